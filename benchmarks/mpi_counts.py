"""Counting the MPI calls of a Problem: which are distop's own, which its operators'.

`CountingComm(MPI.COMM_WORLD)` is a communicator that records every call of its
communicating methods, and of those of every communicator duplicated from it (mpi4py's
`Dup` keeps the class): distop's private communicators, its watchdog's channel and its
operators'. Hand it to a `Problem` and to its operators as `comm=`.
A call is the operator's where it is made inside an operator's method (a frame of the
stack is a method of a `DistributedOperator` or `ImplicitOperator`), else distop's own.
Calls of other threads than the main one (the watchdog's) are counted apart.

Bytes are those a rank receives: the receive buffer of a collective or a receive, the
pickled result of a lower-case (pickling) collective.
"""

import dataclasses
import pickle
import sys
import threading
from typing import Any

import jax
import numpy as np
from mpi4py import MPI

import distop
from distop._mpi.names import COMMUNICATING, MAKERS

_ROOTED = {"Bcast", "Reduce", "Gather", "Gatherv"}  # (only the root, or the others, receive)


@dataclasses.dataclass
class Record:
    """One MPI call: whose (`own` or `operator`), which method, bytes received, peers
    of a point-to-point call, and whether it ran on the main thread."""

    whose: str
    method: str
    received: int
    peer: int | None
    main: bool


LOG: list[Record] = []


def _nbytes(spec: Any) -> int:
    """**Returns:** the bytes of an mpi4py buffer specification (an array, or a list
    whose first item is one)."""
    if isinstance(spec, (list, tuple)):
        spec = spec[0] if spec else None
    if spec is None or spec is MPI.IN_PLACE:
        return 0
    try:
        return memoryview(spec).nbytes
    except TypeError:
        return int(np.asarray(spec).nbytes)


def _whose() -> str:
    """**Returns:** `operator` where the stack holds an operator's method, else `own`."""
    operators = (distop.DistributedOperator, distop.ImplicitOperator)
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, operators) and not frame.f_code.co_name.startswith("_"):
            return "operator"
        frame = frame.f_back
    return "own"


def _received(comm: Any, name: str, args: tuple, kwargs: dict, result: Any) -> int:
    """**Returns:** the bytes this rank receives in the call `name(*args, **kwargs)`."""
    if name[0].islower():  # pickled Python objects: what came back
        if name in ("send", "isend", "barrier") or result is None:
            return 0
        return len(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    if name in ("Barrier", "Send", "Ssend", "Isend", "Issend", "Bsend", "Rsend"):
        return 0
    if name in ("Recv", "Irecv"):
        return _nbytes(args[0] if args else kwargs.get("buf"))
    if name == "Sendrecv":
        return _nbytes(args[3] if len(args) > 3 else kwargs.get("recvbuf"))
    if name == "Bcast":
        root = args[1] if len(args) > 1 else kwargs.get("root", 0)
        return 0 if comm.Get_rank() == root else _nbytes(args[0])
    if name in _ROOTED:
        root = args[3 if name == "Reduce" else 2] if len(args) > (3 if name == "Reduce" else 2) \
            else kwargs.get("root", 0)
        return _nbytes(args[1]) if comm.Get_rank() == root else 0
    if len(args) > 1:
        return _nbytes(args[1])
    return _nbytes(kwargs.get("recvbuf"))


def _peer(name: str, args: tuple, kwargs: dict) -> int | None:
    """**Returns:** the peer of a point-to-point call, else None."""
    if name in ("Send", "Isend", "Ssend", "Issend", "Bsend", "Rsend", "send", "isend"):
        return args[1] if len(args) > 1 else kwargs.get("dest")
    if name in ("Recv", "Irecv", "recv", "irecv"):
        return args[1] if len(args) > 1 else kwargs.get("source")
    if name == "Sendrecv":
        return args[1] if len(args) > 1 else kwargs.get("dest")
    return None


def _counted(name: str) -> Any:
    base = getattr(MPI.Intracomm, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = base(self, *args, **kwargs)
        LOG.append(Record(_whose(), name, _received(self, name, args, kwargs, result),
                          _peer(name, args, kwargs),
                          threading.current_thread() is threading.main_thread()))
        return result

    method.__name__ = name
    return method


class CountingComm(MPI.Intracomm):
    """An intra-communicator that records its communicating calls in `LOG`."""


for _name in sorted(COMMUNICATING - MAKERS):
    if hasattr(MPI.Intracomm, _name):
        setattr(CountingComm, _name, _counted(_name))


@dataclasses.dataclass
class Tally:
    """What one stretch of code did: per `whose`, the calls (by method) and bytes."""

    calls: dict[str, dict[str, int]]
    received: dict[str, int]
    peers: set

    def count(self, whose: str) -> int:
        return sum(self.calls.get(whose, {}).values())


class counting:
    """`with counting() as tally:` fills `tally` with the main thread's calls inside."""

    def __enter__(self) -> Tally:
        self.start = len(LOG)
        self.tally = Tally({}, {}, set())
        return self.tally

    def __exit__(self, *exc: Any) -> None:
        for record in LOG[self.start:]:
            if not record.main:
                continue
            calls = self.tally.calls.setdefault(record.whose, {})
            calls[record.method] = calls.get(record.method, 0) + 1
            self.tally.received[record.whose] = (self.tally.received.get(record.whose, 0)
                                                 + record.received)
            if record.peer is not None:
                self.tally.peers.add(record.peer)


class Matvec(distop.DistributedOperator):
    """y = (A_0 + ... + A_(P-1)) x, as in the README: one Allreduce per forward and per
    (batched) VJP, the operator both scale.py and the tests count."""

    A: np.ndarray
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)
    batched_vjp = True

    def output_spec(self, x: Any) -> Any:
        return jax.ShapeDtypeStruct((self.A.shape[0],), x.dtype)

    def forward(self, comm: Any, x: np.ndarray) -> np.ndarray:
        y = np.empty(self.A.shape[0])
        comm.Allreduce(self.A @ x, y, op=MPI.SUM)
        return y

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray) -> np.ndarray:
        x_bar = np.empty(y_bar.shape[:-1] + (self.A.shape[1],))
        comm.Allreduce(np.ascontiguousarray(y_bar @ self.A), x_bar, op=MPI.SUM)
        return x_bar
