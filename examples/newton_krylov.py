"""mpiexec -n 4 python examples/newton_krylov.py

Newton-Krylov minimisation with Hessian-vector products through a distributed
operator: regularised logistic regression whose samples are split over the ranks,

    L(w) = (1 / N) sum_i log(1 + exp(-s_i x_i . w)) + (lam / 2) ||w||^2,

with the labels s_i = +-1. The data term is one nonlinear operator, `LogisticLoss`:
each rank holds its own rows of the data (its operator's fields) and sums its share,
and one `Allreduce` per method makes the total; its `hvp` is X^T D X t (D the
curvature of each sample's loss), so `Problem.compute_hvp` gives H t with one
collective per call.

The weights w are replicated: every rank runs the same optimizer in lockstep on the
same numbers (the loss, its gradient and every H t are the same on every rank). It
minimises L three ways:
- Newton-Krylov: Newton steps H p = -g solved by conjugate gradients
  (`scipy.sparse.linalg.cg`) on H t from `compute_hvp`, until the gradient is at its
  rounding: quadratic convergence, to a minimiser within 1e-8 of the one found in one
  process (Newton's method on the whole data with the dense Hessian);
- `scipy.optimize.minimize(method="trust-krylov")` with `hessp` from `compute_hvp`
  and the loss and gradient from `run_and_compute_totals`;
- `L-BFGS-B` with the gradient alone.
scipy's two stop on the loss's rounding (a step lowers the loss by about the square
of the gradient), so they are held to 1e-6. Prints, per method, the iterations and
evaluations, the final gradient norm and the largest difference from the one-process
minimiser, then `max relative error x.xe-xx` (Newton-Krylov's); exits with status 1
above 1e-8 (or 1e-6 for scipy's). Before that, `check_hvp` compares `compute_hvp`
with differences of the gradient.
Options: `--samples` (default 400), `--features` (default 20), `--lam` (default 0.1),
`--split` (samples per rank, comma-separated; default an even split).
"""

import argparse
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
import scipy.sparse.linalg
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)
BOUND = 1e-8  # Newton-Krylov's difference from the one-process minimiser
LOOSE = 1e-6  # scipy's, which stop on the loss's rounding


def sigmoid(z):
    """**Returns:** 1 / (1 + exp(-z)), without overflow."""
    return np.exp(-np.logaddexp(0.0, -z))


class LogisticLoss(distop.DistributedOperator):
    """The sum over every rank's samples of log(1 + exp(-s_i x_i . w)): replicated w in,
    a replicated scalar out; each rank holds its own rows `X` and labels `s`."""

    X: np.ndarray
    s: np.ndarray
    forward_collectives = vjp_collectives = jvp_collectives = hvp_collectives = (
        "Allreduce",)
    output_kinds = "replicated"
    batched_hvp = True

    def output_spec(self, w):
        return jax.ShapeDtypeStruct((), w.dtype)

    def _total(self, comm, local):
        total = np.empty_like(local)
        comm.Allreduce(np.ascontiguousarray(local), total, op=MPI.SUM)
        return total

    def _margins(self, w):
        return self.s * (self.X @ w)

    def forward(self, comm, w):
        return self._total(comm, np.array(np.logaddexp(0.0, -self._margins(w)).sum()))

    def vjp(self, comm, loss_bar, w):
        slope = -self.s * sigmoid(-self._margins(w))  # d loss_i / d (x_i . w)
        return loss_bar * self._total(comm, self.X.T @ slope)

    def jvp(self, comm, w_dot, w):
        slope = -self.s * sigmoid(-self._margins(w))
        return self._total(comm, np.array(slope @ (self.X @ w_dot)))

    def hvp(self, comm, loss_bar, w_dot, w, *, batched=False):
        # (batched: loss_bar (K,), w_dot (K, d) and w (K, d), the same w in every row)
        margins = self._margins(w[0] if batched else w)
        curvature = sigmoid(margins) * sigmoid(-margins)  # s_i ** 2 = 1
        local = (self.X @ w_dot.T).T * curvature @ self.X  # rows of X^T D X w_dot
        return np.asarray(loss_bar)[..., None] * self._total(comm, local)


def split(samples, size, text):
    """**Returns:** the samples of each rank: `text` (comma-separated) or an even split."""
    if text:
        counts = [int(c) for c in text.split(",")]
        if len(counts) != size or sum(counts) != samples:
            raise SystemExit(f"--split {text}: expected {size} counts summing to {samples}")
        return counts
    return [samples // size + (r < samples % size) for r in range(size)]


def reference(X, s, lam):
    """**Returns:** the minimiser of L in one process: Newton's method with the dense
    Hessian on the whole data, to convergence."""
    w = np.zeros(X.shape[1])
    for _ in range(100):
        m = s * (X @ w)
        g = X.T @ (-s * sigmoid(-m)) / len(s) + lam * w
        H = (X.T * (sigmoid(m) * sigmoid(-m))) @ X / len(s) + lam * np.eye(len(w))
        step = np.linalg.solve(H, g)
        w = w - step
        if np.max(np.abs(step)) <= 1e-15 * max(1.0, np.max(np.abs(w))):
            break
    return w


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--lam", type=float, default=1e-1)
    parser.add_argument("--split", default="")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n, d, lam = args.samples, args.features, args.lam
    counts = split(n, size, args.split)
    start = sum(counts[:rank])

    # The data: the same on every rank (one seed); each rank keeps its own rows.
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, d)) / np.sqrt(d)
    w_true = rng.standard_normal(d)
    s = np.where(rng.uniform(size=n) < sigmoid(X @ w_true), 1.0, -1.0)
    mine = slice(start, start + counts[rank])
    loss = LogisticLoss(np.ascontiguousarray(X[mine]), np.ascontiguousarray(s[mine]))

    def model(w):
        return {"L": loss(w) / n + 0.5 * lam * jnp.sum(w ** 2)}

    w0 = np.zeros(d)
    problem = distop.Problem(model, {"w": w0})
    checked = problem.check_hvp("L", out_stream=io.StringIO(), raise_on_error=True)
    hessps, current = [0], [None]

    def fun(w):
        values, totals = problem.run_and_compute_totals(of="L", wrt="w", inputs={"w": w})
        current[0] = np.array(w)
        return float(values["L"]), np.array(totals["L", "w"][0])

    def hessp(w, t):
        hessps[0] += 1
        if current[0] is None or not np.array_equal(w, current[0]):
            problem.run(w=w)  # (compute_hvp works at the current point)
            current[0] = np.array(w)
        return np.array(problem.compute_hvp("L", "w", {"w": t})["w"])

    def newton_krylov(w):
        """Newton steps, each solved by CG on H t, until the gradient stops shrinking."""
        iterations, evaluations, norms = 0, 0, []
        while iterations < 50:
            g = fun(w)[1]
            evaluations += 1
            norms.append(np.linalg.norm(g))
            if len(norms) > 2 and norms[-1] >= 0.5 * norms[-2]:  # (at its rounding)
                break
            H = scipy.sparse.linalg.LinearOperator((d, d), lambda t, w=w: hessp(w, t),
                                                   dtype=np.float64)
            step, info = scipy.sparse.linalg.cg(H, -g, rtol=1e-3 * min(1.0, norms[-1]),
                                                atol=0.0, maxiter=10 * d)
            if info != 0:
                raise SystemExit(f"rank {rank}: CG did not converge (info {info})")
            w, iterations = w + step, iterations + 1
        return scipy.optimize.OptimizeResult(x=w, nit=iterations, nfev=evaluations)

    best = reference(X, s, lam)
    errors = {}
    lines = [f"logistic regression: {n} samples of {d} features on {size} rank(s) "
             f"({counts}); check_hvp: {'ok' if all(r.ok for r in checked.values()) else 'FAILED'}"]
    for method, options in (("Newton-Krylov", None),
                            ("trust-krylov", {"gtol": 1e-9}),
                            ("L-BFGS-B", {"gtol": 1e-10, "ftol": 0.0, "maxiter": 1000})):
        hessps[0] = 0
        if options is None:
            found = newton_krylov(w0)
        else:
            found = scipy.optimize.minimize(fun, w0, jac=True, method=method, options=options,
                                            hessp=hessp if method != "L-BFGS-B" else None)
        gradient = fun(found.x)[1]
        errors[method] = float(np.max(np.abs(found.x - best)) / np.max(np.abs(best)))
        lines.append(f"{method:<13} {found.nit:>4} iterations, {found.nfev:>4} evaluations, "
                     f"{hessps[0]:>4} Hessian-vector products; |grad| = "
                     f"{np.linalg.norm(gradient):.1e}; against one process "
                     f"{errors[method]:.1e}")
        # every rank took the same steps: the same answer, bit for bit
        if len(set(comm.allgather(found.x.tobytes()))) > 1:
            raise SystemExit(f"rank {rank}: {method}: the ranks found different answers")
    if rank == 0:
        print("\n".join(lines))
        print(f"max relative error {errors['Newton-Krylov']:.1e}")
    return 0 if (errors["Newton-Krylov"] <= BOUND
                 and max(errors.values()) <= LOOSE) else 1


if __name__ == "__main__":
    sys.exit(main())
