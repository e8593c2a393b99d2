"""Kinds of values across ranks (`Kind`), the kinds operators declare, and `vary`: the
identity whose transpose sums a cotangent over the ranks.

A value is replicated (one value, held alike by every rank) or varying (each rank holds
its own: a rank-local value or a block of a distributed one). Where a replicated value
meets varying data on its way to a result, each rank's cotangent of it is that rank's
share only; `vary` marks that place, and its transpose adds the shares up.
"""

import contextvars
import enum
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .._compat import ShapedArray


class Kind(enum.StrEnum):
    """How a value is held across ranks.

    - `REPLICATED` (`"replicated"`): one value, the same on every rank; its cotangent is
      one cotangent, the same on every rank.
    - `VARYING` (`"varying"`): each rank holds its own value (rank-local data, or a
      block of a distributed array); each rank's cotangent is its own.
    """

    REPLICATED = "replicated"
    VARYING = "varying"


def declared(op: Any, which: str, count: int) -> tuple[Kind | None, ...]:
    """The kinds an operator declares for its inputs or outputs.

    **Arguments:**
    - `op`: the operator.
    - `which`: `"input"` or `"output"`.
    - `count`: how many inputs or outputs the call has.

    **Returns:** one `Kind`, or None where undeclared, per input or output.

    **Raises:** `TypeError` naming the operator for a declaration of the wrong length
    or an unknown kind.
    """
    found = getattr(type(op), f"{which}_kinds", None)
    if found is None:
        return (None,) * count
    several = isinstance(found, (tuple, list))
    kinds = tuple(found) if several else (found,) * count
    if len(kinds) != count:
        raise TypeError(f"{type(op).__name__}.{which}_kinds declares {len(kinds)} kinds; "
                        f"this call has {count} {which}s.")
    try:
        return tuple(None if k is None else Kind(k) for k in kinds)
    except ValueError as err:
        raise TypeError(f"{type(op).__name__}.{which}_kinds = {found!r}: each kind is "
                        "'replicated', 'varying' or None.") from err


def takes_blocks(op: Any) -> bool:
    """Whether `op` combines the ranks' own blocks, so that copies of one value on every
    rank give another result than one copy would (a sum of P copies, a halo of a rank's
    own rows).

    A built-in collective says so in its `_blocks_in`; an operator of the user's does
    where it declares every input varying and every output replicated and its forward
    communicates (a reduction over the ranks).
    """
    found = getattr(op, "_blocks_in", None)
    if found is not None:
        return bool(found)
    inputs = getattr(type(op), "input_kinds", None)
    outputs = getattr(type(op), "output_kinds", None)

    def every(kinds: Any, kind: Kind) -> bool:
        many = kinds if isinstance(kinds, (tuple, list)) else (kinds,)
        return all(k is not None and Kind(k) is kind for k in many)

    return (inputs is not None and outputs is not None and every(inputs, Kind.VARYING)
            and every(outputs, Kind.REPLICATED)
            and bool(getattr(op, "forward_collectives", ())))


# Whether the function traced now goes through kind inference (`with_kinds`, or a
# Problem's model): differentiating a collective outside it warns once (see `primitive`).
inferring: contextvars.ContextVar[bool] = contextvars.ContextVar("distop_inferring",
                                                                 default=False)


# -- vary ------------------------------------------------------------------------------
# The identity from a replicated value to a varying one. Its JVP is itself (the tangent
# of a replicated value is the same on every rank); its transpose sums the cotangent over
# the ranks with the operator in its `total` parameter (one Allreduce). It lowers to
# nothing.
vary_p = Primitive("distop_vary")


def vary(x: Any, total: Any) -> Any:
    """**Returns:** `x`, seen as varying: its cotangent is summed over the ranks by
    `total` (an operator whose forward is that sum)."""
    return vary_p.bind(x, total=total)


def _abstract(x: ShapedArray, *, total: Any) -> ShapedArray:
    return x


def _transpose(cotangent: Any, x: Any, *, total: Any) -> list[Any]:
    return [total(cotangent)]


vary_p.def_impl(lambda x, *, total: x)
vary_p.def_abstract_eval(_abstract)
ad.deflinear2(vary_p, _transpose)
batching.defvectorized(vary_p)
mlir.register_lowering(vary_p, lambda ctx, x, *, total: [x])
