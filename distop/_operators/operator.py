"""`DistributedOperator` and its lowering to ordered host callbacks.

An operator call `op(x)` binds one JAX primitive, `distop_host_call`, whose parameter is
the `HostCall` to run. Its rules keep every transformation at one host call per operator
call: the JVP of a forward call is a `jvp` call, linear in the tangents, whose transpose
is a `vjp` call; `vmap` adds a batch level to the same call (so `jacrev` and batched
totals issue ONE callback on the whole batch). It lowers to `io_callback(ordered=True)`
when the operator communicates: JAX threads an effect token through it, which fixes its
place in program order on every rank and keeps XLA from dropping, duplicating or
overlapping it.
"""

from collections.abc import Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .._agreement import comm as _comm
from .._compat import (
    ORDERED_IO_EFFECT,
    STRUCTURED_RESIDUALS,
    ShapedArray,
    fallback_linearize_rule,
    no_effects,
    primitive_linearizations,
)
from .._dtypes import inexact_spec
from .._errors import DistopError, MissingMethodError, SecondDerivativeError
from .._hostcalls import ffi as _ffi
from .._hostcalls.host import HostCall
from .._safety.guard import check_declarations
from . import complex_step as _stepping
from .refusals import install as install_refusals
from .second_derivative import refused


class DistributedOperator(eqx.Module):
    """Base class of a differentiable operator whose methods may use MPI.

    Subclasses implement `forward` and `vjp` with numpy/scipy and mpi4py, and declare
    the communication each method makes.
    Calling an instance, `op(x, ...)`, works in any JAX code: `jit`, `grad`, `vjp`,
    `jacrev`, `vmap`, `lax.scan`, `lax.fori_loop`.
    A subclass without `forward` raises `MissingMethodError` when called.

    Class attributes (a subclass sets them in its body):
    - `forward_collectives`, `vjp_collectives`, `jvp_collectives`: the mpi4py
      communicator methods each method calls, e.g. `("Allreduce",)` or `("Sendrecv",)`;
      empty means purely local.
    - `batched_forward`, `batched_vjp`, `batched_jvp`: True if the method accepts a
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
      into a `vjp` call (at zero inputs). Default False.
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
    batched_forward: ClassVar[bool] = False
    batched_vjp: ClassVar[bool] = False
    batched_jvp: ClassVar[bool] = False
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
        raise MissingMethodError(_missing(self, "vjp"))

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
        raise MissingMethodError(_missing(self, "jvp"))

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
        if not (self.forward_collectives or self.vjp_collectives or self.jvp_collectives):
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
    lean = _ffi.session() is not None and explicit_order(op) is not False
    if _ffi.structure_only():  # (traced for its kinds, never run)
        ordered = False
    call = HostCall(op, "forward", _comm.private(op.comm), ordered or lean, in_specs,
                    out_specs, lean=lean)
    outs = _bind(call, arrays)
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


def _bind(call: HostCall, args: Sequence[Any]) -> list[Any]:
    """Bind the primitive; a lean call takes the session's token and moves it on (at
    the program's top level; see `_ffi.Session.at_top`)."""
    if not call.lean:
        return host_call_p.bind(*args, call=call)
    session = _ffi.session()
    if session is None:  # (a lean call's derivative, traced again after its session)
        return host_call_p.bind(*args, call=call.unleaned())
    if not session.at_top():
        # In the body of the model's own loop, branch or checkpoint: a placeholder
        # token, which the program's rewrite replaces (see _compiler/stages/nested.py).
        return host_call_p.bind(np.zeros((), _ffi.token_dtype()), *args, call=call)[1:]
    token, *outs = host_call_p.bind(session.token, *args, call=call)
    session.token = token
    return outs


# -- the primitive --------------------------------------------------------------------
# One primitive for every host call, whatever the phase. Its rules make differentiation
# and batching produce further host calls of the same kind: the JVP of `forward` is a
# `jvp` call (linear in the tangents), whose transpose is a `vjp` call (and back); vmap
# adds a batch level to the same single call. Ordered calls carry JAX's ordered-IO
# effect, so they keep their place in program order and are never dropped. Lean calls
# (the lean path, see _hostcalls/ffi.py) carry no effect: their first operand and first result
# are the token that orders them.
host_call_p = Primitive("distop_host_call")
host_call_p.multiple_results = True


def _token_aval() -> ShapedArray:
    return ShapedArray((), _ffi.token_dtype())


def _abstract_eval(*args: Any, call: HostCall) -> tuple[list[ShapedArray], Any]:
    avals = [ShapedArray(s.shape, s.dtype) for s in call.shapes()]
    if call.lean:
        return [_token_aval()] + avals, no_effects
    return avals, ({ORDERED_IO_EFFECT} if call.ordered else no_effects)


def _lower(*args: Any, call: HostCall) -> Any:
    """The ordered (io_callback) and unordered (pure_callback) lowerings."""
    _require_method(call)
    if call.ordered:
        return io_callback(call, call.shapes(), *args, ordered=True)
    # Unordered: the naive lowering, free to be reordered, run concurrently or dropped.
    return jax.pure_callback(call, call.shapes(), *args)


_lower_callback = mlir.lower_fun(_lower, multiple_results=True)
_lower_ffi = jax.ffi.ffi_lowering(_ffi.TARGET)


def _lowering(ctx: Any, *args: Any, call: HostCall) -> Any:
    """Lean calls lower straight to the FFI custom call (no per-call tracing: a model
    with thousands of calls lowers in time linear in their number)."""
    if not call.lean:
        return _lower_callback(ctx, *args, call=call)
    _require_method(call)
    if call.ffi_id is None:
        call.ffi_id = _ffi.register(call)
    return _lower_ffi(ctx, *args, call_id=np.int64(call.ffi_id))


def _require_method(call: HostCall) -> None:
    if call.phase in ("jvp", "vjp") and getattr(type(call.op), call.phase) is getattr(
            DistributedOperator, call.phase):
        raise MissingMethodError(_missing(call.op, call.phase))


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
         call: HostCall) -> tuple[list[Any], list[Any]]:
    if call.phase != "forward":
        return _jvp_of_derivative(primals, tangents, call)
    if call.lean:  # the token has no tangent
        token, primals, tangents = primals[0], primals[1:], tangents[1:]
    outs = host_call_p.bind(*([token] if call.lean else []), *primals, call=call)
    return outs, _tangents_out(call, outs[0] if call.lean else None, primals, tangents)


def _jvp_of_derivative(primals: Sequence[Any], tangents: Sequence[Any],
                       call: HostCall) -> tuple[list[Any], list[Any]]:
    """The JVP of a `jvp` or `vjp` call: linear in its (co)tangents, which gives another
    call of its phase (not on the lean path); the part from its inputs' tangents is a
    derivative of a derivative, which raises where it is evaluated (see
    second_derivative.py), so one traced and discarded is no error."""
    outs = host_call_p.bind(*primals, call=call)
    avals = [ShapedArray(s.shape, s.dtype) for s in call.shapes()]
    nonzero = [t for t in tangents if type(t) is not ad.Zero]
    if call.lean:
        message = f"{call.where}: derivatives of a derivative are not available on the lean path."
        return outs, [ad.Zero(_token_aval().to_tangent_aval()),
                      *refused(message, nonzero, avals)]
    linear, inputs = tangents[:call.n_linear], tangents[call.n_linear:]
    found = None
    if any(type(t) is not ad.Zero for t in linear):
        found = host_call_p.bind(*map(ad.instantiate_zeros, linear),
                                 *primals[call.n_linear:], call=call)
    varying = [t for t in inputs if type(t) is not ad.Zero]
    if varying:
        message = (f"{call.where}: derivatives of a derivative with respect to the inputs "
                   "are not available.")
        second = refused(message, varying, avals)
        found = second if found is None else [a + b for a, b in zip(found, second)]
    assert found is not None  # (JAX asks for a JVP only where some tangent is not zero)
    return outs, found


def _tangents_out(call: HostCall, token: Any, inputs: Sequence[Any],
                  tangents: Sequence[Any]) -> list[Any]:
    """The output tangents of a forward call (on the lean path the token's, a zero,
    first): its `jvp` call on the inputs' `tangents`, given the `inputs` and (lean) the
    `token` after the call. The jvp call reads the chain's token but does not extend
    it: in reverse mode it is transposed away, and the transposed call joins the chain
    then. A tangent is batched where its input is."""
    jvp = call.with_phase("jvp", [call.levels[i] for i in _diff(call.in_specs)])
    linear = [ad.instantiate_zeros(tangents[i]) for i in jvp.slots]
    first = [token] if call.lean else []
    touts = iter(host_call_p.bind(*first, *linear, *inputs, call=jvp)[len(first):])
    out = [next(touts) if inexact_spec(s) else ad.Zero(ShapedArray(s.shape, s.dtype)
                                                   .to_tangent_aval())
           for s in call.out_specs]
    return [ad.Zero(_token_aval().to_tangent_aval())] + out if call.lean else out


def _linearize(is_vjp: bool, nonzeros: Sequence[bool], *primals: Any,
               call: HostCall) -> tuple[Any, ...]:
    """Linearization of a forward call, made of the same two calls as `_jvp`: the call
    itself, and its `jvp` call on the tangents as the linear part. (JAX's default
    derives this from `_jvp` by partial evaluation, call by call: most of the time
    spent tracing a reverse sweep over thousands of calls.)"""
    if call.phase != "forward":
        return fallback_linearize_rule(host_call_p, is_vjp, nonzeros, *primals, call=call)
    outs = host_call_p.bind(*primals, call=call)
    # what the jvp call reads: (lean) the token after the call, and the inputs
    residuals = (outs[0], *primals[1:]) if call.lean else primals

    def linearized(residuals: Sequence[Any], *tangents: Any) -> list[Any]:
        if STRUCTURED_RESIDUALS:
            tangents = tangents[1:]  # (none here)
        if call.lean:  # the token has no tangent
            return _tangents_out(call, residuals[0], residuals[1:], tangents[1:])
        return _tangents_out(call, None, residuals, tangents)

    nonzero_out = [False] * call.lean + [inexact_spec(s) for s in call.out_specs]
    if STRUCTURED_RESIDUALS:
        return outs, nonzero_out, residuals, None, linearized
    return outs, nonzero_out, residuals, linearized


def _transpose(cts: Sequence[Any], *args: Any, call: HostCall) -> list[Any]:
    if call.phase == "forward":
        return _transpose_forward(cts, *args, call=call)
    if all(type(c) is ad.Zero for c in cts):  # (a derivative nothing reads: no call)
        return [None] * len(args)
    if call.lean:
        args, cts = args[1:], cts[1:]
    inputs = args[call.n_linear:]
    if any(ad.is_undefined_primal(x) for x in inputs):
        raise SecondDerivativeError(f"{call.where}: derivatives of a derivative with "
                                    "respect to the inputs are not available.")
    other = "vjp" if call.phase == "jvp" else "jvp"
    if getattr(type(call.op), other) is getattr(DistributedOperator, other):
        raise MissingMethodError(_missing(call.op, other))
    transposed = call.with_phase(other)
    cts = [ad.instantiate_zeros(c) if type(c) is ad.Zero else c for c in cts]
    results = []
    for result, levels in zip(_bind(transposed, [*cts, *inputs]), call.levels):
        # A (co)tangent argument without some batch axis receives the sum over it.
        unbatched = tuple(k for k, on in enumerate(levels) if not on)
        results.append(jnp.sum(result, axis=unbatched) if unbatched else result)
    results += [None] * len(inputs)
    return [None] + results if call.lean else results


def _transpose_forward(cts: Sequence[Any], *args: Any, call: HostCall) -> list[Any]:
    """The transpose of a forward call (`jax.linear_transpose`): its `vjp` call, at zero
    inputs, for an operator that declares itself linear."""
    name, op = type(call.op).__name__, call.op
    rank = call.comm.Get_rank() if call.comm is not None else 0
    refusal = getattr(type(op), "transpose_refusal", None)
    if refusal:
        raise DistopError(f"jax.linear_transpose: {name} on rank {rank} {refusal}.")
    if not type(op).is_linear(op):
        why = ("is not linear with these fields (is_linear() is False)" if type(op).linear
               else "is not declared linear")
        raise DistopError(
            f"jax.linear_transpose: {name}.forward on rank {rank} {why}, so it has no "
            "transpose. Declare linear = True in the class if forward is linear in its "
            "floating-point inputs together (its vjp is then the transpose), or transpose "
            "its linearization instead (jax.vjp of the function).")
    if call.lean:
        args, cts = args[1:], cts[1:]
    known = [k for k, (x, spec) in enumerate(zip(args, call.in_specs))
             if inexact_spec(spec) and not ad.is_undefined_primal(x)]
    if known:
        raise DistopError(
            f"jax.linear_transpose: {name}.forward on rank {rank} is linear in its "
            f"floating-point inputs together, but inputs {known} are known values here, "
            "which makes the call affine in the others, not linear. Pass every "
            "floating-point input of the call as a linear argument.")
    vjp = "vjp"
    if getattr(type(op), vjp) is getattr(DistributedOperator, vjp):
        raise MissingMethodError(_missing(op, vjp))
    # (a linear map's vjp is the same at every point: zero inputs stand for the unknown)
    inputs = [jnp.zeros(x.aval.shape, x.aval.dtype) if ad.is_undefined_primal(x) else x
              for x in args]
    transposed = call.with_phase(vjp)
    cts = [ad.instantiate_zeros(c) if type(c) is ad.Zero else c for c in cts]
    linear = [cts[j] for j, spec in enumerate(call.out_specs) if inexact_spec(spec)]
    found = iter(_bind(transposed, [*linear, *inputs]))
    results: list[Any] = []
    for x, spec, levels in zip(args, call.in_specs, call.levels):
        result = next(found) if inexact_spec(spec) else None
        if not ad.is_undefined_primal(x):
            result = None
        elif result is not None:  # an input without some batch axis: summed over it
            unbatched = tuple(k for k, on in enumerate(levels) if not on)
            result = jnp.sum(result, axis=unbatched) if unbatched else result
        results.append(result)
    return [None] + results if call.lean else results


def _batch(args: Sequence[Any], dims: Sequence[int | None], *,
           call: HostCall) -> tuple[list[Any], list[int | None]]:
    if call.lean:
        if dims[0] is not None:
            raise NotImplementedError(f"{call.where}: a batched token")
        token, args, dims = args[0], args[1:], dims[1:]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    # (lax, not jnp.moveaxis: a jitted function, traced again on every call site)
    args = [a if not d else lax.transpose(a, (d, *(k for k in range(a.ndim) if k != d)))
            for a, d in zip(args, dims)]
    deeper = call.with_batch([d is not None for d in dims], size)
    if call.lean:
        outs = host_call_p.bind(token, *args, call=deeper)
        return outs, [None] + [0] * (len(outs) - 1)
    outs = host_call_p.bind(*args, call=deeper)
    return outs, [0] * len(outs)


def _diff(specs: Sequence[jax.ShapeDtypeStruct]) -> list[int]:
    return [i for i, s in enumerate(specs) if inexact_spec(s)]


def _missing(op: DistributedOperator, phase: str) -> str:
    custom = getattr(type(op), "missing_methods", {}).get(phase)
    if custom:  # (a class that names the method of its own that is missing)
        return custom
    mode = ("forward mode (jax.jvp, jacfwd, compute_totals(direction='fwd'))"
            if phase == "jvp"
            else "reverse mode (grad, vjp, jacrev, compute_totals)")
    return (f"{type(op).__name__} does not implement {phase}(self, comm, "
            f"{'tangent' if phase == 'jvp' else 'cotangent'}, *inputs), which {mode} needs.")


host_call_p.def_effectful_abstract_eval(_abstract_eval)
def _impl(*args: Any, call: HostCall) -> list[jax.Array]:
    """Outside jit: call the host directly, in Python's own order (a missing method
    raises here, on every rank, before its call runs)."""
    _require_method(call)
    return [jnp.asarray(r) for r in call(*(np.asarray(a) for a in args))]


host_call_p.def_impl(_impl)
mlir.register_lowering(host_call_p, _lowering)
ad.primitive_jvps[host_call_p] = _jvp
ad.primitive_transposes[host_call_p] = _transpose
if primitive_linearizations is not None:
    primitive_linearizations[host_call_p] = _linearize
batching.primitive_batchers[host_call_p] = _batch
install_refusals()  # (JAX's refusals of ordered calls, naming the operator)
