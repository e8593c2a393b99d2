"""The checks of what a host call's method returns, and of the collectives it issued,
with the messages that say what it returned and what was expected.

`HostCall._check` passes the common case (one array of the right shape) itself; every
other result comes here.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import OperatorError


def check_results(call: Any, result: Any, batch: tuple[int, ...],
                  row: tuple[int, ...] | None = None) -> tuple[np.ndarray, ...]:
    """Check what a method returned against what its call expects.

    **Arguments:**
    - `call`: the `HostCall` whose method returned it.
    - `result`: what the method returned.
    - `batch`: the batch axes each result leads with.
    - `row`: the batch row the method ran on, for messages (None: the whole batch).

    **Returns:** the results as C-contiguous numpy arrays, in the call's order.
    """
    n = call.n_user_results
    if n == 1 and isinstance(result, list):
        where, what = _describe(call, row)
        raise OperatorError(call.say(
            f"returned a list{where}; return its one {what} as a numpy array "
            "(np.asarray(...)), or a tuple of one array"))
    if not isinstance(result, (tuple, list)):
        result = (result,) if n == 1 else result
    if not isinstance(result, (tuple, list)) or len(result) != n:
        where, what = _describe(call, row)
        got = (f"a {type(result).__name__} of length {len(result)}"
               if isinstance(result, (tuple, list)) else type(result).__name__)
        raise OperatorError(call.say(
            f"returned {got}{where}; expected {n} {what}s as a tuple, one per "
            + ("input" if call.phase in ("vjp", "hvp") else "output")))
    return tuple(_checked(call, result[k], k, shape, dtype, batch, row)
                 for k, shape, dtype in call.spec.expected_results)


def _checked(call: Any, r: Any, k: int, shape: tuple[int, ...], dtype: Any,
             batch: tuple[int, ...], row: tuple[int, ...] | None) -> np.ndarray:
    """**Returns:** the method's result `k`, `r`, as a C-contiguous numpy array, checked
    against its expected `shape` (after `batch`) and `dtype` (see `check_results`)."""
    if type(r) is not np.ndarray or not r.flags.c_contiguous:
        if r is None:
            where, what = _describe(call, row)
            raise OperatorError(call.say(
                f"returned None for {what} {k}{where}; " + (
                    "return an array" if call.phase == "forward"
                    else f"return zeros for a zero {what}")))
        r = np.asarray(r, order="C")
    if r.shape != batch + shape or r.dtype != dtype:
        where, what = _describe(call, row)
        raise OperatorError(call.say(
            f"returned {what} {k}{where} with shape {r.shape} and dtype "
            f"{r.dtype}; expected shape {batch + shape} and dtype {dtype}"
            + (" (a leading batch axis, as batched_" + call.phase + " = True)"
               if batch else "") + _expected_from(call)))
    return r


def _expected_from(call: Any) -> str:
    """**Returns:** where the expected shapes come from and where the method is, for
    the message of a result of the wrong shape (the traceback holds only distop's
    frames: the method has returned)."""
    name = type(call.op).__name__
    if call.phase == "forward":
        told = (f". The expected shapes come from {name}.output_spec (by default: "
                "the first input's shape and dtype); define output_spec(self, "
                "*input_specs) returning the outputs' jax.ShapeDtypeStruct where "
                "they differ")
    else:
        told = (f". A {call.phase} returns one array per "
                + ("input, shaped as that input" if call.phase == "vjp"
                   else "output, shaped as that output"))
    code = getattr(call.function, "__code__", None)
    place = ("" if code is None else
             f" ({call.where} is at {code.co_filename}:{code.co_firstlineno})")
    return told + place


def _describe(call: Any, row: tuple[int, ...] | None) -> tuple[str, str]:
    """**Returns:** (where in the batch, what the results are), for messages."""
    return ("" if row is None else f" (batch row {row})",
            {"vjp": "input cotangent", "hvp": "input cotangent",
             "jvp": "output tangent"}.get(call.phase, "output"))


def check_declared(call: Any, issued: Sequence[str]) -> None:
    """Check that a method issued only the collectives its operator declares.

    **Arguments:**
    - `call`: the `HostCall` whose method ran.
    - `issued`: the names of the MPI calls it issued (checking mode).
    """
    # mpi4py's lower-case methods are the same collectives on Python objects.
    declared = {name.lower() for name in call.declared}
    undeclared = sorted({name for name in issued if name.lower() not in declared})
    if undeclared:
        raise OperatorError(call.say(
            f"issued {undeclared}, not declared in {call.label}_collectives="
            f"{call.declared}; declare every collective the method issues"))
