"""mpiexec -n 4 python examples/distributed_least_squares.py

Least squares with its rows split unevenly over the ranks (the last rank owns none when
there are several): loss(x) = 1/2 sum_r |A_r x - b_r|^2 and its gradient come from
distop, are verified with check_totals, and drive an L-BFGS solve that every rank runs
identically. The solution is compared with a dense single-process solve of the gathered
system. Prints `max relative error <x.xe-xx>` on rank 0; exits non-zero above 1e-8.

Options: --rows M (default 203), --unknowns n (default 12).
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)


class Residual(distop.DistributedOperator):
    """r_r = A_r x - b_r: replicated x, distributed b and r (this rank's rows)."""

    A: np.ndarray
    vjp_collectives = ("Allreduce",)
    batched_vjp = True

    def output_spec(self, x, b):
        return b

    def forward(self, comm, x, b):
        return self.A @ x - b

    def vjp(self, comm, r_bar, x, b, *, batched=False):
        # x is replicated: its cotangent is the sum of every rank's share.
        local = np.ascontiguousarray(r_bar @ self.A)
        x_bar = np.empty_like(local)
        comm.Allreduce(local, x_bar, op=MPI.SUM)
        return x_bar, -r_bar


def row_counts(rows, size):
    """Uneven blocks: the last rank owns none when there are several ranks."""
    if size == 1:
        return [rows]
    weights = np.arange(1, size, dtype=float)
    counts = np.floor(rows * weights / weights.sum()).astype(int)
    counts[-1] += rows - counts.sum()
    return [int(c) for c in counts] + [0]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=203)
    parser.add_argument("--unknowns", type=int, default=12)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(3)
    a_all = rng.standard_normal((args.rows, args.unknowns))  # generated everywhere, then
    b_all = rng.standard_normal(args.rows)                   # each rank keeps its rows
    counts = row_counts(args.rows, comm.size)
    start = sum(counts[:comm.rank])
    rows = slice(start, start + counts[comm.rank])
    residual = Residual(a_all[rows])

    def model(x, b):
        r = residual(x, b)
        return {"r": r, "loss": distop.AllreduceSum()(0.5 * jnp.sum(r ** 2))}

    problem = distop.Problem(model, {"x": np.zeros(args.unknowns), "b": b_all[rows]},
                             distributed={"b", "r"})
    checks = problem.check_totals(out_stream=sys.stdout if comm.rank == 0 else None)
    ok = all(c.ok for c in checks.values())

    def loss_and_grad(x):  # the value and the gradient from one program
        values, totals = problem.run_and_compute_totals("loss", "x", inputs={"x": x})
        return float(values["loss"]), totals["loss", "x"][0]

    solution = scipy.optimize.minimize(loss_and_grad, np.zeros(args.unknowns), jac=True,
                                       method="L-BFGS-B",
                                       options={"gtol": 1e-13, "ftol": 1e-16, "maxiter": 500})
    # the dense reference, from the gathered rows
    a_dense = np.concatenate(comm.allgather(a_all[rows]))
    b_dense = np.concatenate(comm.allgather(b_all[rows]))
    exact = np.linalg.lstsq(a_dense, b_dense, rcond=None)[0]
    err = np.linalg.norm(solution.x - exact) / np.linalg.norm(exact)
    grad_err = np.linalg.norm(loss_and_grad(exact)[1]) / np.linalg.norm(a_dense.T @ b_dense)
    err = comm.allreduce(max(err, grad_err), op=MPI.MAX)
    if comm.rank == 0:
        print(f"{comm.size} ranks, rows per rank {counts}; L-BFGS: {solution.nit} iterations; "
              f"check_totals {'passed' if ok else 'FAILED'}")
        print(f"max relative error {err:.1e}", flush=True)
    return 0 if ok and err <= 1e-8 else 1


if __name__ == "__main__":
    sys.exit(main())
