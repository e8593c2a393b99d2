"""Run-time safety: the watchdog that bounds every wait, and the checking mode that
verifies across ranks, before each collective, that all ranks issue the same one.

Both act on the settings of `_config` (`DISTOP_WATCHDOG`, `DISTOP_CHECK_COLLECTIVES`).
"""

import threading
import time

import numpy as np

# `env_flag` stays importable from here, for code written before `_config` held it.
from ._config import env_flag, settings  # noqa: F401
from ._errors import CollectiveMismatchError
from ._runtime import abort, world

# MPI methods that communicate with every rank of the communicator.
COLLECTIVES = frozenset(
    "Allreduce allreduce Allgather allgather Allgatherv Alltoall alltoall Alltoallv "
    "Alltoallw Bcast bcast Reduce reduce Gather gather Gatherv Scatter scatter Scatterv "
    "Barrier barrier Reduce_scatter Reduce_scatter_block Scan scan Exscan exscan".split())
# Collectives whose counts may legitimately differ between ranks.
VARIABLE = frozenset("Allgatherv Alltoallv Alltoallw Gatherv Scatterv allgather gather "
                     "scatter alltoall bcast reduce allreduce scan exscan".split())


# -- the watchdog ---------------------------------------------------------------------
class Watchdog:
    """Aborts the job when one distop step waits longer than `settings.watchdog`.

    A stuck rank cannot be told anything by its peers, and MPI gives no timeout on a
    blocking collective: a background thread notices instead, prints where this rank
    stands, and calls MPI_Abort, which ends every rank.
    """

    def __init__(self):
        self._active = {}
        self._lock = threading.Lock()
        self._thread = None

    def watch(self, where):
        """A context manager marking this thread as in step `where` (a description)."""
        return _Watch(self, where)

    def note(self, where):
        """Update this thread's description (e.g. the collective it is about to issue)."""
        key = threading.get_ident()
        found = self._active.get(key)
        if found is not None:
            self._active[key] = (where, found[1])

    # Entering and leaving run on every host call: a dict entry of this thread's own,
    # set and removed without a lock (each a single operation under the GIL, as is the
    # watchdog thread's copy of the values).
    def _enter(self, where):
        if settings.watchdog <= 0:
            return
        self._active[threading.get_ident()] = (where, time.monotonic())
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run,
                                                    name="distop-watchdog", daemon=True)
                    self._thread.start()

    def _leave(self):
        self._active.pop(threading.get_ident(), None)

    def _run(self):
        while True:
            time.sleep(max(0.05, min(1.0, settings.watchdog / 20)))
            now = time.monotonic()
            stuck = [(w, now - t) for w, t in list(self._active.values())
                     if settings.watchdog > 0 and now - t > settings.watchdog]
            if stuck:
                self._abort(stuck)

    @staticmethod
    def _abort(stuck):
        comm = world()
        # (the checking mode names a rank whose schedule differs only while that rank
        # still takes part in the checks: not one that left, or that waits elsewhere)
        hint = ("the checking mode is on, and that rank answers no check" if
                settings.check_collectives else "DISTOP_CHECK_COLLECTIVES=1 names it")
        abort(comm, "".join(
            f"distop watchdog: rank {comm.Get_rank()} of {comm.Get_size()} has waited "
            f"{waited:.0f} s in {where} (limit DISTOP_WATCHDOG={settings.watchdog:g} s). "
            "Another rank is elsewhere: it failed, exited, or runs a different "
            f"schedule (rank-dependent control flow; {hint}). Aborting the job.\n"
            for where, waited in stuck))


class _Watch:
    def __init__(self, dog, where):
        self.dog, self.where = dog, where

    def __enter__(self):
        self.dog._enter(self.where)

    def __exit__(self, *exc):
        self.dog._leave()


watchdog = Watchdog()


# -- the checking mode ----------------------------------------------------------------
class Checker:
    """Cross-rank agreement on what every rank is about to do, on a communicator of its
    own. Every exchange is an allgather of one small description per rank, so a rank that
    is elsewhere (another collective, another operator, the end of its program) shows up
    as a differing description and every rank raises the same error."""

    def __init__(self, comm):
        self.comm = comm
        self.sequence = 0

    def agree(self, what):
        """Exchange `what` (a tuple describing the next step) with every rank.

        **Raises:** `CollectiveMismatchError` on every rank if any rank differs.
        """
        self.sequence += 1
        mine = (self.sequence,) + tuple(what)
        every = self.comm.allgather(mine)
        if all(_same(e, mine) for e in every):
            return
        lines = ["Detected mismatch between collectives on ranks:"]
        for rank, e in enumerate(every):
            lines.append(f"  Rank {rank} is running {_say(e)}")
        lines.append("Likely cause: control flow that depends on the rank (lax.cond, "
                     "while_loop, Python code in an operator), an operator whose collectives "
                     "depend on rank-local data, or a failure on the ranks named above.")
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
    records the collectives issued, to compare with the declared ones."""

    def __init__(self, comm, checker, where):
        self._comm, self._checker, self._where = comm, checker, where
        self.issued = []

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in COLLECTIVES:
            return attr

        def collective(*args, **kwargs):
            count, dtype = _describe_buffer(args)
            watchdog.note(f"{self._where}, collective {name}")
            self._checker.agree(("collective", self._where, name, count, dtype))
            self.issued.append(name)
            return attr(*args, **kwargs)

        return collective
