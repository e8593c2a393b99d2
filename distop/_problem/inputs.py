"""Inputs as distop keeps them: checked, converted, and in memory XLA reads in place."""

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._compat import x64_enabled


def as_input(where: str, value: Any, copy: bool | None = True) -> np.ndarray:
    """An input as distop keeps it: see `Problem`'s `copy` (True, None or False)."""
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        # immutable already: a read-only view of its memory, no copy (see `to_device`)
        try:
            host = np.asarray(value)
        except Exception as err:  # a deleted (or donated) array, say
            raise TypeError(f"{where}: could not read the JAX array: {err}") from err
        if host.flags.c_contiguous and _numeric(host.dtype) and not _narrows(host.dtype):
            return host  # (one JAX would narrow is refused below)
    if isinstance(value, np.ma.MaskedArray):  # (np.asarray would drop the mask)
        raise TypeError(f"{where}: got a masked array; pass an array of its values, "
                        "`a.filled(...)`, as JAX does.")
    try:
        array = np.asarray(value)
    except Exception as err:
        raise TypeError(f"{where}: could not make an array of a {type(value).__name__}.") from err
    if not _numeric(array.dtype):
        raise TypeError(f"{where}: got a {type(value).__name__} ({array.dtype}); expected a "
                        "numeric array or number.")
    narrow = _narrows(array.dtype)
    if narrow is not None:
        if isinstance(value, (np.ndarray, np.generic, jax.Array)):  # the caller's dtype
            raise TypeError(f"{where}: a {array.dtype} input, but JAX is in 32-bit mode "
                            f"and would silently make it {narrow}. Call "
                            "jax.config.update('jax_enable_x64', True) first, or pass "
                            f"{narrow}.")
        # a Python number or list: made in 32 bits, as JAX makes it
        narrowed = array.astype(narrow)
        if narrow.kind in "iu" and (narrowed != array).any():
            raise TypeError(f"{where}: {value!r} does not fit in {narrow}, JAX's "
                            "integers in 32-bit mode.")
        array = narrowed
    if copy is True or not isinstance(value, np.ndarray):
        return _aligned_copy(array)
    why = _copy_needed(array)
    if why is None:
        return array
    if copy is None:
        return _aligned_copy(array)
    raise ValueError(f"{where}: Problem(copy=False), but XLA cannot read this array in "
                     f"place ({why}), so it needs a copy. Make it with distop.empty, or "
                     "pass copy=None to copy such arrays.")


def _narrows(dtype: np.dtype) -> np.dtype | None:
    """**Returns:** the narrower dtype JAX would make of `dtype` (in its 32-bit mode),
    or None."""
    if x64_enabled():
        return None
    narrow = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    return narrow if narrow.itemsize < dtype.itemsize else None


def _numeric(dtype: np.dtype) -> bool:
    """Whether JAX takes arrays of `dtype` as numbers (bfloat16 and the other ml_dtypes
    floats included: numpy gives them kind 'V')."""
    return dtype.kind in "biufc" or (dtype.kind == "V" and not dtype.fields
                                     and jnp.issubdtype(dtype, jnp.inexact))


ALIGN = 64  # the alignment at which XLA's CPU client reads a host buffer in place


def empty(shape: Any, dtype: Any = float) -> np.ndarray:
    """A new, uninitialized numpy array that XLA can read in place.

    It is C-contiguous, at a 64-byte-aligned address; numpy's own are usually 16 bytes
    off it, and XLA copies those.
    With `Problem(..., copy=None)`, an input made here is shared, not copied.
    Fill it in place first: `out=` of numpy's functions, or `a[...] = ...`.

    **Arguments:**
    - `shape`: int or tuple of ints.
    - `dtype`: numpy dtype (default float64), in the machine's byte order.

    **Returns:** the array.

    **Raises:** `TypeError` for a dtype that is not numeric or a shape that is not an
    int or a tuple of ints; `ValueError` for negative dimensions.

    ```python
    import numpy as np

    import distop

    w = distop.empty((16, 1000))
    np.random.default_rng(0).standard_normal(out=w)
    assert w.ctypes.data % 64 == 0
    ```
    """
    dtype = np.dtype(dtype).newbyteorder("=")
    if not _numeric(dtype) or not dtype.itemsize:
        raise TypeError(f"distop.empty(dtype={dtype}): expected a numeric dtype.")
    try:
        shape = tuple(map(operator.index, [shape] if np.ndim(shape) == 0 else shape))
    except TypeError as err:
        raise TypeError(f"distop.empty(shape={shape!r}): expected an int or a tuple of "
                        "ints.") from err
    if any(n < 0 for n in shape):
        raise ValueError(f"distop.empty(shape={shape}): negative dimensions are not allowed.")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _copy_needed(array: np.ndarray) -> str | None:
    """**Returns:** why XLA would not read `array` in place (see `empty`), or None."""
    if not array.flags.c_contiguous:
        return "it is not C-contiguous"
    if not array.dtype.isnative:
        return "it is not in the machine's byte order"
    if array.size and array.ctypes.data % ALIGN:  # (an empty array has no memory)
        return f"its address is {array.ctypes.data % ALIGN} bytes off {ALIGN}-byte alignment"
    return None


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    """distop's own copy of an input (so that changing the caller's array later changes
    nothing here), made by `empty`: `DeviceCache` then hands it to the programs without a
    second copy. In the machine's byte order (JAX takes no other)."""
    out = empty(array.shape, array.dtype)
    out[...] = array
    return out


REUSES = 8  # calls with the same array before it is passed as a JAX array


class DeviceCache:
    """The point's arrays as a program takes them, remembered per input name.

    A new array goes as it is: XLA reads an aligned numpy array in place (see
    `_aligned_copy`). One passed `REUSES` times goes as a JAX array of it, made once: a
    program takes a JAX array faster than a numpy one, but making one costs more than a
    call, so only an array passed again and again repays it.
    """

    def __init__(self) -> None:
        self._seen: dict[str, list] = {}  # name -> [array, times passed, what is passed]

    def __call__(self, point: dict) -> dict:
        """**Returns:** the arrays of `point` (name -> array) as the program takes them."""
        cache = self._seen
        out = {}
        for k, v in point.items():
            found = cache.get(k)
            if found is None or found[0] is not v:
                found = cache[k] = [v, 0, v]
            found[1] += 1
            if found[1] == REUSES:
                found[2] = to_device(v)
            out[k] = found[2]
        return out


def to_device(array: np.ndarray) -> jax.Array:
    """A JAX array of `array`, sharing its memory where XLA can (aligned, see
    `_aligned_copy`), else a copy. Uncommitted to a device, as a numpy argument is:
    JAX compiles a program once per mix of committed and uncommitted arguments (one
    from DLPack is committed)."""
    return jax.device_put(array)
