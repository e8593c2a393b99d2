"""The lean host-call path: an XLA FFI target whose handler is a Python function.

A jitted program with an ordered JAX effect leaves JAX's fast dispatch path, and its
`io_callback`s go through JAX's Python callback machinery. Inside the programs a
`Problem` builds, distop can do without the effect: every ordered host call takes and
returns a float64 scalar *token*, threaded through the calls in program order (a data
dependency that XLA must respect), and the final token is a program output, so no call
is dropped. Each call site carries a unique `call_id` attribute, so XLA never merges two
calls. The handler answers XLA's metadata query, reports Python errors through the FFI
error API (an exception escaping a ctypes callback would read as success), and writes
results straight into XLA's output buffers. It reads XLA's structs through the mirror of
XLA's FFI C API in `_xla_ffi`, which registration checks against the running jaxlib.
"""

import ctypes as C
import itertools
import threading
from collections.abc import Iterable

import numpy as np

from .._compat import x64_enabled
from .._errors import DistopError
from . import xla_ffi as _xla_ffi
from .base import HostCallable
from .views import Slot
from .xla_ffi import (
    DTYPES,
    ERROR_CREATE_ARGS_SIZE,
    EXECUTE,
    INTERNAL,
    METADATA,
    Api,
    Buffer,
    CallFrame,
    ErrorCreateArgs,
    MetadataExtension,
    Scalar,
)

TARGET = "distop_host_call"
# call_id -> HostCall (FusedCall, RolledCall) of every live lean call site
_sites: dict[int, HostCallable] = {}
_ids = itertools.count(1)
_lock = threading.Lock()
_registered = False

_DATA = Buffer.data.offset
# call_id -> the _Plans of its arguments and results
_plans: dict[int, "_Plans"] = {}
class _Plans:
    """The slots of a call site's arguments and results, the token's left out (see
    `_handler`), each with its position, and the ctypes type of the token's value."""

    __slots__ = ("args", "rets", "token")

    def __init__(self, args: "C._Pointer[C.c_void_p]", n_args: int,
                 rets: "C._Pointer[C.c_void_p]", n_rets: int) -> None:
        self.args = [(i, Slot(args[i], False)) for i in range(1, n_args)]
        self.rets = [(i, Slot(rets[i], True)) for i in range(1, n_rets)]
        dtype = DTYPES[Buffer.from_address(args[0]).dtype]
        self.token = C.c_double if dtype is np.float64 else C.c_float


def _address(buffer: int) -> int | None:
    """**Returns:** the data address of the XLA buffer struct at `buffer`."""
    return C.c_void_p.from_address(buffer + _DATA).value


def _handler(frame_pointer: "C._Pointer[CallFrame]") -> int | None:
    frame = frame_pointer.contents
    try:
        extension = frame.extension_start
        if extension and extension.contents.type == METADATA:
            _answer(frame_pointer, extension)
            return None
        if frame.stage != EXECUTE:
            return None
        scalar = Scalar.from_address(frame.attrs.attrs[0])
        call_id = C.c_int64.from_address(scalar.value).value
        call = _sites[call_id]
        arg_values, ret_values = frame.args.values, frame.rets.values
        plans = _plans.get(call_id)
        if plans is None:
            plans = _plans[call_id] = _Plans(arg_values, frame.args.size,
                                             ret_values, frame.rets.size)
        # the token: how many calls ran before, plus one (read and written in place)
        token, before, after = plans.token, _address(arg_values[0]), _address(ret_values[0])
        assert before is not None and after is not None  # (a scalar has an address)
        token.from_address(after).value = token.from_address(before).value + 1
        # (the arguments' views are read-only, as JAX's own callbacks pass them: XLA may
        # pass a program input or a constant of the program, which a method must not change)
        args = [slot.view(_address(arg_values[i])) for i, slot in plans.args]
        rets = [slot.view(_address(ret_values[i])) for i, slot in plans.rets]
        gate = call.gate
        if gate is not None and gate.pending is not None:
            if gate.pending.ranks_disagree():
                # The ranks do not agree on this program: no method runs, on any rank
                # (each one's first call finds it out), and the results are zeros.
                for out in rets:
                    out[...] = 0
                return None
            gate.pending = None  # (agreed: the program's later calls need not ask)
        results = call(*args, out=rets)
        for out, result in zip(rets, results):
            if result is not out:
                # (numpy skips the copy when `result` is `out`'s memory: written in place)
                out[...] = result
        return None
    except BaseException as err:  # noqa: BLE001 - must become an FFI error, never escape
        api = C.cast(frame.api, C.POINTER(Api)).contents
        text = f"{type(err).__name__}: {err}".encode("utf-8", "backslashreplace")
        error = ErrorCreateArgs(ERROR_CREATE_ARGS_SIZE, None, text, INTERNAL)
        return api.error_create(C.byref(error))


_HANDLER = C.CFUNCTYPE(C.c_void_p, C.POINTER(CallFrame))(_handler)
# What XLA's metadata query found while `_register_target` registers the handler: the
# `_xla_ffi.Report` of an API that fits the mirror, a `DistopError` saying why it does
# not, or None before the query.
_found: _xla_ffi.Report | DistopError | None = None


def _answer(frame_pointer: "C._Pointer[CallFrame]",
            extension: "C._Pointer[_xla_ffi.ExtensionBase]") -> None:
    """Answer XLA's metadata query, once the C API that makes it is found to fit the
    mirror in `_xla_ffi`; XLA makes the query as it registers the handler.

    Where the API does not fit, no further field of the query is read or written and
    no XLA function is called, since either may lie elsewhere than the mirror says.
    The query stays unanswered, so XLA refuses the handler, and `_register_target`
    raises the `DistopError` left in `_found`.

    **Arguments:**

    - `frame_pointer`: the query's call frame.
    - `extension`: the frame's metadata extension.
    """
    global _found
    try:
        report = _xla_ffi.report(frame_pointer)
        problem = _xla_ffi.incompatibility(report)
        if problem is None:
            metadata = C.cast(extension, C.POINTER(MetadataExtension)).contents.metadata
            metadata.contents.api_version.major_version = _xla_ffi.MAJOR
            metadata.contents.api_version.minor_version = _xla_ffi.MINOR
            metadata.contents.traits = 0
            _found = report
        else:
            _found = _unavailable(report.version, problem)
    except BaseException as err:  # noqa: BLE001 - an escaping exception reads as success
        _found = _unavailable(None, f"checking it raised {type(err).__name__}: {err}")


def _unavailable(version: tuple[int, int] | None, problem: str) -> DistopError:
    """The error of a jaxlib whose FFI C API does not fit the mirror in `_xla_ffi`.

    **Arguments:**

    - `version`: the jaxlib's (major, minor) FFI API version, None where unknown.
    - `problem`: a clause saying what does not fit (`_xla_ffi.incompatibility`).

    **Returns:** the error, naming both versions and the fallback.
    """
    import jaxlib

    ours = f"{_xla_ffi.MAJOR}.{_xla_ffi.MINOR}"
    theirs = "an unknown version" if version is None else f"version {version[0]}.{version[1]}"
    return DistopError(
        f"Problem's lean path cannot use jaxlib {jaxlib.__version__}: distop mirrors "
        f"XLA's FFI C API version {ours} (xla/ffi/api/c_api.h), jaxlib "
        f"{jaxlib.__version__} has {theirs}, and {problem}. "
        "The lean path is unavailable with this jaxlib, since its host calls read "
        "XLA's structs through that mirror. "
        "Pass Problem(..., backend='io_callback') or set DISTOP_BACKEND=io_callback.")


def _register_target(name: str) -> _xla_ffi.Report:
    """Register the handler with XLA as the CPU FFI target `name`, checking on the way
    that the running jaxlib's FFI C API fits the mirror in `_xla_ffi`.

    The check runs in XLA's metadata query, the handler's first call, before any
    program runs: a mismatch is a `DistopError` here, on every rank alike, rather than
    a fallback to `io_callback` that would leave every program silently slower. The
    handler's calls that run programs do not check again.

    **Arguments:**

    - `name`: the target's name.

    **Returns:** what the metadata query read of the API version and struct sizes.

    **Raises:** `DistopError` where the API does not fit or could not be checked.
    """
    global _found
    import jax

    # XLA queries the metadata during registration only once the CPU backend exists;
    # before, the query would run inside the backend's creation, beyond our reach.
    jax.local_devices(backend="cpu")
    _found = None
    try:
        jax.ffi.register_ffi_target(
            name, jax.ffi.pycapsule(C.cast(_HANDLER, C.c_void_p).value), platform="cpu")
        refused = None
    except Exception as err:  # noqa: BLE001 - our own verdict, where there is one, says why
        refused = err
    found, _found = _found, None
    if isinstance(found, DistopError):
        raise found
    if refused is not None:
        raise refused
    if found is None:
        raise _unavailable(None, "XLA registered the handler without querying its "
                                 "metadata, where the check runs")
    return found


def register(call: HostCallable) -> int:
    """Give `call` (a lean `HostCall`, `FusedCall` or `RolledCall`, when lowered) a
    unique id for its call site; register the FFI target with XLA on first use (see
    `_register_target`).

    **Returns:** the id, passed to the target as the `call_id` attribute.
    """
    global _registered

    with _lock:
        if not _registered:
            _register_target(TARGET)
            _registered = True
        call_id = next(_ids)
        _sites[call_id] = call
    return call_id


def release(host_calls: Iterable[HostCallable]) -> None:
    """Forget the call sites of a program that is gone."""
    with _lock:
        for call in host_calls:
            if call.ffi_id is not None:  # (None: never lowered, so never registered)
                _sites.pop(call.ffi_id, None)
                _plans.pop(call.ffi_id, None)


# -- the token, threaded through the calls while a program is traced ----------------------
# Restart the count here: the token counts exactly up to 2**24 in 32-bit mode.
TOKEN_RESTART = 2 ** 20


def token_dtype() -> np.dtype:
    """The token's dtype: float64, or float32 where JAX is in 32-bit mode (a program
    takes no float64 input then)."""
    return np.dtype(np.float64 if x64_enabled() else np.float32)
