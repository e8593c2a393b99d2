"""Implicit operators: a distributed solve whose derivatives come from one adjoint solve.

An `ImplicitOperator` computes y with R(y, inputs) = 0. Its derivatives follow from the
implicit function theorem: the VJP of y is `-residual_vjp(solve_adjoint(y_bar))`, the
JVP `-solve_linear(residual_jvp(tangents))`. Neither differentiates the solver's
iterations, and neither solves the forward problem again.

A call binds two ordinary operator calls, so every rule of the explicit ones (ordering,
the lean path, batching, fusing, the schedule, the checks) holds as it is:
- `Op.solve`: the solve, on inputs that carry no derivative;
- `Op.state`: y once more, as a function of the inputs, whose derivatives are the ones
  above. It receives the y that `solve` returned (a copy into XLA's buffer on the lean
  path), so the adjoint reuses it on every rank alike.
"""

import functools
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from jax import lax

from .._agreement.comm import private
from .._dtypes import inexact_dtype
from .._errors import MissingMethodError, OperatorError, operator_error
from .operator import DistributedOperator, apply, as_arrays, explicit_order

_METHODS = {
    "solve": "solve(self, comm, *inputs), which every implicit operator needs",
    "solve_adjoint": ("solve_adjoint(self, comm, y_bar, y, *inputs), which reverse mode "
                      "(grad, vjp, jacrev, compute_totals) needs"),
    "residual_vjp": ("residual_vjp(self, comm, lam, y, *inputs), which reverse mode "
                     "(grad, vjp, jacrev, compute_totals) needs"),
    "solve_linear": ("solve_linear(self, comm, rhs, y, *inputs), which forward mode "
                     "(jax.jvp, jacfwd) needs"),
    "residual_jvp": ("residual_jvp(self, comm, tangents, y, *inputs), which forward mode "
                     "(jax.jvp, jacfwd) needs"),
}


class ImplicitOperator(DistributedOperator):
    """Base class of an operator defined by a residual: y with R(y, inputs) = 0.

    Subclasses implement, in numpy/scipy with mpi4py, on this rank's blocks:
    - `solve(self, comm, *inputs) -> y`;
    - `solve_adjoint(self, comm, y_bar, y, *inputs) -> lam`, solving (dR/dy)^T lam =
      y_bar;
    - `residual_vjp(self, comm, lam, y, *inputs) -> tuple`: (dR/d input_i)^T lam for
      each input (a tuple even for one input; None for an integer input);
    - optionally, for forward mode: `solve_linear(self, comm, rhs, y, *inputs)`, solving
      (dR/dy) z = rhs, and `residual_jvp(self, comm, tangents, y, *inputs)`, giving
      sum_i (dR/d input_i) tangents[i] (None in place of an integer input's tangent).

    distop derives the VJP, input_bar_i = -residual_vjp_i(solve_adjoint(y_bar)).
    It derives the JVP, y_dot = -solve_linear(residual_jvp(tangents)).
    `solve` runs once per call; its y is what the adjoint receives.

    Class attributes (a subclass sets them in its body):
    - `solve_collectives`, `adjoint_collectives`, `residual_collectives`: the
      communication each method issues (`solve`; `solve_adjoint` and `solve_linear`;
      `residual_vjp` and `residual_jvp`), as an explicit operator declares it.
    - `batched_adjoint`: True if `solve_adjoint` and `residual_vjp` take `y_bar` and
      `lam` with a leading batch axis (K seeds: one block solve for all of them; K may
      be 1) and return one; `y` and the inputs come without it. Otherwise distop calls
      them once per seed, in a fixed order.
    - `ordered`: as for `DistributedOperator`.
    - `complex_step` (with `takes_complex_step`), `batched_forward` and `unbatched`: as
      for `DistributedOperator`, of `solve`. The explicit names of the others hold too
      (`forward_collectives` adds to `solve_collectives`; `vjp_collectives` and
      `jvp_collectives` to the adjoint's; `batched_vjp` means `batched_adjoint`).
      `linear` gives no transpose: `jax.linear_transpose` of a call raises.

    `output_spec` gives y's shape and dtype (default: the first input's).
    In the schedule, a call shows as `Op.solve` and `Op.state`, and its derivatives as
    `Op.adjoint` (reverse mode) and `Op.linear` (forward mode).

    **Arguments:**
    - the subclass's own fields, and `comm` and `ordered`: as for `DistributedOperator`.

    **Returns:** the operator; `op(*inputs)` returns y as a JAX array.

    **Raises:** as `DistributedOperator`; an error names the method that failed
    (`Poisson.solve_adjoint on rank 2: ...`).
    """

    solve_collectives: ClassVar[tuple[str, ...]] = ()
    adjoint_collectives: ClassVar[tuple[str, ...]] = ()
    residual_collectives: ClassVar[tuple[str, ...]] = ()
    batched_adjoint: ClassVar[bool] = False

    def solve(self, comm: Any, *inputs: Any) -> Any:
        """Solve R(y, inputs) = 0 on this rank's blocks.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `inputs`: C-contiguous numpy arrays (read-only).

        **Returns:** y, a numpy array of `output_spec`'s shape and dtype.

        **Raises:** `MissingMethodError` here, in the base class.
        """
        raise MissingMethodError(_missing(type(self), "solve"))

    def solve_adjoint(self, comm: Any, y_bar: Any, y: Any, *inputs: Any) -> Any:
        """Solve (dR/dy)^T lam = y_bar.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `y_bar`: the cotangent of y (with a leading batch axis if `batched_adjoint`).
        - `y`: the solution `solve` returned.
        - `inputs`: the inputs of that call.

        **Returns:** lam, shaped as `y_bar`.

        **Raises:** `MissingMethodError` here, in the base class.
        """
        raise MissingMethodError(_missing(type(self), "solve_adjoint"))

    def residual_vjp(self, comm: Any, lam: Any, y: Any, *inputs: Any) -> Any:
        """Pull `lam` back through the residual to each input: (dR/d input_i)^T lam.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `lam`: the adjoint solution (with a leading batch axis if `batched_adjoint`).
        - `y`: the solution `solve` returned.
        - `inputs`: the inputs of that call.

        **Returns:** a tuple with one array per input, shaped as it (with the batch axis
        if `batched_adjoint`); None for an integer input.

        **Raises:** `MissingMethodError` here, in the base class.
        """
        raise MissingMethodError(_missing(type(self), "residual_vjp"))

    def solve_linear(self, comm: Any, rhs: Any, y: Any, *inputs: Any) -> Any:
        """Solve (dR/dy) z = rhs (optional: forward mode).

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `rhs`: the right-hand side, shaped as y.
        - `y`: the solution `solve` returned.
        - `inputs`: the inputs of that call.

        **Returns:** z, shaped as `rhs`.

        **Raises:** `MissingMethodError` here, in the base class.
        """
        raise MissingMethodError(_missing(type(self), "solve_linear"))

    def residual_jvp(self, comm: Any, tangents: Any, y: Any, *inputs: Any) -> Any:
        """Push the inputs' tangents through the residual (optional: forward mode).

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `tangents`: a tuple with one tangent per input (None for an integer input).
        - `y`: the solution `solve` returned.
        - `inputs`: the inputs of that call.

        **Returns:** sum_i (dR/d input_i) tangents[i], an array shaped as y.

        **Raises:** `MissingMethodError` here, in the base class.
        """
        raise MissingMethodError(_missing(type(self), "residual_jvp"))

    def forward(self, comm: Any, *inputs: Any, **keywords: Any) -> Any:
        """The solve (an implicit operator called as an explicit one's forward)."""
        return self.solve(comm, *inputs)

    def is_ordered(self) -> bool:
        """**Returns:** whether this operator's callbacks are ordered (see `ordered`)."""
        explicit = explicit_order(self)
        if explicit is not None:
            return explicit
        if not (self.solve_collectives or self.adjoint_collectives
                or self.residual_collectives or self.forward_collectives
                or self.vjp_collectives or self.jvp_collectives):
            return False
        return private(self.comm).Get_size() > 1

    def __call__(self, *inputs: Any) -> Any:
        return solve_implicit(self, inputs)


def solve_implicit(op: ImplicitOperator, inputs: Sequence[Any]) -> Any:
    """Call an implicit operator on JAX values (see the module docstring).

    **Arguments:**
    - `op`: the `ImplicitOperator`.
    - `inputs`: its inputs (arrays or scalars).

    **Returns:** y.
    """
    solve, state = _wrappers(type(op))
    # (the class body's `ordered` too: the wrappers are classes of their own)
    fields = {"comm": op.comm, "ordered": explicit_order(op)}
    arrays = as_arrays(type(op).__name__, inputs)
    # The solve itself carries no derivative: `state` gives y's, from the adjoint.
    y = apply(solve(op, **fields), [lax.stop_gradient(x) for x in arrays])
    if isinstance(y, tuple):
        raise TypeError(f"{type(op).__name__}.output_spec gives {len(y)} outputs; an "
                        "implicit operator solves for one array y (concatenate several "
                        "unknowns into one, or split them after the call).")
    return apply(state(op, **fields), [lax.stop_gradient(y), *arrays])


@functools.cache
def _wrappers(cls: type[ImplicitOperator]) -> tuple[type, type]:
    """**Returns:** the two explicit operator classes a call of `cls` binds (see the
    module docstring), named as `cls` and carrying its declarations.

    The declarations of an explicit operator hold for an implicit one as well:
    `forward_collectives` adds to `solve_collectives`, `vjp_collectives` and
    `jvp_collectives` to the adjoint's, `batched_vjp` means `batched_adjoint`;
    `batched_forward` and `unbatched` are the solve's; `complex_step` (with
    `takes_complex_step`) holds for both calls; `ordered` is passed on by the call.
    """
    adjoint = _union(cls.adjoint_collectives, cls.residual_collectives,
                     cls.vjp_collectives, cls.jvp_collectives)
    missing_reverse = [m for m in ("solve_adjoint", "residual_vjp") if not _has(cls, m)]
    missing_forward = [m for m in ("solve_linear", "residual_jvp") if not _has(cls, m)]
    solve = type(cls.__name__, (_Solve,), {
        "__module__": cls.__module__,
        "forward_collectives": _union(cls.solve_collectives, cls.forward_collectives),
        "batched_forward": bool(cls.batched_forward), "unbatched": cls.unbatched,
        "complex_step": bool(cls.complex_step), "forward": _solve_forward(cls)})
    attributes: dict[str, Any] = {
        "__module__": cls.__module__, "complex_step": bool(cls.complex_step),
        "vjp_collectives": adjoint,
        "jvp_collectives": adjoint,
        "batched_vjp": bool(cls.batched_adjoint or cls.batched_vjp),
        "missing_methods": {"hvp": (
            f"{cls.__name__} is an implicit operator, whose second derivatives are not "
            "available: its adjoint and linear solves are not differentiated again. "
            "Differentiate through it once, or write the map as an explicit operator "
            "with jvp and hvp")}}
    # A missing method: the phase stays the base class's, which distop reports as
    # missing (naming the user's method) before any rank runs the program.
    if missing_reverse:
        attributes["vjp"] = DistributedOperator.vjp
        attributes["missing_methods"]["vjp"] = _missing(cls, missing_reverse[0])
    if missing_forward:
        attributes["jvp"] = DistributedOperator.jvp
        attributes["missing_methods"]["jvp"] = _missing(cls, missing_forward[0])
    return solve, type(cls.__name__, (_State,), attributes)


def _union(*declared: Sequence[str]) -> tuple[str, ...]:
    """**Returns:** the names of the `declared` tuples, each once, in order."""
    return tuple(dict.fromkeys(name for names in declared for name in names))


def _solve_forward(cls: type[ImplicitOperator]) -> Any:
    """**Returns:** the solve wrapper's `forward`, taking the keywords (`batched`, `out`)
    that `cls.solve` takes."""

    def forward(self: Any, comm: Any, *inputs: Any, **keywords: Any) -> Any:
        return type(self.implicit).solve(self.implicit, comm, *inputs, **keywords)

    # (distop reads the keywords a method takes from its signature)
    forward.__signature__ = inspect.signature(cls.solve)  # type: ignore[attr-defined]
    return forward


def _has(cls: type, method: str) -> bool:
    return getattr(cls, method) is not getattr(ImplicitOperator, method)


def _missing(cls: type, method: str) -> str:
    return f"{cls.__name__} does not implement {_METHODS[method]}."


class _Wrapper(DistributedOperator):
    """One of the two calls an implicit operator's call binds."""

    implicit: Any = None
    # (jax.linear_transpose would meet the stop_gradient between the two calls)
    transpose_refusal: ClassVar[str] = (
        "is an implicit operator: its call has no transpose (declared linear or not). "
        "Transpose its linearization instead (jax.vjp of the function: one adjoint "
        "solve), or, for a linear system A y = x, write an explicit operator with A in "
        "forward and its transpose in vjp, declared linear = True")

    def takes_complex_step(self) -> bool:
        return type(self.implicit).takes_complex_step(self.implicit)


class _Solve(_Wrapper):
    """The solve of an implicit operator's call, as an explicit operator's forward."""

    phase_labels: ClassVar[dict[str, str]] = {"forward": "solve"}

    def output_spec(self, *input_specs: Any) -> Any:
        return type(self.implicit).output_spec(self.implicit, *input_specs)


class _State(_Wrapper):
    """y again, from the y `solve` returned and the inputs, with the implicit operator's
    derivatives: an explicit operator whose `vjp` is the adjoint and `jvp` the linear
    solve."""

    phase_labels: ClassVar[dict[str, str]] = {"forward": "state", "vjp": "adjoint",
                                              "jvp": "linear"}
    unbatched: ClassVar[str] = "expand_dims"

    def forward(self, comm: Any, y: np.ndarray, *inputs: Any,
                out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return y.copy()
        np.copyto(out, y)
        return out

    def output_spec(self, y: Any, *input_specs: Any) -> Any:
        return y

    def vjp(self, comm: Any, y_bar: np.ndarray, y: np.ndarray, *inputs: np.ndarray,
            batched: bool = False) -> tuple:
        if not batched:
            if not self.batched_vjp:
                return (np.zeros_like(y), *_pull_back(self.implicit, comm, y_bar, y, inputs, ()))
            # (a batched adjoint always sees the batch axis: here, of one seed)
            found = _pull_back(self.implicit, comm, y_bar[None], y, inputs, (1,))
            return (np.zeros_like(y), *(None if f is None else f[0] for f in found))
        # (a batched call: y_bar carries the K seeds; y and the inputs carry a batch
        # axis of 1 where they are the same for every seed, as in compute_totals)
        count = y_bar.shape[0]
        if all(a.shape[:1] == (1,) for a in (y, *inputs)):
            found = _pull_back(self.implicit, comm, y_bar, y[0, ...], [x[0, ...] for x in inputs],
                                    (count,))
        else:  # (vmapped over the inputs as well: one seed at a time)
            rows = [_pull_back(self.implicit, comm, y_bar[k:k + 1], _row(y, k),
                                    [_row(x, k) for x in inputs], (1,))
                    for k in range(count)]
            found = [None if r[0] is None else np.concatenate(r) for r in zip(*rows)]
        return (np.zeros(y_bar.shape, y.dtype), *found)

    def jvp(self, comm: Any, tangents: Any, y: np.ndarray, *inputs: np.ndarray) -> Any:
        op = self.implicit
        if not isinstance(tangents, tuple):  # (only y is inexact: no input tangent)
            tangents = (tangents,) + (None,) * len(inputs)
        change = _checked(op, "residual_jvp", comm, tangents[1:], y, *inputs)
        _expect(op, comm, "residual_jvp", "residual tangent", change, y.shape, y.dtype)
        z = _checked(op, "solve_linear", comm, change, y, *inputs)
        _expect(op, comm, "solve_linear", "solution", z, y.shape, y.dtype)
        return np.negative(z)


def _pull_back(op: ImplicitOperator, comm: Any, y_bar: np.ndarray, y: np.ndarray,
           inputs: Sequence[np.ndarray], batch: tuple[int, ...]) -> list:
    """Pull `y_bar` back to the inputs through one adjoint solve.

    **Returns:** each input's cotangent, -residual_vjp(solve_adjoint(y_bar)) (None for
    an integer input), with the batch axes `batch`.
    """
    lam = _checked(op, "solve_adjoint", comm, y_bar, y, *inputs)
    _expect(op, comm, "solve_adjoint", "lam", lam, y_bar.shape, y_bar.dtype)
    found = _checked(op, "residual_vjp", comm, lam, y, *inputs)
    if not isinstance(found, tuple) or len(found) != len(inputs):
        got = (f"a tuple of {len(found)}" if isinstance(found, tuple)
               else f"a {type(found).__name__}")
        raise OperatorError(_say(op, "residual_vjp", comm,
                                 f"returned {got}; expected a tuple with one array per "
                                 f"input ({len(inputs)}), even for one input"))
    pulled: list[np.ndarray | None] = []
    for k, (bar, x) in enumerate(zip(found, inputs)):
        if not inexact_dtype(x.dtype):
            pulled.append(None)
            continue
        _expect(op, comm, "residual_vjp", f"input cotangent {k}", bar, batch + x.shape,
                x.dtype)
        pulled.append(np.negative(bar))
    return pulled


def _row(a: np.ndarray, k: int) -> np.ndarray:
    return a[0, ...] if a.shape[0] == 1 else a[k, ...]


def _checked(op: ImplicitOperator, method: str, comm: Any, *args: Any) -> Any:
    """Call a method of the user's, naming it in any error it raises."""
    try:
        # (the class's function: equinox's bound-method wrapper adds a frame per call)
        return getattr(type(op), method)(op, comm, *args)
    except OperatorError:
        raise
    except Exception as err:
        text = f"raised {type(err).__name__}: {err}"
        if isinstance(err, ValueError) and "read-only" in str(err):
            text += (". The arrays a method receives are read-only by design: they are "
                     "XLA's buffers, shared without a copy. Copy one first (x = x.copy()) "
                     "to change it")
        # (one traceback, the user's frames in it: not a chain of two)
        raise operator_error(_say(op, method, comm, text), err).with_traceback(
            err.__traceback__) from None


def _expect(op: ImplicitOperator, comm: Any, method: str, what: str, value: Any,
            shape: tuple[int, ...], dtype: Any) -> None:
    """Check one array a method returned. **Raises:** `OperatorError` naming it."""
    if not isinstance(value, np.ndarray) or value.shape != shape or value.dtype != dtype:
        got = (f"shape {value.shape} and dtype {value.dtype}"
               if isinstance(value, np.ndarray) else f"a {type(value).__name__}")
        raise OperatorError(_say(op, method, comm,
                                 f"returned {what} with {got}; expected a numpy array of "
                                 f"shape {shape} and dtype {np.dtype(dtype)}"))


def _say(op: ImplicitOperator, method: str, comm: Any, text: str) -> str:
    rank = comm.Get_rank() if comm is not None else 0
    return f"{type(op).__name__}.{method} on rank {rank}: {text}"
