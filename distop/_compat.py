"""Shims over JAX versions: every one names what lets it go."""

from typing import Any

import jax

from ._config import env_flag

JaxRuntimeError = jax.errors.JaxRuntimeError  # XLA's runtime error


def x64_enabled() -> bool:
    """**Returns:** whether 64-bit JAX types are on (`jax_enable_x64`)."""
    return bool(jax.config.read("jax_enable_x64"))


# The effect JAX's ordered io_callback carries, declared by distop's host-call primitive
# so that its lowering may issue ordered callbacks. No public name as of jax 0.10.2.
from jax._src.callback import _OrderedIOEffect as ORDERED_IO_EFFECT  # noqa: E402, F401
from jax._src.config import int_state as _int_state  # noqa: E402  (see lean_session)
from jax._src.core import ShapedArray, no_effects  # noqa: E402, F401

# The trace a primitive binds into, and the class of the traces that make programs
# (a jit's, a loop body's, a branch's): no public names as of jax 0.12.0.
from jax._src.core import trace_ctx as _trace_ctx  # noqa: E402
from jax._src.interpreters.partial_eval import (  # noqa: E402
    DynamicJaxprTrace as ProgramTrace,  # noqa: F401
)

# A JAX setting whose value distop sets while it traces a program (0: none). JAX keys its
# caches of traced bodies (of loops, branches, checkpoints, inner jits) on such
# settings, so a body traced with host calls under one value is traced afresh under
# another (see _hostcalls/sessions.py). No public way to add a setting as of jax 0.12.0.
lean_session = _int_state("distop_lean_session", 0, "The value of the tracing scope under "
                          "way (set by distop while it traces a program).",
                          include_in_trace_context=True)


def current_trace() -> object:
    """**Returns:** the trace a primitive bound now binds into."""
    return _trace_ctx.trace

# Per-primitive linearization rules (no public name as of jax 0.12.0):
# without one, JAX derives a primitive's linearization from its JVP rule by partial
# evaluation, call by call. A rule returns (outputs, which tangents are nonzero,
# residuals, linear function of (residuals, *tangents)) up to jax 0.10.2; newer releases
# add "structured residuals" before the function, which then takes them after the
# residuals (STRUCTURED_RESIDUALS). None where this jax has no such table, or calls its
# rules otherwise (distop then keeps JAX's derivation: slower to trace, the same
# program).
try:
    import inspect

    from jax._src.interpreters.ad import (
        LinearizeTrace,
        fallback_linearize_rule,
        primitive_linearizations,
    )

    if [p.kind for p in inspect.signature(fallback_linearize_rule).parameters.values()] != [
            inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3 + [inspect.Parameter.VAR_POSITIONAL,
                                                          inspect.Parameter.VAR_KEYWORD]:
        raise ImportError("another calling convention")
    _caller = inspect.getsource(LinearizeTrace.process_primitive)
    STRUCTURED_RESIDUALS = "residuals, structured_res, linearized = lin(" in _caller
    if not STRUCTURED_RESIDUALS and "residuals, linearized = lin(" not in _caller:
        raise ImportError("another calling convention")
except (ImportError, OSError, TypeError):  # pragma: no cover - other jax releases
    fallback_linearize_rule = primitive_linearizations = None  # type: ignore[assignment]
    STRUCTURED_RESIDUALS = False


def prefer_inline_execution() -> None:
    """Ask JAX's CPU client to run programs on the calling thread (turn off its async
    dispatch), unless it has started already or `DISTOP_ASYNC_DISPATCH=1`.

    With async dispatch, XLA runs every program but the cheapest on a worker thread, so
    each host call waits for the GIL on a thread other than the caller's and the caller
    waits for the worker: several times as long as inline for a small program (see
    docs/performance.md).
    """
    if env_flag("DISTOP_ASYNC_DISPATCH", False):
        return
    try:
        # No public name (jax 0.10.2): the option only acts when the CPU client is made.
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_cpu_enable_async_dispatch", False)
    except (ImportError, AttributeError):  # pragma: no cover - other jax releases
        pass


# `lax.scan`'s parameters: counts of constants and carried values up to jax 0.11, trees
# of them (`ft_in`, `ft_out`) from jax 0.12.0 on.
def scan_consts(params: dict) -> int:
    """**Returns:** how many constants a scan's body takes first."""
    if "num_consts" in params:
        return int(params["num_consts"])
    return len(params["ft_in"].unpack()[0])


def scan_carrying_one_more(params: dict) -> dict:
    """**Returns:** a scan's parameters with one more carried value, the first."""
    params = dict(params)
    if "num_carry" in params:
        at = params["num_consts"]
        params["num_carry"] += 1
        if "linear" in params:  # (a parameter of some jax releases)
            params["linear"] = (*params["linear"][:at], False, *params["linear"][at:])
        return params
    import importlib

    flattree: Any = importlib.import_module("jax._src.flattree")
    consts, carry, xs = params["ft_in"].unpack()
    carry_out, ys = params["ft_out"].unpack()
    params["ft_in"] = flattree.pack((consts, flattree.pack((flattree.nones(1), carry)), xs))
    params["ft_out"] = flattree.pack((flattree.pack((flattree.nones(1), carry_out)), ys))
    return params


# The rules with which JAX refuses ordered callbacks: the partial evaluation of
# `jax.checkpoint` (differentiating it), the batching of `lax.cond` and of
# `while_loop`. distop wraps them so that the error names the operator (see
# _operators/refusals.py). No public names as of jax 0.10.2; none is wrapped where they moved.
def effect_refusing_rules() -> list[tuple[str, dict, Any]]:
    """**Returns:** (construct, rule table, primitive) for each rule found."""
    try:
        from jax._src.ad_checkpoint import remat_p
        from jax._src.interpreters import batching, partial_eval
        from jax._src.lax.control_flow.conditionals import cond_p
        from jax._src.lax.control_flow.loops import while_p
    except ImportError:  # pragma: no cover - other jax releases
        return []
    return [("checkpoint", partial_eval.custom_partial_eval_rules, remat_p),
            ("cond", batching.fancy_primitive_batchers, cond_p),
            ("while_loop", batching.fancy_primitive_batchers, while_p)]


def scan_counts(params: dict) -> tuple[int, int]:
    """**Returns:** how many constants and carried values a scan's body takes first."""
    if "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def source_line(eqn: Any) -> str:
    """**Returns:** where the user's code made `eqn` ("file:line (function)"), or ""
    (no public name as of jax 0.12.0)."""
    try:
        from jax._src import source_info_util

        return str(source_info_util.summarize(eqn.source_info))
    except (ImportError, AttributeError):  # pragma: no cover - other jax releases
        return ""


def bind_equation(eqn: Any, values: list[Any]) -> list[Any]:
    """Bind `eqn`'s primitive on `values` in the current trace, with its source and
    context, as `jax.core.eval_jaxpr` does. **Returns:** its results, as a list.
    (`get_bind_params` returned (functions, parameters) before jax 0.10 and the
    parameters alone since; the source helpers have no public name as of jax 0.12.0.)"""
    from jax._src import source_info_util

    found = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = found if isinstance(found, tuple) else ((), found)
    names = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
          eqn.ctx.manager):
        out = eqn.primitive.bind(*subfuns, *values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]
