"""Shims over JAX versions: every one names what lets it go."""

import jax

# jax.errors.JaxRuntimeError is the public name of XLA's runtime error since jax 0.4.36;
# older releases only expose jaxlib's XlaRuntimeError. Drop when the minimum passes 0.4.36.
JaxRuntimeError = getattr(jax.errors, "JaxRuntimeError", None)
if JaxRuntimeError is None:  # pragma: no cover
    from jaxlib.xla_extension import XlaRuntimeError as JaxRuntimeError  # noqa: F401


def x64_enabled():
    """**Returns:** whether 64-bit JAX types are on (`jax_enable_x64`)."""
    return bool(jax.config.read("jax_enable_x64"))


# The effect JAX's ordered io_callback carries, declared by distop's host-call primitive
# so that its lowering may issue ordered callbacks. No public name as of jax 0.10.2.
from jax._src.callback import _OrderedIOEffect as ORDERED_IO_EFFECT  # noqa: E402, F401
from jax._src.core import ShapedArray, no_effects  # noqa: E402, F401
