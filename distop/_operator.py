"""`DistributedOperator` and its lowering to ordered host callbacks.

An operator call `op(x)` becomes a `jax.custom_vjp` function whose forward and backward
passes are host callbacks. Each callback is wrapped in `jax.custom_batching.custom_vmap`
so that under `vmap` (and so `jacrev` and batched totals) it is still ONE callback on the
whole batch, issued with `io_callback(ordered=True)` when the operator communicates:
JAX then threads an effect token through it, which fixes its place in program order on
every rank and keeps XLA from dropping, duplicating or overlapping it.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from . import _comm
from ._callback import HostCall
from ._errors import MissingMethodError


class DistributedOperator(eqx.Module):
    """Abstract base class of a differentiable operator whose host code may use MPI.

    Subclasses implement `forward` and `vjp` with numpy/scipy and mpi4py, and declare the
    collectives each issues. Calling an instance, `op(x, ...)`, works in any JAX code
    (`jit`, `grad`, `vjp`, `jacrev`, `vmap`, `lax.scan`, `lax.fori_loop`).

    Class attributes (a subclass sets them in its body):
    - `forward_collectives`, `vjp_collectives`: names of the MPI collectives each method
      issues, e.g. `("Allreduce",)`; empty means purely local.
    - `batched_forward`, `batched_vjp`: True if the method accepts a leading batch axis
      on every argument (and returns one), so a whole batch costs one collective.
      Otherwise distop calls it once per batch row, in a fixed order, in one callback.
    - `ordered`: None (default) orders the callbacks whenever the operator declares
      collectives and its communicator has more than one rank; True/False force it.
      Also settable per instance: `MyOp(A, ordered=False)`.

    Fields every operator has (keyword-only, optional):
    - `comm`: the MPI communicator (default `MPI.COMM_WORLD`). User code receives a
      private duplicate, so distop's traffic never matches the user's own messages.
    - `ordered`: the per-instance override of the class setting.
    """

    comm: Any = eqx.field(default=None, kw_only=True)
    ordered: bool | None = eqx.field(default=None, kw_only=True, static=True)

    forward_collectives: ClassVar[tuple[str, ...]] = ()
    vjp_collectives: ClassVar[tuple[str, ...]] = ()
    batched_forward: ClassVar[bool] = False
    batched_vjp: ClassVar[bool] = False

    def forward(self, comm, *inputs):
        """Compute the outputs on this rank.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `inputs`: C-contiguous numpy arrays (0-d inputs stay 0-d).

        **Returns:** a numpy array, or a tuple of them for several outputs.
        """
        raise MissingMethodError(f"{type(self).__name__} does not implement "
                                 "forward(self, comm, *inputs), which every operator needs.")

    def vjp(self, comm, cotangent, *inputs):
        """Pull an output cotangent back to the inputs on this rank.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `cotangent`: the output cotangent (a tuple for several outputs).
        - `inputs`: the inputs of the matching forward call.

        **Returns:** the input cotangent, or a tuple with one per input.
        """
        raise MissingMethodError(f"{type(self).__name__} does not implement "
                                 "vjp(self, comm, cotangent, *inputs), which reverse mode "
                            "(grad, vjp, jacrev, compute_totals) needs.")

    def output_spec(self, *input_specs):
        """The shapes and dtypes of the outputs.

        **Arguments:**
        - `input_specs`: one `jax.ShapeDtypeStruct` per input.

        **Returns:** a `jax.ShapeDtypeStruct`, or a tuple of them for several outputs.
        Default: the same as the first input.
        """
        return input_specs[0]

    def is_ordered(self):
        """**Returns:** whether this operator's callbacks are ordered (see `ordered`)."""
        if self.ordered is not None:
            return bool(self.ordered)
        for cls in type(self).__mro__:  # a subclass body's `ordered = ...` wins
            if "ordered" in cls.__dict__ and cls.__dict__["ordered"] is not None:
                value = cls.__dict__["ordered"]
                if isinstance(value, bool):
                    return value
        if not (self.forward_collectives or self.vjp_collectives):
            return False
        return _comm.private(self.comm).Get_size() > 1

    def __call__(self, *inputs):
        return apply(self, inputs)

    # An operator is an identity, not a value: fields such as numpy arrays and sparse
    # matrices are unhashable, and `jax.jit(op)` needs a hashable function.
    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


def apply(op, inputs):
    """Call `op` on JAX values through ordered host callbacks (see the module docstring).

    **Arguments:**
    - `op`: a `DistributedOperator`.
    - `inputs`: its inputs (arrays or scalars).

    **Returns:** the output, or a tuple of outputs.
    """
    name = type(op).__name__
    if type(op).forward is DistributedOperator.forward:
        raise MissingMethodError(f"{name} does not implement forward(self, comm, *inputs), "
                            "which every operator needs.")
    arrays = []
    for k, x in enumerate(inputs):
        try:
            arrays.append(jnp.asarray(x))
        except TypeError as err:
            raise TypeError(f"{name}(...): input {k} is a {type(x).__name__}, not an "
                            "array; pass jax or numpy arrays or numbers.") from err
    in_specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    out_specs = op.output_spec(*in_specs)
    several = isinstance(out_specs, (tuple, list))
    out_specs = tuple(out_specs) if several else (out_specs,)
    for s in out_specs:
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise TypeError(f"{name}.output_spec returned {s!r}; expected "
                            "jax.ShapeDtypeStruct(shape, dtype) per output.")
    out_specs = tuple(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in out_specs)
    comm = _comm.private(op.comm)
    ordered = op.is_ordered()
    diff = tuple(k for k, s in enumerate(in_specs) if jnp.issubdtype(s.dtype, jnp.inexact))

    forward = _host_function(op, "forward", comm, 0, in_specs, out_specs, None, ordered)

    @jax.custom_vjp
    def call(*xs):
        return forward(*xs)

    def call_fwd(*xs):
        return forward(*xs), xs

    def call_bwd(xs, cts):
        if type(op).vjp is DistributedOperator.vjp:
            raise MissingMethodError(f"{name} does not implement vjp(self, comm, cotangent, "
                                "*inputs), which reverse mode (grad, vjp, jacrev, "
                                "compute_totals) needs.")
        backward = _host_function(op, "vjp", comm, len(out_specs), out_specs + in_specs,
                                  tuple(in_specs[k] for k in diff), diff, ordered)
        grads = dict(zip(diff, backward(*cts, *xs)))
        return tuple(grads.get(k) for k in range(len(xs)))

    call.defvjp(call_fwd, call_bwd)
    outs = call(*arrays)
    return tuple(outs) if several else outs[0]


def _host_function(op, phase, comm, n_cotangents, arg_specs, result_specs, result_picks,
                   ordered, levels=None, batch_shape=()):
    """A JAX function that runs one operator method on the host, batched by `custom_vmap`.

    Under `vmap` the rule moves the batch axis to the front, records which arguments
    carry it, and calls the same construction one batch level deeper: nested `vmap`
    still gives one callback.
    """
    if levels is None:
        levels = tuple(() for _ in arg_specs)

    @jax.custom_batching.custom_vmap
    def host(*args):
        call = HostCall(op, phase, comm, n_cotangents, arg_specs, result_specs,
                        result_picks, levels, batch_shape, ordered)
        shapes = tuple(jax.ShapeDtypeStruct(batch_shape + s.shape, s.dtype)
                       for s in result_specs)
        if ordered:
            return io_callback(call, shapes, *args, ordered=True)
        # Unordered: the naive lowering, free to be reordered or run concurrently.
        return jax.pure_callback(call, shapes, *args)

    @host.def_vmap
    def rule(axis_size, in_batched, *args):
        deeper = _host_function(
            op, phase, comm, n_cotangents, arg_specs, result_specs, result_picks, ordered,
            tuple((b,) + lv for b, lv in zip(in_batched, levels)),
            (axis_size,) + batch_shape)
        return deeper(*args), tuple(True for _ in result_specs)

    return host
