"""MPI access: lazy import, private duplicated communicators, small agreement helpers."""

import threading

import numpy as np

from ._errors import MPIUnavailableError

_private = {}
_lock = threading.Lock()


def mpi():
    """Import `mpi4py.MPI`, or raise a clear error saying what to install.

    **Returns:** the `mpi4py.MPI` module.
    """
    try:
        from mpi4py import MPI
    except ImportError as err:  # mpi4py missing, or it found no libmpi
        raise MPIUnavailableError(
            f"distop needs an MPI library but mpi4py could not load one ({err}). "
            "Install one with `pip install 'distop[mpich]'` (the mpich wheel, which also "
            "brings mpiexec), or point mpi4py at your cluster's MPI (module load mpi)."
        ) from err
    return MPI


def world():
    """**Returns:** `MPI.COMM_WORLD`."""
    return mpi().COMM_WORLD


def private(comm):
    """A duplicate of `comm` reserved for distop, created once per communicator.

    `Dup` is collective, so callers reach this at the same point of the program on every
    rank (at trace or construction time, never lazily inside a callback).

    **Arguments:**
    - `comm`: an `mpi4py` communicator, or None for `MPI.COMM_WORLD`.

    **Returns:** the private duplicate.
    """
    comm = world() if comm is None else comm
    key = comm.py2f()
    with _lock:
        dup = _private.get(key)
        if dup is None:
            dup = _private[key] = comm.Dup()
            # A private duplicate of a duplicate is itself.
            _private[dup.py2f()] = dup
    return dup


def all_equal(comm, value):
    """Whether an integer is the same on every rank (one small Allreduce).

    **Arguments:**
    - `comm`: the communicator.
    - `value`: an integer that fits in int64.

    **Returns:** True on every rank if all ranks passed the same value, else False on
    every rank.
    """
    if comm.Get_size() == 1:
        return True
    buf = np.array([value, -value], dtype=np.int64)
    out = np.empty_like(buf)
    comm.Allreduce(buf, out, op=mpi().MAX)
    return out[0] == -out[1]
