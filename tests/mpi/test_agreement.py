"""The ranks agree before they communicate: where their calls, arguments, shapes or
block sizes differ, every rank raises and no method runs."""

import fractions
import logging
import os
import threading

import distributed_matvec as dm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    all_close_everywhere,
)
from jax import lax
from jax.experimental import io_callback
from mpi4py import MPI

import distop

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


def test_sizes_given_as_numpy_integers_on_some_ranks_only():
    class Reshape(distop.DistributedOperator):
        def output_spec(self, x):  # the same size, of another type on rank 0
            return jax.ShapeDtypeStruct((2, np.int64(3) if rank == 0 else 3), x.dtype)

        def forward(self, comm, x):
            return x.reshape(2, 3)

        def vjp(self, comm, y_bar, x):
            return y_bar.reshape(6)

    problem = distop.Problem(lambda x: {"f": jnp.sum(Reshape()(x))}, {"x": np.arange(6.0)})
    assert all(type(d) is int for e in problem.schedule for s in e.output_shapes for d in s)
    all_close_everywhere(comm, problem.compute_totals()["f", "x"], np.ones((1, 6)))


# -- errors that must reach every rank ------------------------------------------------
def test_model_branching_on_rank_is_a_schedule_mismatch():
    a_local, _, x0, _ = dm.setup(8, 1, comm)
    op = dm.DistributedMatvec(a_local)

    def model(x):
        y = op(x)
        if rank == size - 1:  # the bug: one rank builds a different program
            y = op(y)
        return {"f": jnp.sum(y)}

    try:
        distop.Problem(model, {"x": x0})
    except distop.ScheduleMismatchError as err:
        text = str(err)
        # every rank's own version of the first entry that differs: the second
        lines = [line for line in text.splitlines() if line.startswith("  rank ")]
        assert len(lines) == size, text
        for r, line in enumerate(lines):
            entries = 4 if r == size - 1 else 2
            phase = "forward" if r == size - 1 else "vjp"
            assert line.startswith(f"  rank {r}: {entries} entries; entry 1: "
                                   f"DistributedMatvec.{phase} "), text
        assert "branches on the rank" in text, text
        # (named as what the user called, not as the program built for its schedule)
        assert text.startswith("Problem(...): the ranks compiled different"), text
    else:
        raise AssertionError("no ScheduleMismatchError")
    try:  # the last rank skips the operator: the others' entry is what it lacks
        distop.Problem(lambda x: {"f": jnp.sum(x if rank == size - 1 else op(x))}, {"x": x0})
    except distop.ScheduleMismatchError as err:
        text = str(err)
        assert "rank 0: 2 entries; entry 0: DistributedMatvec.forward " in text, text
        assert (f"rank {size - 1}: 0 entries; entry 0: (none: its schedule ends after 0 "
                "entries)") in text, text
    else:
        raise AssertionError("no ScheduleMismatchError")


def test_a_result_read_on_one_rank_only_is_made_on_every_rank():
    a_local, _, x0, _ = dm.setup(8, 1, comm)
    op1, op2 = dm.DistributedMatvec(a_local), dm.DistributedMatvec(a_local)

    def model(x):
        y, z = op1(x), op2(x)
        # only rank 0's reverse sweep reads op1's result (and op2's): the forward calls
        # it needs are made on every rank, so the collectives still match
        return {"f": jnp.sum(z * y) if rank == 0 else jnp.sum(z) + 0 * jnp.sum(y)}

    problem = distop.Problem(model, {"x": x0}, backend="lean")
    assert all(e.made and e.lean for e in problem.schedule), problem.schedule
    safe = distop.Problem(model, {"x": x0}, backend="io_callback")  # makes every call
    np.testing.assert_allclose(problem.compute_totals()["f", "x"],
                               safe.compute_totals()["f", "x"], rtol=1e-12)


def test_options_differing_between_ranks_raise_everywhere():
    for options in ({"fuse": rank == 0}, {"backend": "lean" if rank == 0 else "io_callback"}):
        try:
            distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": np.ones(3)}, **options)
        except distop.DistopError as err:
            assert "different arguments" in str(err) and "rank 1: ('Problem'" in str(err), err
        else:
            raise AssertionError(f"no error for {options}")


def test_a_model_only_some_ranks_cannot_differentiate_runs_everywhere():
    def model(x):
        if rank == size - 1:  # reverse mode refuses a while_loop: on this rank only
            y = lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0]
        else:
            y = x * 8.0
        return {"f": distop.AllreduceSum()(jnp.sum(y))}

    # made on every rank
    problem = distop.Problem(model, {"x": np.ones(2)}, distributed={"x"})
    assert problem.run()["f"] == 16.0 * size
    try:
        problem.compute_totals()
    except distop.DistopError as err:
        assert rank != size - 1 and "failed on other ranks" in str(err), err
    except ValueError as err:
        assert rank == size - 1 and "Reverse-mode" in str(err), err
    else:
        raise AssertionError("no error")


def test_equal_arguments_of_different_types_agree():
    # each rank spells the same request its own way: every rank runs it
    a_local, a_global, x0, w = dm.setup(8, 1, comm)
    op = dm.DistributedMatvec(a_local)
    problem = distop.Problem(lambda x: {"f": w[0] @ op(x)}, {"x": x0})
    names = ("f", ["f"], ("f",))[rank % 3]
    J = problem.compute_totals(of=names, wrt=["x"] if rank else "x")["f", "x"]
    np.testing.assert_allclose(J, w @ a_global, rtol=1e-12)
    _, totals = problem.run_and_compute_totals(names, mode=np.str_("batched") if rank else
                                               "batched")
    np.testing.assert_allclose(totals["f", "x"], J)
    step = (1e-6, np.float64(1e-6), fractions.Fraction(1, 10 ** 6))[rank % 3]
    checks = problem.check_totals(names, step=step, rtol=1e-6 if rank else np.float64(1e-6),
                                  atol=0 if rank else 0.0, out_stream=None)
    assert all(c.ok for c in checks.values()), checks
    for mode in (["batched"], ["batched"] if rank == 0 else "batched"):  # all, or rank 0
        try:  # unhashable: an error on every rank, not a crash of the ranks that pass it
            problem.compute_totals(mode=mode)
        except ValueError as err:
            assert isinstance(mode, list) and "mode=['batched']" in str(err), err
        except distop.DistopError as err:
            assert "with different arguments" in str(err), err
        else:
            raise AssertionError("no error")


def test_shapes_changing_on_one_rank_raise_everywhere():
    a_local, _, x0, _ = dm.setup(8, 1, comm)
    problem = distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": x0})
    try:
        problem.run(x=np.ones(9) if rank == 0 else x0)
    except distop.DistopError as err:
        assert "inputs of different shapes" in str(err) and "rank 0" in str(err), str(err)
    else:
        raise AssertionError("no error")
    assert problem.run(x=np.ones(9))["f"] == 9.0  # agreed on every rank: recompiles
    try:  # different requests on different ranks: an error everywhere, not a hang
        problem.compute_totals(of="f", mode="batched" if rank == 0 else "loop")
    except distop.DistopError as err:
        assert "with different arguments" in str(err), str(err)
    else:
        raise AssertionError("no error")


def test_calls_that_ran_before_still_agree_before_communicating():
    a_local, _, x0, w = dm.setup(8, 2, comm)
    for backend in ("lean", "io_callback"):
        problem = distop.Problem(dm.build(a_local, w, "reverse"), {"x": x0}, backend=backend)
        expected = problem.run()["f0"], problem.compute_totals()["f0", "x"]
        for _ in range(2):  # both requests ran before (compiled): each still agrees first
            try:  # rank 0 runs, the others compute totals: both start an Allreduce
                problem.run() if rank == 0 else problem.compute_totals()
            except distop.DistopError as err:
                assert "different entry points" in str(err), err
            else:
                raise AssertionError("no error")
        # every rank is in step again: values and totals as before
        np.testing.assert_array_equal(problem.run()["f0"], expected[0])
        np.testing.assert_array_equal(problem.compute_totals()["f0", "x"], expected[1])


class _Squares(distop.DistributedOperator):
    """y = b * b on this rank's block, no collectives; every call logged."""

    log: list

    def forward(self, comm, b):
        self.log.append("forward")
        return b * b

    def vjp(self, comm, y_bar, b):
        self.log.append("vjp")
        return 2.0 * b * y_bar


def test_ranks_that_disagree_on_calls_made_before_run_no_method():
    log = []
    op = _Squares(log=log)
    problem = distop.Problem(lambda b: {"s": distop.AllreduceSum()(jnp.sum(op(b)))},
                             {"b": np.full(2, 1.0 + rank)}, distributed=["b"])
    expected = problem.run()["s"], problem.compute_totals()["s", "b"]
    log.clear()
    problem.compute_totals()
    once = list(log)  # the methods one compute_totals calls
    for _ in range(2):  # both requests made before, on every rank
        for call, other in ((lambda: problem.run(), lambda: problem.compute_totals()),
                            (lambda: problem.compute_totals(of="nothing"),
                             lambda: problem.compute_totals(of="s"))):
            log.clear()
            try:  # rank 0 asks for one thing, the others for another
                call() if rank == 0 else other()
            except distop.DistopError as err:
                assert "with different arguments" in str(err), err
            else:
                raise AssertionError("no error")
            assert log == [], log  # no method ran on any rank
    log.clear()  # every rank is in step again, each call made once
    assert problem.run()["s"] == expected[0] and log == ["forward"], log
    np.testing.assert_array_equal(problem.compute_totals()["s", "b"], expected[1])
    assert log == ["forward"] + once and "vjp" in once, log


def test_block_sizes_changing_on_some_ranks_after_calls_made_before():
    log = []
    op = _Squares(log=log)
    problem = distop.Problem(lambda b: {"s": distop.AllreduceSum()(jnp.sum(op(b)))},
                             {"b": np.ones(2)}, distributed=["b"])
    grown = [3] + [2] * (size - 1)
    last = [2] * (size - 1) + [1]
    # the same sizes again; rank 0's block grows and shrinks back, so that ranks
    # expect different sizes of the same request from their last calls; the last
    # rank's block shrinks while rank 0's sizes stay what they were
    once = None  # the methods one run and one compute_totals call
    for sizes in ([2] * size, [2] * size, grown, [2] * size, grown, grown, [2] * size,
                  last, [2] * size):
        b = np.full(sizes[rank], 1.0 + rank)
        log.clear()
        assert problem.run(b=b)["s"] == sum(n * (1.0 + r) ** 2 for r, n in enumerate(sizes))
        J = problem.compute_totals()["s", "b"]
        np.testing.assert_array_equal(J, [np.concatenate(
            [np.full(n, 2.0 + 2 * r) for r, n in enumerate(sizes)])])
        once = once or list(log)
        assert log == once and "vjp" in once, (sizes, log)


class _LoggedSum(distop.DistributedOperator):
    """y = sum over ranks of x (replicated in and out: an Allreduce in forward and vjp);
    every call logged as (phase, shape of its argument, thread it ran on). While `fail`
    holds True, the forward raises on the last rank."""

    log: list
    fail: list
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)
    batched_vjp = True

    def forward(self, comm, x):
        self.log.append(("forward", x.shape, threading.current_thread().name))
        if self.fail[0] and comm.Get_rank() == comm.Get_size() - 1:
            raise RuntimeError("fails once")
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, y_bar, x):
        self.log.append(("vjp", y_bar.shape, threading.current_thread().name))
        out = np.empty_like(y_bar)
        comm.Allreduce(y_bar, out, op=MPI.SUM)
        return out


@pytest.mark.async_dispatch
def test_ranks_that_disagree_run_no_method_on_any_thread():
    # With JAX's async dispatch kept (the "async" launch: DISTOP_ASYNC_DISPATCH=1), XLA
    # runs a program of more than about 1000 flops on a thread of its own, after the
    # call that dispatched it has returned; its first host call must still make the
    # ranks' agreement before any method runs.
    log = []
    op = _LoggedSum(log=log, fail=[False])
    m = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) / 8)
    problem = distop.Problem(lambda b: {"s": jnp.sum(op(m @ (m @ b)))}, {"b": np.ones(64)})
    expected = problem.run()["s"], problem.compute_totals()["s", "b"]
    threads = {thread for _, _, thread in log}
    assert (threads != {"MainThread"}) == (os.environ.get("DISTOP_ASYNC_DISPATCH") == "1"
                                           and problem.backend == "lean"), threads
    for _ in range(4):  # both requests made before, on every rank
        log.clear()
        try:  # rank 0 runs, the others compute totals: both start an Allreduce of 64
            problem.run() if rank == 0 else problem.compute_totals()
        except distop.DistopError as err:
            assert "different entry points" in str(err), err
        else:
            raise AssertionError("no error")
        assert log == [], log  # no method ran on any rank
    log.clear()  # in step again
    assert problem.run()["s"] == expected[0] and [p for p, *_ in log] == ["forward"], log
    np.testing.assert_array_equal(problem.compute_totals()["s", "b"], expected[1])
    assert [p for p, *_ in log][-1] == "vjp", log


class _LocalScale(distop.DistributedOperator):
    """y = 3 x, no collectives, set to ordered=False; every call logged."""

    log: list
    ordered = False

    def forward(self, comm, x):
        self.log.append("local forward")
        return 3.0 * x

    def vjp(self, comm, y_bar, x):
        self.log.append("local vjp")
        return 3.0 * y_bar


def test_ranks_that_disagree_run_no_unordered_method_either():
    # XLA may run an unordered call before the program's first ordered one, which would
    # otherwise make the ranks' agreement: such a program agrees before it runs
    log = []
    local = _LocalScale(log=log)
    problem = distop.Problem(lambda x: {"s": jnp.sum(distop.AllreduceSum()(local(x)) ** 2)},
                             {"x": np.ones(3)})
    expected = problem.run()["s"], problem.compute_totals()["s", "x"]
    for _ in range(2):  # both requests made before, on every rank
        log.clear()
        try:
            problem.run() if rank == 0 else problem.compute_totals()
        except distop.DistopError as err:
            assert "different entry points" in str(err), err
        else:
            raise AssertionError("no error")
        assert log == [], log
    assert problem.run()["s"] == expected[0]
    np.testing.assert_array_equal(problem.compute_totals()["s", "x"], expected[1])


def test_a_fused_call_agrees_on_rows_only_for_members_wired_alike_on_every_rank():
    # Two VJPs fused into one host call: on rank 0 the second reads the first's result,
    # elsewhere both read the seeds (a model whose data flow depends on the rank). Their
    # schedules are the same; the fused call's Allreduce on the nonzero rows must then
    # run on every rank or none (it had run on some ranks only: MPI aborted the job).
    log = []
    a, b = _LoggedSum(log=log, fail=[False]), _LoggedSum(log=log, fail=[False])

    def model(x, x2):
        if rank == 0:
            return {"f": jnp.sum(b(a(x))), "g": jnp.sum(x2 ** 2), "h": jnp.sum(x)}
        return {"f": jnp.sum(b(x2)) + jnp.sum(a(x)), "g": jnp.sum(x2 ** 2),
                "h": jnp.sum(x)}

    problem = distop.Problem(model, {"x": np.ones(3), "x2": np.ones(3)})
    log.clear()
    try:  # (the totals differ between ranks, as the models do: an error on every rank)
        problem.compute_totals(of=["f", "g"])
    except distop.DistopError as err:
        assert size > 1 and "differ between ranks" in str(err), err
    rows = [(phase, shape) for phase, shape, _ in log]
    assert len(set(map(tuple, comm.allgather(rows)))) == 1, rows  # the same everywhere


@pytest.mark.async_dispatch
def test_a_problem_whose_call_failed_everywhere_runs_again():
    # The checking mode makes one rank's failure an error on every rank; the Problem
    # must then run as before. With JAX's async dispatch kept, XLA reports the failure
    # after the dispatch returned, in the program's outputs, the token among them.
    before = distop.configure().check_collectives
    distop.configure(check_collectives=True)  # (for programs traced from now on)
    try:
        fail = [False]
        op = _LoggedSum(log=[], fail=fail)
        m = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)) / 8)
        problem = distop.Problem(lambda b: {"s": jnp.sum(op(m @ (m @ b)))},
                                 {"b": np.ones(64)})
        expected = problem.run()["s"], problem.compute_totals()["s", "b"]
        fail[0] = True
        try:
            problem.run()
        except (distop.OperatorError, distop.CollectiveMismatchError) as err:
            assert "fails once" in str(err) or "mismatch" in str(err), err
        else:
            raise AssertionError("no error")
        fail[0] = False
        for _ in range(2):
            assert problem.run()["s"] == expected[0]
            np.testing.assert_array_equal(problem.compute_totals()["s", "b"], expected[1])
    finally:
        distop.configure(check_collectives=before)


def test_problems_with_other_numbers_of_distributed_inputs_called_on_different_ranks():
    # their agreements send rows of one width: every rank raises distop's error, where
    # rows of two widths had ended the job with MPI's "message truncated" on 4 ranks
    blocks = distop.Problem(
        lambda x, y: {"f": distop.AllreduceSum()(jnp.sum(x) + jnp.sum(y))},
        {"x": np.ones(1 + rank), "y": np.ones(2)}, distributed=["x", "y"])
    # (copies summed on purpose: through RankLocal, which declares them rank-local)
    plain = distop.Problem(lambda x: {"f": jnp.sum(distop.AllreduceSum()(distop.RankLocal()(x)))},
                           {"x": np.ones(3)})
    expected = blocks.run()["f"], plain.run()["f"]
    for _ in range(2):  # the second time, both requests made before on every rank
        try:
            (plain if rank % 2 else blocks).run()
        except distop.DistopError as err:
            assert "different entry points, of different Problems" in str(err), err
        else:
            raise AssertionError("no error")
        assert (blocks.run()["f"], plain.run()["f"]) == expected  # in step again
    # a Problem with more distributed inputs than any before made on even ranks, another
    # with the same names distributed, two of them its outputs, on odd ones: the widths
    # are agreed as each is made, so the making raises distop's error everywhere
    names = ["x", "y", "z"]
    try:
        if rank % 2 == 0:
            distop.Problem(
                lambda x, y, z: {"f": distop.AllreduceSum()(jnp.sum(x) + jnp.sum(y) + z[0])},
                {"x": np.ones(1 + rank), "y": np.ones(2), "z": np.ones(1)}, distributed=names)
        else:
            distop.Problem(lambda x: {"f": jnp.sum(distop.AllreduceSum()(x)), "y": x, "z": x},
                           {"x": np.ones(3)}, distributed=names)
    except distop.DistopError as err:
        assert "different entry points, of different Problems" in str(err), err
    else:
        raise AssertionError("no error")
    # the same Problem with other distributed inputs on odd ranks
    try:
        distop.Problem(lambda x: {"f": jnp.sum(distop.AllreduceSum()(x))}, {"x": np.ones(3)},
                       distributed=["x"] if rank % 2 else [])
    except distop.DistopError as err:
        assert "the ranks named different distributed values" in str(err), err
        assert "rank 1: ['x']" in str(err) and "rank 0: []" in str(err), err
    else:
        raise AssertionError("no error")


def test_two_problems_called_on_different_ranks_raise_everywhere():
    # the same operator class, collectives and shapes: only which Problem tells them apart
    total, local = distop.AllreduceSum(), distop.RankLocal()  # (copies summed)
    for backend in ("lean", "io_callback"):
        p = distop.Problem(lambda x: {"f": jnp.sum(total(local(x)) ** 2)},
                           {"x": np.ones(3)}, backend=backend)
        q = distop.Problem(lambda x: {"f": jnp.sum(total(local(10.0 * x)))},
                           {"x": np.ones(3)}, backend=backend)
        for call in (lambda pr: pr.run(), lambda pr: pr.compute_totals()):
            try:
                call(q if rank == 1 else p)
            except distop.DistopError as err:
                assert "different entry points, of different Problems" in str(err), err
                assert f"(Problem #{p._coordinator.serial})" in str(err), err
                assert f"(Problem #{q._coordinator.serial})" in str(err), err
            else:
                raise AssertionError("no error")
        size = comm.Get_size()
        assert p.run()["f"] == 3 * size ** 2 and q.run()["f"] == 30 * size  # in step


def test_arguments_refused_on_one_rank_raise_on_every_rank():
    problem = distop.Problem(
        lambda x: {"f": jnp.sum(distop.AllreduceSum()(distop.RankLocal()(x)) ** 2)},
        {"x": np.ones(3)})
    bad = [lambda: problem.run(x="abc"), lambda: problem.run(z=1.0),
           lambda: problem.run_and_compute_totals(inputs=[1.0])]
    for i, call in enumerate(bad):
        who = i % comm.Get_size()  # this rank's arguments are bad, the others' fine
        try:
            call() if rank == who else problem.run_and_compute_totals(inputs={"x": np.ones(3)})
        except distop.DistopError as err:
            assert rank != who and "refused their arguments" in str(err), err
            assert f"rank {who}: " in str(err), err
        except (TypeError, ValueError) as err:
            assert rank == who and not isinstance(err, distop.DistopError), err
        else:
            raise AssertionError("no error")
        # every rank is in step again
        assert problem.run(x=np.full(3, 2.0))["f"] == 12.0 * comm.Get_size() ** 2
    try:  # every rank refuses: each raises its own error, and all stay in step
        problem.run(z=1.0)
    except distop.DistopError as err:
        raise AssertionError(f"not this rank's own error: {err}") from err
    except ValueError as err:
        assert "no input named 'z'" in str(err), err
    else:
        raise AssertionError("no error")
    assert problem.run()["f"] == 12.0 * comm.Get_size() ** 2
    made = [  # also when the Problem is made: rank 0's arguments are bad
        (dict(inputs={"x": "abc"}), "TypeError: Problem(inputs={'x': ...}): got a str"),
        (dict(inputs=[np.ones(2)]), "TypeError: Problem(inputs=...): expected a non-empty"),
        (dict(inputs={"x": np.ones(2)}, backend="leen"), "ValueError: Problem(backend='leen')"),
    ]
    for kwargs, text in made:
        if rank != 0:
            kwargs = dict(inputs={"x": np.ones(2)})
        try:
            distop.Problem(lambda x: {"f": x * 2.0}, **kwargs)
        except distop.DistopError as err:
            assert rank != 0 and f"rank 0: {text}" in str(err), err
        except (TypeError, ValueError) as err:
            assert rank == 0 and text.split(": ", 1)[1] in str(err), err
        else:
            raise AssertionError("no error")
    # every rank made (and counted) each of them: the next Problem is the same everywhere
    assert distop.Problem(lambda x: {"f": x * 2.0}, {"x": np.ones(2)}).run()["f"][0] == 2.0
    for form in ("sideways", "central" if rank else "sideways"):  # all, or rank 0 only
        try:
            problem.check_totals(form=form, out_stream=None)
        except ValueError as err:
            assert form == "sideways" and "check_totals(form='sideways')" in str(err), err
        except distop.DistopError as err:
            assert "with different arguments" in str(err), err
        else:
            raise AssertionError("no error")
    assert all(c.ok for c in problem.check_totals(out_stream=None).values())


def test_shared_inputs_and_one_refused_on_one_rank():
    # copy=None: each rank's distributed block, made by distop.empty, read in place
    x = distop.empty(rank + 1)
    x[:] = 1.0
    problem = distop.Problem(lambda x: {"s": distop.AllreduceSum()(jnp.sum(x ** 2))},
                             {"x": x}, distributed=["x"], copy=False)
    assert problem._point["x"] is x
    total = sum(r + 1 for r in range(comm.Get_size()))
    assert problem.run()["s"] == total
    J = problem.compute_totals()["s", "x"]
    np.testing.assert_array_equal(J, np.full((1, total), 2.0))
    who = comm.Get_size() - 1  # its new block needs a copy, which copy=False refuses
    try:
        problem.run(x=np.arange(rank + 3.0)[1:] if rank == who else x)
    except distop.DistopError as err:
        assert rank != who and f"rank {who}: ValueError" in str(err), err
    except ValueError as err:
        assert rank == who and "Problem(copy=False)" in str(err), err
    else:
        raise AssertionError("no error")
    assert problem._point["x"] is x and problem.run()["s"] == total  # in step


def test_thirty_two_bit_mode_with_float32_values():
    jax.config.update("jax_enable_x64", False)
    try:
        op = distop.AllreduceSum()
        problem = distop.Problem(lambda x: {"s": op(jnp.sum(x ** 2))},
                                 {"x": np.full(rank + 1, 2.0, np.float32)}, distributed=["x"])
        total = sum(r + 1 for r in range(comm.Get_size()))
        for _ in range(3):
            assert problem.run()["s"] == 4.0 * total and problem._executor.token.dtype == np.float32
        J = problem.compute_totals()["s", "x"]
        assert J.dtype == np.float32 and J.tolist() == [[4.0] * total]
        assert all(c.ok for c in problem.check_totals(step=5e-3, rtol=1e-3,
                                                      out_stream=None).values())
    finally:
        jax.config.update("jax_enable_x64", True)


def test_forward_mode_without_a_jvp_raises_on_every_rank():
    class NoJvp(distop.DistributedOperator):
        forward_collectives = ("Allreduce",)

        def forward(self, comm, x):
            out = np.empty_like(x)
            comm.Allreduce(x, out)
            return out

    op, x = NoJvp(), np.ones(3)
    for forward_mode in (lambda: jax.jvp(op, (x,), (x,)), lambda: jax.jacfwd(op)(x),
                         lambda: jax.jit(jax.jacfwd(op))(x)):
        try:
            forward_mode()
        except distop.MissingMethodError as err:
            assert "NoJvp does not implement jvp" in str(err), err
        else:
            raise AssertionError("no error")
    np.testing.assert_array_equal(op(x), np.full(3, comm.Get_size()))  # in step


def test_a_communicator_made_after_one_is_freed_gets_its_own_duplicate():
    # MPI gives the new communicator the freed one's handle: distop must not take it for
    # the old one (whose private duplicate has another group of ranks)
    alone = comm.Split(rank, 0)
    assert distop.Problem(lambda x: {"f": x * 2.0}, {"x": np.ones(2)}, comm=alone).comm.size == 1
    alone.Free()
    every = comm.Dup()
    problem = distop.Problem(lambda x: {"s": distop.AllreduceSum()(jnp.sum(x))},
                             {"x": np.ones(2)}, comm=every, distributed=["x"])
    assert problem.comm.Get_size() == comm.Get_size()
    assert problem.run()["s"] == 2.0 * comm.Get_size()
    every.Free()


def test_block_sizes_changing_on_some_ranks_are_agreed_again():
    op = distop.AllreduceSum()
    problem = distop.Problem(lambda b: {"s": op(jnp.sum(b * b))}, {"b": np.ones(2)},
                             distributed=["b"])
    # rank 0 changes its block, the others keep theirs (the same local shapes as the
    # call before, whose program exists): every call agrees on every rank's sizes
    for sizes in ([2] * size, [3] + [2] * (size - 1), [3] + [2] * (size - 1), [2] * size,
                  [2] + [5] * (size - 1), [2] * size):
        b = np.full(sizes[rank], 1.0 + rank)
        expected = sum(n * (1.0 + r) ** 2 for r, n in enumerate(sizes))
        assert problem.run(b=b)["s"] == expected
        J = problem.compute_totals()["s", "b"]
        np.testing.assert_array_equal(J, [np.concatenate([np.full(n, 2.0 + 2 * r)
                                                          for r, n in enumerate(sizes)])])


def test_a_model_with_collectives_of_its_own_and_changing_block_sizes():
    class Local(distop.DistributedOperator):  # no collectives: runs before the others
        def forward(self, comm, b):
            calls.append(1)
            return b * b

    def own_sum(b):  # the model's own ordered callback, with an Allreduce of its own
        return np.asarray(comm.allreduce(float(np.sum(b))))

    def model(b):
        own = io_callback(own_sum, jax.ShapeDtypeStruct((), np.float64), lax.stop_gradient(b),
                          ordered=True)
        return {"s": distop.AllreduceSum()(jnp.sum(Local()(b))) + own}

    calls, logged = [], []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("jax._src.callback").addHandler(handler)
    try:
        for backend in ("lean", "io_callback"):
            problem = distop.Problem(model, {"b": np.ones(2)}, distributed=["b"],
                                     backend=backend)
            # every rank has run the request before, then rank 0's block grows: no rank
            # may enter the model's own Allreduce while another agrees on the sizes
            for sizes in ([2] * size, [2] * size, [3] + [2] * (size - 1), [2] * size,
                          [2] * size):
                b = np.full(sizes[rank], 1.0 + rank)
                calls.clear()
                assert problem.run(b=b)["s"] == sum(n * (1.0 + r) ** 2 + n * (1.0 + r)
                                                    for r, n in enumerate(sizes))
                assert len(calls) == 1, (backend, sizes, calls)
    finally:
        logging.getLogger("jax._src.callback").removeHandler(handler)
    assert not logged, [r.getMessage() for r in logged]  # no callback failed


def test_a_steady_call_enters_the_agreement_once_and_makes_it_in_its_program(monkeypatch):
    from distop._agreement import coordinator as _coordinator
    from distop._hostcalls import ffi as _ffi

    a_local, _, x0, w = dm.setup(8, 2, comm)
    problem = distop.Problem(dm.build(a_local, w, "reverse"), {"x": x0}, distributed="x")
    expected = problem.run()["f0"], problem.compute_totals()["f0", "x"]
    entered, made = [], []
    for name, method in list(vars(_coordinator.Coordinator).items()):
        if name.startswith("__") or not callable(method):
            continue
        monkeypatch.setattr(_coordinator.Coordinator, name,
                            lambda self, *a, _m=method, _n=name, **k:
                            entered.append(_n) or _m(self, *a, **k))
    differs = _coordinator.CallAgreement.anything_differs

    def anything_differs(self):  # who makes it: the FFI handler, in the program's first call
        made.append(any(f.f_code is _ffi._handler.__code__ for f in _frames()))
        return differs(self)

    monkeypatch.setattr(_coordinator.CallAgreement, "anything_differs", anything_differs)
    np.testing.assert_array_equal(problem.run()["f0"], expected[0])
    np.testing.assert_array_equal(problem.compute_totals()["f0", "x"], expected[1])
    # one entry into the agreement per call, and one collective: made in the program,
    # except where its programs cannot (the checking mode, the io_callback backend)
    in_program = all(p.makes_agreement for p in problem._programs.programs.values())
    assert in_program is (problem.backend == "lean" and not distop.configure().check_collectives)
    assert entered == ["request", "request"], entered
    assert made == [in_program, in_program], made
    assert not hasattr(_coordinator, "_offered")


def _frames():
    """The frames of the calling thread, innermost first."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back
