"""A ctypes mirror of XLA's FFI C API, as far as distop's lean host call needs it.

The mirror follows the header `xla/ffi/api/c_api.h` at FFI API version 0.3
(`XLA_FFI_API_MAJOR` 0, `XLA_FFI_API_MINOR` 3), the version jaxlib 0.10.2 reports in
its `XLA_FFI_Api_Version`. Each struct names its header struct in its docstring and
holds the header's fields in the header's order, up to the last one distop uses or one
past it (`CallFrame.future`, `Metadata.state_type_id`); `Api` holds only the first of
XLA's functions, the one distop calls.

The header states its compatibility rule: a new major version may rearrange or delete
fields, while a new minor version only adds them, after the fields an older one knew.
So a running jaxlib can be called through this mirror when its major version equals
`MAJOR` and its minor version is at least `MINOR`. XLA also puts the size of each
struct in its first field, `struct_size`: the header's `XLA_FFI_STRUCT_SIZE`, up to the
end of the field the header names as the struct's last (no trailing padding, and for
the call frame not `future`), which is what `SIZES` holds for the mirror. `report`
reads what a call frame says of both, and `incompatibility` compares it with the
mirror. `_ffi` does so once, in XLA's metadata query as it registers the handler.
"""

import ctypes as C
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

MAJOR, MINOR = 0, 3

DTYPES = {1: np.bool_, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint8,
          7: np.uint16, 8: np.uint32, 9: np.uint64, 10: np.float16, 11: np.float32,
          12: np.float64, 15: np.complex64, 16: jnp.bfloat16, 18: np.complex128}
"""`XLA_FFI_DataType` -> the numpy dtype of a buffer's elements."""
EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
METADATA = 1  # XLA_FFI_Extension_Metadata
INTERNAL = 13  # XLA_FFI_Error_Code_INTERNAL


class ExtensionBase(C.Structure):
    """`XLA_FFI_Extension_Base`: the head of every extension in a chain."""

    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.c_void_p)]


class ApiVersion(C.Structure):
    """`XLA_FFI_Api_Version`: the API version, of XLA or of what a handler expects."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("major_version", C.c_int), ("minor_version", C.c_int)]


class Metadata(C.Structure):
    """`XLA_FFI_Metadata`: a handler's answer to XLA's metadata query."""

    _fields_ = [("struct_size", C.c_size_t), ("api_version", ApiVersion),
                ("traits", C.c_uint32), ("state_type_id", C.c_int64)]


class MetadataExtension(C.Structure):
    """`XLA_FFI_Metadata_Extension`: the extension that makes a call a metadata query."""

    _fields_ = [("extension_base", ExtensionBase), ("metadata", C.POINTER(Metadata))]


class Buffer(C.Structure):
    """`XLA_FFI_Buffer`: one argument or result of a call."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("dtype", C.c_int), ("data", C.c_void_p), ("rank", C.c_int64),
                ("dims", C.POINTER(C.c_int64))]


class Values(C.Structure):
    """`XLA_FFI_Args` and `XLA_FFI_Rets`, which share one layout (`values` is the
    header's `args` or `rets`)."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)),
                ("values", C.POINTER(C.c_void_p))]


class Scalar(C.Structure):
    """`XLA_FFI_Scalar`: a scalar attribute, such as a call site's `call_id`."""

    _fields_ = [("dtype", C.c_int), ("value", C.c_void_p)]


class Attrs(C.Structure):
    """`XLA_FFI_Attrs`: a call's attributes, sorted by name."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("size", C.c_int64), ("types", C.POINTER(C.c_int)),
                ("names", C.c_void_p), ("attrs", C.POINTER(C.c_void_p))]


class CallFrame(C.Structure):
    """`XLA_FFI_CallFrame`: everything XLA passes to a handler on one call."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.POINTER(ExtensionBase)),
                ("api", C.c_void_p), ("ctx", C.c_void_p), ("stage", C.c_int),
                ("args", Values), ("rets", Values), ("attrs", Attrs),
                ("future", C.c_void_p)]


class ErrorCreateArgs(C.Structure):
    """`XLA_FFI_Error_Create_Args`: what `Api.error_create` takes."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("message", C.c_char_p), ("errc", C.c_int)]


class Api(C.Structure):
    """`XLA_FFI_Api`: XLA's table of API functions, of which distop calls only the first."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("api_version", ApiVersion), ("internal_api", C.c_void_p),
                ("error_create", C.CFUNCTYPE(C.c_void_p, C.POINTER(ErrorCreateArgs)))]


def struct_size(struct: type[C.Structure], last_field: str) -> int:
    """The header's `XLA_FFI_STRUCT_SIZE` of a mirrored struct.

    **Arguments:**

    - `struct`: a struct of this mirror.
    - `last_field`: the field the header's `XLA_FFI_DEFINE_STRUCT_TRAITS` names for it.

    **Returns:** the bytes up to the end of that field.
    """
    field = getattr(struct, last_field)
    return field.offset + field.size


ERROR_CREATE_ARGS_SIZE = struct_size(ErrorCreateArgs, "errc")
SIZES = {"XLA_FFI_Api": struct_size(Api, "error_create"),
         "XLA_FFI_Api_Version": struct_size(ApiVersion, "minor_version"),
         "XLA_FFI_CallFrame": struct_size(CallFrame, "attrs"),
         "XLA_FFI_Args": struct_size(Values, "values"),
         "XLA_FFI_Rets": struct_size(Values, "values"),
         "XLA_FFI_Attrs": struct_size(Attrs, "attrs"),
         "XLA_FFI_Metadata_Extension": struct_size(MetadataExtension, "metadata"),
         "XLA_FFI_Metadata": struct_size(Metadata, "traits")}
"""The size of each struct XLA reports, as the mirror lays it out.

`XLA_FFI_Api` is the mirror's prefix of the table, up to the one function it calls.
"""
EMBEDDED = frozenset({"XLA_FFI_Api_Version", "XLA_FFI_Args", "XLA_FFI_Rets",
                      "XLA_FFI_Attrs"})
"""The structs held by value inside another: a larger one would move the fields after it."""


class Report(NamedTuple):
    """What a call frame says of the API that made it.

    - `version`: XLA's (major, minor) API version, or None where the frame or the
      API table is too small to hold it.
    - `sizes`: the `struct_size` XLA reports for each struct read so far, by the
      header's name of the struct.
    """

    version: tuple[int, int] | None
    sizes: dict[str, int]


def report(frame_pointer: "C._Pointer[CallFrame]") -> Report:
    """Read the API version and the struct sizes from a call frame of XLA's.

    Each read happens only once what came before vouches for it: the frame's size for
    the API pointer, the API's size for its version, a compatible version for
    everything else, the frame's size for the structs it holds.

    **Arguments:**

    - `frame_pointer`: the call frame XLA passed to the handler.

    **Returns:** a `Report`, with only the sizes it was safe to read.
    """
    frame = frame_pointer.contents
    sizes = {"XLA_FFI_CallFrame": frame.struct_size}
    if sizes["XLA_FFI_CallFrame"] < struct_size(CallFrame, "api"):
        return Report(None, sizes)
    api = C.cast(frame.api, C.POINTER(Api)).contents
    sizes["XLA_FFI_Api"] = api.struct_size
    if sizes["XLA_FFI_Api"] < struct_size(Api, "api_version"):
        return Report(None, sizes)
    version = (api.api_version.major_version, api.api_version.minor_version)
    if not _compatible(version):
        return Report(version, sizes)
    sizes["XLA_FFI_Api_Version"] = api.api_version.struct_size
    if sizes["XLA_FFI_CallFrame"] >= SIZES["XLA_FFI_CallFrame"]:
        sizes["XLA_FFI_Args"] = frame.args.struct_size
        sizes["XLA_FFI_Rets"] = frame.rets.struct_size
        sizes["XLA_FFI_Attrs"] = frame.attrs.struct_size
    extension = frame.extension_start
    if extension and extension.contents.type == METADATA:
        sizes["XLA_FFI_Metadata_Extension"] = extension.contents.struct_size
        if sizes["XLA_FFI_Metadata_Extension"] >= SIZES["XLA_FFI_Metadata_Extension"]:
            metadata = C.cast(extension, C.POINTER(MetadataExtension)).contents.metadata
            if metadata:
                sizes["XLA_FFI_Metadata"] = metadata.contents.struct_size
    return Report(version, sizes)


def _compatible(version: tuple[int, int]) -> bool:
    return version[0] == MAJOR and version[1] >= MINOR


def incompatibility(found: Report) -> str | None:
    """What makes a call frame's API unfit for this mirror.

    **Arguments:**

    - `found`: what `report` read from the frame.

    **Returns:** one clause saying what differs (the version, else the first struct
    whose size does not fit), or None where the mirror fits.
    """
    if found.version is None:
        return (f"its call frame ({found.sizes['XLA_FFI_CallFrame']} bytes) or API table "
                f"({found.sizes.get('XLA_FFI_Api', 0)} bytes) is too small to hold the "
                "API version")
    if not _compatible(found.version):
        return (f"the mirror needs major version {MAJOR} and minor version {MINOR} or "
                "later")
    for name, ours in SIZES.items():
        theirs = found.sizes.get(name)
        if theirs is None:
            if name.startswith("XLA_FFI_Metadata"):
                continue  # (only a metadata query carries these)
            return f"XLA did not report the size of {name}"
        if name in EMBEDDED and theirs != ours:
            return (f"its {name} is {theirs} bytes, where the mirror's is {ours}, and "
                    "a struct held inside another must match its mirror exactly")
        if theirs < ours:
            return f"its {name} is {theirs} bytes, smaller than the mirror's {ours}"
    return None
