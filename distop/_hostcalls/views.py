"""Numpy views of XLA's buffers, as the FFI handler (`ffi`) gives them to methods: each
made on the buffer's exact bytes, read-only for arguments, a large result's buffer
advised to use huge pages first, and the view of a call site's last buffer kept."""

import ctypes as C
import sys
from collections.abc import Callable

import numpy as np

from .xla_ffi import DTYPES, Buffer

# The process's memory from `_BASE` on (below it nothing is ever mapped) as two
# memoryviews, read-only and writeable: nothing is read or allocated. `Slot.view`
# makes its numpy view on a slice of one, the buffer's exact bytes (read-only for
# arguments, so a method cannot make them writeable): faster than a view through a
# ctypes array (see docs/performance.md). The view's `.base` is that slice, no more.
_BASE = 4096
_memory = C.pythonapi.PyMemoryView_FromMemory
_memory.restype, _memory.argtypes = C.py_object, [C.c_void_p, C.c_ssize_t, C.c_int]
_SPACE = {writeable: _memory(_BASE, sys.maxsize - _BASE, 0x200 if writeable else 0x100)
          for writeable in (False, True)}  # (PyBUF_WRITE, PyBUF_READ)


def _huge_pages() -> Callable[[int, int], None] | None:
    """**Returns:** a function `advise(address, nbytes)` asking Linux to back the whole
    2 MiB pages of that range with huge pages, or None where it cannot (not Linux, or
    transparent huge pages off)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        madvise = C.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [C.c_void_p, C.c_size_t, C.c_int], C.c_int

    def advise(address: int, nbytes: int) -> None:
        start = -(-address // _HUGE) * _HUGE
        stop = (address + nbytes) // _HUGE * _HUGE
        if stop > start:
            madvise(start, stop - start, _MADV_HUGEPAGE)  # (a refusal changes nothing)

    return advise


_HUGE, _MADV_HUGEPAGE = 2 << 20, 14
# Results of at least this many bytes get huge pages, as numpy asks for its own arrays
# of 4 MiB and more: XLA allocates a result's buffer afresh on most calls, and an
# Allreduce into a large buffer of small pages is slower (page faults, TLB misses) than
# into a numpy array (see docs/performance.md).
_ADVISED = 4 << 20
_advise = _huge_pages()


class Slot:
    """One argument or result of a call site: its dtype and shape (fixed per call site),
    and whether a method may write to it. A call gets a numpy view of XLA's buffer (and
    a large result's buffer huge pages, see `_ADVISED`); the view of the buffer the
    previous call got is kept, since XLA passes the same buffers on every step of a
    loop."""

    __slots__ = ("advise", "dtype", "kept", "nbytes", "shape", "size", "space")

    def __init__(self, address: int, writeable: bool) -> None:
        b = Buffer.from_address(address)
        self.shape = tuple(b.dims[i] for i in range(b.rank))
        self.dtype = np.dtype(DTYPES[b.dtype])
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.space = _SPACE[writeable]
        self.advise = _advise if writeable and self.nbytes >= _ADVISED else None
        # (the last view made and its buffer's address, set as one pair: a call of the
        # site in another thread finds either the old pair or the new one)
        self.kept: tuple[int | None, np.ndarray] = (-1, np.empty(0))

    def view(self, data: int | None) -> np.ndarray:
        address, last = self.kept
        if data == address and last.shape == self.shape and last.dtype == self.dtype:
            # (XLA passes a loop's buffers again and again; a method that reshaped its
            # view in place gets a new one)
            return last
        if not self.size:
            return np.zeros(self.shape, self.dtype)
        assert data is not None  # (XLA's buffer of a nonempty value has an address)
        if self.advise is not None:
            self.advise(data, self.nbytes)
        start = data - _BASE
        made = np.ndarray(self.shape, self.dtype, self.space[start:start + self.nbytes])
        self.kept = (data, made)
        return made
