"""Conjugate gradients, for a symmetric positive definite operator."""

import math
from typing import Any

import numpy as np

from ._solve import NAN_WHY, Block, Solve, SolveResult

_FIX = ("check that the operator (and the preconditioner) is symmetric positive definite, "
        "and for an adjoint solve that matvec applies the transpose; use gmres for a "
        "non-symmetric or indefinite operator")


def cg(comm: Any, matvec: Block, b: np.ndarray, x0: np.ndarray | None = None, *,
       rtol: float = 1e-10, atol: float = 0.0, maxiter: int | None = None,
       precondition: Block | None = None, name: str = "cg",
       raise_on_failure: bool = True) -> SolveResult:
    """Solve A x = b for a symmetric positive definite A by conjugate gradients.

    Collective: every rank calls it with its own blocks and the same options, and
    every rank makes the same iterations, `matvec` calls and verdict (see the module's
    docstring). Each iteration makes two `Allreduce` calls of a few scalars. The
    iterations stop where ||r|| <= max(rtol * ||b||, atol) (global 2-norms), and that
    is checked on b - A x itself before the solve reports convergence.

    **Arguments:**
    - `comm`: the mpi4py communicator the blocks are spread over (an operator method's
      own `comm` too: declare `"Allreduce"` beside `matvec`'s calls), or None for one
      process (no MPI calls).
    - `matvec`: `matvec(v)` returns this rank's block of A v from this rank's block of
      v (read-only), exchanging halos itself.
    - `b`: this rank's block of the right-hand side, a 1-D array of any length.
    - `x0`: this rank's block of the starting guess (default zeros).
    - `rtol`, `atol`: the relative and absolute tolerances.
    - `maxiter`: the most iterations (default 10 times the global size).
    - `precondition`: `precondition(r)` returns this rank's block of M^-1 r, for a
      symmetric positive definite M (default none).
    - `name`: the solver's name in messages, e.g. "Poisson.solve_adjoint".
    - `raise_on_failure`: if False, return an unconverged result instead of raising.

    **Returns:** a `SolveResult`; x = 0 at once where b = 0.

    **Raises:** `ConvergenceError` on every rank where the tolerance is not met within
    `maxiter` iterations, or at a breakdown (p^T A p <= 0: A not positive definite;
    r^T M^-1 r <= 0: M not positive definite; a NaN or infinity), and at once where b
    or x0 holds a NaN or infinity on any rank. `ValueError` or `TypeError` for a
    wrong block (b not 1-D, x0 shaped unlike b, matvec or precondition returning
    another shape) on its rank, and a `DistopError` naming that rank on the others.

    ```python
    import numpy as np

    from distop.linalg import cg

    A = np.array([[4.0, 1.0], [1.0, 3.0]])
    result = cg(None, lambda v: A @ v, np.array([1.0, 2.0]))  # one process: comm=None
    assert result.converged and np.allclose(A @ result.x, [1.0, 2.0])
    ```
    """
    solve = Solve(comm, name, matvec, precondition)
    b, x0 = solve.start(b, x0, rtol, atol, maxiter)
    early = solve.verdict_before(b, x0, raise_on_failure)
    if early is not None:
        return early
    x, r, r_norm = solve.initial(b, x0)
    x, iterations, r_norm, why = _iterate(solve, b, x, r, r_norm)
    return solve.end(x, iterations, r_norm, why, _FIX, raise_on_failure)


def _iterate(solve: Solve, b: np.ndarray, x: np.ndarray, r: np.ndarray, r_norm: float,
             ) -> tuple[np.ndarray, int, float, str | None]:
    """Iterate from x until the tolerance, the iteration limit or a breakdown.

    **Arguments:**
    - `solve`: the solve.
    - `b`: this rank's block of the right-hand side.
    - `x`, `r`, `r_norm`: the starting point, this rank's block of b - A x, its global
      2-norm.

    **Returns:** (x, the iterations made, the global 2-norm of b - A x computed
    directly, why the iterations stopped short of the tolerance or None).
    """
    direct = True  # r is b - A x computed directly, not by the recurrence
    restart = True  # p starts again from the preconditioned residual
    iterations, why = 0, None
    p, rz, rz_next, z = r, 0.0, 0.0, r
    while True:
        if not math.isfinite(r_norm):
            why = NAN_WHY.format(iterations)
            break
        if r_norm <= solve.tolerance:
            if direct:
                break
            # the recurrence drifts from b - A x: check it, and go on from it if it misses
            r, r_norm = solve.residual(b, x)
            direct = restart = True
            continue
        if iterations >= solve.maxiter:
            break
        if restart:
            z, failure = solve.prepare(r)
            rz_next = (solve.sum([solve.dot(r, z)], failure)[0]
                       if solve.precondition is not None else r_norm * r_norm)
        if not rz_next > 0.0:
            why = _breakdown(iterations, "r^T M^-1 r", rz_next, "preconditioner")
            break
        p = z.copy() if restart else z + (rz_next / rz) * p
        rz, restart = rz_next, False
        q, failure = solve.apply(p)
        (pq,) = solve.sum([solve.dot(p, q)], failure)
        if not pq > 0.0:
            why = _breakdown(iterations, "p^T A p", pq, "operator")
            break
        alpha = rz / pq
        x += alpha * p
        r -= alpha * q
        iterations, direct = iterations + 1, False
        if solve.precondition is None:
            (rr,) = solve.sum([solve.dot(r, r)])
            rz_next = rr
        else:
            z, failure = solve.prepare(r)
            rz_next, rr = solve.sum([solve.dot(r, z), solve.dot(r, r)], failure)
        r_norm = math.sqrt(rr) if rr >= 0 else math.nan
    if not direct:
        r, r_norm = solve.residual(b, x)
    return x, iterations, r_norm, why


def _breakdown(iterations: int, quantity: str, value: float, what: str) -> str:
    """Say why the iterations stop where a quantity that must be positive is not.

    **Arguments:**
    - `iterations`: the iterations made.
    - `quantity`: the quantity's formula.
    - `value`: its value, not > 0.
    - `what`: the operator it shows not to be positive definite.

    **Returns:** the reason, for `Solve.end`.
    """
    if not math.isfinite(value):
        return NAN_WHY.format(iterations)
    return (f"breakdown at iteration {iterations}: {quantity} = {value:.3e} <= 0, so the "
            f"{what} is not positive definite")
