"""The collective schedule of a compiled program, its fingerprint, and cross-rank checks.

The schedule is read off the traced program itself (every host callback in program
order, including those inside loops and branches), so it is exactly what will run.
"""

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from .._errors import DistopError, ScheduleMismatchError
from .._hostcalls.fused import FusedCall
from .._hostcalls.host import HostCall
from .jaxprs import CHECKPOINTS


@dataclasses.dataclass(frozen=True)
class ScheduleEntry:
    """One operator call of a compiled program, in program order.

    `Problem.schedule` lists them; `describe()` gives one line.

    **Arguments:**
    - `index`: the call's place in program order.
    - `operator`: the operator's class name.
    - `phase`: `forward`, `vjp`, `jvp` or `hvp` (implicit operators: `solve`, `state`,
      `adjoint`, `linear`, `second_adjoint`).
    - `collectives`: the communication declared for that phase.
    - `input_shapes`, `output_shapes`, `input_dtypes`, `output_dtypes`: unbatched.
    - `batch`: batch sizes, outermost first; () if not batched. A derivative call is
      passed only the rows of its batch whose (co)tangents can be nonzero.
    - `ordered`: whether the call is ordered.
    - `context`: enclosing loops and branches, e.g. `scan[3]`.
    - `input_distributed`, `output_distributed`: per argument, whether its local axis 0
      differs between ranks; the shape then shows the global size of that axis.
    - `lean`: called through the lean path, ordered by the program's token chain.
    - `group`: the host call that runs the entry, counted in program order. Entries with
      the same group were fused into one host call and run one after another in it.
    - `made`: False for a call the lean program leaves out because nothing reads its
      results, such as a forward call in `compute_totals` whose values only the outputs
      need. It keeps its place in program order and carries the group of the next call
      made (or of the last one, at the end), so the groups are still the host calls.
    """

    index: int
    operator: str
    phase: str
    collectives: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    batch: tuple[int, ...]
    ordered: bool
    context: str
    input_distributed: tuple[bool, ...] = ()
    output_distributed: tuple[bool, ...] = ()
    lean: bool = False
    group: int = 0
    made: bool = True

    @property
    def shapes(self) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """**Returns:** `(input_shapes, output_shapes)`."""
        return self.input_shapes, self.output_shapes

    @property
    def dtypes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """**Returns:** `(input_dtypes, output_dtypes)`."""
        return self.input_dtypes, self.output_dtypes

    def describe(self) -> str:
        """**Returns:** a one-line, rank-independent description (no index)."""
        ins = _arrays(self.input_shapes, self.input_dtypes, self.input_distributed)
        outs = _arrays(self.output_shapes, self.output_dtypes, self.output_distributed)
        return (f"{self.operator}.{self.phase} collectives={list(self.collectives)} "
                f"in=({ins}) out=({outs}) batch={list(self.batch)} "
                f"{'lean' if self.lean else 'ordered' if self.ordered else 'unordered'}"
                + (f" in {self.context}" if self.context else "") + f" call {self.group}"
                + ("" if self.made else " not made: its results are unused"))


def _arrays(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str],
            distributed: Sequence[bool]) -> str:
    distributed = distributed or (False,) * len(shapes)
    return ", ".join(f"{d}[{', '.join(map(str, s))}{' distributed' if dist else ''}]"
                     for s, d, dist in zip(shapes, dtypes, distributed))


Found = tuple[HostCall, str, int]  # a call in a program: (call, context, group)
Row = tuple[HostCall, str, int, bool]  # a call of a schedule: (..., whether it is made)


def extract(closed_jaxpr: ClosedJaxpr,
            traced: Sequence[HostCall] | None = None) -> tuple[ScheduleEntry, ...]:
    """The schedule of a traced program.

    **Arguments:**
    - `closed_jaxpr`: the program, as from `jax.make_jaxpr` or `jit(...).trace(...).jaxpr`.
    - `traced`: for a lean program rewritten after tracing (see _compiler/passes/), its lean
      calls as traced, in chain order: those the rewrite left out are listed too, with
      `made=False`. None: only the calls in `closed_jaxpr`.

    **Returns:** a tuple of `ScheduleEntry`, in program order.
    """
    found: list[Found] = []
    _walk(closed_jaxpr, "", found, [0])
    rows: Sequence[Found | Row] = found if traced is None else _with_unmade(found, traced)
    return tuple(_entry(i, *row) for i, row in enumerate(rows))




def refuse_checkpoint(closed: ClosedJaxpr) -> ClosedJaxpr:
    """**Returns:** `closed` (a program traced with `io_callback`s), unless an operator is
    called inside `jax.checkpoint`, which JAX cannot differentiate with ordered
    callbacks inside.

    **Raises:** `DistopError` naming the operator."""
    found: list[Found] = []  # as `extract` finds them
    _walk(closed, "", found, [0])
    for call, context, _ in found:
        if "checkpoint" in context.replace(".", "/").split("/"):
            raise DistopError(
                f"{call.where} is called inside jax.checkpoint (jax.remat), which "
                "JAX cannot differentiate with ordered io_callbacks inside. The lean "
                "path (Problem's default backend) runs checkpointed operators: their "
                "recomputed calls run again in the reverse sweep, in one order on every "
                "rank. Else call the operator outside jax.checkpoint.")
    return closed


def _with_unmade(found: Sequence[Found], traced: Sequence[HostCall]) -> list[Row]:
    """The calls `found` in the program, as (call, context, group, made), with the
    `traced` lean calls the program does not make, in chain order, each before the next
    lean call made."""
    position = {id(call): j for j, call in enumerate(traced)}
    out: list[Row] = []
    done = 0
    for call, context, group in found:
        j = position.get(id(call.origin or call))
        if j is not None:  # the lean calls made come in chain order
            out.extend((c, "", group, False) for c in traced[done:j])
            done = j + 1
        out.append((call, context, group, True))
    last = found[-1][2] if found else 0
    out.extend((c, "", last, False) for c in traced[done:])
    return out


def _walk(jaxpr: Jaxpr | ClosedJaxpr, context: str, found: list[Found],
          count: list[int]) -> None:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        call = eqn.params.get("call")
        if isinstance(call, (HostCall, FusedCall)):
            for member in call.members if isinstance(call, FusedCall) else (call,):
                found.append((member, context, count[0]))
            count[0] += 1
            continue
        name = eqn.primitive.name
        if name == "scan":
            inner = f"scan[{eqn.params['length']}]"
        elif name == "while":
            inner = "while"
        elif name == "cond":
            inner = "cond"
        elif name in CHECKPOINTS:
            inner = "checkpoint"
        else:
            inner = ""
        sub = f"{context}/{inner}" if context and inner else (inner or context)
        for value in eqn.params.values():
            for k, j in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                if hasattr(getattr(j, "jaxpr", j), "eqns"):
                    where = f"{sub}.branch{k}" if name == "cond" else sub
                    _walk(j, where, found, count)


def _entry(index: int, call: HostCall, context: str, group: int,
           made: bool = True) -> ScheduleEntry:
    op = call.op
    inputs = call.in_specs
    return ScheduleEntry(
        index=index,
        operator=type(op).__name__,
        phase=call.label,
        collectives=call.declared,
        input_shapes=tuple(tuple(s.shape) for s in inputs),
        output_shapes=tuple(tuple(s.shape) for s in call.result_specs),
        input_dtypes=tuple(_name(s.dtype) for s in inputs),
        output_dtypes=tuple(_name(s.dtype) for s in call.result_specs),
        batch=tuple((call.origin or call).batch_shape),
        ordered=call.ordered,
        context=context,
        lean=call.lean,
        group=group,
        made=made,
    )


@functools.cache
def _name(dtype: Any) -> str:
    return str(np.dtype(dtype))


def fingerprint(name: str, entries: Sequence[ScheduleEntry]) -> int:
    """**Returns:** a 63-bit integer that identifies the schedule `entries` of `name` up
    to every array's axis 0 (which may differ between ranks)."""
    text = repr((name, [_key(e) for e in entries]))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _key(entry: ScheduleEntry) -> tuple[Any, ...]:
    """**Returns:** every field of `entry` but its index, as plain values, without the
    arrays' axis 0."""
    return (entry.operator, entry.phase, entry.collectives, _tails(entry.input_shapes),
            _tails(entry.output_shapes), entry.input_dtypes, entry.output_dtypes,
            entry.batch, entry.ordered, entry.context, entry.input_distributed,
            entry.output_distributed, entry.lean, entry.group, entry.made)


def _replaced(entry: ScheduleEntry, **changes: Any) -> ScheduleEntry:
    """`dataclasses.replace(entry, **changes)` without its per-field introspection
    (tens of µs per entry; a schedule can have thousands)."""
    new = object.__new__(ScheduleEntry)
    new.__dict__.update(entry.__dict__, **changes)
    return new


def check_schedules(comm: Any, name: str,
          entries: tuple[ScheduleEntry, ...]) -> tuple[ScheduleEntry, ...]:
    """Check that every rank compiled the same schedule, up to distributed axes.

    Three reductions of a size fixed by the schedule, whatever the number of ranks: the
    largest of a fingerprint of each rank's schedule (with every array's axis 0 left
    out) and of its negation (the same on every rank exactly when the largest is minus
    the largest negation), then that of each array's local size of axis 0 and of its
    negation, then the sums of those sizes. An axis 0 that differs between
    ranks marks a distributed value and is described by its global size, so the
    returned schedule is the same on every rank. Only where the fingerprints differ do
    the ranks gather their schedules, to name the first differing entry.

    **Arguments:**
    - `comm`: the problem's communicator.
    - `name`: the entry point, e.g. `"run"` or `"compute_totals"`.
    - `entries`: this rank's schedule (local shapes).

    **Returns:** the schedule with global shapes.

    **Raises:** `ScheduleMismatchError` on every rank, naming the first differing entry
    of each rank.
    """
    if comm.Get_size() == 1:
        return entries
    heads = np.array([s[0] if s else -1 for e in entries
                      for s in e.input_shapes + e.output_shapes], np.int64)
    # (a rank whose schedule has another length holds another fingerprint: the sizes
    # are compared only once the fingerprints are known to agree, in buffers of one size)
    summary = np.array([fingerprint(name, entries), heads.size], np.int64)
    extremes = np.empty(4, np.int64)
    comm.Allreduce(np.concatenate([summary, -summary]), extremes, op=_op("MAX"))
    if (extremes[:2] != -extremes[2:]).any():
        _mismatch(comm, name, entries)
    extremes = np.empty(2 * heads.size, np.int64)
    comm.Allreduce(np.concatenate([heads, -heads]), extremes, op=_op("MAX"))
    high, low = extremes[:heads.size], -extremes[heads.size:]
    distributed = (high != low).tolist()
    totals = np.empty_like(heads)
    comm.Allreduce(heads, totals, op=_op("SUM"))
    totals = totals.tolist()
    out, k = [], 0
    for e in entries:
        shapes, flags = [], []
        for s in e.input_shapes + e.output_shapes:
            flags.append(distributed[k])
            shapes.append((totals[k],) + s[1:] if distributed[k] else s)
            k += 1
        n = len(e.input_shapes)
        out.append(_replaced(
            e, input_shapes=tuple(shapes[:n]), output_shapes=tuple(shapes[n:]),
            input_distributed=tuple(flags[:n]), output_distributed=tuple(flags[n:])))
    return tuple(out)


def _op(name: str) -> Any:
    from mpi4py import MPI

    return getattr(MPI, name)


def _tails(shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[Any, ...], ...]:
    return tuple(s[1:] if s else ("0-d",) for s in shapes)


def _mismatch(comm: Any, name: str, entries: Sequence[ScheduleEntry]) -> NoReturn:
    every = comm.allgather([(repr(_key(e)), e.describe()) for e in entries])
    lines = [f"{name}: the ranks compiled different collective schedules, so their "
             "collectives would meet the wrong partners."]
    longest = max(len(mine) for mine in every)
    # the first entry that differs between ranks (axis 0 aside), shown for every rank
    first = next((i for i in range(longest)
                  if len({mine[i][0] if i < len(mine) else None for mine in every}) > 1),
                 longest)
    for rank, mine in enumerate(every):
        here = (mine[first][1] if first < len(mine)
                else f"(none: its schedule ends after {len(mine)} entries)")
        lines.append(f"  rank {rank}: {len(mine)} entries; entry {first}: {here}")
    lines.append("Likely cause: model code that branches on the rank (a Python `if` on "
                 "comm.rank), or values whose shapes differ between ranks in an axis other "
                 "than axis 0 (only axis 0 may be distributed). Every rank must build the "
                 "same program.")
    raise ScheduleMismatchError("\n".join(lines))
