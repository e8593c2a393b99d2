"""Segments: a long chain of host calls cut into pieces, each the taken branch of a
`lax.cond`, so that XLA's compile time grows linearly in the number of calls.

XLA's CPU runtime orders a program's operations by comparing each one with every
earlier one when it builds the executable, so a flat program of thousands of host calls
compiles in time that grows with their square (docs/architecture.md, "Segments"). A
long chain is therefore cut into segments of `SEGMENT` host calls, each run as the taken
branch of a `lax.cond` on the token (`token >= 0`, always true, unknown to XLA, so the
branch is kept): every branch is a small program of its own. The token still runs
through every call in order; the other branch would return a NaN token, which the
count of calls checked after every run would catch. This is the last step of the final
stage (see pipeline.py), after the loops: each loop is a segment of its own.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Literal, Var

from ..jaxprs import has_lean, is_lean, pieces, shaped

SEGMENT = 64  # host calls per segment of a long chain


def segmented(closed_jaxpr: ClosedJaxpr,
              size: int | None = None) -> Callable[..., list[Any]] | None:
    """A function evaluating `closed_jaxpr` (flat arguments, flat results) with its chain
    cut into segments of `size` (default `SEGMENT`) host calls, each the taken branch of
    a conditional; None if the chain has at most `size` calls."""
    size = size or SEGMENT
    jaxpr = closed_jaxpr.jaxpr
    eqns = jaxpr.eqns
    bounds, count = [0], 0
    for i, eqn in enumerate(eqns):
        if is_lean(eqn):
            count += 1
            if count % size == 0:
                bounds.append(i + 1)
        elif has_lean(eqn):
            # a loop (see loops.py) is a piece of its own, run as it is: every other
            # piece then starts with a call whose token comes from before the piece
            bounds.extend([i, i + 1][bounds[-1] == i:])
    if count <= size:
        return None
    if bounds[-1] != len(eqns):
        bounds.append(len(eqns))
    found = pieces(jaxpr, bounds)

    def run(*args: jax.Array) -> list[jax.Array]:
        env = dict(zip(jaxpr.constvars, closed_jaxpr.consts))
        env.update(zip(jaxpr.invars, args))
        for piece in found:
            values = [env[v] for v in piece.inputs]
            if piece.token is None:  # no host call in this piece
                results = piece.fn(*values)
            else:
                results = lax.cond(env[piece.token] >= 0, piece.fn,
                                   _not_taken(piece.outputs, piece.token_out), *values)
            env.update(zip(piece.outputs, results))
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    return run


def _not_taken(outputs: Sequence[Var],
               token_out: Var | None) -> Callable[..., list[jax.Array]]:
    """The branch never taken: zeros, and a NaN token that fails the count of calls."""
    def branch(*_: jax.Array) -> list[jax.Array]:
        return [jnp.full(shaped(v).shape, jnp.nan if v is token_out else 0, shaped(v).dtype)
                for v in outputs]
    return branch
