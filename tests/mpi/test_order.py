"""Every communicating call runs once, in one order, one at a time on every rank: on
both backends, fused, given the rows some rank needs, in segments and in the model's
own loops."""


import distributed_matvec as dm
import jax
import jax.numpy as jnp
import numpy as np
from helpers import (
    Cube,
    RankSum,
    RowScale,
    ScaledSum,
    all_close_everywhere,
    loops_since,
    totals_jaxpr,
    without_loops,
)
from jax import lax
from mpi4py import MPI

import distop

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


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


def test_lean_calls_run_exactly_once_in_order_one_at_a_time():
    calls_run_exactly_once_in_order_one_at_a_time("lean")


def test_io_callback_calls_run_exactly_once_in_order_one_at_a_time():
    calls_run_exactly_once_in_order_one_at_a_time("io_callback")


def test_fusion_runs_independent_neighbours_in_one_call_in_the_same_order():
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


def test_fused_vjps_agree_on_their_nonzero_seed_rows():
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


def test_vjps_are_given_the_rows_some_rank_needs_on_every_rank():
    from distop._compiler.passes import rows

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


def test_calls_given_rows_alike_where_ranks_build_different_programs():
    seen = []
    first, second = RowScale(2.0, seen), RowScale(3.0, seen)

    def model(x, w):
        y = first(x)
        z = second(y)
        out = {"a": jnp.sum(x), "c": z[0], "d": z[1] + z[2]}
        # only ranks holding rows of w add a term in y: there, the second call's
        # cotangent reaches the first through a sum; elsewhere, directly
        out["e"] = jnp.sum(y) * w if w.shape[0] else w  # (distributed, as w)
        return out

    w = np.ones(1) if rank == 0 else np.zeros(0)
    problem = distop.Problem(model, {"x": np.array([1.0, 2.0, 3.0]), "w": w},
                             distributed=["w", "e"], backend="lean")
    J = problem.compute_totals(wrt="x")
    # the same rows everywhere, so every Allreduce meets its partners
    assert comm.allgather(seen) == [seen] * size, seen
    reference = distop.Problem(model, {"x": np.array([1.0, 2.0, 3.0]), "w": w},
                               distributed=["w", "e"], backend="io_callback")
    R = reference.compute_totals(wrt="x")
    for key in R:
        all_close_everywhere(comm, J[key], R[key])


def test_a_long_chain_runs_in_segments_with_every_collective_once_in_order():
    from distop._compiler.stages import segments

    # no loops: the chain as it is
    without_loops(lambda: _chain_runs_every_collective_once_in_order(segments.SEGMENT + 6))


def test_a_repeated_stretch_runs_as_one_loop_with_every_collective_once_in_order():
    from distop._compiler.stages import loops
    from distop._hostcalls import ffi as _ffi

    before = set(_ffi._sites)
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


def test_operators_in_the_models_own_loops_run_lean_once_each_in_order():
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
def test_several_inputs_and_outputs_with_a_0d_input():
    a, b, t = np.arange(3.0) + 1, np.arange(2.0) - 0.5, np.array(1.5)
    total = size * (size + 1) / 2
    op = ScaledSum()
    problem = distop.Problem(lambda a, b, t: dict(zip("uv", op(a, b, t))),
                             {"a": a, "b": b, "t": t})
    out = problem.run()
    all_close_everywhere(comm, out["u"], total * a)
    all_close_everywhere(comm, out["v"], total * b * t)
    for mode in distop._problem.problem.MODES:
        J = problem.compute_totals(mode=mode)
        all_close_everywhere(comm, J["u", "a"], total * np.eye(3))
        all_close_everywhere(comm, J["v", "b"], total * t * np.eye(2))
        all_close_everywhere(comm, J["v", "t"], (total * b)[:, None])
        all_close_everywhere(comm, J["u", "t"], np.zeros((3, 1)))
    g = jax.grad(lambda a, b, t: jnp.sum(op(a, b, t)[1]), argnums=2)(a, b, t)
    all_close_everywhere(comm, g, total * b.sum())


def test_unused_output_still_runs_its_vjp():
    a, b, t = np.ones(3), np.ones(2), np.array(2.0)
    total = size * (size + 1) / 2
    op = ScaledSum()
    problem = distop.Problem(lambda a, b, t: {"u": jnp.sum(op(a, b, t)[0])},
                             {"a": a, "b": b, "t": t})
    assert [e.phase for e in problem.schedule] == ["forward", "vjp"]
    J = problem.compute_totals(of="u", wrt=["a", "t"])
    all_close_everywhere(comm, J["u", "a"], total * np.ones((1, 3)))
    all_close_everywhere(comm, J["u", "t"], np.zeros((1, 1)))


def test_rank_local_input_gets_the_full_cotangent():
    x = np.arange(4.0) * (rank + 1)
    op = RankSum()
    s = jax.jit(op)(x)
    all_close_everywhere(comm, s, np.arange(4.0) * size * (size + 1) / 2)
    g = jax.grad(lambda x: jnp.sum(op(x) ** 2))(x)
    all_close_everywhere(comm, g, 2 * np.asarray(s))  # d/dx_r: the full s_bar


def test_operators_inside_scan_and_fori_loop():
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
    for mode in distop._problem.problem.MODES:
        all_close_everywhere(comm, problem.compute_totals(mode=mode)["f", "x"][0], exact)
    del op


def test_jacrev_and_vmap_directly():
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


def test_local_operator_mixed_with_collectives():
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
