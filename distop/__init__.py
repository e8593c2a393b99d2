"""distop: differentiable distributed operators for JAX, ordered the same on every rank."""

import importlib.metadata as _metadata

from . import _compat
from . import linalg as linalg
from ._collectives.basic import Allgather as Allgather
from ._collectives.basic import AllreduceSum as AllreduceSum
from ._collectives.basic import Alltoall as Alltoall
from ._collectives.basic import Broadcast as Broadcast
from ._collectives.basic import RankLocal as RankLocal
from ._collectives.basic import Split as Split
from ._collectives.halo import HaloExchange as HaloExchange
from ._collectives.reductions import Allreduce as Allreduce
from ._collectives.reductions import Exscan as Exscan
from ._collectives.reductions import Scan as Scan
from ._collectives.rooted import Gather as Gather
from ._collectives.rooted import Reduce as Reduce
from ._collectives.rooted import Scatter as Scatter
from ._compiler.schedule import ScheduleEntry as ScheduleEntry
from ._config import Settings as Settings
from ._config import configure as configure
from ._diagnostics.profile import Profile as Profile
from ._diagnostics.report import Report as Report
from ._errors import CollectiveMismatchError as CollectiveMismatchError
from ._errors import ConvergenceError as ConvergenceError
from ._errors import DerivativeCheckError as DerivativeCheckError
from ._errors import DistopError as DistopError
from ._errors import KindError as KindError
from ._errors import KindWarning as KindWarning
from ._errors import LauncherMismatchError as LauncherMismatchError
from ._errors import MissingMethodError as MissingMethodError
from ._errors import MPIUnavailableError as MPIUnavailableError
from ._errors import OperatorError as OperatorError
from ._errors import OrderedEffectError as OrderedEffectError
from ._errors import ScheduleMismatchError as ScheduleMismatchError
from ._errors import SecondDerivativeError as SecondDerivativeError
from ._inference.transform import with_kinds as with_kinds
from ._mpi import runtime as _runtime
from ._operators.implicit import ImplicitOperator as ImplicitOperator
from ._operators.kinds import Kind as Kind
from ._operators.operator import DistributedOperator as DistributedOperator
from ._problem.problem import Problem as Problem
from ._problem.problem import empty as empty
from ._problem.shard import shard as shard
from ._totals.operator_check import OperatorCheck as OperatorCheck
from ._totals.operator_check import check_operator as check_operator
from ._totals.totals import TotalsCheck as TotalsCheck

# the public names, re-exported above
__all__ = [
    "Allgather", "Allreduce", "AllreduceSum", "Alltoall", "Broadcast",
    "CollectiveMismatchError", "ConvergenceError", "DerivativeCheckError",
    "DistopError", "DistributedOperator", "Exscan", "Gather", "HaloExchange",
    "ImplicitOperator", "Kind", "KindError", "KindWarning", "LauncherMismatchError",
    "MPIUnavailableError", "MissingMethodError", "OperatorCheck", "OperatorError",
    "OrderedEffectError", "Problem", "Profile", "RankLocal", "Reduce", "Report", "Scan",
    "Scatter", "ScheduleEntry", "ScheduleMismatchError", "SecondDerivativeError",
    "Settings", "Split", "TotalsCheck", "check_operator", "configure", "empty",
    "linalg", "shard", "with_kinds",
]

try:
    __version__ = _metadata.version("distop")
except _metadata.PackageNotFoundError:  # (a source tree on sys.path, not installed)
    __version__ = "0+unknown"

# Host calls run fastest on the caller's thread (see _compat.prefer_inline_execution).
_compat.prefer_inline_execution()

# Check the launcher against the MPI library before mpi4py starts MPI (nothing above
# starts it), then start it.
_runtime.start()
