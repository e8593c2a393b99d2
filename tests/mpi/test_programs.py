"""A Problem's programs and communicators: run_and_compute_totals, replicated values,
dtypes, the programs kept, a halo exchange, freed communicators, an implicit
operator."""

import os

import distributed_matvec as dm
import jax.numpy as jnp
import numpy as np
from helpers import (
    Coupled,
    Stencil,
    all_close_everywhere,
)
from mpi4py import MPI

import distop

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def test_run_and_compute_totals_gives_what_run_then_compute_totals_give():
    a_local, _, x0, w = dm.setup(8, 3, comm)
    for backend in ("lean", "io_callback"):
        for variant in ("reverse", "forward"):
            problem, twin = (distop.Problem(dm.build(a_local, w, variant), {"x": x0},
                                            backend=backend) for _ in range(2))
            for x in (x0 + 0.25, x0 - 1.0):
                values, totals = problem.run_and_compute_totals(inputs={"x": x})
                expected = twin.run(x=x), twin.compute_totals()
                for got, want in zip((values, totals), expected):
                    assert got.keys() == want.keys()
                    for k in got:
                        np.testing.assert_array_equal(got[k], want[k])
    op = distop.AllreduceSum()
    problem = distop.Problem(lambda b: {"s": op(jnp.sum(b * b))}, {"b": np.ones(2)},
                             distributed=["b"])
    for sizes in ([2] * size, [1 + r for r in range(size)]):
        values, totals = problem.run_and_compute_totals(
            inputs={"b": np.full(sizes[rank], 1.0 + rank)})
        assert values["s"] == sum(n * (1.0 + r) ** 2 for r, n in enumerate(sizes))
        np.testing.assert_array_equal(totals["s", "b"], [np.concatenate(
            [np.full(n, 2.0 + 2 * r) for r, n in enumerate(sizes)])])
        mine = problem.run_and_compute_totals(return_format="local")[1]["s", "b"]
        np.testing.assert_array_equal(mine, [np.full(sizes[rank], 2.0 + 2 * rank)])


# -- reliability ----------------------------------------------------------------------
def test_replicated_values_are_compared_as_values_and_differences_name_rank_and_size():
    problem = distop.Problem(lambda x: {"y": x * 1.0}, {"x": np.zeros(2)},
                             check_replicated=True)
    signed = np.array([0.0, np.nan]) * (-1.0 if rank % 2 else 1.0)  # -0.0 on odd ranks
    np.testing.assert_array_equal(problem.run(x=signed)["y"], [0.0, np.nan])
    differs = np.array([1.0, 2.0 + 1e-3 * (rank == size - 1)])
    try:
        problem.run(x=differs)
    except distop.DistopError as err:
        text = str(err)
        assert f"'x': rank {size - 1} differs from rank 0 by up to 1.000e-03" in text, text
        assert f"'y': rank {size - 1} differs" in text, text
    else:
        raise AssertionError("no error for differing replicated values")


def test_a_dtype_change_of_a_differentiable_input_is_refused_on_every_rank():
    op = distop.AllreduceSum()
    # (copies summed on purpose: through RankLocal)
    problem = distop.Problem(lambda x: {"s": op(distop.RankLocal()(jnp.sum(x * x)))},
                             {"x": np.ones(3)})
    x = np.arange(3) if rank == size - 1 else np.arange(3.0)
    try:
        problem.run(x=x)
    except TypeError as err:  # this rank's own refusal
        assert rank == size - 1 and "is float64 at this Problem's point" in str(err), err
        assert "x.astype(numpy.float64)" in str(err), err
    except distop.DistopError as err:  # another rank's
        assert rank != size - 1 and "int64" in str(err), err
    else:
        raise AssertionError("no error for an integer array in place of a float input")
    # a list of numbers takes the input's dtype; the Problem goes on as before
    assert problem.run(x=[1, 2, 3])["s"] == 14.0 * size


def test_a_problem_keeps_the_programs_of_its_most_recent_shapes_only():
    os.environ["DISTOP_CACHE_SIZE"] = "3"
    try:
        op = distop.AllreduceSum()
        problem = distop.Problem(lambda b: {"s": op(jnp.sum(b * b))}, {"b": np.ones(1)},
                                 distributed=["b"])
    finally:
        del os.environ["DISTOP_CACHE_SIZE"]
    programs = problem._programs
    for n in [2, 3, 4, 5, 2, 6, 2]:  # 2 comes back after it was evicted, then stays
        b = np.full(n + rank, 1.0)  # uneven blocks
        assert problem.run(b=b)["s"] == sum(n + r for r in range(size))
        J = problem.compute_totals()["s", "b"]
        np.testing.assert_array_equal(J, np.full((1, sum(n + r for r in range(size))), 2.0))
        assert len(programs.layouts) <= 3
        assert {id(v) for v in programs.layouts.values()} >= {k[2] for k in programs.programs}


# -- point-to-point operators ---------------------------------------------------------
def test_a_halo_exchange_operator_declares_its_point_to_point_calls():
    sizes = [2 + r for r in range(size)]  # uneven blocks
    n = sum(sizes)
    xg = np.linspace(-1.0, 1.0, n)
    start = sum(sizes[:rank])
    dense = np.eye(n) + np.eye(n, k=1) + np.eye(n, k=-1)
    def model(x):
        y = Stencil()(x)
        return {"y": y, "f": distop.AllreduceSum()(jnp.sum(y ** 2))}

    problem = distop.Problem(model, {"x": xg[start:start + sizes[rank]]},
                             distributed=["x", "y"])
    values = problem.run()
    all_close_everywhere(comm, values["y"], (dense @ xg)[start:start + sizes[rank]])
    totals = problem.compute_totals()
    all_close_everywhere(comm, totals["y", "x"], dense)
    all_close_everywhere(comm, totals["f", "x"], (2 * dense @ dense @ xg)[None])
    assert all(r.ok for r in problem.check_totals(out_stream=None).values())


def _hold_all_communicators_but(spare):
    """Take all but `spare` of the communicators MPI can make (MPICH has 2048 context
    ids), or 4096 if it has more.

    Duplicates of `MPI.COMM_SELF` take them without communicating (a duplicate of the
    world would cost one collective each). Where the ranks' free ids then differ (their
    past differed), `spare` duplicates of the world do not fit: then none is held.

    **Returns:** the duplicates held (free them after).
    """
    held = []
    try:
        while len(held) < 4096:
            held.append(MPI.COMM_SELF.Dup())
    except MPI.Exception:
        pass
    for c in held[len(held) - spare:]:
        c.Free()
    del held[len(held) - spare:]
    trial = []
    try:  # (every rank fails at the same one: the ranks agree on each id)
        while len(trial) < spare:
            trial.append(comm.Dup())
    except MPI.Exception:
        held, trial = held + trial, None
    for c in held if trial is None else trial:
        c.Free()
    return [] if trial is None else held


def test_freeing_a_communicator_frees_distop_s_duplicate_of_it():
    from distop._agreement import comm as _comm

    # With all but 16 of MPI's communicators held, one duplicate left behind per
    # Problem would exhaust them within the loop ("Other MPI error" from MPI_Comm_dup).
    held = _hold_all_communicators_but(16)
    try:
        before = _comm.live_duplicates()
        for _ in range(40):
            mine = comm.Dup()
            problem = distop.Problem(lambda x: {"y": x * 2.0}, {"x": np.ones(2)}, comm=mine)
            del problem
            mine.Free()
            assert _comm.live_duplicates() == before, (before, _comm.live_duplicates())
    finally:
        for c in held:
            c.Free()
    try:
        distop.Problem(lambda x: {"y": x * 2.0}, {"x": np.ones(2)}, comm=mine)
    except distop.DistopError as err:
        assert "MPI.COMM_NULL" in str(err) and "free it only after" in str(err), err
    else:
        raise AssertionError("no error for a Problem on a freed communicator")


def test_what_distop_keeps_per_communicator_goes_with_it():
    from distop._agreement import coordinator as _coordinator

    # a Problem with more distributed inputs widens every agreement on its communicator;
    # a later communicator (which may get the freed one's handle) starts afresh
    first = comm.Dup()
    wide = distop.Problem(lambda a, b: {"s": distop.AllreduceSum()(jnp.sum(a) + jnp.sum(b))},
                          {"a": np.ones(1 + rank), "b": np.ones(2)}, distributed=["a", "b"],
                          comm=first)
    assert _coordinator._widths[wide.comm] == 4 and wide._coordinator.serial == 0
    assert wide.run()["s"] == sum(3 + r for r in range(size))
    first.Free()
    second = comm.Dup()
    narrow = distop.Problem(lambda x: {"s": distop.AllreduceSum()(distop.RankLocal()(
        jnp.sum(x)))}, {"x": np.ones(2)}, comm=second)
    assert _coordinator._widths[narrow.comm] == 2 and narrow._coordinator.serial == 0
    assert narrow.run()["s"] == 2.0 * size
    second.Free()
    for call in (narrow.run, narrow.compute_totals):  # used after: a DistopError, alike
        try:
            call()
        except distop.DistopError as err:
            assert "communicator was freed" in str(err), err
        else:
            raise AssertionError("no error for a Problem used after its communicator")


# -- implicit operators ---------------------------------------------------------------
def test_an_implicit_operator_differentiates_by_its_adjoint():
    sizes = [3, 0, 2, 4][:size] if size > 2 else [3, 2][:size]  # uneven, one empty
    n, start = sum(sizes), sum(sizes[:rank])
    bg = np.linspace(0.5, 2.0, n)
    k = 1.5
    dense = k * np.eye(n) + np.ones((n, n))
    yg = np.linalg.solve(dense, bg)
    op = Coupled()

    def model(b, k):
        y = op(b, k)
        return {"y": y, "f": distop.AllreduceSum()(jnp.sum(y ** 2))}

    problem = distop.Problem(model, {"b": bg[start:start + sizes[rank]], "k": k},
                             distributed=["b", "y"])
    values = problem.run()
    all_close_everywhere(comm, values["y"], yg[start:start + sizes[rank]])
    all_close_everywhere(comm, values["f"], yg @ yg)
    inverse = np.linalg.inv(dense)
    for mode in ("batched", "loop"):
        totals = problem.compute_totals(mode=mode)
        all_close_everywhere(comm, totals["y", "b"], inverse, atol=1e-14)
        all_close_everywhere(comm, totals["y", "k"], -(inverse @ yg)[:, None], atol=1e-14)
        all_close_everywhere(comm, totals["f", "b"], (2 * inverse @ yg)[None], atol=1e-14)
    assert all(r.ok for r in problem.check_totals(out_stream=None).values())
    phases = [(e.operator, e.phase) for e in problem.schedule]
    assert ("Coupled", "solve") in phases and ("Coupled", "adjoint") in phases, phases
