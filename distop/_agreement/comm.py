"""Private communicators: distop's own duplicates of the user's, what distop keeps per
duplicate, and the checking mode's agreement on each.

A duplicate lives exactly as long as the user's communicator it was made from: distop
frees it (and its checking-mode duplicate) when the user frees that communicator. Why
then and not when the last Problem on it is collected: `MPI_Comm_free` is collective,
so every rank must free a duplicate at the same point of the program. The user's
`comm.Free()` is such a point (it is collective too), and MPI calls distop there, through
the delete callback of the attribute that links the two. The garbage collector is not:
each process collects its Problems at moments of its own, so counting them could decide
to free on one rank and not yet on another. MPICH and Open MPI happen to free a
communicator without communicating, but the MPI standard lets a library synchronize
there, and no collective point of the duplicate's ranks is known to come after its last
Problem is collected. So the duplicates distop holds number at most the user's live
communicators (two each with the watchdog's channel, three in checking mode).
"""

import threading
from typing import Any

from .._errors import DistopError
from .._mpi.runtime import SingleProcess, at_finalize, attach, mpi, world
from .._safety.checking import Checker
from .._safety.watchdog import watchdog

_keyval = None  # the MPI attribute key linking a communicator to its `_Duplicate`
_lock = threading.RLock()  # (reentrant: MPI may call `_deleted` while it is held)
_live: dict[int, "_Duplicate"] = {}  # id of each live private duplicate -> its record
_finalizing = False  # MPI_Finalize has begun: it frees every communicator itself


class _Duplicate:
    """A private duplicate, its checking-mode `Checker`, its ranks in reverse order, and
    the values distop keeps for it (`PerCommunicator`), which go with it when it is
    freed."""

    __slots__ = ("channel", "checker", "comm", "freed", "internal", "owner", "reversed",
                 "values")

    def __init__(self, comm: Any, owner: "_Duplicate | None" = None) -> None:
        self.comm = comm
        self.internal: Any = None  # distop's own duplicate of it (see `internal`)
        self.owner = owner  # for an internal duplicate: the private one's record
        self.checker: Checker | None = None
        self.reversed: Any = None  # its ranks in reverse order (see `reversed_ranks`)
        self.channel: Any = None  # the watchdog's channel among its ranks
        self.values: dict = {}
        self.freed = False


# Without MPI, the one process's stand-in needs no duplicate; its values live here.
_single = _Duplicate(SingleProcess())


def private(comm: Any) -> Any:
    """A duplicate of `comm` reserved for distop, created once per communicator.

    `Dup` is collective, so callers reach this at the same point of the program on every
    rank (at trace or construction time, never lazily inside a callback). The duplicate
    is freed when `comm` is: free `comm` only after the last use of the Problems and
    operators made on it.

    **Arguments:**
    - `comm`: an `mpi4py` communicator, or None for `MPI.COMM_WORLD`.

    **Returns:** the private duplicate.

    **Raises:** `DistopError` if `comm` is `MPI.COMM_NULL` (freed, say).
    """
    comm = world() if comm is None else comm
    if isinstance(comm, SingleProcess):
        return comm
    if comm == mpi().COMM_NULL:
        raise DistopError(
            "distop got MPI.COMM_NULL as a communicator: a communicator that was freed, "
            "or one this rank is not a member of. Pass a communicator that is still in "
            "use, and free it only after the last use of the Problems and operators "
            "made on it.")
    with _lock:
        # Kept as an MPI attribute of `comm`, not by its handle: MPI reuses the handle of
        # a freed communicator for a new one, which must get its own duplicate.
        found = comm.Get_attr(_key())
        if found is not None and not found.freed:
            return found.comm
        # (a rank that left before making a Problem leaves the others waiting here)
        with watchdog.watch("Problem: duplicating the communicator for distop"):
            dup = comm.Dup()
        made = _live[id(dup)] = _Duplicate(dup)
        comm.Set_attr(_key(), made)
        dup.Set_attr(_key(), made)  # a private duplicate of a duplicate is itself
        attach(dup)
        made.channel = watchdog.attach(dup)
    return dup


def internal(comm: Any) -> Any:
    """The communicator of distop's own messages among `comm`'s ranks: a further
    duplicate of its private one, made once, which no method ever receives.

    A Problem's agreement, its checks and its gathers run on it, so that a collective a
    method makes on one rank only can never meet distop's own (the ranks then wait in
    different places, and the watchdog says where). It is a private duplicate in its own
    right (its values, checker and freeing as `private`'s), freed with `comm`'s.
    Collective at first use, as `private`.

    **Arguments:**
    - `comm`: an `mpi4py` communicator, or None for `MPI.COMM_WORLD`.

    **Returns:** the internal duplicate.
    """
    dup = private(comm)
    if isinstance(dup, SingleProcess):
        return dup
    with _lock:
        made = _record(dup)
        if made.internal is None:
            with watchdog.watch("Problem: duplicating the communicator for distop"):
                inner = dup.Dup()
            record = _live[id(inner)] = _Duplicate(inner, owner=made)
            inner.Set_attr(_key(), record)
            attach(inner)
            made.internal = inner
        return made.internal


def checker(comm: Any) -> Checker:
    """The checking mode's `Checker` of a private communicator.

    It agrees on a further duplicate of its own, created at trace time (like `private`),
    and freed with the private communicator. An internal duplicate (see `internal`) has
    its private one's: a program's checks and its methods' checks are one sequence.

    **Arguments:**
    - `comm`: a private communicator (from `private`), or its internal duplicate.

    **Returns:** its `Checker`, the same one on every call.
    """
    with _lock:
        made = _record(comm)
        made = made.owner or made
        if made.checker is None:
            made.checker = Checker(comm.Dup())
    return made.checker


def reversed_ranks(comm: Any) -> Any:
    """A communicator of a private communicator's ranks in reverse order, on which a
    prefix reduction is a suffix reduction of `comm`'s ranks.

    It is made at first use (`Split`, collective: every rank reaches its first use at
    the same collective of the same method), kept, and freed with `comm`.

    **Arguments:**
    - `comm`: a private communicator (from `private`).

    **Returns:** the reversed communicator, the same one on every call.
    """
    with _lock:
        made = _record(comm)
        if made.reversed is None:
            made.reversed = comm.Split(0, comm.Get_size() - 1 - comm.Get_rank())
    return made.reversed


def live_duplicates() -> int:
    """**Returns:** how many communicators distop holds for private use now: each private
    duplicate, its watchdog channel's, its checking-mode duplicate and its reversed
    ranks (the runtime's own, made once, is not counted)."""
    with _lock:
        return sum(1 + (d.checker is not None) + (d.channel is not None)
                   + (d.reversed is not None) for d in _live.values())  # (internal: its own)


class PerCommunicator:
    """A table of one value per private communicator, kept with its duplicate.

    A freed duplicate takes its values with it: MPI gives a later communicator the freed
    one's handle, and that communicator must start afresh (a table keyed by handles
    would hand it the old values, which may differ between ranks).
    """

    def _values(self, comm: Any) -> dict:
        """**Returns:** the dict holding this table's value for `comm` (under `self`)."""
        return _record(comm).values

    def get(self, comm: Any, default: Any = None) -> Any:
        """**Returns:** the value for `comm`, or `default` if it has none."""
        return self._values(comm).get(self, default)

    def setdefault(self, comm: Any, default: Any) -> Any:
        """**Returns:** the value for `comm`, set to `default` first if it has none."""
        return self._values(comm).setdefault(self, default)

    def __getitem__(self, comm: Any) -> Any:
        return self._values(comm)[self]

    def __setitem__(self, comm: Any, value: Any) -> None:
        self._values(comm)[self] = value


def check_live(comm: Any) -> None:
    """Check that `comm` (a private communicator) was not freed with the user's.

    **Raises:** `DistopError` if it was, saying so."""
    _record(comm)


def _record(comm: Any) -> _Duplicate:
    """**Returns:** the record of a private communicator (or of the single-process
    stand-in, which needs no duplicate). **Raises:** `DistopError` if it was freed."""
    made = _live.get(id(comm))
    if made is not None and made.comm is comm:
        return made
    if isinstance(comm, SingleProcess):
        return _single
    raise DistopError(
        "this Problem's communicator was freed (`comm.Free()`), and distop's duplicate "
        "of it with it, so the Problem cannot run any more. Free a communicator only "
        "after the last use of the Problems and operators made on it.")


def _key() -> int:
    """**Returns:** the attribute key, created at first use with its delete callback."""
    global _keyval
    if _keyval is None:
        _keyval = mpi().Comm.Create_keyval(delete_fn=_deleted)
        at_finalize(_stop_freeing)
    return _keyval


def _deleted(comm: Any, keyval: int, made: _Duplicate) -> None:
    """MPI's delete callback of the attribute: `comm` is being freed (or its attribute
    replaced). Freeing the user's communicator frees its private duplicate."""
    with _lock:
        if made.freed:  # (the duplicate's own attribute, as distop frees it)
            return
        if comm.py2f() == made.comm.py2f():
            _forget(made)  # the user freed the duplicate itself: MPI frees it now
        elif not _finalizing:
            _forget(made)
            made.comm.Free()


def _forget(made: _Duplicate) -> None:
    """Mark a duplicate freed, drop what distop kept for it and free its checker's."""
    made.freed = True
    _live.pop(id(made.comm), None)
    made.values.clear()
    if made.checker is not None and not _finalizing:
        made.checker.comm.Free()
    if made.reversed is not None and not _finalizing:
        made.reversed.Free()
    if made.internal is not None and not _finalizing:
        made.internal.Free()  # (its own record goes with it: see `_deleted`)
    if made.channel is not None and not _finalizing:
        watchdog.detach(made.channel)


def _stop_freeing() -> None:
    """From the start of `MPI_Finalize` on, MPI frees every communicator itself: the
    delete callbacks it then runs must not free any."""
    global _finalizing
    _finalizing = True



def most(comm: Any, vector: Any) -> Any:
    """**Returns:** the elementwise maximum of an int64 numpy `vector` over the ranks of
    `comm` (every rank passes one of the same length): one Allreduce, none on one rank.
    Values alike everywhere are found by sending `h` and `-h` (alike where
    max h == -max -h).

    A vector at least as long as the largest power of two not above the number of
    ranks, yet short, travels as one element of a contiguous datatype, reduced by an
    operation of distop's own: MPI picks a reduction's algorithm by its count, and
    MPICH, for one, reduces such a count in two phases (a reduce-scatter, then an
    allgather), twice the steps of the recursive doubling it takes for a smaller one.
    A smaller count goes as it is, reduced by MPI's own maximum: the operation of
    distop's own runs Python at every step of the reduction."""
    import numpy as np

    ranks = comm.Get_size()
    if ranks == 1:
        return vector
    vector = np.ascontiguousarray(vector, np.int64)
    found = np.empty_like(vector)
    if vector.size < 1 << (ranks.bit_length() - 1) or vector.size > _SHORT:
        comm.Allreduce(vector, found, op=mpi().MAX)
    else:
        kind = _packed(vector.size)
        comm.Allreduce([vector, 1, kind], [found, 1, kind], op=_elementwise_max())
    return found


_SHORT = 32  # the longest vector `most` sends as one element
_kinds: dict[int, Any] = {}  # length -> its committed contiguous datatype of int64
_maximum: Any = None  # the elementwise maximum of int64 vectors, as an MPI operation


def _packed(length: int) -> Any:
    """**Returns:** the committed MPI datatype of `length` contiguous int64s, made once
    per length."""
    kind = _kinds.get(length)
    if kind is None:
        kind = _kinds[length] = mpi().INT64_T.Create_contiguous(length).Commit()
    return kind


def _elementwise_max() -> Any:
    """**Returns:** the MPI operation taking the elementwise maximum of the int64s of
    the elements it is handed, made once."""
    global _maximum
    if _maximum is None:
        _maximum = mpi().Op.Create(_maximum_into, commute=True)
    return _maximum


def _maximum_into(incoming: Any, inout: Any, kind: Any) -> None:
    """The body of `_elementwise_max`: `inout` becomes the elementwise maximum of both
    buffers. (A short loop over memoryviews costs less than numpy's call here.)"""
    mine, theirs = memoryview(inout).cast("B").cast("q"), memoryview(incoming).cast("B").cast("q")
    for i, value in enumerate(theirs):
        if value > mine[i]:
            mine[i] = value
