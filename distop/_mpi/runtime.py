"""The MPI runtime: starting MPI, the world, aborting the job, and the hooks that keep
one rank's failure or early exit from leaving the others waiting, and have it reported
once, by the rank that failed."""

import atexit
import hashlib
import json
import os
import re
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .._config import env_flag, settings
from .._errors import (
    CollectiveMismatchError,
    LauncherMismatchError,
    MPIUnavailableError,
    ScheduleMismatchError,
)
from . import launch as _launch
from .tracebacks import format_exception

ABORT_GRACE = 1.0  # seconds between the last words of a failing rank and MPI_Abort

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
    `_report`): the exception's traceback, where the message holds it as
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
        _say(message)
        time.sleep(ABORT_GRACE)
        comm.Abort(1)
        return
    whole = traceback.format_exc()
    if whole in message:
        message = message.replace(whole, format_exception(error))
    _report(comm, error, lambda: message, message.split("\n", 1)[0], own=True)


def _abort_on_uncaught_exception(comm: Any) -> None:
    """Print an uncaught exception and abort the job, where there are several ranks.

    An uncaught exception on one rank would leave the others waiting in their next
    collective. Installed at `import distop`; `DISTOP_ABORT_ON_EXCEPTION=0` keeps
    Python's own handling. The traceback is shown without distop's own frames, once:
    ranks that stop because of another rank's failure (distop raises its errors on
    every rank), or that raised the same error as a lower rank, say so in one line
    (see `_report`).

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

        _report(comm, value, show, f"{kind.__name__}: {value}",
                own=not _reports_elsewhere(value))

    hook._distop = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# -- failure reports ------------------------------------------------------------------
# A failing rank tells the others, on the runtime's communicator (see `attach`), in a
# notice, which a thread of each rank receives. Ranks that stop because of it print one
# line naming it instead of a traceback of their own. A notice goes to rank 0, the relay,
# which passes on, at most once per look, the news: the lowest notice of each kind of
# failure and which ranks sent one (see `_Listener`). So a failure of every rank at once
# sends a number of messages linear in the number of ranks.
NOTICE_WAIT = 2.0  # seconds a failing rank waits for the notices of lower ranks failing too
ELSEWHERE_WAIT = 5.0  # seconds a rank reporting another's failure waits for that rank's
_NOTICE_TAG = 1  # (the runtime's communicator carries no other point-to-point message)
_NOTICE_BYTES = 1024
_NEWS_BYTES = 1 << 16  # the most a relay's news takes (see `_news`)
# the first line of an operator's failure as distop reports it, after "distop: " or the
# exception's name
_FAILED = re.compile(r"(?:[\w.]+: )?([A-Za-z_]\w*\.[A-Za-z_]\w*) on rank \d+: ")

_runtime_comm: Any = None  # the runtime's own communicator, once attached
_listener: "_Listener | None" = None
_heard: list["_Notice"] = []  # the notices received, in order of arrival, one per rank
_failed: set[int] = set()  # the ranks known to have sent a notice (some only by the news)
_arrived: dict[int, float] = {}  # rank -> when its first notice arrived (monotonic)
_reporting = False  # this rank reports a failure: its listener prints nothing
_said = False  # this rank printed its line on another rank's failure
_said_lock = threading.Lock()  # (the listener's thread may say it too)
_sent: list = []  # the requests of the notices sent (kept until MPI_Abort)


class _Notice(NamedTuple):
    """What a failing rank tells the others."""

    rank: int  # on the runtime's communicator
    own: bool  # a failure of its own, not distop's report of one elsewhere
    same: str  # a digest of the error, alike for the same error on any rank
    what: str  # e.g. "failed in Cube.vjp", to follow "rank 3"


def _report(comm: Any, error: BaseException, show: Callable[[], str], summary: str,
            own: bool) -> None:
    """Report this rank's failure once across the ranks, then abort the job.

    It sends a notice to the relay (see `_send`), then waits a moment for those of the ranks
    that fail at the same time (see `_first`): a rank whose error is distop's report of
    a failure elsewhere (`own` False) defers to a rank that failed on its own, and a
    rank defers to a lower one that failed with the same error. A rank that defers
    prints one line naming that rank; the others print what `show` gives.

    **Arguments:**
    - `comm`: the communicator to abort.
    - `error`: the exception.
    - `show`: gives the text to print where this rank does not defer (it may print
      some of it itself).
    - `summary`: the error's message, for the notice (its first line names the
      operator's method that failed, where one did).
    - `own`: whether the error is a failure of this rank's own.
    """
    global _reporting
    _reporting = True
    runtime = _runtime_comm
    mine = _Notice(-1, own, _digest(error, summary), _what(error, summary))
    first = None
    if runtime is not None and _listener is not None:
        mine = mine._replace(rank=runtime.Get_rank())
        _send(runtime, mine)
        first = _first(mine, runtime.Get_size())
    if first is None:
        _say(show())
        time.sleep(ABORT_GRACE)
    else:
        if first.own and not own:
            _stopped(first)
        else:
            _stopped(first, f"it {mine.what}, as rank {first.rank} did (see rank "
                            f"{first.rank}'s traceback)")
        time.sleep(3 * ABORT_GRACE)  # (the reporting rank's MPI_Abort ends the job first)
    comm.Abort(1)


def _first(mine: _Notice, size: int) -> _Notice | None:
    """Wait for the notices of other ranks failing at the same time as this one.

    A rank that failed on its own waits for the lower ranks, at most `NOTICE_WAIT`
    seconds, or as long as the lowest rank heard to fail alike waits for its own lower
    ranks (it defers to one of them failing alike meanwhile). A rank whose error reports
    a failure elsewhere waits for the rank that failed, at most `ELSEWHERE_WAIT` seconds
    (it may be busy printing, or slow), and for no one once every other rank has sent
    its notice.

    **Arguments:**
    - `mine`: this rank's own notice.
    - `size`: the number of ranks.

    **Returns:** the notice of the rank this one defers to, or None.
    """
    deadline = time.monotonic() + (NOTICE_WAIT if mine.own else ELSEWHERE_WAIT)
    while True:
        # (the news may tell this rank of its own notice)
        heard = [h for h in _heard if h.rank != mine.rank]
        ranks = _failed - {mine.rank}
        if not mine.own:
            origin = _lowest(h for h in heard if h.own)
            if origin is not None:
                return origin
        same = _lowest(h for h in heard if h.rank < mine.rank and h.own == mine.own
                       and h.same == mine.same)
        if mine.own and same is not None:
            if set(range(same.rank)) <= ranks:  # no rank below it can fail alike unheard
                return same
            # That rank waits for the ranks below it as long as this one may, and defers
            # to one of them that fails alike meanwhile: so wait as long as it does.
            deadline = max(deadline, _arrived.get(same.rank, 0.0) + NOTICE_WAIT + 0.5)
        done = (len(ranks & set(range(mine.rank))) == mine.rank if mine.own
                else len(ranks) >= size - 1)
        if done or time.monotonic() > deadline:
            return same
        time.sleep(0.01)


def _reports_elsewhere(error: BaseException) -> bool:
    """**Returns:** whether `error` is distop's report of a failure on another rank, or
    of a disagreement of every rank: raised alike on the ranks that did not fail
    themselves. (In the checking mode, the rank whose operator failed raises the report
    too, its own failure first.)"""
    if not (isinstance(error, (CollectiveMismatchError, ScheduleMismatchError))
            or getattr(error, "elsewhere", False)):
        return False
    return _operator(f"{type(error).__name__}: {error}") is None


def _operator(summary: str) -> str | None:
    """**Returns:** the operator and method a rank's error reports as failing on that
    rank ("Cube.vjp" for "Cube.vjp on rank 3: raised ...", distop's words for it), or
    None."""
    found = _FAILED.match(summary.split("\n", 1)[0])
    return found[1] if found else None


def _digest(error: BaseException, summary: str) -> str:
    """**Returns:** a digest of an error, the same for the same error on any rank
    (rank numbers in its message left out)."""
    text = re.sub(r"\b[Rr]ank \d+", "rank", f"{type(error).__name__} {summary}")
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:16]


def _what(error: BaseException, summary: str) -> str:
    """**Returns:** where a rank failed, to follow "rank 3": "failed in Cube.vjp", or
    "raised ValueError" where no operator's method failed."""
    where = _operator(summary)
    return f"failed in {where}" if where else f"raised {type(error).__name__}"


def _send(comm: Any, notice: _Notice) -> None:
    """Send `notice` to the relay, rank 0 of `comm` (the relay itself: to every other
    rank), without waiting for delivery."""
    data = json.dumps(notice._asdict()).encode()[:_NOTICE_BYTES]
    _post(comm, data, [0] if notice.rank != 0 else range(1, comm.Get_size()))


def _post(comm: Any, data: bytes, ranks: Iterable[int]) -> None:
    """Send `data` to `ranks` of `comm` as a notice, without waiting for delivery."""
    MPI = mpi()
    for rank in ranks:
        _sent.append(comm.Isend([data, MPI.BYTE], dest=rank, tag=_NOTICE_TAG))


def _learn(notice: _Notice) -> bool:
    """Keep `notice`, the first of its rank; **Returns:** whether it is new."""
    if any(h.rank == notice.rank for h in _heard):
        return False
    _heard.append(notice)
    _failed.add(notice.rank)
    _arrived.setdefault(notice.rank, time.monotonic())
    return True


def _read(data: bytes, source: int) -> list[_Notice]:
    """**Returns:** the notices of a message from rank `source`: a notice, or a relay's
    news (whose list of ranks joins `_failed`)."""
    try:
        found = json.loads(data)
        if "notices" not in found:
            return [_Notice(**found)]
        for first, last in found["ranks"]:
            _failed.update(range(first, last + 1))
        return [_Notice(**notice) for notice in found["notices"]]
    except (ValueError, TypeError, KeyError):  # (cut short: the sender's own words stand)
        return [_Notice(source, True, "", "failed")]


def _news() -> bytes:
    """**Returns:** what the relay passes on: the lowest notice of each kind (own or
    not, and the error's digest) and the ranks that sent one, as runs."""
    lowest: dict[tuple, _Notice] = {}
    for notice in _heard:
        kind = (notice.own, notice.same)
        if kind not in lowest or notice.rank < lowest[kind].rank:
            lowest[kind] = notice
    runs: list[list[int]] = []
    for rank in sorted(_failed):
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    notices = sorted(lowest.values(), key=lambda notice: notice.rank)
    data = json.dumps({"notices": [n._asdict() for n in notices], "ranks": runs}).encode()
    if len(data) > _NEWS_BYTES:  # (the lowest notices only: the others wait their time)
        data = json.dumps({"notices": [n._asdict() for n in notices[:8]],
                           "ranks": []}).encode()
    return data[:_NEWS_BYTES]


def _say(text: str) -> None:
    """Print `text` (and a newline if it has none) to stderr, and flush both streams."""
    sys.stdout.flush()
    sys.stderr.write(text if text.endswith("\n") else text + "\n")
    sys.stderr.flush()


def _lowest(notices: Iterable[_Notice]) -> _Notice | None:
    """**Returns:** the notice of the lowest rank among `notices`, or None."""
    return min(notices, key=lambda notice: notice.rank, default=None)


def _stopped(notice: _Notice, why: str | None = None) -> None:
    """Say, once, that this rank stops because of the failure of the rank of `notice`.

    **Arguments:**
    - `notice`: that rank's notice.
    - `why`: the reason, after "stopped: "; by default that rank's failure.
    """
    global _said
    with _said_lock:
        if _said:
            return
        _said = True
    why = why or f"rank {notice.rank} {notice.what} (see its traceback)"
    _say(f"distop: rank {_runtime_comm.Get_rank()} of {_runtime_comm.Get_size()} "
         f"stopped: {why}.")


class _Listener:
    """Receives the notices of failing ranks, on a thread of its own.

    It polls one posted receive a few times a second: a blocking receive would keep a
    core busy (MPI libraries wait by polling), and a rank that stops because of another
    is most often waiting in a collective, where no other code of it runs.

    **Arguments:**
    - `comm`: the runtime's communicator.
    """

    POLL = 0.1  # seconds between two looks

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.relays = comm.Get_rank() == 0
        self.buffer = bytearray(_NEWS_BYTES)
        self.request = self._post()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="distop-notices", daemon=True)
        self.thread.start()

    def _post(self) -> Any:
        MPI = mpi()
        return self.comm.Irecv([self.buffer, MPI.BYTE], source=MPI.ANY_SOURCE,
                               tag=_NOTICE_TAG)

    def _run(self) -> None:
        status = mpi().Status()
        since = float("inf")  # when the first notice of a rank that failed on its own came
        while not self.stop.wait(self.POLL):
            fresh = False
            while self.request.Test(status):
                data = bytes(self.buffer[:status.Get_count(mpi().BYTE)])
                self.request = self._post()
                for notice in _read(data, status.Get_source()):
                    fresh = _learn(notice) or fresh
                    if notice.own:
                        since = min(since, time.monotonic())
            if fresh and self.relays:  # (the news of this look, to every other rank)
                _post(self.comm, _news(), range(1, self.comm.Get_size()))
            # A rank not reporting a failure itself names the failed rank that prints its
            # traceback: the lowest of those failing together (see `_first`).
            failed = _lowest(h for h in _heard if h.own)
            if failed is not None and not _reporting and time.monotonic() > since + NOTICE_WAIT:
                _stopped(failed)

    def close(self) -> None:
        """Stop the thread and withdraw the posted receive (before MPI_Finalize)."""
        if self.stop.is_set():
            return
        self.stop.set()
        self.thread.join()
        self.request.Cancel()
        self.request.Wait()


# -- the runtime's communicator and MPI_Finalize ----------------------------------------
def attach(comm: Any) -> None:
    """Give the runtime a communicator of its own, once: a duplicate of the first private
    communicator with several ranks (made at the same point everywhere).

    On it, every rank waits at interpreter exit until every rank reaches its own exit: a
    rank that leaves while the others still run distop programs would otherwise leave
    them waiting forever (or be torn down by the launcher without a word). It waits at
    most as long as the watchdog allows; past that, it says so and aborts the job. On it
    too, a failing rank tells the others (see `_report`), where MPI allows threads to
    call it (`MPI.THREAD_MULTIPLE`, as distop starts it).

    **Arguments:**
    - `comm`: a private communicator, duplicated here.
    """
    global _runtime_comm, _listener
    if comm.Get_size() == 1 or _runtime_comm is not None:
        return
    MPI = mpi()
    _runtime_comm = comm.Dup()
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        _listener = _Listener(_runtime_comm)
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
