"""distop: differentiable distributed operators for JAX, ordered the same on every rank."""

import importlib.metadata

from ._errors import DistopError as DistopError
from ._errors import MPIUnavailableError as MPIUnavailableError
from ._errors import OperatorError as OperatorError
from ._errors import ScheduleMismatchError as ScheduleMismatchError
from ._operator import DistributedOperator as DistributedOperator

__version__ = importlib.metadata.version("distop")
from ._problem import Problem as Problem
from ._schedule import ScheduleEntry as ScheduleEntry
