"""Hessian-vector products of a Problem in a single process (and the cases of
tests/mpi/test_hvp.py, which run under MPI too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Coupled, Cube, NormScale, mpi_tests, norm_scale

import distop


@pytest.mark.parametrize("case", mpi_tests("test_hvp"))
def test_case(case):
    case()


X = np.array([0.5, -1.5, 2.0])


def test_compute_hvp_checks_its_arguments():
    problem = distop.Problem(lambda x, n: {"f": jnp.sum(NormScale()(x)) * n, "y": x * 2.0},
                             {"x": X, "n": np.array(2)})
    for args, error, message in [
        (("y", "x", {"x": X}), ValueError, r"compute_hvp\(of='y'\): output 'y' has shape "
                                           r"\(3,\); expected a scalar"),
        (("g", "x", {"x": X}), ValueError, r"no output named 'g'"),
        ((["f"], "x", {"x": X}), TypeError, r"expected the name of one scalar output"),
        (("f", "z", {"z": X}), ValueError, r"compute_hvp\(wrt=\['z'\]\): no input named"),
        (("f", "n", {"n": np.array(1)}), ValueError, r"'n' is not floating point"),
        (("f", "x", {"y": X}), ValueError, r"its names \['y'\] are not those of wrt"),
        (("f", "x", X), TypeError, r"expected a dict of input name -> array"),
        (("f", "x", {"x": X[:2]}), ValueError, r"shape \(2,\); expected \(3,\).*\(K, \*"),
        (("f", "x", {"x": X + 1j}), TypeError, r"got complex128 values for a float64"),
        (("f", "x", {"x": np.zeros((0, 3))}), ValueError, r"no directions"),
    ]:
        with pytest.raises(error, match=message):
            problem.compute_hvp(*args)
    got = problem.compute_hvp("f", "x", {"x": X})  # (and then works)
    want = jax.hessian(lambda x: 2 * jnp.sum(norm_scale(x)))(X) @ X
    np.testing.assert_allclose(got["x"], want, rtol=1e-13)


def test_compute_hvp_through_an_operator_without_hvp_raises_naming_it():
    problem = distop.Problem(lambda x: {"f": jnp.sum(jnp.sin(Cube()(x)))}, {"x": X})
    with pytest.raises((distop.MissingMethodError, distop.SecondDerivativeError),
                       match="Cube does not implement jvp"):
        problem.compute_hvp("f", "x", {"x": X})

    class ForwardCube(Cube):
        def jvp(self, comm, t, x):
            return 3 * x ** 2 * t

    for backend in ("lean", "io_callback"):
        problem = distop.Problem(lambda x: {"f": jnp.sum(jnp.sin(ForwardCube()(x)))},
                                 {"x": X}, backend=backend)
        with pytest.raises(distop.SecondDerivativeError,
                           match="ForwardCube does not implement hvp"):
            problem.compute_hvp("f", "x", {"x": X})


def test_compute_hvp_makes_one_call_per_operator_method_for_all_directions():
    op = NormScale(seen=[])
    problem = distop.Problem(lambda x: {"f": jnp.sum(jnp.sin(op(x)))}, {"x": X})
    tangents = np.random.default_rng(1).standard_normal((8, 3))
    got = problem.compute_hvp("f", "x", {"x": tangents})
    H = jax.hessian(lambda x: jnp.sum(jnp.sin(norm_scale(x))))(X)
    np.testing.assert_allclose(got["x"], tangents @ H, rtol=1e-12)
    assert op.seen == [((8, 3), (8, 3))]
    # the program: a forward, a jvp, an hvp and a vjp call, all its directions at once
    # (the lean path's schedule of the last program built)
    program = next(p for k, p in problem._programs.programs.items() if k[0] == "compute_hvp")
    assert sorted(e.phase for e in program.schedule) == ["forward", "hvp", "jvp", "vjp"]


def test_compute_hvp_of_a_0d_input():
    op = NormScale()
    problem = distop.Problem(lambda x, a: {"f": a ** 3 * jnp.sum(jnp.sin(op(x)))},
                             {"x": X, "a": np.array(1.5)})
    got = problem.compute_hvp("f", ["x", "a"], {"x": X[::-1], "a": np.array(-2.0)})
    assert got["a"].shape == () and got["x"].shape == (3,)
    H = jax.hessian(lambda z: z[3] ** 3 * jnp.sum(jnp.sin(norm_scale(z[:3]))))(
        np.append(X, 1.5))
    want = H @ np.append(X[::-1], -2.0)
    np.testing.assert_allclose(got["x"], want[:3], rtol=1e-12)
    np.testing.assert_allclose(got["a"], want[3], rtol=1e-12)


def test_a_second_derivative_through_an_implicit_operator_raises_naming_it():
    op = Coupled()
    b = np.array([1.0, 2.0, 3.0])
    f = lambda b: jnp.sum(jnp.sin(op(b, 2.0)))  # noqa: E731
    with pytest.raises(distop.SecondDerivativeError,
                       match=r"Coupled.adjoint on rank 0: Coupled is an implicit operator "
                             r"with a residual not declared linear, and does not implement "
                             r"residual_hvp\(self, comm, lam, tangent, y, \*inputs\)"):
        jax.grad(lambda b: jax.grad(f)(b) @ b)(b)
    with pytest.raises(distop.MissingMethodError, match=r"Coupled does not implement "
                                                        r"solve_linear"):
        jax.hessian(f)(b)  # (forward over reverse: its linear solve first)

    class WithResidualHvp(Coupled):  # (but no forward mode, which the products need too)
        def residual_hvp(self, comm, lam, tangent, y, b, k):
            raise AssertionError("never called")

    op = WithResidualHvp()
    with pytest.raises(distop.SecondDerivativeError,
                       match=r"WithResidualHvp.adjoint on rank 0: WithResidualHvp does not "
                             r"implement solve_linear\(self, comm, rhs, y, \*inputs\), which "
                             r"second derivatives .* need besides residual_hvp"):
        jax.grad(lambda b: jax.grad(f)(b) @ b)(b)


def test_compute_hvp_with_another_number_of_directions_makes_another_program():
    op = NormScale()
    problem = distop.Problem(lambda x: {"f": jnp.sum(jnp.sin(op(x)))}, {"x": X})
    H = jax.hessian(lambda x: jnp.sum(jnp.sin(norm_scale(x))))(X)
    T = np.random.default_rng(2).standard_normal((3, 3))
    for tangents in (T, T[:2], T[0], T[:1], T):
        got = problem.compute_hvp("f", "x", {"x": tangents})["x"]
        assert got.shape == tangents.shape
        np.testing.assert_allclose(got, tangents @ H, rtol=1e-12)


def test_compute_hvp_through_an_operator_inside_lax_scan():
    op = NormScale()

    def f(x, op):
        y, _ = jax.lax.scan(lambda c, _: (jnp.sin(op(c)), None), x, None, length=3)
        return jnp.sum(y)

    x = X / 3
    H = jax.hessian(lambda x: f(x, norm_scale))(x)
    T = np.random.default_rng(0).standard_normal((4, 3))
    for backend in ("lean", "io_callback"):
        problem = distop.Problem(lambda x: {"f": f(x, op)}, {"x": x}, backend=backend)
        np.testing.assert_allclose(problem.compute_hvp("f", "x", {"x": T})["x"], T @ H,
                                   rtol=1e-12, atol=1e-14)
        program = next(p for k, p in problem._programs.programs.items()
                       if k[0] == "compute_hvp")
        # (on the lean path its calls are on the token chain, counted per run)
        assert (program.n_calls != 0) == (backend == "lean")
