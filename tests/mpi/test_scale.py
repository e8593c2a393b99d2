"""distop's own MPI traffic per call is fixed, whatever the number of ranks: counted on
a communicator that records every call (benchmarks/mpi_counts.py)."""

import sys

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from mpi4py import MPI

import distop

sys.path.insert(0, str(ROOT / "benchmarks"))
import mpi_counts  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


@pytest.fixture
def counting():
    """A new communicator of every rank that counts its calls: distop makes its private
    duplicate of it here, counted too, whatever the tests before made of COMM_WORLD."""
    counted = mpi_counts.CountingComm(comm.Dup())
    yield counted
    counted.Free()


def steady(call, repeat=3):
    """**Returns:** the `Tally` of each of `repeat` calls after a first one."""
    call()
    tallies = []
    for _ in range(repeat):
        with mpi_counts.counting() as tally:
            call()
        tallies.append(tally)
    return tallies


def test_distop_s_own_traffic_per_steady_state_call_is_one_fixed_size_reduction(counting):
    op = mpi_counts.Matvec(np.random.default_rng(rank).standard_normal((3, 4)), comm=counting)
    w = jnp.array([1.0, -2.0, 0.5])

    def model(x):  # the README's
        y = op(x)
        return {"f": jnp.dot(w, y), "g": jnp.sum(y ** 2)}

    problem = distop.Problem(model, {"x": np.ones(4)}, comm=counting)
    own = {} if size == 1 else {"Allreduce": 1}  # (3 int64: 24 bytes, whatever the size)
    for entry in (problem.run, lambda: problem.compute_totals(["f", "g"], "x")):
        for tally in steady(entry):
            assert tally.calls.get("own", {}) == own, tally
            assert tally.received.get("own", 0) == (24 if own else 0), tally
            assert set(tally.calls["operator"]) == {"Allreduce"}, tally  # (counted apart)


def test_a_fused_call_s_rows_are_agreed_in_a_reduction_of_a_fixed_size(counting):
    # two calls of one operator fuse; their VJPs agree across ranks on the nonzero rows
    # of their cotangents: one more Allreduce, one byte per row, whatever the size
    op = mpi_counts.Matvec(np.random.default_rng(rank).standard_normal((3, 4)), comm=counting)
    problem = distop.Problem(lambda x: {"f": jnp.sum(op(x)), "g": jnp.sum(op(2 * x) ** 2)},
                             {"x": np.ones(4)}, comm=counting)
    for tally in steady(lambda: problem.compute_totals(["f", "g"], "x")):
        own = tally.calls.get("own", {})
        assert set(own) <= {"Allreduce"} and own.get("Allreduce", 0) <= 2, tally
        assert tally.received.get("own", 0) <= 24 + 8, tally  # (2 rows of 2 members)


def test_a_replicated_input_s_totals_are_checked_on_a_program_s_first_call_only(counting):
    op = mpi_counts.Matvec(np.ones((2, 3)), comm=counting)
    problem = distop.Problem(lambda x: {"f": jnp.sum(op(x))}, {"x": np.ones(3)},
                             comm=counting)
    with mpi_counts.counting() as first:
        problem.compute_totals("f", "x")
    with mpi_counts.counting() as second:
        problem.compute_totals("f", "x")
    if size > 1:  # the first makes the check: one more Allreduce of distop's own
        assert first.calls["own"].get("Allreduce", 0) > second.calls["own"]["Allreduce"]
    distop.configure(check_collectives=True)
    try:
        checking = distop.Problem(lambda x: {"f": jnp.sum(op(x))}, {"x": np.ones(3)},
                                  comm=counting)
        checking.compute_totals("f", "x")
        with mpi_counts.counting() as again:
            checking.compute_totals("f", "x")
    finally:
        distop.configure(check_collectives=False)
    if size > 1:  # the checking mode checks on every call
        assert again.calls["own"]["Allreduce"] > second.calls["own"]["Allreduce"], again


def test_a_halo_exchange_on_long_blocks_messages_its_two_neighbours_only(counting):
    halo = distop.HaloExchange(width=2, comm=counting)
    rows = 3 + rank % 2  # (uneven, each at least the width)

    def model(x):
        h = halo(x)
        return {"y": h[:-4] + h[2:-2] + h[4:]}

    x = np.arange(rows, dtype=float) + 10 * rank
    problem = distop.Problem(model, {"x": x}, distributed=["x", "y"], comm=counting)
    neighbours = {r for r in (rank - 1, rank + 1) if 0 <= r < size}
    for entry in (problem.run, lambda: problem.compute_totals("y", "x", return_format="local")):
        for tally in steady(entry):
            operator = tally.calls.get("operator", {})
            assert set(operator) <= {"Isend", "Irecv"}, tally  # no collective
            assert tally.peers == neighbours, (tally.peers, neighbours)
            # per halo call, one message to each neighbour and one from each
            calls = operator.get("Isend", 0)
            assert calls == operator.get("Irecv", 0) and calls % max(len(neighbours), 1) == 0


class _Recording(MPI.Intracomm):
    """A communicator that keeps the send buffer specification of each Allreduce."""

    sent: list = []

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):  # noqa: N802 - mpi4py's name
        type(self).sent.append(sendbuf)
        return super().Allreduce(sendbuf, recvbuf, op)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 32, 33, 100])
def test_distop_s_elementwise_maximum_is_right_and_packs_a_short_vector_where_it_helps(
        length):
    from distop._agreement.comm import most

    recording = _Recording(comm.Dup())
    try:
        rng = np.random.default_rng(length + 97 * rank)
        mine = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, length,
                            dtype=np.int64)
        mine[0] = np.iinfo(np.int64).min + rank  # (extremes survive the reduction)
        _Recording.sent.clear()
        found = most(recording, mine)
        every = np.array(comm.allgather(mine))
        np.testing.assert_array_equal(found, every.max(axis=0))
        if size > 1:
            (spec,) = _Recording.sent
            # one element of a datatype of `length` int64s where MPICH would take its
            # two-phase reduction for the array and the vector is short, else the array
            phases = 1 << (size.bit_length() - 1) <= length <= 32
            assert isinstance(spec, list) == phases, spec
            if isinstance(spec, list):
                assert spec[1] == 1 and spec[2].Get_size() == 8 * length, spec
    finally:
        recording.Free()
