"""Which dtypes distop differentiates, as JAX decides: a leaf module, importing nothing
of the package."""

import functools
from typing import Any

import jax.numpy as jnp


def inexact_spec(spec: Any) -> bool:
    """Whether values of an array spec are differentiable (see `inexact_dtype`).

    **Arguments:**
    - `spec`: anything with a `dtype` (a `jax.ShapeDtypeStruct`, an array).

    **Returns:** True for floating-point and complex dtypes.
    """
    return inexact_dtype(spec.dtype)


@functools.cache
def inexact_dtype(dtype: Any) -> bool:
    """Whether values of `dtype` are differentiable, as JAX decides: floating point and
    complex, including bfloat16 and the other ml_dtypes (which numpy's own
    `issubdtype(..., np.inexact)` does not count)."""
    return bool(jnp.issubdtype(dtype, jnp.inexact))
