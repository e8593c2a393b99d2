"""mpiexec -n 4 python examples/load_imbalance.py --slow-rank 1 --factor 4

One slow rank, found by a profile wherever its time goes: every rank holds rows of a
matrix A and the operator computes the Gram product y = sum over ranks of A_r^T (A_r x),
but rank `--slow-rank` does `--factor` times the work of the others, in one of three
places (`--where`):

- `method` (the default): it holds `--factor` times as many rows, so the operator's
  method computes longer there (uneven data);
- `jax`: every rank holds the same rows, but the model on the slow rank does jax.numpy
  work in proportion to (factor - 1) times the rows more (matrix products whose result
  it drops);
- `outside`: every rank holds the same rows, but the slow rank's own code, between its
  calls of distop, computes the Gram product of (factor - 1) times the rows more,
  as often as the call's methods do.

Every rank meets the others in the Allreduce and in distop's agreement on each call,
so the fast ranks wait there for the slow one. The profile's report (rank 0 prints its
table and a line `slowest rank: R`) names the rank the others waited for, how long,
and where its extra time went.

Options: --where {method,jax,outside} (default method), --slow-rank R (default: the
last rank), --factor F (default 4), --rows N (rows per ordinary rank, default 20000:
enough work that the slow rank stands out of the noise of a busy machine),
--size M (the length of x, default 48), --repeat K (profiled calls of run and
compute_totals, default 10), --trace out.json (a Chrome trace for
https://ui.perfetto.dev), --plot out.png (needs matplotlib: `pip install
'distop[plot]'`).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)


class Gram(distop.DistributedOperator):
    """y = sum over ranks r of A_r^T (A_r x): x and y replicated, A_r this rank's rows.
    Symmetric, so its vjp is itself."""

    a_local: np.ndarray
    forward_collectives = vjp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        local = self.a_local.T @ (self.a_local @ x)  # the work: 4 x rows x M flops
        out = np.empty_like(local)
        comm.Allreduce(local, out, op=MPI.SUM)  # where the fast ranks wait
        return out

    def vjp(self, comm, y_bar, x):
        return self.forward(comm, y_bar)


def rows(rank, slow_rank, factor, base, where="method"):
    """**Returns:** the number of rows `rank` holds."""
    return base * factor if rank == slow_rank and where == "method" else base


def extra_rows(rank, slow_rank, factor, base, where):
    """**Returns:** the rows of extra work `rank` does in `where` (none but on the slow
    rank, and in the operator's method the rows themselves are the extra work)."""
    return base * (factor - 1) if rank == slow_rank and where != "method" else 0


def jax_work(x, rows):
    """jax.numpy work in the model, made from x: products of a small matrix in a loop,
    four times the flops of a Gram product of `rows` rows (small matrix products run
    faster than a product streaming that many rows from memory).

    Rows the model closed over would be a constant of its program, compiled and cached
    with all their values."""
    m = x.shape[0]

    def step(_, v):
        return jnp.tanh(v @ v)

    return jax.lax.fori_loop(0, max(1, 8 * rows // m ** 2), step, jnp.outer(x, x) / m)


def own_work(b, x):
    """The caller's own code between calls of distop: the rows' work in numpy."""
    return b.T @ (b @ x)


def main(argv=None):
    comm = MPI.COMM_WORLD
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", choices=("method", "jax", "outside"), default="method")
    parser.add_argument("--slow-rank", type=int, default=comm.size - 1)
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--size", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--trace")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    if not 0 <= args.slow_rank < comm.size:
        parser.error(f"--slow-rank {args.slow_rank}: expected a rank of 0..{comm.size - 1}")
    m, where = args.size, args.where
    n = rows(comm.rank, args.slow_rank, args.factor, args.rows, where)
    a_local = np.random.default_rng(comm.rank).standard_normal((n, m)) / np.sqrt(n)
    gram = Gram(a_local)
    extra = extra_rows(comm.rank, args.slow_rank, args.factor, args.rows, where)
    b = np.random.default_rng(100 + comm.rank).standard_normal(
        (extra if where == "outside" else 0, m)) / np.sqrt(args.rows)
    x0 = np.linspace(-1.0, 1.0, m)

    def model(x):
        if where == "jax" and extra:
            # jax.numpy work on this rank only, its result dropped (0 * a finite value
            # is exactly 0: the model's value and derivatives are every rank's alike)
            x = x + 0.0 * jnp.sum(jax_work(x, extra))
        return {"f": 0.5 * jnp.sum(gram(x) ** 2)}

    def own_code(times):
        # (as many Gram products as the call's methods make: the same extra work as
        # the slow rank's rows make with --where method)
        if where == "outside" and extra:
            for _ in range(times):
                own_work(b, x0)

    problem = distop.Problem(model, {"x": x0})
    # the operator's derivatives are right (before profiling: this is many runs)
    checks = problem.check_totals(out_stream=None, rtol=1e-5, atol=1e-7)
    ok = all(c.ok for c in checks.values())
    problem.run(), problem.compute_totals()  # compiled before the profile
    with problem.profile() as prof:
        for _ in range(args.repeat):
            own_code(1)
            problem.run()
            own_code(2)
            problem.compute_totals()
    report = prof.print_report()
    waits = (report.wait + report.agreement) * 1e3
    if comm.rank == 0:
        others = [r for r in range(comm.size) if r != report.slowest_rank]
        every = [rows(r, args.slow_rank, args.factor, args.rows, where)
                 for r in range(comm.size)]
        print(f"rows per rank: {every}; the slow rank's extra work: {where}")
        if others:
            print("wait in MPI on the other ranks (ms): "
                  + ", ".join(f"rank {r}: {waits[r]:.3g}" for r in others))
        print(f"check_totals: {'ok' if ok else 'FAILED'}", flush=True)
    if args.trace:
        prof.write_trace(args.trace)
    if args.plot:
        prof.plot(args.plot)
    if comm.rank == 0 and (args.trace or args.plot):
        print("wrote " + " and ".join(p for p in (args.trace, args.plot) if p), flush=True)
    return 0 if comm.allreduce(ok, op=MPI.LAND) else 1


if __name__ == "__main__":
    raise SystemExit(main())
