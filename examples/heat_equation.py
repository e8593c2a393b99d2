"""mpiexec -n 4 python examples/heat_equation.py

The 2-D heat equation on an n x n grid split by rows over the ranks (unevenly; with
three ranks or more the last owns none). Each explicit step exchanges one halo row with
each neighbour (`Sendrecv`), inside `lax.scan`. The objective is the misfit of the final
temperature against data. Its totals with respect to the initial temperature
(distributed) and the diffusivity (replicated) come from distop. They are verified by
check_totals, and against a dense single-process run of the same steps in jax.numpy.
With `--checkpoint-every k` the steps run as a scan of checkpointed scans of k steps:
the reverse sweep stores every k-th state and recomputes the others.

Prints `max relative error <x.xe-xx>` on rank 0; exits non-zero above 1e-10.

Options: --steps N (default 60), --n (default 12), --checkpoint-every k (default 0:
no checkpointing; N must be a multiple of k).
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)


class Halo(distop.DistributedOperator):
    """This rank's rows with one row of each neighbour around them (zeros at the
    domain's edges): (m, n) -> (m + 2, n). Ranks that own no rows take no part."""

    above: int  # the rank owning the row above this block, or MPI.PROC_NULL
    below: int  # the rank owning the row below it, or MPI.PROC_NULL
    forward_collectives = ("Sendrecv",)
    vjp_collectives = ("Sendrecv",)

    def output_spec(self, u):
        return jax.ShapeDtypeStruct((u.shape[0] + 2, u.shape[1]), u.dtype)

    def forward(self, comm, u):
        padded = np.zeros((u.shape[0] + 2, u.shape[1]))
        padded[1:-1] = u
        if len(u):
            comm.Sendrecv(u[-1], self.below, recvbuf=padded[0], source=self.above)
            comm.Sendrecv(u[0], self.above, recvbuf=padded[-1], source=self.below)
        return padded

    def vjp(self, comm, padded_bar, u):
        # the halo rows were the neighbours' rows: their cotangents go back to them
        u_bar = padded_bar[1:-1].copy()
        if len(u):
            from_below, from_above = np.zeros(u.shape[1]), np.zeros(u.shape[1])
            comm.Sendrecv(np.ascontiguousarray(padded_bar[0]), self.above,
                          recvbuf=from_below, source=self.below)
            comm.Sendrecv(np.ascontiguousarray(padded_bar[-1]), self.below,
                          recvbuf=from_above, source=self.above)
            u_bar[-1] += from_below
            u_bar[0] += from_above
        return u_bar


def row_counts(n, size):
    """Uneven blocks of rows; with three ranks or more the last owns none."""
    owners = size - 1 if size >= 3 else size
    weights = np.arange(1, owners + 1, dtype=float)
    counts = np.floor(n * weights / weights.sum()).astype(int)
    counts[-1] += n - counts.sum()
    return [int(c) for c in counts] + [0] * (size - owners)


def neighbours(counts, rank):
    """The nearest ranks above and below `rank` that own rows (MPI.PROC_NULL if none)."""
    above = [r for r in range(rank) if counts[r]]
    below = [r for r in range(rank + 1, len(counts)) if counts[r]]
    return (above[-1] if above else MPI.PROC_NULL), (below[0] if below else MPI.PROC_NULL)


def step(padded, kappa, dt, h):
    """One explicit Euler step of u_t = kappa * laplacian(u), zero at the edges, given
    the block with its halo rows."""
    u = padded[1:-1]
    sides = jnp.pad(u, ((0, 0), (1, 1)))
    laplacian = (padded[:-2] + padded[2:] + sides[:, :-2] + sides[:, 2:] - 4 * u) / h ** 2
    return u + dt * kappa * laplacian


def evolve(u0, kappa, steps, every, halo, dt, h):
    """`steps` steps from `u0`: one scan, or a scan of checkpointed scans of `every`."""
    def one(u, _):
        return step(halo(u), kappa, dt, h), None

    if not every:
        return lax.scan(one, u0, None, length=steps)[0]
    stretch = jax.checkpoint(lambda u, _: (lax.scan(one, u, None, length=every)[0], None))
    return lax.scan(stretch, u0, None, length=steps // every)[0]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n", type=int, default=12)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    args = parser.parse_args(argv)
    if args.checkpoint_every and args.steps % args.checkpoint_every:
        parser.error("--steps must be a multiple of --checkpoint-every")
    comm = MPI.COMM_WORLD
    n, h = args.n, 1.0 / (args.n + 1)
    dt = 0.2 * h ** 2  # stable for kappa up to 1.25
    grid = np.linspace(h, 1 - h, n)
    u0_all = np.outer(np.sin(np.pi * grid), np.sin(2 * np.pi * grid)) + 0.1
    data_all = 0.5 * np.outer(grid, 1 - grid)
    counts = row_counts(n, comm.size)
    start = sum(counts[:comm.rank])
    rows = slice(start, start + counts[comm.rank])
    halo = Halo(*neighbours(counts, comm.rank))

    def model(u0, kappa, data):
        # kappa is replicated, and each rank uses it on its own rows: RankLocal sums the
        # ranks' shares of its cotangent, so its total is whole and the same everywhere
        kappa = distop.RankLocal()(kappa)
        u = evolve(u0, kappa, args.steps, args.checkpoint_every, halo, dt, h)
        return {"misfit": distop.AllreduceSum()(0.5 * jnp.sum((u - data) ** 2))}

    problem = distop.Problem(model, {"u0": u0_all[rows], "kappa": np.array(0.8),
                                     "data": data_all[rows]},
                             distributed={"u0", "data"})
    totals = problem.compute_totals("misfit", ["u0", "kappa"])
    checks = problem.check_totals("misfit", ["u0", "kappa"],
                                  out_stream=sys.stdout if comm.rank == 0 else None)
    ok = all(c.ok for c in checks.values())

    # the dense reference: the same steps on the whole grid in one process
    def dense(u0, kappa):
        def one(u, _):
            return step(jnp.pad(u, ((1, 1), (0, 0))), kappa, dt, h), None
        u = lax.scan(one, u0, None, length=args.steps)[0]
        return 0.5 * jnp.sum((u - data_all) ** 2)

    value, (du0, dkappa) = jax.value_and_grad(dense, argnums=(0, 1))(u0_all, 0.8)
    misfit = problem.run()["misfit"]
    errors = [abs(misfit - value) / abs(value),
              np.abs(totals["misfit", "u0"][0] - du0.ravel()).max() / np.abs(du0).max(),
              abs(totals["misfit", "kappa"][0, 0] - dkappa) / abs(dkappa)]
    err = comm.allreduce(float(max(errors)), op=MPI.MAX)
    ok = comm.allreduce(ok, op=MPI.LAND)
    if comm.rank == 0:
        calls = {e.context for e in problem.schedule if e.operator == "Halo"}
        print(f"{comm.size} ranks, rows per rank {counts}; {args.steps} steps"
              + (f", checkpointed every {args.checkpoint_every}" if args.checkpoint_every
                 else "") + f"; halo calls in {sorted(calls)}; "
              f"check_totals {'passed' if ok else 'FAILED'}")
        print(f"max relative error {err:.1e}", flush=True)
    return 0 if ok and err <= 1e-10 else 1


if __name__ == "__main__":
    sys.exit(main())
