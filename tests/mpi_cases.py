"""Cases run under `mpiexec -n P python tests/mpi_cases.py GROUP` by tests/test_mpi.py.

Many cases per launch: each launch pays JAX's start-up on every rank. Any failure
aborts the whole job (so no rank waits forever) and the test sees a non-zero exit code.
"""

import fractions
import io
import logging
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)
import distributed_matvec as dm  # noqa: E402
from helpers import (  # noqa: E402
    Cube,
    RankSum,
    RowScale,
    ScaledSum,
    all_close_everywhere,
    loops_since,
    run_cases,
    totals_jaxpr,
    without_loops,
)

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
CASES = {}


def case(group):
    def register(fn):
        CASES.setdefault(group, []).append(fn)
        return fn
    return register


# -- the matvec scenario --------------------------------------------------------------
def matvec_scenario(objectives, variants, modes):
    for k in objectives:
        a_local, a_global, x0, w = dm.setup(60, k, comm)
        for variant in variants:
            problem = distop.Problem(dm.build(a_local, w, variant), {"x": x0})
            for mode in modes:
                err = comm.allreduce(dm.errors(problem, a_global, x0, w, mode, calls=3),
                                     op=MPI.MAX)
                assert err <= 1e-12, f"K={k} {variant} {mode}: error {err:.1e}"


@case("matvec")
def matvec_batched_and_loop():
    matvec_scenario((1, 9, 10, 16, 32), ("reverse", "forward"), ("batched", "loop"))


@case("matvec")
def matvec_unrolled():
    matvec_scenario((1, 9, 10, 16, 32), ("reverse",), ("unrolled",))
    matvec_scenario((1, 9, 10, 16), ("forward",), ("unrolled",))


@case("matvec")
def one_vector_objective_drops_the_unit_seed_product_on_every_rank():
    # one output f = W y: its seeds are the identity, the same on every rank, so every
    # rank's program skips seeds @ W (and its VJP gets x once, expand_dims)
    a_local, a_global, x0, w = dm.setup(40, 6, comm)
    op = dm.DistributedMatvec(a_local)
    problem = distop.Problem(lambda x, w: {"f": w @ op(x)}, {"x": x0, "w": w})
    for _ in range(2):
        J = problem.compute_totals("f", "x")["f", "x"]
        all_close_everywhere(comm, J, w @ a_global, atol=1e-12)
    if problem.backend != "lean":  # only lean programs are rewritten
        return
    program = next(p for key, p in problem._programs.programs.items()
                   if key[0] == "compute_totals" and key[1][1:3] == (("f",), ("x",)))
    jaxpr = program.fn.trace(jax.ShapeDtypeStruct((), np.float64),
                             {"x": jax.ShapeDtypeStruct(x0.shape, x0.dtype),
                              "w": jax.ShapeDtypeStruct(w.shape, w.dtype)},
                             jax.ShapeDtypeStruct((6, 6), np.float64)).jaxpr
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert all(e.invars[0].aval.shape == w.shape for e in products), products


@case("matvec")
def matvec_ordered_is_default_and_verified():
    a_local, _, x0, w = dm.setup(20, 4, comm)
    problem = distop.Problem(dm.build(a_local, w, "forward"), {"x": x0})
    phases = [e.phase for e in problem.schedule]
    assert phases == ["forward"] * 4 + ["vjp"] * 4, phases
    assert all(e.ordered and e.collectives == ("Allreduce",) for e in problem.schedule)
    assert [e.batch for e in problem.schedule[4:]] == [(4,)] * 4


class Logged(distop.DistributedOperator):
    """y = x + Allreduce(1): logs every call, and any call that starts while another
    distop call is still running on this rank."""

    index: int
    log: list
    active: list
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)
    batched_vjp = True

    def _enter(self, phase, comm):
        self.active[0] += 1
        self.log.append((phase, self.index, self.active[0]))
        one = np.ones(1)
        total = np.empty(1)
        comm.Allreduce(one, total, op=MPI.SUM)  # a collective in every call
        self.active[0] -= 1
        return total[0]

    def forward(self, comm, x):
        return x + self._enter("forward", comm) - size

    def vjp(self, comm, y_bar, x):
        self._enter("vjp", comm)
        return y_bar.copy()


def calls_run_exactly_once_in_order_one_at_a_time(backend):
    k = 24  # well above the 10 independent calls at which XLA starts to overlap them
    log, active = [], [0]
    ops = [Logged(i, log, active) for i in range(k)]
    problem = distop.Problem(lambda x: {f"f{i}": jnp.sum(op(x)) * (i + 1)
                                        for i, op in enumerate(ops)},
                             {"x": np.ones(3)}, backend=backend)
    assert all(e.lean == (backend == "lean") for e in problem.schedule), problem.schedule
    forward = [("forward", i, 1) for i in range(k)]
    backward = [("vjp", i, 1) for i in reversed(range(k))]
    for _ in range(3):
        log.clear()
        out = problem.run()
        assert log == forward, log  # each call once, in program order, never overlapping
        all_close_everywhere(comm, [out[f"f{i}"] for i in range(k)], 3 * np.arange(1, k + 1))
        log.clear()
        J = problem.compute_totals()
        # on the lean path the forward calls are not made: nothing in the reverse sweep
        # reads their results (the vjp takes x)
        assert log == (backward if backend == "lean" else forward + backward), log
        all_close_everywhere(comm, J[f"f{k - 1}", "x"], np.full((1, 3), k))
    every = comm.allgather(log)
    assert all(other == log for other in every)


@case("core")
def lean_calls_run_exactly_once_in_order_one_at_a_time():
    calls_run_exactly_once_in_order_one_at_a_time("lean")


@case("core")
def io_callback_calls_run_exactly_once_in_order_one_at_a_time():
    calls_run_exactly_once_in_order_one_at_a_time("io_callback")


@case("core")
def fusion_runs_independent_neighbours_in_one_call_in_the_same_order():
    log, active = [], [0]
    ops = [Logged(i, log, active) for i in range(6)]

    def model(x):
        a, b = ops[0](x), ops[1](2 * x)  # independent: one host call
        c = ops[2](a * b)  # reads both: a host call after theirs
        d = ops[3](x)  # independent of c: joins it
        e = ops[4](jnp.sin(c))  # reads c: a new host call
        return {"f": jnp.sum(e ** 2) + jnp.sum(d * x), "g": jnp.sum(ops[5](c) * a)}

    x0 = np.array([0.3, -0.7, 1.1])
    runs = {}
    for fuse in (True, False):
        problem = distop.Problem(model, {"x": x0}, fuse=fuse, backend="lean")
        log.clear()
        values = problem.run()
        forward = list(log)
        log.clear()
        J = problem.compute_totals()
        runs[fuse] = (problem.schedule, forward, list(log), values, J)
    (fused, f_log, t_log, values, J), (plain, f_plain, t_plain, v_plain, J_plain) = (
        runs[True], runs[False])
    assert [e.group for e in plain] == list(range(len(plain))), plain
    groups = [e.group for e in fused]
    assert groups == sorted(groups) and len(set(groups)) < len(fused), fused
    assert fused[0].group == fused[1].group != fused[2].group == fused[3].group, fused
    assert fused[4].group != fused[3].group, fused
    # the same calls, in the same order, one at a time; the same numbers, bit for bit
    assert f_log == f_plain and t_log == t_plain and all(n == 1 for *_, n in t_log), t_log
    assert [e.describe().rsplit(" call ", 1)[0] for e in fused] == [
        e.describe().rsplit(" call ", 1)[0] for e in plain]
    assert all(np.array_equal(values[k], v_plain[k]) for k in values)
    assert all(np.array_equal(J[k], J_plain[k]) for k in J)
    all_close_everywhere(comm, J["f", "x"], jax.jacrev(
        lambda x: jnp.sum(jnp.sin(x * 2 * x) ** 2) + jnp.sum(x * x))(x0)[None])


@case("core")
def fused_vjps_agree_on_their_nonzero_seed_rows():
    seen = []

    class Weighted(distop.DistributedOperator):
        """y = c_r * x summed over ranks (an Allreduce in forward and vjp)."""

        c: float
        forward_collectives = vjp_collectives = ("Allreduce",)
        batched_vjp = True

        def _total(self, comm):
            total = np.empty(1)
            comm.Allreduce(np.array([self.c * (rank + 1)]), total, op=MPI.SUM)
            return total[0]

        def forward(self, comm, x):
            return self._total(comm) * x

        def vjp(self, comm, y_bar, x):
            seen.append((self.c, y_bar.shape[0]))
            return self._total(comm) * y_bar

    ops = [Weighted(float(c)) for c in (1, 2, 3)]
    # f_i reads only op i, g none of them; the cotangents depend on x, so the rows are
    # found when the program runs
    problem = distop.Problem(
        lambda x: {**{f"f{i}": jnp.sum(op(x) * x) for i, op in enumerate(ops)},
                   "g": jnp.sum(x)}, {"x": np.ones(2)}, backend="lean")
    J = problem.compute_totals()
    weight = size * (size + 1) / 2
    for i, c in enumerate((1, 2, 3)):
        all_close_everywhere(comm, J[f"f{i}", "x"], np.full((1, 2), 2 * c * weight))
    # four seeds; each VJP gets only its own row, on every rank, so its collective meets
    assert sorted(seen) == [(1.0, 1), (2.0, 1), (3.0, 1)], seen
    assert comm.allgather(sorted(seen)) == [sorted(seen)] * size


@case("core")
def vjps_are_given_the_rows_some_rank_needs_on_every_rank():
    from distop._passes import rows

    class Weighted(distop.DistributedOperator):
        """y = c * sum over ranks of (rank + 1) * x (an Allreduce in forward and vjp)."""

        c: float
        forward_collectives = vjp_collectives = ("Allreduce",)
        batched_vjp = True

        def forward(self, comm, x):
            out = np.empty_like(x)
            comm.Allreduce(self.c * (comm.rank + 1) * x, out, op=MPI.SUM)
            return out

        def vjp(self, comm, y_bar, x):
            out = np.empty_like(y_bar)
            comm.Allreduce(self.c * (comm.rank + 1) * y_bar, out, op=MPI.SUM)
            return out

    ops = [Weighted(float(c)) for c in (1, 2, 3)]

    def model(x):  # four seeds; op i's cotangent, a constant, is nonzero in row i only
        return {**{f"f{i}": jnp.sum(op(x)) for i, op in enumerate(ops)}, "g": jnp.sum(x)}

    # Ranks other than 0 report the next row instead (as a model whose constants differ
    # between ranks would): each call must get both rows everywhere, or its collectives
    # would meet the wrong rows, and rank 0's row would be lost elsewhere.
    known = rows.known_rows

    def shifted(closed):
        found = known(closed)
        return found if rank == 0 else {p: (min(a + 1, 3), min(b + 1, 4))
                                        for p, (a, b) in found.items()}

    rows.known_rows = shifted
    try:
        problem = distop.Problem(model, {"x": np.ones(2)}, backend="lean")
        J = problem.compute_totals()
    finally:
        rows.known_rows = known
    weight = size * (size + 1) / 2
    for i, c in enumerate((1, 2, 3)):
        all_close_everywhere(comm, J[f"f{i}", "x"], np.full((1, 2), c * weight))
    batches = sorted(c.batch_shape for c in totals_jaxpr(problem)[1] if c.phase == "vjp")
    assert batches == ([(1,)] * 3 if size == 1 else [(2,)] * 3), batches


@case("core")
def calls_given_rows_alike_where_ranks_build_different_programs():
    seen = []
    first, second = RowScale(2.0, seen), RowScale(3.0, seen)

    def model(x, w):
        y = first(x)
        z = second(y)
        out = {"a": jnp.sum(x), "c": z[0], "d": z[1] + z[2]}
        # only ranks holding rows of w add a term in y: there, the second call's
        # cotangent reaches the first through a sum; elsewhere, directly
        out["e"] = jnp.sum(y) * jnp.sum(w) if w.shape[0] else jnp.sum(w)
        return out

    w = np.ones(1) if rank == 0 else np.zeros(0)
    problem = distop.Problem(model, {"x": np.array([1.0, 2.0, 3.0]), "w": w},
                             distributed=["w"], backend="lean")
    J = problem.compute_totals(wrt="x")
    # the same rows everywhere, so every Allreduce meets its partners
    assert comm.allgather(seen) == [seen] * size, seen
    reference = distop.Problem(model, {"x": np.array([1.0, 2.0, 3.0]), "w": w},
                               distributed=["w"], backend="io_callback")
    R = reference.compute_totals(wrt="x")
    for key in R:
        all_close_everywhere(comm, J[key], R[key])


@case("core")
def a_long_chain_runs_in_segments_with_every_collective_once_in_order():
    from distop._passes import segments

    # no loops: the chain as it is
    without_loops(lambda: _chain_runs_every_collective_once_in_order(segments.SEGMENT + 6))


@case("core")
def a_repeated_stretch_runs_as_one_loop_with_every_collective_once_in_order():
    from distop import _ffi
    from distop._passes import loops

    before = set(_ffi._calls)
    problem = _chain_runs_every_collective_once_in_order(2 * loops.REPEATS + 3)
    assert loops_since(before)  # (its call sites live as long as the Problem)
    del problem


def _chain_runs_every_collective_once_in_order(n):
    log, active = [], [0]
    ops = [Logged(i, log, active) for i in range(n)]

    def model(x):
        for op in ops:
            x = jnp.sin(op(x))  # an XLA operation between the calls: nothing fuses
        return {"f": jnp.sum(x)}

    problem = distop.Problem(model, {"x": np.array([0.2, -0.4])}, backend="lean")
    assert all(e.lean for e in problem.schedule)
    assert len({e.group for e in problem.schedule}) == 2 * n
    log.clear()
    f = problem.run()["f"]
    assert log == [("forward", i, 1) for i in range(n)], log
    log.clear()
    J = problem.compute_totals()["f", "x"]
    assert log == ([("forward", i, 1) for i in range(n)]
                   + [("vjp", i, 1) for i in reversed(range(n))]), log
    x = jnp.array([0.2, -0.4])
    reference = jax.value_and_grad(lambda x: jnp.sum(_sin_chain(x, n)))(x)
    all_close_everywhere(comm, f, reference[0])
    all_close_everywhere(comm, J[0], reference[1])
    return problem


def _sin_chain(x, n):
    for _ in range(n):
        x = jnp.sin(x)  # Logged's forward adds Allreduce(1) - size = 0
    return x


@case("core")
def operators_in_the_models_own_loops_run_lean_once_each_in_order():
    log, active = [], [0]
    op = Logged(0, log, active)

    def model(x):
        y = lax.scan(lambda c, _: (op(c), None), x, None, length=2)[0]
        y = lax.cond(jnp.sum(y) > 0, op, lambda c: op(op(c)), y)
        return {"f": jnp.sum(jax.checkpoint(lambda c: jnp.sin(op(c)))(y))}

    x = np.linspace(0.1, 0.3, 2)
    problem = distop.Problem(model, {"x": x}, backend="lean")
    assert all(e.lean for e in problem.schedule), problem.schedule
    contexts = {e.context for e in problem.schedule}
    assert {"scan[2]", "cond.branch0", "cond.branch1", "checkpoint"} <= contexts, contexts
    for _ in range(2):
        log.clear()
        all_close_everywhere(comm, problem.run()["f"], np.sum(np.sin(x)))
        assert log == [("forward", 0, 1)] * 4, log
        log.clear()
        all_close_everywhere(comm, problem.compute_totals()["f", "x"], np.cos(x)[None])
        # the scan's two steps and the branch, then the checkpoint's call, recomputed
        # in the reverse sweep, and the vjps in reverse order
        assert log == [("forward", 0, 1)] * 5 + [("vjp", 0, 1)] * 4, log
        every = comm.allgather(log)
        assert all(other == log for other in every)
    # an operator in a while loop's condition is beyond the token: io_callback
    beyond = distop.Problem(
        lambda x: {"f": lax.while_loop(lambda c: jnp.sum(op(c)) > 1, lambda c: c / 2, x)},
        {"x": np.ones(2)}, backend="lean")
    assert [(e.context, e.lean) for e in beyond.schedule] == [("while", False)]
    all_close_everywhere(comm, beyond.run()["f"], np.full(2, 0.5))
    # a vmap the model applies itself keeps the chain: lean, proven, and exact
    inner = distop.Problem(lambda x: {"f": jnp.sum(jax.vmap(op)(x) ** 2)},
                           {"x": np.arange(6.0).reshape(3, 2)}, backend="lean")
    assert all(e.lean for e in inner.schedule), inner.schedule
    all_close_everywhere(comm, inner.compute_totals()["f", "x"], 2 * np.arange(6.0)[None])


# -- operators used directly in JAX code ----------------------------------------------
@case("core")
def several_inputs_and_outputs_with_a_0d_input():
    a, b, t = np.arange(3.0) + 1, np.arange(2.0) - 0.5, np.array(1.5)
    total = size * (size + 1) / 2
    op = ScaledSum()
    problem = distop.Problem(lambda a, b, t: dict(zip("uv", op(a, b, t))),
                             {"a": a, "b": b, "t": t})
    out = problem.run()
    all_close_everywhere(comm, out["u"], total * a)
    all_close_everywhere(comm, out["v"], total * b * t)
    for mode in distop._problem.MODES:
        J = problem.compute_totals(mode=mode)
        all_close_everywhere(comm, J["u", "a"], total * np.eye(3))
        all_close_everywhere(comm, J["v", "b"], total * t * np.eye(2))
        all_close_everywhere(comm, J["v", "t"], (total * b)[:, None])
        all_close_everywhere(comm, J["u", "t"], np.zeros((3, 1)))
    g = jax.grad(lambda a, b, t: jnp.sum(op(a, b, t)[1]), argnums=2)(a, b, t)
    all_close_everywhere(comm, g, total * b.sum())


@case("core")
def unused_output_still_runs_its_vjp():
    a, b, t = np.ones(3), np.ones(2), np.array(2.0)
    total = size * (size + 1) / 2
    op = ScaledSum()
    problem = distop.Problem(lambda a, b, t: {"u": jnp.sum(op(a, b, t)[0])},
                             {"a": a, "b": b, "t": t})
    assert [e.phase for e in problem.schedule] == ["forward", "vjp"]
    J = problem.compute_totals(of="u", wrt=["a", "t"])
    all_close_everywhere(comm, J["u", "a"], total * np.ones((1, 3)))
    all_close_everywhere(comm, J["u", "t"], np.zeros((1, 1)))


@case("core")
def rank_local_input_gets_the_full_cotangent():
    x = np.arange(4.0) * (rank + 1)
    op = RankSum()
    s = jax.jit(op)(x)
    all_close_everywhere(comm, s, np.arange(4.0) * size * (size + 1) / 2)
    g = jax.grad(lambda x: jnp.sum(op(x) ** 2))(x)
    all_close_everywhere(comm, g, 2 * np.asarray(s))  # d/dx_r: the full s_bar


@case("core")
def operators_inside_scan_and_fori_loop():
    a_local, a_global, x0, _ = dm.setup(30, 1, comm)
    op = dm.DistributedMatvec(a_local)
    a_norm = a_global / np.linalg.norm(a_global, 2)
    op_norm = dm.DistributedMatvec(a_local / np.linalg.norm(a_global, 2))

    def model(x):
        y, _ = lax.scan(lambda c, _: (op_norm(c), None), x, None, length=3)
        z = lax.fori_loop(0, 2, lambda i, c: op_norm(c), x)
        return {"f": jnp.sum(y ** 2) + jnp.sum(z)}

    problem = distop.Problem(model, {"x": x0})
    assert any("scan[3]" in e.context for e in problem.schedule), problem.schedule
    m3 = np.linalg.matrix_power(a_norm, 3)
    m2 = np.linalg.matrix_power(a_norm, 2)
    y = m3 @ x0
    all_close_everywhere(comm, problem.run()["f"], y @ y + np.sum(m2 @ x0))
    exact = 2 * m3.T @ y + m2.T @ np.ones(30)
    for mode in distop._problem.MODES:
        all_close_everywhere(comm, problem.compute_totals(mode=mode)["f", "x"][0], exact)
    del op


@case("core")
def jacrev_and_vmap_directly():
    a_local, a_global, x0, _ = dm.setup(12, 1, comm)
    op = dm.DistributedMatvec(a_local)
    all_close_everywhere(comm, jax.jit(jax.jacrev(op))(x0), a_global)
    all_close_everywhere(comm, jax.jit(jax.jacfwd(op))(x0), a_global)  # forward mode
    _, y_dot = jax.jvp(op, (x0,), (np.ones(12),))
    all_close_everywhere(comm, y_dot, a_global @ np.ones(12))
    xs = np.stack([x0, 2 * x0, -x0])
    all_close_everywhere(comm, jax.vmap(op)(xs), xs @ a_global.T)
    all_close_everywhere(comm, jax.vmap(jax.vmap(op))(xs[None]), (xs @ a_global.T)[None])
    g = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(op(x)))))(xs)
    all_close_everywhere(comm, g, np.cos(xs @ a_global.T) @ a_global)


@case("core")
def local_operator_mixed_with_collectives():
    a_local, a_global, x0, _ = dm.setup(10, 1, comm)
    mv, cube = dm.DistributedMatvec(a_local), Cube()
    assert not cube.is_ordered() and mv.is_ordered()
    problem = distop.Problem(lambda x: {"f": jnp.sum(mv(cube(x)))}, {"x": x0})
    # on the lean path the local operator's calls join the chain; on io_callback they
    # stay unordered
    lean = problem.schedule[1].lean
    assert [e.ordered for e in problem.schedule] == [lean, True, True, lean]
    assert [e.lean for e in problem.schedule] == [lean] * 4
    all_close_everywhere(comm, problem.run()["f"], np.sum(a_global @ x0 ** 3))
    exact = 3 * x0 ** 2 * (a_global.T @ np.ones(10))
    all_close_everywhere(comm, problem.compute_totals()["f", "x"][0], exact)


@case("core")
def sizes_given_as_numpy_integers_on_some_ranks_only():
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
@case("core")
def model_branching_on_rank_is_a_schedule_mismatch():
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


@case("core")
def a_result_read_on_one_rank_only_is_made_on_every_rank():
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


@case("core")
def options_differing_between_ranks_raise_everywhere():
    for options in ({"fuse": rank == 0}, {"backend": "lean" if rank == 0 else "io_callback"}):
        try:
            distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": np.ones(3)}, **options)
        except distop.DistopError as err:
            assert "different arguments" in str(err) and "rank 1: ('Problem'" in str(err), err
        else:
            raise AssertionError(f"no error for {options}")


@case("core")
def a_model_only_some_ranks_cannot_differentiate_runs_everywhere():
    def model(x):
        if rank == size - 1:  # reverse mode refuses a while_loop: on this rank only
            y = lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0]
        else:
            y = x * 8.0
        return {"f": distop.AllreduceSum()(jnp.sum(y))}

    problem = distop.Problem(model, {"x": np.ones(2)})  # made on every rank
    assert problem.run()["f"] == 16.0 * size
    try:
        problem.compute_totals()
    except distop.DistopError as err:
        assert rank != size - 1 and "failed on other ranks" in str(err), err
    except ValueError as err:
        assert rank == size - 1 and "Reverse-mode" in str(err), err
    else:
        raise AssertionError("no error")


@case("core")
def equal_arguments_of_different_types_agree():
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


@case("core")
def shapes_changing_on_one_rank_raise_everywhere():
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


@case("core")
def calls_that_ran_before_still_agree_before_communicating():
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


@case("core")
def ranks_that_disagree_on_calls_made_before_run_no_method():
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


@case("core")
def block_sizes_changing_on_some_ranks_after_calls_made_before():
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


@case("core")
@case("async")
def ranks_that_disagree_run_no_method_on_any_thread():
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


@case("core")
def ranks_that_disagree_run_no_unordered_method_either():
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


@case("core")
def a_fused_call_agrees_on_rows_only_for_members_wired_alike_on_every_rank():
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


@case("core")
@case("async")
def a_problem_whose_call_failed_everywhere_runs_again():
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


@case("core")
def problems_with_other_numbers_of_distributed_inputs_called_on_different_ranks():
    # their agreements send rows of one width: every rank raises distop's error, where
    # rows of two widths had ended the job with MPI's "message truncated" on 4 ranks
    blocks = distop.Problem(
        lambda x, y: {"f": distop.AllreduceSum()(jnp.sum(x) + jnp.sum(y))},
        {"x": np.ones(1 + rank), "y": np.ones(2)}, distributed=["x", "y"])
    plain = distop.Problem(lambda x: {"f": jnp.sum(distop.AllreduceSum()(x))},
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


@case("core")
def two_problems_called_on_different_ranks_raise_everywhere():
    # the same operator class, collectives and shapes: only which Problem tells them apart
    for backend in ("lean", "io_callback"):
        p = distop.Problem(lambda x: {"f": jnp.sum(distop.AllreduceSum()(x) ** 2)},
                           {"x": np.ones(3)}, backend=backend)
        q = distop.Problem(lambda x: {"f": jnp.sum(distop.AllreduceSum()(10.0 * x))},
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


@case("core")
def arguments_refused_on_one_rank_raise_on_every_rank():
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


@case("core")
def shared_inputs_and_one_refused_on_one_rank():
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


@case("core")
def thirty_two_bit_mode_with_float32_values():
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


@case("core")
def forward_mode_without_a_jvp_raises_on_every_rank():
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


@case("core")
def a_communicator_made_after_one_is_freed_gets_its_own_duplicate():
    # MPI gives the new communicator the freed one's handle: distop must not take it for
    # the old one (whose private duplicate has another group of ranks)
    alone = comm.Split(rank, 0)
    assert distop.Problem(lambda x: {"f": x * 2.0}, {"x": np.ones(2)}, comm=alone).comm.size == 1
    alone.Free()
    every = comm.Dup()
    problem = distop.Problem(lambda x: {"s": distop.AllreduceSum()(jnp.sum(x))},
                             {"x": np.ones(2)}, comm=every)
    assert problem.comm.Get_size() == comm.Get_size()
    assert problem.run()["s"] == 2.0 * comm.Get_size()
    every.Free()


@case("core")
def block_sizes_changing_on_some_ranks_are_agreed_again():
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


@case("core")
def a_model_with_collectives_of_its_own_and_changing_block_sizes():
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


@case("hangs")
def a_case_that_hangs():
    # not a test of distop: the harness's own watchdog (tests/test_mpi.py runs it)
    comm.Barrier() if rank == 0 else time.sleep(600)


@case("core")
def run_and_compute_totals_gives_what_run_then_compute_totals_give():
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
@case("core")
def replicated_values_are_compared_as_values_and_differences_name_rank_and_size():
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


@case("core")
def a_dtype_change_of_a_differentiable_input_is_refused_on_every_rank():
    op = distop.AllreduceSum()
    problem = distop.Problem(lambda x: {"s": op(jnp.sum(x * x))}, {"x": np.ones(3)})
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


@case("core")
def a_problem_keeps_the_programs_of_its_most_recent_shapes_only():
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
class Stencil(distop.DistributedOperator):
    """y_i = x_(i-1) + x_i + x_(i+1) over the global vector (zero beyond its ends), each
    rank holding a block of rows: a halo exchange of one row with each neighbour
    (Sendrecv). The stencil is symmetric, so its VJP is itself."""

    forward_collectives = ("Sendrecv",)
    vjp_collectives = ("Sendrecv",)

    def forward(self, comm, x):
        r, p = comm.Get_rank(), comm.Get_size()
        left, right = (r - 1 if r > 0 else MPI.PROC_NULL), (r + 1 if r < p - 1 else MPI.PROC_NULL)
        from_left, from_right = np.zeros(1), np.zeros(1)
        comm.Sendrecv(x[-1:].copy(), dest=right, recvbuf=from_left, source=left)
        comm.Sendrecv(x[:1].copy(), dest=left, recvbuf=from_right, source=right)
        padded = np.concatenate([from_left, x, from_right])
        return padded[:-2] + padded[1:-1] + padded[2:]

    def vjp(self, comm, y_bar, x):
        return self.forward(comm, y_bar)


@case("core")
def a_halo_exchange_operator_declares_its_point_to_point_calls():
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


@case("core")
def freeing_a_communicator_frees_distop_s_duplicate_of_it():
    from distop import _comm

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


@case("core")
def what_distop_keeps_per_communicator_goes_with_it():
    from distop import _coordinator

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
    narrow = distop.Problem(lambda x: {"s": distop.AllreduceSum()(jnp.sum(x))},
                            {"x": np.ones(2)}, comm=second)
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
class Coupled(distop.ImplicitOperator):
    """y with R(y, b, k) = k y + sum(y) - b = 0 over the global vector (the matrix
    k I + 1 1^T, coupling every rank), solved in closed form with one Allreduce; its
    adjoint is the same solve (the matrix is symmetric), batched over the seeds."""

    solve_collectives = adjoint_collectives = residual_collectives = ("Allreduce",)
    batched_adjoint = True
    fail: str = ""  # the method that fails on the last rank, for tests/mpi_failures.py

    def _solve(self, comm, rhs, k):
        """(k I + 1 1^T)^-1 rhs, rows of a batch at once."""
        sums = np.array([rhs.sum(axis=-1), np.full(rhs.shape[:-1], rhs.shape[-1], float)])
        total = np.empty_like(sums)
        comm.Allreduce(sums, total, op=MPI.SUM)
        s = total[0] / (k + total[1])
        return (rhs - s[..., None]) / k

    def solve(self, comm, b, k):
        _maybe_fail(self, comm, "solve")
        return self._solve(comm, b, k)

    def solve_adjoint(self, comm, y_bar, y, b, k):
        _maybe_fail(self, comm, "solve_adjoint")
        return self._solve(comm, y_bar, k)

    def residual_vjp(self, comm, lam, y, b, k):
        k_bar = np.empty(lam.shape[0])
        comm.Allreduce(np.ascontiguousarray(lam @ y), k_bar, op=MPI.SUM)
        if self.fail == "residual_vjp" and comm.Get_rank() == comm.Get_size() - 1:
            return -lam[:, :-1], k_bar
        return -lam, k_bar


def _maybe_fail(op, comm, method):
    if op.fail == method and comm.Get_rank() == comm.Get_size() - 1:
        raise RuntimeError(f"{method} did not converge in 50 iterations")


@case("core")
def an_implicit_operator_differentiates_by_its_adjoint():
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


# -- distop.linalg: Krylov solvers on blocks ------------------------------------------
class Stencil3:
    """A 1-D three-point stencil (lower, diagonal, upper) on N rows split over the ranks
    as `counts`, its halos exchanged by Sendrecv between the nearest ranks that hold rows
    (a rank with none takes no part)."""

    def __init__(self, counts, lower, diagonal, upper):
        self.counts, self.coefficients = counts, (lower, diagonal, upper)
        self.start, self.n = sum(counts[:rank]), counts[rank]
        holders = [r for r in range(size) if counts[r] > 0]
        at = holders.index(rank) if self.n else None
        self.left = holders[at - 1] if at else MPI.PROC_NULL
        self.right = (holders[at + 1] if at is not None and at + 1 < len(holders)
                      else MPI.PROC_NULL)

    def matvec(self, comm, v):
        from_left, from_right = np.zeros(1), np.zeros(1)
        if self.n:
            comm.Sendrecv(v[-1:].copy(), dest=self.right, recvbuf=from_left, source=self.left)
            comm.Sendrecv(v[:1].copy(), dest=self.left, recvbuf=from_right, source=self.right)
        padded = np.concatenate([from_left, v, from_right])
        lower, diagonal, upper = self.coefficients
        return lower * padded[:-2] + diagonal * padded[1:-1] + upper * padded[2:]

    def transposed(self):
        lower, diagonal, upper = self.coefficients
        return Stencil3(self.counts, upper, diagonal, lower)

    def dense(self):
        lower, diagonal, upper = self.coefficients
        total = sum(self.counts)
        return (np.diag(np.full(total, diagonal)) + np.diag(np.full(total - 1, lower), -1)
                + np.diag(np.full(total - 1, upper), 1))

    def mine(self, whole):
        return np.array(whole[self.start:self.start + self.n])


def uneven_rows(total=37):
    """Rows per rank: more on later ranks, none on rank 1 from 3 ranks on."""
    weights = [0 if (r == 1 and size >= 3) else r + 1 for r in range(size)]
    counts = [total * w // sum(weights) for w in weights]
    counts[-1] += total - sum(counts)
    return counts


def same_everywhere(*values):
    every = comm.allgather(values)
    assert all(v == every[0] for v in every), every


@case("linalg")
def krylov_solves_of_an_uneven_stencil_match_a_dense_solve():
    from distop.linalg import cg, gmres

    counts = uneven_rows()
    assert size < 3 or counts[1] == 0, counts
    b_whole = np.random.default_rng(5).standard_normal(sum(counts))
    laplacian = Stencil3(counts, -1.0, 2.0, -1.0)
    flow = Stencil3(counts, -1.3, 2.5, -0.7)  # convection-diffusion: not symmetric
    runs = [(cg, laplacian, {}), (cg, laplacian, {"precondition": lambda r: r / 2.0}),
            (gmres, laplacian, {"restart": 40}), (gmres, flow, {"restart": 8}),
            (gmres, flow.transposed(), {"restart": 8}),
            (gmres, flow, {"precondition": lambda r: r / 2.5})]
    for solver, stencil, options in runs:
        b = stencil.mine(b_whole)
        result = solver(comm, lambda v, s=stencil: s.matvec(comm, v), b, **options)
        assert result.converged and result.x.shape == b.shape
        x_whole = np.concatenate(comm.allgather(result.x))
        expected = np.linalg.solve(stencil.dense(), b_whole)
        all_close_everywhere(comm, x_whole, expected, rtol=1e-8, atol=1e-10)
        same_everywhere(result.iterations, result.residual_norm, result.converged)
        r = b - stencil.matvec(comm, result.x)
        direct = np.sqrt(comm.allreduce(float(r @ r)))
        assert abs(result.residual_norm - direct) <= 1e-6 * direct, (result, direct)
        assert result.residual_norm <= 1e-10 * np.linalg.norm(b_whole)


@case("linalg")
def krylov_failures_raise_on_every_rank():
    from distop.linalg import ConvergenceError, cg, gmres

    counts = uneven_rows()
    laplacian = Stencil3(counts, -1.0, 2.0, -1.0)
    b = laplacian.mine(np.random.default_rng(6).standard_normal(sum(counts)))

    def outcome(call):
        try:
            call()
        except (ConvergenceError, distop.DistopError, ValueError) as err:
            return type(err).__name__, str(err), getattr(err, "elsewhere", False)
        return "returned", "", False

    for solver in (cg, gmres):
        kind, message, _ = outcome(lambda s=solver: s(
            comm, lambda v: laplacian.matvec(comm, v), b, maxiter=3, name="Heat.solve_adjoint"))
        assert kind == "ConvergenceError", (kind, message)
        for part in (f"Heat.solve_adjoint on rank {rank} of {size}", "after 3 iterations",
                     "misses the tolerance", "raise maxiter"):
            assert part in message, (part, message)
        same_everywhere(kind, message.replace(f"rank {rank} of", "rank of"))
        result = solver(comm, lambda v: laplacian.matvec(comm, v), b, maxiter=3,
                        raise_on_failure=False)
        assert not result.converged
        same_everywhere(result.iterations, result.residual_norm, result.converged)

    # a negative definite operator: p^T A p < 0 on every rank at once
    negated = Stencil3(counts, 1.0, -2.0, 1.0)
    kind, message, _ = outcome(lambda: cg(comm, lambda v: negated.matvec(comm, v), b))
    assert kind == "ConvergenceError" and "not positive definite" in message, message
    same_everywhere(kind)

    # a wrong block on the last rank only: its own error there, a report elsewhere
    last = size - 1

    def short_on_the_last_rank(v):
        out = laplacian.matvec(comm, v)
        return out[:-1] if rank == last else out

    kind, message, elsewhere = outcome(lambda: cg(comm, short_on_the_last_rank, b))
    if rank == last:
        assert kind == "ValueError" and f"cg on rank {last} of {size}: matvec returned" in message
    else:
        assert kind == "DistopError" and elsewhere and f"rank(s) [{last}]" in message, message
    kind, message, elsewhere = outcome(lambda: gmres(
        comm, lambda v: laplacian.matvec(comm, v), b if rank else b[None]))
    if rank == 0:
        assert kind == "ValueError" and "b has shape" in message, message
    else:
        assert kind == "DistopError" and elsewhere and "rank(s) [0]" in message, message


class ImplicitFlow(distop.DistributedOperator):
    """y solving A y = x for a non-symmetric stencil A, by GMRES; its VJP solves with
    A^T."""

    stencil: Stencil3
    forward_collectives = ("Sendrecv", "Allreduce")
    vjp_collectives = ("Sendrecv", "Allreduce")

    def forward(self, comm, x):
        from distop.linalg import gmres

        return gmres(comm, lambda v: self.stencil.matvec(comm, v), x,
                     name="ImplicitFlow.forward").x

    def vjp(self, comm, y_bar, x):
        from distop.linalg import gmres

        adjoint = self.stencil.transposed()
        return gmres(comm, lambda v: adjoint.matvec(comm, v), y_bar,
                     name="ImplicitFlow.vjp").x


@case("linalg")
def an_implicit_operator_solves_forward_and_adjoint_with_krylov():
    counts = uneven_rows(13)
    flow = Stencil3(counts, -1.3, 2.5, -0.7)
    x = flow.mine(np.linspace(0.5, 1.5, sum(counts)))
    problem = distop.Problem(lambda x: {"y": ImplicitFlow(flow)(x)}, {"x": x},
                             distributed=["x", "y"])
    y = np.concatenate(comm.allgather(np.asarray(problem.run()["y"])))
    all_close_everywhere(comm, y, np.linalg.solve(flow.dense(), np.linspace(0.5, 1.5, 13)),
                         rtol=1e-8)
    J = problem.compute_totals("y", "x")["y", "x"]
    all_close_everywhere(comm, J, np.linalg.inv(flow.dense()), rtol=1e-8, atol=1e-10)
    assert all(c.ok for c in problem.check_totals(out_stream=None).values())


# -- the built-in collectives against dense references --------------------------------
# Every rank runs `local` on its own part of a replicated parameter vector p; the
# results of every rank, gathered, are a replicated function of p, the same on every
# rank, which `dense` computes in one process for every rank at once (rank by rank).
# Blocks are uneven, and rank 1 owns none from 2 ranks on.
BLOCKS = [(3, 0, 2, 1)[r % 4] for r in range(size)] if size > 1 else [4]
STARTS = [sum(BLOCKS[:r]) for r in range(size)]
ROWS = sum(BLOCKS)


def smooth(v):
    """A nonlinear map, increasing on [-2, 2]: keeps ties and zeros of its input."""
    return jnp.sin(v) + 0.5 * v


def own(p, r, length, offset=0):
    """Rank r's rank-local part of p: `length` entries after `offset`, through `smooth`."""
    return smooth(p[offset + r * length:offset + (r + 1) * length])


def block(p, r, offset=0, width=1):
    """Rank r's block of a distributed (ROWS, width) array stored in p after `offset`."""
    rows = p[offset + STARTS[r] * width:offset + (STARTS[r] + BLOCKS[r]) * width]
    return smooth(rows).reshape(BLOCKS[r], width)


def even_rows(total):
    """**Returns:** the rows per rank of `total` split as evenly as possible."""
    return distop.Split().rows(size, total)


def check_collectives(cases, p):
    """Compare values, jvp, jacfwd, jacrev and vmap of every case with its dense
    reference, outside a Problem and inside one (forward mode on the io_callback
    backend, totals on the lean path).

    **Arguments:**
    - `cases`: {name: (local, dense, enters, replicated)}: `local(q)` this rank's
      result from the parameters q; `dense(p, r)` rank r's result; `enters`: whether q
      is p through `RankLocal` (local code takes rank-dependent parts of it) or p
      itself (a replicated input); `replicated`: whether the result is replicated
      (compared as it is) or rank-local or distributed (gathered from every rank).
    - `p`: the parameters, the same on every rank.
    """
    def model(p):
        entered = distop.RankLocal()(p)
        found = {}
        for name, (local, _, enters, replicated) in cases.items():
            y = jnp.ravel(local(entered if enters else p))
            found[name] = y if replicated else distop.Allgather()(y)
        return found

    def dense(p):
        return {name: jnp.concatenate([jnp.ravel(jnp.asarray(reference(p, r)))
                                       for r in range(1 if replicated else size)])
                for name, (_, reference, _, replicated) in cases.items()}

    t = np.random.default_rng(7).standard_normal(p.shape)
    values, J = jax.jit(dense)(p), jax.jit(jax.jacfwd(dense))(p)
    got, tangents = jax.jvp(model, (p,), (t,))  # (op by op: each operator call eagerly)
    forward, reverse = jax.jit(jax.jacfwd(model))(p), jax.jit(jax.jacrev(model))(p)
    twice = jax.jit(jax.vmap(model))(np.stack([p, 2 * p]))
    in_problem = distop.Problem(
        lambda p: {**{f"J {k}": v for k, v in jax.jacfwd(model)(p).items()},
                   **{f"t {k}": v for k, v in jax.jvp(model, (p,), (t,))[1].items()}},
        {"p": p}, backend="io_callback").run()
    totals = distop.Problem(model, {"p": p}).compute_totals(wrt="p")
    doubled = jax.jit(dense)(2 * p)
    for name in cases:
        found = {"value": (got[name], values[name]), "vmap": (twice[name][1], doubled[name]),
                 "jvp": (tangents[name], J[name] @ t),
                 "jvp in a Problem": (in_problem[f"t {name}"], J[name] @ t),
                 "jacfwd": (forward[name], J[name]), "jacrev": (reverse[name], J[name]),
                 "jacfwd in a Problem": (in_problem[f"J {name}"], J[name]),
                 "compute_totals": (totals[name, "p"], J[name])}
        for what, (a, b) in found.items():
            try:
                all_close_everywhere(comm, a, b, atol=1e-14)
            except AssertionError as err:
                raise AssertionError(f"{name}, {what}: {err}") from None


@case("collectives")
def linear_collectives_in_forward_and_reverse_mode():
    m, width = 3, 2
    p = np.linspace(-1.5, 1.5, size * m + ROWS * width + 1)
    root = size - 1
    counts = tuple(BLOCKS)
    cases = {
        "AllreduceSum": (lambda q: distop.AllreduceSum()(own(q, rank, m)),
                         lambda p, r: sum(own(p, s, m) for s in range(size)), True, True),
        "Allgather": (lambda q: distop.Allgather()(block(q, rank)),
                      lambda p, r: jnp.concatenate([block(p, s) for s in range(size)]),
                      True, True),
        "Allgather of 0-d": (lambda q: distop.Allgather()(jnp.sum(own(q, rank, m))),
                             lambda p, r: jnp.stack([jnp.sum(own(p, s, m))
                                                     for s in range(size)]), True, True),
        "Split": (lambda p: distop.Split(counts=counts)(smooth(p[:ROWS])),
                  lambda p, r: smooth(p[STARTS[r]:STARTS[r] + BLOCKS[r]]), False, False),
        "Split evenly": (lambda p: distop.Split()(smooth(p[:5]) * 2),
                         lambda p, r: smooth(p[:5])[
                             sum(even_rows(5)[:r]):sum(even_rows(5)[:r + 1])] * 2,
                         False, False),
        "Alltoall": (lambda q: distop.Alltoall()(block(q, rank, width=width)),
                     lambda p, r: jnp.concatenate([block(p, s, width=width)
                                                   for s in range(size)]).T[
                         sum(even_rows(width)[:r]):sum(even_rows(width)[:r + 1])],
                     True, False),
        "Broadcast": (lambda q: distop.Broadcast(root=root)(own(q, rank, m)),
                      lambda p, r: own(p, root, m), True, True),
        "RankLocal": (lambda p: distop.RankLocal()(smooth(p[:m])) * (rank + 1),
                      lambda p, r: smooth(p[:m]) * (r + 1), False, False),
    }
    check_collectives(cases, p)


def ranks_by_column():
    """Rank-local values, (size, 6), with ties and zeros across ranks: per column, a
    tie of every rank; the extremes on the first and last ranks; one zero; two zeros
    (a tie of ranks 0 and 1); a tie of the last two ranks only; all distinct."""
    r = np.arange(size)[:, None]
    return np.hstack([np.full((size, 1), 0.7), 0.1 * r - 0.3, np.where(r == 0, 0.0, 0.5 + 0.1 * r),
                      np.where(r < 2, 0.0, -0.4),
                      np.where(r >= size - 2, 1.1, 0.2 * r - 0.9), 1.2 - 0.25 * r])


@case("collectives")
def reductions_over_ranks_in_forward_and_reverse_mode():
    values = ranks_by_column()
    m = values.shape[1]
    p = values.ravel()

    def extreme(p, pick):  # the lowest rank holding the extreme takes the derivative
        every = jnp.stack([own(p, s, m) for s in range(size)])
        return every[pick(every, axis=0), jnp.arange(m)]

    def product(p):
        found = own(p, 0, m)
        for s in range(1, size):
            found = found * own(p, s, m)
        return found

    cases = {f"Allreduce {op}": (lambda q, op=op: distop.Allreduce(op=op)(own(q, rank, m)),
                                 reference, True, True)
             for op, reference in [
                 ("sum", lambda p, r: sum(own(p, s, m) for s in range(size))),
                 ("max", lambda p, r: extreme(p, jnp.argmax)),
                 ("min", lambda p, r: extreme(p, jnp.argmin)),
                 ("prod", lambda p, r: product(p))]}
    cases["Scan"] = (lambda q: distop.Scan()(own(q, rank, m)),
                     lambda p, r: sum(own(p, s, m) for s in range(r + 1)), True, False)
    cases["Exscan"] = (lambda q: distop.Exscan()(own(q, rank, m)),
                       lambda p, r: sum((own(p, s, m) for s in range(r)), jnp.zeros(m)),
                       True, False)
    cases["Scan of 2-D values"] = (
        lambda q: distop.Scan()(own(q, rank, m).reshape(2, 3)),
        lambda p, r: sum(own(p, s, m) for s in range(r + 1)).reshape(2, 3), True, False)
    check_collectives(cases, p)
    # the rule for ties: the lowest rank holding the extreme, on every rank alike
    x = jnp.asarray(values[rank])
    for op, pick in (("max", np.argmax), ("min", np.argmin)):
        grad = jax.grad(lambda x, op=op: jnp.sum(distop.Allreduce(op=op)(x)))(x)
        all_close_everywhere(comm, grad, (pick(values, axis=0) == rank).astype(float))
    grad = jax.grad(lambda x: jnp.sum(distop.Allreduce(op="prod")(x)))(x)
    others = np.prod(np.delete(values, rank, axis=0), axis=0)
    all_close_everywhere(comm, grad, others)  # exact where some values are zero


@case("collectives")
def rooted_collectives_in_forward_and_reverse_mode():
    m = 3
    p = np.linspace(-1.4, 1.3, max(size * m, size * ROWS) + 2)
    last = size - 1
    counts = tuple(BLOCKS)

    def on(r, root, value):
        return value if r == root else jnp.zeros_like(value)

    cases = {
        "Reduce": (lambda q: distop.Reduce(root=last)(own(q, rank, m)),
                   lambda p, r: on(r, last, sum(own(p, s, m) for s in range(size))), True, False),
        "Reduce to 0": (lambda q: distop.Reduce()(own(q, rank, m).reshape(1, m)),
                        lambda p, r: on(r, 0, sum(own(p, s, m) for s in range(size))),
                        True, False),
        "Gather": (lambda q: distop.Gather()(block(q, rank)),
                   lambda p, r: on(r, 0, jnp.concatenate([block(p, s)
                                                          for s in range(size)])), True, False),
        "Gather of 0-d": (lambda q: distop.Gather(root=last)(jnp.sum(own(q, rank, m))),
                          lambda p, r: on(r, last, jnp.stack([jnp.sum(own(p, s, m))
                                                              for s in range(size)])), True, False),
        "Scatter": (lambda q: distop.Scatter(root=last, counts=counts)(own(q, rank, ROWS)),
                    lambda p, r: own(p, last, ROWS)[STARTS[r]:STARTS[r] + BLOCKS[r]], True, False),
        "Scatter evenly": (lambda q: distop.Scatter()(own(q, rank, 4).reshape(2, 2)),
                           lambda p, r: own(p, 0, 4).reshape(2, 2)[
                               sum(even_rows(2)[:r]):sum(even_rows(2)[:r + 1])], True, False),
    }
    check_collectives(cases, p)


@case("collectives")
def halo_exchanges_in_forward_and_reverse_mode():
    columns = 2
    p = np.linspace(-1.2, 1.4, ROWS * columns + 1)

    def window(p, r, w, boundary):
        every = jnp.concatenate([block(p, s, width=columns) for s in range(size)])
        padded = jnp.pad(every, ((w, w), (0, 0)),
                         mode="wrap" if boundary == "periodic" else "constant")
        return padded[STARTS[r]:STARTS[r] + BLOCKS[r] + 2 * w]

    cases = {}
    # widths beyond the smallest blocks, and beyond every row (periodic: rows repeat)
    for w in (0, 1, 2, ROWS + 2):
        for boundary in ("zero", "periodic"):
            cases[f"HaloExchange({w}, {boundary})"] = (
                lambda q, w=w, b=boundary: distop.HaloExchange(width=w, boundary=b)(
                    block(q, rank, width=columns)),
                lambda p, r, w=w, b=boundary: window(p, r, w, b), True, False)
    cases["HaloExchange of 1-D blocks"] = (
        lambda q: distop.HaloExchange(boundary="periodic")(block(q, rank)[:, 0]),
        lambda p, r: jnp.pad(jnp.concatenate([block(p, s) for s in range(size)])[:, 0],
                             1, mode="wrap")[STARTS[r]:STARTS[r] + BLOCKS[r] + 2], True, False)
    check_collectives(cases, p)


@case("collectives")
def a_stencil_on_a_halo_in_a_problem_with_distributed_input_and_output():
    xg = np.linspace(0.3, 1.4, ROWS)

    def stencil(h):
        return h[:-2] * h[1:-1] + jnp.sin(h[2:])

    def model(x):
        y = stencil(distop.HaloExchange(boundary="periodic")(x))
        return {"y": y, "f": distop.AllreduceSum()(jnp.sum(y ** 2))}

    def dense(x):
        y = stencil(jnp.pad(x, 1, mode="wrap"))
        return {"y": y, "f": jnp.sum(y ** 2)}

    problem = distop.Problem(model, {"x": xg[STARTS[rank]:STARTS[rank] + BLOCKS[rank]]},
                             distributed=["x", "y"])
    J, expected = problem.compute_totals(), jax.jacrev(dense)(xg)
    all_close_everywhere(comm, J["y", "x"], expected["y"], atol=1e-14)
    all_close_everywhere(comm, J["f", "x"], expected["f"][None], atol=1e-14)
    assert all(c.ok for c in problem.check_totals(out_stream=None).values())


class OffOnTheLastRank(distop.DistributedOperator):
    """The sum over ranks, rank-local in, replicated out, whose vjp is wrong on the last
    rank only (its forward and jvp are right)."""

    forward_collectives = jvp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, y_bar, x):
        return y_bar * (1.5 if comm.Get_rank() == comm.Get_size() - 1 else 1.0)

    def jvp(self, comm, t, x):
        return self.forward(comm, t)


PAIRS = {"jvp vs fd", "vjp vs fd", "vjp vs jvp", "forward batched", "jvp batched",
         "vjp batched"}


@case("collectives")
def check_operator_passes_the_built_ins_and_names_a_wrong_vjp():
    rng = np.random.default_rng([3, rank])
    mine = rng.uniform(0.5, 1.5, 3)  # rank-local: each rank's own
    rows = rng.uniform(0.5, 1.5, (BLOCKS[rank], 2))  # a distributed block, maybe empty
    p = np.linspace(0.5, 1.5, ROWS)  # replicated
    last = size - 1
    cases = [(distop.AllreduceSum(), (mine,), dict(replicated_outputs=[0])),
             (distop.Allreduce(op="prod"), (mine,), dict(replicated_outputs=[0])),
             (distop.Allreduce(op="max"), (mine,), dict(replicated_outputs=[0])),
             (distop.Scan(), (mine,), {}), (distop.Exscan(), (mine,), {}),
             (distop.Allgather(), (rows,), dict(replicated_outputs=[0])),
             (distop.Split(counts=tuple(BLOCKS)), (p,), dict(replicated_inputs=[0])),
             (distop.Alltoall(), (rows,), {}),
             (distop.Broadcast(root=last), (mine,), dict(replicated_outputs=[0])),
             (distop.RankLocal(), (p,), dict(replicated_inputs=[0])),
             (distop.Reduce(root=last), (mine,), {}), (distop.Gather(), (rows,), {}),
             (distop.Scatter(root=last, counts=tuple(BLOCKS)), (p * (rank + 1),), {}),
             (distop.HaloExchange(width=2, boundary="periodic"), (rows,), {})]
    for op, args, kinds in cases:
        results = distop.check_operator(op, *args, out_stream=None, **kinds)
        assert set(results) == PAIRS and all(r.ok for r in results.values()), (op, results)
    if size > 1:  # a replicated output summed over ranks as if rank-local: P times too much
        assert not distop.check_operator(distop.AllreduceSum(), mine,
                                         out_stream=None)["vjp vs jvp"].ok

    out = io.StringIO()
    results = distop.check_operator(OffOnTheLastRank(), mine, replicated_outputs=[0],
                                    out_stream=out)
    failed = {pair for pair, r in results.items() if not r.ok}
    assert failed == {"vjp vs fd", "vjp vs jvp"}, results
    if rank == 0:
        text = out.getvalue()
        assert f"OffOnTheLastRank on {size} rank(s)" in text and "<-- FAILED" in text, text
        assert ("check_operator: OffOnTheLastRank.vjp is wrong: it disagrees with finite "
                "differences, which jvp agrees with") in text, text
    else:
        assert out.getvalue() == ""
    try:
        distop.check_operator(OffOnTheLastRank(), mine, replicated_outputs=[0],
                              out_stream=None, raise_on_error=True)
    except distop.DerivativeCheckError as err:
        assert "check_operator(OffOnTheLastRank): vjp vs fd: error" in str(err), err
    else:
        raise AssertionError("no DerivativeCheckError")


@case("collectives")
def linear_operators_transpose_into_their_vjp():
    rng = np.random.default_rng([5, rank])
    mine = rng.uniform(0.5, 1.5, 3)
    rows = rng.uniform(0.5, 1.5, (BLOCKS[rank], 2))
    p = np.linspace(0.5, 1.5, ROWS)
    last = size - 1
    for op, x in [(distop.AllreduceSum(), mine), (distop.Allreduce(), mine),
                  (distop.Scan(), mine), (distop.Exscan(), mine),
                  (distop.Allgather(), rows), (distop.Split(counts=tuple(BLOCKS)), p),
                  (distop.Alltoall(), rows), (distop.Broadcast(root=last), mine),
                  (distop.RankLocal(), p), (distop.Reduce(root=last), mine),
                  (distop.Gather(), rows), (distop.Scatter(root=last, counts=tuple(BLOCKS)), p),
                  (distop.HaloExchange(width=2, boundary="periodic"), rows)]:
        y = op(x)
        c = np.random.default_rng([6, rank]).standard_normal(y.shape)
        transpose = jax.linear_transpose(op, x)
        expected = jax.vjp(op, x)[1](c)[0]
        for found in (transpose(c)[0], jax.jit(transpose)(c)[0],
                      jax.vmap(transpose)(np.stack([c, 2 * c]))[0][1] / 2):
            all_close_everywhere(comm, found, expected, atol=1e-14)
    for op, text in [(distop.Allreduce(op="max"), "Allreduce.forward on rank "
                      f"{rank} is not linear with these fields"),
                     (Cube(), f"Cube.forward on rank {rank} is not declared linear")]:
        try:
            jax.linear_transpose(op, mine)(mine)
        except distop.DistopError as err:
            assert f"jax.linear_transpose: {text}" in str(err), err
        else:
            raise AssertionError(f"no DistopError for {type(op).__name__}")

    # the adjoint of a halo exchange inside a model, run by a Problem: each rank's
    # window, squared and weighted, added back onto the rows it came from
    def model(x):
        halo = distop.HaloExchange()
        return {"y": jax.linear_transpose(halo, x)(halo(x) ** 2 * (rank + 1.0))[0]}

    def dense(xg):
        padded = jnp.pad(xg, 1)
        total = jnp.zeros(ROWS + 2)
        for r in range(size):
            window = slice(STARTS[r], STARTS[r] + BLOCKS[r] + 2)
            total = total.at[window].add(padded[window] ** 2 * (r + 1.0))
        return total[1:-1]

    xg = np.linspace(0.3, 1.4, ROWS)
    problem = distop.Problem(model, {"x": xg[STARTS[rank]:STARTS[rank] + BLOCKS[rank]]},
                             distributed=["x", "y"])
    y = np.concatenate(comm.allgather(np.asarray(problem.run()["y"])))
    all_close_everywhere(comm, y, dense(xg), atol=1e-14)
    all_close_everywhere(comm, problem.compute_totals()["y", "x"], jax.jacrev(dense)(xg),
                         atol=1e-14)
    assert problem.check_totals(out_stream=None)["y", "x"].ok


if __name__ == "__main__":
    run_cases([fn for group in sys.argv[1:] for fn in CASES[group]])
