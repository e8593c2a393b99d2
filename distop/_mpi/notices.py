"""Failure notices: how the ranks tell each other of a failure, so that it is reported
once, by the rank that failed, and the others say in one line why they stop.

A failing rank tells the others, on the runtime's communicator (see `runtime.attach`),
in a notice, which a thread of each rank receives (`Listener`). Ranks that stop because
of it print one line naming it instead of a traceback of their own. A notice goes to
rank 0, the relay, which passes on, at most once per look, the news: the lowest notice
of each kind of failure and which ranks sent one. So a failure of every rank at once
sends a number of messages linear in the number of ranks.

Imports only `_errors` of the package."""

import hashlib
import json
import re
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .._errors import CollectiveMismatchError, ScheduleMismatchError

ABORT_GRACE = 1.0  # seconds between the last words of a failing rank and MPI_Abort
NOTICE_WAIT = 2.0  # seconds a failing rank waits for the notices of lower ranks failing too
ELSEWHERE_WAIT = 5.0  # seconds a rank reporting another's failure waits for that rank's
_NOTICE_TAG = 1  # (the runtime's communicator carries no other point-to-point message)
_NOTICE_BYTES = 1024
_NEWS_BYTES = 1 << 16  # the most a relay's news takes (see `_news`)
# the first line of an operator's failure as distop reports it, after "distop: " or the
# exception's name
_FAILED = re.compile(r"(?:[\w.]+: )?([A-Za-z_]\w*\.[A-Za-z_]\w*) on rank \d+: ")

_comm: Any = None  # the runtime's communicator, once a listener receives notices on it
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


def report(comm: Any, error: BaseException, show: Callable[[], str], summary: str,
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
    runtime = _comm
    mine = _Notice(-1, own, _digest(error, summary), _what(error, summary))
    first = None
    if runtime is not None:
        mine = mine._replace(rank=runtime.Get_rank())
        _send(runtime, mine)
        first = _first(mine, runtime.Get_size())
    if first is None:
        say(show())
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


def reports_elsewhere(error: BaseException) -> bool:
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
    MPI = _mpi_module()
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


def say(text: str) -> None:
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
    say(f"distop: rank {_comm.Get_rank()} of {_comm.Get_size()} "
         f"stopped: {why}.")


class Listener:
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
        MPI = _mpi_module()
        return self.comm.Irecv([self.buffer, MPI.BYTE], source=MPI.ANY_SOURCE,
                               tag=_NOTICE_TAG)

    def _run(self) -> None:
        status = _mpi_module().Status()
        since = float("inf")  # when the first notice of a rank that failed on its own came
        while not self.stop.wait(self.POLL):
            fresh = False
            while self.request.Test(status):
                data = bytes(self.buffer[:status.Get_count(_mpi_module().BYTE)])
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


def listen(comm: Any) -> Listener:
    """Receive the notices of failing ranks on `comm`, and send this rank's there where
    it fails (see `report`).

    **Arguments:**
    - `comm`: the runtime's communicator, on which MPI allows threads to call it.

    **Returns:** the listener, to close before `MPI_Finalize`.
    """
    global _comm
    listener = Listener(comm)
    _comm = comm
    return listener


def _mpi_module() -> types.ModuleType:
    """**Returns:** the `mpi4py.MPI` module, started by now: only a rank that listens sends
    or receives notices."""
    from mpi4py import MPI  # (imported here: loading it waits for the launcher check)

    return MPI
