"""The agreement of a Problem's ranks on what they run: one class, one method per step.

Every step that may go differently on different ranks (checking arguments, tracing,
rewriting a program, the request of a call) ends in one collective on every rank, so
that an error on one rank is an error on every rank and no rank waits for another.
"""

import enum
import hashlib
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import DistopError
from .._safety import watchdog as _watchdog
from . import comm as _comm

REFUSED = "refused"  # the request a rank sends in place of arguments it refused
# (kept with each private communicator: freed with it, never found by a reused handle)
_serials = _comm.PerCommunicator()  # private communicator -> count of Problems made on it
_widths = _comm.PerCommunicator()  # private communicator -> its agreements' row width


class Failure(enum.Enum):
    """One rank's view of a step that failed on it, as the ranks decide together
    whether to go on without it (`Coordinator.go_on_without`)."""

    LEFT_FOR_LATER = "later"  # this rank may go on; the step's error comes when used
    ON_OTHER_RANKS = "others"  # it failed because another rank did
    RAISE_NOW = "raise"  # this rank must raise now


class Missed(Exception):
    """A pending agreement, made before a program was built or run, found that the
    ranks disagree (see `CallAgreement`)."""


class Coordinator:
    """The agreement of one Problem's ranks, step by step.

    A call of an entry point agrees once, alike on every rank (see `_problem/calls.py`,
    which walks a call through these states):

    ```
    request() ──(seen before)──► pending: a CallAgreement, made before the program or
       │                         by its first host call
       │                            │ the ranks agree          │ the ranks disagree
       ▼                            ▼                          ▼
    agreed ◄────────────────── agreed                        missed: request() again
       ▲                                                     with what every rank sent
       └───────────────────────────────────────────────────── (`gathered`): agreed or raised
    ```

    **Arguments:**
    - `comm`: the Problem's private communicator.
    - `distributed`: the names of the distributed values (their axis 0 may differ).
    """

    def __init__(self, comm: Any, distributed: frozenset) -> None:
        self.comm = comm
        self.distributed = distributed
        self.handle = comm.py2f()
        # Which Problem on this communicator (they are made in the same order on every
        # rank, each construction agreeing across ranks): part of every request, so that
        # ranks calling two different Problems raise instead of running both.
        self.serial = next(_serials.setdefault(comm, itertools.count()))
        self._fixed: dict = {}  # (shapes, request) -> (what must agree, its hash)
        self._guesses: dict = {}  # (shapes, request) -> the block sizes agreed last time

    # -- steps of making a Problem or a program -------------------------------------
    def collective_step(self, what: str, thunk: Callable[[], Any],
              share: Callable[[Any], Any] | None = None) -> Any:
        """Run `thunk` on every rank; if it raises on any rank, raise on every rank.

        **Arguments:**
        - `what`: the step, for messages and the watchdog.
        - `thunk`: the step itself.
        - `share`: a function of the step's result, shared with every rank.

        **Returns:** the step's result; with `share`, also every rank's
        `share(result)`, from the same collective.
        """
        try:
            result, error = thunk(), None
            shared = share(result) if share is not None else None
        except Exception as err:  # noqa: BLE001 - reported collectively below
            result, shared, error = None, None, err
        mine = (None if error is None else f"{type(error).__name__}: {error}", shared)
        every = [mine]
        if self.comm.Get_size() > 1:
            # (`what` may name the Problem itself: "Problem: checking its arguments")
            where = what if what.startswith("Problem") else f"Problem: {what}"
            with _watchdog.watchdog.watch(where):
                # every rank's message and share only where some rank failed or
                # something is shared: else one fixed-size reduction says all went well
                if share is not None or self.any_rank(error is not None):
                    every = self.comm.allgather(mine)
            if any(m for m, _ in every) and error is None:
                failed = DistopError(f"{what} failed on other ranks:\n" + "\n".join(
                    f"  rank {r}: {m}" for r, (m, _) in enumerate(every) if m))
                failed.elsewhere = True  # (this rank's step itself went well)
                raise failed
        if error is not None:
            raise error
        return result if share is None else (result, [shared for _, shared in every])

    def any_rank(self, mine: bool) -> bool:
        """**Returns:** whether `mine` is True on some rank: one reduction of a fixed
        size, whatever the number of ranks."""
        return bool(_comm.most(self.comm, np.array([1 if mine else 0], np.int64))[0])

    def most(self, vector: np.ndarray,
             what: str = "Problem: agreeing on a program's rewrites") -> np.ndarray:
        """The elementwise maximum of an int64 vector over the ranks.

        **Arguments:**
        - `vector`: this rank's; every rank passes one of the same length.
        - `what`: the step, for the watchdog's message should a rank not come.

        **Returns:** the maximum.
        """
        with _watchdog.watchdog.watch(what):
            return _comm.most(self.comm, vector)

    def widen(self, widths: list[int]) -> None:
        """Make every agreement on this communicator send rows of the largest of
        `widths` (every rank's, agreed as a Problem is made), so that ranks calling
        Problems with other numbers of distributed inputs send messages of one size."""
        _widths[self.comm] = max(_widths.get(self.comm, 2), *widths)

    def go_on_without(self, mine: Failure) -> bool:
        """Decide with every rank whether a failed step is left for later.

        **Arguments:**
        - `mine`: this rank's view (a `Failure`).

        **Returns:** whether every rank goes on: some rank may wait and none must raise.
        """
        every = [mine]
        if self.comm.Get_size() > 1:
            with _watchdog.watchdog.watch("Problem: agreeing on a failed compute_totals"):
                every = self.comm.allgather(mine)
        return Failure.LEFT_FOR_LATER in every and Failure.RAISE_NOW not in every

    # -- the agreement of a call ------------------------------------------------------
    def request(self, local: tuple, request: tuple, own: list[int],
                refused: BaseException | None = None, may_defer: bool = False,
                gathered: np.ndarray | None = None) -> tuple[tuple, "CallAgreement | None"]:
        """Agree with every rank on a call's request and the shapes of its point.

        **Arguments:**
        - `local`: (name, shape, dtype) of every input of the point.
        - `request`: the entry point and its arguments.
        - `own`: this rank's block sizes of the distributed inputs, in point order.
        - `refused`: the error of an argument this rank refused. This rank takes its
          place in the agreement with a mark instead of a request and raises it; the
          other ranks raise a `DistopError` naming it. No rank runs the call.
        - `may_defer`: the agreement may be left pending, for the program to make (see
          `CallAgreement`): the caller makes it before anything else communicates.
        - `gathered`: every rank's row of a pending agreement of this call that found
          the ranks disagree; read instead of communicating.

        **Returns:** (every rank's block sizes per distributed input, and the
        `CallAgreement` still to make where they are those of last time, else None).
        """
        if self.comm.Get_size() == 1:
            if refused is not None:
                raise refused
            return (), None
        fixed: tuple | None
        if refused is not None:  # (a hash is never negative)
            fixed = ((REFUSED, f"{type(refused).__name__}: {refused}", None), -1)
        else:
            fixed = self._fixed.get((local, request))
        if fixed is None:  # what must agree, and its hash: once per shapes and request
            shapes = tuple((k, s[1:] if k in self.distributed else s, d)
                           for k, s, d in local)
            fixed = self._fixed[local, request] = (
                (request, shapes, self.serial),
                stable_hash((self.serial, request, shapes)))
        every = gathered
        if every is None:
            guess = self._guesses.get((local, request)) if may_defer and refused is None \
                else None
            if guess is not None:
                return guess[0], CallAgreement(self.comm, [fixed[1], guess[1], *own],
                                               _widths[self.comm], guess[2], guess[0])
            first = CallAgreement(self.comm, [fixed[1], -1, *own], _widths[self.comm],
                                  stable_hash((fixed[1], -1)))
            first.anything_differs()  # (always True: no rank expects sizes here)
            every = first.gather()
        if (every[:, 0] != every[0, 0]).any():
            self._differ(fixed, refused)
        counts = block_sizes(every, len(own))
        if may_defer:  # (the sizes, their hash, and one hash of it and the request's)
            made = stable_hash(counts)
            self._guesses[local, request] = (counts, made, stable_hash((fixed[1], made)))
        if refused is not None:  # (every rank refused)
            raise refused
        return counts, None

    def forget(self, local: tuple) -> None:
        """Forget what was agreed for calls at shapes `local`: their next call agrees
        before its program."""
        for table in (self._fixed, self._guesses):
            for key in [k for k in table if k[0] == local]:
                del table[key]

    def _differ(self, fixed: tuple, refused: BaseException | None) -> None:
        """Raise, on every rank, the error of ranks whose requests differ."""
        shapes = self.comm.allgather(fixed[0])
        others = [f"  rank {r}: {s}" for r, (c, s, _) in enumerate(shapes) if c == REFUSED]
        if refused is not None:
            raise refused
        if others:
            raise DistopError("other ranks refused their arguments to the same call, "
                              "so no rank runs it:\n" + "\n".join(others))
        raise DistopError(
            "the ranks called different entry points, of different Problems (#: "
            "the order of their making on this communicator), with different "
            "arguments, or passed inputs of different shapes or dtypes, so they "
            "would run different programs:\n"
            + "\n".join(f"  rank {r}: {c} {s} (Problem #{n})"
                        for r, (c, s, n) in enumerate(shapes))
            + "\nCall the same methods with the same arguments and shapes on every "
            "rank; only inputs named in Problem(distributed=...) may differ, and "
            "only in axis 0.")


class CallAgreement:
    """The agreement of one call of an entry point across ranks.

    Every rank holds (`mine`) the hash of its request and shapes, the hash of the block
    sizes its layout was made for (-1 where it has made no layout yet) and the block
    sizes of its distributed inputs. The ranks have agreed on a layout made in advance
    (that of the sizes of the request's last call) when all hold the same two hashes
    and every rank's own block sizes are those the layout was made for (`expect`).

    Each rank tests its own sizes against `expect` itself, so one reduction of a fixed
    three numbers to their maximum decides it: one hash of both hashes (`key`, made
    with them), its negation (all ranks hold the same hash exactly when its maximum is
    minus the maximum of its negation) and a flag raised by a rank whose sizes differ
    or that expects none. `comm.most` keeps the reduction on MPI's shortest algorithm
    at any number of ranks (at 2 and 3, it sends the three as one element). Only where
    that finds a difference do the ranks gather every rank's row (`gather`), padded
    with zeros to the `width` of every agreement on its communicator (the most any
    rank's Problem made on it sends, agreed as each Problem is made, so the same on
    every rank: ranks calling Problems with other numbers of distributed inputs send
    rows of one size, and raise the error of differing requests instead of MPI's of
    differing message sizes). Both steps depend only on what every rank sent, so every
    rank decides alike.

    Made before the program where the rank made no layout in advance, or where the
    program cannot make it (see `Program.makes_agreement`); else by the program's first host
    call, right before its method (the program's `Gate` holds it while the program
    runs): one collective beside the method's own, where one before the program would
    make the ranks meet once more. Every rank makes it before any method of the call
    runs, the same collectives wherever it is made. Where the ranks disagree, no host
    call of the program runs a method (each returns zeros), and the call is made again
    as if the agreement had been made first (see `_problem/calls.py`).
    """

    # The row is kept as Python ints until a gather needs it as an array: the check of
    # every call is then a handful of integer operations around its one reduction.
    __slots__ = ("comm", "every", "expect", "key", "mine", "missed", "sizes")

    def __init__(self, comm: Any, mine: list[int], width: int, key: int,
                 expect: tuple | None = None) -> None:
        self.comm, self.key, self.expect, self.sizes = comm, key, expect, len(mine) - 2
        self.mine = mine + [0] * (width - len(mine))
        self.every: np.ndarray | None = None
        self.missed: bool | None = None

    def anything_differs(self) -> bool:
        """**Returns:** whether some rank holds other hashes than this one, or finds its
        own block sizes other than `expect` (or expects none): one fixed-size
        collective, decided alike on every rank."""
        mine, expect = self.mine, self.expect
        if expect is None:
            mine_fit = False
        else:
            rank = self.comm.Get_rank()
            own = mine[2:2 + self.sizes]
            mine_fit = all(sizes[rank] == size for sizes, size in zip(expect, own))
        summary = np.array([self.key, -self.key, 0 if mine_fit else 1], np.int64)
        with _watchdog.watchdog.watch("Problem: agreeing on the inputs' shapes"):
            top = _comm.most(self.comm, summary).tolist()
        return top[0] != -top[1] or top[2] != 0

    def gather(self) -> np.ndarray:
        """**Returns:** every rank's `mine`, one row per rank (after `anything_differs`,
        and only where it found a difference: every rank makes both alike)."""
        every = np.empty((self.comm.Get_size(), len(self.mine)), np.int64)
        with _watchdog.watchdog.watch("Problem: agreeing on the inputs' shapes"):
            self.comm.Allgather(np.array(self.mine, np.int64), every)
        return every

    def ranks_disagree(self) -> bool:
        """Make the agreement, once. **Returns:** whether the ranks disagree."""
        if self.missed is None:
            if not self.anything_differs():
                self.missed = False
                return False
            self.every = self.gather()
            self.missed = bool((self.every[:, :2] != self.mine[:2]).any()
                               or block_sizes(self.every, self.sizes) != self.expect)
        return self.missed


def block_sizes(every: np.ndarray, sizes: int) -> tuple:
    """Per distributed input (`sizes` of them), every rank's block size, from the
    agreement's rows."""
    return tuple(map(tuple, every[:, 2:2 + sizes].T.tolist()))


def stable_hash(obj: object) -> int:
    """A hash that is the same in every process (Python's own `hash` is salted)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1
