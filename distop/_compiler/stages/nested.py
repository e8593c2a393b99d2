"""Nested calls: the token threaded through the model's own loops, branches and
checkpoints, so that their operator calls take the lean path.

While a program is traced, a call inside the body of a `lax.scan`, `fori_loop`,
`while_loop`, `cond`/`switch`, `jax.checkpoint` or inner `jax.jit` cannot take the
session's token: the body is a program of its own, traced apart. It takes a placeholder
instead (see `primitive.bind_call`). `threaded` then rewrites the traced program: every lean
call, at any depth, takes the token of the call before it in program order. A loop
carries the token as its first carried value, a branch takes it as its first operand
and returns it as its first result, a checkpoint takes and returns it likewise, and an
inner jit is inlined. So the calls run one at a time, in program order, each iteration's
after the one before, and the program's last output depends on every one of them.
"""

from collections.abc import Sequence
from typing import Any

from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    new_jaxpr_eqn,
)
from jax.extend.core.primitives import convert_element_type_p

from ..._compat import ShapedArray, no_effects, scan_carrying_one_more, scan_consts
from ..._errors import DistopError
from ..._hostcalls.base import HostCallable
from ..._hostcalls.ffi import token_dtype
from ..jaxprs import CHECKPOINTS, anywhere, has_lean, inner_eqns, is_lean, shaped

# the primitives a nested call may sit in whose bodies are inlined (newer JAX binds a
# call, and a checkpoint that is not differentiated, as eval_jaxpr)
_INLINED = ("jit", "pjit", "closed_call", "core_call", "eval_jaxpr", "custom_jvp_call",
            "custom_vjp_call", "custom_vjp_call_jaxpr")


def nested(jaxpr: Jaxpr) -> bool:
    """Whether a lean call of `jaxpr` sits inside a loop, branch, checkpoint or call."""
    return any(has_lean(eqn) for eqn in jaxpr.eqns)


def threaded(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` (a program traced on the lean path: the token its first input and last
    output) with every lean call, at any depth, on one token chain in program order.

    **Raises:** `DistopError` where an operator is called where the token cannot reach
    it (a `while_loop`'s condition, an unknown construct), naming the operator.
    """
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    constvars = list(jaxpr.constvars)
    eqns, token = _thread(jaxpr.eqns, jaxpr.invars[0], constvars, consts)
    new = Jaxpr(constvars, jaxpr.invars, [*jaxpr.outvars[:-1], token], eqns,
                jaxpr.effects, jaxpr.debug_info)
    return ClosedJaxpr(new, consts)


def _thread(eqns: Sequence[JaxprEqn], token: Var, constvars: list[Var],
            consts: list[Any]) -> tuple[list[JaxprEqn], Var]:
    """**Returns:** (`eqns` with the token threaded from `token` on, the last token).
    Inlined bodies may add constants: to `constvars` and `consts`."""
    out: list[JaxprEqn] = []
    for eqn in eqns:
        if is_lean(eqn):
            # (a placeholder's token nothing read was traced as a dropped variable `_`;
            # the chain reads it now)
            after = eqn.outvars[0]
            if isinstance(after, DropVar):
                after = Var(after.aval)
            out.append(eqn.replace(invars=[token, *eqn.invars[1:]],
                                   outvars=[after, *eqn.outvars[1:]]))
            token = after
        elif not has_lean(eqn):
            out.append(eqn)
        elif eqn.primitive.name in _INLINED:
            more, token = _thread(_inlined(eqn, constvars, consts), token, constvars,
                                  consts)
            out.extend(more)
        else:
            done, token = _around(eqn, token)
            out.append(done)
    return out, token


def _around(eqn: JaxprEqn, token: Var) -> tuple[JaxprEqn, Var]:
    """**Returns:** (a loop, branch or checkpoint `eqn` taking `token` and giving the
    token after its calls, that token)."""
    name, params = eqn.primitive.name, dict(eqn.params)
    after = Var(token.aval)
    if name == "scan":
        at = scan_consts(params)
        params = scan_carrying_one_more(params)
        params["jaxpr"] = _closed_body(params["jaxpr"], at)
    elif name == "while":
        if anywhere(params["cond_jaxpr"].jaxpr.eqns, is_lean):
            raise DistopError(f"{_first_call(params['cond_jaxpr'].jaxpr.eqns)} is called "
                              "inside a "
                              "while_loop's condition, where its calls cannot be ordered. "
                              "Call it in the loop's body and carry its result.")
        at = params["cond_nconsts"] + params["body_nconsts"]
        params["body_jaxpr"] = _closed_body(params["body_jaxpr"], params["body_nconsts"])
        params["cond_jaxpr"] = _ignoring(params["cond_jaxpr"], params["cond_nconsts"])
    elif name == "cond":
        at = 1
        params["branches"] = tuple(_closed_body(b, 0) for b in params["branches"])
    elif name in CHECKPOINTS:
        at = 0
        consts: list[Any] = []
        params["jaxpr"] = _body(params["jaxpr"], list(params["jaxpr"].constvars), consts, 0)
        if consts:  # (a checkpoint's body is open: no constants of its own)
            raise DistopError(f"{_first_call([eqn])} is called inside a jitted function "
                              "inside jax.checkpoint, which distop cannot order on the "
                              "lean path. Call it outside the inner jit.")
    else:
        raise DistopError(f"{_first_call([eqn])} is called inside {name}, which distop "
                          "cannot order on the lean path. Pass Problem(..., "
                          "backend='io_callback') or call it outside.")
    invars = [*eqn.invars[:at], token, *eqn.invars[at:]]
    return eqn.replace(invars=invars, outvars=[after, *eqn.outvars], params=params), after


def _closed_body(closed: ClosedJaxpr, at: int) -> ClosedJaxpr:
    """`_body` of a closed body, its constants kept."""
    consts = list(closed.consts)
    constvars = list(closed.jaxpr.constvars)
    return ClosedJaxpr(_body(closed.jaxpr, constvars, consts, at), consts)


def _body(jaxpr: Jaxpr, constvars: list[Var], consts: list[Any], at: int) -> Jaxpr:
    """A body taking the token as its argument `at` and giving the token after its
    calls as its first result. Inlined calls may add to `constvars` and `consts`, the
    body's own (the given lists, which the caller passes on)."""
    token = Var(ShapedArray((), token_dtype()))
    eqns, after = _thread(jaxpr.eqns, token, constvars, consts)
    invars = [*jaxpr.invars[:at], token, *jaxpr.invars[at:]]
    outvars = [after, *jaxpr.outvars]
    return Jaxpr(constvars, invars, outvars, eqns, jaxpr.effects,
                 _info(len(invars), len(outvars)))


def _ignoring(closed: ClosedJaxpr, at: int) -> ClosedJaxpr:
    """A while loop's condition, taking (and ignoring) the token as argument `at`."""
    jaxpr = closed.jaxpr
    invars = [*jaxpr.invars[:at], Var(ShapedArray((), token_dtype())), *jaxpr.invars[at:]]
    return ClosedJaxpr(Jaxpr(jaxpr.constvars, invars, jaxpr.outvars, jaxpr.eqns,
                             jaxpr.effects, _info(len(invars), len(jaxpr.outvars))),
                       closed.consts)


def _inlined(eqn: JaxprEqn, constvars: list[Var], consts: list[Any]) -> list[JaxprEqn]:
    """**Returns:** the equations of a call's body (an inner jit, a custom derivative's
    function) with fresh variables, reading the call's arguments and giving its results.
    The body's constants are added to `constvars` and `consts`."""
    closed: Any = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(closed, Jaxpr):
        closed = ClosedJaxpr(closed, [])
    jaxpr = closed.jaxpr
    rename: dict[Var, Any] = {}
    for v, value in zip(jaxpr.constvars, closed.consts):
        rename[v] = Var(v.aval)
        constvars.append(rename[v])
        consts.append(value)
    # (a custom derivative's call passes its constants first, as arguments)
    rename.update(zip(jaxpr.invars, eqn.invars[len(eqn.invars) - len(jaxpr.invars):]))
    copies = []  # results that are not made by an equation of their own in the body
    for result, value in zip(eqn.outvars, jaxpr.outvars):
        if isinstance(result, DropVar):
            continue  # (unused: the body's value keeps a variable of its own)
        if isinstance(value, Var) and value not in rename:
            rename[value] = result
        else:
            copies.append((value, result))

    def read(v: Any) -> Any:
        return v if isinstance(v, Literal) else rename.setdefault(v, Var(v.aval))

    body = [e.replace(invars=[read(v) for v in e.invars], outvars=[read(v) for v in e.outvars])
            for e in jaxpr.eqns]
    for value, result in copies:
        aval = shaped(result)
        params = {"new_dtype": aval.dtype, "weak_type": aval.weak_type,
                  "sharding": getattr(aval, "sharding", None)}
        body.append(new_jaxpr_eqn([read(value)], [result], convert_element_type_p, params,
                                  no_effects))
    return body


def _first_call(eqns: Sequence[JaxprEqn]) -> str:
    """**Returns:** the first lean call among `eqns`, at any depth, as messages name it."""
    for eqn in eqns:
        if is_lean(eqn):
            return str(eqn.params["call"].where)
        if has_lean(eqn):
            return _first_call(list(inner_eqns(eqn)))
    return "an operator"


def _info(n_in: int, n_out: int) -> DebugInfo:
    return DebugInfo("distop nested", "distop_nested", ("",) * n_in, ("",) * n_out)


def host_calls(jaxpr: Jaxpr) -> list[HostCallable]:
    """**Returns:** the lean calls of `jaxpr` at any depth, each once, in program order."""
    found: dict[int, HostCallable] = {}

    def walk(eqns: Any) -> None:
        for eqn in eqns:
            if is_lean(eqn):
                found.setdefault(id(eqn.params["call"]), eqn.params["call"])
            else:
                walk(inner_eqns(eqn))
    walk(jaxpr.eqns)
    return list(found.values())


def count(jaxpr: Jaxpr) -> int | None:
    """**Returns:** how many lean calls a run of `jaxpr` makes (how much it adds to the
    token), or None where it depends on the values (a while loop, branches making
    different numbers of calls)."""
    total = 0
    for eqn in jaxpr.eqns:
        if is_lean(eqn):
            total += 1
            continue
        if not has_lean(eqn):
            continue
        name = eqn.primitive.name
        if name == "scan":
            inner = count(eqn.params["jaxpr"].jaxpr)
            found = None if inner is None else eqn.params["length"] * inner
        elif name == "cond":
            each = {count(b.jaxpr) for b in eqn.params["branches"]}
            found = each.pop() if len(each) == 1 else None
        elif name in CHECKPOINTS:
            found = count(eqn.params["jaxpr"])
        else:
            found = None
        if found is None:
            return None
        total += found
    return total
