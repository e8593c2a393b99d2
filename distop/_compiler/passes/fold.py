"""Values the program computes from its identity inputs alone, computed once, ahead.

A reverse sweep over unit seeds starts with operations on the seeds only (splitting
them into the outputs' cotangents, sending each back through the model's last steps),
which XLA cannot fold, the seeds being arguments: it runs and compiles each on its own
(docs/architecture.md, "Values known before the program runs").
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, new_jaxpr_eqn

from ..jaxprs import shaped, variables
from .base import Context, LocalPass
from .identity import drop_identity_products


class FoldKnown(LocalPass[tuple[int, ...]]):
    """What the program computes from its identity inputs alone, computed now.

    Proposal and decision: the positions of the inputs that hold identity matrices.
    """

    def analyse(self, program: ClosedJaxpr, context: Context) -> tuple[int, ...]:
        """**Returns:** the positions of `program`'s inputs that hold identities."""
        return context.identities

    def apply(self, program: ClosedJaxpr, decision: tuple[int, ...]) -> ClosedJaxpr:
        """**Returns:** `program` with what it computes from those inputs folded."""
        return fold_known(program, {program.jaxpr.invars[i] for i in decision}) or program


FOLD_LIMIT = 1 << 21  # elements (16 MiB of float64): the largest value computed ahead
# of the program; the matvec's forward variant at K=64 multiplies its seeds, broadcast
# to (64, 64, 400), by W: 1.6e6
FOLD_BUDGET = 1 << 22  # elements (32 MiB of float64): the values the program receives,
# all of them together; the forward variant unrolled at K=64 needs 1.6e6 (its 4096
# cotangents of 400)
FOLD_SPEND = 1 << 24  # elements: all values computed ahead, kept or not (held until
# the folding ends); past it, the rest is left to the program


def fold_known(closed_jaxpr: ClosedJaxpr, identities: set[Var], limit: int = FOLD_LIMIT,
               budget: int = FOLD_BUDGET, spend: int = FOLD_SPEND) -> ClosedJaxpr | None:
    """The program with what it computes from `identities` alone computed once, now.

    A reverse sweep over unit seeds starts with operations on the seeds only: splitting
    them into the outputs' cotangents and sending each back through the model's last
    steps (the slices and pads of `f[i]`, products with constant weights). XLA cannot
    fold them, the seeds being arguments, and on CPU runs each as a small loop of its
    own, every call, and compiles each (most of an unrolled program's compile time).
    The seeds are known when the program is built: every operation that reads them
    (and else only constants and literals) and whose values numpy gives as XLA does at
    run time (`_NUMPY`) is evaluated here, and the values the rest of the program reads
    become its constants (read by XLA's operations through a barrier: `_fenced`).

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
    known = {v: np.eye(*shaped(v).shape, dtype=shaped(v).dtype) for v in identities
             if math.prod(shaped(v).shape) <= limit}
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
            if any(v in seeded for v in variables(eqn.invars)):
                seeded.update(eqn.outvars)
                continue  # computed here only
        kept.append(eqn)  # (also what reads constants only: XLA folds that itself)
    read = set(variables(jaxpr.outvars)).union(*(variables(e.invars) for e in kept))
    results = [v for v in env if v in seeded and v in read and v not in known]
    if not results or sum(math.prod(shaped(v).shape) for v in results) > budget:
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


def _fenced(closed_jaxpr: ClosedJaxpr, constants: Sequence[Var]) -> ClosedJaxpr:
    """The program with its XLA operations reading `constants` through an optimization
    barrier: XLA must not fold them at compile time either, where it gets other values
    than at run time (it rewrites `(c + a) + b` as `c + (a + b)`, converts otherwise).
    Host calls read them as they are (XLA folds nothing through them)."""
    jaxpr = closed_jaxpr.jaxpr
    read = {v for e in jaxpr.eqns if "call" not in e.params for v in variables(e.invars)}
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


def _evaluate(eqn: JaxprEqn, values: Sequence[Any], limit: int) -> list[np.ndarray] | None:
    """**Returns:** the results of `eqn` on `values`, computed by numpy, or None where
    `_NUMPY` has no rule for it (or for an equation of the inner program of a `jit`),
    where a result has more than `limit` elements, or where the values would not be
    XLA's (see `_NUMPY`). A value numpy cannot take (a typed PRNG key) or an operation
    it refuses leaves the equation to XLA too."""
    if eqn.effects or sum(math.prod(shaped(v).shape) for v in eqn.outvars) > limit:
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
    results: list[Any] = list(found) if eqn.primitive.multiple_results else [found]
    if len(results) != len(eqn.outvars) or any(
            np.shape(r) != shaped(v).shape or np.result_type(r) != shaped(v).dtype
            for r, v in zip(results, eqn.outvars)):
        return None
    return [np.asarray(r) for r in results]


def _evaluate_all(closed_jaxpr: ClosedJaxpr, values: Sequence[np.ndarray],
                  limit: int) -> list[np.ndarray] | None:
    """**Returns:** the results of an inner program on `values` (numpy), or None."""
    env = dict(zip(closed_jaxpr.jaxpr.constvars, closed_jaxpr.consts))
    env.update(zip(closed_jaxpr.jaxpr.invars, values))
    for eqn in closed_jaxpr.jaxpr.eqns:
        found = _evaluate(eqn, [_value(env, v) for v in eqn.invars], limit)
        if found is None:
            return None
        env.update(zip(eqn.outvars, found))
    return [_value(env, v) for v in closed_jaxpr.jaxpr.outvars]


def _value(env: dict[Var, Any], atom: Var | Literal) -> Any:
    """The value of a variable in `env`, or of a literal."""
    return np.asarray(atom.val, shaped(atom).dtype) if isinstance(atom, Literal) else env[atom]


def _pad(x: np.ndarray, value: np.ndarray,
         padding_config: Sequence[tuple[int, int, int]]) -> np.ndarray | None:
    inner = [max(n + (n - 1) * i, 0) for n, (_, _, i) in zip(x.shape, padding_config)]
    shape = [m + max(lo, 0) + max(hi, 0) for m, (lo, hi, _) in zip(inner, padding_config)]
    if math.prod(shape) > FOLD_LIMIT:  # (before cropping: it may be far larger)
        return None
    out = np.full(shape, value, x.dtype)
    out[tuple(slice(max(lo, 0), max(lo, 0) + m, i + 1)
              for m, (lo, _, i) in zip(inner, padding_config))] = x
    return out[tuple(slice(-min(lo, 0), n + min(hi, 0))
                     for n, (lo, hi, _) in zip(shape, padding_config))]


def _broadcast(x: np.ndarray, shape: Sequence[int], broadcast_dimensions: Sequence[int],
               **_: Any) -> np.ndarray:
    axes = [1] * len(shape)
    for size, d in zip(x.shape, broadcast_dimensions):
        axes[d] = size
    return np.broadcast_to(x.reshape(axes), shape)


def _widening(x: np.ndarray, new_dtype: Any) -> bool:
    """Whether converting `x` to `new_dtype` is exact (as in XLA): to floating point,
    from bool, an integer or a floating point type no wider."""
    new = np.dtype(new_dtype)
    return np.issubdtype(new, np.floating) and (
        x.dtype.kind in "biu" or (x.dtype.kind == "f" and x.dtype.itemsize <= new.itemsize))


def _plain(x: np.ndarray) -> bool:
    """Whether XLA computes with `x` as numpy does: an integer array (both wrap
    around), or real floating point without subnormals (XLA on CPU flushes them)."""
    if x.dtype.kind in "biu":
        return True
    if x.dtype.kind != "f":
        return False  # (complex products are not one rounding per element)
    return not ((np.abs(x) < np.finfo(x.dtype).tiny) & (x != 0)).any()


def _whole(x: np.ndarray) -> bool:
    """Whether every entry of `x` is an integer that its type holds exactly, and no zero
    is negative: sums of such values are the same in any order or rewrite."""
    if x.dtype.kind in "biu":
        return True
    return bool(_plain(x) and (np.abs(x) <= 2.0 ** np.finfo(x.dtype).nmant).all()
                and (np.round(x) == x).all() and not np.signbit(x[x == 0]).any())


def _sum(x: np.ndarray, y: np.ndarray, subtract: bool = False) -> np.ndarray | None:
    """`x + y` (or `x - y`) where its value cannot depend on how it is computed."""
    if not (_whole(x) and _whole(y)):
        return None
    return np.subtract(x, y) if subtract else np.add(x, y)


def _product(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """`x * y` where one factor holds only -1, 0 and 1 (the seeds, moved and summed):
    each entry is then the other factor's, its negative, a zero or a NaN, whichever
    way it is computed."""
    if not (_plain(x) and _plain(y)):
        return None
    if x.dtype.kind == "f" and not any(np.isin(f, (-1, 0, 1)).all() for f in (x, y)):
        return None
    return np.multiply(x, y)


def _selects(x: np.ndarray, contracting: Sequence[int]) -> bool:
    """Whether `x` holds only -1, 0 and 1, with exactly one nonzero entry over its
    `contracting` axes for every index of its other axes (a permutation matrix, the
    unit seeds in another order, say)."""
    if not np.isin(x, (-1, 0, 1)).all():
        return False
    rest = [a for a in range(x.ndim) if a not in contracting]
    rows = np.transpose(x, rest + list(contracting)).reshape(
        math.prod(x.shape[a] for a in rest), -1)
    return bool(rows.shape[1]) and bool(((rows != 0).sum(axis=1) == 1).all())


def _dot(x: np.ndarray, y: np.ndarray, dimension_numbers: Any,
         **_: Any) -> np.ndarray | None:
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
    shared_x: list[str | None] = [None] * x.ndim
    shared_y: list[str | None] = [None] * y.ndim
    for i, j in (*zip(bx, by), *zip(cx, cy)):
        shared_x[i] = shared_y[j] = next(letters)
    sx = [a or next(letters) for a in shared_x]
    sy = [a or next(letters) for a in shared_y]
    out = ([sx[i] for i in bx] + [a for i, a in enumerate(sx) if i not in (*bx, *cx)]
           + [a for j, a in enumerate(sy) if j not in (*by, *cy)])
    found = np.einsum(f"{''.join(sx)},{''.join(sy)}->{''.join(out)}", x, y)
    return None if (found == 0).any() else found


# The operations `fold_known` evaluates, each to the values XLA computes: data moved,
# exact conversions, and arithmetic only where its result cannot depend on how it is
# computed (XLA rewrites expressions of constants, `a / c` as `a * (1 / c)` or `a + 0`
# as `a`, and flushes subnormals to zero).
_NUMPY: dict[str, Callable[..., Any]] = {
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


def _permutation(value: np.ndarray) -> bool:
    """Whether `value` is a permutation matrix (0 and 1 only, one 1 in every row and
    every column), the identity included."""
    return bool(value.ndim == 2 and value.shape[0] == value.shape[1]
                and value.dtype.kind in "biuf" and (value >= 0).all()
                and _selects(value, (0,)) and _selects(value, (1,)))
