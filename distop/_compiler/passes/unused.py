"""Forward calls whose results nothing reads, taken off the chain.

Only the token keeps such a call in a lean program: this is the dead code elimination
that XLA applies to any unused computation. In `compute_totals`, where the outputs'
values are not returned, it drops every forward call that only they need (a reverse
sweep reads the operators' inputs, not their outputs): one call and its collectives
less per operator. Derivative calls always stay (every operator runs its VJP, with zero
cotangents where no output depends on it).
"""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

from ..jaxprs import chain_token, is_lean, positions, variables
from .base import Context, Pass


class Drops(NamedTuple):
    """The decision of `DropUnused`.

    Fields: `positions` (the chain positions of the calls that no rank reads, sorted),
    `unanimous` (whether every rank proposed exactly those).
    """

    positions: tuple[int, ...]
    unanimous: bool


class DropUnused(Pass[tuple[int, ...], Drops]):
    """Forward calls that no rank reads, dropped on every rank.

    Proposal: the chain positions of the forward calls nothing reads on this rank (among
    `context.allowed`). What a call's results feed can depend on the rank's block sizes
    (JAX's derivative of `prod` over one row reads nothing), so a call is dropped only
    where no rank reads it; a call kept for another rank may read a result this rank
    could drop. So the pass runs `optimistic`: where the ranks' proposals differ, the driver
    analyses it again with only the calls every rank proposed allowed, until they agree.
    """

    shared = True
    optimistic = True

    def analyse(self, program: ClosedJaxpr, context: Context) -> tuple[int, ...]:
        """**Returns:** `unused_calls` of `program`, among `context.allowed`."""
        return unused_calls(program.jaxpr, context.allowed)

    def merge(self, proposals: Sequence[tuple[int, ...]]) -> Drops:
        """**Returns:** the calls every rank proposed, and whether all proposed the same."""
        common = set.intersection(*(set(p) for p in proposals))
        return Drops(tuple(sorted(common)), len(set(proposals)) == 1)

    dimensions = 1

    def sizes(self, proposal: tuple[int, ...]) -> tuple[int, ...]:
        """**Returns:** one more than the last position proposed (0 for none)."""
        return (max(proposal, default=-1) + 1,)

    def encode(self, proposal: tuple[int, ...], sizes: tuple[int, ...]) -> np.ndarray:
        """**Returns:** per position, whether this rank did not propose it, then
        whether it did."""
        proposed = np.zeros(sizes[0], np.int64)
        proposed[list(proposal)] = 1
        return np.concatenate([1 - proposed, proposed])

    def decode(self, largest: np.ndarray, sizes: tuple[int, ...]) -> Drops:
        """**Returns:** the positions no rank left out; agreed where no position was
        proposed by some ranks and left out by others."""
        left_out, proposed = largest[:sizes[0]], largest[sizes[0]:]
        common = tuple(int(p) for p in np.flatnonzero(left_out == 0))
        return Drops(common, not bool(((left_out == 1) & (proposed == 1)).any()))

    def apply(self, program: ClosedJaxpr, decision: Drops) -> ClosedJaxpr:
        """**Returns:** `program` without the decided calls (`drop_calls`)."""
        return drop_calls(program, decision.positions)

    def unanimous(self, decision: Drops) -> bool:
        """Whether every rank proposed the calls `decision` drops."""
        return decision.unanimous

    def again(self, context: Context, decision: Drops) -> Context:
        """**Returns:** `context` with only the calls every rank proposed allowed."""
        return dataclasses.replace(context, allowed=frozenset(decision.positions))


def unused_calls(jaxpr: Jaxpr, allowed: frozenset[int] | None = None) -> tuple[int, ...]:
    """One backward pass over `jaxpr`: the lean forward calls whose results nothing
    reads, or only operations whose own results nothing reads.

    **Arguments:**
    - `jaxpr`: a traced program whose lean calls form one chain.
    - `allowed`: the chain positions (the lean calls counted from 0) of the calls that
      may go (None: any).

    **Returns:** the chain positions of such calls, sorted.
    """
    position = positions(jaxpr)
    live, dropped = set(variables(jaxpr.outvars)), []
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if (is_lean(eqn) and eqn.params["call"].phase == "forward"
                and (allowed is None or position[i] in allowed)
                and not any(v in live for v in eqn.outvars[1:])):
            dropped.append(position[i])
            if eqn.outvars[0] in live:  # the token goes on, past the call
                live.add(chain_token(eqn))
        elif is_lean(eqn) or eqn.effects or any(v in live for v in eqn.outvars):
            live.update(variables(eqn.invars))
    return tuple(sorted(dropped))


def drop_calls(closed_jaxpr: ClosedJaxpr, dropped: Sequence[int]) -> ClosedJaxpr:
    """The program without the lean calls at chain positions `dropped` (whose results
    nothing reads: see `unused_calls`), and without the operations that read their
    results (unused too). The schedule, agreed after this, lists them as not made.

    **Returns:** the rewritten `ClosedJaxpr`, or `closed_jaxpr` itself if `dropped` is
    empty.
    """
    if not dropped:
        return closed_jaxpr
    jaxpr, drop = closed_jaxpr.jaxpr, set(dropped)
    indices = {i for i, p in positions(jaxpr).items() if p in drop}
    # Everything else stays (XLA removes what is unused), but what reads a dropped
    # call's results, which can only be unused as well.
    rename: dict[Var, Var] = {}
    gone, eqns = set(), []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in indices:
            token = chain_token(eqn)
            rename[eqn.outvars[0]] = rename.get(token, token)
            gone.update(eqn.outvars[1:])
        elif any(v in gone for v in variables(eqn.invars)):
            gone.update(eqn.outvars)
        else:
            eqns.append(eqn.replace(invars=[rename.get(v, v) if isinstance(v, Var) else v
                                            for v in eqn.invars]))
    outvars = [rename.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    new = Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, eqns, jaxpr.effects,
                jaxpr.debug_info)
    return ClosedJaxpr(new, closed_jaxpr.consts)
