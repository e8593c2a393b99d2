"""The checking mode: before each collective, every rank agrees that all issue the same.

It acts on `DISTOP_CHECK_COLLECTIVES` (`_config.settings.check_collectives`). Every
check is a collective of its own, watched by the watchdog like any other wait.
"""

import numpy as np

from .._errors import CollectiveMismatchError
from .._mpi.names import COLLECTIVES, VARIABLE
from .watchdog import WatchedComm, watchdog


class Checker:
    """Cross-rank agreement on what every rank is about to do, on a communicator of its
    own. Every exchange is an allgather of one small description per rank, so a rank that
    is elsewhere (another collective, another operator, the end of its program) shows up
    as a differing description and every rank raises the same error."""

    def __init__(self, comm):
        self.comm = comm
        self.sequence = 0

    def check_same(self, what):
        """Exchange `what` (a tuple describing the next step) with every rank.

        **Raises:** `CollectiveMismatchError` on every rank if any rank differs.
        """
        self.sequence += 1
        mine = (self.sequence,) + tuple(what)
        with watchdog.watch(f"the checking mode's check of {_say(mine)}"):
            every = self.comm.allgather(mine)
        if all(_same(e, mine) for e in every):
            return
        lines = ["Detected mismatch between collectives on ranks:"]
        for rank, e in enumerate(every):
            lines.append(f"  Rank {rank} is running {_say(e)}")
        failed = [(r, e) for r, e in enumerate(every) if len(e) > 2 and e[1] == "failed"]
        if failed:
            lines.append("Cause: " + "; ".join(
                f"rank {r} failed in {e[2]}" for r, e in failed)
                + ": its error, raised there with the method's traceback, is the one to "
                "read; the other ranks stop here.")
        else:
            lines.append("Likely cause: control flow that depends on the rank (lax.cond, "
                         "while_loop, Python code in an operator), an operator whose "
                         "collectives depend on rank-local data, or a failure on the ranks "
                         "named above.")
        raise CollectiveMismatchError("\n".join(lines))


def _same(a, b):
    # Variable-count collectives may differ in count between ranks; nothing else may.
    if len(a) != len(b):
        return False
    if len(a) >= 5 and a[3] == b[3] and a[3] in VARIABLE:
        return a[:4] == b[:4] and a[5:] == b[5:]
    return a == b


def _say(e):
    seq, *rest = e
    if rest and rest[0] == "collective":
        _, where, name, count, dtype = rest
        return (f"collective #{seq}: {name} in {where} (count {count}, dtype {dtype})")
    return f"step #{seq}: " + " ".join(map(str, rest))


def _describe_buffer(args):
    if not args:
        return None, None
    buf = args[0]
    if isinstance(buf, (list, tuple)) and buf and isinstance(buf[0], np.ndarray):
        buf = buf[0]
    if isinstance(buf, np.ndarray):
        return int(buf.size), buf.dtype.str
    return None, type(buf).__name__


class CheckedComm:
    """A communicator wrapper for user code in checking mode: before each collective,
    all ranks agree on (sequence, operator and phase, collective, count, dtype); it also
    records the collectives issued, to compare with the declared ones. It wraps a
    `WatchedComm` (made here if `comm` is not one), so that the watchdog sees the
    method's MPI calls as waits."""

    def __init__(self, comm, checker, where):
        if not isinstance(comm, WatchedComm):
            comm = WatchedComm(comm, where)
        self._comm, self._checker, self._where = comm, checker, where
        self.issued = []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in COLLECTIVES:
            return attr

        def collective(*args, **kwargs):
            count, dtype = _describe_buffer(args)
            self._checker.check_same(("collective", self._where, name, count, dtype))
            self.issued.append(name)
            return attr(*args, **kwargs)

        return collective
