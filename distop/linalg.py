"""Matrix-free distributed Krylov solvers on numpy blocks: `cg` and `gmres`.

For operators whose output solves a system (a residual R(y, x) = 0, say): the forward
method solves with the Jacobian, the `vjp` with its transpose, both in parallel. Each
rank holds a block of the global vectors, a 1-D numpy array of any length (zero
included); `matvec(v)` applies the operator to this rank's block of `v` and does its
own halo exchange. Every inner product and norm is summed over the ranks by
`comm.Allreduce` (several of them in one call where the algorithm allows), so every
rank holds the same scalars and takes the same decisions: the same iterations, the same
calls of `matvec` (and so of its halo exchanges), the same verdict. A failure (the
iteration limit, a breakdown, a bad block on one rank) is therefore raised on every rank
alike, and no rank waits in a collective the others have left.

This rests on the MPI library's `Allreduce` giving every rank the same bits, as MPICH
and Open MPI do (the MPI standard recommends it), and on every rank passing the same
options (`rtol`, `atol`, `maxiter`, `restart`).
"""

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from ._errors import ConvergenceError as ConvergenceError
from ._errors import DistopError
from ._mpi.runtime import mpi

__all__ = ["ConvergenceError", "SolveResult", "cg", "gmres"]

Block = Callable[[np.ndarray], np.ndarray]  # this rank's block in, this rank's block out


@dataclasses.dataclass(frozen=True, eq=False)
class SolveResult:
    """What a solver reached, the same on every rank but for `x`.

    **Arguments:**
    - `x`: this rank's block of the solution.
    - `iterations`: the iterations made (products with the operator, but for the
      residuals checked directly).
    - `residual_norm`: the global 2-norm of b - A x, computed directly (not the
      solver's running estimate).
    - `converged`: whether `residual_norm <= max(rtol * ||b||, atol)`.
    """

    x: np.ndarray
    iterations: int
    residual_norm: float
    converged: bool


class _Solve:
    """One solve's view of its communicator, operator and tolerance: sums over the
    ranks, checked products, and the verdict, raised alike on every rank.

    **Arguments:**
    - `comm`: an mpi4py communicator, or None for one process.
    - `name`: the solver's name in messages.
    - `matvec`: the operator on this rank's block.
    - `precondition`: the preconditioner on this rank's block, or None.
    """

    def __init__(self, comm: Any, name: str, matvec: Block, precondition: Block | None,
                 ) -> None:
        self.comm, self.name = comm, name
        self.matvec, self.precondition = matvec, precondition
        self.rank = 0 if comm is None else comm.Get_rank()
        self.size = 1 if comm is None else comm.Get_size()
        self.where = f"{name} on rank {self.rank} of {self.size}"
        self.n, self.dtype = 0, np.dtype(np.float64)
        self.b_norm = self.tolerance = 0.0
        self.rtol = self.atol = 0.0
        self.nonfinite: str | None = None  # which of b and x0 hold a NaN or infinity
        self.maxiter = 0

    # -- sums over the ranks -----------------------------------------------------------
    def sum(self, values: Any, failure: Exception | None = None) -> np.ndarray:
        """Sum `values` over the ranks in one `Allreduce`, with whether any rank failed.

        **Arguments:**
        - `values`: this rank's scalars (a sequence or a 1-D array).
        - `failure`: this rank's error since the last sum, if any.

        **Returns:** the sums, as float64, the same on every rank.

        **Raises:** `failure` on the ranks that have one, and a `DistopError` naming
        them on the others, where any rank has one.
        """
        local = np.asarray(values, dtype=np.float64).ravel()
        send = np.empty(local.size + 1)
        send[:-1] = local
        send[-1] = failure is not None
        if self.comm is None:
            total = send
        else:
            total = np.empty_like(send)
            self.comm.Allreduce(send, total, op=mpi().SUM)
        if total[-1] != 0:
            self._fail(failure)
        return total[:-1]

    def _fail(self, failure: Exception | None) -> None:
        """Raise on every rank where some rank failed: its own error where it has one,
        else an error naming the ranks that failed."""
        failed = [self.rank] if failure is not None else []
        if self.comm is not None:
            mine = np.zeros(self.size)
            mine[self.rank] = failure is not None
            every = np.empty_like(mine)
            self.comm.Allreduce(mine, every, op=mpi().SUM)
            failed = [int(r) for r in np.flatnonzero(every)]
        if failure is not None:
            raise failure
        error = DistopError(
            f"{self.where}: stopped because of an error on rank(s) {failed} (see the "
            "error raised there). Every rank stops alike, so that none waits in a "
            "collective the others have left.")
        error.elsewhere = True  # (this rank's own blocks were fine)
        raise error

    def dot(self, u: np.ndarray, v: np.ndarray) -> float:
        """**Returns:** this rank's share of the inner product u . v."""
        return float(np.dot(u, v))

    # -- the user's functions ----------------------------------------------------------
    def apply(self, v: np.ndarray) -> tuple[np.ndarray, Exception | None]:
        """**Returns:** (A v, None), or (zeros, the error) where `matvec` gave a block of
        the wrong shape or kind; the caller passes the error to its next `sum`."""
        return self._call("matvec", self.matvec, v)

    def prepare(self, v: np.ndarray) -> tuple[np.ndarray, Exception | None]:
        """**Returns:** (M^-1 v, None) (v itself without a preconditioner), or (zeros,
        the error), as `apply`."""
        if self.precondition is None:
            return v, None
        return self._call("precondition", self.precondition, v)

    def _call(self, what: str, fn: Block, v: np.ndarray) -> tuple[np.ndarray, Exception | None]:
        seen = v.view()
        seen.flags.writeable = False  # (the solver's own vectors: a function must not change them)
        out = fn(seen)
        got = np.asarray(out)
        expected = f"expected a 1-D numpy array of shape ({self.n},), like this rank's block of b"
        if got.shape != (self.n,):
            return np.zeros(self.n, self.dtype), ValueError(
                f"{self.where}: {what} returned an array of shape {got.shape}; {expected}. "
                f"Return {what}(v) for this rank's block v only (after any halo exchange).")
        if got.dtype.kind not in "biuf":
            return np.zeros(self.n, self.dtype), TypeError(
                f"{self.where}: {what} returned an array of dtype {got.dtype}; {expected}, "
                f"real (dtype {self.dtype}). Complex systems are not supported.")
        # a copy: the solver updates its vectors in place, and `fn` may return its input
        return np.array(got, dtype=self.dtype), None

    # -- start and end -----------------------------------------------------------------
    def start(self, b: Any, x0: Any, rtol: float, atol: float, maxiter: int | None,
              ) -> tuple[np.ndarray, np.ndarray | None]:
        """Check the arguments, agree on ||b|| and the global size.

        **Arguments:** those of the solver.

        **Returns:** (b, x0) as arrays of the working dtype (x0 None where not given).

        **Raises:** `ValueError` or `TypeError` on the ranks whose block is wrong, and a
        `DistopError` on the others.
        """
        for option, value in (("rtol", rtol), ("atol", atol)):
            if not (isinstance(value, numbers.Real) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{self.name}({option}={value!r}): expected a finite "
                                 "number >= 0, the same on every rank.")
        if maxiter is not None and not (isinstance(maxiter, numbers.Integral)
                                        and maxiter >= 0):
            raise ValueError(f"{self.name}(maxiter={maxiter!r}): expected an int >= 0 or "
                             "None, the same on every rank.")
        self.rtol, self.atol = float(rtol), float(atol)
        failure: Exception | None = None
        block, start = np.zeros(0), None
        try:
            block = np.asarray(b)
            if block.dtype.kind not in "biuf":
                raise TypeError(f"{self.where}: b has dtype {block.dtype}; expected a real "
                                "numeric 1-D numpy array (complex systems are not "
                                "supported).")
            if block.ndim != 1:
                raise ValueError(f"{self.where}: b has shape {block.shape}; expected this "
                                 "rank's block of the right-hand side, a 1-D array (of any "
                                 "length, zero included). Pass b.ravel() and solve on "
                                 "flattened blocks.")
            self.dtype = block.dtype if block.dtype.kind == "f" else np.dtype(np.float64)
            self.n = block.shape[0]
            if x0 is not None:
                start = np.asarray(x0)
                if start.dtype.kind not in "biuf":
                    raise TypeError(f"{self.where}: x0 has dtype {start.dtype}; expected a "
                                    "real numeric array like b.")
                if start.shape != block.shape:
                    raise ValueError(f"{self.where}: x0 has shape {start.shape} but b has "
                                     f"shape {block.shape}; x0 is this rank's block of the "
                                     "starting guess, shaped like b's block.")
                start = np.array(start, dtype=self.dtype)
            block = np.array(block, dtype=self.dtype)
        except (TypeError, ValueError) as err:
            failure, block, start = err, np.zeros(0), None
        # the count of non-finite entries, summed with the rest: every rank learns alike
        bad_x0 = 0 if start is None else int(np.count_nonzero(~np.isfinite(start)))
        bb, n, bad_b, bad_x0 = self.sum(
            [self.dot(block, block), block.shape[0],
             np.count_nonzero(~np.isfinite(block)), bad_x0], failure)
        inputs = [name for name, bad in (("b", bad_b), ("x0", bad_x0)) if bad]
        if inputs:
            self.nonfinite = " and ".join(inputs)
        self.b_norm = math.sqrt(bb) if bb >= 0 else math.nan
        self.tolerance = max(self.rtol * self.b_norm, self.atol)
        self.maxiter = 10 * int(n) if maxiter is None else int(maxiter)
        return block, start

    def residual(self, b: np.ndarray, x: np.ndarray, failure: Exception | None = None,
                 ) -> tuple[np.ndarray, float]:
        """**Returns:** (this rank's block of b - A x, its global 2-norm); raises
        `failure` (this rank's error since the last sum) collectively, as `sum`."""
        ax, failure_ax = self.apply(x)
        r = b - ax
        (rr,) = self.sum([self.dot(r, r)], failure or failure_ax)
        return r, math.sqrt(rr) if rr >= 0 else math.nan

    def refuse_nonfinite(self, b: np.ndarray, x0: np.ndarray | None,
                         raise_on_failure: bool) -> SolveResult | None:
        """The verdict where b or x0 holds a NaN or infinity on some rank, else None.

        **Returns:** an unconverged result, with no iteration made, where
        `raise_on_failure` is False.

        **Raises:** `ConvergenceError` on every rank alike otherwise.
        """
        if self.nonfinite is None:
            return None
        x = np.zeros_like(b) if x0 is None else x0
        norm = self.b_norm if not math.isfinite(self.b_norm) else math.inf
        why = (f"{self.nonfinite} hold(s) a NaN or infinity (on some rank), so no "
               "iterate can meet a tolerance")
        return self.end(x, 0, norm, why, f"pass finite {self.nonfinite}", raise_on_failure)

    def initial(self, b: np.ndarray, x0: np.ndarray | None,
                ) -> tuple[np.ndarray, np.ndarray, float]:
        """**Returns:** the starting point of an iteration: (x, this rank's block of
        b - A x, its global 2-norm), from x0, or from zero (no product) where `x0` is None."""
        if x0 is None:
            return np.zeros_like(b), b.copy(), self.b_norm
        r, r_norm = self.residual(b, x0)
        return x0, r, r_norm

    def end(self, x: np.ndarray, iterations: int, residual_norm: float,
            why: str | None, fix: str, raise_on_failure: bool) -> SolveResult:
        """The verdict on the ranks alike: a result, or a `ConvergenceError`.

        **Arguments:**
        - `x`, `iterations`, `residual_norm`: where the solver stopped (the residual
          computed directly).
        - `why`: why it stopped short of the tolerance (None where it has not yet: it is
          then the iteration limit, unless the residual meets the tolerance).
        - `fix`: the solver's advice (after raising maxiter and the like, where the
          iteration limit stopped it).
        - `raise_on_failure`: whether to raise on failure or return the result.

        **Returns:** the `SolveResult`.

        **Raises:** `ConvergenceError` where the residual misses the tolerance and
        `raise_on_failure`.
        """
        # (a non-finite tolerance, from ||b|| = inf, would pass inf <= inf)
        converged = (self.nonfinite is None and math.isfinite(residual_norm)
                     and math.isfinite(self.tolerance) and residual_norm <= self.tolerance)
        result = SolveResult(x, iterations, float(residual_norm), bool(converged))
        if converged or not raise_on_failure:
            return result
        if why is None:
            why = f"did not converge within maxiter={self.maxiter} iterations"
            fix = f"raise maxiter, loosen rtol or atol, or pass a preconditioner; {fix}"
        error = ConvergenceError(
            f"{self.where}: {why}; the residual norm ||b - A x|| = {residual_norm:.3e} "
            f"after {iterations} iterations misses the tolerance {self.tolerance:.3e} = "
            f"max(rtol={self.rtol:g} * ||b|| = {self.rtol * self.b_norm:.3e}, "
            f"atol={self.atol:g}). To fix: {fix} (raised on every rank alike; "
            "raise_on_failure=False returns the unconverged result instead).")
        error.result = result
        raise error


_NAN_WHY = ("breakdown at iteration {}: a NaN or infinity in the solver's scalars (from "
            "b, x0, matvec or precondition)")


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
    solve = _Solve(comm, name, matvec, precondition)
    b, x0 = solve.start(b, x0, rtol, atol, maxiter)
    fix = ("check that the operator (and the preconditioner) is symmetric positive "
           "definite, and for an adjoint solve that matvec applies the transpose; use "
           "gmres for a non-symmetric or indefinite operator")
    refused = solve.refuse_nonfinite(b, x0, raise_on_failure)
    if refused is not None:
        return refused
    if solve.b_norm == 0.0:
        return SolveResult(np.zeros_like(b), 0, 0.0, True)
    x, r, r_norm = solve.initial(b, x0)
    direct = True  # r is b - A x computed directly, not by the recurrence
    restart = True  # p starts again from the preconditioned residual
    iterations, why = 0, None
    p, rz, rz_next, z = r, 0.0, 0.0, r
    while True:
        if not math.isfinite(r_norm):
            why = _NAN_WHY.format(iterations)
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
            rz_next = (solve.sum([solve.dot(r, z)], failure)[0] if precondition is not None
                       else r_norm * r_norm)
        if not rz_next > 0.0:
            why = (f"breakdown at iteration {iterations}: r^T M^-1 r = {rz_next:.3e} <= 0, "
                   "so the preconditioner is not positive definite" if math.isfinite(rz_next)
                   else _NAN_WHY.format(iterations))
            break
        p = z.copy() if restart else z + (rz_next / rz) * p
        rz, restart = rz_next, False
        q, failure = solve.apply(p)
        (pq,) = solve.sum([solve.dot(p, q)], failure)
        if not pq > 0.0:
            why = (f"breakdown at iteration {iterations}: p^T A p = {pq:.3e} <= 0, so the "
                   "operator is not positive definite" if math.isfinite(pq)
                   else _NAN_WHY.format(iterations))
            break
        alpha = rz / pq
        x += alpha * p
        r -= alpha * q
        iterations, direct = iterations + 1, False
        if precondition is None:
            (rr,) = solve.sum([solve.dot(r, r)])
            rz_next = rr
        else:
            z, failure = solve.prepare(r)
            rz_next, rr = solve.sum([solve.dot(r, z), solve.dot(r, r)], failure)
        r_norm = math.sqrt(rr) if rr >= 0 else math.nan
    if not direct:
        r, r_norm = solve.residual(b, x)
    return solve.end(x, iterations, r_norm, why, fix, raise_on_failure)


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
    solve = _Solve(comm, name, matvec, precondition)
    b, x0 = solve.start(b, x0, rtol, atol, maxiter)
    fix = ("check the operator (for an adjoint solve, that matvec applies the transpose), "
           "or raise restart")
    refused = solve.refuse_nonfinite(b, x0, raise_on_failure)
    if refused is not None:
        return refused
    if solve.b_norm == 0.0:
        return SolveResult(np.zeros_like(b), 0, 0.0, True)
    x, r, r_norm = solve.initial(b, x0)
    eps = float(np.finfo(solve.dtype).eps)
    basis = np.empty((int(restart) + 1, solve.n), solve.dtype)
    iterations, why = 0, None
    while True:
        if not math.isfinite(r_norm):
            why = _NAN_WHY.format(iterations)
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
                why = _NAN_WHY.format(iterations)
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


def _cycle(solve: _Solve, basis: np.ndarray, r: np.ndarray, r_norm: float,
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
        z, failure = solve.prepare(basis[j])
        w, failure_w = solve.apply(z)
        # Gram-Schmidt twice against the basis; one sum per pass, with ||w||^2
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
        if not (math.isfinite(h_next) and math.isfinite(ww) and all(map(math.isfinite, column))):
            return _Step(0), _NAN_WHY.format(iterations + count)
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
        step.choices.append((np.array(y, dtype=basis.dtype), estimate))
    return step, None
