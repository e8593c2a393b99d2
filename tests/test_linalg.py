"""The Krylov solvers of distop.linalg in one process, against dense solves."""

import numpy as np
import pytest
import scipy.linalg
from mpi4py import MPI

import distop
from distop import linalg
from distop.linalg import ConvergenceError, SolveResult, cg, gmres


def spd(n, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n))
    return m @ m.T + n * np.eye(n), rng.standard_normal(n)


def nonsymmetric(n, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, n)) + 3 * np.sqrt(n) * np.eye(n), rng.standard_normal(n)


class Counting:
    """A dense matvec that counts its calls."""

    def __init__(self, a):
        self.a, self.calls = a, 0

    def __call__(self, v):
        self.calls += 1
        return self.a @ v


class CountingComm:
    """A one-rank communicator that counts its Allreduce calls and refuses the rest."""

    def __init__(self):
        self.allreduces = 0

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Allreduce(self, send, recv, op):
        assert isinstance(send, np.ndarray) and op == MPI.SUM
        self.allreduces += 1
        recv[...] = send


def residual_norm(a, x, b):
    return float(np.linalg.norm(b - a @ x))


@pytest.mark.parametrize("n", [1, 7, 40])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_cg_matches_a_dense_solve(n, preconditioned):
    a, b = spd(n)
    kwargs = {"precondition": lambda r: r / np.diag(a)} if preconditioned else {}
    result = cg(None, lambda v: a @ v, b, **kwargs)
    expected = scipy.linalg.solve(a, b, assume_a="pos")
    assert isinstance(result, SolveResult) and result.converged
    assert 1 <= result.iterations <= n + 5
    np.testing.assert_allclose(result.x, expected, rtol=1e-8, atol=1e-10)
    assert result.residual_norm == pytest.approx(residual_norm(a, result.x, b), rel=1e-6)
    assert result.residual_norm <= 1e-10 * np.linalg.norm(b)


def test_cg_with_a_dense_spd_preconditioner_and_a_starting_guess():
    a, b = spd(30, seed=3)
    m_inv = np.linalg.inv(a + np.diag(np.arange(30.0)))  # SPD, close to A^-1
    x0 = np.ones(30)
    plain = cg(None, lambda v: a @ v, b, x0)
    result = cg(None, lambda v: a @ v, b, x0, precondition=lambda r: m_inv @ r)
    np.testing.assert_allclose(result.x, np.linalg.solve(a, b), rtol=1e-8)
    assert result.converged and result.iterations < plain.iterations
    assert np.all(x0 == 1.0)  # x0 itself is left alone


@pytest.mark.parametrize("restart", [3, 10, 60])
@pytest.mark.parametrize("preconditioned", [False, True])
def test_gmres_matches_a_dense_solve_and_its_transpose(restart, preconditioned):
    a, b = nonsymmetric(40)
    assert not np.allclose(a, a.T)
    for op in (a, a.T):  # the operator and its adjoint
        kwargs = {"precondition": lambda r, op=op: r / np.diag(op)} if preconditioned else {}
        result = gmres(None, lambda v, op=op: op @ v, b, restart=restart, **kwargs)
        assert result.converged
        np.testing.assert_allclose(result.x, np.linalg.solve(op, b), rtol=1e-8, atol=1e-10)
        assert result.residual_norm == pytest.approx(residual_norm(op, result.x, b), rel=1e-6)
        assert result.residual_norm <= 1e-10 * np.linalg.norm(b)


def test_gmres_solves_the_identity_in_one_iteration():
    b = np.arange(1.0, 6.0)
    result = gmres(None, lambda v: v, b)
    assert result.converged and result.iterations == 1
    np.testing.assert_allclose(result.x, b)


@pytest.mark.parametrize("solver", [cg, gmres])
def test_b_zero_returns_zero_at_once(solver):
    a, _ = spd(5)
    matvec = Counting(a)
    result = solver(None, matvec, np.zeros(5), np.ones(5))
    assert result.converged and result.iterations == 0 and result.residual_norm == 0.0
    assert np.all(result.x == 0.0) and matvec.calls == 0


@pytest.mark.parametrize("solver", [cg, gmres])
def test_an_empty_block(solver):
    result = solver(None, lambda v: 2 * v, np.zeros(0))
    assert result.converged and result.x.shape == (0,) and result.iterations == 0


@pytest.mark.parametrize("solver", [cg, gmres])
def test_a_starting_guess_that_solves_it_takes_no_iteration(solver):
    a, b = spd(6)
    result = solver(None, lambda v: a @ v, b, np.linalg.solve(a, b))
    assert result.converged and result.iterations == 0


def test_float32_blocks_stay_float32():
    a, b = spd(10)
    result = cg(None, lambda v: (a @ v).astype(np.float32), b.astype(np.float32), rtol=1e-5)
    assert result.x.dtype == np.float32 and result.converged
    np.testing.assert_allclose(result.x, np.linalg.solve(a, b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("solver", [cg, gmres])
def test_comm_self_gives_what_one_process_gives(solver):
    a, b = spd(12)
    alone = solver(None, lambda v: a @ v, b)
    on_self = solver(MPI.COMM_SELF, lambda v: a @ v, b)
    assert on_self.iterations == alone.iterations
    np.testing.assert_array_equal(on_self.x, alone.x)


def test_cg_makes_two_allreduces_per_iteration_and_gmres_at_most_three():
    a, b = spd(20)
    comm = CountingComm()
    result = cg(comm, lambda v: a @ v, b)
    # one for ||b||, two per iteration, one for the residual checked at the end
    assert comm.allreduces == 2 * result.iterations + 2, (comm.allreduces, result.iterations)
    comm = CountingComm()
    result = gmres(comm, lambda v: a @ v, b, restart=50)
    assert comm.allreduces <= 3 * result.iterations + 2, (comm.allreduces, result.iterations)


@pytest.mark.parametrize("solver", [cg, gmres])
def test_maxiter_too_small_raises_with_what_to_do(solver):
    a, b = spd(40)
    with pytest.raises(ConvergenceError) as info:
        solver(None, lambda v: a @ v, b, maxiter=3, name="Poisson.solve_adjoint")
    message = str(info.value)
    for part in ("Poisson.solve_adjoint on rank 0 of 1", "maxiter=3", "after 3 iterations",
                 "misses the tolerance", "raise maxiter", "loosen rtol", "transpose"):
        assert part in message, (part, message)
    result = info.value.result
    assert not result.converged and result.iterations == 3
    assert f"{result.residual_norm:.3e}" in message
    assert result.residual_norm == pytest.approx(residual_norm(a, result.x, b))
    assert isinstance(info.value, distop.DistopError)
    assert linalg.ConvergenceError is distop._errors.ConvergenceError


@pytest.mark.parametrize("solver", [cg, gmres])
def test_raise_on_failure_false_returns_the_unconverged_result(solver):
    a, b = spd(40)
    result = solver(None, lambda v: a @ v, b, maxiter=2, raise_on_failure=False)
    assert not result.converged and result.iterations == 2
    assert result.residual_norm == pytest.approx(residual_norm(a, result.x, b))
    assert result.residual_norm > 1e-10 * np.linalg.norm(b)


def test_cg_breaks_down_on_an_operator_that_is_not_positive_definite():
    a, b = spd(10)
    with pytest.raises(ConvergenceError, match=r"p\^T A p = .* <= 0, so the operator is not "
                       "positive definite.*symmetric positive definite.*use gmres"):
        cg(None, lambda v: -(a @ v), b)


def test_cg_breaks_down_on_a_preconditioner_that_is_not_positive_definite():
    a, b = spd(10)
    with pytest.raises(ConvergenceError, match="the preconditioner is not positive definite"):
        cg(None, lambda v: a @ v, b, precondition=lambda r: -r)


@pytest.mark.parametrize("solver", [cg, gmres])
def test_nan_from_matvec_raises(solver):
    with pytest.raises(ConvergenceError, match="NaN or infinity"):
        solver(None, lambda v: np.full_like(v, np.nan), np.ones(4))


def test_gmres_reports_stagnation():
    # a cyclic shift: GMRES(5) on it makes no progress on a vector of 30 entries
    b = np.zeros(30)
    b[0] = 1.0
    with pytest.raises(ConvergenceError, match="stagnation.*raise restart"):
        gmres(None, lambda v: np.roll(v, 1), b, restart=5)


@pytest.mark.parametrize("solver", [cg, gmres])
def test_wrong_blocks_say_which_and_on_which_rank(solver):
    with pytest.raises(ValueError, match=r"solve on rank 0 of 1: b has shape \(2, 2\); "
                       "expected this rank's block"):
        solver(None, lambda v: v, np.ones((2, 2)), name="solve")
    with pytest.raises(ValueError, match=r"x0 has shape \(3,\) but b has shape \(4,\)"):
        solver(None, lambda v: v, np.ones(4), np.ones(3))
    with pytest.raises(ValueError, match=r"on rank 0 of 1: matvec returned an array of "
                       r"shape \(3,\); expected .* shape \(4,\)"):
        solver(None, lambda v: v[:3], np.ones(4))
    with pytest.raises(ValueError, match=r"precondition returned an array of shape \(5,\)"):
        solver(None, lambda v: 2 * v, np.ones(4), precondition=lambda r: np.ones(5))
    with pytest.raises(TypeError, match="complex systems are not supported"):
        solver(None, lambda v: v, np.ones(4, complex))
    with pytest.raises(ValueError, match=r"maxiter=-1"):
        solver(None, lambda v: v, np.ones(4), maxiter=-1)
    with pytest.raises(ValueError, match=r"rtol=nan"):
        solver(None, lambda v: v, np.ones(4), rtol=float("nan"))


def test_gmres_refuses_a_restart_below_one():
    with pytest.raises(ValueError, match=r"gmres\(restart=0\)"):
        gmres(None, lambda v: v, np.ones(4), restart=0)


@pytest.mark.parametrize("solver", [cg, gmres])
def test_functions_get_read_only_blocks_and_may_return_them(solver):
    seen = []

    def matvec(v):
        seen.append(v.flags.writeable)
        return v  # the identity, returning its argument

    result = solver(None, matvec, np.arange(1.0, 5.0), precondition=lambda r: r)
    assert result.converged and seen and not any(seen)
    np.testing.assert_allclose(result.x, np.arange(1.0, 5.0))


@pytest.mark.parametrize("solver", [cg, gmres])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["b", "x0"])
def test_a_non_finite_b_or_x0_is_never_converged(solver, bad, where):
    b, x0 = np.array([1.0, 2.0]), np.zeros(2)
    (b if where == "b" else x0)[1] = bad
    with pytest.raises(ConvergenceError, match=f"{where} hold.* a NaN or infinity") as info:
        solver(None, lambda v: v, b, x0)
    assert not info.value.result.converged
    result = solver(None, lambda v: v, b, x0, raise_on_failure=False)
    assert not result.converged and not np.isfinite(result.residual_norm)
    assert result.iterations == 0


@pytest.mark.parametrize("solver", [cg, gmres])
def test_a_non_finite_residual_is_never_converged(solver):
    # the operator overflows: the residual is infinite, whatever the tolerance
    result = solver(None, lambda v: v * np.inf, np.array([1.0, 2.0]), np.ones(2),
                    atol=1e300, raise_on_failure=False)
    assert not result.converged and not np.isfinite(result.residual_norm)


@pytest.mark.parametrize("tiny", [1e-17, 1e-30, 0.0])
def test_gmres_never_ends_worse_than_its_start_with_a_singular_preconditioner(tiny):
    a, m = np.diag([2.0, 3.0, 4.0]), np.diag([1.0, 1.0, tiny])
    b, x0 = np.array([0.0, 1.0, 1.0]), np.array([1.0, 0.0, 0.0])
    result = gmres(None, lambda v: a @ v, b, x0, precondition=lambda v: m @ v,
                   rtol=1e-15, atol=0.0, raise_on_failure=False)
    assert result.residual_norm <= residual_norm(a, x0, b)
    assert result.residual_norm == pytest.approx(residual_norm(a, result.x, b))
    if tiny == 0.0:  # the third entry of b is out of reach: the best is a residual of 1
        assert not result.converged and result.residual_norm == pytest.approx(1.0)
        with pytest.raises(ConvergenceError, match="stagnation|breakdown"):
            gmres(None, lambda v: a @ v, b, x0, precondition=lambda v: m @ v, rtol=1e-15)
    else:  # M is nonsingular, only badly scaled: GMRES solves it
        assert result.converged


def test_gmres_restarts_never_make_the_residual_worse():
    rng = np.random.default_rng(3)
    for _ in range(100):
        a = rng.standard_normal((6, 6))
        q = np.linalg.qr(rng.standard_normal((6, 6)))[0]
        d = np.ones(6)
        d[rng.integers(6)] = 10.0 ** float(rng.integers(-40, 0))
        m = q @ np.diag(d) @ q.T  # nearly singular
        b, x0 = rng.standard_normal(6), rng.standard_normal(6)
        result = gmres(None, lambda v, a=a: a @ v, b, x0, precondition=lambda v, m=m: m @ v,
                       restart=int(rng.integers(1, 6)), rtol=1e-14, raise_on_failure=False)
        assert result.residual_norm <= residual_norm(a, x0, b)
        assert result.residual_norm == pytest.approx(residual_norm(a, result.x, b),
                                                     rel=1e-9, abs=1e-12)


def test_gmres_reports_a_breakdown_on_an_operator_that_maps_the_residual_to_zero():
    with pytest.raises(ConvergenceError, match="breakdown at iteration 1.*singular") as info:
        gmres(None, lambda v: 0.0 * v, np.ones(4))
    np.testing.assert_array_equal(info.value.result.x, np.zeros(4))


def test_gmres_keeps_its_best_iterate_where_the_update_is_not_finite():
    calls = []

    def precondition(v):  # the final update of the first cycle overflows
        calls.append(1)
        return v if len(calls) <= 4 else np.full_like(v, np.inf)

    def matvec(v):
        with np.errstate(all="ignore"):  # (inf - inf in the product: NaN, no warning)
            return a @ v

    a, b = nonsymmetric(4)
    x0 = np.linalg.solve(a, b) + 1e-3
    result = gmres(None, matvec, b, x0, precondition=precondition, restart=4,
                   raise_on_failure=False)
    assert not result.converged and np.all(np.isfinite(result.x))
    np.testing.assert_array_equal(result.x, x0)
    assert result.residual_norm == pytest.approx(residual_norm(a, x0, b))
    calls.clear()
    with pytest.raises(ConvergenceError, match="breakdown at iteration 4: a NaN or infinity"):
        gmres(None, matvec, b, x0, precondition=precondition, restart=4)
