"""What the watchdog keeps of each thread: its `State` (sent to the peers as a number)
and its innermost step, a `Mark`."""

import enum
import functools
from typing import NamedTuple


class State(enum.IntEnum):
    """Where a thread stands, and so a rank (see `Watchdog.busy` and `WatchedComm`); sent
    to the peers as its number."""

    OUTSIDE = 0  # in no distop step: its own code, or distop tracing and compiling
    COMPUTING = 1  # in an operator's method, outside its MPI calls
    WAITING = 2  # in a distop collective, or in a blocking MPI call of a method
    UNSEEN = 3  # in a method that started a non-blocking call: computing, or waiting on it
    EXITING = 4  # at its exit, waiting for the other ranks to reach theirs


class Mark(NamedTuple):
    """A thread's innermost step, as the watchdog keeps it."""

    state: State
    where: str  # the step, as `Watchdog.watch` or `Watchdog.busy` names it
    detail: str | None  # the MPI call it is in, if any
    since: float  # when it began (monotonic)
    outer: "Mark | None"  # the step it is in, restored when it ends


# A mark is made at every step of every call: `tuple.__new__` makes the same object
# without the NamedTuple's Python-level constructor.
new_mark = functools.partial(tuple.__new__, Mark)


# How many limits a wait may last while a peer runs where the watchdog cannot see
# whether it computes or waits (`OUTSIDE`, `UNSEEN`); such a rank itself gets as long.
UNSEEN_PATIENCE = 10
