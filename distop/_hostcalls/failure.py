"""The failure policy of host calls: how a method's error reaches every rank and the
caller.

Under MPI a failing call cannot simply raise: the other ranks may already wait in a
collective. It tells them (the checking mode) or aborts the job with a report (see
`_mpi.runtime.abort`); in one process, or once reported, the error is raised and kept
for `Problem` to raise as itself instead of XLA's wrapped runtime error.
"""

import sys
import threading
import traceback
from typing import Any, NoReturn

from .._errors import CollectiveMismatchError, MPIUnavailableError, OperatorError, operator_error
from .._mpi.runtime import abort

# The exception raised inside the last failing callback, so that `Problem` can re-raise
# it as itself instead of XLA's wrapped runtime error. Callbacks run on XLA threads.
_last_error: BaseException | None = None
_error_lock = threading.Lock()


def take_error() -> BaseException | None:
    """**Returns:** the exception raised by the last failing callback (once), or None."""
    global _last_error
    with _error_lock:
        err, _last_error = _last_error, None
    return err


def _is_mpi_error(err: BaseException) -> bool:
    """**Returns:** whether `err` is mpi4py's `MPI.Exception` (an error of MPI itself)."""
    module = sys.modules.get("mpi4py.MPI")
    return module is not None and isinstance(err, module.Exception)


def fail(call: Any, err: BaseException) -> NoReturn:
    """Report `err`, raised in `call` (a `HostCall`), as every rank must learn of it (see
    the guide's errors section), and raise it."""
    global _last_error
    if isinstance(err, MPIUnavailableError):  # (no MPI: a single process)
        err = MPIUnavailableError(call.say(str(err)))
        err.__cause__ = sys.exc_info()[1]
    elif not isinstance(err, (OperatorError, CollectiveMismatchError)):
        # (a message that cannot be encoded, a lone surrogate in it, say, would fail
        # again where XLA takes it: shown escaped instead)
        text = f"raised {type(err).__name__}: {err}"
        if _is_mpi_error(err):
            text += (". An MPI error inside a method: most often the ranks' collectives "
                     "did not match (one rank made a collective the others did not, or "
                     "with other sizes). Run with DISTOP_CHECK_COLLECTIVES=1 (the checking "
                     "mode) to find the call where the ranks part")
        elif isinstance(err, ValueError) and "read-only" in str(err):
            text += (". The arrays a method receives are read-only by design: they are "
                     "XLA's buffers, shared without a copy. Copy one first (x = x.copy()) "
                     "to change it")
        err = operator_error(call.say(
            text.encode("utf-8", "backslashreplace").decode("utf-8")), err)
        err.__cause__ = sys.exc_info()[1]
    size = call.comm.Get_size() if call.comm is not None else 1
    if call.checker is not None and not isinstance(err, CollectiveMismatchError):
        # Checking mode: tell the other ranks (they meet this message at their next
        # check), so that every rank raises instead of aborting the job. Nothing is
        # printed: the error reaches the caller with its cause, the method's traceback,
        # and a caller that catches it sees no output.
        try:
            call.checker.check_same(("failed", call.where))
        except CollectiveMismatchError as mismatch:
            failed, err = err, CollectiveMismatchError(f"{err}\n{mismatch}")
            err.__cause__ = failed.__cause__ or failed  # (the method's traceback)
    elif size > 1 and not isinstance(err, CollectiveMismatchError):
        # The other ranks may already wait in a collective (this operator's or a later
        # one) and cannot be told: report where we stand and end the job, never hang.
        abort(call.comm, f"distop: {err}\n{traceback.format_exc()}"
                         f"distop: aborting all {size} ranks.")
    with _error_lock:
        _last_error = err
    raise err
