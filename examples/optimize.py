"""mpiexec -n 4 python examples/optimize.py --n 16

An inverse problem driven by an optimizer on every rank in lockstep: recover the source
f of the Poisson problem in examples/poisson.py from noisy observations of u, with
Tikhonov regularisation,

    J(f) = (||u(f) - u_obs||^2 + alpha ||f||^2) / alpha,

minimised by `scipy.optimize.minimize(method="L-BFGS-B", jac=True)` with distop's
`run_and_compute_totals` giving J and dJ/df.

How every rank takes the same step: the iterate is replicated (every rank holds all of
f, as scipy does), and each rank passes its block of rows to the Problem. J is a
replicated output and dJ/df a row of the full Jacobian, the same on every rank: distop
gathers a distributed input's totals into one row that every rank receives. So every
rank's L-BFGS sees the same numbers and takes the same decisions. The example checks it
at every evaluation: the ranks compare a digest of (J, dJ/df), bit for bit, and stop
with an error naming the ranks if they ever differ.

The optimizer stops on the gradient (`gtol`), where each step still lowers J by far
more than J's rounding: near the minimum a step lowers J by about the square of the
gradient, which J's rounding hides long before the gradient reaches zero, and a line
search that cannot see its progress would stop at a point and an iteration count that
depend on rounding (and so on the number of ranks).

The answer is compared with the exact minimiser (J is quadratic in f: a dense solve of
its normal equations in one process). Prints the iteration count and `max relative
error x.xe-xx` on rank 0; exits with status 1 above 1e-8.
Options: `--n` (grid size, default 16), `--alpha` (default 1e-3), `--noise` (default
0.01), `--split` (rows per rank, as in examples/poisson.py).
"""

import argparse
import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from mpi4py import MPI
from poisson import Poisson, neighbours, split_rows

import distop

jax.config.update("jax_enable_x64", True)
BOUND = 1e-8


def forward_matrix(n, k):
    """**Returns:** the dense map f -> u of the n x n grid, (k A)^-1 (one process)."""
    h2 = 1.0 / (n + 1) ** 2
    T = np.diag(2 * np.ones(n)) - np.diag(np.ones(n - 1), 1) - np.diag(np.ones(n - 1), -1)
    A = (np.kron(T, np.eye(n)) + np.kron(np.eye(n), T)) / h2
    return np.linalg.inv(k * A)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--split", default="")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    n, k, alpha = args.n, 1.0, args.alpha
    rows = split_rows(n, comm.Get_size(), args.split)
    start, mine = sum(rows[:comm.Get_rank()]) * n, rows[comm.Get_rank()] * n

    # The truth and its noisy observation: the same on every rank (one seed).
    rng = np.random.default_rng(0)
    x = np.linspace(0, 1, n + 2)[1:-1]
    X, Y = np.meshgrid(x, x, indexing="ij")
    f_true = (10 * np.exp(-20 * ((X - 0.3) ** 2 + (Y - 0.6) ** 2))).ravel()
    K = forward_matrix(n, k)
    u_obs = K @ f_true
    u_obs += args.noise * np.abs(u_obs).max() * rng.standard_normal(n * n)

    poisson = Poisson(n, *neighbours(rows, comm.Get_rank()))
    observed = u_obs[start:start + mine].reshape(-1, n)

    def model(f):
        u = poisson(f, k)
        misfit = jnp.sum((u - observed) ** 2) + alpha * jnp.sum(f ** 2)
        return {"J": distop.AllreduceSum()(misfit) / alpha}

    problem = distop.Problem(model, {"f": np.zeros((rows[comm.Get_rank()], n))},
                             distributed=["f"])

    def objective(f):
        values, totals = problem.run_and_compute_totals(
            inputs={"f": f[start:start + mine].reshape(-1, n)}, of="J", wrt="f")
        J, grad = float(values["J"]), np.asarray(totals["J", "f"][0])
        digest = hashlib.sha256(np.float64(J).tobytes() + grad.tobytes()).hexdigest()
        every = comm.allgather(digest)
        if len(set(every)) > 1:
            differ = [r for r, d in enumerate(every) if d != every[0]]
            raise SystemExit(f"rank {comm.Get_rank()}: J or dJ/df differ between rank 0 "
                             f"and ranks {differ}: the ranks would take different steps")
        return J, grad

    found = scipy.optimize.minimize(objective, np.zeros(n * n), jac=True, method="L-BFGS-B",
                                    options={"gtol": 1e-7, "ftol": 0.0, "maxiter": 2000,
                                             "maxcor": 30})
    best = np.linalg.solve(K.T @ K + alpha * np.eye(n * n), K.T @ u_obs)
    err = float(np.max(np.abs(found.x - best)) / np.max(np.abs(best)))
    if comm.Get_rank() == 0:
        print(f"L-BFGS-B on {comm.Get_size()} ranks, {n} x {n} grid: {found.nit} iterations, "
              f"{found.nfev} evaluations ({found.message})")
        print(f"  J = {found.fun:.12e}; the regularised f against the truth: relative error "
              f"{np.max(np.abs(found.x - f_true)) / np.max(np.abs(f_true)):.1e}")
        print(f"max relative error {err:.1e}")
    return 0 if err <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
