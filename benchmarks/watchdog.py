"""What the watchdog costs a method per MPI call, against the raw communicator.

    OMP_NUM_THREADS=1 python benchmarks/watchdog.py [--repeat 100000] [--rounds 9]

A method receives its operator's private communicator watched (`WatchedComm`): each
blocking MPI call marks its thread as waiting for as long as it lasts, so that the
watchdog counts waits and not computing. This times, in one process, a method that
calls `comm.Allreduce` on 8 doubles (the call alone, and the method inside the host
call's mark, `Watchdog.busy`), and `comm.Get_rank()` (passed through), on the raw
communicator and on the watched one, interleaved, and prints the medians and the
difference per call. Times are the calling thread's CPU time (`time.thread_time`): the
work a call does, which other processes sharing the core do not inflate.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from distop._agreement import comm as _comm
from distop._safety.watchdog import WatchedComm, watchdog


def per_call(fn: Callable[[], object], repeat: int) -> float:
    """**Returns:** CPU seconds of this thread per call of `fn`, over `repeat` calls."""
    started = time.thread_time()
    for _ in range(repeat):
        fn()
    return (time.thread_time() - started) / repeat


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    raw = _comm.private(None)
    # (one process: `Watchdog.busy` hands over the raw communicator, with no peer to
    # wait for; the wrapper is made here to time it)
    watched = WatchedComm(raw, "Bench.forward")
    mark = watchdog.busy("Bench.forward")
    x, y = np.ones(8), np.empty(8)

    def method(comm: object) -> Callable[[], object]:
        def call() -> object:
            with mark:
                return comm.Allreduce(x, y, op=MPI.SUM)
        return call

    cases = {
        "Allreduce(8 doubles)": lambda c: (lambda: c.Allreduce(x, y, op=MPI.SUM)),
        "method: mark+Allreduce": method,
        "Get_rank()": lambda c: (lambda: c.Get_rank()),
    }
    print(f"# one process, {args.repeat} calls x {args.rounds} interleaved rounds; "
          "median CPU time per call (us)")
    print(f"{'call':>22} {'raw':>8} {'watched':>8} {'extra':>8}")
    for name, make in cases.items():
        times = {"raw": [], "watched": []}
        for _ in range(args.rounds):
            for label, comm in (("raw", raw), ("watched", watched)):
                times[label].append(per_call(make(comm), args.repeat))
        r, w = (statistics.median(times[k]) * 1e6 for k in ("raw", "watched"))
        print(f"{name:>22} {r:8.3f} {w:8.3f} {w - r:8.3f}")


if __name__ == "__main__":
    main()
