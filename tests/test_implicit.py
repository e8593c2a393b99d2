"""Implicit operators in a single process: values and derivatives against dense solves,
one solve per call, batched adjoints, and the errors that name the user's method."""

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import distop
from distop import linalg

N = 6
_rng = np.random.default_rng(7)
_M = _rng.normal(size=(N, N))
A = _M @ _M.T + N * np.eye(N)  # SPD
B = A + np.triu(_rng.normal(size=(N, N)), 1)  # not symmetric: the adjoint differs


class Scaled(distop.ImplicitOperator):
    """y with (k B) y = b + c, for a vector b, a scalar k and a shift c; counts its
    methods' calls."""

    calls: ClassVar[list] = []  # (class-level: the instances are equinox modules)

    def solve(self, comm, b, k, c):
        self.calls.append("solve")
        return np.linalg.solve(k * B, b + c)

    def solve_adjoint(self, comm, y_bar, y, b, k, c):
        self.calls.append("solve_adjoint")
        return np.linalg.solve((k * B).T, y_bar)

    def residual_vjp(self, comm, lam, y, b, k, c):
        # R = k B y - b - c: dR/db = -I, dR/dk = B y, dR/dc = -1
        self.calls.append("residual_vjp")
        return -lam, np.asarray(lam @ (B @ y)), np.asarray(-lam.sum())

    def solve_linear(self, comm, rhs, y, b, k, c):
        return np.linalg.solve(k * B, rhs)

    def residual_jvp(self, comm, tangents, y, b, k, c):
        tb, tk, tc = tangents
        return -tb + tk * (B @ y) - tc


class BatchedScaled(Scaled):
    """`Scaled` with one block solve for every seed."""

    batched_adjoint = True

    def solve_adjoint(self, comm, y_bar, y, b, k, c):
        self.calls.append(("solve_adjoint", y_bar.shape, y.shape))
        return np.linalg.solve((k * B).T, y_bar.T).T.copy()

    def residual_vjp(self, comm, lam, y, b, k, c):
        self.calls.append(("residual_vjp", lam.shape))
        return -lam, lam @ (B @ y), -lam.sum(axis=1)


def dense(b, k, c):
    return jnp.linalg.solve(k * B, b + c)


POINT = (np.linspace(-1.0, 1.0, N), 1.5, 0.25)


@pytest.mark.parametrize("cls", [Scaled, BatchedScaled])
def test_derivatives_match_a_dense_solve(cls):
    op = cls()
    f = lambda b, k, c: jnp.sum(op(b, k, c) ** 3)  # noqa: E731
    g = lambda b, k, c: jnp.sum(dense(b, k, c) ** 3)  # noqa: E731
    for got, want in zip(jax.grad(f, (0, 1, 2))(*POINT), jax.grad(g, (0, 1, 2))(*POINT)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    jitted = jax.jit(jax.jacrev(lambda b: op(b, 1.5, 0.25)))(POINT[0])
    np.testing.assert_allclose(jitted, jnp.linalg.inv(1.5 * B), rtol=1e-12, atol=1e-14)
    tangent = (np.ones(N), 0.5, -1.0)
    _, got = jax.jvp(lambda *a: op(*a), POINT, tangent)
    _, want = jax.jvp(dense, POINT, tangent)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", [Scaled, BatchedScaled])
def test_problem_totals_solve_once_and_reuse_y(cls):
    op = cls()
    problem = distop.Problem(lambda b, k, c: {"y": op(b, k, c)},
                             dict(zip("bkc", POINT)))
    cls.calls.clear()
    values = problem.run()
    np.testing.assert_allclose(values["y"], dense(*POINT), rtol=1e-12)
    assert cls.calls == ["solve"]
    for mode in ("batched", "loop", "unrolled"):
        cls.calls.clear()
        J = problem.compute_totals(mode=mode)
        inverse = np.linalg.inv(1.5 * B)
        np.testing.assert_allclose(J["y", "b"], inverse, rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(J["y", "c"], inverse.sum(axis=1, keepdims=True),
                                   rtol=1e-11, atol=1e-13)
        np.testing.assert_allclose(J["y", "k"], -(values["y"] / 1.5)[:, None],
                                   rtol=1e-11, atol=1e-13)
        solves = [c for c in cls.calls if c == "solve"]
        assert len(solves) <= 1, cls.calls  # the adjoint never solves the forward again
    cls.calls.clear()
    values, J = problem.run_and_compute_totals()
    assert [c for c in cls.calls if c == "solve"] == ["solve"]
    if cls is BatchedScaled:  # one block solve for the N seeds, y without a batch axis
        assert ("solve_adjoint", (N, N), (N,)) in cls.calls
        assert ("residual_vjp", (N, N)) in cls.calls
    assert all(r.ok for r in problem.check_totals(out_stream=None).values())


def test_schedule_names_the_solve_and_the_adjoint():
    op = Scaled()
    problem = distop.Problem(lambda b, k, c: {"f": jnp.sum(op(b, k, c) ** 2)},
                             dict(zip("bkc", POINT)))
    problem.compute_totals()
    phases = [(e.operator, e.phase) for e in problem.schedule]
    assert ("Scaled", "solve") in phases and ("Scaled", "adjoint") in phases
    assert phases.index(("Scaled", "solve")) < phases.index(("Scaled", "adjoint"))


def test_integer_inputs_get_no_cotangent():
    class Shifted(distop.ImplicitOperator):
        def solve(self, comm, b, n):
            return np.linalg.solve(A, b) + n

        def solve_adjoint(self, comm, y_bar, y, b, n):
            return np.linalg.solve(A.T, y_bar)

        def residual_vjp(self, comm, lam, y, b, n):
            return -lam, None  # R = A (y - n) - b: dR/db = -I

    op = Shifted()
    b = np.ones(N)
    grad = jax.grad(lambda b: jnp.sum(op(b, np.int32(2))))(b)
    np.testing.assert_allclose(grad, np.linalg.solve(A, np.ones(N)), rtol=1e-12)


def test_a_missing_adjoint_names_the_method():
    class OnlySolve(distop.ImplicitOperator):
        def solve(self, comm, b):
            return b * 2.0

    op = OnlySolve()
    np.testing.assert_array_equal(op(np.ones(2)), 2.0 * np.ones(2))
    with pytest.raises(distop.MissingMethodError, match=r"OnlySolve does not implement "
                       r"solve_adjoint\(self, comm, y_bar, y, \*inputs\)"):
        jax.grad(lambda b: jnp.sum(op(b)))(np.ones(2))
    with pytest.raises(distop.MissingMethodError, match="solve_linear"):
        jax.jvp(op, (np.ones(2),), (np.ones(2),))


def test_wrong_results_name_the_method_and_what_is_expected():
    class Wrong(Scaled):
        def residual_vjp(self, comm, lam, y, b, k, c):
            return -lam[:-1], np.asarray(0.0), np.asarray(0.0)

    class NotATuple(Scaled):
        def residual_vjp(self, comm, lam, y, b, k, c):
            return -lam

    class Raises(Scaled):
        def solve_adjoint(self, comm, y_bar, y, b, k, c):
            raise RuntimeError("the adjoint did not converge")

    f = lambda op: jax.grad(lambda b: jnp.sum(op(b, 1.0, 0.0)))(np.ones(N))  # noqa: E731
    with pytest.raises(distop.OperatorError, match=r"Wrong.residual_vjp on rank 0: returned "
                       r"input cotangent 0 with shape \(5,\).*expected .*shape \(6,\)"):
        f(Wrong())
    with pytest.raises(distop.OperatorError, match=r"NotATuple.residual_vjp on rank 0: "
                       r"returned a ndarray; expected a tuple with one array per input"):
        f(NotATuple())
    with pytest.raises(distop.OperatorError, match=r"Raises.solve_adjoint on rank 0: raised "
                       r"RuntimeError: the adjoint did not converge"):
        f(Raises())


def test_declarations_are_checked_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"Bad.adjoint_collectives names 'Allreduse'.*"
                       r"Did you mean 'Allreduce'"):
        class Bad(distop.ImplicitOperator):
            adjoint_collectives = ("Allreduse",)


def test_vmap_over_the_inputs_solves_each():
    op = BatchedScaled()
    bs = np.stack([POINT[0], 2.0 * POINT[0]])
    got = jax.vmap(jax.grad(lambda b: jnp.sum(op(b, 1.5, 0.25) ** 2)))(bs)
    want = jax.vmap(jax.grad(lambda b: jnp.sum(dense(b, 1.5, 0.25) ** 2)))(bs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


class Sqrt(distop.ImplicitOperator):
    """y with y^2 = x, for complex x too."""

    complex_step = True

    def solve(self, comm, x):
        return np.sqrt(x)

    def solve_adjoint(self, comm, y_bar, y, x):
        return y_bar / (2 * y)

    def residual_vjp(self, comm, lam, y, x):
        return (-lam,)


def test_complex_step_checks_an_implicit_operator_that_declares_it():
    problem = distop.Problem(lambda x: {"y": Sqrt()(x)}, {"x": np.array([4.0, 9.0])})
    results = problem.check_totals(method="cs", out_stream=None)
    assert all(r.ok for r in results.values())

    class RealSqrt(Sqrt):
        complex_step = False

    refused = distop.Problem(lambda x: {"y": RealSqrt()(x)}, {"x": np.array([4.0, 9.0])})
    with pytest.raises(distop.DistopError, match=r"RealSqrt.solve on rank 0.*does not "
                       "declare complex_step = True"):
        refused.check_totals(method="cs", out_stream=None)

    class ChosenSqrt(Sqrt):
        complex: bool = True

        def takes_complex_step(self):
            return self.complex

    chosen = distop.Problem(lambda x: {"y": ChosenSqrt(False)(x)}, {"x": np.array([4.0])})
    with pytest.raises(distop.DistopError, match="takes_complex_step"):
        chosen.check_totals(method="cs", out_stream=None)


def test_the_class_body_ordered_setting_holds_for_implicit_operators():
    class OrderedSqrt(Sqrt):
        ordered = True

    jaxpr = jax.make_jaxpr(OrderedSqrt())(jnp.ones(2))
    assert "OrderedSqrt.solve[ordered]" in str(jaxpr), jaxpr
    assert "OrderedSqrt.state[ordered]" in str(jaxpr) and jaxpr.effects
    jaxpr = jax.make_jaxpr(OrderedSqrt(ordered=False))(jnp.ones(2))
    assert "OrderedSqrt.solve[unordered]" in str(jaxpr) and not jaxpr.effects
    assert OrderedSqrt().is_ordered() and not Sqrt().is_ordered()


def test_the_explicit_names_of_declarations_hold_for_implicit_operators():
    from mpi4py import MPI

    class Summed(Scaled):
        """Scaled, its methods making (one-rank) Allreduce calls declared by the names
        an explicit operator uses."""

        forward_collectives = ("Allreduce",)
        vjp_collectives = ("Allreduce",)
        batched_vjp = True  # (batched_adjoint, as an explicit operator says it)

        def solve(self, comm, b, k, c):
            comm.Allreduce(MPI.IN_PLACE, b.copy(), op=MPI.SUM)
            return super().solve(comm, b, k, c)

        def solve_adjoint(self, comm, y_bar, y, b, k, c):
            self.calls.append(("solve_adjoint", y_bar.shape))
            comm.Allreduce(MPI.IN_PLACE, y_bar.copy(), op=MPI.SUM)
            return np.linalg.solve((k * B).T, y_bar.T).T.copy()

        def residual_vjp(self, comm, lam, y, b, k, c):
            return -lam, lam @ (B @ y), -lam.sum(axis=1)

    op = Summed()
    Summed.calls.clear()
    problem = distop.Problem(lambda b, k, c: {"y": op(b, k, c)}, dict(zip("bkc", POINT)))
    J = problem.compute_totals()
    np.testing.assert_allclose(J["y", "b"], np.linalg.inv(1.5 * B), rtol=1e-11, atol=1e-13)
    assert ("solve_adjoint", (N, N)) in Summed.calls  # one block solve for the N seeds


def test_a_batched_solve_takes_the_whole_batch_in_one_call():
    shapes = []

    class BatchedSolve(Sqrt):
        batched_forward = True

        def solve(self, comm, x, batched=False):
            shapes.append((x.shape, batched))
            return np.sqrt(x)

    xs = np.array([[4.0, 9.0], [16.0, 25.0], [1.0, 4.0]])
    got = jax.vmap(BatchedSolve())(xs)
    np.testing.assert_allclose(got, np.sqrt(xs), rtol=1e-15)
    assert shapes == [((3, 2), True)]
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda x: jnp.sum(BatchedSolve()(x))))(xs),
                               0.5 / np.sqrt(xs), rtol=1e-14)


def test_linear_transpose_of_an_implicit_operator_says_what_to_do():
    class Third(distop.ImplicitOperator):
        linear = True

        def solve(self, comm, x):
            return x / 3.0

        def solve_adjoint(self, comm, y_bar, y, x):
            return y_bar / 3.0

        def residual_vjp(self, comm, lam, y, x):
            return (-lam,)

    with pytest.raises(distop.DistopError, match=r"jax.linear_transpose: Third on rank 0 is "
                       "an implicit operator.*jax.vjp"):
        jax.linear_transpose(Third(), jnp.ones(2))(jnp.ones(2))
    _, pull = jax.vjp(Third(), jnp.ones(2))  # the transpose it points to
    np.testing.assert_allclose(pull(jnp.ones(2))[0], np.full(2, 1.0 / 3.0), rtol=1e-15)


def test_a_convergence_error_in_a_method_stays_a_convergence_error():
    class Unconverged(Scaled):
        def solve(self, comm, b, k, c):
            return linalg.cg(None, lambda v: k * (A @ v), b + c, maxiter=1,
                                    name="Unconverged.solve").x

    problem = distop.Problem(lambda b: {"y": Unconverged()(b, 1.0, 0.0)}, {"b": np.ones(N)})
    with pytest.raises(linalg.ConvergenceError) as info:
        problem.run()
    err = info.value
    assert isinstance(err, distop.OperatorError), type(err).__mro__
    assert "Unconverged.solve on rank 0: raised ConvergenceError" in str(err)
    assert err.result is not None and not err.result.converged  # (its SolveResult kept)

    class Plain(distop.DistributedOperator):
        def forward(self, comm, b):
            return linalg.cg(None, lambda v: A @ v, b, maxiter=1, name="Plain.forward").x

    problem = distop.Problem(lambda b: {"y": Plain()(b)}, {"b": np.ones(N)})
    with pytest.raises(linalg.ConvergenceError) as again:
        problem.run()
    assert type(again.value) is type(err)  # (one class for both kinds, made once)
    # the method's own error is the cause: its traceback shows where the solve stopped
    assert isinstance(again.value.__cause__, linalg.ConvergenceError)
