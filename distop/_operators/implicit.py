"""Implicit operators: a distributed solve whose derivatives come from one adjoint solve.

An `ImplicitOperator` computes y with R(y, inputs) = 0. Its derivatives follow from the
implicit function theorem: the VJP of y is `-residual_vjp(solve_adjoint(y_bar))`, the
JVP `-solve_linear(residual_jvp(tangents))`. Neither differentiates the solver's
iterations, and neither solves the forward problem again. Its second derivatives (the
derivative of the VJP along a tangent dx: the second-order adjoint) take per direction
one incremental forward solve, dy = -solve_linear(residual_jvp(dx)), and one incremental
adjoint solve, of the y part of the residual's second derivative (`residual_hvp`), as
`_second_order` derives.

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
    "residual_hvp": ("residual_hvp(self, comm, lam, tangent, y, *inputs), which second "
                     "derivatives (jax.hessian, jax.jvp of jax.grad, jax.grad of jax.grad "
                     "or of jax.jvp, Problem.compute_hvp) need"),
}
# the methods of reverse mode, then forward mode's
_FIRST_ORDER = ("solve_adjoint", "residual_vjp", "solve_linear", "residual_jvp")
# (where the list of what second derivatives need names the computations once)
_SECOND_ORDER = "second derivatives through it (jax.hessian, jax.jvp of jax.grad, " \
    "jax.grad of jax.grad or of jax.jvp, Problem.compute_hvp)"


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
    - optionally, for second derivatives (with the forward-mode methods):
      `residual_hvp(self, comm, lam, tangent, y, *inputs) -> tuple`: the second
      derivative of lam . R(y, *inputs) with respect to (y, *inputs) jointly, applied
      to `tangent` (a tuple over (y, *inputs)): one array per entry of (y, *inputs)
      (None for an integer input).

    distop derives the VJP, input_bar_i = -residual_vjp_i(solve_adjoint(y_bar)).
    It derives the JVP, y_dot = -solve_linear(residual_jvp(tangents)).
    It derives the second-order adjoint, the derivative of the VJP along dx: with
    dy = -solve_linear(residual_jvp(dx)) (the incremental forward solve), lam =
    solve_adjoint(y_bar) and (h_y, *h_x) = residual_hvp(lam, (dy, *dx)), it is
    residual_vjp(solve_adjoint(h_y)) - h_x (one incremental adjoint solve): the
    adjoint's own change is dlam = -solve_adjoint(h_y), from differentiating
    (dR/dy)^T lam = y_bar. An operator with `linear = True` (a residual linear in y and
    the inputs together, so that y is linear in the inputs) needs no `residual_hvp`:
    its second derivatives are zero.
    `solve` runs once per call; its y is what the adjoint receives.

    Class attributes (a subclass sets them in its body):
    - `solve_collectives`, `adjoint_collectives`, `residual_collectives`: the
      communication each method issues (`solve`; `solve_adjoint` and `solve_linear`;
      `residual_vjp`, `residual_jvp` and `residual_hvp`), as an explicit operator
      declares it.
    - `batched_adjoint`: True if `solve_adjoint`, `residual_vjp` and `residual_hvp`
      take `y_bar`, `lam` and `tangent` with a leading batch axis (K seeds: one block
      solve for all of them; K may be 1) and return one; `y` and the inputs come
      without it. Otherwise distop calls them once per seed, in a fixed order.
      (`solve_linear` and `residual_jvp` always take one direction.)
    - `ordered`: as for `DistributedOperator`.
    - `complex_step` (with `takes_complex_step`), `batched_forward` and `unbatched`: as
      for `DistributedOperator`, of `solve`. The explicit names of the others hold too
      (`forward_collectives` adds to `solve_collectives`; `vjp_collectives` and
      `jvp_collectives` and `hvp_collectives` to the adjoint's; `batched_vjp` means
      `batched_adjoint`). `linear` says that y is linear in the inputs together (the
      residual is linear in y and the inputs together): second derivatives need no
      `residual_hvp`. It gives no transpose: `jax.linear_transpose` of a call raises.

    `output_spec` gives y's shape and dtype (default: the first input's).
    In the schedule, a call shows as `Op.solve` and `Op.state`, and its derivatives as
    `Op.adjoint` (reverse mode), `Op.linear` (forward mode) and `Op.second_adjoint`
    (second derivatives).

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

    def residual_hvp(self, comm: Any, lam: Any, tangent: Any, y: Any, *inputs: Any) -> Any:
        """The residual's second derivative, weighted by `lam` (optional: second
        derivatives).

        With L(y, *inputs) = lam . R(y, *inputs) (summed over every rank's rows), it
        returns the Hessian of L with respect to (y, *inputs) jointly applied to
        `tangent`: per entry j of (y, *inputs), sum_k d^2 L / (d v_j d v_k) tangent[k].
        Where the residual is linear in y and the inputs together, declare
        `linear = True` instead.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `lam`: the adjoint solution (with a leading batch axis if `batched_adjoint`).
        - `tangent`: a tuple over (y, *inputs): the tangent of y, then one per input
          (None for an integer input; with the batch axis if `batched_adjoint`).
        - `y`: the solution `solve` returned.
        - `inputs`: the inputs of that call.

        **Returns:** a tuple over (y, *inputs), each shaped as its value (with the batch
        axis if `batched_adjoint`); None for an integer input. A replicated input's
        entry is the whole sum over the ranks, as `residual_vjp` returns it.

        **Raises:** `MissingMethodError` here, in the base class.
        """
        raise MissingMethodError(_missing(type(self), "residual_hvp"))

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
                or self.vjp_collectives or self.jvp_collectives or self.hvp_collectives):
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
    `forward_collectives` adds to `solve_collectives`, `vjp_collectives`,
    `jvp_collectives` and `hvp_collectives` to the adjoint's, `batched_vjp` means
    `batched_adjoint`; `batched_forward` and `unbatched` are the solve's; `complex_step`
    (with `takes_complex_step`) holds for both calls; `ordered` is passed on by the
    call; `linear` (with `is_linear`) is the state's.
    """
    adjoint = _union(cls.adjoint_collectives, cls.residual_collectives,
                     cls.vjp_collectives, cls.jvp_collectives, cls.hvp_collectives)
    missing_reverse = [m for m in _FIRST_ORDER[:2] if not _has(cls, m)]
    missing_forward = [m for m in _FIRST_ORDER[2:] if not _has(cls, m)]
    solve = type(cls.__name__, (_Solve,), {
        "__module__": cls.__module__,
        "forward_collectives": _union(cls.solve_collectives, cls.forward_collectives),
        "batched_forward": bool(cls.batched_forward), "unbatched": cls.unbatched,
        "complex_step": bool(cls.complex_step), "forward": _solve_forward(cls)})
    batched = bool(cls.batched_adjoint or cls.batched_vjp)
    attributes: dict[str, Any] = {
        "__module__": cls.__module__, "complex_step": bool(cls.complex_step),
        "vjp_collectives": adjoint, "jvp_collectives": adjoint, "hvp_collectives": adjoint,
        "batched_vjp": batched, "batched_hvp": batched, "missing_methods": {}}
    # A missing method: the phase stays the base class's, which distop reports as
    # missing (naming the user's method) before any rank runs the program.
    if missing_reverse:
        attributes["vjp"] = DistributedOperator.vjp
        attributes["missing_methods"]["vjp"] = _missing(cls, missing_reverse[0])
    if missing_forward:
        attributes["jvp"] = DistributedOperator.jvp
        attributes["missing_methods"]["jvp"] = _missing(cls, missing_forward[0])
    refusal = _second_order_refusal(cls, missing_reverse + missing_forward)
    if refusal is None:
        attributes["hvp"] = _State.second_order
    else:  # (a linear one's never asked for: its second derivatives are zero)
        attributes["missing_methods"]["hvp"] = refusal
    return solve, type(cls.__name__, (_State,), attributes)


def _second_order_refusal(cls: type[ImplicitOperator], missing: Sequence[str]) -> str | None:
    """**Returns:** why the second derivatives of `cls` are not available (the methods
    it lacks, named), or None where its state call gets an `hvp`; `missing`: the
    first-order methods it lacks."""
    name = cls.__name__
    if not _has(cls, "residual_hvp"):
        return (f"{name} is an implicit operator with a residual not declared linear, "
                f"and does not implement residual_hvp(self, comm, lam, tangent, y, "
                f"*inputs), which {_SECOND_ORDER} need: the second derivative of lam . "
                "R(y, *inputs) with respect to (y, *inputs) jointly, applied to tangent. "
                f"Add it to {name}, or declare linear = True if the residual is linear "
                "in y and the inputs together (its second derivatives are then zero).")
    if missing:
        return (f"{name} does not implement {_METHODS[missing[0]].split(', which')[0]}, "
                f"which {_SECOND_ORDER} need besides residual_hvp: each direction takes "
                "an incremental forward solve (solve_linear of residual_jvp) and an "
                "incremental adjoint solve (solve_adjoint).")
    return None


def provides_second_derivatives(op: ImplicitOperator) -> bool:
    """**Returns:** whether second derivatives through `op` call its `residual_hvp`
    (it has one, and the methods the second-order adjoint needs besides)."""
    return _second_order_refusal(type(op), [m for m in _FIRST_ORDER if not _has(type(op), m)]
                                 ) is None


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
                                              "jvp": "linear", "hvp": "second_adjoint"}
    unbatched: ClassVar[str] = "expand_dims"

    def is_linear(self) -> bool:
        return type(self.implicit).is_linear(self.implicit)

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
        return _increment(op, comm, tangents[1:], y, inputs)

    def second_order(self, comm: Any, y_bar: np.ndarray, tangent: tuple, y: np.ndarray,
                     *inputs: np.ndarray, batched: bool = False) -> tuple:
        """The `hvp` of the state call: the second-order adjoint (see `_second_order`).

        The state is y(inputs), whatever y it is handed (that argument carries no
        derivative): its tangent is left out, and its entry is zero."""
        directions = tangent[1:]
        if not batched:
            if not self.batched_hvp:
                found = _second_order(self.implicit, comm, y_bar, directions, y, inputs, ())
                return (np.zeros_like(y), *found)
            # (a batched residual_hvp always sees the batch axis: here, of one direction)
            found = _second_order(self.implicit, comm, y_bar[None], _rows(directions, None),
                                  y, inputs, (1,))
            return (np.zeros_like(y), *(None if f is None else f[0] for f in found))
        # (as in `vjp`: y and the inputs carry a batch axis of 1 where they are the same
        # for every direction)
        count = y_bar.shape[0]
        if all(a.shape[:1] == (1,) for a in (y, *inputs)):
            found = _second_order(self.implicit, comm, y_bar, directions, y[0, ...],
                                  [x[0, ...] for x in inputs], (count,))
        else:  # (vmapped over the inputs as well: one direction at a time)
            rows = [_second_order(self.implicit, comm, y_bar[k:k + 1],
                                  _rows(directions, slice(k, k + 1)), _row(y, k),
                                  [_row(x, k) for x in inputs], (1,))
                    for k in range(count)]
            found = [None if r[0] is None else np.concatenate(r) for r in zip(*rows)]
        return (np.zeros(y_bar.shape, y.dtype), *found)


def _rows(values: Sequence[Any], rows: slice | None) -> list[Any]:
    """**Returns:** `values[rows]` of each of `values` (None stays None); rows None: a
    new leading axis of one."""
    return [None if v is None else v[None] if rows is None else v[rows] for v in values]


def _second_order(op: ImplicitOperator, comm: Any, y_bar: np.ndarray,
                  directions: Sequence[Any], y: np.ndarray, inputs: Sequence[np.ndarray],
                  batch: tuple[int, ...]) -> list:
    """The derivative of the VJP, -residual_vjp(lam) with lam = solve_adjoint(y_bar),
    along the inputs' `directions` dx (y following them: R(y, inputs) = 0).

    With L = lam . R, differentiating (dR/dy)^T lam = y_bar gives (dR/dy)^T dlam =
    -(L_yy dy + L_yx dx), and the VJP changes by -(L_xy dy + L_xx dx) - (dR/dx)^T dlam.
    So, with dy = -solve_linear(residual_jvp(dx)) (the incremental forward solve, per
    direction) and (h_y, *h_x) = residual_hvp(lam, (dy, *dx)):
    residual_vjp(solve_adjoint(h_y)) - h_x (one incremental adjoint solve).

    **Arguments:** `batch`: () for one direction, or (K,) for K of them along the
    leading axis of `y_bar` and `directions` (the operator's methods then take a batch:
    `batched_adjoint`); `y` and `inputs` carry no batch axis.

    **Returns:** each input's part (None for an integer input), with the batch axes.
    """
    lam = _checked(op, "solve_adjoint", comm, y_bar, y, *inputs)
    _expect(op, comm, "solve_adjoint", "lam", lam, y_bar.shape, y_bar.dtype)
    if batch:  # (the forward-mode methods take one direction at a time)
        dy = np.stack([_increment(op, comm, [None if d is None else d[k] for d in directions],
                                  y, inputs) for k in range(batch[0])])
    else:
        dy = _increment(op, comm, directions, y, inputs)
    found = _checked(op, "residual_hvp", comm, lam, (dy, *directions), y, *inputs)
    if not isinstance(found, tuple) or len(found) != 1 + len(inputs):
        got = (f"a tuple of {len(found)}" if isinstance(found, tuple)
               else f"a {type(found).__name__}")
        raise OperatorError(_say(op, "residual_hvp", comm,
                                 f"returned {got}; expected a tuple over (y, *inputs), "
                                 f"with {1 + len(inputs)} entries"))
    _expect(op, comm, "residual_hvp", "entry 0 (y's)", found[0], batch + y.shape, y.dtype)
    back = _pull_back(op, comm, found[0], y, inputs, batch)  # -residual_vjp(solve_adjoint(h_y))
    parts: list[np.ndarray | None] = []
    for k, (pulled, h, x) in enumerate(zip(back, found[1:], inputs)):
        if pulled is None:
            parts.append(None)
            continue
        _expect(op, comm, "residual_hvp", f"entry {k + 1} (input {k}'s)", h,
                batch + x.shape, x.dtype)
        parts.append(np.negative(pulled + h))
    return parts


def _increment(op: ImplicitOperator, comm: Any, direction: Sequence[Any], y: np.ndarray,
               inputs: Sequence[np.ndarray]) -> np.ndarray:
    """**Returns:** dy = -solve_linear(residual_jvp(direction)): y's tangent along one
    direction of the inputs (the incremental forward solve)."""
    change = _checked(op, "residual_jvp", comm, tuple(direction), y, *inputs)
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
