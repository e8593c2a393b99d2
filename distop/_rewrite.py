"""Rewrites of a proven lean program: fusion of host calls, loops, and segments (and,
before fusion, simplifications: products with unit seeds, values known ahead, unused
calls).

**Fusion.** A traced lean program (see _ffi.py) runs its communicating calls along one token chain.
Two neighbours on the chain are independent when the later one reads nothing the earlier
one computed (other than the token). A run of such neighbours is replaced by one
`FusedCall`, which runs its members one after another, in chain order, in one host call:
the same user methods, the same collectives in the same order, one dispatch instead of
many (under MPI, a fused group may also skip the (co)tangent rows that are zero on every
rank: `FusedCall._agree_rows`). The rest of the program is reordered around the fused
call (a topological order that keeps the original order wherever it can), and the
result is again one chain.

**Segments.** XLA's CPU runtime orders a program's operations by comparing each one with
every earlier one when it builds the executable, so a flat program of thousands of host
calls compiles in time that grows with their square (measured: the step after code
generation takes 0.11 s for 1000 calls, 0.87 s for 2000, 4.7 s for 4000). A long chain
is therefore cut into segments of `SEGMENT` host calls, each run as the taken branch of
a `lax.cond` on the token (`token >= 0`, always true, unknown to XLA, so the branch is
kept): every branch is a small program of its own, and compile time grows linearly. The
token still runs through every call in order; the other branch would return a NaN
token, which the count of calls checked after every run would catch.

**Loops.** Before the segments, a stretch of the program repeated at least `REPEATS`
times (a Python loop over operator calls) is rolled into one `lax.scan` (see `rolled`;
each loop is then a segment of its own):
XLA compiles one repetition, where it would compile each, at 0.6-1 ms per host call
and more than linearly in their number (buffer assignment).
"""

import functools
import heapq
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, Var, jaxpr_as_fun, new_jaxpr_eqn

from . import _safety
from ._callback import rows_of
from ._compat import ShapedArray
from ._ffi import has_lean
from ._runtime import mpi

SEGMENT = 64  # host calls per segment of a long chain


class FusedCall:
    """Several lean `HostCall`s run by one host call, in order.

    **Arguments:**
    - `members`: the `HostCall`s, in chain order.
    - `wiring`: per member, per argument: `(False, k)` for the fused call's argument k,
      or `(True, k)` for result k of the members before it (counted over all of them).
    - `returned`: the member results (same counting) that leave the fused call, in order.
    """

    lean = ordered = True
    phase = "fused"

    def __init__(self, members, wiring, returned):
        self.members, self.wiring, self.returned = tuple(members), wiring, returned
        self.ffi_id = None  # set when lowered (see _ffi.register)
        # per member: where its results sit in XLA's buffers, if all of them leave
        where, start, self._offers = {k: i for i, k in enumerate(returned)}, 0, []
        for member in self.members:
            mine = range(start, start + len(member.result_specs))
            self._offers.append(None if any(k not in where for k in mine)
                                else [where[k] for k in mine])
            start = mine.stop
        self._agreeing, self._comm = self._members_agreeing_on_rows()

    @property
    def agreeing(self):
        """The members that skip zero (co)tangent rows on rows the fused call agrees
        across ranks, by this rank's wiring (see `agree_on`)."""
        return self._agreeing

    def agree_on(self, members):
        """Agree rows for `members` only (the agreeing members of every rank: the
        Allreduce of `_agree_rows` runs on every rank or none), at least two of them."""
        self._agreeing = tuple(sorted(members)) if len(members) >= 2 else ()

    def __repr__(self):
        return f"fused[{', '.join(map(repr, self.members))}]"

    def shapes(self):
        """**Returns:** the `jax.ShapeDtypeStruct`s of the returned results."""
        every = [s for m in self.members for s in m.shapes()]
        return tuple(every[k] for k in self.returned)

    def __call__(self, *args, out=None):
        """Run the members in order; `out`: XLA's buffers of the returned results, each
        offered to the member that computes it when all of its results are returned."""
        rows = self._agree_rows(args) if self._agreeing else {}
        results = []
        for i, (member, wiring, offer) in enumerate(zip(self.members, self.wiring,
                                                        self._offers)):
            given = None if out is None or offer is None else [out[k] for k in offer]
            results.extend(member(*[_read_only(results[k]) if inner else args[k]
                                    for inner, k in wiring],
                                  out=given, rows=rows.get(i, False)))
        return [results[k] for k in self.returned]

    def _members_agreeing_on_rows(self):
        """**Returns:** (the members that skip zero (co)tangent rows on rows agreed by
        the fused call, their communicator): members that can skip rows, whose
        (co)tangents come from outside the fused call, on one communicator with more
        than one rank, if there are at least two of them (else none)."""
        chosen, comm = [], None
        for i, (member, wiring) in enumerate(zip(self.members, self.wiring)):
            if (member.skippable and not any(inner for inner, _ in wiring[:member.n_linear])
                    and (comm is None or member.comm is comm)):
                chosen.append(i)
                comm = member.comm
        if len(chosen) < 2 or comm is None or comm.Get_size() == 1:
            return (), None
        return tuple(chosen), comm

    def _agree_rows(self, args):
        """The nonzero (co)tangent rows of the agreeing members, agreed across ranks
        with ONE collective, so that they call their methods on the same rows
        everywhere.

        **Returns:** member index -> rows (None: every row).
        """
        masks = [self.members[i].row_mask(
            [args[k] for _, k in self.wiring[i][:self.members[i].n_linear]])
            for i in self._agreeing]
        every = np.concatenate(masks).astype(np.uint8)
        with _safety.watchdog.watch("fused call: agreeing on the nonzero rows"):
            self._comm.Allreduce(mpi().IN_PLACE, every, op=mpi().MAX)
        found, start = {}, 0
        for i, mask in zip(self._agreeing, masks):
            found[i] = rows_of(every[start:start + mask.size].astype(bool))
            start += mask.size
        return found


def _read_only(array):
    """A read-only view: a member's result, passed to the next, may be XLA's buffer of
    a program result (methods get read-only arguments everywhere)."""
    view = array.view()
    view.flags.writeable = False
    return view


def _lean(eqn):
    return getattr(eqn.params.get("call"), "lean", False)


def _positions(jaxpr):
    """**Returns:** equation index -> chain position (counted from 0) of the lean calls."""
    return {i: p for p, i in enumerate(i for i, e in enumerate(jaxpr.eqns) if _lean(e))}


def _other_effects(jaxpr):
    """Whether `jaxpr` has effects besides its lean calls, whose order a reordering of
    the program could change (then nothing is fused)."""
    return any(eqn.effects and not _lean(eqn) for eqn in jaxpr.eqns)


def fusion_joins(closed_jaxpr):
    """**Returns:** per lean call in chain order, whether `fuse` would join it to the
    call before it (see `_groups`); all False where `fuse` fuses nothing."""
    jaxpr = closed_jaxpr.jaxpr
    position = _positions(jaxpr)
    joins = [False] * len(position)
    if not _other_effects(jaxpr):
        for group in _groups(jaxpr)[0]:
            for i in group[1:]:
                joins[position[i]] = True
    return tuple(joins)


def fuse(closed_jaxpr, primitive, allowed=None):
    """Fuse runs of neighbours on a proven token chain (see `_groups`).

    **Arguments:**
    - `closed_jaxpr`: a traced program whose lean calls form one chain at top level (as
      checked by `_ffi.chained`).
    - `primitive`: the host-call primitive to bind for fused calls.
    - `allowed`: per lean call in chain order, whether it may join the call before it
      (None: wherever it can). What a call reads can depend on the rank's block sizes
      (JAX's derivatives of some operations on one row or none read nothing), so
      `Problem` lets a call join only where it can on every rank (`fusion_joins`).

    **Returns:** the rewritten `ClosedJaxpr`, or None if no two calls can be fused (or
    the program has other effects, whose order a reordering could change).
    """
    jaxpr = closed_jaxpr.jaxpr
    if _other_effects(jaxpr):
        return None
    groups, uses = _groups(jaxpr, allowed)
    if all(len(g) == 1 for g in groups):
        return None
    order = _topological(_nodes(jaxpr, groups, uses, primitive))
    new = Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, order, jaxpr.effects,
                jaxpr.debug_info)
    return ClosedJaxpr(new, closed_jaxpr.consts)


def _groups(jaxpr, allowed=None):
    """The chain's calls (equation indices), cut into runs that one host call can run:
    each call of a run reads only values computed before the run or results of the
    calls before it in the run, as they are (no XLA operation in between), and joins
    the run only where `allowed` (per chain position; None: everywhere) says it may."""
    uses = {}
    for v in [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars):
        if isinstance(v, Var):
            uses[v] = uses.get(v, 0) + 1
    deps = {}  # var -> bit set of the chain calls it depends on (through data, not token)
    groups, mask, made, position = [], 0, set(), 0
    previous_token = None
    for i, eqn in enumerate(jaxpr.eqns):
        lean = _lean(eqn)
        reads = [v for v in (eqn.invars[1:] if lean else eqn.invars) if isinstance(v, Var)]
        need = 0
        for v in reads:
            need |= deps.get(v, 0)
        if lean:
            bit = 1 << position
            position += 1
            joins = (groups and uses.get(previous_token, 0) == 1
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


def _nodes(jaxpr, groups, uses, primitive):
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
        calls = [eqns[j] for j in group]
        inputs, wiring, results, made = _wiring(calls)
        # a result leaves the fused call unless only later calls of the group read it
        inner_reads = {}
        for e in calls:
            for v in _vars(e.invars[1:]):
                if v in made:
                    inner_reads[v] = inner_reads.get(v, 0) + 1
        returned = [k for k, v in enumerate(results)
                    if v in outside or uses.get(v, 0) > inner_reads.get(v, 0)]
        call = FusedCall([e.params["call"] for e in calls], wiring, tuple(returned))
        nodes.append((i, new_jaxpr_eqn([calls[0].invars[0]] + list(inputs),
                                       [calls[-1].outvars[0]] + [results[k] for k in returned],
                                       primitive, {"call": call}, calls[0].effects,
                                       calls[0].source_info, calls[0].ctx)))
    return nodes


def _wiring(calls):
    """How the calls of one fused call read their arguments.

    **Returns:** (the fused call's inputs, per call its `FusedCall` wiring, the calls'
    results in order, variable -> its index among them). An input read by several
    calls is passed once; a literal takes a place of its own.
    """
    made, inputs, index, wiring, results = {}, [], {}, [], []
    for e in calls:
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


def _topological(nodes):
    """The nodes in a topological order, earliest original position first."""
    producer = {}
    for k, (_, eqn) in enumerate(nodes):
        for v in eqn.outvars:
            producer[v] = k
    waiting, users = [], {}
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


# -- calls whose results nothing reads --------------------------------------------------
def drop_unused_calls(closed_jaxpr, allowed=None):
    """The program without the lean forward calls whose results nothing reads, and
    without the operations that read their results (unused too).

    Only the token keeps such a call in the program: the same dead code elimination that
    XLA applies to any unused computation. In `compute_totals`, where the outputs'
    values are not returned, this drops every forward call that only they need (a
    reverse sweep reads the operators' inputs, not their outputs): one call and its
    collectives less per operator. Derivative calls always stay (every operator runs its
    VJP, with zero cotangents where no output depends on it).

    **Arguments:**
    - `closed_jaxpr`: a traced program whose lean calls form one chain.
    - `allowed`: the chain positions (the lean calls counted from 0) of the calls that
      may go (None: any). `Problem` allows only those no rank reads (what a rank reads
      can depend on its block sizes: JAX's derivative of `prod` over one row reads
      nothing), so that every rank drops the same calls. The schedule, agreed after
      this, lists the dropped ones as not made.

    **Returns:** (the rewritten `ClosedJaxpr`, or `closed_jaxpr` itself if it drops
    nothing; the chain positions of the dropped calls).
    """
    jaxpr = closed_jaxpr.jaxpr
    dropped = _unused(jaxpr, allowed)
    if not dropped:
        return closed_jaxpr, ()
    # Everything else stays (XLA removes what is unused), but what reads a dropped
    # call's results, which can only be unused as well.
    rename, gone, eqns = {}, set(), []
    for i, eqn in enumerate(jaxpr.eqns):
        if i in dropped:
            rename[eqn.outvars[0]] = rename.get(eqn.invars[0], eqn.invars[0])
            gone.update(eqn.outvars[1:])
        elif any(v in gone for v in _vars(eqn.invars)):
            gone.update(eqn.outvars)
        else:
            eqns.append(eqn.replace(invars=[rename.get(v, v) if isinstance(v, Var) else v
                                            for v in eqn.invars]))
    outvars = [rename.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    new = Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, eqns, jaxpr.effects,
                jaxpr.debug_info)
    return ClosedJaxpr(new, closed_jaxpr.consts), tuple(sorted(dropped.values()))


def _unused(jaxpr, allowed):
    """One backward pass over `jaxpr`: the forward calls at chain positions in
    `allowed` (None: any) whose results nothing reads.

    **Returns:** equation index -> chain position of every such call."""
    positions = _positions(jaxpr)
    live, dropped = set(_vars(jaxpr.outvars)), {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        if (_lean(eqn) and eqn.params["call"].phase == "forward"
                and (allowed is None or positions[i] in allowed)
                and not any(v in live for v in eqn.outvars[1:])):
            dropped[i] = positions[i]
            if eqn.outvars[0] in live:  # the token goes on, past the call
                live.add(eqn.invars[0])
        elif _lean(eqn) or eqn.effects or any(v in live for v in eqn.outvars):
            live.update(_vars(eqn.invars))
    return dropped


# -- products with unit seeds ----------------------------------------------------------
def drop_identity_products(closed_jaxpr, identities, permutations=None):
    """The program with every product of an identity matrix and another array replaced
    by that array (transposed where the product's dimension order asks for it), and
    every product of a permutation matrix known ahead and another array by that array's
    entries in the permuted order.

    A reverse sweep over K unit seeds starts with products like `seeds @ W`: with
    `seeds` the identity that is W itself, but XLA computes it (for a (16, 1e6) W,
    about 150 ms and a fresh 122 MiB buffer). With the seeds in another order (the
    matvec's objectives `f0`, `f1`, ..., `f10` are seeded in the order of their names),
    it is W's rows in that order. The result is the exact product (where W holds
    infinities or NaNs, it is the derivative where the product would spread NaN; a
    negative zero of W stays one).

    **Arguments:**
    - `closed_jaxpr`: the traced program.
    - `identities`: its variables (inputs or constants) that hold identity matrices.
    - `permutations`: its constants that hold permutation matrices: variable -> value.

    **Returns:** the rewritten `ClosedJaxpr`, or None if it has no such product.
    """
    permutations = permutations or {}
    if not identities and not permutations:
        return None
    jaxpr, rename, eqns, dropped = closed_jaxpr.jaxpr, {}, [], False
    constvars, consts = list(jaxpr.constvars), list(closed_jaxpr.consts)
    for eqn in jaxpr.eqns:
        if rename:
            eqn = eqn.replace(invars=[rename.get(v, v) if isinstance(v, Var) else v
                                      for v in eqn.invars])
        found = _identity_product(eqn, identities, permutations)
        if found is None:
            eqns.append(eqn)
            continue
        other, permutation = found
        dropped = True
        if permutation is None:
            rename[eqn.outvars[0]] = other
        elif isinstance(permutation, tuple):
            eqns.append(new_jaxpr_eqn([other], eqn.outvars, lax.transpose_p,
                                      {"permutation": permutation}, set(), eqn.source_info,
                                      eqn.ctx))
        else:  # a function of `other`: its equations, inlined
            inner = jax.make_jaxpr(permutation)(
                jax.ShapeDtypeStruct(other.aval.shape, other.aval.dtype))
            constvars += inner.jaxpr.constvars
            consts += inner.consts
            inside = {inner.jaxpr.invars[0]: other}
            for e in inner.jaxpr.eqns:
                eqns.append(e.replace(invars=[inside.get(v, v) if isinstance(v, Var) else v
                                              for v in e.invars]))
            rename[eqn.outvars[0]] = inside.get(inner.jaxpr.outvars[0],
                                                inner.jaxpr.outvars[0])
    if not dropped:
        return None
    outvars = [rename.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    new = Jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info)
    return ClosedJaxpr(new, consts)


def _identity_product(eqn, identities, permutations):
    """**Returns:** (the other factor, how the product follows from it) if `eqn`
    multiplies an identity or permutation matrix with another array (a `dot_general`
    contracting one axis, no batch axes, same dtype); else None. How: None (the other
    factor itself), the permutation of its axes (a tuple), or a function of it."""
    if eqn.primitive is not lax.dot_general_p:
        return None
    (contract_l, contract_r), batch = eqn.params["dimension_numbers"]
    if any(batch) or len(contract_l) != 1:
        return None
    out = eqn.outvars[0].aval
    lhs, rhs = eqn.invars
    for unit, other, axis, first, own in ((lhs, rhs, contract_r[0], True, contract_l[0]),
                                          (rhs, lhs, contract_l[0], False, contract_r[0])):
        if not (isinstance(unit, Var) and isinstance(other, Var)
                and other not in identities and other not in permutations
                and other.aval.dtype == out.dtype):
            continue
        rest = [a for a in range(other.aval.ndim) if a != axis]
        permutation = [axis] + rest if first else rest + [axis]
        if unit in identities:
            if permutation == sorted(permutation):
                return other, None
            return other, tuple(permutation)
        if unit in permutations:
            # the product's free axis of the matrix, entry i: the other factor's entry
            # order[i] along the contracted axis (first or last, as dot_general puts it)
            order = np.argmax(permutations[unit], axis=own)
            return other, functools.partial(_permuted, order=order, axis=axis,
                                            to=0 if first else -1)
    return None


def _permuted(x, order, axis, to):
    return jnp.moveaxis(jnp.take(x, order, axis=axis, mode="clip"), axis, to)


def _permutation(value):
    """Whether `value` is a permutation matrix (0 and 1 only, one 1 in every row and
    every column), the identity included."""
    return (value.ndim == 2 and value.shape[0] == value.shape[1]
            and value.dtype.kind in "biuf" and (value >= 0).all()
            and _selects(value, (0,)) and _selects(value, (1,)))


# -- values known before the program runs ----------------------------------------------
FOLD_LIMIT = 1 << 21  # elements (16 MiB of float64): the largest value computed ahead
# of the program; the matvec's forward variant at K=64 multiplies its seeds, broadcast
# to (64, 64, 400), by W: 1.6e6
FOLD_BUDGET = 1 << 22  # elements (32 MiB of float64): the values the program receives,
# all of them together; the forward variant unrolled at K=64 needs 1.6e6 (its 4096
# cotangents of 400)
FOLD_SPEND = 1 << 24  # elements: all values computed ahead, kept or not (held until
# the folding ends); past it, the rest is left to the program


def fold_known(closed_jaxpr, identities, limit=FOLD_LIMIT, budget=FOLD_BUDGET,
               spend=FOLD_SPEND):
    """The program with what it computes from `identities` alone computed once, now.

    A reverse sweep over unit seeds starts with operations on the seeds only: splitting
    them into the outputs' cotangents and sending each back through the model's last
    steps (the slices and pads of `f[i]`, products with constant weights). XLA cannot
    fold them, the seeds being arguments, and on CPU runs each as a small loop of its
    own, every call (the forward variant of the matvec, K=16: 33 such loops), and
    compiles each (most of an unrolled program's compile time). The seeds are known
    when the program is built: every operation that reads them (and else only
    constants and literals) and whose values numpy gives as XLA does at run time
    (`_NUMPY`) is evaluated here, and the values the rest of the program reads become
    its constants (read by XLA's operations through a barrier: `_fenced`).

    **Arguments:**
    - `closed_jaxpr`: the traced program.
    - `identities`: its input variables that hold identity matrices (each taken if it
      has at most `limit` elements).
    - `limit`: the most elements an operation may produce to be evaluated here.
    - `budget`: the most elements of values the program may receive as constants; with
      more, nothing is folded.
    - `spend`: the most elements of all values computed here; the operations after it
      is reached stay in the program.

    **Returns:** the rewritten `ClosedJaxpr` (where a folded value is an identity matrix
    again, its products dropped too: see `drop_identity_products`), or None if nothing
    reads only known values.
    """
    jaxpr = closed_jaxpr.jaxpr
    known = {v: np.eye(*v.aval.shape, dtype=v.aval.dtype) for v in identities
             if math.prod(v.aval.shape) <= limit}
    if not known:
        return None
    env = dict(known)  # every value computed here (constants: as the program has them)
    env.update(zip(jaxpr.constvars, closed_jaxpr.consts))
    seeded, kept = set(known), []  # seeded: values that depend on a known input
    spent = sum(value.size for value in known.values())
    for eqn in jaxpr.eqns:
        found = None
        if spent <= spend and all(isinstance(v, Literal) or v in env for v in eqn.invars):
            found = _evaluate(eqn, [_value(env, v) for v in eqn.invars], limit)
        if found is not None:
            spent += sum(np.size(value) for value in found)
            env.update(zip(eqn.outvars, found))
            if any(v in seeded for v in _vars(eqn.invars)):
                seeded.update(eqn.outvars)
                continue  # computed here only
        kept.append(eqn)  # (also what reads constants only: XLA folds that itself)
    read = set(_vars(jaxpr.outvars)).union(*(_vars(e.invars) for e in kept))
    results = [v for v in env if v in seeded and v in read and v not in known]
    if not results or sum(math.prod(v.aval.shape) for v in results) > budget:
        return None
    values = [np.asarray(env[v], order="C") for v in results]  # (0-d stays 0-d)
    closed = ClosedJaxpr(Jaxpr([*jaxpr.constvars, *results], jaxpr.invars, jaxpr.outvars,
                               kept, jaxpr.effects, jaxpr.debug_info),
                         [*closed_jaxpr.consts, *values])
    # a value folded into an identity or a permutation matrix: its products go as well
    permutations = {v: value for v, value in zip(results, values) if _permutation(value)}
    identities = {v for v, value in permutations.items()
                  if (np.argmax(value, axis=1) == np.arange(len(value))).all()}
    closed = drop_identity_products(closed, identities, {
        v: value for v, value in permutations.items() if v not in identities}) or closed
    return _fenced(closed, results)


def _fenced(closed_jaxpr, constants):
    """The program with its XLA operations reading `constants` through an optimization
    barrier: XLA must not fold them at compile time either, where it gets other values
    than at run time (it rewrites `(c + a) + b` as `c + (a + b)`, converts otherwise).
    Host calls read them as they are (XLA folds nothing through them)."""
    jaxpr = closed_jaxpr.jaxpr
    read = {v for e in jaxpr.eqns if "call" not in e.params for v in _vars(e.invars)}
    fenced = [v for v in constants if v in read]
    if not fenced:
        return closed_jaxpr
    rename = {v: Var(v.aval) for v in fenced}
    eqns = [new_jaxpr_eqn(fenced, list(rename.values()), lax.optimization_barrier_p, {},
                          set())]
    eqns += [e if "call" in e.params else e.replace(
        invars=[rename.get(v, v) if isinstance(v, Var) else v for v in e.invars])
        for e in jaxpr.eqns]
    return ClosedJaxpr(Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns,
                             jaxpr.effects, jaxpr.debug_info), closed_jaxpr.consts)


def _evaluate(eqn, values, limit):
    """**Returns:** the results of `eqn` on `values`, computed by numpy, or None where
    `_NUMPY` has no rule for it (or for an equation of the inner program of a `jit`),
    where a result has more than `limit` elements, or where the values would not be
    XLA's (see `_NUMPY`). A value numpy cannot take (a typed PRNG key) or an operation
    it refuses leaves the equation to XLA too."""
    if eqn.effects or sum(math.prod(v.aval.shape) for v in eqn.outvars) > limit:
        return None
    try:
        with np.errstate(all="ignore"):  # (0 * inf in a constant is XLA's NaN as well)
            values = [np.asarray(v) for v in values]
            if eqn.primitive.name in ("jit", "pjit"):  # jax.numpy's functions, among others
                found = _evaluate_all(eqn.params["jaxpr"], values, limit)
            else:
                rule = _NUMPY.get(eqn.primitive.name)
                found = None if rule is None else rule(*values, **eqn.params)
    except (TypeError, ValueError):
        return None
    if found is None:
        return None
    found = list(found) if eqn.primitive.multiple_results else [found]
    if len(found) != len(eqn.outvars) or any(
            np.shape(r) != v.aval.shape or np.result_type(r) != v.aval.dtype
            for r, v in zip(found, eqn.outvars)):
        return None
    return [np.asarray(r) for r in found]


def _evaluate_all(closed_jaxpr, values, limit):
    """**Returns:** the results of an inner program on `values` (numpy), or None."""
    env = dict(zip(closed_jaxpr.jaxpr.constvars, closed_jaxpr.consts))
    env.update(zip(closed_jaxpr.jaxpr.invars, values))
    for eqn in closed_jaxpr.jaxpr.eqns:
        found = _evaluate(eqn, [_value(env, v) for v in eqn.invars], limit)
        if found is None:
            return None
        env.update(zip(eqn.outvars, found))
    return [_value(env, v) for v in closed_jaxpr.jaxpr.outvars]


def _value(env, atom):
    """The value of a variable in `env`, or of a literal."""
    return np.asarray(atom.val, atom.aval.dtype) if isinstance(atom, Literal) else env[atom]


def _pad(x, value, padding_config):
    inner = [max(n + (n - 1) * i, 0) for n, (_, _, i) in zip(x.shape, padding_config)]
    shape = [m + max(lo, 0) + max(hi, 0) for m, (lo, hi, _) in zip(inner, padding_config)]
    if math.prod(shape) > FOLD_LIMIT:  # (before cropping: it may be far larger)
        return None
    out = np.full(shape, value, x.dtype)
    out[tuple(slice(max(lo, 0), max(lo, 0) + m, i + 1)
              for m, (lo, _, i) in zip(inner, padding_config))] = x
    return out[tuple(slice(-min(lo, 0), n + min(hi, 0))
                     for n, (lo, hi, _) in zip(shape, padding_config))]


def _broadcast(x, shape, broadcast_dimensions, **_):
    axes = [1] * len(shape)
    for size, d in zip(x.shape, broadcast_dimensions):
        axes[d] = size
    return np.broadcast_to(x.reshape(axes), shape)


def _widening(x, new_dtype):
    """Whether converting `x` to `new_dtype` is exact (as in XLA): to floating point,
    from bool, an integer or a floating point type no wider."""
    new = np.dtype(new_dtype)
    return np.issubdtype(new, np.floating) and (
        x.dtype.kind in "biu" or (x.dtype.kind == "f" and x.dtype.itemsize <= new.itemsize))


def _plain(x):
    """Whether XLA computes with `x` as numpy does: an integer array (both wrap
    around), or real floating point without subnormals (XLA on CPU flushes them)."""
    if x.dtype.kind in "biu":
        return True
    if x.dtype.kind != "f":
        return False  # (complex products are not one rounding per element)
    return not ((np.abs(x) < np.finfo(x.dtype).tiny) & (x != 0)).any()


def _whole(x):
    """Whether every entry of `x` is an integer that its type holds exactly, and no zero
    is negative: sums of such values are the same in any order or rewrite."""
    if x.dtype.kind in "biu":
        return True
    return bool(_plain(x) and (np.abs(x) <= 2.0 ** np.finfo(x.dtype).nmant).all()
                and (np.round(x) == x).all() and not np.signbit(x[x == 0]).any())


def _sum(x, y, subtract=False):
    """`x + y` (or `x - y`) where its value cannot depend on how it is computed."""
    if not (_whole(x) and _whole(y)):
        return None
    return np.subtract(x, y) if subtract else np.add(x, y)


def _product(x, y):
    """`x * y` where one factor holds only -1, 0 and 1 (the seeds, moved and summed):
    each entry is then the other factor's, its negative, a zero or a NaN, whichever
    way it is computed."""
    if not (_plain(x) and _plain(y)):
        return None
    if x.dtype.kind == "f" and not any(np.isin(f, (-1, 0, 1)).all() for f in (x, y)):
        return None
    return np.multiply(x, y)


def _selects(x, contracting):
    """Whether `x` holds only -1, 0 and 1, with exactly one nonzero entry over its
    `contracting` axes for every index of its other axes (a permutation matrix, the
    unit seeds in another order, say)."""
    if not np.isin(x, (-1, 0, 1)).all():
        return False
    rest = [a for a in range(x.ndim) if a not in contracting]
    rows = np.transpose(x, rest + list(contracting)).reshape(
        math.prod(x.shape[a] for a in rest), -1)
    return bool(rows.shape[1]) and bool(((rows != 0).sum(axis=1) == 1).all())


def _dot(x, y, dimension_numbers, **_):
    """`dot_general` where one factor selects (`_selects`) and the other is finite, and
    no result is zero: each result is then one entry of the other factor or its
    negative, plus zeros, whichever way XLA sums them (a sum of zeros' signs aside,
    hence no zero results). XLA on CPU multiplies float64 and float32 at full precision
    (`precision` aside), the only platform of the lean path."""
    (cx, cy), (bx, by) = dimension_numbers
    if x.dtype != y.dtype or x.dtype.kind != "f" or not (_plain(x) and _plain(y)):
        return None
    if not ((_selects(x, cx) and np.isfinite(y).all())
            or (_selects(y, cy) and np.isfinite(x).all())):
        return None
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    sx, sy = [None] * x.ndim, [None] * y.ndim
    for i, j in (*zip(bx, by), *zip(cx, cy)):
        sx[i] = sy[j] = next(letters)
    sx = [a or next(letters) for a in sx]
    sy = [a or next(letters) for a in sy]
    out = ([sx[i] for i in bx] + [a for i, a in enumerate(sx) if i not in (*bx, *cx)]
           + [a for j, a in enumerate(sy) if j not in (*by, *cy)])
    found = np.einsum(f"{''.join(sx)},{''.join(sy)}->{''.join(out)}", x, y)
    return None if (found == 0).any() else found


# The operations `fold_known` evaluates, each to the values XLA computes: data moved,
# exact conversions, and arithmetic only where its result cannot depend on how it is
# computed (XLA rewrites expressions of constants, `a / c` as `a * (1 / c)` or `a + 0`
# as `a`, and flushes subnormals to zero).
_NUMPY = {
    "slice": lambda x, start_indices, limit_indices, strides=None, **_: x[tuple(
        slice(a, b, c) for a, b, c in zip(start_indices, limit_indices,
                                          strides or (None,) * x.ndim))],
    "reshape": lambda x, new_sizes, dimensions=None, **_:
        x.reshape(new_sizes) if dimensions is None else None,
    "broadcast_in_dim": _broadcast,
    "squeeze": lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions)),
    "transpose": lambda x, permutation, **_: np.transpose(x, permutation),
    "concatenate": lambda *xs, dimension, **_: np.concatenate(xs, dimension),
    "pad": lambda x, value, padding_config, **_: _pad(x, value, padding_config),
    "unstack": lambda x, axis, **_: list(np.moveaxis(x, axis, 0)),
    "split": lambda x, sizes, axis, **_: np.split(x, np.cumsum(sizes)[:-1], axis),
    "select_n": lambda which, *cases: np.where(which, cases[1], cases[0])
        if len(cases) == 2 and which.dtype == np.bool_ else None,
    "convert_element_type": lambda x, new_dtype, **_:
        x.astype(new_dtype) if _widening(x, new_dtype) else None,
    "copy": lambda x, **_: x.copy(),
    "neg": lambda x, **_: np.negative(x) if _plain(x) else None,
    "add": lambda x, y, **_: _sum(x, y),
    "add_any": lambda x, y, **_: _sum(x, y),
    "sub": lambda x, y, **_: _sum(x, y, subtract=True),
    "mul": lambda x, y, **_: _product(x, y),
    "dot_general": _dot,
}


# -- segments -------------------------------------------------------------------------
# -- batch rows known to be zero ----------------------------------------------------------
def known_rows(closed_jaxpr):
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
    read_by_calls = {v for e in jaxpr.eqns if _lean(e) for v in _vars(e.invars[1:])}
    found = {}
    for position, eqn in enumerate(e for e in jaxpr.eqns if _lean(e)
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


def narrow(closed_jaxpr, spans):
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
        if not _lean(eqn) or call.phase == "forward":
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
    read = set(_vars(jaxpr.outvars)).union(*(_vars(e.invars) for e in eqns))
    constvars = [v for v in jaxpr.constvars if v in read] + list(added)
    return ClosedJaxpr(Jaxpr(constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects,
                             jaxpr.debug_info),
                       [consts[v] for v in constvars if v in consts] + list(added.values()))


def _placed_sums(eqns, placed, outvars, added):
    """`eqns` with every sum (`add_any`, as reverse mode accumulates cotangents) made of
    padded results alone, whose rows do not overlap, made one concatenation of them
    with zero blocks between: XLA's CPU code evaluates pads inside a fused sum element
    by element, every pad at every element (16 padded rows of 400 took 150 us, their
    concatenation 7 us). Such a sum adds nothing but zeros to each value, so its values
    are the same (a zero may change sign); a sum with other terms keeps its order (and
    so its rounding), with only its part of padded results alone replaced. Its zero
    blocks become constants in `added`.

    **Arguments:**
    - `eqns`: the equations, with the pads `narrow` made.
    - `placed`: each such pad's result -> (the rows it pads, where they start).
    - `outvars`: the program's results (never removed).
    - `added`: new constants (variable -> value), updated with the zero blocks.
    """
    results = set(_vars(outvars))
    uses, made = {}, {v: e for e in eqns for v in e.outvars}
    for v in [v for e in eqns for v in _vars(e.invars)]:
        uses[v] = uses.get(v, 0) + 1

    def only_here(v):  # read once, by a sum: it may go into that sum's concatenation
        return isinstance(v, Var) and uses.get(v) == 1 and v not in results

    parts, inner, within = {}, {}, set()  # sum's result -> its padded parts, its sums
    for eqn in eqns:
        if eqn.primitive.name != "add_any" or not all(
                only_here(v) and (v in placed or v in parts) for v in eqn.invars):
            continue
        out = eqn.outvars[0]
        parts[out] = [p for v in eqn.invars for p in parts.get(v, [v])]
        inner[out] = [eqn] + [e for v in eqn.invars for e in inner.get(v, [])]
        within.update(v for v in eqn.invars if v in parts)
    gone, replace = set(), {}
    for out, padded in parts.items():
        spans = sorted(((placed[v][1], placed[v][1] + placed[v][0].aval.shape[0], v)
                        for v in padded), key=lambda span: span[:2])
        if out in within or any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            continue  # part of a larger such sum, or rows that overlap
        aval, pieces, at = out.aval, [], 0
        for start, stop, v in spans + [(aval.shape[0], aval.shape[0], None)]:
            if start > at:
                zeros = Var(ShapedArray((start - at,) + aval.shape[1:], aval.dtype))
                added[zeros] = np.zeros(zeros.aval.shape, aval.dtype)
                pieces.append(zeros)
            if v is not None:
                pieces.append(placed[v][0])
                gone.add(id(made[v]))
            at = stop
        gone.update(id(e) for e in inner[out])
        replace[id(inner[out][0])] = new_jaxpr_eqn(pieces, [out], lax.concatenate_p,
                                                   {"dimension": 0}, set())
    return [replace.get(id(e), e) for e in eqns if id(e) not in gone or id(e) in replace]


def lean_calls(jaxpr):
    """**Returns:** the lean host calls at the top level of `jaxpr`, in program order."""
    return tuple(eqn.params["call"] for eqn in jaxpr.eqns if _lean(eqn))


def segmented(closed_jaxpr, size=None):
    """A function evaluating `closed_jaxpr` (flat arguments, flat results) with its chain
    cut into segments of `size` (default `SEGMENT`) host calls, each the taken branch of
    a conditional; None if the chain has at most `size` calls."""
    size = size or SEGMENT
    jaxpr = closed_jaxpr.jaxpr
    eqns = jaxpr.eqns
    bounds, calls = [0], 0
    for i, eqn in enumerate(eqns):
        if _lean(eqn):
            calls += 1
            if calls % size == 0:
                bounds.append(i + 1)
        elif has_lean(eqn):
            # a loop (see `rolled`) is a piece of its own, run as it is: every other
            # piece then starts with a call whose token comes from before the piece
            bounds.extend([i, i + 1][bounds[-1] == i:])
    if calls <= size:
        return None
    if bounds[-1] != len(eqns):
        bounds.append(len(eqns))
    pieces = _pieces(jaxpr, bounds)

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
        env.update(zip(jaxpr.invars, args))
        for inputs, outputs, branch, token, token_out in pieces:
            values = [env[v] for v in inputs]
            if token is None:  # no host call in this piece
                results = branch(*values)
            else:
                results = lax.cond(env[token] >= 0, branch,
                                   _not_taken(outputs, token_out), *values)
            env.update(zip(outputs, results))
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    return run


def _pieces(jaxpr, bounds):
    """**Returns:** `_segment` of each piece `jaxpr.eqns[a:b]` between two neighbours
    of `bounds`, in program order."""
    needed, pieces = set(_vars(jaxpr.outvars)), []
    for start, stop in reversed(list(itertools.pairwise(bounds))):
        pieces.append(_segment(jaxpr.eqns[start:stop], needed))
        for eqn in jaxpr.eqns[start:stop]:
            needed.update(_vars(eqn.invars))
    return pieces[::-1]


def _vars(atoms):
    return [v for v in atoms if isinstance(v, Var)]


def _segment(eqns, needed):
    """**Returns:** (inputs, outputs, branch function, input token, output token) of a
    piece of the program (tokens None if it has no host call); `needed` holds the
    variables read after it."""
    defined, inputs, seen = set(), [], set()
    for eqn in eqns:
        for v in _vars(eqn.invars):
            if v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)
        defined.update(eqn.outvars)
    outputs = [v for eqn in eqns for v in eqn.outvars if v in needed]
    token = next((eqn.invars[0] for eqn in eqns if _lean(eqn)), None)
    token_out = next((eqn.outvars[0] for eqn in reversed(eqns) if _lean(eqn)), None)
    info = DebugInfo("distop segment", None, ("",) * len(inputs), ("",) * len(outputs))
    branch = jaxpr_as_fun(ClosedJaxpr(Jaxpr([], inputs, outputs, eqns, debug_info=info), []))
    return inputs, outputs, branch, token, token_out


def _not_taken(outputs, token_out):
    """The branch never taken: zeros, and a NaN token that fails the count of calls."""
    def branch(*_):
        return [jnp.full(v.aval.shape, jnp.nan if v is token_out else 0, v.aval.dtype)
                for v in outputs]
    return branch


# -- loops: a repeated stretch of the program rolled into one lax.scan ------------------
REPEATS = 16  # fewest repetitions of a stretch that `rolled` rolls into a loop


class RolledCall:
    """The lean calls at one place of a stretch of the program repeated `len(members)`
    times, rolled into a loop: iteration i runs `members[i]` (whose argument and result
    shapes are all the same). Its first argument after the token is i."""

    lean = ordered = True
    phase = "rolled"

    def __init__(self, members):
        self.members = tuple(members)
        self.ffi_id = None  # set when lowered (see _ffi.register)

    def __repr__(self):
        return f"rolled[{len(self.members)} x {self.members[0]!r}]"

    def shapes(self):
        """**Returns:** the `jax.ShapeDtypeStruct`s of the results (the members')."""
        return self.members[0].shapes()

    def __call__(self, index, *args, out=None):
        return self.members[int(index)](*args, out=out)


class _Loop:
    """A stretch of `m` repetitions of `k` equations from `start` on, and how each
    repetition's inputs and outputs connect (see `_loop`)."""

    def __init__(self, start, k, m, kinds, starts, needed):
        self.start, self.k, self.m, self.stop = start, k, m, start + k * m
        self.kinds = kinds  # (eqn, argument) -> kind of what the argument reads
        self.starts = starts  # (eqn, result) read by the next repetition -> first value
        self.carried = sorted(starts)  # those (eqn, result), in order
        # (eqn, result) read after the stretch -> whether from a repetition before the
        # last (else the last one's, which the carry may give)
        self.needed = needed


def rolled(closed_jaxpr, repeats=None):
    """Roll every stretch of a lean program that repeats at least `repeats` (default
    `REPEATS`) times (the same operations on values of the same shapes, each repetition
    reading the one before it the same way, as `for _ in range(n): y = f(op(y))`
    gives) into one `lax.scan`: XLA compiles one repetition instead of all of them. Each
    lean call of the stretch becomes one `RolledCall`; the token runs through the loop's
    carry, so the calls still run one at a time, in the same order, each once.

    **Returns:** `(ClosedJaxpr, RolledCalls)`, or None if nothing repeats (or the
    program has effects besides its lean calls). Values agree with the calls one by
    one to round-off: XLA may fold or fuse a repetition differently.
    """
    jaxpr = closed_jaxpr.jaxpr
    if _other_effects(jaxpr):  # their order inside a loop is not proven here
        return None
    loops = _loops(jaxpr, repeats or REPEATS)
    if not loops:
        return None
    # the stretch before each loop, and after the last, as a function of its own
    eqns = jaxpr.eqns
    bounds = [0, *(b for loop in loops for b in (loop.start, loop.stop)), len(eqns)]
    stretches = [piece[:3] for piece in _pieces(jaxpr, bounds)[::2]]
    made = []

    def run(*args):
        env = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
        env.update(zip(jaxpr.invars, args))
        stacked = {}  # var -> (a loop's stacked results, index): read there when needed

        def read(v):
            if isinstance(v, Literal):
                return v.val
            if v not in env:
                array, index = stacked[v]
                env[v] = array[index]
            return env[v]

        for (inputs, outputs, fn), loop in zip(stretches, loops + [None]):
            env.update(zip(outputs, fn(*map(read, inputs))))
            if loop is not None:
                made.extend(_run_loop(eqns, loop, read, env, stacked))
        return [read(v) for v in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return jax.make_jaxpr(run)(*avals), tuple(made)


def _key(eqn):
    """What two equations must share to be one equation of a loop's body: primitive,
    parameters (lean calls count alike), argument and result types, literals' values."""
    params = []
    for name, value in sorted(eqn.params.items()):
        if name == "call":
            value = "lean" if getattr(value, "lean", False) else id(value)
        else:
            try:
                hash(value)
            except TypeError:
                value = id(value)
        params.append((name, value))
    args = tuple((v.aval, np.asarray(v.val).tobytes()) if isinstance(v, Literal)
                 else v.aval for v in eqn.invars)
    return eqn.primitive, tuple(params), args, tuple(v.aval for v in eqn.outvars)


def _loops(jaxpr, repeats):
    """**Returns:** the `_Loop`s of `jaxpr`, in program order, none overlapping. Each
    starts at a lean call that recurs, every k equations, at least `repeats` times."""
    eqns, ids = jaxpr.eqns, {}
    keys = [ids.setdefault(_key(eqn), len(ids)) for eqn in eqns]
    later, seen = [None] * len(eqns), {}
    for i in range(len(eqns) - 1, -1, -1):
        later[i], seen[keys[i]] = seen.get(keys[i]), i
    where = {v: (i, p) for i, eqn in enumerate(eqns) for p, v in enumerate(eqn.outvars)}
    readers = {}
    for i, eqn in enumerate(eqns):
        for v in _vars(eqn.invars):
            readers.setdefault(v, []).append(i)
    for v in _vars(jaxpr.outvars):
        readers.setdefault(v, []).append(len(eqns))
    loops, i = [], 0
    while i < len(eqns):
        step, j, tries = 1, later[i], 0
        while _lean(eqns[i]) and j is not None and tries < 4:
            k, m = j - i, 1
            while keys[i + m * k:i + (m + 1) * k] == keys[i:i + k]:
                m += 1
            if m >= repeats:
                loop, consistent = _loop(eqns, i, k, m, where, readers)
                if loop is not None and loop.m >= repeats:
                    loops.append(loop)
                    step = loop.stop - i
                    break
                step = max(step, consistent * k)
            j, tries = later[j], tries + 1
        i += step
    return loops


def _loop(eqns, start, k, m, where, readers):
    """Check that `m` repetitions of `eqns[start:start + k]` can be one loop, as far as
    they can.

    **Returns:** (the `_Loop` of the longest such run from `start`, or None; how many
    repetitions read their arguments consistently)."""
    kinds, m = _kinds(eqns, start, k, m, where)
    if m < 2:
        return None, m
    # A result is read in its own repetition, the next one or after the loop (`_kinds`
    # ended the run at any read from two or more repetitions back).
    needed, stop = {}, start + m * k
    for j in range(m):
        for r in range(k):
            for p, v in enumerate(eqns[start + j * k + r].outvars):
                if any(u >= stop for u in readers.get(v, ())):
                    needed[(r, p)] = needed.get((r, p), False) or j < m - 1
    starts = {}
    for (r, q), kind in kinds.items():
        if kind[0] == "carry":  # the arguments carried from one result start alike
            v, produced = eqns[start + r].invars[q], eqns[start + kind[1]].outvars[kind[2]]
            if (starts.setdefault(kind[1:], v) is not v
                    or v.aval.shape != produced.aval.shape
                    or v.aval.dtype != produced.aval.dtype):
                return None, 0
    return _Loop(start, k, m, kinds, starts, needed), m


def _kinds(eqns, start, k, m, where):
    """**Returns:** (argument (eqn, position) of a repetition -> what it reads (see
    `_kind`; carried where the first repetition reads a value from before the loop
    and the others the one before's result), how many repetitions from `start` read
    alike (at most `m`))."""
    kinds = {}
    for j in range(m):
        base = start + j * k
        for r in range(k):
            for q, v in enumerate(eqns[base + r].invars):
                kind = _kind(v, where, start, base, k)
                if j == 0 or (j == 1 and kinds[(r, q)] == _OUTSIDE and kind is not None
                              and kind[0] == "carry"):
                    kinds[(r, q)] = kind
                elif kind is None or kind != kinds[(r, q)]:
                    return kinds, j
    return kinds, m


_LITERAL, _OUTSIDE = ("literal",), ("outside",)


def _kind(v, where, start, base, k):
    """What argument `v` of the repetition at `base` reads: `_LITERAL`, `_OUTSIDE` (a
    value from before the stretch), ("inside", eqn, result) of the same repetition,
    ("carry", eqn, result) of the one before, or None (an earlier one)."""
    if isinstance(v, Literal):
        return _LITERAL
    found = where.get(v)
    if found is None or found[0] < start:
        return _OUTSIDE
    if found[0] >= base:
        return ("inside", found[0] - base, found[1])
    if found[0] >= base - k:
        return ("carry", found[0] - base + k, found[1])
    return None


def _run_loop(eqns, loop, read, env, stacked):
    """Run `loop` as a `lax.scan` (see `rolled`): set its results in `env` (the last
    repetition's carried results) and `stacked` (results stacked over repetitions).

    **Returns:** the `RolledCall`s of its body."""
    start, k, m = loop.start, loop.k, loop.m
    block = eqns[start:start + k]
    carry_in = {c: Var(block[c[0]].outvars[c[1]].aval) for c in loop.carried}
    outside, xs, invariants = {}, [], []  # slot -> var of the body; the loop's inputs
    for slot, kind in loop.kinds.items():
        if kind != _OUTSIDE:
            continue
        every = [eqns[start + j * k + slot[0]].invars[slot[1]] for j in range(m)]
        body_var = Var(every[0].aval)
        if all(v is every[0] for v in every):
            invariants.append((body_var, read(every[0])))
        else:
            xs.append((body_var, _stack(every, read, stacked)))
        outside[slot] = body_var
    index = Var(ShapedArray((), np.int32))
    body_eqns, calls = [], []
    for r, eqn in enumerate(block):
        invars = []
        for q, v in enumerate(eqn.invars):
            kind = loop.kinds[(r, q)]
            invars.append(v if kind[0] in ("literal", "inside")
                          else carry_in[kind[1:]] if kind[0] == "carry" else outside[(r, q)])
        params = eqn.params
        if _lean(eqn):
            call = RolledCall([eqns[start + j * k + r].params["call"] for j in range(m)])
            calls.append(call)
            invars.insert(1, index)
            params = dict(params, call=call)
        body_eqns.append(new_jaxpr_eqn(invars, eqn.outvars, eqn.primitive, params,
                                       eqn.effects))
    ys = [slot for slot, before_end in loop.needed.items()
          if before_end or slot not in carry_in]
    inputs = list(carry_in.values()) + [index] + [v for v, _ in xs] + [v for v, _ in invariants]
    outputs = ([block[r].outvars[p] for r, p in loop.carried]
               + [block[r].outvars[p] for r, p in ys])
    info = DebugInfo("distop loop", None, ("",) * len(inputs), ("",) * len(outputs))
    body = jaxpr_as_fun(ClosedJaxpr(Jaxpr([], inputs, outputs, body_eqns, debug_info=info),
                                    []))
    fixed = [value for _, value in invariants]
    init = [read(loop.starts[c]) for c in loop.carried]

    def step(carry, x):
        results = body(*carry, *x, *fixed)
        return results[:len(carry)], results[len(carry):]

    last, stacks = lax.scan(step, init, [jnp.arange(m, dtype=np.int32)]
                            + [value for _, value in xs])
    final = start + (m - 1) * k
    for (r, p), value in zip(loop.carried, last):
        env[eqns[final + r].outvars[p]] = value
    for (r, p), array in zip(ys, stacks):
        for j in range(m):
            v = eqns[start + j * k + r].outvars[p]
            if v not in env:
                stacked[v] = (array, j)
    return calls


def _stack(every, read, stacked):
    """The values of `every` (variables) stacked along a new first axis: a run of them
    that a loop stacked in order (or in reverse order) is a slice of its stack."""
    pieces, j, none = [], 0, (None, None)
    while j < len(every):
        array, first = stacked.get(every[j], none)
        run, step = 1, 1
        if array is not None and j + 1 < len(every):
            after = stacked.get(every[j + 1], none)
            if after[0] is array and abs(after[1] - first) == 1:
                step = after[1] - first
                while j + run < len(every):
                    found = stacked.get(every[j + run], none)
                    if found[0] is not array or found[1] != first + step * run:
                        break
                    run += 1
        if array is None:
            pieces.append(lax.expand_dims(read(every[j]), (0,)))
        else:
            low = min(first, first + step * (run - 1))
            piece = lax.slice_in_dim(array, low, low + run)
            pieces.append(piece if step == 1 else lax.rev(piece, (0,)))
        j += run
    return pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, 0)
