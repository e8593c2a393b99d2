"""What a profile shows: the imbalance report, its table, the trace and the picture.

Everything here works on plain data (the records of `_profile`, each rank's summary),
so it runs anywhere, one rank's part or the gathered whole.
"""

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

# (operator, phase) or (entry point, position, operator, phase) -> [calls, compute ns,
# wait ns, wall ns], on one rank
Sums = dict[tuple[Any, ...], list[int]]


def summarize(calls: Sequence[Any], runs: Sequence[Any]) -> dict[str, Any]:
    """One rank's times, summed per operator and phase and per call of each program.

    **Arguments:**
    - `calls`: the rank's `CallRecord`s.
    - `runs`: its `RunRecord`s.

    **Returns:** a small dict of plain values, to gather across ranks.
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
    entries: dict[str, int] = {}
    for r in runs:
        entries[r.entry] = entries.get(r.entry, 0) + 1
    wall = sum(r.end - r.start for r in runs)
    return {"operators": operators, "positions": positions, "runs": entries,
            "wall": wall, "host": host}


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

    Fields: `ranks`, `operators` (a `Times` per operator and phase, in the order they
    first ran), `calls` (a `Times` per call of each program: entry point and place
    in it), `runs` (entry point -> program runs, per rank), and per rank (numpy arrays
    in seconds): `compute` and `wait` (summed over the methods), `host` (the methods'
    wall time within program runs), `jax` (the rest of the runs: JAX's time between
    host calls) and `wall` (the program runs, each timed once finished). Over ranks:
    `slowest_rank` (the most compute), `imbalance` (its compute / the mean) and
    `wait_share` (the share of the runs' time, over all ranks, spent in MPI calls).
    """

    ranks: int
    operators: tuple[Times, ...]
    calls: tuple[Times, ...]
    runs: dict[str, int]
    compute: np.ndarray
    wait: np.ndarray
    host: np.ndarray
    jax: np.ndarray
    wall: np.ndarray
    slowest_rank: int
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
        compute = np.array([sum(s[1] for s in m["operators"].values()) for m in every]) * 1e-9
        wait = np.array([sum(s[2] for s in m["operators"].values()) for m in every]) * 1e-9
        host = np.array([m["host"] for m in every], dtype=np.float64) * 1e-9
        wall = np.array([m["wall"] for m in every], dtype=np.float64) * 1e-9
        return cls(len(every), rows[0], rows[1], dict(every[0]["runs"]), compute, wait,
                   host, np.maximum(wall - host, 0.0), wall,
                   int(np.argmax(compute)) if len(every) else 0, _imbalance(compute),
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

    def table(self, *, calls: bool = False) -> str:
        """The report as text, one line per operator and phase.

        **Arguments:**
        - `calls`: also one line per call of each program.

        **Returns:** the table.
        """
        runs = ", ".join(f"{name} x{n}" for name, n in self.runs.items()) or "none"
        lines = [f"distop profile: {self.ranks} rank(s); program runs: {runs}; "
                 f"wall {_ms(float(self.wall.max()))} ms (the slowest rank)",
                 _row("operator.phase", "calls", "compute ms min/med/max",
                      "wait ms min/med/max", "slowest", "imbalance", "waiting")]
        for t in self.operators:
            lines.append(_times_row(t.name, t))
        lines.append(_row("JAX between calls", "", _triple(self.jax), "", f"rank "
                          f"{int(np.argmax(self.jax))}", f"{_imbalance(self.jax):.2f}", ""))
        lines.append(_row("all methods", "", _triple(self.compute), _triple(self.wait),
                          f"rank {self.slowest_rank}", f"{self.imbalance:.2f}",
                          f"{100 * self.wait_share:.0f}%"))
        if calls:
            lines.append("")
            lines.append(_row("entry[place] operator.phase", "calls", "compute ms "
                              "min/med/max", "wait ms min/med/max", "slowest",
                              "imbalance", "waiting"))
            for t in self.calls:
                lines.append(_times_row(f"{t.entry or '-'}[{t.position}] {t.name}", t))
        slow = float(self.compute[self.slowest_rank]) if self.ranks else 0.0
        median = float(np.median(self.compute)) if self.ranks else 0.0
        lines.append(f"slowest rank: {self.slowest_rank} (compute {_ms(slow)} ms, "
                     f"{slow / median if median > 0 else 1.0:.2f}x the median rank's; "
                     f"{100 * self.wait_share:.0f}% of the runs' time waiting in MPI)")
        return "\n".join(lines)


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
def trace_events(every: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> dict[str, Any]:
    """The Chrome trace-event document of every rank's records.

    **Arguments:**
    - `every`: per rank, in rank order, its (`CallRecord`s, `RunRecord`s).

    **Returns:** `{"traceEvents": [...], "displayTimeUnit": "ms"}`: per rank a process
    track (`pid` = rank, named "rank R"), with a complete (`X`) event per program run,
    per method and per MPI call, nested, timestamps in µs.
    """
    events: list[dict[str, Any]] = []
    for rank, (calls, runs) in enumerate(every):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        slices: list[tuple[int, int, str, str, dict[str, Any]]] = []
        for r in runs:
            slices.append((r.start, r.end, r.entry, "program", {}))
        for c in calls:
            wait = c.wait
            slices.append((c.start, c.end, f"{c.operator}.{c.phase}", "method",
                           {"compute_us": (c.end - c.start - wait) / 1e3,
                            "wait_us": wait / 1e3, "position": c.position}))
            for name, start, end in c.collectives:
                slices.append((start, end, name, "mpi", {}))
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
    phase, with JAX's time between host calls on top, to a PNG.

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
    ax.bar(ranks, 1e3 * report.jax, bottom=bottom, color="0.8", label="JAX between calls")
    ax.set_xlabel("rank")
    ax.set_ylabel("time (ms)")
    ax.set_xticks(ranks)
    ax.set_title(f"compute against wait per rank\nslowest rank: {report.slowest_rank}, "
                 f"imbalance {report.imbalance:.2f}", fontsize="medium")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

