"""Loops: a stretch of the program repeated at least `REPEATS` times (a Python loop
over operator calls) rolled into one `lax.scan`.

XLA compiles each operation of a program on its own, and more than linearly in their
number; a loop is compiled once (docs/architecture.md, "Loops: a repeated stretch
compiles once"). This is part of the final stage, after the passes (see pipeline.py):
it makes a program of its own, and `RolledCall`s that live as long as it.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    jaxpr_as_fun,
    new_jaxpr_eqn,
)

from ..._compat import ShapedArray
from ..._hostcalls.rolled import RolledCall, UnstackedCall
from ..jaxprs import is_lean, other_effects, pieces, shaped, variables

REPEATS = 16  # fewest repetitions of a stretch that `rolled` rolls into a loop

Slot = tuple[int, int]  # (equation within a repetition, argument or result)
Kind = tuple[Any, ...]  # what an argument reads: see `_kind`


@dataclasses.dataclass
class _Loop:
    """A stretch of `m` repetitions of `k` equations from `start` on, and how each
    repetition's inputs and outputs connect (see `_loop`).

    Fields: `kinds` ((eqn, argument) -> kind of what the argument reads), `starts`
    ((eqn, result) read by the next repetition -> its first value), `needed` ((eqn,
    result) read after the stretch -> whether from a repetition before the last, else
    the last one's, which the carry may give); `stop` (where the stretch ends) and
    `carried` (the keys of `starts`, in order) follow.
    """

    start: int
    k: int
    m: int
    kinds: dict[Slot, Kind]
    starts: dict[Slot, Var]
    needed: dict[Slot, bool]
    stop: int = dataclasses.field(init=False)
    carried: list[Slot] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.stop = self.start + self.k * self.m
        self.carried = sorted(self.starts)


class Rolled(NamedTuple):
    """What `rolled` makes: the `program` with its loops, and the `host_calls` of
    their bodies (`RolledCall`s) and of the calls reading their stacks
    (`UnstackedCall`s)."""

    program: ClosedJaxpr
    host_calls: tuple[RolledCall | UnstackedCall, ...]


def rolled(closed_jaxpr: ClosedJaxpr, repeats: int | None = None) -> Rolled | None:
    """Roll every stretch of a lean program that repeats at least `repeats` (default
    `REPEATS`) times (the same operations on values of the same shapes, each repetition
    reading the one before it the same way, as `for _ in range(n): y = f(op(y))`
    gives) into one `lax.scan`: XLA compiles one repetition instead of all of them. Each
    lean call of the stretch becomes one `RolledCall`; the token runs through the loop's
    carry, so the calls still run one at a time, in the same order, each once.

    **Returns:** the `Rolled` program, or None if nothing repeats (or the
    program has effects besides its lean calls). Values agree with the calls one by
    one to round-off: XLA may fold or fuse a repetition differently.
    """
    jaxpr = closed_jaxpr.jaxpr
    if other_effects(jaxpr):  # their order inside a loop is not proven here
        return None
    loops = _loops(jaxpr, repeats or REPEATS)
    if not loops:
        return None
    eqns = jaxpr.eqns
    starts = {loop.start: loop for loop in loops}
    gathers = _gathers(eqns, loops, repeats or REPEATS)
    # the stretches between the loops and around the calls that read their stacks, each
    # as a function of its own
    bounds = sorted({0, len(eqns), *(b for loop in loops for b in (loop.start, loop.stop)),
                     *(b for i in gathers for b in (i, i + 1))})
    stretches = pieces(jaxpr, bounds)
    made: list[RolledCall | UnstackedCall] = []

    def run(*args: jax.Array) -> list[jax.Array]:
        env = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
        env.update(zip(jaxpr.invars, args))
        # var -> (a loop's stacked results, index): read there when needed
        stacked: dict[Var, tuple[Any, int]] = {}

        def read(v: Var | Literal) -> Any:
            if isinstance(v, Literal):
                return v.val
            if v not in env:
                array, index = stacked[v]
                env[v] = array[index]
            return env[v]

        for start, piece in zip(bounds, stretches):
            if start in starts:
                made.extend(_run_loop(eqns, starts[start], read, env, stacked))
            elif start in gathers:
                made.append(_run_unstacked(eqns[start], read, env, stacked))
            else:
                env.update(zip(piece.outputs, piece.fn(*map(read, piece.inputs))))
        return [read(v) for v in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return Rolled(jax.make_jaxpr(run)(*avals), tuple(made))


def _gathers(eqns: Sequence[JaxprEqn], loops: Sequence[_Loop], repeats: int) -> set[int]:
    """**Returns:** the indices of the lean calls outside `loops` that read at least
    `repeats` results made inside them (a fused call of the reverse sweep, say, reading
    every step's input): `_run_unstacked` gives them slices of the stacks."""
    inside = {v for loop in loops for eqn in eqns[loop.start:loop.stop] for v in eqn.outvars}
    within = {i for loop in loops for i in range(loop.start, loop.stop)}
    return {i for i, eqn in enumerate(eqns) if is_lean(eqn) and i not in within
            and sum(v in inside for v in variables(eqn.invars)) >= repeats}


def _run_unstacked(eqn: JaxprEqn, read: Callable[[Any], Any], env: dict[Var, Any],
                   stacked: dict[Var, tuple[Any, int]]) -> UnstackedCall:
    """Run a lean call that reads many stacked results of a loop (see `_gathers`), each
    run of rows of one stack, in order or in reverse, given as one slice: set its
    results in `env`.

    **Returns:** its `UnstackedCall`."""
    given = eqn.invars[1:]

    def row(j: int) -> tuple[Any, int] | None:
        """(stack, index) of argument j where it is a stacked result not read yet."""
        v = given[j] if j < len(given) else None
        return stacked.get(v) if isinstance(v, Var) and v not in env else None

    args, layout, j = [], [], 0
    while j < len(given):
        found, after = row(j), row(j + 1)
        run, step = 1, 1
        if (found is not None and after is not None and after[0] is found[0]
                and abs(after[1] - found[1]) == 1):
            step = after[1] - found[1]
            while (further := row(j + run)) is not None and further[0] is found[0] \
                    and further[1] == found[1] + step * run:
                run += 1
        if run == 1:
            args.append(read(given[j]))
            layout.append(0)
        else:
            assert found is not None  # (a run of rows starts at a stacked result)
            low = min(found[1], found[1] + step * (run - 1))
            args.append(lax.slice_in_dim(found[0], low, low + run))
            layout.append(run * step)
        j += run
    call = UnstackedCall(eqn.params["call"], layout)
    outs = eqn.primitive.bind(read(eqn.invars[0]), *args, **dict(eqn.params, call=call))
    env.update(zip(eqn.outvars, outs))
    return call


def _key(eqn: JaxprEqn) -> tuple[Any, ...]:
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


def _loops(jaxpr: Jaxpr, repeats: int) -> list[_Loop]:
    """**Returns:** the `_Loop`s of `jaxpr`, in program order, none overlapping. Each
    starts at a lean call that recurs, every k equations, at least `repeats` times."""
    eqns = jaxpr.eqns
    ids: dict[tuple[Any, ...], int] = {}
    keys = [ids.setdefault(_key(eqn), len(ids)) for eqn in eqns]
    later: list[int | None] = [None] * len(eqns)  # the next equation of the same key
    seen: dict[int, int] = {}
    for i in range(len(eqns) - 1, -1, -1):
        later[i], seen[keys[i]] = seen.get(keys[i]), i
    where = {v: (i, p) for i, eqn in enumerate(eqns) for p, v in enumerate(eqn.outvars)}
    readers: dict[Var, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for v in variables(eqn.invars):
            readers.setdefault(v, []).append(i)
    for v in variables(jaxpr.outvars):
        readers.setdefault(v, []).append(len(eqns))
    loops: list[_Loop] = []
    i = 0
    while i < len(eqns):
        step, j, tries = 1, later[i], 0
        while is_lean(eqns[i]) and j is not None and tries < 4:
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


def _loop(eqns: Sequence[JaxprEqn], start: int, k: int, m: int,
          where: dict[Var, Slot], readers: dict[Var, list[int]]) -> tuple[_Loop | None, int]:
    """Check that `m` repetitions of `eqns[start:start + k]` can be one loop, as far as
    they can.

    **Returns:** (the `_Loop` of the longest such run from `start`, or None; how many
    repetitions read their arguments consistently)."""
    kinds, m = _kinds(eqns, start, k, m, where)
    if m < 2:
        return None, m
    # A result is read in its own repetition, the next one or after the loop (`_kinds`
    # ended the run at any read from two or more repetitions back).
    needed: dict[Slot, bool] = {}
    stop = start + m * k
    for j in range(m):
        for r in range(k):
            for p, v in enumerate(eqns[start + j * k + r].outvars):
                if any(u >= stop for u in readers.get(v, ())):
                    needed[(r, p)] = needed.get((r, p), False) or j < m - 1
    starts: dict[Slot, Var] = {}
    for (r, q), kind in kinds.items():
        if kind[0] == "carry":  # the arguments carried from one result start alike
            arg, produced = eqns[start + r].invars[q], eqns[start + kind[1]].outvars[kind[2]]
            assert isinstance(arg, Var)  # (a literal is `_LITERAL`, never carried)
            if (starts.setdefault(kind[1:], arg) is not arg
                    or shaped(arg).shape != shaped(produced).shape
                    or shaped(arg).dtype != shaped(produced).dtype):
                return None, 0
    return _Loop(start, k, m, kinds, starts, needed), m


def _kinds(eqns: Sequence[JaxprEqn], start: int, k: int, m: int,
           where: dict[Var, Slot]) -> tuple[dict[Slot, Kind], int]:
    """**Returns:** (argument (eqn, position) of a repetition -> what it reads (see
    `_kind`; carried where the first repetition reads a value from before the loop
    and the others the one before's result), how many repetitions from `start` read
    alike (at most `m`))."""
    kinds: dict[Slot, Kind] = {}
    for j in range(m):
        base = start + j * k
        for r in range(k):
            for q, v in enumerate(eqns[base + r].invars):
                kind = _kind(v, where, start, base, k)
                if kind is None:  # (never in the first repetition: none is before it)
                    return kinds, j
                if j == 0 or (j == 1 and kinds[(r, q)] == _OUTSIDE and kind[0] == "carry"):
                    kinds[(r, q)] = kind
                elif kind != kinds[(r, q)]:
                    return kinds, j
    return kinds, m


_LITERAL, _OUTSIDE = ("literal",), ("outside",)


def _kind(v: Var | Literal, where: dict[Var, Slot], start: int, base: int,
          k: int) -> Kind | None:
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


def _run_loop(eqns: Sequence[JaxprEqn], loop: _Loop, read: Callable[[Any], Any],
              env: dict[Var, Any], stacked: dict[Var, tuple[Any, int]]) -> list[RolledCall]:
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
        # (values from before the loop: variables, a literal being `_LITERAL`)
        every = variables(eqns[start + j * k + slot[0]].invars[slot[1]] for j in range(m))
        body_var = Var(every[0].aval)
        if all(v is every[0] for v in every):
            invariants.append((body_var, read(every[0])))
        else:
            xs.append((body_var, _stack(every, read, stacked)))
        outside[slot] = body_var
    index = Var(ShapedArray((), np.int32))
    body_eqns, host_calls = [], []
    for r, eqn in enumerate(block):
        invars = []
        for q, v in enumerate(eqn.invars):
            kind = loop.kinds[(r, q)]
            invars.append(v if kind[0] in ("literal", "inside")
                          else carry_in[kind[1:]] if kind[0] == "carry" else outside[(r, q)])
        params = eqn.params
        if is_lean(eqn):
            call = RolledCall([eqns[start + j * k + r].params["call"] for j in range(m)])
            host_calls.append(call)
            invars.insert(1, index)
            params = dict(params, call=call)
        body_eqns.append(new_jaxpr_eqn(invars, eqn.outvars, eqn.primitive, params,
                                       eqn.effects))
    ys = [slot for slot, before_end in loop.needed.items()
          if before_end or slot not in carry_in]
    inputs = list(carry_in.values()) + [index] + [v for v, _ in xs] + [v for v, _ in invariants]
    outputs = ([block[r].outvars[p] for r, p in loop.carried]
               + [block[r].outvars[p] for r, p in ys])
    info = DebugInfo("distop loop", "distop_loop", ("",) * len(inputs), ("",) * len(outputs))
    body = jaxpr_as_fun(ClosedJaxpr(Jaxpr([], inputs, outputs, body_eqns, debug_info=info),
                                    []))
    fixed = [value for _, value in invariants]
    init = [read(loop.starts[c]) for c in loop.carried]

    def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
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
    return host_calls


def _stack(every: Sequence[Var], read: Callable[[Any], Any],
           stacked: dict[Var, tuple[Any, int]]) -> jax.Array:
    """The values of `every` (variables) stacked along a new first axis: a run of them
    that a loop stacked in order (or in reverse order) is a slice of its stack."""
    pieces, j = [], 0
    while j < len(every):
        found = stacked.get(every[j])
        run, step = 1, 1
        if found is None:
            pieces.append(lax.expand_dims(read(every[j]), (0,)))
        else:
            array, first = found
            after = stacked.get(every[j + 1]) if j + 1 < len(every) else None
            if after is not None and after[0] is array and abs(after[1] - first) == 1:
                step = after[1] - first
                while j + run < len(every):
                    further = stacked.get(every[j + run])
                    if (further is None or further[0] is not array
                            or further[1] != first + step * run):
                        break
                    run += 1
            low = min(first, first + step * (run - 1))
            piece = lax.slice_in_dim(array, low, low + run)
            pieces.append(piece if step == 1 else lax.rev(piece, (0,)))
        j += run
    return pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, 0)
