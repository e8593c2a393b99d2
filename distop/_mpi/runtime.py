"""The MPI runtime: starting MPI, the world, aborting the job, and the hooks that keep
one rank's failure or early exit from leaving the others waiting, and have it reported
once, by the rank that failed."""

import atexit
import os
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

from .._config import env_flag, settings
from .._errors import LauncherMismatchError, MPIUnavailableError
from . import launch as _launch
from .notices import ABORT_GRACE, Listener, listen, report, reports_elsewhere, say
from .tracebacks import format_exception

_INSTALL = ("Install one with `pip install 'distop[mpich]'` (the mpich wheel, which also "
            "brings mpiexec), or load your cluster's MPI (e.g. `module load mpi`) and "
            "reinstall mpi4py against it.")

_unavailable = None  # why mpi4py.MPI could not load, once tried


def start() -> types.ModuleType | None:
    """Load MPI, checking the launcher against the library before and after `MPI_Init`.

    If mpi4py has not started MPI yet, distop loads `mpi4py.MPI` without starting it,
    checks the environment against the library, then starts it (thread level MULTIPLE:
    callbacks run on XLA's threads). Called at `import distop`.

    **Returns:** the `mpi4py.MPI` module, or None if no MPI library can be loaded.

    **Raises:** `LauncherMismatchError` naming the library, the launcher and the fix.
    """
    global _unavailable
    already = "mpi4py.MPI" in sys.modules
    try:
        # Imported here: loading mpi4py.MPI must wait for the launcher check below.
        import mpi4py

        if not already:
            initialize, finalize = mpi4py.rc.initialize, mpi4py.rc.finalize
            mpi4py.rc.initialize, mpi4py.rc.finalize = False, True
        try:
            from mpi4py import MPI
        finally:
            if not already:
                mpi4py.rc.initialize, mpi4py.rc.finalize = initialize, finalize
    except (ImportError, RuntimeError) as err:
        # mpi4py missing, or it found no MPI library (mpi4py 4 raises RuntimeError where it
        # cannot load the one it chose, ImportError where it has none)
        launcher, started = _launch.detect_launcher(os.environ)
        if started is not None and started > 1 and not _launch.skip():
            raise MPIUnavailableError(
                f"this process is one of {started} started by {launcher}, but mpi4py could "
                f"not load an MPI library ({_one_line(err)}): each would run alone, as "
                f"a one-rank job. {_INSTALL} (DISTOP_SKIP_LAUNCH_CHECK=1 skips this "
                "check.)") from err
        _unavailable = err
        return None
    check = not _launch.skip()
    if not MPI.Is_initialized():
        problem = check and _launch.diagnose(os.environ, MPI.Get_library_version())
        if problem:
            raise LauncherMismatchError(problem + " (DISTOP_SKIP_LAUNCH_CHECK=1 skips "
                                        "this check.)")
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    problem = check and _launch.diagnose(os.environ, MPI.Get_library_version(),
                                         MPI.COMM_WORLD.Get_size())
    if problem:
        raise LauncherMismatchError(problem + " (DISTOP_SKIP_LAUNCH_CHECK=1 skips this "
                                    "check.)")
    _abort_on_uncaught_exception(MPI.COMM_WORLD)
    return MPI


def mpi() -> types.ModuleType:
    """The `mpi4py.MPI` module, or a clear error saying what to install.

    **Returns:** the `mpi4py.MPI` module.

    **Raises:** `MPIUnavailableError` if no MPI library could be loaded.
    """
    module = sys.modules.get("mpi4py.MPI")
    if module is not None and _unavailable is None:
        return module
    raise MPIUnavailableError("this needs MPI, but mpi4py could not load an MPI library "
                              f"({_one_line(_unavailable)}). {_INSTALL}")


def _one_line(err: BaseException | None) -> str:
    """**Returns:** the message of `err` on one line."""
    return " ".join(str(err).split())


class SingleProcess:
    """Stands in for `MPI.COMM_WORLD` when no MPI library can be loaded: one rank.

    Anything that would communicate raises `MPIUnavailableError` saying what to install.
    """

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    rank, size = 0, 1

    def py2f(self) -> int:
        return -1

    def Dup(self) -> "SingleProcess":
        return self

    def allgather(self, value: Any) -> list:
        return [value]

    def Abort(self, code: int = 1) -> None:
        os._exit(code)

    def __getattr__(self, name: str) -> Any:
        mpi()  # raises the clear error
        raise AttributeError(name)


def world() -> Any:
    """The world communicator.

    **Returns:** `MPI.COMM_WORLD`, or a single-process stand-in without MPI.
    """
    if _unavailable is not None:
        return SingleProcess()
    return mpi().COMM_WORLD


def abort(comm: Any, message: str) -> None:
    """Print a message on this rank, then abort the job (every rank).

    It waits `ABORT_GRACE` seconds in between, for the launcher to forward the message:
    MPI_Abort tears the job down at once, and output still on its way would be lost.

    Called while an exception is handled, it reports a failure of this rank's own (see
    `notices.report`): the exception's traceback, where the message holds it as
    `traceback.format_exc()` gives it, is shown without distop's own frames, and the
    other ranks are told, each saying in one line that it stops because of this rank.
    Where other ranks fail the same way at the same time, the lowest prints its message
    and the others one line each.

    **Arguments:**
    - `comm`: the communicator to abort.
    - `message`: the text to print (it should name the rank and where it stands).
    """
    error = sys.exc_info()[1]
    if error is None:
        say(message)
        time.sleep(ABORT_GRACE)
        comm.Abort(1)
        return
    whole = traceback.format_exc()
    if whole in message:
        message = message.replace(whole, format_exception(error))
    report(comm, error, lambda: message, message.split("\n", 1)[0], own=True)


def _abort_on_uncaught_exception(comm: Any) -> None:
    """Print an uncaught exception and abort the job, where there are several ranks.

    An uncaught exception on one rank would leave the others waiting in their next
    collective. Installed at `import distop`; `DISTOP_ABORT_ON_EXCEPTION=0` keeps
    Python's own handling. The traceback is shown without distop's own frames, once:
    ranks that stop because of another rank's failure (distop raises its errors on
    every rank), or that raised the same error as a lower rank, say so in one line
    (see `notices.report`).

    **Arguments:**
    - `comm`: the communicator to abort (the world).
    """
    if comm.Get_size() == 1 or getattr(sys.excepthook, "_distop", False):
        return
    if not env_flag("DISTOP_ABORT_ON_EXCEPTION", True):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException,
             tb: types.TracebackType | None) -> None:
        last = (f"distop: uncaught {kind.__name__} on rank {comm.Get_rank()}; aborting "
                f"all {comm.Get_size()} ranks so none waits forever.")

        def show() -> str:
            if previous is sys.__excepthook__:
                return format_exception(value) + last
            previous(kind, value, tb)  # (a hook of the user's prints it its way)
            return last

        report(comm, value, show, f"{kind.__name__}: {value}",
               own=not reports_elsewhere(value))

    hook._distop = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# -- the runtime's communicator and MPI_Finalize ----------------------------------------
_runtime_comm: Any = None  # the runtime's own communicator, once attached
_listener: Listener | None = None  # receives failure notices on it, where MPI allows


def attach(comm: Any) -> None:
    """Give the runtime a communicator of its own, once: a duplicate of the first private
    communicator with several ranks (made at the same point everywhere).

    On it, every rank waits at interpreter exit until every rank reaches its own exit: a
    rank that leaves while the others still run distop programs would otherwise leave
    them waiting forever (or be torn down by the launcher without a word). It waits at
    most as long as the watchdog allows; past that, it says so and aborts the job. On it
    too, a failing rank tells the others (see `notices.report`), where MPI allows threads
    to call it (`MPI.THREAD_MULTIPLE`, as distop starts it).

    **Arguments:**
    - `comm`: a private communicator, duplicated here.
    """
    global _runtime_comm, _listener
    if comm.Get_size() == 1 or _runtime_comm is not None:
        return
    MPI = mpi()
    _runtime_comm = comm.Dup()
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        _listener = listen(_runtime_comm)
        at_finalize(_listener.close)
    atexit.register(_wait_for_peers)


def _wait_for_peers() -> None:
    """At interpreter exit, wait until every rank reaches its own (see `attach`)."""
    comm = _runtime_comm
    if comm is None or mpi().Is_finalized():
        return
    request = comm.Ibarrier()
    # A little longer than the watchdog, so that a stuck peer's own report comes first.
    limit = settings.watchdog + 2 if settings.watchdog > 0 else float("inf")
    deadline = time.monotonic() + limit
    while not request.Test():
        if time.monotonic() > deadline:
            abort(comm, f"distop: rank {comm.Get_rank()} of {comm.Get_size()} is exiting, "
                        f"but not every rank reached its exit within {limit:g} s: the "
                        "others are stuck or still running. Aborting the job so that "
                        "none waits forever.")
        time.sleep(0.005)
    if _listener is not None:
        _listener.close()


_finalizing: list[Callable[[], None]] = []  # what runs when MPI_Finalize begins
_finalize_key = None


def at_finalize(fn: Callable[[], None]) -> None:
    """Run `fn` when `MPI_Finalize` begins, while MPI still works.

    MPI calls the delete callbacks of `MPI.COMM_SELF`'s attributes first thing there,
    when the program calls `MPI.Finalize()`. (At the interpreter's exit, mpi4py
    finalizes MPI after the `atexit` functions, and runs no Python callback then.)

    **Arguments:**
    - `fn`: a function of no arguments.
    """
    global _finalize_key
    _finalizing.append(fn)
    if _finalize_key is None:
        MPI = mpi()
        _finalize_key = MPI.Comm.Create_keyval(delete_fn=lambda *_: _finalize())
        MPI.COMM_SELF.Set_attr(_finalize_key, _finalizing)


def _finalize() -> None:
    """Run what `at_finalize` was given, last given first."""
    while _finalizing:
        _finalizing.pop()()
