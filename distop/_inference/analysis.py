"""The kinds of a traced function's values, found by walking its jaxpr, and the places
where a replicated value meets varying data (`analyse`).

Every value is replicated, varying, or unknown (the output of an operator that declares
no kinds). An equation with a varying operand gives varying results, and each of its
replicated operands that carries a derivative is a place: its cotangent there is one
rank's share. A replicated operand meeting an unknown one is undecidable, and raises.
The walk enters the bodies of loops, branches, checkpoints and inner jits; it returns a
`Plan` that says, equation by equation, what `emit` inserts.
"""

import contextvars
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from .._compat import scan_counts, source_line
from .._errors import KindError
from .._operators.kinds import Kind, declared, takes_blocks

# Ordered: a result takes the largest of its operands' kinds. UNKNOWN is the output of
# an operator that declares no kinds; MIXED such an output combined with a replicated
# value that carries a derivative: harmless until it meets varying data, where the
# place of the sum over the ranks would depend on what the operator's output is.
REPLICATED, UNKNOWN, MIXED, VARYING = 0, 1, 2, 3
INLINED = ("pjit", "jit", "closed_call", "core_call")  # calls whose body is inlined
RETRACED = ("scan", "cond", "while", "remat2", "checkpoint")  # bodies emitted afresh


class Info(NamedTuple):
    """What the walk knows of one value: its kind, whether it carries a derivative
    (`live`: it depends on an argument and is floating-point), and, for an unknown or
    mixed kind, the operator it comes from and where it was mixed (`source`)."""

    kind: int
    live: bool = False
    source: tuple[str, str] = ("", "")


class Step(NamedTuple):
    """What `emit` does at one equation: pass the operands at `vary` through `vary`
    first; emit the bodies afresh with `subs` (their plans), or bind the equation as
    traced where `subs` is None."""

    vary: tuple[int, ...] = ()
    subs: tuple["Plan", ...] | None = None


class Plan(NamedTuple):
    """The steps of one jaxpr, and whether any of them, at any depth, inserts `vary`
    (`varies`) or holds an operator call (`has_calls`)."""

    steps: tuple[Step, ...]
    varies: bool
    has_calls: bool


CONSTANT = Info(REPLICATED)
# The kinds of the constants of the bodies inside the function walked now (by `id`; an
# inner jit keeps its own), as `analyse_function` sets them.
_inner_constants: contextvars.ContextVar[dict[int, Info] | None] = contextvars.ContextVar(
    "distop_inner_constants", default=None)


# The operators that combine the ranks' blocks and are given copies of one value that
# depends on the arguments (see `takes_blocks`), by name, as `analyse_function` collects
# them.
_copies: contextvars.ContextVar[dict[str, None] | None] = contextvars.ContextVar(
    "distop_copies", default=None)


def analyse_function(jaxpr: Jaxpr, ins: Sequence[Info], consts: Sequence[Info],
                     inner: dict[int, Info]) -> tuple[list[Info], Plan, list[str]]:
    """`analyse` of a whole function, with the kinds of its bodies' own constants
    (`inner`: `id` of the constant -> its `Info`; see `inner_constants`).

    **Returns:** `analyse`'s, and the operators given copies of one value that depends
    on the arguments where they combine each rank's own block (a replicated value
    where a distributed one was meant, almost always: a forgotten declaration).
    """
    copies: dict[str, None] = {}
    token, found = _inner_constants.set(inner), _copies.set(copies)
    try:
        outs, plan = analyse(jaxpr, ins, consts)
    finally:
        _inner_constants.reset(token)
        _copies.reset(found)
    return outs, plan, list(copies)


def inner_constants(jaxpr: Jaxpr) -> list[Any]:
    """**Returns:** the constants of the closed bodies inside `jaxpr`, at any depth."""
    found = []
    for eqn in jaxpr.eqns:
        for body in _jaxprs(eqn.params):
            if isinstance(body, ClosedJaxpr):
                found.extend(body.consts)
                body = body.jaxpr
            found.extend(inner_constants(body))
    return found


def join(infos: Sequence[Info]) -> Info:
    """**Returns:** the `Info` of a result of `infos`: the largest kind, live if any is."""
    kind = max((i.kind for i in infos), default=REPLICATED)
    source = next((i.source for i in infos if i.kind == kind), ("", ""))
    return Info(kind, any(i.live for i in infos), source)


def analyse(jaxpr: Jaxpr, ins: Sequence[Info], consts: Sequence[Info]) -> tuple[list[Info], Plan]:
    """Walk `jaxpr` with the kinds of its inputs and constants.

    **Returns:** (the `Info` of each output, the `Plan` of its equations).

    **Raises:** `KindError` where a replicated value that carries a derivative meets
    the output of an operator that declares no kinds.
    """
    env: dict[Any, Info] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, ins))

    def read(atom: Any) -> Info:
        return CONSTANT if isinstance(atom, Literal) else env[atom]

    steps = []
    varies = has_calls = False
    for eqn in jaxpr.eqns:
        infos = [read(v) for v in eqn.invars]
        outs, step, sub_calls = _equation(eqn, infos)
        env.update(zip(eqn.outvars, outs))
        steps.append(step)
        varies |= bool(step.vary) or any(p.varies for p in step.subs or ())
        has_calls |= sub_calls
    return [read(v) for v in jaxpr.outvars], Plan(tuple(steps), varies, has_calls)


def _equation(eqn: JaxprEqn, infos: list[Info]) -> tuple[list[Info], Step, bool]:
    """**Returns:** the `Info` of each result of `eqn`, its `Step`, and whether it holds
    an operator call."""
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    live = [i.live and _inexact(v) for i, v in zip(infos, eqn.invars)]
    if name == "distop_host_call":
        return _operator_call(eqn, infos, live)
    if name == "distop_vary":
        return [Info(VARYING, infos[0].live)], Step(), False
    if name in INLINED:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        outs, plan = _closed(inner, infos)
        return outs, Step(subs=(plan,) if plan.varies or plan.has_calls else None), plan.has_calls
    if name == "scan":
        return _scan(eqn, infos)
    if name == "while":
        return _while(eqn, infos)
    if name == "cond" and infos[0].kind != VARYING:
        branches = [_closed(b, infos[1:]) for b in eqn.params["branches"]]
        outs = [join(found) for found in zip(*(b[0] for b in branches))]
        plans = tuple(b[1] for b in branches)
        busy = any(p.varies or p.has_calls for p in plans)
        return outs, Step(subs=plans if busy else None), any(p.has_calls for p in plans)
    if name in ("remat2", "checkpoint"):
        outs, plan = analyse(eqn.params["jaxpr"], infos, ())
        return outs, Step(subs=(plan,) if plan.varies or plan.has_calls else None), plan.has_calls
    # any other equation, as one operation (a cond on a varying index among them): a
    # varying operand makes every result varying, and its replicated live operands
    # places
    result = join(infos)
    places: tuple[int, ...] = ()
    replicated_live = [i for i, (info, lv) in enumerate(zip(infos, live))
                       if lv and info.kind == REPLICATED]
    if result.kind == VARYING:
        mixed = next((i for i in infos if i.kind == MIXED), None)
        if mixed is not None:
            raise KindError(_undecided(mixed.source, eqn))
        places = tuple(replicated_live)
    elif result.kind == UNKNOWN and replicated_live:
        result = Info(MIXED, True, (result.source[0], _where(eqn)))
    inner_calls = holds_calls(eqn)
    return [result] * n_out, Step(vary=places), inner_calls


def _operator_call(eqn: JaxprEqn, infos: list[Info], live: list[bool],
                   ) -> tuple[list[Info], Step, bool]:
    """An operator call: its declared input kinds say which replicated operands are
    places (an input declared varying takes each rank's own value, and its VJP returns
    each rank's share); its declared output kinds give its results' kinds."""
    call = eqn.params["call"]
    op = call.op
    label = f"{type(op).__name__}.{call.phase}"
    lively = any(live)
    if call.phase != "forward":  # (a derivative the model takes itself)
        return [Info(UNKNOWN, lively, (label, ""))] * len(eqn.outvars), Step(), True
    wants = declared(op, "input", len(infos))
    for want, info in zip(wants, infos):
        if want is Kind.VARYING and info.kind == MIXED:
            raise KindError(_undecided(info.source, eqn))
    places = tuple(i for i, (want, info, lv) in enumerate(zip(wants, infos, live))
                   if want is Kind.VARYING and lv and info.kind == REPLICATED)
    copies = _copies.get()
    if copies is not None and infos and all(i.kind == REPLICATED for i in infos) \
            and any(i.live for i in infos) and takes_blocks(op):
        copies[type(op).__name__] = None
    gives = declared(op, "output", len(eqn.outvars))
    outs = [Info(UNKNOWN, lively, (type(op).__name__, "")) if kind is None else
            Info(VARYING if kind is Kind.VARYING else REPLICATED, lively) for kind in gives]
    return outs, Step(vary=places), True


def _closed(closed: Any, ins: Sequence[Info]) -> tuple[list[Info], Plan]:
    """`analyse` of a body, closed (its constants' kinds as `analyse_function` was
    given them) or not."""
    if isinstance(closed, ClosedJaxpr):
        known = _inner_constants.get() or {}
        return analyse(closed.jaxpr, ins, [known.get(id(c), CONSTANT) for c in closed.consts])
    return analyse(closed, ins, ())


def _scan(eqn: JaxprEqn, infos: list[Info]) -> tuple[list[Info], Step, bool]:
    """A scan: its carried values' kinds found by iterating the body to a fixed point
    (a carry that becomes varying stays varying)."""
    body = eqn.params["jaxpr"]
    n_consts, n_carry = scan_counts(eqn.params)
    consts, carry, xs = (infos[:n_consts], infos[n_consts:n_consts + n_carry],
                         infos[n_consts + n_carry:])
    outs, plan, carry = _scan_fixed(body, consts, carry, xs)
    # A replicated constant the body meets only at places varies for the whole loop:
    # one `vary` before it, whose transpose sums the cotangent once, after the sweep
    # back has added up every step's share.
    hoisted = tuple(i for i, c in enumerate(consts) if c.kind == REPLICATED and c.live
                    and _only_places(body.jaxpr, body.jaxpr.invars[i], plan))
    if hoisted:
        consts = [Info(VARYING, c.live) if i in hoisted else c for i, c in enumerate(consts)]
        outs, plan, carry = _scan_fixed(body, consts, carry, xs)
    busy = plan.varies or plan.has_calls
    return outs, Step(vary=hoisted, subs=(plan,) if busy or hoisted else None), plan.has_calls


def _scan_fixed(body: ClosedJaxpr, consts: list[Info], carry: list[Info], xs: list[Info],
                ) -> tuple[list[Info], Plan, list[Info]]:
    """**Returns:** the body's outputs, plan and carried kinds at their fixed point."""
    n_carry = len(carry)
    while True:
        outs, plan = _closed(body, consts + carry + xs)
        wider = [join([c, o]) for c, o in zip(carry, outs[:n_carry])]
        if wider == carry:
            return outs, plan, carry
        carry = wider


def _only_places(jaxpr: Jaxpr, var: Any, plan: Plan) -> bool:
    """Whether every use of `var` in `jaxpr` leads to places of `plan` only: it is a
    place, or an operand of a plain equation whose results lead to places only (a
    replicated computation that only varying data reads: `vary` may come before it).
    None is in a body or an output."""
    leads: dict[Any, bool] = {}
    for eqn, step in reversed(list(zip(jaxpr.eqns, plan.steps))):
        plain = step.subs is None and eqn.primitive.name != "distop_host_call"
        onward = plain and all(leads.get(v, False) for v in eqn.outvars)
        for i, atom in enumerate(eqn.invars):
            if isinstance(atom, Literal):
                continue
            ok = i in step.vary or onward
            leads[atom] = leads.get(atom, True) and ok
    for atom in jaxpr.outvars:
        if not isinstance(atom, Literal):
            leads[atom] = False
    return leads.get(var, False)


def _while(eqn: JaxprEqn, infos: list[Info]) -> tuple[list[Info], Step, bool]:
    """A while loop: as a scan, and every result varying where the condition is (the
    ranks may then run different numbers of steps)."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = infos[:nc], infos[nc:nc + nb], infos[nc + nb:]
    outs, body_plan, carry = _scan_fixed(p["body_jaxpr"], body_consts, carry, [])
    (test,), cond_plan = _closed(p["cond_jaxpr"], cond_consts + carry)
    if test.kind == VARYING:
        carry = [Info(VARYING, c.live, c.source) for c in carry]
        outs, body_plan = _closed(p["body_jaxpr"], body_consts + carry)
    plans = (cond_plan, body_plan)
    busy = any(q.varies or q.has_calls for q in plans)
    return carry, Step(subs=plans if busy else None), any(q.has_calls for q in plans)


def _inexact(atom: Any) -> bool:
    """Whether `atom` is floating-point or complex (can carry a derivative)."""
    dtype = getattr(atom.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _jaxprs(params: dict) -> list[Any]:
    """**Returns:** the jaxprs among an equation's parameters (its bodies)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (Jaxpr, ClosedJaxpr)):
                found.append(item)
    return found


def holds_calls(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is an operator call or holds one in a body, at any depth."""
    return eqn.primitive.name == "distop_host_call" or any(
        holds_calls(e) for j in _jaxprs(eqn.params)
        for e in (j.jaxpr if isinstance(j, ClosedJaxpr) else j).eqns)


def _where(eqn: JaxprEqn) -> str:
    """**Returns:** `eqn`'s primitive and where the user's code made it."""
    line = source_line(eqn)
    return f"`{eqn.primitive.name}`" + (f" ({line})" if line else "")


def _undecided(source: tuple[str, str], eqn: JaxprEqn) -> str:
    operator, mixed = source
    return (f"{operator} declares no output_kinds. Its output meets a replicated value "
            f"that carries a derivative in {mixed}, and the result meets data that "
            f"varies between ranks in {_where(eqn)}. Whether that value's derivative "
            f"is the sum of every rank's share depends on whether {operator}'s output "
            "is the same on every rank, which distop cannot tell. Declare output_kinds "
            f"= 'replicated' or 'varying' (one per output) in {operator}'s class body.")
