"""JAX's refusals of ordered callbacks, in distop's words.

Outside a `Problem`, an operator that communicates on more than one rank (or declares
`ordered = True`) lowers to ordered `io_callback`s. JAX cannot differentiate those
inside `jax.checkpoint`, nor vmap them inside `lax.cond` or `while_loop`, and says so
with an error of its own that names neither the operator nor a way out. `install`
wraps the rules that refuse: where what they refuse holds an ordered operator call,
the error is an `OrderedEffectError` naming the operator and the fix.
"""

import functools
from collections.abc import Callable, Iterator
from typing import Any

from .._compat import effect_refusing_rules
from .._errors import OrderedEffectError

_WHY = {
    "checkpoint": ("is called inside jax.checkpoint (jax.remat), which JAX cannot "
                   "differentiate with ordered callbacks inside"),
    "cond": ("is called inside lax.cond (or lax.switch), which JAX cannot vmap with "
             "ordered callbacks inside (jax.vmap, jacrev or jacfwd of it)"),
    "while_loop": ("is called inside lax.while_loop (or a fori_loop with traced bounds), "
                   "which JAX cannot vmap with ordered callbacks inside"),
}
_FIX = {
    "checkpoint": ("call the model inside a distop.Problem, whose lean path runs "
                   "checkpointed operators (their forward calls run again in the "
                   "reverse sweep, in one order on every rank), or call the operator "
                   "outside jax.checkpoint"),
    "cond": ("call the model inside a distop.Problem, whose lean path vmaps it; or "
             "compute both branches and pick one with jnp.where; or loop over the rows "
             "in Python"),
    "while_loop": ("call the model inside a distop.Problem, whose lean path vmaps it; or "
                   "loop over the rows in Python"),
}


def install() -> None:
    """Wrap JAX's refusing rules (once; a rule already wrapped stays as it is)."""
    for construct, table, primitive in effect_refusing_rules():
        rule = table.get(primitive)
        if rule is not None and not getattr(rule, "distop_wrapped", False):
            table[primitive] = _wrapped(construct, rule)


def _wrapped(construct: str, rule: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(rule)
    def wrapped(*args: Any, **params: Any) -> Any:
        try:
            return rule(*args, **params)
        except Exception as err:  # (JAX raises Exception itself for a while_loop)
            text = str(err)
            if "ffect" not in text or "not supported" not in text:
                raise
            call = next(_ordered_calls(params.values()), None)
            if call is None:
                raise
            rank = call.comm.Get_rank() if call.comm is not None else 0
            raise OrderedEffectError(
                f"{call.where} on rank {rank} {_WHY[construct]}; outside a Problem, the "
                "calls of an operator that communicates on more than one rank (or "
                f"declares ordered = True) are ordered. To fix: {_FIX[construct]}. "
                f"(JAX: {text})") from err

    wrapped.distop_wrapped = True  # type: ignore[attr-defined]
    return wrapped


def _ordered_calls(values: Any) -> Iterator[Any]:
    """**Returns:** the ordered distop host calls (not lean ones) in the programs among
    `values` (a rule's parameters), at any depth."""
    for value in values:
        if isinstance(value, (tuple, list)):
            yield from _ordered_calls(value)
            continue
        jaxpr = getattr(value, "jaxpr", value)  # (a closed program's own)
        for eqn in getattr(jaxpr, "eqns", ()):
            call = eqn.params.get("call") if eqn.primitive.name == "distop_host_call" else None
            if call is not None and call.ordered and not call.lean:
                yield call
            else:
                yield from _ordered_calls(eqn.params.values())
