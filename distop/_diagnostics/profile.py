"""Profiles: where each rank's time goes, host call by host call.

While a `Profile` is active (`with problem.profile() as prof:`), every host call a
program makes records its wall time and the time its method spends inside MPI calls
(through a `TimedComm` wrapped around the communicator the method receives), and every
program run records its own wall time once it has finished; the rest of a run is JAX's
time between host calls. Nothing is recorded otherwise: a host call reads `active`
once and finds None.
"""

import dataclasses
import time
from typing import Any

from .._errors import DistopError
from .._mpi import runtime as _runtime
from .._mpi.names import COMMUNICATING, MAKERS
from .._safety import watchdog as _watchdog
from . import report as _profile_report

_now = time.perf_counter_ns

# The recorder of the active profile, read by every host call and program run; None
# while no profile is active (one per process: programs run one at a time).
active: "Recorder | None" = None


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One host call's method, as one rank ran it (times in ns since the profile began).

    Fields: `run` (the program run it belongs to, an index into `Profile.runs`; -1 for
    a call outside any), `position` (its place among the run's method calls: the same
    on every rank), `operator` (class name), `phase` (as users know it: `forward`,
    `vjp`, an implicit operator's `solve` ...), `start`, `end`, `wait` (ns inside MPI
    calls), `collectives` ((name, start, end) per MPI call).
    """

    run: int
    position: int
    operator: str
    phase: str
    start: int
    end: int
    wait: int
    collectives: tuple[tuple[str, int, int], ...]


@dataclasses.dataclass(frozen=True)
class WaitRecord:
    """One wait of distop's own for the other ranks (an agreement, a check), outside any
    method, as one rank made it: `where` (the step, as the watchdog names it), `run`
    (the program run it was in, -1 for none), `start` and `end` (ns since the profile
    began)."""

    where: str
    run: int
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class EntryRecord:
    """One call of a Problem's entry point (`run`, `compute_totals` ...), whole: its
    agreement, programs and all, `start` and `end` (ns since the profile began). The
    time between entries is the caller's own."""

    entry: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One program run, as one rank ran it: its entry point (`run`, `compute_totals`
    ...), `start` and `end` (ns since the profile began, the end once it finished)."""

    entry: str
    start: int
    end: int


class TimedComm:
    """A communicator that times every MPI call a method makes through it.

    Each communicating call appends `(name, start, end)` (ns since the profile began)
    to `slices`; anything else is the wrapped communicator's own. Communicators made
    from it are timed too, into the same `slices`. A non-blocking call is timed as it
    starts; its wait on the request counts as the method's compute.

    **Arguments:**
    - `comm`: the communicator the method would receive (`GuardedComm`, watched).
    - `origin`: `time.perf_counter_ns()` when the profile began.
    - `root`: the `TimedComm` this one was made from (whose `slices` it fills); None
      for itself.
    """

    def __init__(self, comm: Any, origin: int, root: "TimedComm | None" = None) -> None:
        self._comm, self._origin = comm, origin
        self._root = self if root is None else root
        self.slices: list[tuple[str, int, int]] = []

    def __getattr__(self, name: str) -> Any:
        if name in ("_comm", "_origin", "_root", "slices"):  # (not set yet: a copy)
            raise AttributeError(name)
        found = getattr(self._comm, name)
        if name not in COMMUNICATING or not callable(found):
            return found
        root, origin = self._root, self._origin

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = _now()
            try:
                return found(*args, **kwargs)
            finally:
                root.slices.append((name, start - origin, _now() - origin))

        if name in MAKERS:
            def making(*args: Any, **kwargs: Any) -> Any:
                made = timed(*args, **kwargs)
                if not hasattr(made, "Get_size") or made == _runtime.mpi().COMM_NULL:
                    return made
                return TimedComm(made, origin, root)
            self.__dict__[name] = making
            return making
        self.__dict__[name] = timed  # later calls find it without `__getattr__`
        return timed

    def __repr__(self) -> str:
        return f"TimedComm({self._comm!r})"


class Recorder:
    """What one rank records while a profile is active.

    **Arguments:**
    - `origin`: `time.perf_counter_ns()` when the profile began (after a barrier).
    """

    def __init__(self, origin: int) -> None:
        self.origin = origin
        self.calls: list[CallRecord] = []
        self.runs: list[RunRecord] = []
        self.waits: list[WaitRecord] = []
        self.entries: list[EntryRecord] = []
        self._run, self._run_start, self._position = -1, 0, 0
        # id(call) -> (the call, its timed communicator, when it started)
        self._open: dict[int, tuple[Any, TimedComm, int]] = {}
        self._current: TimedComm | None = None  # the method running now, if one is
        self._waiting, self._wait_start = 0, 0  # nested distop waits, the outermost's start
        self._entered, self._entry_start = 0, 0  # nested entry points, the outermost's

    def wait_started(self) -> None:
        """Mark a wait of distop's own for the peers (`Watchdog.watch`) as starting."""
        if self._waiting == 0:
            self._wait_start = _now()
        self._waiting += 1

    def wait_ended(self, where: str) -> None:
        """Record the wait `wait_started` began, in step `where`: the running method's
        wait where one runs, else distop's own."""
        self._waiting -= 1
        if self._waiting:
            return
        start, end = self._wait_start - self.origin, _now() - self.origin
        if self._current is not None:
            self._current.slices.append((f"distop: {where}", start, end))
        else:
            self.waits.append(WaitRecord(where, self._run, start, end))

    def entered(self) -> None:
        """Mark a call of an entry point as starting (nested ones count as one)."""
        if self._entered == 0:
            self._entry_start = _now()
        self._entered += 1

    def left(self, entry: str) -> None:
        """Record the call of entry point `entry` that `entered` began as ended."""
        self._entered -= 1
        if self._entered == 0:
            self.entries.append(EntryRecord(entry, self._entry_start - self.origin,
                                            _now() - self.origin))

    def started(self, call: Any) -> TimedComm:
        """Mark `call` (a `HostCall`) as starting now.

        **Arguments:**
        - `call`: the host call; its `guarded` communicator is what gets timed.

        **Returns:** the communicator to hand its method.
        """
        found = self._open.get(id(call))
        timed = TimedComm(call.guarded, self.origin) if found is None else found[1]
        timed.slices = []
        self._open[id(call)] = (call, timed, _now())
        self._current = timed
        return timed

    def ended(self, call: Any) -> None:
        """Record `call`, started with `started`, as ending now.

        **Arguments:**
        - `call`: the host call.
        """
        end = _now()
        _, timed, start = self._open[id(call)]
        self._current = None
        slices = tuple(timed.slices)
        self.calls.append(CallRecord(
            self._run, self._position, type(call.op).__name__, call.label,
            start - self.origin, end - self.origin, sum(e - s for _, s, e in slices),
            slices))
        self._position += 1

    def program_started(self, entry: str) -> None:
        """Mark a program run of entry point `entry` as starting now."""
        self._run, self._position = len(self.runs), 0
        self._run_start = _now()

    def program_ended(self, entry: str) -> None:
        """Record the program run started last as finished now."""
        self.runs.append(RunRecord(entry, self._run_start - self.origin,
                                   _now() - self.origin))
        self._run = -1


class Profile:
    """Per-rank times of a Problem's host calls while active; made by `Problem.profile`.

    A context manager: entering it and everything that reads it across ranks
    (`report`, `print_report`, `write_trace`, `plot`) are collective on the Problem's
    communicator. It records every distop program the process runs while active.

    **Arguments:**
    - `comm`: the Problem's private communicator.

    Attributes (this rank's, filled once the profile has ended): `calls` (a
    `CallRecord` per method call, in order), `runs` (a `RunRecord` per program run),
    `waits` (a `WaitRecord` per wait of distop's own outside the methods), `entries`
    (an `EntryRecord` per call of an entry point) and `span` (ns from the start of the
    profile to its end).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.calls: tuple[CallRecord, ...] = ()
        self.runs: tuple[RunRecord, ...] = ()
        self.waits: tuple[WaitRecord, ...] = ()
        self.entries: tuple[EntryRecord, ...] = ()
        self.span = 0
        self._recorder: Recorder | None = None
        self._report: _profile_report.Report | None = None
        self._ended = False

    def __enter__(self) -> "Profile":
        global active
        if active is not None:
            raise DistopError("Problem.profile(): another profile is active in this "
                              "process. End it first (profiles do not nest).")
        if self._recorder is not None:
            raise DistopError("Problem.profile(): this profile was used already; make a "
                              "new one with problem.profile().")
        # one clock origin on every rank, as close together as a barrier allows
        with _watchdog.watchdog.watch("Problem.profile: starting on every rank"):
            self.comm.Barrier()
        self._recorder = active = _watchdog.watchdog.timing = Recorder(_now())
        return self

    def __exit__(self, *exc: object) -> None:
        global active
        active = _watchdog.watchdog.timing = None
        recorder = self._recorder
        if recorder is not None:
            self.calls, self.runs = tuple(recorder.calls), tuple(recorder.runs)
            self.waits, self.entries = tuple(recorder.waits), tuple(recorder.entries)
            self.span = _now() - recorder.origin
        self._ended = True

    def _check_ended(self, what: str) -> None:
        if not self._ended:
            raise DistopError(f"Profile.{what}(): the profile is still recording. Call it "
                              "after the `with problem.profile() as prof:` block.")

    def report(self) -> _profile_report.Report:
        """The imbalance report: every rank's times, gathered; collective.

        **Returns:** a `Report` (the same on every rank).

        **Raises:** `DistopError` while the profile is still recording.
        """
        self._check_ended("report")
        if self._report is None:
            mine = _profile_report.summarize(self.calls, self.runs, self.waits,
                                             self.entries, self.span)
            with _watchdog.watchdog.watch("Profile.report: gathering every rank's times"):
                every = self.comm.allgather(mine)
            self._report = _profile_report.Report.build(every)
        return self._report

    def print_report(self, *, calls: bool = False, file: Any = None) -> _profile_report.Report:
        """Print the imbalance report as a table on rank 0; collective.

        **Arguments:**
        - `calls`: also list every method call of each program (by its place in it).
        - `file`: where to print (default `sys.stdout`).

        **Returns:** the `Report` (on every rank).
        """
        report = self.report()
        if self.comm.Get_rank() == 0:
            print(report.table(calls=calls), file=file, flush=True)
        return report

    def trace(self) -> dict[str, Any] | None:
        """The Chrome trace-event document of every rank; collective.

        **Returns:** on rank 0, a dict (`{"traceEvents": [...], ...}`) with one process
        track per rank (`pid` = rank): a slice per program run, method and MPI call;
        None on the other ranks.
        """
        self._check_ended("trace")
        with _watchdog.watchdog.watch("Profile.trace: gathering every rank's calls"):
            every = self.comm.gather((self.calls, self.runs, self.waits, self.entries,
                                      self.span), root=0)
        return None if every is None else _profile_report.trace_events(every)

    def write_trace(self, path: str) -> str | None:
        """Write the trace (see `trace`) as JSON to `path` on rank 0; collective. Open it
        in https://ui.perfetto.dev or chrome://tracing.

        **Arguments:**
        - `path`: the file to write.

        **Returns:** `path` on rank 0, None elsewhere.
        """
        document = self.trace()
        if document is None:
            return None
        _profile_report.write_json(document, path)
        return path

    def plot(self, path: str) -> str | None:
        """Draw compute against wait per rank and operator to a PNG on rank 0;
        collective. Needs matplotlib (`pip install 'distop[plot]'`).

        **Arguments:**
        - `path`: the image file to write.

        **Returns:** `path` on rank 0, None elsewhere.

        **Raises:** ImportError (on rank 0) where matplotlib is missing.
        """
        report = self.report()
        if self.comm.Get_rank() != 0:
            return None
        _profile_report.plot(report, path)
        return path
