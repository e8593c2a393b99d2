"""A derivative of an operator's derivative, refused where it is evaluated, not traced.

JAX differentiates everything a function traces, also what it then throws away:
`jax.grad(lambda x: jax.value_and_grad(f)(x)[0])` traces the derivative of the inner
gradient and discards it. So the rules of an operator's derivative calls do not raise
when asked for their own derivatives; they return tangents made by one primitive,
`distop_second_derivative`, which raises `SecondDerivativeError` when a value of it is
computed (outside jit) or lowered (in a jitted program, where JAX has already removed
what no output reads). Its transpose is the same primitive again, and a zero cotangent
stays a zero, so a discarded second derivative never reaches either.
"""

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .._compat import ShapedArray
from .._errors import SecondDerivativeError

second_derivative_p = Primitive("distop_second_derivative")
second_derivative_p.multiple_results = True


def refused(message: str, operands: Sequence[Any], avals: Sequence[ShapedArray]) -> list[Any]:
    """Values of shapes `avals` that raise `SecondDerivativeError(message)` when
    evaluated.

    **Arguments:**
    - `message`: the error's message, naming the operator's call.
    - `operands`: the tangents they are derived from (not zeros), which keep them in the
      linear part of a derivative, where nothing reads them unless needed.
    - `avals`: their shapes and dtypes.

    **Returns:** one value per aval.
    """
    return second_derivative_p.bind(*operands, message=message, avals=tuple(avals))


def _abstract_eval(*operands: Any, message: str, avals: tuple[ShapedArray, ...],
                   ) -> list[ShapedArray]:
    return list(avals)


def _raise(*operands: Any, message: str, avals: tuple[ShapedArray, ...]) -> Any:
    raise SecondDerivativeError(message)


def _lower(ctx: Any, *operands: Any, message: str, avals: tuple[ShapedArray, ...]) -> Any:
    raise SecondDerivativeError(message)


def _jvp(primals: Sequence[Any], tangents: Sequence[Any], *, message: str,
         avals: tuple[ShapedArray, ...]) -> tuple[list[Any], list[Any]]:
    linear = [ad.instantiate_zeros(t) for t in tangents]
    return (second_derivative_p.bind(*primals, message=message, avals=avals),
            second_derivative_p.bind(*linear, message=message, avals=avals))


def _transpose(cts: Sequence[Any], *operands: Any, message: str,
               avals: tuple[ShapedArray, ...]) -> list[Any]:
    undefined = [x for x in operands if ad.is_undefined_primal(x)]
    if all(type(ct) is ad.Zero for ct in cts) or not undefined:
        return [None] * len(operands)
    found = iter(second_derivative_p.bind(
        *(ad.instantiate_zeros(ct) for ct in cts), message=message,
        avals=tuple(x.aval for x in undefined)))
    return [next(found) if ad.is_undefined_primal(x) else None for x in operands]


def _batch(operands: Sequence[Any], dims: Sequence[int | None], *, message: str,
           avals: tuple[ShapedArray, ...]) -> tuple[list[Any], list[int]]:
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    batched = tuple(ShapedArray((size, *a.shape), a.dtype) for a in avals)
    outs = second_derivative_p.bind(*operands, message=message, avals=batched)
    return outs, [0] * len(outs)


second_derivative_p.def_abstract_eval(_abstract_eval)
second_derivative_p.def_impl(_raise)
mlir.register_lowering(second_derivative_p, _lower)
ad.primitive_jvps[second_derivative_p] = _jvp
ad.primitive_transposes[second_derivative_p] = _transpose
batching.primitive_batchers[second_derivative_p] = _batch
