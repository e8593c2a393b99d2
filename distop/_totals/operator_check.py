"""`check_operator`: one operator's methods against each other and finite differences,
on its own, collectively on every rank.

Each rank draws a tangent t for its inputs and a cotangent y_bar for its outputs (the
same on every rank for replicated ones). Then, on every rank alike:
- `jvp vs fd`: jvp(t) against the central difference of forward along t;
- `vjp vs fd` and `vjp vs jvp`: the dot-product test, <y_bar, J t> = <vjp(y_bar), t>,
  with J t from the differences or from jvp, summed over the ranks (a replicated value
  counted once);
- `<method> batched`: each method on a batch of two rows against the rows one by one;
- `hvp vs fd`: hvp(y_bar, t) against the central difference of vjp(y_bar) along t, and
  `hvp symmetry`: <s, hvp(y_bar, t)> = <t, hvp(y_bar, s)> for a second tangent s,
  summed over the ranks (the weighted Hessian is symmetric), where the operator has an
  `hvp` (an implicit operator: a `residual_hvp`, which these check through the
  second-order adjoint it makes).
"""

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._agreement import comm as _comm
from .._dtypes import inexact_dtype
from .._errors import DerivativeCheckError, DistopError, MissingMethodError
from .._operators.implicit import ImplicitOperator, provides_second_derivatives
from .._operators.operator import DistributedOperator, as_arrays
from .._operators.primitive import implements
from .differences import JUDGEABLE, default_step, estimate, judge, multiples
from .totals import STDOUT


@dataclasses.dataclass
class OperatorCheck:
    """The result of comparing two ways of computing one of an operator's values.

    Fields: `pair` (e.g. `"vjp vs jvp"`), `abs_error` (the largest difference, over
    every rank), `allowed` (what that difference is allowed: atol + rtol |value|, plus
    the error finite differences carry where they take part), `ok` (every entry within
    its allowance, on every rank), `rank` (the rank of the worst entry; None for a sum
    over the ranks), `where` (that entry, in words).
    """

    pair: str
    abs_error: float
    allowed: float
    ok: bool
    rank: int | None
    where: str


def check_operator(op: DistributedOperator, *inputs: Any,
                   replicated_inputs: Iterable[int] = (),
                   replicated_outputs: Iterable[int] = (), step: float | None = None,
                   atol: float = 1e-8, rtol: float = 1e-6, seed: int = 0,
                   out_stream: Any = STDOUT,
                   raise_on_error: bool = False) -> dict[str, OperatorCheck]:
    """Compare an operator's forward, vjp, jvp and hvp with each other and with finite
    differences, collectively: call it on every rank with that rank's inputs (an
    implicit operator: its derivatives, made of its residual methods and solves).

    **Arguments:**
    - `op`: the `DistributedOperator`.
    - `inputs`: this rank's inputs, as for `op(*inputs)`.
    - `replicated_inputs`, `replicated_outputs`: the positions of the inputs and
      outputs that are replicated (the same on every rank, counted once); the others
      are rank-local or distributed (each rank's own).
    - `step`: the finite-difference step along the tangent; by default 1e-6 for
      float64 values, 1e-3 for float32 ones (as `Problem.check_totals`).
    - `atol`, `rtol`: the tolerances.
    - `seed`: seeds the random tangents and cotangents.
    - `out_stream`: where rank 0 prints the report (default `sys.stdout` as it is at
      the call); None prints nothing.
    - `raise_on_error`: raise `DerivativeCheckError` on every rank if a pair fails.

    **Returns:** dict of pair name -> `OperatorCheck`, the same on every rank. A method
    the operator does not implement leaves its pairs out.
    """
    name = type(op).__name__
    comm = _comm.private(op.comm)
    rank, size = comm.Get_rank(), comm.Get_size()
    arrays = as_arrays(name, inputs)
    outs = _tuple(op(*arrays))
    rep_in, rep_out = _positions(name, "inputs", replicated_inputs, len(arrays)), _positions(
        name, "outputs", replicated_outputs, len(outs))
    _check_same_call(comm, name, arrays, outs, rep_in, rep_out)
    s = _sample(op, comm, arrays, outs, rep_in, rep_out, seed)
    if step is None:
        step = default_step("fd", [a.dtype for a in s.primals]
                            + [outs[k].dtype for k in s.real_out])
    results, jvp, vjp, pullback = _first_order(s, step, atol, rtol)
    results += _batched_checks(s, step, atol, rtol, jvp, vjp, pullback)
    if vjp is not None and jvp is not None and _has_hvp(op) and s.real_out:
        others = [_draw(seed, rank, arrays[i].shape, arrays[i].dtype, i in rep_in, 2000 + i)
                  for i in s.diff]
        results += _hvp_checks(comm, s.f, s.primals, s.tangents, others, s.cotangents,
                               s.w_in, step, atol, rtol)
    found = {r.pair: r for r in results}
    _report(found, name, size, arrays, outs, out_stream, rank,
            "residual_hvp" if isinstance(op, ImplicitOperator) else "hvp")
    failed = [r for r in results if not r.ok]
    if raise_on_error and failed:
        raise DerivativeCheckError(f"check_operator({name}): " + "; ".join(
            f"{r.pair}: error {r.abs_error:.2e} > allowed {r.allowed:.2e} at {r.where}"
            for r in failed))
    return found


@dataclasses.dataclass(frozen=True)
class _Sample:
    """An operator as a function of its differentiable inputs, at this rank's inputs,
    with the random tangents and cotangents the checks apply it to.

    **Arguments:**
    - `comm`: the operator's private communicator.
    - `f`: the operator's outputs, a tuple, from its differentiable inputs.
    - `diff`: the positions of the differentiable inputs.
    - `real_out`: the positions of the differentiable outputs.
    - `primals`: the differentiable inputs.
    - `tangents`: a random tangent per differentiable input.
    - `cotangents`: a random cotangent per output (zeros of dtype float0 for the others).
    - `w_in`, `w_out`: the weight of each rank's share of a differentiable input's and
      output's pairing in a sum over the ranks: a replicated value counted once.
    """

    comm: Any
    f: Callable[..., tuple[Any, ...]]
    diff: list[int]
    real_out: list[int]
    primals: list[Any]
    tangents: list[np.ndarray]
    cotangents: list[np.ndarray]
    w_in: list[float]
    w_out: list[float]


def _sample(op: DistributedOperator, comm: Any, arrays: Sequence[Any], outs: Sequence[Any],
            rep_in: set[int], rep_out: set[int], seed: int) -> _Sample:
    """**Returns:** the operator at this rank's inputs `arrays` (its outputs `outs`),
    with tangents and cotangents drawn from `seed` (see `_draw`)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    diff = [i for i, a in enumerate(arrays) if inexact_dtype(a.dtype)]
    real_out = [k for k, y in enumerate(outs) if inexact_dtype(y.dtype)]

    def f(*d: Any) -> tuple[Any, ...]:
        args = list(arrays)
        for i, v in zip(diff, d):
            args[i] = v
        return _tuple(op(*args))

    tangents = [_draw(seed, rank, arrays[i].shape, arrays[i].dtype, i in rep_in, i)
                for i in diff]
    cotangents = [_draw(seed, rank, y.shape, y.dtype, k in rep_out, 1000 + k)
                  if k in real_out else np.zeros(y.shape, jax.dtypes.float0)
                  for k, y in enumerate(outs)]
    return _Sample(comm, f, diff, real_out, [arrays[i] for i in diff], tangents, cotangents,
                   [1 / size if i in rep_in else 1.0 for i in diff],
                   [1 / size if k in rep_out else 1.0 for k in real_out])


def _draw(seed: int, rank: int, shape: Sequence[int], dtype: Any, replicated: bool,
          salt: int) -> np.ndarray:
    """**Returns:** a random array of `shape` and `dtype`, from `seed` and `salt`: the
    same on every rank where `replicated`, this rank's own otherwise."""
    rng = np.random.default_rng([seed, salt, 0 if replicated else rank + 1])
    drawn = rng.standard_normal(tuple(shape))
    if jnp.issubdtype(dtype, jnp.complexfloating):
        drawn = drawn + 1j * rng.standard_normal(tuple(shape))
    return np.asarray(drawn, dtype)


def _first_order(s: _Sample, step: float, atol: float, rtol: float,
                 ) -> tuple[list[OperatorCheck], Any, Any, Any]:
    """The checks of `jvp` and `vjp` against finite differences and each other.

    **Returns:** (the checks; the jvp along the tangents, the vjp of the cotangents, and
    the pullback of `jax.vjp`, each None where the operator lacks what it needs).
    """
    fd, fd_error = _differences(s.f, s.primals, s.tangents, s.real_out, step)
    jvp = _try(lambda: jax.jvp(s.f, s.primals, s.tangents)[1])
    pullback = jax.vjp(s.f, *s.primals)[1] if s.diff else None
    vjp = _try(lambda: pullback(tuple(s.cotangents))) if pullback is not None else None
    results: list[OperatorCheck] = []
    if jvp is not None:
        got = _flat([jvp[k] for k in s.real_out])
        results.append(_entrywise(s.comm, "jvp vs fd", got, fd, atol + rtol * np.abs(fd),
                                  fd_error))
    if vjp is not None:
        right = _pairing(vjp, s.tangents, s.w_in)
        for pair, ydot, error in (("vjp vs fd", fd, fd_error),
                                  ("vjp vs jvp", None if jvp is None else _flat(
                                      [jvp[k] for k in s.real_out]), 0.0)):
            if ydot is None:
                continue
            left = _pairing_flat([s.cotangents[k] for k in s.real_out], ydot, s.w_out, error)
            results.append(_dot(s.comm, pair, left, right, atol, rtol))
    return results, jvp, vjp, pullback


def _batched_checks(s: _Sample, step: float, atol: float, rtol: float, jvp: Any, vjp: Any,
                    pullback: Any) -> list[OperatorCheck]:
    """**Returns:** the checks of forward, `jvp` and `vjp` on a batch of two rows against
    the rows one by one (those the operator has; see `_first_order`)."""
    f, real_out, comm = s.f, s.real_out, s.comm
    results: list[OperatorCheck] = []
    if s.diff:
        results.append(_batched(comm, "forward batched", lambda x: _jflat(
            [f(*x)[k] for k in real_out]), [np.stack([p, p + step * t])
                                            for p, t in zip(s.primals, s.tangents)], atol, rtol))
    if jvp is not None:
        results.append(_batched(comm, "jvp batched", lambda t: _jflat(
            [jax.jvp(f, s.primals, list(t))[1][k] for k in real_out]),
            [np.stack([t, -2 * t]) for t in s.tangents], atol, rtol))
    if vjp is not None and pullback is not None and real_out:
        def pulled(rows: Sequence[Any]) -> Any:
            given = list(s.cotangents)
            for k, c in zip(real_out, rows):
                given[k] = c
            return _jflat(pullback(tuple(given)))

        results.append(_batched(comm, "vjp batched", pulled, [
            np.stack([s.cotangents[k], -2 * s.cotangents[k]]) for k in real_out], atol, rtol))
    return results


def _hvp_checks(comm: Any, f: Callable[..., Any], primals: Sequence[Any],
                tangents: Sequence[Any], others: Sequence[Any], cotangents: Sequence[Any],
                weights: Sequence[float], step: float, atol: float,
                rtol: float) -> list[OperatorCheck]:
    """The checks of `hvp`: against differences of `vjp` along `tangents`, its symmetry
    (with the tangents `others`), and its batched form."""
    def pulled(*p: Any) -> tuple[Any, ...]:  # vjp(y_bar) at p
        return tuple(jax.vjp(f, *p)[1](tuple(cotangents)))

    def hvp(t: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(jax.jvp(pulled, tuple(primals), tuple(t))[1])

    along_t, along_s = hvp(tangents), hvp(others)
    fd, fd_error = _differences(pulled, primals, tangents, range(len(primals)), step)
    got = _flat(along_t)
    return [
        _entrywise(comm, "hvp vs fd", got, fd, atol + rtol * np.abs(fd), fd_error),
        _dot(comm, "hvp symmetry", _pairing(along_t, others, weights),
             _pairing(along_s, tangents, weights), atol, rtol,
             "the sum over ranks of <s, hvp t> against <t, hvp s>"),
        _batched(comm, "hvp batched", lambda t: _jflat(hvp(t)),
                 [np.stack([t, -2 * t]) for t in tangents], atol, rtol),
    ]


def _has_hvp(op: DistributedOperator) -> bool:
    """**Returns:** whether `op` has second derivatives of its own to check: an `hvp`,
    or an implicit operator's `residual_hvp`."""
    if isinstance(op, ImplicitOperator):
        return provides_second_derivatives(op)
    return implements(op, "hvp")


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _positions(name: str, what: str, given: Iterable[int], count: int) -> set[int]:
    found = set()
    for k in given:
        if not isinstance(k, (int, np.integer)) or not 0 <= int(k) < count:
            raise ValueError(f"check_operator({name}, replicated_{what}=...): {k!r} is not "
                             f"the position of one of its {count} {what}.")
        found.add(int(k))
    return found


def _check_same_call(comm: Any, name: str, arrays: Sequence[Any], outs: Sequence[Any],
                     rep_in: set[int], rep_out: set[int]) -> None:
    """Raise on every rank where the ranks check different calls."""
    mine = (name, [str(a.dtype) for a in arrays], [str(y.dtype) for y in outs],
            sorted(rep_in), sorted(rep_out))
    every = comm.allgather(mine)
    if any(e != every[0] for e in every):
        raise DistopError(f"check_operator({name}): the ranks check different calls "
                          "(operator, input and output dtypes, replicated positions):\n"
                          + "\n".join(f"  rank {r}: {e}" for r, e in enumerate(every))
                          + "\nCall it with the same operator and kinds of inputs on "
                          "every rank.")


def _try(make: Callable[[], Any]) -> Any:
    """**Returns:** `make()`, or None where the operator lacks the method it needs
    (the same on every rank: a missing method raises before its call runs)."""
    try:
        return make()
    except MissingMethodError:
        return None


def _flat(values: Sequence[Any]) -> np.ndarray:
    """**Returns:** `values` flattened into one real vector (complex: real parts, then
    imaginary parts)."""
    flat = np.concatenate([np.ravel(np.asarray(v)) for v in values] + [np.zeros(0)])
    return np.concatenate([flat.real, flat.imag]) if np.iscomplexobj(flat) else flat


def _differences(f: Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any],
                 real_out: Sequence[int], step: float) -> tuple[np.ndarray, np.ndarray]:
    """**Returns:** the central difference of `f` along `tangents`, and the error it
    carries (see `_differences.estimate`), both flat as `_flat` makes them."""
    factors = multiples("fd", "central")
    values = [_flat([f(*(p + factor.real * step * t for p, t in zip(primals, tangents)))[k]
                     for k in real_out])[None] for factor in factors]
    steps = [np.full((1, 1), factor.real * step) for factor in factors]
    eps = max([float(jnp.finfo(v.dtype).eps) for v in values] + [
        float(jnp.finfo(p.dtype).eps) for p in primals] + [0.0])
    found = estimate("fd", "central", values, None, steps, eps)
    # the inputs round x + h t too: by eps |x| / h of each entry's derivative
    scale = max([float(jnp.max(jnp.abs(p), initial=0.0)) for p in primals] + [0.0])
    error = found.error + eps * scale / step * np.abs(found.value)
    return found.value[0], error[0]


def _entrywise(comm: Any, pair: str, got: np.ndarray, ref: np.ndarray,
               tolerated: np.ndarray, ref_error: np.ndarray) -> OperatorCheck:
    """Compare two vectors entry by entry on every rank, each allowed `tolerated` plus
    the error `ref_error` of the reference (an entry within that only by an error that
    is a visible share of the largest reference entry cannot be judged, and fails); the
    worst over the ranks."""
    allowed = tolerated + ref_error
    with np.errstate(invalid="ignore", over="ignore"):
        inexact = (np.abs(got - ref) > tolerated) & (
            ref_error > JUDGEABLE * np.max(np.abs(ref), initial=0.0))
    diff, within, share = judge(got, ref, allowed, inexact)
    k = int(np.argmax(share)) if share.size else -1
    mine = (float(share[k]), float(diff[k]), float(allowed[k]), k) if k >= 0 else (
        0.0, 0.0, 0.0, -1)
    every = comm.allgather((mine, bool(np.all(within))))
    worst = max(range(len(every)), key=lambda r: every[r][0][0])
    (_, error, bound, entry), _ = every[worst]
    where = f"rank {worst}, entry {entry}" if entry >= 0 else "no entries"
    return OperatorCheck(pair, error, bound, all(ok for _, ok in every), worst, where)


def _pairing(values: Sequence[Any], others: Sequence[Any], weights: Sequence[float],
             ) -> tuple[float, float, float]:
    """**Returns:** this rank's share of Re sum <values, others> (no conjugate, as JAX
    pairs cotangents and tangents), of its sum of magnitudes, and of its error."""
    total, magnitude = 0.0, 0.0
    for v, o, w in zip(values, others, weights):
        product = np.ravel(np.asarray(v)) * np.ravel(np.asarray(o))
        total += w * float(np.sum(product).real)
        magnitude += w * float(np.sum(np.abs(product)))
    return total, magnitude, 0.0


def _pairing_flat(cotangents: Sequence[Any], ydot: np.ndarray, weights: Sequence[float],
                  error: Any) -> tuple[float, float, float]:
    """`_pairing` of the output cotangents with a flat J t (see `_flat`), whose entries
    err by `error`."""
    flat = [np.ravel(np.asarray(c)) for c in cotangents]
    w = np.concatenate([np.full(c.size, wk) for c, wk in zip(flat, weights)] + [np.zeros(0)])
    c = np.concatenate(flat + [np.zeros(0)])
    if np.iscomplexobj(c):  # (Re(c z) = Re c Re z - Im c Im z)
        c, w = np.concatenate([c.real, -c.imag]), np.concatenate([w, w])
    products = w * c.real * ydot
    return (float(np.sum(products)), float(np.sum(np.abs(products))),
            float(np.sum(w * np.abs(c) * error)))


def _dot(comm: Any, pair: str, left: tuple[float, float, float],
         right: tuple[float, float, float], atol: float, rtol: float,
         where: str = "the sum over ranks of <y_bar, J t> against <x_bar, t>",
         ) -> OperatorCheck:
    """Compare two pairings summed over the ranks (the same on every rank)."""
    sums = comm.allreduce(np.array(left + right))  # (the sum over ranks)
    error = abs(float(sums[0] - sums[3]))
    allowed = atol + rtol * max(float(sums[1]), float(sums[4])) + float(sums[2])
    ok = math.isfinite(error) and math.isfinite(allowed) and error <= allowed
    return OperatorCheck(pair, error, allowed, ok, None, where)


def _batched(comm: Any, pair: str, fn: Callable[[Sequence[Any]], Any],
             batch: Sequence[np.ndarray], atol: float, rtol: float) -> OperatorCheck:
    """Compare `fn` on a batch of two rows (vmapped: one batched call of the method)
    with `fn` on each row."""
    together = np.ravel(np.asarray(jax.vmap(lambda *b: fn(b))(*batch)))
    rows = np.concatenate([np.asarray(fn([b[i] for b in batch])) for i in range(2)])
    return _entrywise(comm, pair, together, rows, atol + rtol * np.abs(rows), np.zeros(rows.shape))


def _jflat(values: Sequence[Any]) -> Any:
    """`_flat` for JAX values (inside `vmap`)."""
    flat = jnp.concatenate([jnp.ravel(v) for v in values]) if values else jnp.zeros(0)
    return jnp.concatenate([flat.real, flat.imag]) if jnp.iscomplexobj(flat) else flat


def _report(found: dict[str, OperatorCheck], name: str, size: int, arrays: Sequence[Any],
            outs: Sequence[Any], out_stream: Any, rank: int, hvp: str = "hvp") -> None:
    """Print the table of `found` on rank 0 (`hvp`: the method the `hvp` rows check,
    an implicit operator's `residual_hvp`)."""
    if out_stream is None or rank != 0:
        return
    if out_stream is STDOUT:
        out_stream = sys.stdout

    def kinds(values: Sequence[Any]) -> str:
        return ", ".join(f"{v.dtype}{list(v.shape)}" for v in values)

    lines = [f"check_operator: {name} on {size} rank(s), inputs ({kinds(arrays)}), outputs "
             f"({kinds(outs)}) on rank 0",
             f"{'pair':<16} {'abs error':>10} {'allowed':>10}  {'worst':<24} flag"]
    lines.append("-" * len(lines[-1]))
    for r in found.values():
        where = r.where if r.rank is not None else "sum over ranks"
        lines.append(f"{r.pair:<16} {r.abs_error:>10.2e} {r.allowed:>10.2e}  {where:<24} "
                     + ("" if r.ok else "<-- FAILED"))
    lines += [f"check_operator: {name}.{method} is wrong: it disagrees with finite "
              f"differences, which {other} agrees with" for method, other in (
                  ("vjp", "jvp"), ("jvp", "vjp")) if _blames(found, method, other)]
    if _blames(found, "hvp", "vjp"):
        lines.append(f"check_operator: {name}.{hvp} is wrong: "
                     + ("" if hvp == "hvp" else "the second-order adjoint made of it ")
                     + "disagrees with finite differences of vjp, which agrees with finite "
                     "differences itself")
    print("\n".join(lines), file=out_stream, flush=True)


def _blames(found: dict[str, OperatorCheck], method: str, other: str) -> bool:
    """**Returns:** whether the checks single out `method` as wrong: it fails against
    finite differences, and `other` passes against them."""
    mine, theirs = found.get(f"{method} vs fd"), found.get(f"{other} vs fd")
    return mine is not None and theirs is not None and not mine.ok and theirs.ok
