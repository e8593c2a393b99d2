"""Calls of one Problem one at a time: each entry point under the Problem's lock."""

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from .._agreement import comm as _comm
from .._diagnostics import profile as _profile

Arguments = ParamSpec("Arguments")
Result = TypeVar("Result")


def one_at_a_time(method: Callable[Concatenate[Any, Arguments], Result],
                  ) -> Callable[Concatenate[Any, Arguments], Result]:
    """`method` under its Problem's lock: threads calling one Problem take turns, each
    call whole (its agreement, programs, point and token are the Problem's own). A
    Problem whose communicator was freed raises a `DistopError` saying so."""
    @functools.wraps(method)
    def locked(self: Any, *args: Arguments.args, **kwargs: Arguments.kwargs) -> Result:
        with self._lock:
            _comm.check_live(self.comm)  # (freed with the user's: a DistopError, alike)
            profile = _profile.active
            if profile is None:
                return method(self, *args, **kwargs)
            profile.entered()  # (the time between entries is the caller's own)
            try:
                return method(self, *args, **kwargs)
            finally:
                profile.left(method.__name__)
    return locked
