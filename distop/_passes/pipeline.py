"""The driver: a traced lean program through the passes, then loops and segments.

**The order.** `PASSES` lists the passes in the order they analyse the program. A pass
that is not shared is merged on this rank's proposal alone and applied at once: the
next pass analyses the program it leaves. A shared pass is applied only after the ranks
have exchanged their proposals, in the order of `PASSES`. An `ahead` pass is the
exception: it is applied at once with this rank's own proposal, and the exchanges go on
until that proposal is the decision (see `base.Pass`). So the rows are analysed before
the calls to drop and applied after them: they count derivative calls, and a drop moves
none. `SETTLE` lists the passes analysed on the rewritten program; their proposals
travel in the rewrite's own exchange. The final stage follows: loops (loops.py),
segments (segments.py), and the compiled function.

**The exchanges.** Every cross-rank step goes through `exchange(what, thunk, share)`,
as `Coordinator.agree` makes it: one collective, which runs `thunk()` on every rank, raises
on every rank if it raised on any, and returns (its result, every rank's
`share(result)`). `lean_program` makes these, on every rank alike:
1. "agreeing on the lean path": every rank's shared proposals, or None where its
   program is not one chain. The program takes the lean path on every rank or on none.
2. "agreeing on the calls to drop", once per round, and no round where the first
   exchange agreed. Where the ranks proposed different calls to drop, each analyses the
   `ahead` pass again with only the common ones allowed, and the shared passes after
   it; they exchange those proposals again. The allowed calls shrink every round, so
   the rounds end.
3. "rewriting the program": every rank applies the decisions, runs the final stage and
   shares the proposals of `SETTLE`; their decisions are applied after it.
"""

import functools
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import jax
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

from .. import _ffi
from .._errors import DistopError
from . import fold, fuse, identity, loops, nested, rows, segments, unused
from .base import Context, Pass

PASSES: tuple[Pass[Any, Any], ...] = (identity.DropIdentityProducts(), fold.FoldKnown(),
                                      rows.KnownRows(), unused.DropUnused(), fuse.Fuse())
SETTLE: tuple[Pass[Any, Any], ...] = (fuse.AgreeRows(),)

Result = TypeVar("Result")
Shared = TypeVar("Shared")


class Exchange(Protocol):
    """`exchange(what, thunk, share) -> (thunk(), every rank's share(thunk()))`."""

    def __call__(self, what: str, thunk: Callable[[], Result],
                 share: Callable[[Result], Shared]) -> tuple[Result, list[Shared]]: ...


Outputs = dict[str, tuple[tuple[int, ...], Any]]  # name -> (shape, dtype)
# (function, outputs, program) as traced: the fields of a `LeanProgram`
Found = tuple[Callable[..., Any], Outputs, ClosedJaxpr]


class LeanProgram(NamedTuple):
    """A program of the lean path.

    Fields: `fn` (the jitted function: token, inputs, extra arguments -> packed
    results, token), `outputs` (name -> (shape, dtype) of its results before packing),
    `closed` (the program before loops and segments: its schedule).
    """

    fn: Callable[..., Any]
    outputs: Outputs
    closed: ClosedJaxpr


class Proposed(NamedTuple):
    """This rank's side of an exchange of proposals.

    Fields: `analysed` (the program the first shared `ahead` pass analysed, which it
    analyses again in later rounds), `program` (the program with the passes applied
    so far: those that are not shared, and `ahead` passes with this rank's proposal),
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
    if found is not None and _ffi.chained(found[2]):
        invars = found[2].jaxpr.invars
        first = len(invars) - len(specs)
        context = Context(tuple(first + i for i in unit_seeds), fuse)
    # A program with calls inside its own loops or branches (see nested.py) is compiled
    # as traced: the passes read the chain's calls at the top level only.
    inside = found is not None and nested.nested(found[2].jaxpr)
    passes, settle = ((), ()) if inside else (PASSES, SETTLE)
    given, offered = exchange(
        f"{name}: agreeing on the lean path",
        lambda: None if found is None or context is None else propose(found[2], context,
                                                                      passes),
        lambda proposed: None if proposed is None else proposed.proposals)
    every = [proposals for proposals in offered if proposals is not None]
    # (proposals of as many passes on every rank: the ranks agree on `inside`)
    if len(every) < len(offered) or len({len(p) for p in every}) > 1:
        return None
    # every rank proposed, this one too: its program is one chain
    assert found is not None and context is not None and given is not None
    mine = given
    shared = [step for step in passes if step.shared]
    decisions = [step.merge([p[j] for p in every]) for j, step in enumerate(shared)]
    ahead = next((j for j, step in enumerate(shared) if step.ahead), None)
    while ahead is not None and not shared[ahead].agreed(decisions[ahead]):
        context = shared[ahead].again(context, decisions[ahead])
        rest = passes[passes.index(shared[ahead]):]
        assert mine.analysed is not None  # set by the `ahead` pass, which `propose` ran
        mine, every = exchange(f"{name}: agreeing on the calls to drop",
                               functools.partial(propose, mine.analysed, context, rest),
                               lambda proposed: proposed.proposals)
        decisions[ahead:] = [step.merge([p[j] for p in every])
                             for j, step in enumerate(shared[ahead:])]

    def rewrite() -> LeanProgram:
        program = mine.program
        for step, decision in zip(shared, decisions):
            if not step.ahead:
                program = step.apply(program, decision)
        if not _ffi.chained(program):
            raise DistopError("the rewritten program is not one chain")
        return compiled(LeanProgram(*found), program, inputs, specs)

    lean, every = exchange(f"{name}: rewriting the program", rewrite,
                           lambda made: tuple(step.analyse(made.closed, context)
                                              for step in settle))
    for j, step in enumerate(settle):
        step.apply(lean.closed, step.merge([p[j] for p in every]))
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
        if step.ahead and analysed is None:
            analysed = program
        if not step.shared or step.ahead:
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
        weakref.finalize(fn, _ffi.release, looped.calls)
    fn.trace(jax.ShapeDtypeStruct((), _ffi.token_dtype()), inputs, *specs)
    return LeanProgram(fn, found.outputs, program)


def function(run: Callable[..., list[Any]]) -> Any:
    """**Returns:** `run` (flat arguments -> flat results) jitted as a program is called:
    (token, inputs, extra arguments) -> the results, as a tuple."""
    return jax.jit(lambda *args: tuple(run(*jax.tree.leaves(args))))
