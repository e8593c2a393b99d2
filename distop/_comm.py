"""Private communicators: distop's own duplicates of the user's, and the checking mode's
agreement on each."""

import threading
from typing import Any

from ._runtime import SingleProcess, mpi, wait_for_peers_at_exit, world
from ._safety import Checker, watchdog

_keyval = None  # the MPI attribute key of private duplicates (see `private`)
_lock = threading.Lock()
_checkers: dict[int, Checker] = {}  # Fortran handle of a private communicator -> its Checker


def private(comm: Any) -> Any:
    """A duplicate of `comm` reserved for distop, created once per communicator.

    `Dup` is collective, so callers reach this at the same point of the program on every
    rank (at trace or construction time, never lazily inside a callback).

    **Arguments:**
    - `comm`: an `mpi4py` communicator, or None for `MPI.COMM_WORLD`.

    **Returns:** the private duplicate.
    """
    comm = world() if comm is None else comm
    if isinstance(comm, SingleProcess):
        return comm
    global _keyval
    with _lock:
        # Kept as an MPI attribute of `comm`, not by its handle: MPI reuses the handle of
        # a freed communicator for a new one, which must get its own duplicate.
        if _keyval is None:
            _keyval = mpi().Comm.Create_keyval()
        dup = comm.Get_attr(_keyval)
        if dup is None:
            # (a rank that left before making a Problem leaves the others waiting here)
            with watchdog.watch("Problem: duplicating the communicator for distop"):
                dup = comm.Dup()
            comm.Set_attr(_keyval, dup)
            dup.Set_attr(_keyval, dup)  # a private duplicate of a duplicate is itself
            wait_for_peers_at_exit(dup)
    return dup


def checker(comm: Any) -> Checker:
    """The checking mode's `Checker` of a private communicator.

    It agrees on a further duplicate of its own, created at trace time (like `private`).

    **Arguments:**
    - `comm`: a private communicator (from `private`).

    **Returns:** its `Checker`, the same one on every call.
    """
    key = comm.py2f()
    with _lock:
        found = _checkers.get(key)
        if found is None:
            found = _checkers[key] = Checker(comm.Dup())
    return found
