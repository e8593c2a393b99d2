"""`check_totals(method="cs")`'s complex step as operators see it: while its program is
traced (`complex_step`), an operator given complex values must declare that it takes
them and must return complex outputs."""

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._agreement import comm as _comm
from .._dtypes import inexact_spec
from .._errors import DistopError

# Whether the program being traced is check_totals' complex step: every operator
# given complex values then must declare that it takes them.
_complex_step: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "distop_complex_step", default=False)


@contextlib.contextmanager
def complex_step(on: bool) -> Iterator[None]:
    """Trace, within, the program of `check_totals(method="cs")` (if `on`): an operator
    given complex values must declare `complex_step = True`."""
    token = _complex_step.set(on)
    try:
        yield
    finally:
        _complex_step.reset(token)


def _refused(op: Any, why: str) -> str:
    rank = _comm.private(op.comm).Get_rank()
    method = getattr(type(op), "phase_labels", {}).get("forward", "forward")
    return (f"check_totals(method='cs'): {type(op).__name__}.{method} on rank {rank} (and "
            f"every rank alike): {why}. Declare complex_step = True in the class if its "
            f"{method} computes the same formulas on complex values (and returns complex "
            "outputs for them), or check with method='fd'.")


def stepped(op: Any, arrays: Sequence[Any]) -> bool:
    """**Returns:** whether `op` is called inside the complex step on complex values.

    **Raises:** `DistopError` naming the operator where it does not take them."""
    if not (_complex_step.get() and any(jnp.iscomplexobj(a) for a in arrays)):
        return False
    if not type(op).takes_complex_step(op):
        method = getattr(type(op), "phase_labels", {}).get("forward", "forward")
        raise DistopError(_refused(op, f"its {method} would get complex inputs, which it "
                                   "does not take (" + (
            "takes_complex_step() is False with these fields" if type(op).complex_step
            else "it does not declare complex_step = True") + ")"))
    return True


def check_outputs(op: Any, out_specs: Sequence[jax.ShapeDtypeStruct]) -> None:
    """**Raises:** `DistopError` where a complex step's call would return a real output,
    which drops the imaginary part."""
    if any(inexact_spec(s) and not jnp.issubdtype(s.dtype, jnp.complexfloating)
           for s in out_specs):
        raise DistopError(_refused(op, "its output_spec gives a real output for complex "
                                   "inputs, which drops the imaginary part"))
