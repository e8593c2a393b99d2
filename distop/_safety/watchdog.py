"""The watchdog: it bounds every wait for peers, and counts nothing else.

It acts on `DISTOP_WATCHDOG` (`_config.settings.watchdog`). It counts only the time a
rank waits for its peers: in distop's own collectives (`Watchdog.watch`) and in the MPI
calls an operator's method makes through the communicator it is handed (`WatchedComm`).
A method computing (`Watchdog.busy`) is busy, not stuck. On a communicator of their own
(`Channel`), the watchdog threads of the ranks ask each other where they stand, so that
a rank that has waited long can tell a peer still computing (it waits on) from a hang
(it says what every rank is doing, and aborts the job).
"""

import atexit
import functools
import json
import threading
import time
from typing import Any

from .._config import settings
from .._mpi.names import BLOCKING, COLLECTIVES, MAKERS, STARTERS
from .._mpi.runtime import abort, mpi, world
from .marks import UNSEEN_PATIENCE, Mark, State, new_mark
from .watchdog_channel import Channel, decode
from .watchdog_report import grouped, groups_of, peer_standings, report, spans

OUTSIDE, COMPUTING, WAITING, UNSEEN, EXITING = State  # (short names inside this module)


_now = time.monotonic
_ident = threading.get_ident


# -- the watchdog ---------------------------------------------------------------------
class Watchdog:
    """Aborts the job when a rank has waited for its peers longer than `settings.watchdog`.

    A stuck rank cannot be told anything by its peers, and MPI gives no timeout on a
    blocking collective: a background thread notices instead, asks the other ranks
    where they stand, and unless one of them is still computing, prints what every
    rank is doing and calls MPI_Abort, which ends every rank.
    """

    def __init__(self) -> None:
        self._active: dict[int, Mark] = {}  # thread id -> its innermost step
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._channels: list[Channel] = []
        self._blind = "no communicator of distop's spans them yet"  # why it cannot ask
        self._heard: dict[int, tuple] = {}  # world rank -> (when, state, text, seconds)
        self._asked: dict[int, float] = {}  # world rank -> when it was last asked
        # a relay's world rank -> (when, its summary's groups; see `_summary`)
        self._relayed: dict[int, tuple[float, list]] = {}
        self._asked_at = -float("inf")
        self._relaying_until = -float("inf")  # a relay asks every rank while asked
        # held while the watchdog thread calls MPI; `_close` takes it to end those calls
        self._mpi_lock = threading.Lock()
        self._closed = False
        self._exit_set = False  # whether the wait at exit is registered
        # the active profile's recorder, which times every watched wait; None while
        # no profile is active (see `_profile.Profile`)
        self.timing: Any = None

    def watch(self, where: str) -> "_Watch":
        """A context manager marking this thread as waiting for its peers in step `where`.

        **Arguments:**
        - `where`: the step, for the message (`"Problem: agreeing on ..."`).

        **Returns:** the context manager (reusable: it keeps no state).
        """
        return _Watch(self, where)

    def busy(self, where: str, comm: Any = None) -> "_Busy":
        """A context manager marking this thread as computing in an operator's method.

        Time in it does not count, but for the MPI calls the method makes through the
        `comm` attribute of the result, which mark this thread as waiting while they
        last (a `WatchedComm`).

        **Arguments:**
        - `where`: the method, as `Operator.phase`.
        - `comm`: the communicator the method is handed; None for none.

        **Returns:** the context manager (reusable: it keeps no state), whose `comm` is
        the communicator to hand the method: `comm` watched where it has several ranks,
        else `comm` itself.
        """
        return _Busy(self, where, comm)

    def note(self, where: str) -> None:
        """Rename the step this thread is in (e.g. after the collective it issues next).

        **Arguments:**
        - `where`: the new description.
        """
        key = _ident()
        found = self._active.get(key)
        if found is not None:
            self._active[key] = found._replace(where=where, detail=None)

    def attach(self, comm: Any) -> "Channel | None":
        """Open a channel on which the watchdogs of `comm`'s ranks ask each other where
        they stand; collective.

        Call it where every rank of `comm` reaches the same point: distop calls it as
        it makes a private communicator, after the runtime's own wait at exit is set
        up, so that the watchdog's wait at exit (which tells the peers that this rank
        has ended) runs first.

        **Arguments:**
        - `comm`: the communicator (duplicated here).

        **Returns:** the channel, to `detach` when `comm` is freed; None where `comm`
        has one rank.
        """
        if comm is None or comm.Get_size() == 1:
            return None
        MPI = mpi()
        channel = Channel(comm)
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            # MPI lets only one thread call it at a time: the watchdog thread may not.
            self._blind = (f"MPI runs at thread level {MPI.Query_thread()}, and only "
                           f"MPI_THREAD_MULTIPLE ({MPI.THREAD_MULTIPLE}) lets the watchdog "
                           "thread ask them")
        elif not self._channels:
            self._blind = ""
        with self._mpi_lock:
            self._channels.append(channel)
        if not self._exit_set:
            self._exit_set = True
            atexit.register(self._wait_at_exit)
            # MPI deletes the attributes of COMM_SELF first thing in MPI_Finalize: the
            # watchdog thread stops calling MPI there, even where the program finalizes
            # MPI itself.
            keyval = MPI.Comm.Create_keyval(delete_fn=lambda *_: self._close())
            MPI.COMM_SELF.Set_attr(keyval, True)
        self._start()
        return channel

    def detach(self, channel: "Channel") -> None:
        """Close a channel and free its communicator; collective over its ranks, as the
        user's `comm.Free()` it follows is.

        **Arguments:**
        - `channel`: a channel `attach` returned.
        """
        with self._mpi_lock:
            if channel in self._channels:
                self._channels.remove(channel)
            if not self._closed:
                channel.close()
                channel.comm.Free()
            if not self._channels and not self._blind:
                self._blind = "no communicator of distop's spans them now"

    # Marking runs on every host call and MPI call of a method: a dict entry of this
    # thread's own, set and restored without a lock (each a single operation under the
    # GIL, as is the watchdog thread's copy of the values).
    def _mark(self, state: State, where: str, detail: str | None = None) -> None:
        active, key = self._active, _ident()
        active[key] = new_mark((state, where, detail, _now(), active.get(key)))
        if self._thread is None and settings.watchdog > 0:
            self._start()

    def _unmark(self) -> None:
        active, key = self._active, _ident()
        found = active.get(key)
        if found is not None:
            if found.outer is None:
                del active[key]
            else:
                active[key] = found.outer

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="distop-watchdog",
                                                daemon=True)
                self._thread.start()

    # -- the watchdog thread ----------------------------------------------------------
    def _run(self) -> None:
        quiet_since: float | None = _now()  # since when this rank is in no distop step
        while True:
            limit = settings.watchdog
            tick = max(0.05, min(1.0, limit / 20)) if limit > 0 else 1.0
            time.sleep(tick)
            now = _now()
            entries = list(self._active.values())
            if entries:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            waits = _waits(entries, now, limit)
            # Asked from half the limit on, so that answers are fresh when it is reached.
            every = max(tick, limit / 10)
            ask = (limit > 0 and now - self._asked_at >= every
                   and (any(waited > patience / 2 for *_, waited, patience in waits)
                        or now < self._relaying_until))
            self._serve(functools.partial(_standing, entries, now, quiet_since), ask, now,
                        limit, every)
            stuck = [w for w in waits if w[2] > w[3]] if limit > 0 else []
            if stuck and not self._held(now, limit, max(w[2] for w in stuck)):
                self._abort(stuck, now, limit)

    def _serve(self, standing: Any, ask: bool, now: float, limit: float,
               every: float) -> None:
        """Answer the peers' questions, read their answers and summaries, and ask if
        `ask` (a relay every rank, another rank its relays: see `Channel`)."""
        with self._mpi_lock:
            if self._closed or self._blind or not self._channels:
                return
            summary = functools.partial(self._summary, standing, now, limit)
            try:
                for channel in self._channels:
                    answers, summaries, asked_here, asked = channel.serve(
                        standing, summary, ask, now, 2 * every)
                    for rank, answer in answers:
                        self._heard[rank] = (_now(),) + decode(answer)
                    for data in summaries:
                        self._relayed[channel.relay] = (_now(), groups_of(data))
                    if asked_here and channel.relays:
                        self._relaying_until = now + limit
                    self._asked.update(dict.fromkeys(asked, now))
            except Exception as err:  # noqa: BLE001 - the watchdog must outlive it
                self._blind = f"the watchdog's channel failed ({err})"
            if ask:
                self._asked_at = now

    def _summary(self, standing: Any, now: float, limit: float) -> bytes:
        """**Returns:** what a relay answers a question with: the groups of ranks that
        answered it alike, itself included, as JSON (see `groups`)."""
        mine = world().Get_rank()
        state, where, seconds = standing()
        members = peer_standings(mine, now, limit, self._heard, self._asked, {})
        members[mine] = ((state, where, False), seconds, seconds, 0.0, 0.0)
        return json.dumps([[*key, spans(ranks), *times]
                           for key, ranks, *times in grouped(members)]).encode()

    def _held(self, now: float, limit: float, longest: float) -> bool:
        """Whether a wait of `longest` seconds goes on: a peer answered, within the
        limit, that it computes, or that it runs where the watchdog cannot see and the
        wait is shorter than `UNSEEN_PATIENCE` limits."""
        members = peer_standings(world().Get_rank(), now, limit, dict(self._heard),
                           dict(self._asked), dict(self._relayed))
        for (state, _, _), _, _, _, youngest in members.values():
            if state is None or youngest > limit:
                continue
            if state == COMPUTING:
                return True
            if state in (UNSEEN, OUTSIDE) and longest <= UNSEEN_PATIENCE * limit:
                return True
        return False

    def _abort(self, stuck: list, now: float, limit: float) -> None:
        comm = world()
        abort(comm, report(comm.Get_rank(), comm.Get_size(), stuck, limit, now,
                           self._heard, self._asked, self._blind, self._relayed))

    # -- at exit ----------------------------------------------------------------------
    def _wait_at_exit(self) -> None:
        """Wait, at interpreter exit, until every rank reaches its own exit.

        The wait is a watched step: a peer asking this rank learns that its program has
        ended, and where this rank waits too long while no peer computes, it says so and
        aborts the job. Then the watchdog thread stops calling MPI.
        """
        with self._mpi_lock:
            channel = None if self._blind or not self._channels else self._channels[0]
        if channel is None or mpi().Is_finalized():
            return
        self._mark(EXITING, "its exit, for the other ranks to reach theirs")
        try:
            request = channel.comm.Ibarrier()
            while not request.Test():
                time.sleep(0.005)
        finally:
            self._unmark()
        self._close()

    def _close(self) -> None:
        """Make the watchdog thread stop calling MPI (before MPI finalizes)."""
        # (bounded: MPI_Finalize may run this while holding locks of its own)
        held = self._mpi_lock.acquire(timeout=1.0)
        try:
            if not self._closed:
                self._closed = True
                for channel in self._channels:
                    channel.close()
        finally:
            if held:
                self._mpi_lock.release()


class _Watch:
    """A distop step that waits for the peers (see `Watchdog.watch`)."""

    __slots__ = ("dog", "where")

    def __init__(self, dog: Watchdog, where: str) -> None:
        self.dog, self.where = dog, where

    def __enter__(self) -> None:
        self.dog._mark(WAITING, self.where)
        if self.dog.timing is not None:
            self.dog.timing.wait_started()

    def __exit__(self, *exc: object) -> None:
        self.dog._unmark()
        if self.dog.timing is not None:
            self.dog.timing.wait_ended(self.where)


class _Busy:
    """An operator's method, computing but for its MPI calls (see `Watchdog.busy`)."""

    __slots__ = ("comm", "dog", "where")

    def __init__(self, dog: Watchdog, where: str, comm: Any) -> None:
        self.dog, self.where = dog, where
        try:
            several = comm is not None and comm.Get_size() > 1
        except AttributeError:  # (a wrapper of no communicator)
            several = False
        self.comm = WatchedComm(comm, where, dog) if several else comm

    def __enter__(self) -> None:
        self.dog._mark(COMPUTING, self.where)

    def __exit__(self, *exc: object) -> None:
        self.dog._unmark()


def _waits(entries: list[Mark], now: float, limit: float) -> list:
    """**Returns:** (state, description, seconds, patience) of each thread's step that
    counts: a wait, or a method that started a non-blocking call."""
    found = []
    for state, where, detail, since, _ in entries:
        if state in (WAITING, EXITING):
            found.append((state, _describe(state, where, detail), now - since, limit))
        elif state == UNSEEN:
            found.append((state, _describe(state, where, detail), now - since,
                          UNSEEN_PATIENCE * limit))
    return found


def _standing(entries: list[Mark], now: float, quiet_since: float | None) -> tuple:
    """Where this rank stands, as it answers a peer: a thread computing first (the rank
    is busy), then the longest wait, else outside distop or at its exit.

    **Returns:** (state, description, seconds in it).
    """
    order = {COMPUTING: 0, WAITING: 1, EXITING: 2, UNSEEN: 3}
    if entries:
        state, where, detail, since, _ = min(entries, key=lambda e: (order[e.state], e.since))
        return state, _describe(state, where, detail), now - since
    since = now if quiet_since is None else quiet_since
    # (the main thread has ended: at exit, before distop's own wait there)
    state = OUTSIDE if threading.main_thread().is_alive() else EXITING
    return state, "its exit" if state == EXITING else "", now - since


def _describe(state: State, where: str, detail: str | None) -> str:
    """**Returns:** the step, with the MPI call it is in."""
    if detail is None:
        return where
    if state == UNSEEN:
        return f"{where}, after a non-blocking {detail}"
    return f"{where}, {'collective ' if detail in COLLECTIVES else ''}{detail}"


# -- the communicator handed to methods -----------------------------------------------
def _waiting_call(call: Any, name: str, where: str, active: dict) -> Any:
    """**Returns:** MPI method `call` (named `name`), marking its thread as waiting in
    `where` for as long as it lasts (in `active`, the watchdog's marks)."""
    def waiting(*args: Any, **kwargs: Any) -> Any:
        key = _ident()
        outer = active.get(key)
        active[key] = new_mark((WAITING, where, name, _now(), outer))
        try:
            return call(*args, **kwargs)
        finally:
            if outer is None:
                del active[key]
            else:
                active[key] = outer

    return waiting


def _starting_call(call: Any, name: str, active: dict) -> Any:
    """**Returns:** MPI method `call` (named `name`), marking a computing thread as
    unseen first: from then on it may wait on the request, where no one can see."""
    def starting(*args: Any, **kwargs: Any) -> Any:
        key = _ident()
        found = active.get(key)
        if found is not None and found.state == COMPUTING:
            active[key] = new_mark((UNSEEN, found.where, name, _now(), found.outer))
        return call(*args, **kwargs)

    return starting


class WatchedComm:
    """A communicator that tells the watchdog when an operator's method waits in MPI.

    Each blocking collective and point-to-point call marks the thread as waiting in
    `where` (`Operator.phase`), with the call's name, for as long as it lasts; the rest
    of the method's time is computing, which the watchdog does not count. A call that
    starts a non-blocking operation marks the method as unseen from then on (it may
    wait on the request where the watchdog cannot see). Communicators made from it
    are watched too. Everything else is the wrapped communicator's own.

    It holds only the communicator, so it composes with other wrappers of the same
    kind: whichever it wraps, it times the whole call; whichever wraps it passes its
    calls down. Each method is looked up and wrapped once, on its first use.

    **Arguments:**
    - `comm`: the communicator (an `mpi4py` communicator, or another wrapper).
    - `where`: the method, as `Operator.phase`.
    - `dog`: the `Watchdog` to tell; the one of the process by default.
    """

    def __init__(self, comm: Any, where: str, dog: Watchdog | None = None) -> None:
        self._comm, self._where = comm, where
        self._dog = watchdog if dog is None else dog

    def __getattr__(self, name: str) -> Any:
        if name in ("_comm", "_where", "_dog"):  # (not set yet: a copy being made)
            raise AttributeError(name)
        found = getattr(self._comm, name)
        if not callable(found):
            return found  # (a value, such as `rank`: it may change, so it is not kept)
        active = self._dog._active
        if name in BLOCKING:
            found = _waiting_call(found, name, self._where, active)
        elif name in MAKERS:
            found = self._making(_waiting_call(found, name, self._where, active))
        elif name in STARTERS or name.endswith("_init"):  # (`*_init`: persistent)
            found = _starting_call(found, name, active)
        self.__dict__[name] = found  # later calls find it without `__getattr__`
        return found

    def _making(self, make: Any) -> Any:
        """**Returns:** `make`, whose communicator (unless none) is watched too."""
        def making(*args: Any, **kwargs: Any) -> Any:
            made = make(*args, **kwargs)
            if made == mpi().COMM_NULL:
                return made
            return WatchedComm(made, self._where, self._dog)

        return making

    def __repr__(self) -> str:
        return f"WatchedComm({self._comm!r}, {self._where!r})"


watchdog = Watchdog()
