"""distop: differentiable distributed operators for JAX, ordered the same on every rank."""

import importlib.metadata

from . import _compat, _runtime
from ._collectives import Allgather as Allgather
from ._collectives import AllreduceSum as AllreduceSum
from ._collectives import Alltoall as Alltoall
from ._collectives import Broadcast as Broadcast
from ._collectives import RankLocal as RankLocal
from ._collectives import Split as Split
from ._config import configure as configure
from ._errors import CollectiveMismatchError as CollectiveMismatchError
from ._errors import DerivativeCheckError as DerivativeCheckError
from ._errors import DistopError as DistopError
from ._errors import LauncherMismatchError as LauncherMismatchError
from ._errors import MissingMethodError as MissingMethodError
from ._errors import MPIUnavailableError as MPIUnavailableError
from ._errors import OperatorError as OperatorError
from ._errors import OrderedEffectError as OrderedEffectError
from ._errors import ScheduleMismatchError as ScheduleMismatchError
from ._errors import SecondDerivativeError as SecondDerivativeError
from ._halo import HaloExchange as HaloExchange
from ._implicit import ImplicitOperator as ImplicitOperator
from ._operator import DistributedOperator as DistributedOperator
from ._operator_check import OperatorCheck as OperatorCheck
from ._operator_check import check_operator as check_operator
from ._problem import Problem as Problem
from ._problem import empty as empty
from ._reductions import Allreduce as Allreduce
from ._reductions import Exscan as Exscan
from ._reductions import Scan as Scan
from ._rooted import Gather as Gather
from ._rooted import Reduce as Reduce
from ._rooted import Scatter as Scatter
from ._schedule import ScheduleEntry as ScheduleEntry
from ._totals import TotalsCheck as TotalsCheck
from ._totals import shard as shard

__version__ = importlib.metadata.version("distop")

# Host calls run fastest on the caller's thread (see _compat.prefer_inline_execution).
_compat.prefer_inline_execution()

# Check the launcher against the MPI library before mpi4py starts MPI (nothing above
# starts it), then start it.
_runtime.start()
