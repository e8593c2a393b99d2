"""The functions of the entry points, as traced into programs: the model, its totals,
its finite differences."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .._hostcalls import sessions as _sessions
from .._operators.complex_step import complex_step
from .layout import row, split_seeds


class TotalsOptions(NamedTuple):
    """What selects a totals program besides its layout."""

    mode: str  # "batched", "loop" or "unrolled"
    of: tuple[str, ...]  # output names
    wrt: tuple[str, ...]  # input names
    with_values: bool = False  # whether it returns the outputs' values too
    direction: str = "rev"  # "rev": sweeps seeded by `of`; "fwd": seeded by `wrt`


class FDOptions(NamedTuple):
    """What selects a finite-difference program besides its layout."""

    wrt: tuple[str, ...]  # input names
    form: str  # "central", "forward" or "backward"
    step: float
    method: str = "fd"  # "fd" (finite differences) or "cs" (complex step)


class HvpOptions(NamedTuple):
    """What selects a Hessian-vector product program besides its layout."""

    of: str  # the scalar output
    wrt: tuple[str, ...]  # input names
    # K, the tangents' leading axis of directions (a program per K: its calls' batch
    # sizes are K), or None where they carry none
    directions: int | None


# what selects an entry point's program (`run` takes none)
Options = TotalsOptions | FDOptions | HvpOptions | tuple[()]


def call_model(model: Callable[..., Any], point: dict[str, Any]) -> dict[str, jax.Array]:
    """**Returns:** the model's outputs at `point`, checked to be a dict of arrays."""
    out = model(**point)
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        raise TypeError(f"Problem: the model returned a {type(out).__name__}; expected "
                        "a dict of output name -> array.")
    return {k: jnp.asarray(v) for k, v in out.items()}


def build(model: Callable[..., Any], name: str, options: Options, layout: Any,
          vectorize: bool = True) -> Callable[..., Any]:
    """The function of an entry point; `vectorize=False` replaces `vmap` over seeds
    or perturbations by a sequential loop (for models JAX cannot vmap)."""
    def batch(fn: Callable[[Any], Any], xs: Any) -> Any:
        if not vectorize:
            return lax.map(fn, xs)
        session = _sessions.session()
        if session is None:
            return jax.vmap(fn)(xs)
        # The lean path's token leaves the vmap as an unbatched output.
        out, session.token = jax.vmap(lambda x: (fn(x), session.token),
                                      out_axes=(0, None))(xs)
        return out

    if name == "run":
        return lambda point: call_model(model, point)
    if name == "compute_hvp":
        assert isinstance(options, HvpOptions)
        return _hvp(model, options, batch)
    if name == "fd":
        assert isinstance(options, FDOptions)
        return _perturbed(model, options, batch)
    assert isinstance(options, TotalsOptions)
    of, wrt, direction = options.of, options.wrt, options.direction
    with_values = options.with_values
    mode = "loop" if options.mode == "batched" and not vectorize else options.mode

    def sweeps(sweep: Callable[[Any], Any], seeds: dict[str, Any]) -> dict[str, Any]:
        """`sweep` of every row of `seeds`, stacked, as `mode` says."""
        if mode == "batched":
            return batch(sweep, seeds)
        if mode == "loop":
            return lax.scan(lambda carry, seed: (carry, sweep(seed)), None, seeds)[1]
        n = next(iter(seeds.values())).shape[0]
        rows = [sweep({k: row(v, i) for k, v in seeds.items()}) for i in range(n)]
        return {k: jnp.stack([r[k] for r in rows]) for k in rows[0]}

    def totals(point: dict[str, Any], *packed: Any) -> dict[Any, Any]:
        diff = {k: point[k] for k in wrt}  # differentiate only what was asked for
        rest = {k: v for k, v in point.items() if k not in diff}
        order: list[str] = []  # the model's order of its outputs (jax.vjp's is sorted)

        def restricted(d: dict[str, Any]) -> dict[str, jax.Array]:
            values = call_model(model, {**rest, **d})
            order[:] = values
            return values

        if direction == "fwd":  # one sweep per entry of `wrt`: of name -> tangents
            values, linear = linearized(restricted, diff)
            cts = sweeps(lambda t: {k: linear(t)[k] for k in of},
                         dict(zip(wrt, packed)))
        else:  # one sweep per entry of `of`: wrt name -> cotangents
            values, back = pullback(restricted, diff)
            cts = sweeps(lambda seed: back(seed)[0], split_seeds(packed, layout))
        if not with_values:
            return cts
        # (packed in the model's order, as `run` packs them: XLA then makes no copy
        # of the slices of a vector)
        return {**{("value", k): values[k] for k in order},
                **{("total", k): v for k, v in cts.items()}}

    return totals


def _perturbed(model: Callable[..., Any], options: FDOptions,
               batch: Callable[[Callable[[Any], Any], Any], Any]) -> Callable[..., Any]:
    """The function of the finite-difference program: the model at the point plus each
    perturbation, with complex steps where `options.method` is "cs"."""
    complex_steps = options.method == "cs"

    def perturbed(point: dict[str, Any], deltas: dict[str, Any]) -> Any:
        with complex_step(complex_steps):
            return batch(lambda d: call_model(
                model, {**point, **{k: point[k] + d[k] for k in d}}), deltas)
    return perturbed


def _hvp(model: Callable[..., Any], options: HvpOptions,
         batch: Callable[[Callable[[Any], Any], Any], Any]) -> Callable[..., Any]:
    """The function of `compute_hvp`: the gradient of the inner product of the output's
    gradient with the tangent (reverse over forward: per operator call a forward, a
    `jvp`, an `hvp` and a `vjp` call, and no gradient computed for nothing), for every
    direction at once where the tangents carry a leading axis of them."""
    of, wrt, directions = options

    def hvp(point: dict[str, Any], tangents: dict[str, Any]) -> dict[str, Any]:
        diff = {k: point[k] for k in wrt}
        rest = {k: v for k, v in point.items() if k not in diff}

        def value(d: dict[str, Any]) -> Any:
            return call_model(model, {**rest, **d})[of]

        def along(tangent: dict[str, Any]) -> dict[str, Any]:
            def slope(d: dict[str, Any]) -> Any:
                session = _sessions.session()
                if session is None:
                    return jax.jvp(value, (d,), (tangent,))[1]
                # (the lean path's token leaves jax.jvp as an output of its own)
                (_, session.token), (dot, _) = jax.jvp(
                    lambda d: (value(d), session.token), (d,), (tangent,))
                return dot

            out, back = pullback(slope, diff)
            return back(jnp.ones_like(out))[0]

        return batch(along, tangents) if directions is not None else along(tangents)

    return hvp


def linearized(fn: Callable[[Any], Any], diff: dict[str, Any],
               ) -> tuple[Any, Callable[[Any], Any]]:
    """`jax.linearize(fn, diff)`: the values and the linear map of the tangents; on the
    lean path the token leaves `jax.linearize` as an output of its own, as in
    `pullback`."""
    session = _sessions.session()
    if session is None:
        return jax.linearize(fn, diff)
    (values, session.token), linear = jax.linearize(lambda d: (fn(d), session.token), diff)
    return values, lambda tangent: linear(tangent)[0]


def pullback(fn: Callable[[Any], Any], diff: dict[str, Any],
             ) -> tuple[Any, Callable[[Any], Any]]:
    """`jax.vjp(fn, diff)`: the values and the pullback; on the lean path the token
    leaves `jax.vjp` as an output of its own (with a zero cotangent), so the
    backward calls continue the forward calls' chain."""
    session = _sessions.session()
    if session is None:
        return jax.vjp(fn, diff)
    (values, session.token), back = jax.vjp(lambda d: (fn(d), session.token), diff)
    zero = jnp.zeros(())
    return values, lambda seed: back((seed, zero))
