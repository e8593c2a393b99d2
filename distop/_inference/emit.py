"""A traced function run again equation by equation, with `vary` inserted where its
`Plan` says (`emit`).

Operator calls are made again through the operator (so that they take the lean path's
token where a Problem traces one); inner jits are inlined; the bodies of loops, branches
and checkpoints that hold a place or an operator call are emitted afresh through
`lax.scan`, `lax.switch`, `lax.while_loop` and `jax.checkpoint`; every other equation is
bound as traced.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from .._compat import bind_equation, scan_counts
from .._errors import DistopError
from .._operators.kinds import vary
from .._operators.operator import apply
from .analysis import INLINED, Plan, holds_calls


def emit(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], plan: Plan,
         total: Any) -> list[Any]:
    """Evaluate `jaxpr` on `args` in the current trace, as `plan` says.

    **Arguments:**
    - `jaxpr`, `consts`: the function, traced, and its constants.
    - `args`: its inputs.
    - `plan`: from `analyse`.
    - `total`: the operator that sums a cotangent over the ranks (`vary`'s transpose).

    **Returns:** its outputs.
    """
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    varied: dict[Any, Any] = {}  # variable -> vary of it (one per variable and jaxpr)

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for eqn, step in zip(jaxpr.eqns, plan.steps):
        values = [read(v) for v in eqn.invars]
        for i in step.vary:
            atom = eqn.invars[i]
            if atom not in varied:
                varied[atom] = vary(values[i], total)
            values[i] = varied[atom]
        name = eqn.primitive.name
        if name == "distop_host_call" and eqn.params["call"].phase == "forward":
            found = apply(eqn.params["call"].op, values)
            outs = list(found) if isinstance(found, tuple) else [found]
        elif step.subs is not None:
            outs = _afresh(eqn, values, step.subs, total)
        elif name == "distop_host_call":  # (a derivative of an operator, taken inside)
            call = eqn.params["call"]
            raise DistopError(
                f"{type(call.op).__name__}.{call.phase}: the function differentiates an "
                "operator itself, and the sums over the ranks its kinds need belong to "
                "the function JAX differentiates, not to its derivative. Put with_kinds "
                "around that function, inside the transformation: "
                "jax.grad(distop.with_kinds(loss, distributed=...)), not "
                "distop.with_kinds(jax.grad(loss)) (nor around jax.jit of the gradient); "
                "in a Problem, let compute_totals take the derivatives.")
        elif holds_calls(eqn):
            raise DistopError(
                f"distop cannot run a model whose `{name}` holds operator calls again with "
                "the sums over the ranks its kinds need (a Problem's model, or "
                "distop.with_kinds). Pass the replicated value through "
                "distop.RankLocal() where it meets data that varies between ranks, or "
                f"move the operator calls out of the `{name}`.")
        else:
            outs = bind_equation(eqn, values)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _afresh(eqn: Any, values: list[Any], subs: tuple[Plan, ...], total: Any) -> list[Any]:
    """An equation with bodies, emitted again through JAX's own constructs, its bodies
    as their plans say."""
    name, p = eqn.primitive.name, eqn.params

    def body(closed: Any, plan: Plan) -> Callable[..., list[Any]]:
        if isinstance(closed, ClosedJaxpr):
            return lambda *a: emit(closed.jaxpr, closed.consts, a, plan, total)
        return lambda *a: emit(closed, (), a, plan, total)

    if name in INLINED:
        return body(p.get("jaxpr", p.get("call_jaxpr")), subs[0])(*values)
    if name == "scan":
        n_consts, n_carry = scan_counts(p)
        consts = values[:n_consts]
        inner = body(p["jaxpr"], subs[0])

        def step(carry: Any, x: Any) -> tuple[Any, Any]:
            outs = inner(*consts, *carry, *x)
            return outs[:n_carry], outs[n_carry:]

        carry, ys = lax.scan(step, values[n_consts:n_consts + n_carry],
                             values[n_consts + n_carry:], length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
        return [*carry, *ys]
    if name == "cond":
        branches = [body(b, plan) for b, plan in zip(p["branches"], subs)]
        return list(lax.switch(values[0], [lambda *a, f=f: tuple(f(*a)) for f in branches],
                               *values[1:]))
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        test, step_fn = body(p["cond_jaxpr"], subs[0]), body(p["body_jaxpr"], subs[1])
        cond_consts, body_consts = values[:nc], values[nc:nc + nb]
        return list(lax.while_loop(lambda c: test(*cond_consts, *c)[0],
                                   lambda c: tuple(step_fn(*body_consts, *c)),
                                   tuple(values[nc + nb:])))
    # a checkpoint
    inner = body(p["jaxpr"], subs[0])
    return list(jax.checkpoint(lambda *a: tuple(inner(*a)), prevent_cse=p["prevent_cse"],
                               policy=p["policy"])(*values))
