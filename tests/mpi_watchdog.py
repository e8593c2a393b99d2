"""The watchdog against healthy jobs and real hangs:
`mpiexec -n P python tests/mpi_watchdog.py healthy|exits_early|another_collective`
(tests/test_safety.py runs it with a limit shorter than every computation here,
`DISTOP_WATCHDOG=2`).

`healthy`: cases that compute for `COMPUTE` seconds, on every rank, or on one rank while
the others wait for it in a collective, in requests, or in distop's agreement on the
next call; every one must finish well. The others hang, and must end with the
watchdog's report: the last rank exits before its collective (`exits_early`), or calls
another collective than the others (`another_collective`).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)
from helpers import run_cases  # noqa: E402

comm = MPI.COMM_WORLD
SLOW = comm.size - 1  # the slow rank in the cases where one is: never rank 0
COMPUTE = 5.0  # seconds of computing: more than twice the limit the tests set
CASES = []


def case(fn):
    CASES.append(fn)
    return fn


class Solve(distop.DistributedOperator):
    """An allreduce-sum whose forward computes (sleeps) first, on the ranks in `slow`."""

    slow: tuple = ()
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        if comm.Get_rank() in self.slow:
            time.sleep(COMPUTE)
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, y_bar, x):
        out = np.empty_like(y_bar)
        comm.Allreduce(y_bar, out, op=MPI.SUM)
        return out


class Other(distop.DistributedOperator):
    """A barrier: what the last rank calls where the others call `Solve`."""

    forward_collectives = ("Barrier",)

    def forward(self, comm, x):
        comm.Barrier()
        return x.copy()

    def vjp(self, comm, y_bar, x):
        return y_bar.copy()


class Ring(distop.DistributedOperator):
    """Sends x to the next rank and returns the previous rank's, with non-blocking
    calls; the slow rank computes (sleeps) between starting them and waiting."""

    forward_collectives = ("Isend", "Irecv")
    vjp_collectives = ("Sendrecv",)

    def forward(self, comm, x):
        rank, size = comm.Get_rank(), comm.Get_size()
        out = np.empty_like(x)
        requests = [comm.Irecv(out, (rank - 1) % size), comm.Isend(x, (rank + 1) % size)]
        if rank == SLOW:
            time.sleep(COMPUTE)
        MPI.Request.Waitall(requests)
        return out

    def vjp(self, comm, y_bar, x):
        rank, size = comm.Get_rank(), comm.Get_size()
        out = np.empty_like(y_bar)
        comm.Sendrecv(y_bar, (rank - 1) % size, recvbuf=out, source=(rank + 1) % size)
        return out


def expect_sum(problem):
    started = time.monotonic()
    values = problem.run()
    assert float(values["f"]) == 3.0 * comm.size, values
    return time.monotonic() - started


@case
def every_rank_computes_longer_than_the_limit():
    problem = distop.Problem(lambda x: {"f": jnp.sum(Solve(slow=tuple(range(comm.size)))(x))},
                             {"x": np.ones(3)})
    assert expect_sum(problem) >= COMPUTE


@case
def one_rank_computes_while_the_others_wait_in_its_collective():
    problem = distop.Problem(lambda x: {"f": jnp.sum(Solve(slow=(SLOW,))(x))},
                             {"x": np.ones(3)})
    assert expect_sum(problem) >= COMPUTE


@case
def one_rank_computes_between_starting_requests_and_waiting_on_them():
    problem = distop.Problem(lambda x: {"f": jnp.sum(Ring()(x))}, {"x": np.ones(3)})
    assert float(problem.run()["f"]) == 3.0
    assert problem.compute_totals()["f", "x"].tolist() == [[1.0, 1.0, 1.0]]


@case
def one_rank_works_outside_distop_while_the_others_wait_for_the_next_call():
    problem = distop.Problem(lambda x: {"f": jnp.sum(Solve()(x))}, {"x": np.ones(3)})
    expect_sum(problem)
    if comm.rank == SLOW:
        time.sleep(COMPUTE)  # (the program's own work between two calls)
    expect_sum(problem)


def hang(scenario):
    """Run `scenario` (one of the hangs); the watchdog must end it."""
    last = comm.rank == comm.size - 1
    if scenario == "exits_early":
        problem = distop.Problem(lambda x: {"f": jnp.sum(Solve()(x))}, {"x": np.ones(3)})
        if last:
            sys.exit(0)
        problem.run()
    elif scenario == "another_collective":
        problem = distop.Problem(
            lambda x: {"f": jnp.sum(lax.cond(last, Other(), Solve(), x))}, {"x": np.ones(3)})
        problem.run()
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(f"rank {comm.rank}: scenario {scenario} finished without an error", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "healthy":
        run_cases(CASES)
    else:
        hang(sys.argv[1])
