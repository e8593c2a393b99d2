"""`DistributedOperator` and its call.

An operator call `op(x)` binds one JAX primitive, `distop_host_call` (see primitive.py),
whose parameter is the `HostCall` to run.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._agreement import comm as _comm
from .._errors import MissingMethodError
from .._hostcalls import sessions as _sessions
from .._hostcalls.host import HostCall
from .._safety.guard import check_declarations
from . import complex_step as _stepping
from .primitive import bind_call, missing, unimplemented


class DistributedOperator(eqx.Module):
    """Base class of a differentiable operator whose methods may use MPI.

    Subclasses implement `forward` and `vjp` with numpy/scipy and mpi4py, and declare
    the communication each method makes; `jvp` (forward mode) and `hvp` (second
    derivatives) are optional.
    Calling an instance, `op(x, ...)`, works in any JAX code: `jit`, `grad`, `vjp`,
    `jacrev`, `vmap`, `lax.scan`, `lax.fori_loop`.
    A subclass without `forward` raises `MissingMethodError` when called.

    Class attributes (a subclass sets them in its body):
    - `forward_collectives`, `vjp_collectives`, `jvp_collectives`, `hvp_collectives`:
      the mpi4py
      communicator methods each method calls, e.g. `("Allreduce",)` or `("Sendrecv",)`;
      empty means purely local.
    - `batched_forward`, `batched_vjp`, `batched_jvp`, `batched_hvp`: True if the
      method accepts a
      leading batch axis on every argument (and returns one), so a whole batch costs one
      collective. Otherwise distop calls it once per batch row, in a fixed order, in one
      callback. A batched method may take a keyword `batched` telling whether the axis
      is there (it is only when distop batches).
    - `unbatched`: how a batched method receives an input that the batch does not vary
      (the inputs of a vjp over K seeds, say). `"broadcast"` (default) gives a
      C-contiguous copy repeated along the batch axis; `"expand_dims"` gives the input
      itself with a batch axis of length 1, which saves that copy on every call.
      (Co)tangents are always broadcast.
    - `ordered`: None (default) orders the callbacks whenever the operator declares
      communication and its communicator has more than one rank; True or False force it.
      Inside a `Problem` on the lean path, every call not set to False is ordered by the
      token.
    - `linear`: True if `forward` is linear in its floating-point inputs together
      (f(a x + b y) = a f(x) + b f(y)). `jax.linear_transpose` then transposes a call
      into a `vjp` call (at zero inputs), and second derivatives need no `hvp` (the
      second derivative of a linear map is zero). Default False.
    - `complex_step`: True if `forward`, given complex inputs, computes the same
      formulas on them and returns complex outputs (no `abs`, `conj`, `real` or
      comparisons of them). `check_totals(method="cs")` may then perturb it along the
      imaginary axis. Default False.
    - `output_kinds`: `"replicated"` (the same on every rank) or `"varying"` (each
      rank's own), one for all outputs or a tuple; None (default): unknown, which a
      Problem refuses only where the sum over ranks of a derivative depends on it.
    - `input_kinds`: `"varying"` where `vjp` returns this rank's share of the input's
      cotangent (as `AllreduceSum`'s does), so a replicated value passed there gets
      it summed over the ranks; None (default, or per input in a tuple): `vjp`
      returns the whole cotangent itself.

    A method may take a keyword `out`.
    On the lean path distop passes the buffers its results go to (XLA's own, valid
    during the call): one array, or a tuple in the order of the results, with None in a
    vjp's place for an integer input.
    Elsewhere `out` is None.
    Writing the results into them and returning them saves a copy of each; returning
    other arrays is fine too.

    **Arguments:**
    - the subclass's own fields, positionally or by name (they need no defaults).
    - `comm`: the MPI communicator (keyword; default `MPI.COMM_WORLD`). Methods receive
      a private duplicate, so distop's traffic never matches the user's own messages.
    - `ordered`: the per-instance override of the class setting (keyword), e.g. `MyOp(A,
      ordered=False)`.

    **Returns:** the operator; `op(*inputs)` returns its outputs as JAX arrays, shaped
    by `output_spec`.

    **Raises:** `TypeError` when a subclass is made, for an unknown name in its declared
    communication (naming the nearest one). `OperatorError` (on the failing rank, which
    aborts the job outside the checking mode) where a method fails, returns the wrong
    shape or dtype, or makes an MPI call its phase did not declare. `MissingMethodError`
    where a computation needs a method the operator lacks.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)


    class Scale(distop.DistributedOperator):
        c: float  # y = (sum over ranks of c) x
        forward_collectives = vjp_collectives = ("Allreduce",)

        def forward(self, comm, x):
            total = np.empty(())
            comm.Allreduce(np.array(self.c), total, op=MPI.SUM)
            return total * x

        def vjp(self, comm, y_bar, x):
            return self.forward(comm, y_bar)


    assert jax.grad(lambda x: jnp.sum(Scale(2.0)(x)))(jnp.ones(3))[0] == 2.0  # one process
    ```
    """

    comm: Any = eqx.field(default=None, kw_only=True)
    ordered: bool | None = eqx.field(default=None, kw_only=True, static=True)

    forward_collectives: ClassVar[tuple[str, ...]] = ()
    vjp_collectives: ClassVar[tuple[str, ...]] = ()
    jvp_collectives: ClassVar[tuple[str, ...]] = ()
    hvp_collectives: ClassVar[tuple[str, ...]] = ()
    batched_forward: ClassVar[bool] = False
    batched_vjp: ClassVar[bool] = False
    batched_jvp: ClassVar[bool] = False
    batched_hvp: ClassVar[bool] = False
    unbatched: ClassVar[str] = "broadcast"
    linear: ClassVar[bool] = False
    complex_step: ClassVar[bool] = False
    output_kinds: ClassVar[Any] = None
    input_kinds: ClassVar[Any] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_declarations(cls)

    def forward(self, comm: Any, *inputs: Any, **keywords: Any) -> Any:
        """Compute the outputs on this rank.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `inputs`: C-contiguous, read-only numpy arrays (0-d inputs stay 0-d).
        - `keywords`: `batched` and `out`, where the method takes them (see the class
          docstring).

        **Returns:** a numpy array, or a tuple of them for several outputs.

        **Raises:** `MissingMethodError` here, in the base class: every operator needs
        it.
        """
        raise MissingMethodError(f"{type(self).__name__} does not implement "
                                 "forward(self, comm, *inputs), which every operator needs.")

    @unimplemented
    def vjp(self, comm: Any, cotangent: Any, *inputs: Any, **keywords: Any) -> Any:
        """Pull an output cotangent back to the inputs on this rank.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `cotangent`: the output cotangent (a tuple for several outputs).
        - `inputs`: the inputs of the matching forward call.
        - `keywords`: `batched` and `out`, where the method takes them (see the class
          docstring).

        **Returns:** the input cotangent, or a tuple with one per input (None for an
        integer input).

        **Raises:** `MissingMethodError` here, in the base class: reverse mode needs it.
        """
        raise MissingMethodError(missing(self, "vjp"))

    @unimplemented
    def jvp(self, comm: Any, tangent: Any, *inputs: Any, **keywords: Any) -> Any:
        """Push an input tangent forward to the outputs on this rank (optional).

        It enables forward mode: `jax.jvp` and `jax.jacfwd`.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `tangent`: the input tangent (a tuple for several inputs; None for integer
          inputs).
        - `inputs`: the inputs of the matching forward call.
        - `keywords`: `batched` and `out`, where the method takes them (see the class
          docstring).

        **Returns:** the output tangent, or a tuple with one per output.

        **Raises:** `MissingMethodError` here, in the base class: forward mode needs it.
        """
        raise MissingMethodError(missing(self, "jvp"))

    @unimplemented
    def hvp(self, comm: Any, y_bar: Any, tangent: Any, *inputs: Any,
            **keywords: Any) -> Any:
        """Differentiate `vjp` with respect to the inputs, along a tangent (optional).

        It enables second derivatives (`jax.hessian`, `jax.jvp` of `jax.grad`, `jax.grad`
        of `jax.grad` or of `jax.jvp`, `Problem.compute_hvp`), together with `jvp`. Where
        `forward` is y = f(x), it returns the sum over the outputs' entries i of
        `y_bar[i]` times the Hessian of y[i] with respect to the inputs, applied to
        `tangent`: the derivative of `vjp(comm, y_bar, *inputs)` along `tangent`. This
        weighted Hessian is symmetric, which distop relies on to transpose the call into
        itself. An operator with `linear = True` needs none.

        **Arguments:**
        - `comm`: the operator's private communicator.
        - `y_bar`: the output cotangent, as `vjp` takes it (a tuple for several
          outputs).
        - `tangent`: the input tangent, as `jvp` takes it (a tuple for several inputs;
          None for integer inputs).
        - `inputs`: the inputs of the matching forward call.
        - `keywords`: `batched` and `out`, where the method takes them (see the class
          docstring); with `batched_hvp = True`, `y_bar` and `tangent` carry the
          leading batch axis.

        **Returns:** what `vjp` returns: one array per input, a tuple for several (None
        for an integer input).

        **Raises:** `MissingMethodError` here, in the base class: second derivatives
        through a nonlinear operator need it.
        """
        raise MissingMethodError(missing(self, "hvp"))

    def output_spec(self, *input_specs: Any) -> Any:
        """The shapes and dtypes of the outputs.

        **Arguments:**
        - `input_specs`: one `jax.ShapeDtypeStruct` per input.

        **Returns:** a `jax.ShapeDtypeStruct`, or a tuple of them for several outputs.
        Default: the same as the first input.

        **Raises:** nothing, in the base class.
        """
        return input_specs[0]

    def is_ordered(self) -> bool:
        """**Returns:** whether this operator's callbacks are ordered (see `ordered`)."""
        explicit = explicit_order(self)
        if explicit is not None:
            return explicit
        if not (self.forward_collectives or self.vjp_collectives or self.jvp_collectives
                or self.hvp_collectives):
            return False
        return _comm.private(self.comm).Get_size() > 1

    def is_linear(self) -> bool:
        """**Returns:** whether this operator is linear (see `linear`); an operator whose
        linearity depends on its fields overrides it."""
        return bool(type(self).linear)

    def takes_complex_step(self) -> bool:
        """**Returns:** whether this operator may be perturbed along the imaginary axis
        (see `complex_step`); an operator for which it depends on its fields overrides
        it."""
        return bool(type(self).complex_step)

    def __call__(self, *inputs: Any) -> Any:
        return apply(self, inputs)

    # An operator is an identity, not a value: fields such as numpy arrays and sparse
    # matrices are unhashable, and `jax.jit(op)` needs a hashable function.
    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    # A method of an operator is Python's own bound method: equinox would make each
    # `self.helper` a new pytree Module, which costs more than many a method's work when
    # `forward` or `vjp` calls it once per host call. (An operator is no value to
    # trace: its methods run on numpy, in host calls.)
    if not TYPE_CHECKING:
        __getattribute__ = object.__getattribute__


def as_arrays(name: str, inputs: Sequence[Any]) -> list[Any]:
    """An operator call's inputs as JAX arrays.

    **Arguments:**
    - `name`: the operator's class name, for the message.
    - `inputs`: arrays or scalars.

    **Returns:** one JAX array per input.

    **Raises:** `TypeError` naming the input that is not an array or a number.
    """
    arrays = []
    for k, x in enumerate(inputs):
        try:
            arrays.append(jnp.asarray(x))
        except TypeError as err:
            raise TypeError(f"{name}(...): input {k} is a {type(x).__name__}, not an "
                            "array; pass jax or numpy arrays or numbers.") from err
    return arrays


def apply(op: DistributedOperator, inputs: Sequence[Any]) -> Any:
    """Call `op` on JAX values through one distop host-call primitive per call.

    **Arguments:**
    - `op`: a `DistributedOperator`.
    - `inputs`: its inputs (arrays or scalars).

    **Returns:** the output, or a tuple of outputs.
    """
    name = type(op).__name__
    if type(op).forward is DistributedOperator.forward:
        raise MissingMethodError(f"{name} does not implement forward(self, comm, *inputs), "
                                 "which every operator needs.")
    arrays = as_arrays(name, inputs)
    in_specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    stepped = _stepping.stepped(op, arrays)
    out_specs = type(op).output_spec(op, *in_specs)  # class-level: no bound-method wrap
    several = isinstance(out_specs, (tuple, list))
    out_specs = tuple(out_specs) if several else (out_specs,)
    for s in out_specs:
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise TypeError(f"{name}.output_spec returned {s!r}; expected "
                            "jax.ShapeDtypeStruct(shape, dtype) per output.")
    # (plain ints: numpy integers in a shape would make the schedule's fingerprint differ
    # between ranks that return the same sizes as different types)
    out_specs = tuple(jax.ShapeDtypeStruct(tuple(map(int, s.shape)), s.dtype)
                      for s in out_specs)
    if stepped:
        _stepping.check_outputs(op, out_specs)
    ordered = type(op).is_ordered(op)
    # In a Problem's program every call not declared unordered takes the lean path:
    # ordered by the token, and fusable. (Even where nothing needs ordering, in one
    # process or for a purely local operator: XLA would run independent unordered
    # callbacks on several threads at once, which then wait for each other's GIL.)
    lean = _sessions.session() is not None and explicit_order(op) is not False
    if _sessions.structure_only():  # (traced for its kinds, never run)
        ordered = False
    call = HostCall(op, "forward", _comm.private(op.comm), ordered or lean, in_specs,
                    out_specs, lean=lean)
    outs = bind_call(call, arrays)
    return tuple(outs) if several else outs[0]


def explicit_order(op: DistributedOperator) -> bool | None:
    """**Returns:** the `ordered` setting of `op` or, failing that, of its class body
    (a subclass's wins), or None where neither sets it."""
    if op.ordered is not None:
        return bool(op.ordered)
    for cls in type(op).__mro__:
        value = cls.__dict__.get("ordered")
        if isinstance(value, bool):
            return value
    return None
