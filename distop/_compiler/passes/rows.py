"""Derivative calls given only the batch rows their constant (co)tangents can be
nonzero in.

Where a derivative call's (co)tangents are constants of the program (folded from the
unit seeds: see fold.py), the rows it needs are known when the program is built: it is
passed only their span, and its results are padded back with zeros (docs/architecture.md,
"Rows known ahead").
"""

import itertools
from collections.abc import Sequence

import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, new_jaxpr_eqn

from ..._compat import ShapedArray
from ..jaxprs import is_lean, shaped, variables
from .base import NONE, Context, Pass

Spans = dict[int, tuple[int, int]]  # derivative position -> (start, stop) of its rows


class KnownRows(Pass[Spans, Spans]):
    """Derivative calls narrowed to the rows their constant (co)tangents fill.

    Proposal: this rank's spans (`known_rows`). Decision: for each call every rank
    found, the union of the ranks' nonzero spans, so that every rank passes the same
    rows to the same collectives.
    """

    shared = True

    def analyse(self, program: ClosedJaxpr, context: Context) -> Spans:
        """**Returns:** `known_rows(program)`."""
        return known_rows(program)

    def merge(self, proposals: Sequence[Spans]) -> Spans:
        """**Returns:** the rows a derivative call needs on some rank, for the calls
        every rank found."""
        spans = {}
        for position in set.intersection(*(set(s) for s in proposals)):
            some = [s[position] for s in proposals if s[position][0] < s[position][1]]
            spans[position] = ((min(a for a, _ in some), max(b for _, b in some)) if some
                               else (0, 0))
        return spans

    dimensions = 1

    def sizes(self, proposal: Spans) -> tuple[int, ...]:
        """**Returns:** one more than the last position found (0 for none)."""
        return (max(proposal, default=-1) + 1,)

    def encode(self, proposal: Spans, sizes: tuple[int, ...]) -> np.ndarray:
        """**Returns:** per position: whether this rank did not find it, minus the start
        of its span and its stop (`NONE` where it has no rows)."""
        every = np.full((sizes[0], 3), NONE, np.int64)
        every[:, 0] = 1
        for position, (start, stop) in proposal.items():
            every[position, 0] = 0
            if start < stop:
                every[position, 1:] = (-start, stop)
        return every.ravel()

    def decode(self, largest: np.ndarray, sizes: tuple[int, ...]) -> Spans:
        """**Returns:** the union of the ranks' rows, for the calls every rank found."""
        every = largest.reshape(sizes[0], 3)
        return {int(p): ((0, 0) if every[p, 1] == NONE
                         else (int(-every[p, 1]), int(every[p, 2])))
                for p in np.flatnonzero(every[:, 0] == 0)}

    def apply(self, program: ClosedJaxpr, decision: Spans) -> ClosedJaxpr:
        """**Returns:** `narrow(program, decision)`, or `program` if nothing narrows."""
        return narrow(program, decision) or program


def known_rows(closed_jaxpr: ClosedJaxpr) -> Spans:
    """The batch rows each derivative call is given nonzero (co)tangents in, where the
    program fixes them: calls that may skip zero rows (`HostCall.skippable`) whose
    batched arguments are all constants of the program (the cotangents folded from the
    unit seeds: see `fold_known`). In the matvec's forward variant, operator k's
    cotangents are zero but in row k.

    **Returns:** derivative position (the derivative calls counted from 0 in chain
    order: none is ever dropped) -> (first, last + 1) of its nonzero rows on this rank,
    (0, 0) if there are none.
    """
    jaxpr = closed_jaxpr.jaxpr
    consts = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    # A call whose results another call reads as they are keeps its rows: narrowing it
    # would change which calls fusion may join, agreed on the program as it is. (Left
    # out here, it is left out on every rank: only calls every rank finds are narrowed.)
    read_by_calls = {v for e in jaxpr.eqns if is_lean(e) for v in variables(e.invars[1:])}
    found = {}
    for position, eqn in enumerate(e for e in jaxpr.eqns if is_lean(e)
                                   and e.params["call"].phase != "forward"):
        call, args = eqn.params["call"], eqn.invars[1:]
        if not call.skippable or any(v in read_by_calls for v in eqn.outvars[1:]) or not all(
                isinstance(a, Var) and a in consts
                for a, levels in zip(args, call.levels) if levels[0]):
            continue
        n = call.batch_shape[0]
        rows = np.logical_or.reduce([np.asarray(consts[a]).reshape(n, -1).any(axis=1)
                                     for a in args[:call.n_linear]]).nonzero()[0]
        found[position] = (int(rows[0]), int(rows[-1]) + 1) if len(rows) else (0, 0)
    return found


def narrow(closed_jaxpr: ClosedJaxpr, spans: Spans) -> ClosedJaxpr | None:
    """The program with each derivative call in `spans` given only the rows of its batch
    in its span (its constant batched arguments sliced), its results padded with zeros
    back to the whole batch: zero (co)tangents give zero results, so the values are the
    same, and the call no longer looks for its nonzero rows, zeroes, or returns, the
    others. The ranks pass the same spans (the union of theirs), so that every rank
    passes the same rows to the same collectives.

    **Arguments:**
    - `closed_jaxpr`: a lean program.
    - `spans`: derivative position -> (start, stop), as from `known_rows`.

    **Returns:** the rewritten `ClosedJaxpr`, or None if no call is narrowed.
    """
    jaxpr = closed_jaxpr.jaxpr
    consts = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
    eqns, added, placed, position = [], {}, {}, -1
    for eqn in jaxpr.eqns:
        call = eqn.params.get("call")
        if not is_lean(eqn) or call.phase == "forward":
            eqns.append(eqn)
            continue
        position += 1
        start, stop = spans.get(position, (0, 0))
        n = call.batch_shape[0] if call.batch_shape else 0
        if not 0 <= start < stop <= n or stop - start == n:
            eqns.append(eqn)
            continue
        invars = [eqn.invars[0]]
        for a, levels in zip(eqn.invars[1:], call.levels):
            if levels[0]:
                value = np.ascontiguousarray(np.asarray(consts[a])[start:stop])
                a = Var(ShapedArray(value.shape, value.dtype))
                added[a] = value
            invars.append(a)
        small = [Var(ShapedArray((stop - start,) + v.aval.shape[1:], v.aval.dtype))
                 for v in eqn.outvars[1:]]
        eqns.append(new_jaxpr_eqn(invars, [eqn.outvars[0], *small], eqn.primitive,
                                  {"call": call.narrowed(stop - start)}, eqn.effects,
                                  eqn.source_info, eqn.ctx))
        for part, whole in zip(small, eqn.outvars[1:]):
            config = ((start, n - stop, 0),) + ((0, 0, 0),) * (whole.aval.ndim - 1)
            zero = Literal(np.zeros((), whole.aval.dtype), ShapedArray((), whole.aval.dtype))
            eqns.append(new_jaxpr_eqn([part, zero], [whole], lax.pad_p,
                                      {"padding_config": config}, set()))
            placed[whole] = (part, start)
    if not added:
        return None
    eqns = _placed_sums(eqns, placed, jaxpr.outvars, added)
    read = set(variables(jaxpr.outvars)).union(*(variables(e.invars) for e in eqns))
    constvars = [v for v in jaxpr.constvars if v in read] + list(added)
    return ClosedJaxpr(Jaxpr(constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects,
                             jaxpr.debug_info),
                       [consts[v] for v in constvars if v in consts] + list(added.values()))


def _placed_sums(eqns: list[JaxprEqn], placed: dict[Var, tuple[Var, int]],
                 outvars: Sequence[Var | Literal], added: dict[Var, np.ndarray],
                 ) -> list[JaxprEqn]:
    """`eqns` with every sum (`add_any`, as reverse mode accumulates cotangents) made of
    padded results alone, whose rows do not overlap, made one concatenation of them
    with zero blocks between: XLA's CPU code evaluates pads inside a fused sum element
    by element, every pad at every element, far slower than their concatenation. Such a
    sum adds nothing but zeros to each value, so its values are the same (a zero may
    change sign); a sum with other terms keeps its order (and so its rounding), with
    only its part of padded results alone replaced. Its zero blocks become constants in
    `added`.

    **Arguments:**
    - `eqns`: the equations, with the pads `narrow` made.
    - `placed`: each such pad's result -> (the rows it pads, where they start).
    - `outvars`: the program's results (never removed).
    - `added`: new constants (variable -> value), updated with the zero blocks.
    """
    results = set(variables(outvars))
    uses: dict[Var, int] = {}
    made = {v: e for e in eqns for v in e.outvars}
    for v in [v for e in eqns for v in variables(e.invars)]:
        uses[v] = uses.get(v, 0) + 1

    def only_here(v: Var) -> bool:  # read once, by a sum: it may go into its concatenation
        return uses.get(v) == 1 and v not in results

    # sum's result -> its padded parts, its sums
    parts: dict[Var, list[Var]] = {}
    inner: dict[Var, list[JaxprEqn]] = {}
    within: set[Var] = set()
    for eqn in eqns:
        args = variables(eqn.invars)
        if eqn.primitive.name != "add_any" or len(args) < len(eqn.invars) or not all(
                only_here(v) and (v in placed or v in parts) for v in args):
            continue
        out = eqn.outvars[0]
        parts[out] = [p for v in args for p in parts.get(v, [v])]
        inner[out] = [eqn] + [e for v in args for e in inner.get(v, [])]
        within.update(v for v in args if v in parts)
    gone, replace = set(), {}
    for out, padded in parts.items():
        spans = sorted(((placed[v][1], placed[v][1] + shaped(placed[v][0]).shape[0], v)
                        for v in padded), key=lambda span: span[:2])
        if out in within or any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            continue  # part of a larger such sum, or rows that overlap
        aval, pieces, at = shaped(out), [], 0
        for start, stop, term in spans + [(aval.shape[0], aval.shape[0], None)]:
            if start > at:
                zeros = Var(ShapedArray((start - at,) + aval.shape[1:], aval.dtype))
                added[zeros] = np.zeros(shaped(zeros).shape, aval.dtype)
                pieces.append(zeros)
            if term is not None:
                pieces.append(placed[term][0])
                gone.add(id(made[term]))
            at = stop
        gone.update(id(e) for e in inner[out])
        replace[id(inner[out][0])] = new_jaxpr_eqn(pieces, [out], lax.concatenate_p,
                                                   {"dimension": 0}, set())
    return [replace.get(id(e), e) for e in eqns if id(e) not in gone or id(e) in replace]
