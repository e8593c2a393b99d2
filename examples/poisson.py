"""mpiexec -n 4 python examples/poisson.py --n 64 --split 20,0,30,14

A 2-D Poisson problem, -div(k grad u) = f, on the n x n interior points of the unit
square (zero on its boundary), with a constant conductivity k. The grid's rows are split
over the ranks (`--split`, any sizes, zeros allowed). u is solved by distributed
conjugate gradients (`distop.linalg.cg`): each matrix-vector product exchanges one grid
row with each neighbouring rank (Sendrecv), each dot product is an Allreduce.

`Poisson` is an `ImplicitOperator`: its derivatives come from one adjoint solve (the
operator is symmetric: the same CG), never from differentiating the iterations. The
objective J = ||u - u_target||^2 is a replicated scalar; the example computes dJ/df
(f distributed) and dJ/dk (k replicated) with `compute_totals`, compares them with a
sparse direct solve of the whole grid in one process, and checks them with
`check_totals` (finite differences, on a grid of `--check-n` points a side).

Prints `max relative error x.xe-xx` on rank 0 and exits with status 1 above 1e-8.
Options: `--n` (grid size, default 64), `--split`, `--tol` (CG's relative tolerance,
default 1e-12), `--check-n` (default 8; 0 skips the finite differences).
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import distop
import distop.linalg

jax.config.update("jax_enable_x64", True)
BOUND = 1e-8


class Poisson(distop.ImplicitOperator):
    """u with R(u; f, k) = k A u - f = 0, A the 5-point Laplacian of an n x n grid (step
    h = 1/(n+1)), for this rank's block of grid rows.

    Fields:
    - `n`: points per grid row.
    - `above`, `below`: the ranks holding the grid rows just above and below this
      rank's, or `MPI.PROC_NULL` (see `neighbours`).
    - `tol`: CG's relative tolerance.
    """

    n: int
    above: int
    below: int
    tol: float = 1e-12
    solve_collectives = adjoint_collectives = residual_collectives = ("Sendrecv",
                                                                        "Allreduce")

    def laplacian(self, comm, u):
        """A u on this rank's rows: one halo row from each neighbouring rank."""
        up, down = np.zeros(self.n), np.zeros(self.n)
        if len(u):  # (a rank without rows is no one's neighbour)
            comm.Sendrecv(np.ascontiguousarray(u[-1]), dest=self.below, recvbuf=up,
                          source=self.above)
            comm.Sendrecv(np.ascontiguousarray(u[0]), dest=self.above, recvbuf=down,
                          source=self.below)
        padded = np.zeros((len(u) + 2, self.n + 2))
        padded[1:-1, 1:-1] = u
        padded[0, 1:-1], padded[-1, 1:-1] = up, down
        h2 = 1.0 / (self.n + 1) ** 2
        return (4 * u - padded[:-2, 1:-1] - padded[2:, 1:-1] - padded[1:-1, :-2]
                - padded[1:-1, 2:]) / h2

    def cg(self, comm, rhs, k, name):
        """(k A)^-1 rhs by conjugate gradients."""
        shape = rhs.shape
        found = distop.linalg.cg(
            comm, lambda v: k * self.laplacian(comm, v.reshape(shape)).ravel(),
            rhs.ravel(), rtol=self.tol, maxiter=20 * self.n + 100, name=name)
        return found.x.reshape(shape)

    def solve(self, comm, f, k):
        return self.cg(comm, f, k, "Poisson.solve")

    def solve_adjoint(self, comm, u_bar, u, f, k):  # k A is symmetric
        return self.cg(comm, u_bar, k, "Poisson.solve_adjoint")

    def residual_vjp(self, comm, lam, u, f, k):
        # dR/df = -I; dR/dk = A u, summed over every rank's rows (k is replicated)
        k_bar = np.empty(())
        comm.Allreduce(np.asarray(np.vdot(lam, self.laplacian(comm, u))), k_bar)
        return -lam, k_bar

    def solve_linear(self, comm, rhs, u, f, k):
        return self.cg(comm, rhs, k, "Poisson.solve_linear")

    def residual_jvp(self, comm, tangents, u, f, k):
        f_dot, k_dot = tangents
        return k_dot * self.laplacian(comm, u) - f_dot


def neighbours(counts, mine):
    """**Returns:** the ranks holding the grid rows just above and below rank `mine`'s
    (ranks without rows skipped), or `MPI.PROC_NULL` at the grid's edges, given every
    rank's row count."""
    above = [r for r in range(mine) if counts[r]]
    below = [r for r in range(mine + 1, len(counts)) if counts[r]]
    return (above[-1] if above else MPI.PROC_NULL), (below[0] if below else MPI.PROC_NULL)


def split_rows(n, size, text):
    """**Returns:** the number of grid rows of each rank (`--split`, or as even as can
    be)."""
    if text:
        rows = [int(r) for r in text.split(",")]
        if len(rows) != size or sum(rows) != n or min(rows) < 0:
            raise SystemExit(f"--split {text}: give {size} non-negative row counts that "
                             f"add up to --n {n}")
        return rows
    return [n // size + (r < n % size) for r in range(size)]


def dense_reference(n, k, f, target):
    """J's value and totals from a sparse direct solve of the whole grid (one process).

    **Returns:** (u, dJ/df, dJ/dk), flattened over the grid.
    """
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    h2 = 1.0 / (n + 1) ** 2
    T = sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])
    A = (sp.kron(T, sp.eye(n)) + sp.kron(sp.eye(n), T)).tocsc() / h2
    u = spla.spsolve(k * A, f)
    lam = spla.spsolve(k * A, 2 * (u - target))  # (k A)^T lam = dJ/du
    return u, lam, -lam @ (A @ u)


def problem_on(comm, n, k, split, tol):
    """**Returns:** the Problem of J on an n x n grid, this rank's block of f and of the
    target, and the global f and target (every rank makes the same)."""
    rows = split_rows(n, comm.Get_size(), split)
    start = sum(rows[:comm.Get_rank()])
    x = np.linspace(0, 1, n + 2)[1:-1]
    X, Y = np.meshgrid(x, x, indexing="ij")
    f = np.sin(np.pi * X) * np.sin(2 * np.pi * Y) * 20 + 1.0
    target = X * (1 - X) * Y * (1 - Y)
    f_mine = f[start:start + rows[comm.Get_rank()]].copy()
    target_mine = target[start:start + rows[comm.Get_rank()]]
    poisson = Poisson(n, *neighbours(rows, comm.Get_rank()), tol=tol)

    def model(f, k):
        u = poisson(f, k)
        return {"J": distop.AllreduceSum()(jnp.sum((u - target_mine) ** 2))}

    problem = distop.Problem(model, {"f": f_mine, "k": k}, distributed=["f"])
    return problem, f, target


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--split", default="")
    parser.add_argument("--tol", type=float, default=1e-12)
    parser.add_argument("--check-n", type=int, default=8)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    k = 1.7
    say = print if comm.Get_rank() == 0 else (lambda *a, **kw: None)

    problem, f, target = problem_on(comm, args.n, k, args.split, args.tol)
    started = time.perf_counter()
    values, totals = problem.run_and_compute_totals()
    took = time.perf_counter() - started
    u_ref, f_bar, k_bar = dense_reference(args.n, k, f.ravel(), target.ravel())
    J_ref = float(np.sum((u_ref - target.ravel()) ** 2))
    errors = {
        "J": abs(float(values["J"]) - J_ref) / abs(J_ref),
        "dJ/df": float(np.max(np.abs(totals["J", "f"][0] - f_bar)) / np.max(np.abs(f_bar))),
        "dJ/dk": abs(float(totals["J", "k"][0, 0]) - k_bar) / abs(k_bar),
    }
    say(f"Poisson {args.n} x {args.n} on {comm.Get_size()} ranks: J = {float(values['J']):.6e}"
        f", dJ/dk = {float(totals['J', 'k'][0, 0]):.6e} ({took:.2f} s for the value and "
        "the totals)")
    for name, err in errors.items():
        say(f"  {name:6s} against a sparse direct solve: relative error {err:.1e}")
    worst = max(errors.values())
    if args.check_n:
        small, _, _ = problem_on(comm, args.check_n, k, "", args.tol)
        checks = small.check_totals(out_stream=None, step=1e-6, rtol=1e-5)
        share = max(c.abs_error / c.allowed for c in checks.values() if c.allowed)
        say(f"  check_totals on a {args.check_n} x {args.check_n} grid: "
            f"{'ok' if all(c.ok for c in checks.values()) else 'FAILED'} "
            f"(worst entry's error {share:.1e} of what it is allowed)")
        if not all(c.ok for c in checks.values()):
            worst = max(worst, 1.0)
    say(f"max relative error {worst:.1e}")
    return 0 if worst <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
