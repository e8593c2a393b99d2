"""Second derivatives through distributed operators: plain JAX and `compute_hvp` on
uneven blocks (some ranks own none), against dense Hessians of the global model (also
run in one process by tests/test_hvp.py). An explicit operator with `hvp`, the built-in
collectives, and an implicit operator with a nonlinear residual (`residual_hvp`) or a
linear one (none needed)."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BLOCKS,
    ROWS,
    STARTS,
    CubicSolve,
    NormScale,
    all_close_everywhere,
    cubic_solution,
    norm_scale,
)
from mpi4py import MPI

import distop

# (plain JAX differentiates the operators here on purpose: the inputs differentiated are
# each rank's own block, whose derivatives need no sum over the ranks)
pytestmark = pytest.mark.filterwarnings("ignore::distop.KindWarning")
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
rng = np.random.default_rng(7)
XG = rng.uniform(-1.0, 1.0, ROWS)  # the global vector
WG = np.array([0.7, -0.4])  # a replicated input
TG = rng.standard_normal((3, ROWS + 2))  # three global directions, over (x, w)


def mine(global_array):
    """This rank's rows (axis -1) of a global array."""
    return np.array(global_array[..., STARTS[rank]:STARTS[rank] + BLOCKS[rank]])


def reference(z):
    """The model's objective on the global vector x = z[:-2], with w = z[-2:]."""
    x, w = z[:-2], z[-2:]
    return w[0] * jnp.sum(jnp.sin(norm_scale(x))) + w[1] * jnp.sum(x) ** 2 + w[0] * w[1] ** 3


H = np.asarray(jax.hessian(reference)(np.concatenate([XG, WG])))


def objective(op):
    def f(x, w):  # x: this rank's block; the sums over ranks through AllreduceSum
        total = distop.AllreduceSum()(jnp.stack([jnp.sum(jnp.sin(op(x))), jnp.sum(x)]))
        return w[0] * total[0] + w[1] * total[1] ** 2 + w[0] * w[1] ** 3
    return f


def test_second_derivatives_of_a_distributed_operator_in_plain_jax():
    op = NormScale(seen=[])
    f = objective(op)
    x, t = mine(XG), mine(TG[0, :-2])
    want = mine(H[:-2, :-2] @ TG[0, :-2])  # (w held fixed)
    grad = lambda x: jax.grad(f)(x, WG)  # noqa: E731
    got = {
        "jvp of grad": jax.jvp(grad, (x,), (t,))[1],
        "jit jvp of grad": jax.jit(lambda x, t: jax.jvp(grad, (x,), (t,))[1])(x, t),
        "grad of grad": jax.grad(lambda x: grad(x) @ t)(x),
        "grad of jvp": jax.jit(jax.grad(lambda x: jax.jvp(lambda x: f(x, WG), (x,),
                                                          (t,))[1]))(x),
        "vmap jvp of grad": jax.vmap(lambda t: jax.jvp(grad, (x,), (t,))[1])(
            np.stack([t, 2 * t]))[1] / 2,
    }
    for value in got.values():
        all_close_everywhere(comm, value, want, rtol=1e-12, atol=1e-12)
    op.seen.clear()
    jax.vmap(lambda t: jax.jvp(grad, (x,), (t,))[1])(np.stack([t, 2 * t, 3 * t]))
    assert op.seen == [((3, BLOCKS[rank]), (3, BLOCKS[rank]))]  # one call for the batch


def test_compute_hvp_on_uneven_blocks():
    for backend in ("lean", "io_callback"):
        compute_hvp_on_uneven_blocks(backend)


def compute_hvp_on_uneven_blocks(backend):
    op = NormScale(seen=[])
    f = objective(op)
    problem = distop.Problem(lambda x, w: {"f": f(x, w), "y": op(x)},
                             {"x": mine(XG), "w": WG}, distributed={"x", "y"},
                             backend=backend)
    one = problem.compute_hvp("f", ["x", "w"], {"x": mine(TG[0, :-2]), "w": TG[0, -2:]})
    want = H @ TG[0]
    all_close_everywhere(comm, one["x"], mine(want[:-2]), rtol=1e-12, atol=1e-12)
    all_close_everywhere(comm, one["w"], want[-2:], rtol=1e-12, atol=1e-12)
    assert one["x"].shape == (BLOCKS[rank],) and one["w"].shape == (2,)
    op.seen.clear()
    several = problem.compute_hvp("f", ("x", "w"), {"x": mine(TG[:, :-2]), "w": TG[:, -2:]})
    want = TG @ H
    all_close_everywhere(comm, several["x"], mine(want[:, :-2]), rtol=1e-12, atol=1e-12)
    all_close_everywhere(comm, several["w"], want[:, -2:], rtol=1e-12, atol=1e-12)
    # the three directions in one call of the hvp (and one collective)
    assert op.seen == [((3, BLOCKS[rank]), (3, BLOCKS[rank]))]
    only = problem.compute_hvp("f", "w", {"w": TG[:, -2:]})
    all_close_everywhere(comm, only["w"], TG[:, -2:] @ H[-2:, -2:], rtol=1e-12, atol=1e-12)


def test_compute_hvp_refuses_what_some_ranks_got_wrong_on_every_rank():
    op = NormScale()
    problem = distop.Problem(lambda x, w: {"f": objective(op)(x, w)},
                             {"x": mine(XG), "w": WG}, distributed="x")
    bad = np.zeros(BLOCKS[rank] + (rank == size - 1))  # wrong on the last rank only
    with pytest.raises((ValueError, distop.DistopError), match=r"compute_hvp\(tangent="):
        problem.compute_hvp("f", "x", {"x": bad})
    got = problem.compute_hvp("f", "x", {"x": mine(TG[0, :-2])})  # (and then works)
    all_close_everywhere(comm, got["x"], mine(H[:-2, :-2] @ TG[0, :-2]), rtol=1e-12,
                         atol=1e-12)


def test_builtin_collectives_have_second_derivatives():
    local = rng.uniform(0.5, 1.5, (size, 3))  # rank-local values, one row per rank
    if size > 2:
        local[0, 1] = 0.0  # (prod's derivatives without division)
    t = rng.standard_normal((size, 3))
    weights = jnp.arange(1.0, 4.0)
    reductions = {"prod": jnp.prod, "max": jnp.max, "min": jnp.min, "sum": jnp.sum}
    for op, reduce in reductions.items():
        def reference(z, reduce=reduce):
            return jnp.sum(jnp.sin(reduce(z.reshape(size, 3), axis=0)) * weights)

        want = (jax.hessian(reference)(local.ravel()) @ t.ravel()).reshape(size, 3)[rank]
        f = lambda x, op=op: jnp.sum(jnp.sin(distop.Allreduce(op)(x)) * weights)  # noqa: E731
        got = jax.jit(jax.vmap(lambda v, f=f: jax.jvp(jax.grad(f), (local[rank],), (v,))[1]))(
            np.stack([t[rank], 2 * t[rank]]))
        all_close_everywhere(comm, got[0], want, rtol=1e-12, atol=1e-13)
        all_close_everywhere(comm, got[1], 2 * want, rtol=1e-12, atol=1e-13)
        grad_of_grad = jax.grad(lambda x, f=f: jax.grad(f)(x) @ t[rank])(local[rank])
        all_close_everywhere(comm, grad_of_grad, want, rtol=1e-12, atol=1e-13)

    # linear ones: a prefix sum over the ranks (of a rank-local objective: the
    # derivatives of their sum over the ranks), and a gather of uneven blocks
    def gathered(z):
        return jnp.sum(jnp.cos(jnp.cumsum(z[:size * 3].reshape(size, 3), axis=0))) \
            + jnp.sum(jnp.sin(z[size * 3:]) ** 3)

    z = np.concatenate([local.ravel(), XG])
    v = np.concatenate([t.ravel(), TG[0, :-2]])
    want = jax.hessian(gathered)(z) @ v
    mine_of = lambda a: (a[:size * 3].reshape(size, 3)[rank], mine(a[size * 3:]))  # noqa: E731

    def f(a, x):
        return jnp.sum(jnp.cos(distop.Scan()(a))) + jnp.sum(jnp.sin(distop.Allgather()(x)) ** 3)

    got = jax.jvp(jax.grad(f, argnums=(0, 1)), mine_of(z), mine_of(v))[1]
    all_close_everywhere(comm, got[0], want[:size * 3].reshape(size, 3)[rank], rtol=1e-12,
                         atol=1e-13)
    all_close_everywhere(comm, got[1], mine(want[size * 3:]), rtol=1e-12, atol=1e-13)


class WrongHvp(NormScale):
    """`NormScale` with a planted bug: a small extra term in its hvp."""

    def hvp(self, comm, y_bar, t, x):
        return super().hvp(comm, y_bar, t, x) + 1e-3 * t


class AsymmetricHvp(NormScale):
    """`NormScale` with a planted bug that breaks the symmetry of its hvp."""

    def hvp(self, comm, y_bar, t, x):
        local = np.sum(t, axis=-1, keepdims=True)
        total = np.empty_like(local)
        comm.Allreduce(np.ascontiguousarray(local), total, op=MPI.SUM)
        return super().hvp(comm, y_bar, t, x) + 0.1 * x * total


def test_check_hvp_passes_a_right_hvp_and_fails_a_planted_bug():
    for op, right in ((NormScale(), True), (WrongHvp(), False)):
        f = objective(op)
        problem = distop.Problem(lambda x, w, f=f, op=op: {"f": f(x, w), "y": op(x)},
                                 {"x": mine(XG), "w": WG}, distributed={"x", "y"})
        out = io.StringIO()
        results = problem.check_hvp("f", out_stream=out, directions=3)
        assert set(results) == {("f", "x"), ("f", "w")}
        assert results["f", "w"].ok and results["f", "x"].ok == right, out.getvalue()
        assert results["f", "x"].J.shape == (3, ROWS)  # (the whole vector, every rank)
        all_close_everywhere(comm, results["f", "x"].J_fd, results["f", "x"].J_fd)
        if rank == 0:
            assert "check_hvp: 'f'" in out.getvalue() and ("FAILED" in out.getvalue()) != right
        if not right:
            with pytest.raises(distop.DerivativeCheckError, match=r"check_hvp: .*\('f', 'x'\)"):
                problem.check_hvp("f", "x", raise_on_error=True, out_stream=None,
                                  progress=False)
        np.testing.assert_array_equal(problem.run()["y"], op(mine(XG)))  # (point kept)


def test_check_operator_checks_hvp_and_its_symmetry():
    x = mine(XG)
    found = distop.check_operator(NormScale(), x, out_stream=None)
    assert all(found[p].ok for p in ("hvp vs fd", "hvp symmetry", "hvp batched")), found
    wrong = distop.check_operator(WrongHvp(), x, out_stream=None)
    assert not wrong["hvp vs fd"].ok and wrong["vjp vs fd"].ok
    asymmetric = distop.check_operator(AsymmetricHvp(), x, out_stream=None)
    assert not asymmetric["hvp symmetry"].ok and not asymmetric["hvp vs fd"].ok
    local = np.random.default_rng(rank).uniform(0.5, 1.5, 3)  # (no ties between ranks)
    for op in ("prod", "max"):
        found = distop.check_operator(distop.Allreduce(op), local, replicated_outputs=[0],
                                      out_stream=None)
        assert "hvp symmetry" in found and all(r.ok for r in found.values()), found


def test_compute_totals_of_a_model_that_takes_a_gradient_itself():
    # reverse over reverse inside a Problem: the totals of <grad f, c> are H c
    c = mine(TG[1, :-2])
    for backend in ("lean", "io_callback"):
        op = NormScale()
        f = objective(op)

        def model(x, w, f=f):
            g = jax.grad(f)(x, w)  # this rank's block of the gradient
            return {"gc": distop.AllreduceSum()(jnp.sum(g * c)), "g": g}

        problem = distop.Problem(model, {"x": mine(XG), "w": WG}, distributed={"x", "g"},
                                 backend=backend)
        totals = problem.compute_totals("gc", ["x", "w"])  # (x: the whole vector)
        all_close_everywhere(comm, totals["gc", "x"][0], H[:-2, :-2] @ TG[1, :-2],
                             rtol=1e-12, atol=1e-12)
        all_close_everywhere(comm, totals["gc", "w"][0], H[-2:, :-2] @ TG[1, :-2],
                             rtol=1e-12, atol=1e-12)
        assert "hvp" in [e.phase for e in problem.schedule]


# -- an implicit operator: y with d y + v (v . y) + a y**3 = x (see helpers.CubicSolve) --
DG, VG = rng.uniform(2.0, 3.0, ROWS), 0.4 * rng.standard_normal(ROWS)
AG = 0.6  # the replicated scalar a
TA = np.array([0.8, -1.3, 0.4])  # a's part of three global directions (x's: TG[:, :ROWS])


def implicit_reference(z):
    """The objective of `implicit_objective` on the global x = z[:-1], with a = z[-1]."""
    x, a = z[:-1], z[-1]
    y = cubic_solution(x, a, DG, VG)
    return jnp.sum(jnp.cos(y)) + a * jnp.sum(y ** 2 * x)


HI = np.asarray(jax.hessian(implicit_reference)(np.append(XG, AG)))
DIRECTIONS = np.concatenate([TG[:, :ROWS], TA[:, None]], axis=1)  # over (x, a)


def implicit_objective(op):
    def f(x, a):  # x: this rank's block; the sums over ranks through AllreduceSum
        y = op(x, a)
        total = distop.AllreduceSum()(jnp.stack([jnp.sum(jnp.cos(y)), jnp.sum(y ** 2 * x)]))
        return total[0] + a * total[1]
    return f


def cubic(**fields):
    return CubicSolve(mine(DG), mine(VG), **fields)


class WithoutResidualHvp(CubicSolve):
    """`CubicSolve` without `residual_hvp`: its residual is nonlinear."""

    residual_hvp = distop.ImplicitOperator.residual_hvp


class LinearSolve(CubicSolve):
    """y with d y + v (v . y) = x: a residual linear in y and x together, declared so,
    without `residual_hvp`; unbatched adjoint methods."""

    linear = True
    batched_adjoint = False
    residual_hvp = distop.ImplicitOperator.residual_hvp

    def solve(self, comm, x):
        return super().solve(comm, x, 0.0)

    def solve_adjoint(self, comm, y_bar, y, x):
        return self._jacobian_solve(comm, y_bar, y, 0.0)

    def solve_linear(self, comm, rhs, y, x):
        return self._jacobian_solve(comm, rhs, y, 0.0)

    def residual_vjp(self, comm, lam, y, x):
        return (-lam,)

    def residual_jvp(self, comm, tangents, y, x):
        return -tangents[0]


def test_second_derivatives_through_an_implicit_operator_in_plain_jax():
    f = implicit_objective(cubic())
    x, t, ta = mine(XG), mine(TG[0, :ROWS]), TA[0]
    want = HI @ DIRECTIONS[0]
    grad = jax.grad(f, argnums=(0, 1))
    got = {
        "jvp of grad": jax.jvp(grad, (x, AG), (t, ta))[1],
        "jit jvp of grad": jax.jit(lambda x, t: jax.jvp(grad, (x, AG), (t, ta))[1])(x, t),
        "grad of grad": jax.grad(lambda x, a: grad(x, a)[0] @ t + grad(x, a)[1] * ta,
                                 argnums=(0, 1))(x, AG),
        "grad of jvp": jax.jit(jax.grad(lambda x, a: jax.jvp(f, (x, a), (t, ta))[1],
                                        argnums=(0, 1)))(x, AG),
    }
    for value in got.values():
        all_close_everywhere(comm, value[0], mine(want[:ROWS]), rtol=1e-10, atol=1e-10)
        all_close_everywhere(comm, value[1], want[ROWS], rtol=1e-10, atol=1e-10)
    # forward over reverse over the directions at once (one batched second-order adjoint)
    # and jax.hessian in the replicated input
    rows = jax.vmap(lambda t, ta: jax.jvp(grad, (x, AG), (t, ta))[1])(
        mine(TG[:, :ROWS]), TA)
    all_close_everywhere(comm, rows[0], mine((DIRECTIONS @ HI)[:, :ROWS]), rtol=1e-10,
                         atol=1e-10)
    all_close_everywhere(comm, rows[1], (DIRECTIONS @ HI)[:, ROWS], rtol=1e-10, atol=1e-10)
    hessian = jax.hessian(lambda a: f(x, a))(AG)
    all_close_everywhere(comm, hessian, HI[ROWS, ROWS], rtol=1e-10, atol=1e-10)


def test_compute_hvp_through_an_implicit_operator():
    for backend in ("lean", "io_callback"):
        op = cubic()
        f = implicit_objective(op)
        problem = distop.Problem(lambda x, a, f=f, op=op: {"f": f(x, a), "y": op(x, a)},
                                 {"x": mine(XG), "a": np.array(AG)}, distributed={"x", "y"},
                                 backend=backend)
        one = problem.compute_hvp("f", ["x", "a"], {"x": mine(TG[0, :ROWS]), "a": TA[0]})
        want = HI @ DIRECTIONS[0]
        all_close_everywhere(comm, one["x"], mine(want[:ROWS]), rtol=1e-10, atol=1e-10)
        all_close_everywhere(comm, one["a"], want[ROWS], rtol=1e-10, atol=1e-10)
        several = problem.compute_hvp("f", ["x", "a"], {"x": mine(TG[:, :ROWS]), "a": TA})
        want = DIRECTIONS @ HI
        all_close_everywhere(comm, several["x"], mine(want[:, :ROWS]), rtol=1e-10, atol=1e-10)
        all_close_everywhere(comm, several["a"], want[:, ROWS], rtol=1e-10, atol=1e-10)
        program = next(p for k, p in problem._programs.programs.items()
                       if k[0] == "compute_hvp")
        assert ("CubicSolve", "second_adjoint") in [(e.operator, e.phase)
                                                    for e in program.schedule]
        checked = problem.check_hvp("f", out_stream=None, progress=False)
        assert all(r.ok for r in checked.values()), checked


def test_check_hvp_fails_a_planted_residual_hvp_bug_on_one_rank():
    op = cubic(hvp_error=1e-3)  # (on rank 0 only)
    f = implicit_objective(op)
    problem = distop.Problem(lambda x, a: {"f": f(x, a)}, {"x": mine(XG), "a": np.array(AG)},
                             distributed="x")
    out = io.StringIO()
    results = problem.check_hvp("f", out_stream=out, progress=False)
    assert not results["f", "x"].ok, out.getvalue()
    with pytest.raises(distop.DerivativeCheckError, match=r"check_hvp: .*\('f', 'x'\)"):
        problem.check_hvp("f", "x", raise_on_error=True, out_stream=None, progress=False)


def test_check_operator_checks_an_implicit_operators_residual_hvp():
    x, a = mine(XG), np.array(AG)
    found = distop.check_operator(cubic(), x, a, replicated_inputs=[1], out_stream=None)
    assert all(found[p].ok for p in ("hvp vs fd", "hvp symmetry", "hvp batched")), found
    assert all(r.ok for r in found.values()), found
    out = io.StringIO()
    wrong = distop.check_operator(cubic(hvp_error=1e-3), x, a, replicated_inputs=[1],
                                  out_stream=out)
    assert not wrong["hvp vs fd"].ok and wrong["vjp vs fd"].ok
    if rank == 0:
        assert "CubicSolve.residual_hvp is wrong" in out.getvalue(), out.getvalue()
    without = distop.check_operator(WithoutResidualHvp(mine(DG), mine(VG)), x, a,
                                    replicated_inputs=[1], out_stream=None)
    assert "hvp vs fd" not in without and all(r.ok for r in without.values())


def test_an_implicit_operator_without_residual_hvp_is_refused_naming_it():
    op = WithoutResidualHvp(mine(DG), mine(VG))
    f = implicit_objective(op)
    problem = distop.Problem(lambda x, a: {"f": f(x, a)}, {"x": mine(XG), "a": np.array(AG)},
                             distributed="x")
    message = (r"WithoutResidualHvp\.\w+ on rank \d: WithoutResidualHvp is an implicit "
               r"operator .* does not implement residual_hvp\(self, comm, lam, tangent, y")
    with pytest.raises(distop.SecondDerivativeError, match=message):
        problem.compute_hvp("f", "x", {"x": mine(TG[0, :ROWS])})
    with pytest.raises(distop.SecondDerivativeError, match=message):
        jax.jvp(jax.grad(f), (mine(XG), AG), (mine(TG[0, :ROWS]), 0.0))
    # (first derivatives need none)
    grad = problem.compute_totals("f", "a")["f", "a"]
    all_close_everywhere(comm, grad, [[jax.grad(implicit_reference)(np.append(XG, AG))[-1]]],
                         rtol=1e-10)


def test_an_implicit_operator_with_a_linear_residual_needs_no_residual_hvp():
    def reference(x):
        y = cubic_solution(x, 0.0, DG, VG, iterations=2)
        return jnp.sum(jnp.cos(y)) + jnp.sum(y ** 2 * x)

    H = np.asarray(jax.hessian(reference)(XG))
    op = LinearSolve(mine(DG), mine(VG))

    def f(x):
        y = op(x)
        return distop.AllreduceSum()(jnp.sum(jnp.cos(y)) + jnp.sum(y ** 2 * x))

    problem = distop.Problem(lambda x: {"f": f(x)}, {"x": mine(XG)}, distributed="x")
    got = problem.compute_hvp("f", "x", {"x": mine(TG[:, :ROWS])})
    all_close_everywhere(comm, got["x"], mine(TG[:, :ROWS] @ H), rtol=1e-10, atol=1e-10)
    t = mine(TG[0, :ROWS])
    all_close_everywhere(comm, jax.jvp(jax.grad(f), (mine(XG),), (t,))[1],
                         mine(H @ TG[0, :ROWS]), rtol=1e-10, atol=1e-10)
    assert problem.check_hvp("f", out_stream=None, progress=False)["f", "x"].ok
