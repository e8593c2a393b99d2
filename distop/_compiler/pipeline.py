"""The driver: a traced lean program through the passes, then loops and segments.

**The order.** `PASSES` lists the passes in the order they analyse the program. A pass
that is not shared is merged on this rank's proposal alone and applied at once: the
next pass analyses the program it leaves. A shared pass is applied only after the ranks
have exchanged their proposals, in the order of `PASSES`. An `optimistic` pass is the
exception: it is applied at once with this rank's own proposal, and the exchanges go on
until that proposal is the decision (see `base.Pass`). So the rows are analysed before
the calls to drop and applied after them: they count derivative calls, and a drop moves
none. `AFTER_REWRITE` lists the passes analysed on the rewritten program; their proposals
travel in the rewrite's own exchange. The final stage follows: loops (loops.py),
segments (segments.py), and the compiled function.

**The exchanges.** Every cross-rank step goes through `exchange(what, thunk, share,
steps)`, as `Coordinator.collective_step` makes it: it runs `thunk()` on every rank and raises on
every rank if it raised on any; then every rank's proposals of the shared `steps`,
`share(result)` (None where a rank has none), are merged by `decided`: in two
reductions whose size does not grow with the number of ranks (the sizes the proposals
need, then the proposals encoded), an elementwise maximum over the ranks. It returns
(the result, the decisions), the decisions None on every rank where some rank had no
proposals. `lean_program` makes these, on every rank alike:
1. "agreeing on the lean path": every rank's shared proposals, or None where its
   program is not one chain. The program takes the lean path on every rank or on none.
2. "agreeing on the calls to drop", once per round, and no round where the first
   exchange agreed. Where the ranks proposed different calls to drop, each analyses the
   `optimistic` pass again with only the common ones allowed, and the shared passes after
   it; they exchange those proposals again. The allowed calls shrink every round, so
   the rounds end.
3. "rewriting the program": every rank applies the decisions, runs the final stage and
   shares the proposals of `AFTER_REWRITE`; their decisions are applied after it.
"""

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from .._errors import DistopError
from .._hostcalls import ffi as _ffi
from .jaxprs import chained
from .passes import fold, fuse, identity, rows, unused
from .passes.base import Context, Pass
from .stages import loops, nested, segments

PASSES: tuple[Pass[Any, Any], ...] = (identity.DropIdentityProducts(), fold.FoldKnown(),
                                      rows.KnownRows(), unused.DropUnused(), fuse.Fuse())
AFTER_REWRITE: tuple[Pass[Any, Any], ...] = (fuse.AgreeRows(),)

Result = TypeVar("Result")
Shared = TypeVar("Shared")


class Exchange(Protocol):
    """`exchange(what, thunk, share, steps) -> (thunk(), the decisions of steps)`: see
    the module docstring."""

    def __call__(self, what: str, thunk: Callable[[], Result],
                 share: Callable[[Result], tuple[Any, ...] | None],
                 steps: Sequence[Pass[Any, Any]]) -> tuple[Result, list[Any] | None]: ...


Most = Callable[[np.ndarray], np.ndarray]  # an int64 vector -> its elementwise max over ranks


def decided(steps: Sequence[Pass[Any, Any]], proposals: tuple[Any, ...] | None,
            most: Most) -> list[Any] | None:
    """The decisions of the shared `steps` from every rank's proposals.

    Two reductions of `most`, the same on every rank: the sizes every rank's proposals
    need (and whether some rank has none), then every rank's proposals encoded for the
    largest sizes (see `base.Pass`). What the ranks send does not grow with their
    number.

    **Arguments:**
    - `steps`: the shared passes.
    - `proposals`: this rank's proposals of the first of them (the same number on
      every rank, else no decisions), or None where it has none.
    - `most`: the elementwise maximum of an int64 vector over the ranks.

    **Returns:** the decision of each step proposed, as `merge` of every rank's
    proposals would give it; None on every rank where some rank has no proposals, or
    the ranks have proposals of different numbers of steps.
    """
    top = most(_header(steps, proposals))
    if top[0] or top[1] != -top[2]:
        return None
    assert proposals is not None  # (no rank lacks them, this one included)
    steps = steps[:len(proposals)]
    sizes = _sizes(steps, top)
    parts = _encoded(steps, proposals, sizes)
    return _decisions(steps, most(_joined(parts)), sizes, [p.size for p in parts])


def merged(steps: Sequence[Pass[Any, Any]],
           every: Sequence[tuple[Any, ...] | None]) -> list[Any] | None:
    """**Returns:** what `decided` gives every rank whose proposals are `every` (one
    entry per rank): the ranks' exchange, simulated in one process."""
    top = np.max([_header(steps, proposals) for proposals in every], axis=0)
    if top[0] or top[1] != -top[2]:
        return None
    steps = steps[:int(top[1])]
    sizes = _sizes(steps, top)
    encoded = [_encoded(steps, proposals, sizes) for proposals in every
               if proposals is not None]  # (none is: the header says so)
    largest = np.max([_joined(parts) for parts in encoded], axis=0)
    return _decisions(steps, largest, sizes, [p.size for p in encoded[0]])


def _header(steps: Sequence[Pass[Any, Any]], proposals: tuple[Any, ...] | None) -> np.ndarray:
    """**Returns:** whether this rank has no proposals; how many it has (of the first
    of `steps`) and minus that; then the sizes each needs (zeros for the rest)."""
    if proposals is None:
        return np.array([1, 0, 0] + [0] * sum(step.dimensions for step in steps), np.int64)
    sizes = [n for step, p in zip(steps, proposals) for n in step.sizes(p)]
    rest = sum(step.dimensions for step in steps[len(proposals):])
    return np.array([0, len(proposals), -len(proposals), *sizes, *[0] * rest], np.int64)


def _sizes(steps: Sequence[Pass[Any, Any]], top: np.ndarray) -> list[tuple[int, ...]]:
    """**Returns:** per step, its sizes from the largest header over the ranks."""
    sizes, k = [], 3
    for step in steps:
        sizes.append(tuple(int(n) for n in top[k:k + step.dimensions]))
        k += step.dimensions
    return sizes


def _encoded(steps: Sequence[Pass[Any, Any]], proposals: tuple[Any, ...],
             sizes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """**Returns:** this rank's proposal of each step, encoded for its sizes."""
    return [np.asarray(step.encode(p, n), np.int64)
            for step, p, n in zip(steps, proposals, sizes)]


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _decisions(steps: Sequence[Pass[Any, Any]], largest: np.ndarray,
               sizes: list[tuple[int, ...]], widths: list[int]) -> list[Any]:
    """**Returns:** each step's decision from its part (`widths`) of the largest
    encoding over the ranks."""
    decisions, k = [], 0
    for step, n, width in zip(steps, sizes, widths):
        decisions.append(step.decode(largest[k:k + width], n))
        k += width
    return decisions


Outputs = dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape, dtype)


class LeanProgram(NamedTuple):
    """A program of the lean path.

    Fields: `fn` (the jitted function: token, inputs, extra arguments -> packed
    results, token), `outputs` (name -> (shape, dtype) of its results before packing),
    `closed` (the program before loops and segments: its schedule).
    """

    fn: Callable[..., Any]
    outputs: Outputs
    closed: ClosedJaxpr


# A program as traced, before the passes: `fn`, `outputs` and `closed` as a
# `LeanProgram`'s (the one the passes leave unchanged is it).
Found = LeanProgram


class Proposed(NamedTuple):
    """This rank's side of an exchange of proposals.

    Fields: `analysed` (the program the first shared `optimistic` pass analysed, which it
    analyses again in later rounds), `program` (the program with the passes applied
    so far: those that are not shared, and `optimistic` passes with this rank's proposal),
    `proposals` (of the shared passes, in order).
    """

    analysed: ClosedJaxpr | None
    program: ClosedJaxpr
    proposals: tuple[Any, ...]


def lean_program(name: str, found: Found | None, *, exchange: Exchange,
                 unit_seeds: Sequence[int], fuse: bool, inputs: Mapping[str, Any],
                 specs: Sequence[Any]) -> LeanProgram | None:
    """The lean program of an entry point, agreed and rewritten alike on every rank.

    **Arguments:**
    - `name`: the entry point, for the exchanges' messages.
    - `found`: (function, outputs, program) as traced on the lean path, or None where
      tracing failed on this rank.
    - `exchange`: the cross-rank step (see the module docstring).
    - `unit_seeds`: which of the extra arguments hold identity matrices (see
      `_layout.unit_seeds`).
    - `fuse`: whether neighbouring calls may be fused.
    - `inputs`: the `jax.ShapeDtypeStruct`s of the inputs (name -> spec).
    - `specs`: those of the extra arguments after the inputs (the seeds, say).

    **Returns:** the `LeanProgram`, on every rank, or None on every rank (then the
    program takes the `io_callback` path); `found` itself where nothing changes it.
    """
    context = None
    if found is not None and chained(found.closed):
        invars = found.closed.jaxpr.invars
        first = len(invars) - len(specs)
        context = Context(tuple(first + i for i in unit_seeds), fuse)
    # A program with calls inside its own loops or branches (see nested.py) is compiled
    # as traced: the passes read the chain's calls at the top level only.
    inside = found is not None and nested.nested(found.closed.jaxpr)
    passes, after = ((), ()) if inside else (PASSES, AFTER_REWRITE)
    # (the shared passes of every rank's `PASSES`: proposals of as many of them on
    # every rank, or no lean path, so that the ranks agree on `inside`)
    given, agreed = exchange(
        f"{name}: agreeing on the lean path",
        lambda: None if found is None or context is None else propose(found.closed,
                                                                      context, passes),
        lambda proposed: None if proposed is None else proposed.proposals,
        [step for step in PASSES if step.shared])
    if agreed is None:
        return None
    # every rank proposed, this one too: its program is one chain
    assert found is not None and context is not None and given is not None
    mine = given
    shared = [step for step in passes if step.shared]
    decisions = list(agreed)
    optimistic = next((j for j, step in enumerate(shared) if step.optimistic), None)
    while optimistic is not None and not shared[optimistic].unanimous(decisions[optimistic]):
        context = shared[optimistic].again(context, decisions[optimistic])
        rest = passes[passes.index(shared[optimistic]):]
        assert mine.analysed is not None  # set by the `optimistic` pass, which `propose` ran
        mine, again = exchange(f"{name}: agreeing on the calls to drop",
                               functools.partial(propose, mine.analysed, context, rest),
                               lambda proposed: proposed.proposals, shared[optimistic:])
        assert again is not None  # (every rank proposed, as many as before)
        decisions[optimistic:] = again

    def rewrite() -> LeanProgram:
        program = mine.program
        for step, decision in zip(shared, decisions):
            if not step.optimistic:
                program = step.apply(program, decision)
        if not chained(program):
            raise DistopError("the rewritten program is not one chain")
        return compiled(found, program, inputs, specs)

    lean, decided_after = exchange(f"{name}: rewriting the program", rewrite,
                             lambda made: tuple(step.analyse(made.closed, context)
                                                for step in after), after)
    assert decided_after is not None  # (every rank made the program and analysed it)
    for step, decision in zip(after, decided_after):
        step.apply(lean.closed, decision)
    return lean


def propose(program: ClosedJaxpr, context: Context,
            passes: Sequence[Pass[Any, Any]]) -> Proposed:
    """This rank's proposals of `passes` for `program` (see the module docstring).

    **Returns:** the `Proposed`.
    """
    analysed: ClosedJaxpr | None = None
    proposals = []
    for step in passes:
        proposal = step.analyse(program, context)
        if step.shared:
            proposals.append(proposal)
        if step.optimistic and analysed is None:
            analysed = program
        if not step.shared or step.optimistic:
            program = step.apply(program, step.merge([proposal]))
    return Proposed(analysed, program, tuple(proposals))


def compiled(found: LeanProgram, program: ClosedJaxpr, inputs: Mapping[str, Any],
             specs: Sequence[Any]) -> LeanProgram:
    """The final stage: `program` with its loops rolled and its chain cut into segments,
    jitted and traced.

    **Arguments:**
    - `found`: the program as traced.
    - `program`: it after the passes.
    - `inputs`, `specs`: as for `lean_program`.

    **Returns:** the `LeanProgram`; `found` itself if nothing changes it.
    """
    looped = loops.rolled(program)
    runnable = program if looped is None else looped.program
    run = segments.segmented(runnable)
    if run is None and program is found.closed and looped is None:
        return found
    fn = function(run or jaxpr_as_fun(runnable))
    if looped is not None:  # the loops' call sites live as long as the program
        weakref.finalize(fn, _ffi.release, looped.host_calls)
    fn.trace(jax.ShapeDtypeStruct((), _ffi.token_dtype()), inputs, *specs)
    return LeanProgram(fn, found.outputs, program)


def function(run: Callable[..., list[Any]]) -> Any:
    """**Returns:** `run` (flat arguments -> flat results) jitted as a program is called:
    (token, inputs, extra arguments) -> the results, as a tuple."""
    return jax.jit(lambda *args: tuple(run(*jax.tree.leaves(args))))
