"""Runs of neighbours on the token chain fused into one host call.

Two neighbours on the chain are independent when the later one reads nothing the
earlier one computed (other than the token). A run of such neighbours, or of calls each
reading the results of the ones before it as they are, is replaced by one `FusedCall`,
which runs its members one after another, in chain order, in one host call: the same
user methods, the same collectives in the same order, one dispatch instead of many. The
rest of the program is reordered around the fused call (a topological order that keeps
the original order wherever it can), and the result is again one chain.
"""

import heapq
from collections.abc import Sequence

import numpy as np
from jax.extend.core import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    new_jaxpr_eqn,
)

from ..._hostcalls.fused import FusedCall, Wiring
from ..._operators.primitive import host_call_p
from ..jaxprs import is_lean, lean_calls, other_effects, positions, variables
from .base import Context, Pass

Joins = tuple[bool, ...]  # per lean call in chain order: whether it joins the one before


class Fuse(Pass[Joins | None, Joins | None]):
    """Neighbouring calls fused where every rank can fuse them.

    Proposal: where this rank's program could join its calls (`fusion_joins`), or None
    without fusion. What a call reads can depend on the rank's block sizes (JAX's
    derivatives of some operations on one row or none read nothing), so the decision
    joins a call only where every rank can (None: no fusion, or programs of different
    lengths, which the schedule check reports).
    """

    shared = True

    def analyse(self, program: ClosedJaxpr, context: Context) -> Joins | None:
        """**Returns:** `fusion_joins(program)`, or None if `context` says not to fuse."""
        return fusion_joins(program) if context.fuse else None

    def merge(self, proposals: Sequence[Joins | None]) -> Joins | None:
        """**Returns:** per call, whether every rank can join it; None if a rank does not
        fuse or the ranks' chains differ in length."""
        every = [j for j in proposals if j is not None]
        if len(every) < len(proposals) or any(len(j) != len(every[0]) for j in every):
            return None
        return tuple(map(all, zip(*every)))

    dimensions = 1

    def sizes(self, proposal: Joins | None) -> tuple[int, ...]:
        """**Returns:** the length of the chain (0 without fusion)."""
        return (0 if proposal is None else len(proposal),)

    def encode(self, proposal: Joins | None, sizes: tuple[int, ...]) -> np.ndarray:
        """**Returns:** whether this rank does not fuse, its chain's length and minus
        it, then per call whether it cannot join it."""
        if proposal is None:
            return np.concatenate([[1, 0, 0], np.ones(sizes[0], np.int64)])
        apart = np.ones(sizes[0], np.int64)
        apart[:len(proposal)] = np.logical_not(proposal)
        return np.concatenate([[0, len(proposal), -len(proposal)], apart])

    def decode(self, largest: np.ndarray, sizes: tuple[int, ...]) -> Joins | None:
        """**Returns:** per call, whether every rank can join it; None if a rank does not
        fuse or the ranks' chains differ in length."""
        if largest[0] or largest[1] != -largest[2]:
            return None
        return tuple(bool(a == 0) for a in largest[3:3 + largest[1]])

    def apply(self, program: ClosedJaxpr, decision: Joins | None) -> ClosedJaxpr:
        """**Returns:** `program` with the decided runs fused, or `program` itself."""
        if decision is None:
            return program
        return fuse(program, host_call_p, decision) or program


Agreeing = tuple[tuple[int, ...], ...]  # per fused call: the members agreeing on rows


class AgreeRows(Pass[Agreeing, Agreeing | None]):
    """Which members of each fused call agree on their nonzero rows across ranks.

    Proposal: per fused call of the rewritten program, the members that would agree on
    their rows by this rank's wiring (`FusedCall.agreeing`), which follows the data flow
    into it and so can depend on the rank's block sizes. Decision: per fused call, the
    members every rank proposed (None where the ranks' programs have different numbers
    of fused calls: then none agrees). Applying it sets the fused calls themselves and
    returns the program as it is.
    """

    shared = True

    def analyse(self, program: ClosedJaxpr, context: Context) -> Agreeing:
        """**Returns:** per fused call of `program`, its agreeing members here."""
        return tuple(c.agreeing for c in fused_calls(program))

    def merge(self, proposals: Sequence[Agreeing]) -> Agreeing | None:
        """**Returns:** per fused call, the members every rank proposed; None if the
        ranks found different numbers of fused calls."""
        if len({len(p) for p in proposals}) != 1:
            return None
        return tuple(tuple(sorted(set.intersection(*(set(p[i]) for p in proposals))))
                     for i in range(len(proposals[0])))

    dimensions = 2

    def sizes(self, proposal: Agreeing) -> tuple[int, ...]:
        """**Returns:** the number of fused calls, and one more than the last member
        proposed."""
        return (len(proposal), max((max(m, default=-1) for m in proposal), default=-1) + 1)

    def encode(self, proposal: Agreeing, sizes: tuple[int, ...]) -> np.ndarray:
        """**Returns:** the number of fused calls and minus it, then per fused call and
        member whether this rank did not propose it."""
        n_calls, members = sizes
        left_out = np.ones((n_calls, members), np.int64)
        for i, agreeing in enumerate(proposal):
            left_out[i, list(agreeing)] = 0
        return np.concatenate([[len(proposal), -len(proposal)], left_out.ravel()])

    def decode(self, largest: np.ndarray, sizes: tuple[int, ...]) -> Agreeing | None:
        """**Returns:** per fused call, the members every rank proposed; None if the
        ranks found different numbers of fused calls."""
        if largest[0] != -largest[1]:
            return None
        left_out = largest[2:].reshape(sizes)
        return tuple(tuple(int(m) for m in np.flatnonzero(row == 0)) for row in left_out)

    def apply(self, program: ClosedJaxpr, decision: Agreeing | None) -> ClosedJaxpr:
        """**Returns:** `program`, its fused calls set to agree on the decided members."""
        for i, call in enumerate(fused_calls(program)):
            call.agree_on(() if decision is None else decision[i])
        return program


def fused_calls(program: ClosedJaxpr) -> list[FusedCall]:
    """**Returns:** the fused calls of a program, in program order."""
    return [c for c in lean_calls(program.jaxpr) if isinstance(c, FusedCall)]


def fusion_joins(closed_jaxpr: ClosedJaxpr) -> Joins:
    """**Returns:** per lean call in chain order, whether `fuse` would join it to the
    call before it (see `_groups`); all False where `fuse` fuses nothing."""
    jaxpr = closed_jaxpr.jaxpr
    position = positions(jaxpr)
    joins = [False] * len(position)
    if not other_effects(jaxpr):
        for group in _groups(jaxpr)[0]:
            for i in group[1:]:
                joins[position[i]] = True
    return tuple(joins)


def fuse(closed_jaxpr: ClosedJaxpr, primitive: Primitive,
         allowed: Joins | None = None) -> ClosedJaxpr | None:
    """Fuse runs of neighbours on a proven token chain (see `_groups`).

    **Arguments:**
    - `closed_jaxpr`: a traced program whose lean calls form one chain at top level (as
      checked by `jaxprs.chained`).
    - `primitive`: the host-call primitive to bind for fused calls.
    - `allowed`: per lean call in chain order, whether it may join the call before it
      (None: wherever it can). What a call reads can depend on the rank's block sizes
      (JAX's derivatives of some operations on one row or none read nothing), so
      `Fuse` lets a call join only where it can on every rank (`fusion_joins`).

    **Returns:** the rewritten `ClosedJaxpr`, or None if no two calls can be fused (or
    the program has other effects, whose order a reordering could change).
    """
    jaxpr = closed_jaxpr.jaxpr
    if other_effects(jaxpr):
        return None
    groups, uses = _groups(jaxpr, allowed)
    if all(len(g) == 1 for g in groups):
        return None
    order = _topological(_nodes(jaxpr, groups, uses, primitive))
    new = Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, order, jaxpr.effects,
                jaxpr.debug_info)
    return ClosedJaxpr(new, closed_jaxpr.consts)


def _groups(jaxpr: Jaxpr, allowed: Joins | None = None,
            ) -> tuple[list[list[int]], dict[Var, int]]:
    """The chain's calls (equation indices), cut into runs that one host call can run:
    each call of a run reads only values computed before the run or results of the
    calls before it in the run, as they are (no XLA operation in between), and joins
    the run only where `allowed` (per chain position; None: everywhere) says it may."""
    uses: dict[Var, int] = {}
    for v in [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars):
        if isinstance(v, Var):
            uses[v] = uses.get(v, 0) + 1
    # var -> bit set of the chain calls it depends on (through data, not token)
    deps: dict[Var, int] = {}
    groups: list[list[int]] = []
    made: set[Var] = set()
    mask, position = 0, 0
    previous_token: Var | None = None  # (set with the first group)
    for i, eqn in enumerate(jaxpr.eqns):
        lean = is_lean(eqn)
        reads = [v for v in (eqn.invars[1:] if lean else eqn.invars) if isinstance(v, Var)]
        need = 0
        for v in reads:
            need |= deps.get(v, 0)
        if lean:
            bit = 1 << position
            position += 1
            joins = (groups and previous_token is not None and uses.get(previous_token, 0) == 1
                     and (allowed is None or allowed[position - 1])
                     and all(v in made or not deps.get(v, 0) & mask for v in reads))
            if joins:
                groups[-1].append(i)
                mask |= bit
            else:
                groups.append([i])
                mask, made = bit, set()
            made.update(eqn.outvars[1:])
            previous_token = eqn.outvars[0]
            need |= bit
        for v in eqn.outvars:
            deps[v] = need
    return groups, uses


def _nodes(jaxpr: Jaxpr, groups: list[list[int]], uses: dict[Var, int],
           primitive: Primitive) -> list[tuple[int, JaxprEqn]]:
    """**Returns:** (original position, equation) for every equation, with each group
    of calls replaced by one fused equation at the position of its first call."""
    eqns = jaxpr.eqns
    member = {i: g for g in groups for i in g}
    outside = {v for v in jaxpr.outvars if isinstance(v, Var)}
    nodes = []
    for i, eqn in enumerate(eqns):
        group = member.get(i)
        if group is None or len(group) == 1:
            nodes.append((i, eqn))
            continue
        if i != group[0]:
            continue
        call_eqns = [eqns[j] for j in group]
        inputs, wiring, results, made = _wiring(call_eqns)
        # a result leaves the fused call unless only later calls of the group read it
        inner_reads: dict[Var, int] = {}
        for e in call_eqns:
            for v in variables(e.invars[1:]):
                if v in made:
                    inner_reads[v] = inner_reads.get(v, 0) + 1
        returned = [k for k, v in enumerate(results)
                    if v in outside or uses.get(v, 0) > inner_reads.get(v, 0)]
        call = FusedCall([e.params["call"] for e in call_eqns], wiring, tuple(returned))
        first, last = call_eqns[0], call_eqns[-1]
        nodes.append((i, new_jaxpr_eqn([first.invars[0]] + list(inputs),
                                       [last.outvars[0]] + [results[k] for k in returned],
                                       primitive, {"call": call}, first.effects,
                                       first.source_info, first.ctx)))
    return nodes


def _wiring(call_eqns: Sequence[JaxprEqn],
            ) -> tuple[list[Var | Literal], Wiring, list[Var], dict[Var, int]]:
    """How the calls of one fused call read their arguments.

    **Returns:** (the fused call's inputs, per call its `FusedCall` wiring, the calls'
    results in order, variable -> its index among them). An input read by several
    calls is passed once; a literal takes a place of its own.
    """
    made: dict[Var, int] = {}
    inputs: list[Var | Literal] = []
    index: dict[Var, int] = {}
    wiring: list[tuple[tuple[bool, int], ...]] = []
    results: list[Var] = []
    for e in call_eqns:
        wires = []
        for v in e.invars[1:]:
            if isinstance(v, Var) and v in made:
                wires.append((True, made[v]))
            elif isinstance(v, Var) and v in index:
                wires.append((False, index[v]))
            else:
                if isinstance(v, Var):
                    index[v] = len(inputs)
                wires.append((False, len(inputs)))
                inputs.append(v)
        wiring.append(tuple(wires))
        for v in e.outvars[1:]:
            made[v] = len(results)
            results.append(v)
    return inputs, tuple(wiring), results, made


def _topological(nodes: list[tuple[int, JaxprEqn]]) -> list[JaxprEqn]:
    """The nodes in a topological order, earliest original position first."""
    producer = {}
    for k, (_, eqn) in enumerate(nodes):
        for v in eqn.outvars:
            producer[v] = k
    waiting: list[int] = []
    users: dict[int, list[int]] = {}
    for k, (_, eqn) in enumerate(nodes):
        before = {producer[v] for v in eqn.invars if isinstance(v, Var) and v in producer}
        waiting.append(len(before))
        for p in before:
            users.setdefault(p, []).append(k)
    ready = [(nodes[k][0], k) for k in range(len(nodes)) if waiting[k] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(nodes[k][1])
        for u in users.get(k, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (nodes[u][0], u))
    if len(order) != len(nodes):  # cannot happen for runs of chain neighbours
        raise AssertionError("distop fusion: the rewritten program has a cycle")
    return order
