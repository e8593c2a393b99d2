"""A profile finds the slow rank wherever its time goes: in an operator's method, in
jax.numpy code of the model, or in the caller's own code between calls. The slowdown is
large (tens of ms a call, at every call of the profile), so that the noise of a
machine whose cores other work keeps busy cannot hide it."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from mpi4py import MPI

import distop
from distop._diagnostics.report import check_trace

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
SLOW = size - 1 if size == 2 else 2  # (not the last rank on 4)
PAUSE = 0.06  # seconds a slowed call takes more
ROUNDS = 48  # `busy_jax`'s products on the slowed rank: about as long as PAUSE
CALLS = 6  # profiled rounds of run and compute_totals


class Summed(distop.DistributedOperator):
    """y = the sum over ranks of x; `pause` seconds more in each method on the slow
    rank."""

    pause: float
    forward_collectives = vjp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        time.sleep(self.pause)
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, y_bar, x):
        return self.forward(comm, y_bar)


def busy_jax(x, rounds):
    """jax.numpy work of `rounds` products of 256 x 256 matrices, its result dropped
    (0 times a finite value): the model's value stays every rank's alike."""
    m = jnp.cos(jnp.arange(256.0 * 256.0).reshape(256, 256) + x[0])
    found = lax.fori_loop(0, rounds, lambda _, v: jnp.tanh(v @ m) / 256.0, m)
    return x + 0.0 * jnp.sum(found)


def seconds_of_busy_jax(rounds):
    """**Returns:** how long `busy_jax` takes here (jitted, the least of three runs),
    the same number on every rank: what the slowed rank adds to each program."""
    mine = 0.0
    if rounds:
        busy = jax.jit(busy_jax, static_argnums=1)
        x = jnp.ones(4)
        busy(x, rounds).block_until_ready()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            busy(x, rounds).block_until_ready()
            times.append(time.perf_counter() - started)
        mine = min(times)
    return comm.allreduce(mine, op=MPI.MAX)


@pytest.mark.parametrize("where", ["method", "jax", "outside"])
def test_the_profile_names_the_slow_rank_and_where_its_time_went(where):
    slow = rank == SLOW
    op = Summed(PAUSE if slow and where == "method" else 0.0)
    rounds = ROUNDS if slow and where == "jax" else 0
    # (each slowed call adds at least this much)
    added = seconds_of_busy_jax(rounds) if where == "jax" else PAUSE

    def model(x):
        return {"f": jnp.sum(op(busy_jax(x, rounds)) ** 2)}

    def own_code():
        if slow and where == "outside":
            time.sleep(PAUSE)

    problem = distop.Problem(model, {"x": np.linspace(0.0, 1.0, 4)})
    problem.run(), problem.compute_totals()  # (compiled before the profile)
    with problem.profile() as prof:
        for _ in range(CALLS):
            own_code()
            problem.run()
            own_code()
            problem.compute_totals()
    report = prof.report()
    headline = report.headline()
    assert report.slowest_rank == SLOW, report.table()
    assert headline.startswith(f"slowest rank: {SLOW} (the others waited "), headline
    expected = {"method": "Summed.forward (computing)", "jax": "JAX",
                "outside": "its own code between calls"}[where]
    assert report.extra[0][0] == expected, (report.extra, report.table())
    assert report.late[SLOW] > 0.5 * CALLS * added and report.arrivals.shape[0] == size
    # the fast ranks' waiting is booked as wait, not as JAX's time or their own code
    fast = [r for r in range(size) if r != SLOW]
    waited = report.wait + report.agreement
    assert all(waited[r] > waited[SLOW] for r in fast), report.table()
    document = prof.trace()
    if rank == 0:
        check_trace(document)
        events = [e for e in document["traceEvents"] if e["ph"] == "X"]
        for r in range(size):  # on every track: waits and the caller's own code
            categories = {e["cat"] for e in events if e["pid"] == r}
            assert {"program", "method", "mpi", "wait", "outside"} <= categories, categories
        met = [e for e in events if e["cat"] in ("mpi", "wait") and "args" in e
               and "arrival_vs_last_us" in e["args"]]
        assert met and all(e["args"]["arrival_vs_last_us"] <= 0 for e in met)


def test_a_rank_slowed_once_per_pair_of_calls_is_named():
    # slowed in its own code before each run only: it comes last at a few of the
    # meetings, and the others wait for it most of the time
    op = Summed(0.0)
    problem = distop.Problem(lambda x: {"f": jnp.sum(op(x) ** 2)}, {"x": np.ones(4)})
    problem.run(), problem.compute_totals()
    with problem.profile() as prof:
        for _ in range(10):
            if rank == SLOW:
                time.sleep(0.03)
            problem.run()
            problem.compute_totals()
    report = prof.report()
    assert report.slowest_rank == SLOW, report.table()
    assert report.headline().startswith(f"slowest rank: {SLOW} "), report.headline()


def test_with_no_rank_slowed_the_profile_names_none():
    # the same pause on every rank: identical work, the ranks idle in it. A machine
    # whose cores are all busy may slow one rank for real for a while, and the profile
    # says so: of three profiles, one at least names none (a profile that names a rank
    # where none is slowed would name one in each).
    op = Summed(PAUSE / 3)
    problem = distop.Problem(lambda x: {"f": jnp.sum(op(x) ** 2)}, {"x": np.ones(4)})
    problem.run(), problem.compute_totals()
    tables = []
    for _ in range(3):
        with problem.profile() as prof:
            for _ in range(10):
                problem.run()
                problem.compute_totals()
        report = prof.report()
        if comm.allreduce(report.slowest_rank is None, op=MPI.LAND):  # (alike everywhere)
            break
        tables.append(report.table())
    assert report.slowest_rank is None, "\n".join(tables)
    assert report.headline().startswith("slowest rank: none"), report.headline()
