"""Restarted GMRES, for a general (non-symmetric) operator: the cycles of Arnoldi with
Givens rotations, and the update each offers."""

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from ._solve import NAN_WHY, Block, Solve, SolveResult


def gmres(comm: Any, matvec: Block, b: np.ndarray, x0: np.ndarray | None = None, *,
          rtol: float = 1e-10, atol: float = 0.0, restart: int = 20,
          maxiter: int | None = None, precondition: Block | None = None,
          name: str = "gmres", raise_on_failure: bool = True) -> SolveResult:
    """Solve A x = b for a general (non-symmetric) A by restarted GMRES.

    Collective, as `cg`. The Arnoldi basis is orthogonalized by classical Gram-Schmidt
    applied twice, so each iteration makes two `Allreduce` calls (rarely three), each
    of at most `restart + 1` scalars; the basis takes `restart + 1` vectors of this
    rank's block. The preconditioner is applied on the right, so the norm the
    iterations minimize, and the stopping rule ||b - A x|| <= max(rtol * ||b||, atol),
    is that of the true residual; it is checked on b - A x itself after each cycle. A
    cycle's update is taken only where it makes that residual smaller, so the result is
    never worse than the best iterate, `x0` included. Where it does not, a cautious
    update from fewer of the cycle's basis vectors may be tried, at one more call of
    `precondition` and of `matvec`.

    **Arguments:**
    - `comm`: the mpi4py communicator, or None for one process (as in `cg`).
    - `matvec`: `matvec(v)` returns this rank's block of A v (as in `cg`).
    - `b`: this rank's block of the right-hand side, a 1-D array of any length.
    - `x0`: this rank's block of the starting guess (default zeros).
    - `rtol`, `atol`: the relative and absolute tolerances.
    - `restart`: the iterations per cycle, after which the basis starts again.
    - `maxiter`: the most iterations over all cycles (default 10 times the global
      size).
    - `precondition`: `precondition(v)` returns this rank's block of M^-1 v, for any
      fixed nonsingular M (default none).
    - `name`: the solver's name in messages, e.g. "Flow.solve_adjoint".
    - `raise_on_failure`: if False, return an unconverged result instead of raising.

    **Returns:** a `SolveResult`; x = 0 at once where b = 0.

    **Raises:** `ConvergenceError` on every rank where the tolerance is not met within
    `maxiter` iterations, where a whole cycle leaves the residual no smaller, or at a
    NaN or infinity (at once where b or x0 holds one on any rank). `ValueError` or
    `TypeError` for a wrong block, as in `cg`.
    """
    if not (isinstance(restart, numbers.Integral) and restart >= 1):
        raise ValueError(f"{name}(restart={restart!r}): expected an int >= 1, the same on "
                         "every rank.")
    solve = Solve(comm, name, matvec, precondition)
    b, x0 = solve.start(b, x0, rtol, atol, maxiter)
    fix = ("check the operator (for an adjoint solve, that matvec applies the transpose), "
           "or raise restart")
    early = solve.verdict_before(b, x0, raise_on_failure)
    if early is not None:
        return early
    x, r, r_norm = solve.initial(b, x0)
    eps = float(np.finfo(solve.dtype).eps)
    basis = np.empty((int(restart) + 1, solve.n), solve.dtype)
    iterations, why = 0, None
    while True:
        if not math.isfinite(r_norm):
            why = NAN_WHY.format(iterations)
            break
        if r_norm <= solve.tolerance or iterations >= solve.maxiter:
            break
        step, why = _cycle(solve, basis, r, r_norm, iterations, eps)
        iterations += step.count
        if why is not None:
            break
        # The first update that makes the true residual smaller is taken.
        # One whose estimate is no lower is not tried.
        # Where none is taken, x stays: it is the best iterate.
        why = step.unmet or (
            f"stagnation at iteration {iterations}: a whole cycle of at most {restart} "
            f"iterations left the residual no smaller ({r_norm:.3e} before it), so the "
            "next would too; the operator may be singular or too indefinite for this "
            "restart")
        for coefficients, estimate in step.choices:
            if not estimate < r_norm:
                continue
            update, failure = solve.prepare(coefficients @ basis[:coefficients.shape[0]])
            candidate = x + update
            r_next, r_next_norm = solve.residual(b, candidate, failure)
            if not math.isfinite(r_next_norm):
                why = NAN_WHY.format(iterations)
            elif r_next_norm <= solve.tolerance or r_next_norm < r_norm:
                x, r, r_norm, why = candidate, r_next, r_next_norm, None
                break
        if why is not None:
            break
    return solve.end(x, iterations, r_norm, why, fix, raise_on_failure)


@dataclasses.dataclass
class _Step:
    """One GMRES cycle: its iterations and the updates it offers, best first.

    Each choice is the coefficients of the first basis vectors, with the residual norm
    they reach by the cycle's own estimate.
    There are fewer coefficients than `count` where the triangle is singular to working
    precision.
    `unmet` says why the solve stops where no choice lowers the true residual (None:
    stagnation).
    """

    count: int
    choices: list[tuple[np.ndarray, float]] = dataclasses.field(default_factory=list)
    unmet: str | None = None


def _cycle(solve: Solve, basis: np.ndarray, r: np.ndarray, r_norm: float,
           iterations: int, eps: float) -> tuple[_Step, str | None]:
    """One cycle of GMRES from the residual `r`: Arnoldi with Givens rotations.

    Every scalar that decides anything comes from `solve.sum` (the same on every rank)
    and Python float arithmetic on it, so every rank leaves the cycle alike.

    **Arguments:**
    - `solve`: the solve.
    - `basis`: room for the basis, (restart + 1, n).
    - `r`, `r_norm`: the residual where the cycle starts and its norm (> 0).
    - `iterations`: the iterations made before the cycle.
    - `eps`: the working dtype's machine epsilon.

    **Returns:** (the step with its choices, None), or (a step with none, why it broke
    down).
    """
    restart = basis.shape[0] - 1
    basis[0] = r / r_norm
    g = [r_norm]  # the right-hand side of the small least-squares problem, rotated
    columns: list[list[float]] = []  # the rotated Hessenberg matrix, by columns
    rotations: list[tuple[float, float]] = []
    norms: list[float] = []  # the Hessenberg matrix's column norms, before the rotations
    count, scale = 0, 0.0  # scale: the largest of them
    for j in range(min(restart, solve.maxiter - iterations)):
        w, column, h_next, ww = _arnoldi(solve, basis, j)
        if not (math.isfinite(h_next) and math.isfinite(ww) and all(map(math.isfinite, column))):
            return _Step(0), NAN_WHY.format(iterations + count)
        norms.append(math.sqrt(sum(v * v for v in column) + h_next * h_next))
        scale = max(scale, norms[-1])
        for i, (c, s) in enumerate(rotations):
            column[i], column[i + 1] = c * column[i] + s * column[i + 1], \
                -s * column[i] + c * column[i + 1]
        d = math.hypot(column[j], h_next)
        c, s = (column[j] / d, h_next / d) if d > 0.0 else (1.0, 0.0)
        column[j] = d
        rotations.append((c, s))
        g.append(-s * g[j])
        g[j] *= c
        columns.append(column)
        count += 1
        # the Krylov space holds A's image of itself, to rounding: the cycle is exact
        invariant = h_next <= 4.0 * eps * math.sqrt(max(ww, 0.0))
        # a pivot tiny beside the largest column: the fallback choice stops before it
        singular = d <= 4.0 * eps * scale
        if invariant or singular or abs(g[j + 1]) <= solve.tolerance or j + 1 == restart:
            break
        basis[j + 1] = w / h_next
    return _choices(columns, g, norms, scale, eps, iterations, basis.dtype)


def _arnoldi(solve: Solve, basis: np.ndarray, j: int,
             ) -> tuple[np.ndarray, list[float], float, float]:
    """The next column of the Hessenberg matrix: A M^-1 of `basis[j]`, orthogonalized
    against the basis by Gram-Schmidt twice, one sum per pass.

    **Arguments:**
    - `solve`: the solve.
    - `basis`: the basis, its first `j + 1` vectors made.
    - `j`: the basis vector to extend from.

    **Returns:** (this rank's block of the orthogonalized vector; its coefficients on the
    basis, the column; its global norm, the column's entry below; its global squared
    norm before the orthogonalization).
    """
    z, failure = solve.prepare(basis[j])
    w, failure_w = solve.apply(z)
    first = solve.sum(np.append(basis[:j + 1] @ w, solve.dot(w, w)), failure or failure_w)
    h, ww = first[:-1], first[-1]
    w -= h @ basis[:j + 1]
    second = solve.sum(np.append(basis[:j + 1] @ w, solve.dot(w, w)))
    h2, ww2 = second[:-1], second[-1]
    w -= h2 @ basis[:j + 1]
    # ||w||^2 after the second pass, without a third sum unless it cancels badly
    left = ww2 - float(h2 @ h2)
    if not left > 0.5 * ww2:
        left = float(solve.sum([solve.dot(w, w)])[0])
    column = [float(v) for v in h + h2]
    h_next = math.sqrt(left) if left > 0.0 else 0.0 if left == 0.0 else math.nan
    return w, column, h_next, float(ww)


def _choices(columns: list[list[float]], g: list[float], norms: list[float], scale: float,
             eps: float, iterations: int, dtype: np.dtype) -> tuple[_Step, str | None]:
    """The updates a cycle offers, from its rotated Hessenberg matrix, best first.

    **Arguments:**
    - `columns`: the rotated Hessenberg matrix, by columns (one per iteration).
    - `g`: the rotated right-hand side of the small least-squares problem.
    - `norms`, `scale`: the columns' norms before the rotations, and the largest.
    - `eps`: the working dtype's machine epsilon.
    - `iterations`: the iterations made before the cycle.
    - `dtype`: the working dtype.

    **Returns:** as `_cycle`.
    """
    count = len(columns)
    # A pivot tiny beside its own column (that column nearly in the span of those before
    # it) would give huge coefficients that cancel only in exact arithmetic. The choice
    # keeps the columns before the first one. Their triangle and rotated right-hand side
    # are final, and the least-squares residual over them is the norm of the rest of g.
    # The rotations keep each column's rounding small beside that column's own norm.
    # So a column small beside the others is still exact enough where A M is only badly
    # scaled (a preconditioner that scales some entries by far less than eps).
    # A small column may also be rounding noise of matvec or the preconditioner, which
    # no column can show (a nearly singular preconditioner). The fallback choice keeps
    # only the columns before the first pivot tiny beside the largest column norm.
    breakdown = (f"breakdown at iteration {iterations + count}: the preconditioned "
                 "operator maps the residual to (nearly) zero, so it is singular to "
                 "working precision (check the preconditioner too)")
    used = next((i for i in range(count) if abs(columns[i][i]) <= 4.0 * eps * norms[i]),
                count)
    if used == 0:
        return _Step(count), breakdown
    cautious = next((i for i in range(used) if abs(columns[i][i]) <= 4.0 * eps * scale),
                    used)
    step = _Step(count, unmet=breakdown if cautious == 0 else None)
    for k in sorted({used, cautious} - {0}, reverse=True):
        y = [0.0] * k
        for i in reversed(range(k)):
            rest = sum(columns[m][i] * y[m] for m in range(i + 1, k))
            y[i] = (g[i] - rest) / columns[i][i]
        estimate = math.sqrt(sum(v * v for v in g[k:]))
        step.choices.append((np.array(y, dtype=dtype), estimate))
    return step, None
