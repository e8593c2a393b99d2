"""The watchdog's questions go through a relay: a round of them is a number of messages
linear in the number of ranks, and every rank still learns where every other stands."""

import time

from mpi4py import MPI

from distop._safety import watchdog as _watchdog
from distop._safety.watchdog_channel import Channel

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def _standing():
    return _watchdog.State.WAITING, f"Step{rank}.forward, collective Barrier", 3.0


def _rounds(dog, count, ask, every):
    """Serve `count` rounds on every rank, the messages of each delivered before the
    next."""
    for _ in range(count):
        dog._serve(_standing, ask, time.monotonic(), 60.0, every)
        comm.Barrier()
        time.sleep(0.05)


def test_every_rank_asks_the_relay_only_and_learns_where_every_rank_stands():
    channel = Channel(comm)
    dog = _watchdog.Watchdog()
    dog._channels, dog._blind = [channel], ""
    try:
        _rounds(dog, 4, ask=True, every=100.0)  # (a relay this quick is never silent)
        _rounds(dog, 2, ask=False, every=100.0)  # (the last answers read)
        assert set(dog._asked) == ({r for r in range(size) if r != 0} if rank == 0
                                   else {0}), dog._asked
        members = _watchdog.peer_standings(rank, time.monotonic(), 60.0, dog._heard,
                                     dog._asked, dog._relayed)
        assert sorted(members) == [r for r in range(size) if r != rank], members
        for peer, (key, *_) in members.items():
            assert key == (_watchdog.State.WAITING, f"Step{peer}.forward, collective Barrier",
                           False), (peer, key)
        if rank != 0:  # what it knows of the others it learnt from the relay's summary
            assert set(dog._heard) == set() and set(dog._relayed) == {0}
    finally:
        channel.close()
        channel.comm.Free()


def test_a_rank_whose_relay_is_silent_asks_every_rank_itself():
    channel = Channel(comm)
    dog = _watchdog.Watchdog()
    dog._channels, dog._blind = [channel], ""
    try:
        if rank == 0:  # the relay answers nothing: it serves no round
            comm.Barrier()
            time.sleep(0.2)
            comm.Barrier()
        else:
            for _ in range(2):
                now = time.monotonic()
                dog._serve(_standing, True, now, 60.0, 0.01)
                time.sleep(0.1)
            comm.Barrier()
            time.sleep(0.2)
            comm.Barrier()
            # first the relay only, then, the relay silent past the patience, every rank
            assert set(dog._asked) == {r for r in range(size) if r != rank}, dog._asked
        comm.Barrier()
        _rounds(dog, 2, ask=False, every=100.0)  # (the questions read, the answers too)
    finally:
        channel.close()
        channel.comm.Free()
