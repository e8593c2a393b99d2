"""A test that hangs: the harness's own watchdog, not a test of distop. Collected only
with DISTOP_TEST_HANGS=1 (tests/test_mpi.py runs it, with a short limit)."""

import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def test_a_case_that_hangs():
    # not a test of distop: the harness's own watchdog (tests/test_mpi.py runs it)
    comm.Barrier() if rank == 0 else time.sleep(600)
