"""What the communicator a method receives costs per call, against the raw one.

    OMP_NUM_THREADS=1 python benchmarks/comm_wrappers.py [--repeat 200000]

A method gets its operator's private communicator wrapped (`GuardedComm`: it refuses
communication the operator did not declare). This times, in one process, the calls a
method makes on it (an Allreduce of 8 doubles, `Get_rank`) through the raw
communicator and through the wrapper, interleaved, and prints the medians and the
difference per call.
"""

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

from distop._agreement import comm as _comm
from distop._safety.guard import GuardedComm


def per_call(fn, repeat):
    """**Returns:** seconds per call of `fn`, over `repeat` calls."""
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    raw = _comm.private(None)
    guarded = GuardedComm(raw, ("Allreduce",), "Bench.forward")
    x, y = np.ones(8), np.empty(8)
    cases = {
        "Allreduce(8 doubles)": lambda c: (lambda: c.Allreduce(x, y, op=MPI.SUM)),
        "Get_rank()": lambda c: (lambda: c.Get_rank()),
    }
    print(f"# one process, {args.repeat} calls x {args.rounds} interleaved rounds; "
          "median per call (us)")
    print(f"{'call':>22} {'raw':>8} {'guarded':>8} {'extra':>8}")
    for name, make in cases.items():
        times = {"raw": [], "guarded": []}
        for _ in range(args.rounds):
            for label, comm in (("raw", raw), ("guarded", guarded)):
                times[label].append(per_call(make(comm), args.repeat))
        r, g = (statistics.median(times[k]) * 1e6 for k in ("raw", "guarded"))
        print(f"{name:>22} {r:8.3f} {g:8.3f} {g - r:8.3f}")


if __name__ == "__main__":
    main()
