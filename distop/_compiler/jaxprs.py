"""Helpers on traced programs that several passes share, and the walks through the
programs nested inside an equation (a loop's body, a branch's cases, a checkpoint)."""

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    jaxpr_as_fun,
)

from .._compat import scan_consts
from .._hostcalls.base import HostCallable

CHECKPOINTS = ("checkpoint", "remat", "remat2")  # jax.checkpoint's primitive, by version


def is_lean(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a lean host call (one link of the token chain)."""
    return getattr(eqn.params.get("call"), "lean", False)


def has_lean(eqn: JaxprEqn) -> bool:
    """Whether a lean call sits inside `eqn` (a loop, branch or call of its own)."""
    return anywhere(inner_eqns(eqn), is_lean)


def anywhere(eqns: Iterable[JaxprEqn], test: Callable[[JaxprEqn], bool]) -> bool:
    """Whether `test(eqn)` holds for one of `eqns` or an equation inside one of them."""
    return any(test(e) or anywhere(inner_eqns(e), test) for e in eqns)


def inner_eqns(eqn: JaxprEqn) -> Iterator[JaxprEqn]:
    """The equations of the programs inside `eqn` (a loop's body, a branch's cases)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner: Any = getattr(sub, "jaxpr", sub)  # (a Jaxpr, ClosedJaxpr, or else)
            if hasattr(inner, "eqns"):
                yield from inner.eqns


def chained(closed_jaxpr: ClosedJaxpr) -> bool:
    """Whether the lean calls of a traced program form ONE unbroken token chain.

    The chain starts at the program's first input, passes every lean call in program
    order (each takes the previous one's token) and ends at the program's last output.
    A loop, branch or checkpoint with lean calls inside is a link of the chain where the
    token was threaded through it (see `link`). Then XLA must run the calls one at a
    time, in that order, and keep every one. Anything else (a loop whose calls the token
    does not reach, a token that skipped a call) fails.
    """
    jaxpr = closed_jaxpr.jaxpr
    token = jaxpr.invars[0]
    for eqn in jaxpr.eqns:
        if is_lean(eqn):
            if eqn.invars[0] is not token:
                return False
            token = eqn.outvars[0]
        elif has_lean(eqn):
            slots = link(eqn)
            if slots is None or eqn.invars[slots[0]] is not token:
                return False
            token = eqn.outvars[slots[1]]
    return jaxpr.outvars[-1] is token


def link(eqn: JaxprEqn) -> tuple[int, int] | None:
    """Where a loop, branch or checkpoint takes and gives the token once it is threaded
    through (see `_compiler/stages/nested.py`): the token is its first carried value (a scan, a
    while loop), its first operand after the index (a branch) or its first argument (a
    checkpoint), and its first result.

    **Returns:** (argument position, result position), or None for any other equation.
    """
    name = eqn.primitive.name
    if name == "scan":
        return scan_consts(eqn.params), 0
    if name == "while":
        return eqn.params["cond_nconsts"] + eqn.params["body_nconsts"], 0
    if name == "cond":
        return 1, 0
    if name in CHECKPOINTS:
        return 0, 0
    return None


def variables(atoms: Iterable[Var | Literal]) -> list[Var]:
    """**Returns:** the variables among `atoms` (literals left out)."""
    return [v for v in atoms if isinstance(v, Var)]


def shaped(atom: Var | Literal) -> Any:
    """**Returns:** `atom`'s abstract value: a `ShapedArray` (`shape`, `dtype`, `ndim`) in
    the programs the passes rewrite, which JAX declares as any `AbstractValue`."""
    return atom.aval


def positions(jaxpr: Jaxpr) -> dict[int, int]:
    """**Returns:** equation index -> chain position (counted from 0) of the lean calls."""
    return {i: p for p, i in enumerate(i for i, e in enumerate(jaxpr.eqns) if is_lean(e))}


def other_effects(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` has effects besides its lean calls, whose order a reordering of
    the program could change."""
    return any(eqn.effects and not is_lean(eqn) for eqn in jaxpr.eqns)


def chain_token(eqn: JaxprEqn) -> Var:
    """**Returns:** the token a lean call reads (its first argument)."""
    token = eqn.invars[0]
    assert isinstance(token, Var)  # the chain starts at a program input: no literal
    return token


def lean_calls(jaxpr: Jaxpr) -> tuple[HostCallable, ...]:
    """**Returns:** the lean host calls at the top level of `jaxpr`, in program order."""
    return tuple(eqn.params["call"] for eqn in jaxpr.eqns if is_lean(eqn))


@dataclasses.dataclass(frozen=True)
class Piece:
    """A stretch of a program's equations as a function of its own.

    Fields: `inputs` (the variables it reads from before it), `outputs` (those it makes
    that are read after it), `fn` (flat inputs -> flat outputs), `token` and `token_out`
    (the token its first lean call reads, its last one makes; None without host calls).
    """

    inputs: list[Var]
    outputs: list[Var]
    fn: Callable[..., list[Any]]
    token: Var | None
    token_out: Var | None


def pieces(jaxpr: Jaxpr, bounds: Sequence[int]) -> list[Piece]:
    """**Returns:** the `Piece` of each stretch `jaxpr.eqns[a:b]` between two neighbours
    of `bounds`, in program order."""
    needed, found = set(variables(jaxpr.outvars)), []
    for start, stop in reversed(list(itertools.pairwise(bounds))):
        found.append(_piece(jaxpr.eqns[start:stop], needed))
        for eqn in jaxpr.eqns[start:stop]:
            needed.update(variables(eqn.invars))
    return found[::-1]


def _piece(eqns: Sequence[JaxprEqn], needed: set[Var]) -> Piece:
    """**Returns:** the `Piece` of `eqns`; `needed` holds the variables read after them."""
    defined: set[Var] = set()
    inputs: list[Var] = []
    seen: set[Var] = set()
    for eqn in eqns:
        for v in variables(eqn.invars):
            if v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)
        defined.update(eqn.outvars)
    outputs = [v for eqn in eqns for v in eqn.outvars if v in needed]
    token = next((chain_token(eqn) for eqn in eqns if is_lean(eqn)), None)
    token_out = next((eqn.outvars[0] for eqn in reversed(eqns) if is_lean(eqn)), None)
    info = DebugInfo("distop segment", "distop_segment", ("",) * len(inputs),
                     ("",) * len(outputs))
    fn = jaxpr_as_fun(ClosedJaxpr(Jaxpr([], inputs, outputs, list(eqns), debug_info=info),
                                  []))
    return Piece(inputs, outputs, fn, token, token_out)

