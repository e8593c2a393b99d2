"""What every solver of `distop.linalg` shares: its result, and one solve's view of its
communicator, operator and tolerance (sums over the ranks, checked products, the
verdict)."""

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import ConvergenceError, DistopError
from .._mpi.runtime import mpi

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


class Solve:
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

    def verdict_before(self, b: np.ndarray, x0: np.ndarray | None,
                       raise_on_failure: bool) -> SolveResult | None:
        """The verdict before any iteration, where one is due, else None.

        **Arguments:**
        - `b`, `x0`: the arguments as `start` returned them.
        - `raise_on_failure`: the solver's option.

        **Returns:** an unconverged result, with no iteration made, where b or x0 holds
        a NaN or infinity on some rank and `raise_on_failure` is False; x = 0, converged,
        where b = 0; None otherwise.

        **Raises:** `ConvergenceError` on every rank alike where b or x0 holds a NaN or
        infinity and `raise_on_failure`.
        """
        if self.nonfinite is None:
            if self.b_norm == 0.0:
                return SolveResult(np.zeros_like(b), 0, 0.0, True)
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


NAN_WHY = ("breakdown at iteration {}: a NaN or infinity in the solver's scalars (from "
            "b, x0, matvec or precondition)")
