"""What a profile shows: the imbalance report, its table, the trace and the picture.

Everything here works on plain data (the records of `_profile`, each rank's summary),
so it runs anywhere, one rank's part or the gathered whole.
"""

import bisect
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._mpi.names import COLLECTIVES
from .lateness import arrivals_at_meetings, lateness, standing_out

# (operator, phase) or (entry point, position, operator, phase) -> [calls, compute ns,
# wait ns, wall ns], on one rank
Sums = dict[tuple[Any, ...], list[int]]


def meetings(calls: Sequence[Any], waits: Sequence[Any]) -> list[tuple[str, int, int]]:
    """Where one rank met every other, in order: each collective a method called and
    each wait of distop's own (point-to-point calls meet one peer: not counted).

    **Arguments:**
    - `calls`: the rank's `CallRecord`s.
    - `waits`: its `WaitRecord`s.

    **Returns:** (name, start, end) per meeting, in ns since the profile began.
    """
    found = [(name, start, end) for c in calls for name, start, end in c.collectives
             if name in COLLECTIVES or name.startswith("distop: ")]
    found += [(f"distop: {w.where}", w.start, w.end) for w in waits]
    return sorted(found, key=lambda m: m[1])


def _inside(intervals: Sequence[tuple[int, int]], at: int) -> bool:
    """**Returns:** whether time `at` lies in one of sorted, disjoint `intervals`."""
    k = bisect.bisect_right(intervals, (at, float("inf"))) - 1
    return k >= 0 and intervals[k][0] <= at <= intervals[k][1]


def summarize(calls: Sequence[Any], runs: Sequence[Any], waits: Sequence[Any] = (),
              entries: Sequence[Any] = (), span: int = 0) -> dict[str, Any]:
    """One rank's times, summed per operator and phase and per call of each program,
    and what the rank did between them.

    **Arguments:**
    - `calls`: the rank's `CallRecord`s.
    - `runs`: its `RunRecord`s.
    - `waits`: its `WaitRecord`s (distop's own waits outside the methods).
    - `entries`: its `EntryRecord`s (each call of an entry point, whole).
    - `span`: ns from the start of the profile to its end.

    **Returns:** a small dict of plain values, to gather across ranks: besides the sums,
    `outside` (ns in the caller's own code between entry points), `agreement` (ns in
    distop's own waits outside the methods), `jax` (ns of the program runs outside the
    methods and those waits), `distop` (ns of the entry points outside the runs and
    waits: agreements' own work, tracing, dispatch) and `starts`, `ends` and `names` of
    its meetings with the others (ns since the profile began).
    """
    operators: Sums = {}
    positions: Sums = {}
    host = 0
    for c in calls:
        wall = c.end - c.start
        entry = runs[c.run].entry if 0 <= c.run < len(runs) else ""
        for sums, key in ((operators, (c.operator, c.phase)),
                          (positions, (entry, c.position, c.operator, c.phase))):
            found = sums.setdefault(key, [0, 0, 0, 0])
            found[0] += 1
            found[1] += wall - c.wait
            found[2] += c.wait
            found[3] += wall
        if c.run >= 0:
            host += wall
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.entry] = counts.get(r.entry, 0) + 1
    wall = sum(r.end - r.start for r in runs)
    in_runs = sum(w.end - w.start for w in waits if w.run >= 0)
    agreement = sum(w.end - w.start for w in waits)
    jax = max(wall - host - in_runs, 0)
    spans = sorted((e.start, e.end) for e in entries)
    entered = sum(end - start for start, end in spans)
    # (operators called outside any entry point: outside a Problem, say)
    loose = sum(c.end - c.start for c in calls if not _inside(spans, c.start))
    loose += sum(w.end - w.start for w in waits if not _inside(spans, w.start))
    met = meetings(calls, waits)
    return {"operators": operators, "positions": positions, "runs": counts,
            "wall": wall, "host": host, "jax": jax, "agreement": agreement,
            "outside": max(span - entered - loose, 0) if span else 0,
            "distop": max(entered - wall - (agreement - in_runs), 0),
            "starts": [start for _, start, _ in met], "ends": [end for _, _, end in met],
            "names": [m[0] for m in met],
            "span": span}


@dataclasses.dataclass(frozen=True)
class Times:
    """One operator and phase (or one call of a program) across ranks, in seconds.

    Fields: `operator`, `phase`, `entry` and `position` (for one call of a program:
    its entry point and place among its method calls; `""` and -1 per operator),
    `calls` (per rank, the most), `compute`, `wait`, `wall` (numpy arrays, one value
    per rank: time in the methods outside MPI calls, inside them, and both), the
    min / median / max over ranks of compute and wait, `slowest_rank` (the most
    compute), `imbalance` (max / mean compute; 1 when even) and `wait_share` (the share
    of the calls' time, over all ranks, spent in MPI calls: waiting for peers plus
    transfer).
    """

    operator: str
    phase: str
    entry: str
    position: int
    calls: int
    compute: np.ndarray
    wait: np.ndarray
    wall: np.ndarray
    compute_min: float
    compute_median: float
    compute_max: float
    wait_min: float
    wait_median: float
    wait_max: float
    slowest_rank: int
    imbalance: float
    wait_share: float

    @classmethod
    def build(cls, key: tuple[Any, ...], sums: Sequence[list[int] | None]) -> "Times":
        """Gather one key's sums of every rank (None: the rank made no such call).

        **Arguments:**
        - `key`: `(operator, phase)` or `(entry, position, operator, phase)`.
        - `sums`: per rank, its `[calls, compute, wait, wall]` in ns, or None.

        **Returns:** the `Times`.
        """
        every = np.array([s if s is not None else [0, 0, 0, 0] for s in sums],
                         dtype=np.float64)
        compute, wait, wall = every[:, 1] * 1e-9, every[:, 2] * 1e-9, every[:, 3] * 1e-9
        entry, position = (key[0], key[1]) if len(key) == 4 else ("", -1)
        return cls(key[-2], key[-1], entry, position, int(every[:, 0].max()), compute,
                   wait, wall, *_spread(compute), *_spread(wait),
                   int(np.argmax(compute)), _imbalance(compute), _share(wait, wall))

    @property
    def name(self) -> str:
        """**Returns:** `Operator.phase`."""
        return f"{self.operator}.{self.phase}"


def _spread(values: np.ndarray) -> tuple[float, float, float]:
    return float(values.min()), float(np.median(values)), float(values.max())


def _imbalance(values: np.ndarray) -> float:
    mean = float(values.mean())
    return float(values.max()) / mean if mean > 0 else 1.0


def _share(part: np.ndarray, whole: np.ndarray) -> float:
    total = float(whole.sum())
    return float(part.sum()) / total if total > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Report:
    """The imbalance report of a profile: every rank's times, gathered.

    Fields: `ranks`, `operators` (a tuple of `Times`, one per operator and phase, in
    the order they first ran), `calls` (a tuple of `Times`, one per call of each
    program: entry point and place in it), `runs` (entry point -> program runs, per
    rank), and per rank (numpy arrays in seconds): `compute` and `wait` (summed over
    the methods: outside and inside their MPI calls), `agreement` (distop's own waits
    for the other ranks outside the methods: agreeing on a call, checks), `host` (the
    methods' wall time within program runs), `jax` (the rest of the runs but distop's
    waits: JAX's own time between host calls), `distop` (the entry points' time outside
    the runs and waits: agreements' own work, tracing, dispatch), `outside` (the time
    between entry points: the caller's own code) and `wall` (the program runs, each
    timed once finished).

    Who made the others wait: `arrivals` (ranks x meetings: each rank's arrival at each
    meeting of the ranks, a collective or an agreement, relative to the last to arrive,
    in seconds, <= 0; clocks aligned at the start of the profile), `late` (per rank, how
    long the others waited in all at the meetings it reached last), `last` (per rank,
    at how many meetings it arrived last), `slowest_rank` (the rank the others waited
    for, or None where no rank stands out above the noise) and `extra` (where that
    rank's extra time went against the median of the others: (what, seconds) pairs,
    largest first). Over ranks: `imbalance` (the most compute / the mean) and
    `wait_share` (the share of the runs' time, over all ranks, spent in MPI calls).
    """

    ranks: int
    operators: tuple[Times, ...]
    calls: tuple[Times, ...]
    runs: dict[str, int]
    compute: np.ndarray
    wait: np.ndarray
    agreement: np.ndarray
    host: np.ndarray
    jax: np.ndarray
    distop: np.ndarray
    outside: np.ndarray
    wall: np.ndarray
    arrivals: np.ndarray
    late: np.ndarray
    last: np.ndarray
    slowest_rank: int | None
    extra: tuple[tuple[str, float], ...]
    imbalance: float
    wait_share: float

    @classmethod
    def build(cls, every: Sequence[dict[str, Any]]) -> "Report":
        """Build the report from every rank's `summarize`.

        **Arguments:**
        - `every`: per rank, in rank order, its summary.

        **Returns:** the `Report`.
        """
        rows = []
        for kind in ("operators", "positions"):
            keys = list(dict.fromkeys(k for mine in every for k in mine[kind]))
            if kind == "positions":
                keys.sort(key=lambda k: (k[0], k[1]))
            rows.append(tuple(Times.build(k, [mine[kind].get(k) for mine in every])
                              for k in keys))

        def per_rank(name: str) -> np.ndarray:
            return np.array([m.get(name, 0) for m in every], dtype=np.float64) * 1e-9

        compute = np.array([sum(s[1] for s in m["operators"].values()) for m in every]) * 1e-9
        wait = np.array([sum(s[2] for s in m["operators"].values()) for m in every]) * 1e-9
        host, wall = per_rank("host"), per_rank("wall")
        jax = (per_rank("jax") if all("jax" in m for m in every)
               else np.maximum(wall - host, 0.0))
        arrivals = arrivals_at_meetings(every)
        late, last = lateness(arrivals)
        slowest = standing_out(every)
        categories = {"its own code between calls": per_rank("outside"), "JAX": jax,
                      "distop's own work (agreement, tracing, dispatch)":
                          per_rank("distop")}
        for t in rows[0]:
            categories[f"{t.name} (computing)"] = t.compute
        return cls(len(every), rows[0], rows[1], dict(every[0]["runs"]) if every else {},
                   compute, wait, per_rank("agreement"), host, jax, per_rank("distop"),
                   per_rank("outside"), wall, arrivals * 1e-9, late * 1e-9, last,
                   slowest, _extra(categories, slowest), _imbalance(compute),
                   _share(wait, wall))

    def as_dict(self) -> dict[str, Any]:
        """**Returns:** the report as nested dicts and lists of plain numbers (for JSON)."""
        def plain(value: Any) -> Any:
            if isinstance(value, np.ndarray):
                return value.tolist()
            if isinstance(value, Times):
                return {f.name: plain(getattr(value, f.name))
                        for f in dataclasses.fields(value)}
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def headline(self) -> str:
        """**Returns:** the line naming the rank the others waited for, how long, and
        where its extra time went; or saying that no rank stands out."""
        meetings = self.arrivals.shape[1] if self.arrivals.ndim == 2 else 0
        total = float(self.late.sum()) if self.late.size else 0.0
        if self.slowest_rank is None:
            if self.ranks < 2 or meetings == 0:
                return "slowest rank: none (no meeting of several ranks to compare)"
            top = int(np.argmax(self.late))
            return (f"slowest rank: none stands out (at {meetings} meetings the others "
                    f"waited {_ms(total)} ms in all, for no rank late systematically; "
                    f"most for rank {top}: "
                    f"{100 * float(self.late[top]) / max(total, 1e-30):.0f}%)")
        r = self.slowest_rank
        went = ", ".join(f"{what} +{_ms(seconds)} ms" for what, seconds in self.extra[:3])
        return (f"slowest rank: {r} (the others waited {_ms(float(self.late[r]))} ms in all "
                f"for it, last to arrive at {int(self.last[r])} of {meetings} meetings; "
                f"its extra time against the median rank: {went or 'none measured'})")

    def table(self, *, calls: bool = False) -> str:
        """The report as text, one line per operator and phase.

        **Arguments:**
        - `calls`: also one line per call of each program.

        **Returns:** the table.
        """
        runs = ", ".join(f"{name} x{n}" for name, n in self.runs.items()) or "none"
        lines = [f"distop profile: {self.ranks} rank(s); program runs: {runs}; "
                 f"wall {_ms(float(self.wall.max()) if self.ranks else 0.0)} ms (the "
                 "slowest rank)",
                 _row("operator.phase", "calls", "compute ms min/med/max",
                      "wait ms min/med/max", "slowest", "imbalance", "waiting")]
        for t in self.operators:
            lines.append(_times_row(t.name, t))
        lines.append(_row("distop agreement", "", "", _triple(self.agreement),
                          f"rank {int(np.argmax(self.agreement))}" if self.ranks else "",
                          "", ""))
        for name, values in (("JAX between calls", self.jax),
                             ("distop's own work", self.distop),
                             ("outside distop (own code)", self.outside)):
            lines.append(_row(name, "", _triple(values), "", f"rank "
                              f"{int(np.argmax(values))}" if self.ranks else "",
                              f"{_imbalance(values):.2f}", ""))
        everything = self.compute + self.jax + self.distop + self.outside
        waited = self.wait + self.agreement
        lines.append(_row("all", "", _triple(everything), _triple(waited),
                          f"rank {int(np.argmax(everything))}" if self.ranks else "",
                          f"{_imbalance(everything):.2f}",
                          f"{100 * _share(waited, waited + everything):.0f}%"))
        if calls:
            lines.append("")
            lines.append(_row("entry[place] operator.phase", "calls", "compute ms "
                              "min/med/max", "wait ms min/med/max", "slowest",
                              "imbalance", "waiting"))
            for t in self.calls:
                lines.append(_times_row(f"{t.entry or '-'}[{t.position}] {t.name}", t))
        lines.append(self.headline())
        return "\n".join(lines)


def _extra(categories: dict[str, np.ndarray], rank: int | None) -> tuple[tuple[str, float], ...]:
    """**Returns:** where `rank` spent more time than the median of the other ranks:
    (what, seconds) pairs, largest first; none for no rank."""
    if rank is None:
        return ()
    found = []
    for what, values in categories.items():
        others = np.delete(values, rank)
        more = float(values[rank]) - (float(np.median(others)) if others.size else 0.0)
        if more > 0:
            found.append((what, more))
    found.sort(key=lambda f: -f[1])
    total = sum(more for _, more in found)
    # (the parts that matter: a tenth of the extra time or more)
    return tuple(f for f in found if f[1] >= 0.1 * total)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g}"


def _triple(values: np.ndarray) -> str:
    return "/".join(_ms(v) for v in _spread(values)) if values.size else "-"


def _row(*cells: str) -> str:
    widths = (30, 6, 24, 24, 8, 10, 8)
    first = cells[0] if len(cells[0]) <= widths[0] else cells[0][:widths[0] - 1] + "~"
    return " ".join([first.ljust(widths[0])] + [c.rjust(w) for c, w in
                                                  zip(cells[1:], widths[1:])])


def _times_row(name: str, t: Times) -> str:
    return _row(name, str(t.calls), _triple(t.compute), _triple(t.wait),
                f"rank {t.slowest_rank}", f"{t.imbalance:.2f}", f"{100 * t.wait_share:.0f}%")


# -- the trace ------------------------------------------------------------------------
def trace_events(every: Sequence[tuple[Any, ...]]) -> dict[str, Any]:
    """The Chrome trace-event document of every rank's records.

    **Arguments:**
    - `every`: per rank, in rank order, its (`CallRecord`s, `RunRecord`s, `WaitRecord`s,
      `EntryRecord`s, span); the last three may be left out.

    **Returns:** `{"traceEvents": [...], "displayTimeUnit": "ms"}`: per rank a process
    track (`pid` = rank, named "rank R"), with a complete (`X`) event per program run
    (category `program`), per method (`method`), per MPI call of a method (`mpi`), per
    wait of distop's own (`wait`) and per stretch of the caller's own code between
    entry points (`outside`), nested, timestamps in µs. Each meeting of the ranks (a
    collective, an agreement) carries in its arguments the rank's arrival relative to
    the last rank's (`arrival_vs_last_us`), and the last rank (`last_rank`).
    """
    records = [tuple(mine) + ((), (), 0)[len(mine) - 2:] for mine in every]
    summaries = [{"starts": [m[1] for m in meetings(r[0], r[2])],
                  "ends": [m[2] for m in meetings(r[0], r[2])],
                  "names": [m[0] for m in meetings(r[0], r[2])]} for r in records]
    arrivals = arrivals_at_meetings(summaries) if len(records) > 1 else np.zeros((len(records), 0))
    events: list[dict[str, Any]] = []
    for rank, (calls, runs, waits, entries, span) in enumerate(records):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        # the meetings in order, as `arrivals_at_meetings` counts them: (start, name) -> index
        order = {(m[1], m[0]): k for k, m in enumerate(meetings(calls, waits))
                 if k < arrivals.shape[1]}

        def met(name: str, start: int, order: dict = order, rank: int = rank) -> dict[str, Any]:
            k = order.get((start, name))
            if k is None:
                return {}
            return {"arrival_vs_last_us": float(arrivals[rank, k]) / 1e3,
                    "last_rank": int(np.argmax(arrivals[:, k]))}

        slices: list[tuple[int, int, str, str, dict[str, Any]]] = []
        for r in runs:
            slices.append((r.start, r.end, r.entry, "program", {}))
        for c in calls:
            wait = c.wait
            slices.append((c.start, c.end, f"{c.operator}.{c.phase}", "method",
                           {"compute_us": (c.end - c.start - wait) / 1e3,
                            "wait_us": wait / 1e3, "position": c.position}))
            for name, start, end in c.collectives:
                slices.append((start, end, name, "wait" if name.startswith("distop: ")
                               else "mpi", met(name, start)))
        for w in waits:
            slices.append((w.start, w.end, f"distop: {w.where}", "wait",
                           met(f"distop: {w.where}", w.start)))
        previous = 0
        for e in sorted(entries, key=lambda e: e.start):
            if e.start > previous:
                slices.append((previous, e.start, "outside distop", "outside", {}))
            previous = max(previous, e.end)
        if entries and span > previous:
            slices.append((previous, span, "outside distop", "outside", {}))
        # parents first where they start together: the longer slice first
        slices.sort(key=lambda s: (s[0], -(s[1] - s[0])))
        for start, end, name, category, args in slices:
            event = {"name": name, "cat": category, "ph": "X", "pid": rank, "tid": 0,
                     "ts": start / 1e3, "dur": max(end - start, 0) / 1e3}
            if args:
                event["args"] = args
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_json(document: dict[str, Any], path: str) -> None:
    """Write `document` as JSON to `path`.

    **Arguments:**
    - `document`: plain data.
    - `path`: the file.
    """
    with open(path, "w") as f:
        json.dump(document, f)


def check_trace(document: dict[str, Any]) -> None:
    """Check that `document` follows the trace-event format as distop writes it.

    Every event has `name`, `ph`, `pid` and `tid`; every event but metadata (`M`) a
    numeric `ts`; complete (`X`) events a `dur` >= 0; begin (`B`) and end (`E`) events
    match per track; timestamps never go back on a track.

    **Arguments:**
    - `document`: the parsed JSON (`{"traceEvents": [...]}`, or the list itself).

    **Raises:** ValueError naming the first event that breaks a rule.
    """
    events = document["traceEvents"] if isinstance(document, dict) else document
    last: dict[tuple[Any, Any], float] = {}
    open_: dict[tuple[Any, Any], list[str]] = {}
    for i, e in enumerate(events):
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in e]
        if missing:
            raise ValueError(f"trace event {i} ({e}) lacks {missing}.")
        if e["ph"] == "M":
            continue
        if not isinstance(e.get("ts"), (int, float)):
            raise ValueError(f"trace event {i} ({e}) has no numeric 'ts'.")
        track = (e["pid"], e["tid"])
        if e["ts"] < last.get(track, -float("inf")):
            raise ValueError(f"trace event {i} ({e}) goes back in time on its track.")
        last[track] = e["ts"]
        if e["ph"] == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            raise ValueError(f"complete trace event {i} ({e}) has no 'dur' >= 0.")
        if e["ph"] == "B":
            open_.setdefault(track, []).append(e["name"])
        elif e["ph"] == "E":
            if not open_.get(track):
                raise ValueError(f"trace event {i} ({e}) ends no open slice.")
            open_[track].pop()
    unmatched = {t: names for t, names in open_.items() if names}
    if unmatched:
        raise ValueError(f"trace slices begun and never ended: {unmatched}.")


# -- the picture ----------------------------------------------------------------------
def plot(report: Report, path: str) -> None:
    """Draw compute (solid) against wait (hatched) per rank, stacked per operator and
    phase, with distop's own waits, JAX's time between host calls, distop's own work
    and the caller's own code between calls on top, to a PNG.

    **Arguments:**
    - `report`: the `Report`.
    - `path`: the image file.

    **Raises:** ImportError, with the install command, where matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("Profile.plot needs matplotlib: pip install 'distop[plot]' "
                          "(or pip install matplotlib).") from err
    ranks = np.arange(report.ranks)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * report.ranks + 4.0), 4.5))
    bottom = np.zeros(report.ranks)
    colors = plt.get_cmap("tab10")
    for k, t in enumerate(report.operators):
        color = colors(k % 10)
        ax.bar(ranks, 1e3 * t.compute, bottom=bottom, color=color,
               label=f"{t.name} compute")
        bottom += 1e3 * t.compute
        ax.bar(ranks, 1e3 * t.wait, bottom=bottom, color=color, alpha=0.35, hatch="//",
               edgecolor=color, label=f"{t.name} wait")
        bottom += 1e3 * t.wait
    shared: list[tuple[np.ndarray, str, str | None, str]] = [
        (report.agreement, "0.55", "//", "distop agreement (wait)"),
        (report.jax, "0.8", None, "JAX between calls"),
        (report.distop, "0.9", None, "distop's own work"),
        (report.outside, "wheat", "..", "outside distop (own code)")]
    for values, shade, hatch, label in shared:
        ax.bar(ranks, 1e3 * values, bottom=bottom, color=shade, hatch=hatch,
               edgecolor="0.4" if hatch else None, label=label)
        bottom += 1e3 * values
    ax.set_xlabel("rank")
    ax.set_ylabel("time (ms)")
    ax.set_xticks(ranks)
    slowest = "none" if report.slowest_rank is None else report.slowest_rank
    ax.set_title(f"compute against wait per rank\nslowest rank: {slowest}, "
                 f"imbalance {report.imbalance:.2f}", fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

