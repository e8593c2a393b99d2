"""The `distop_host_call` primitive, which every operator call binds, and its rules.

One primitive serves every host call, whatever the phase; its parameter is the
`HostCall` to run. Its rules keep every transformation at one host call per operator
call: the JVP of `forward` is a `jvp` call, linear in the tangents, whose transpose is a
`vjp` call (and back); `vmap` adds a batch level to the same call (so `jacrev` and
batched totals issue ONE callback on the whole batch). An ordered call lowers to
`io_callback(ordered=True)` and carries JAX's ordered-IO effect: JAX threads an effect
token through it, which fixes its place in program order on every rank and keeps XLA
from dropping, duplicating or overlapping it. A lean call (the lean path, see
_hostcalls/ffi.py) carries no effect: its first operand and first result are the token
that orders it. Each rule is registered right after its definition.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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
from .._errors import DistopError, KindWarning, MissingMethodError, SecondDerivativeError
from .._hostcalls import ffi as _ffi
from .._hostcalls import sessions as _sessions
from .._hostcalls.host import HostCall
from .kinds import Kind, declared, inferring
from .refusals import install as install_refusals
from .second_derivative import refused


class _HostCallPrimitive(Primitive):
    """The primitive, which tells the tracing scope under way where each call is bound
    (see `_sessions.bound`): JAX binds through `bind_with_trace`, into the trace it
    names, whoever binds."""

    def bind_with_trace(self, trace: Any, args: Any, *rest: Any) -> Any:
        # (rest: (avals, params) in jax 0.10.2, (params,) in older releases: parameters last)
        _sessions.bound(trace, rest[-1]["call"])
        return super().bind_with_trace(trace, args, *rest)


host_call_p = _HostCallPrimitive("distop_host_call")
host_call_p.multiple_results = True

Method = TypeVar("Method", bound=Callable[..., Any])


# -- the methods an operator may lack -------------------------------------------------
def unimplemented(method: Method) -> Method:
    """Mark a base-class method that stands in for one an operator lacks.

    **Arguments:**
    - `method`: the base class's `jvp` or `vjp`.

    **Returns:** `method` itself, marked (see `implements`).
    """
    method.unimplemented = True  # type: ignore[attr-defined]
    return method


def implements(op: Any, phase: str) -> bool:
    """**Returns:** whether the class of `op` has a `phase` method of its own, not the
    base class's stand-in (see `unimplemented`)."""
    return not getattr(getattr(type(op), phase), "unimplemented", False)


def missing(op: Any, phase: str) -> str:
    """The message for an operator that lacks its `phase` method.

    **Arguments:**
    - `op`: the operator.
    - `phase`: `"jvp"`, `"vjp"` or `"hvp"`.

    **Returns:** the message, naming the method and the computations that need it.
    """
    custom = getattr(type(op), "missing_methods", {}).get(phase)
    if custom:  # (a class that names the method of its own that is missing)
        return custom
    name = type(op).__name__
    if phase == "hvp":
        return (f"{name} does not implement hvp(self, comm, y_bar, tangent, *inputs), "
                "which second derivatives through it (jax.hessian, jax.jvp of jax.grad, "
                "jax.grad of jax.grad or of jax.jvp, Problem.compute_hvp) need. Add it "
                f"to {name} (the derivative of its vjp along the tangent), or declare "
                "linear = True if its forward is linear.")
    mode = ("forward mode (jax.jvp, jacfwd, compute_totals(direction='fwd'))"
            if phase == "jvp"
            else "reverse mode (grad, vjp, jacrev, compute_totals)")
    return (f"{name} does not implement {phase}(self, comm, "
            f"{'tangent' if phase == 'jvp' else 'cotangent'}, *inputs), which {mode} needs.")


def _require(op: Any, phase: str) -> None:
    """Raise `MissingMethodError` where `op` lacks its `phase` method."""
    if not implements(op, phase):
        raise MissingMethodError(missing(op, phase))


def _require_method(call: HostCall) -> None:
    if call.phase in ("jvp", "vjp", "hvp"):
        _require(call.op, call.phase)
    elif call.phase == "jvp2":
        raise SecondDerivativeError(_forward_over_forward(call))


def _forward_over_forward(call: HostCall) -> str:
    """**Returns:** the message of a `jvp2` call evaluated: forward mode over forward
    mode, which distop does not offer."""
    name = type(call.op).__name__
    return (f"{name}.jvp on rank {_rank(call)}: forward mode over forward mode "
            "(jax.jacfwd of jax.jacfwd, jax.jvp of jax.jvp) is not available: it needs "
            f"the derivative of {name}.jvp with respect to the inputs. Use jax.hessian "
            "or jax.jvp of jax.grad instead (forward over reverse), which use its hvp.")


def _lacks_hvp(call: HostCall) -> str:
    """**Returns:** the message of a second derivative through an operator without
    `hvp`, naming `jvp` first where that is missing too (every second derivative needs
    it)."""
    where = f"{call.where} on rank {_rank(call)}: "
    if implements(call.op, "jvp") or getattr(type(call.op), "missing_methods", {}).get("hvp"):
        return where + missing(call.op, "hvp")
    name = type(call.op).__name__
    return (where + f"{name} does not implement jvp(self, comm, tangent, *inputs), which "
            "second derivatives through it need, besides hvp(self, comm, y_bar, "
            "tangent, *inputs) (or linear = True where its forward is linear).")


def _rank(call: HostCall) -> int:
    return call.comm.Get_rank() if call.comm is not None else 0


# -- binding ---------------------------------------------------------------------------
def bind_call(call: HostCall, args: Sequence[Any]) -> list[Any]:
    """Bind the primitive; a lean call takes the session's token and moves it on (at
    the program's top level; see `_sessions.Session.at_top`).

    **Arguments:**
    - `call`: the `HostCall`.
    - `args`: its operands, the token left out.

    **Returns:** its results, the token left out.
    """
    if not call.lean:
        return host_call_p.bind(*args, call=call)
    session = _sessions.session()
    if session is None:  # (a lean call's derivative, traced again after its session)
        return host_call_p.bind(*args, call=call.unleaned())
    if not session.at_top():
        # In the body of the model's own loop, branch or checkpoint: a placeholder
        # token, which the program's rewrite replaces (see _compiler/stages/nested.py).
        return host_call_p.bind(np.zeros((), _ffi.token_dtype()), *args, call=call)[1:]
    token, *outs = host_call_p.bind(session.token, *args, call=call)
    session.token = token
    return outs


# -- evaluation and lowering ------------------------------------------------------------
def _token_aval() -> ShapedArray:
    return ShapedArray((), _ffi.token_dtype())


def _abstract_eval(*args: Any, call: HostCall) -> tuple[list[ShapedArray], Any]:
    avals = [ShapedArray(s.shape, s.dtype) for s in call.shapes()]
    if call.lean:
        return [_token_aval()] + avals, no_effects
    return avals, ({ORDERED_IO_EFFECT} if call.ordered else no_effects)


host_call_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(*args: Any, call: HostCall) -> list[jax.Array]:
    """Outside jit: call the host directly, in Python's own order (a missing method
    raises here, on every rank, before its call runs)."""
    _require_method(call)
    return [jnp.asarray(r) for r in call(*(np.asarray(a) for a in args))]


host_call_p.def_impl(_impl)


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


mlir.register_lowering(host_call_p, _lowering)


# -- differentiation ---------------------------------------------------------------------
def _jvp_of_derivative(primals: Sequence[Any], tangents: Sequence[Any],
                       call: HostCall) -> tuple[list[Any], list[Any]]:
    """The JVP of a `jvp`, `vjp`, `hvp` or `jvp2` call.

    A `jvp` or `vjp` call is linear in its (co)tangents, which gives another call of
    its phase; the part from its inputs' tangents is a second derivative: none for a
    linear operator, an `hvp` call for a `vjp` call, a `jvp2` call for a `jvp` call
    (which is never run, but transposes into an `hvp` call). An operator without `hvp`
    gets values that raise where they are evaluated (see second_derivative.py), so one
    traced and discarded is no error; so do third derivatives. On the lean path the
    new calls read the token after the call without moving it on, as a forward call's
    `jvp` call does (see `_tangents_out`)."""
    outs = host_call_p.bind(*primals, call=call)
    token = outs[0] if call.lean else None
    if call.lean:
        primals, tangents = primals[1:], tangents[1:]
    avals = [ShapedArray(s.shape, s.dtype) for s in call.shapes()]
    linear, inputs = tangents[:call.n_linear], tangents[call.n_linear:]
    moving = [t for t in linear if type(t) is not ad.Zero]
    varying = [t for t in inputs if type(t) is not ad.Zero]
    found: list[Any] | None = None
    if call.phase in ("hvp", "jvp2"):
        message = (f"{call.where} on rank {_rank(call)}: third derivatives (derivatives "
                   "of a second derivative) are not available.")
        found = refused(message, moving + varying, avals)
    else:
        if moving:
            found = _bind_reading(call, token, [*map(ad.instantiate_zeros, linear),
                                                *primals[call.n_linear:]])
        if varying and not type(call.op).is_linear(call.op):
            second = _second(call, token, primals, inputs, varying, avals)
            found = second if found is None else [a + b for a, b in zip(found, second)]
    if found is None:  # (a linear operator's derivative along its inputs: zero)
        found = [ad.Zero(a.to_tangent_aval()) for a in avals]
    return outs, ([ad.Zero(_token_aval().to_tangent_aval()), *found] if call.lean
                  else list(found))


def _bind_reading(call: HostCall, token: Any, args: Sequence[Any]) -> list[Any]:
    """Bind `call`, a derivative of a call on the chain; on the lean path it reads
    `token`, the token after that call, and leaves the chain as it is (the program's
    rewrite threads it, see _compiler/stages/nested.py)."""
    if call.lean and _sessions.session() is None:
        call = call.unleaned()
    if call.lean:
        return host_call_p.bind(token, *args, call=call)[1:]
    return host_call_p.bind(*args, call=call)


def _second(call: HostCall, token: Any, primals: Sequence[Any], inputs: Sequence[Any],
            varying: Sequence[Any], avals: Sequence[ShapedArray]) -> list[Any]:
    """The derivative of a `jvp` or `vjp` call along its inputs' tangents `inputs`: a
    `jvp2` call, or an `hvp` call (values that raise where `hvp` is missing)."""
    n, diff = call.n_linear, _diff(call.in_specs)
    levels = [*call.levels[:n], *(call.levels[n + i] for i in diff)]
    args = [*primals[:n], *(ad.instantiate_zeros(inputs[i]) for i in diff), *primals[n:]]
    if call.phase == "jvp":  # (refused where it is run; transposed into an hvp call)
        return host_call_p.bind(*args, call=call.with_phase("jvp2", levels))
    if not implements(call.op, "hvp"):
        return refused(_lacks_hvp(call), varying, avals)
    return _bind_reading(call.with_phase("hvp", levels), token, args)


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


_warned_outside_kinds = False  # (warned once per process)


def _warn_outside_kinds(call: HostCall, nonzero: Sequence[bool]) -> None:
    """Warn, once per process, where JAX differentiates an operator with an input
    declared varying outside kind inference (`with_kinds`, a Problem) with several
    ranks: a replicated value's derivative there is each rank's share only.

    **Arguments:**
    - `call`: the forward call differentiated.
    - `nonzero`: per input of the call, whether its tangent is not zero.
    """
    global _warned_outside_kinds
    if _warned_outside_kinds or inferring.get():
        return
    wants = declared(call.op, "input", len(nonzero))
    if not any(w is Kind.VARYING and n for w, n in zip(wants, nonzero)) \
            or _comm.private(call.op.comm).Get_size() == 1:
        return
    _warned_outside_kinds = True
    name = type(call.op).__name__
    warnings.warn(
        f"{name}: JAX differentiates it outside distop.with_kinds and a Problem. There, "
        "the derivative of a value that is the same on every rank (a parameter) where it "
        "meets each rank's own data is that rank's share only, not the sum over the "
        "ranks. Wrap the function: jax.grad(distop.with_kinds(loss, distributed=...)), "
        "or make a Problem of it. Where the function passes such values through "
        "distop.RankLocal() itself, silence this with warnings.filterwarnings('ignore', "
        "category=distop.KindWarning).", KindWarning, stacklevel=2)


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *,
         call: HostCall) -> tuple[list[Any], list[Any]]:
    if call.phase != "forward":
        return _jvp_of_derivative(primals, tangents, call)
    if call.lean:  # the token has no tangent
        token, primals, tangents = primals[0], primals[1:], tangents[1:]
    _warn_outside_kinds(call, [type(t) is not ad.Zero for t in tangents])
    outs = host_call_p.bind(*([token] if call.lean else []), *primals, call=call)
    return outs, _tangents_out(call, outs[0] if call.lean else None, primals, tangents)


ad.primitive_jvps[host_call_p] = _jvp


def _linearize(is_vjp: bool, nonzeros: Sequence[bool], *primals: Any,
               call: HostCall) -> tuple[Any, ...]:
    """Linearization of a forward call, made of the same two calls as `_jvp`: the call
    itself, and its `jvp` call on the tangents as the linear part. (JAX's default
    derives this from `_jvp` by partial evaluation, call by call: most of the time
    spent tracing a reverse sweep over thousands of calls.)"""
    if call.phase != "forward":
        return fallback_linearize_rule(host_call_p, is_vjp, nonzeros, *primals, call=call)
    _warn_outside_kinds(call, nonzeros[1:] if call.lean else nonzeros)
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


if primitive_linearizations is not None:
    primitive_linearizations[host_call_p] = _linearize


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
    _require(op, "vjp")
    # (a linear map's vjp is the same at every point: zero inputs stand for the unknown)
    inputs = [jnp.zeros(x.aval.shape, x.aval.dtype) if ad.is_undefined_primal(x) else x
              for x in args]
    transposed = call.with_phase("vjp")
    cts = [ad.instantiate_zeros(c) if type(c) is ad.Zero else c for c in cts]
    linear = [cts[j] for j, spec in enumerate(call.out_specs) if inexact_spec(spec)]
    found = iter(bind_call(transposed, [*linear, *inputs]))
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


def _transpose(cts: Sequence[Any], *args: Any, call: HostCall) -> list[Any]:
    if call.phase == "forward":
        return _transpose_forward(cts, *args, call=call)
    if all(type(c) is ad.Zero for c in cts):  # (a derivative nothing reads: no call)
        return [None] * len(args)
    if call.lean:
        args, cts = args[1:], cts[1:]
    if call.phase in ("hvp", "jvp2"):
        results = _transpose_second(cts, args, call)
        return [None] + results if call.lean else results
    inputs = args[call.n_linear:]
    if any(ad.is_undefined_primal(x) for x in inputs):
        raise SecondDerivativeError(f"{call.where}: derivatives of a derivative with "
                                    "respect to the inputs are not available.")
    other = "vjp" if call.phase == "jvp" else "jvp"
    _require(call.op, other)
    transposed = call.with_phase(other)
    cts = [ad.instantiate_zeros(c) if type(c) is ad.Zero else c for c in cts]
    results = []
    for result, levels in zip(bind_call(transposed, [*cts, *inputs]), call.levels):
        # A (co)tangent argument without some batch axis receives the sum over it.
        unbatched = tuple(k for k, on in enumerate(levels) if not on)
        results.append(jnp.sum(result, axis=unbatched) if unbatched else result)
    results += [None] * len(inputs)
    return [None] + results if call.lean else results


ad.primitive_transposes[host_call_p] = _transpose


def _transpose_second(cts: Sequence[Any], args: Sequence[Any], call: HostCall) -> list[Any]:
    """The transpose of an `hvp` call along its tangents (the weighted Hessian is
    symmetric: the same call on the cotangents), or of a `jvp2` call along its
    directions (an `hvp` call, with the cotangents in the outputs' place), given the
    `args` without the token.

    **Returns:** the cotangents of `args`.
    """
    n, first = call.n_linear, call.spec.n_first
    fixed, moving, inputs = args[:first], args[first:n], args[n:]
    if any(ad.is_undefined_primal(x) for x in (*fixed, *inputs)):
        raise SecondDerivativeError(f"{call.where} on rank {_rank(call)}: third "
                                    "derivatives (derivatives of a second derivative) are "
                                    "not available.")
    undefined = [ad.is_undefined_primal(x) for x in moving]
    cts = [ad.instantiate_zeros(c) for c in cts]
    if not implements(call.op, "hvp"):  # (a jvp2 call: its values raise where evaluated)
        found = iter(refused(_lacks_hvp(call), cts,
                             [x.aval for x, u in zip(moving, undefined) if u]))
        results = [next(found) if u else None for u in undefined]
        return [None] * first + results + [None] * len(inputs)
    full = [(True,) * len(call.batch_shape)] * len(cts)
    if call.phase == "hvp":
        hvp = call.with_phase("hvp", [*call.levels[:first], *full])
        found = iter(bind_call(hvp, [*fixed, *cts, *inputs]))
    else:
        hvp = call.with_phase("hvp", [*full, *call.levels[:first]])
        found = iter(bind_call(hvp, [*cts, *fixed, *inputs]))
    results = []
    for k, u in enumerate(undefined):
        result = next(found)
        # A tangent without some batch axis receives the sum over it.
        unbatched = tuple(b for b, on in enumerate(call.levels[first + k]) if not on)
        result = jnp.sum(result, axis=unbatched) if unbatched and u else result
        results.append(result if u else None)
    return [None] * first + results + [None] * len(inputs)


def _diff(specs: Sequence[jax.ShapeDtypeStruct]) -> list[int]:
    return [i for i, s in enumerate(specs) if inexact_spec(s)]


# -- batching ----------------------------------------------------------------------------
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


batching.primitive_batchers[host_call_p] = _batch
install_refusals()  # (JAX's refusals of ordered calls, naming the operator)
