"""The MPI runtime: starting MPI, the world, aborting the job, and the hooks that keep
one rank's failure or early exit from leaving the others waiting."""

import atexit
import os
import sys
import time
import types
from typing import Any

from . import _launch
from ._config import env_flag, settings
from ._errors import LauncherMismatchError, MPIUnavailableError

ABORT_GRACE = 1.0  # seconds between the last words of a failing rank and MPI_Abort

_INSTALL = ("Install one with `pip install 'distop[mpich]'` (the mpich wheel, which also "
            "brings mpiexec), or load your cluster's MPI (e.g. `module load mpi`) and "
            "reinstall mpi4py against it.")

_unavailable = None  # why mpi4py.MPI could not load, once tried
_exit_comm = None  # the duplicate the wait at exit uses, once installed


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

    **Arguments:**
    - `comm`: the communicator to abort.
    - `message`: the text to print (it should name the rank and where it stands).
    """
    sys.stderr.write(message if message.endswith("\n") else message + "\n")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(ABORT_GRACE)
    comm.Abort(1)


def _abort_on_uncaught_exception(comm: Any) -> None:
    """Print an uncaught exception and abort the job, where there are several ranks.

    An uncaught exception on one rank would leave the others waiting in their next
    collective. Installed at `import distop`; `DISTOP_ABORT_ON_EXCEPTION=0` keeps
    Python's own handling.

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
        previous(kind, value, tb)
        abort(comm, f"distop: uncaught {kind.__name__} on rank {comm.Get_rank()}; "
                    f"aborting all {comm.Get_size()} ranks so none waits forever.")

    hook._distop = True  # type: ignore[attr-defined]  # (marks distop's own hook)
    sys.excepthook = hook


def wait_for_peers_at_exit(comm: Any) -> None:
    """Make this rank wait at interpreter exit until every rank reaches its own exit.

    A rank that leaves while the others still run distop programs would otherwise leave
    them waiting forever (or be torn down by the launcher without a word). It waits at
    most as long as the watchdog allows; past that, it says so and aborts the job.
    Installed once, on the first private communicator with several ranks (its duplicate
    is made at the same point everywhere).

    **Arguments:**
    - `comm`: a private communicator, duplicated here for the wait.
    """
    global _exit_comm
    if comm.Get_size() == 1 or _exit_comm is not None:
        return
    _exit_comm = comm.Dup()

    def wait() -> None:
        MPI = mpi()
        if MPI.Is_finalized():
            return
        request = _exit_comm.Ibarrier()
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

    atexit.register(wait)
