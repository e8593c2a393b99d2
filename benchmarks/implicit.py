"""python benchmarks/implicit.py [--ranks 1 2 4] [--n 256] [--scaling-n 512] [--rounds 3]

What an implicit operator's gradient costs: the Poisson problem of examples/poisson.py
(distributed CG with halo exchanges), J = ||u - u_target||^2, its value and its
gradient with respect to f (n^2 values) and k.

One `mpiexec -n P` job per grid size and rank count (`--worker`), every variant
interleaved round by round; per call: the max over ranks of each rank's median (s).
- `solve`: one forward solve, by hand (the example's numpy + mpi4py code, called
  directly: no JAX, no distop).
- `grad by hand`: J and its gradient by hand: the solve, one adjoint solve, the
  residual's VJP.
- `distop run`, `distop grad`: `Problem.run()` and `Problem.run_and_compute_totals()`.
- `grad/solve`: distop's gradient over one forward solve (the adjoint costs about one
  more solve); `distop/hand`: distop's gradient over the hand-written one.
- `FD (est.)`: central finite differences of the gradient with respect to f, 2 n^2
  solves, estimated from `solve` (not run).
- `JAX through CG` (1 rank, `--jax-n`): the same CG written in jax.numpy with a fixed
  iteration count (the one the solve took), differentiated through its iterations by
  `jax.grad` and jitted: its gradient and its forward, and their ratio. It stores every
  iteration's vectors for the reverse sweep.

The first table is at `--n`, the second (strong scaling, with the speed-up over one
rank) at `--scaling-n`.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "examples")]
from suite import MARK, fmt, launch, print_table, ratio  # noqa: E402

K = 1.7  # the conductivity


def timed(fn):
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def jax_through_cg(n, iterations, rounds):
    """Time a jitted CG in jax.numpy, forward and `jax.grad` through its iterations.

    **Returns:** {"jax forward": s, "jax grad": s} (medians).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    h2 = 1.0 / (n + 1) ** 2
    x = jnp.linspace(0, 1, n + 2)[1:-1]
    X, Y = jnp.meshgrid(x, x, indexing="ij")
    target = X * (1 - X) * Y * (1 - Y)

    def laplacian(u):
        padded = jnp.pad(u, 1)
        return (4 * u - padded[:-2, 1:-1] - padded[2:, 1:-1] - padded[1:-1, :-2]
                - padded[1:-1, 2:]) / h2

    def objective(f, k):
        def step(_, state):
            u, r, p, rr = state
            q = k * laplacian(p)
            alpha = rr / jnp.vdot(p, q)
            u, r = u + alpha * p, r - alpha * q
            rr_new = jnp.vdot(r, r)
            return u, r, r + (rr_new / rr) * p, rr_new

        zero = jnp.zeros_like(f)
        u = lax.fori_loop(0, iterations, step, (zero, f, f, jnp.vdot(f, f)))[0]
        return jnp.sum((u - target) ** 2)

    f = jnp.sin(jnp.pi * X) * jnp.sin(2 * jnp.pi * Y) * 20 + 1.0
    forward = jax.jit(objective)
    gradient = jax.jit(jax.grad(objective, argnums=(0, 1)))
    jax.block_until_ready(forward(f, K))
    jax.block_until_ready(gradient(f, K))
    times = {"jax forward": [], "jax grad": []}
    for _ in range(rounds):
        times["jax forward"].append(timed(lambda: jax.block_until_ready(forward(f, K))))
        times["jax grad"].append(timed(lambda: jax.block_until_ready(gradient(f, K))))
    return {name: statistics.median(t) for name, t in times.items()}


def worker(args):
    """Measure every variant at one grid size on every rank; rank 0 prints the result."""
    import numpy as np
    import poisson as example
    from mpi4py import MPI

    import distop.linalg

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), args.n
    problem, f, target = example.problem_on(comm, n, K, "", args.tol)
    rows = example.split_rows(n, comm.Get_size(), "")
    start = sum(rows[:rank])
    f_mine, t_mine = f[start:start + rows[rank]].copy(), target[start:start + rows[rank]]
    op = example.Poisson(n, *example.neighbours(rows, rank), tol=args.tol)
    raw = comm.Dup()  # (the hand-written code's own communicator)

    def hand_grad():
        u = op.solve(raw, f_mine, K)
        J = np.empty(())
        raw.Allreduce(np.asarray(np.sum((u - t_mine) ** 2)), J)
        lam = op.solve_adjoint(raw, 2 * (u - t_mine), u, f_mine, K)
        f_bar, k_bar = op.residual_vjp(raw, lam, u, f_mine, K)
        return J, -f_bar, -k_bar

    variants = {
        "solve": lambda: op.solve(raw, f_mine, K),
        "grad by hand": hand_grad,
        "distop run": problem.run,
        "distop grad": problem.run_and_compute_totals,
    }
    found = distop.linalg.cg(raw, lambda v: K * op.laplacian(raw, v.reshape(f_mine.shape))
                             .ravel(), f_mine.ravel(), rtol=args.tol)
    values, totals = problem.run_and_compute_totals()  # (compiled before timing)
    _, f_bar, k_bar = hand_grad()
    err = max(float(np.max(np.abs(totals["J", "f"][0, start * n:(start + rows[rank]) * n]
                                  - f_bar.ravel())) / np.max(np.abs(f_bar))),
              abs(float(totals["J", "k"][0, 0]) - float(k_bar)) / abs(float(k_bar)))
    times = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = list(variants)[round_ % len(variants):] + list(variants)[:round_ % len(variants)]
        for name in order:
            comm.Barrier()
            times[name].append(timed(variants[name]))
    result = {name: comm.allreduce(statistics.median(t), op=MPI.MAX)
              for name, t in times.items()}
    result.update(n=n, iterations=found.iterations, err=comm.allreduce(err, op=MPI.MAX))
    if args.jax and comm.Get_size() == 1:
        result.update(jax_through_cg(n, found.iterations, args.rounds))
    if rank == 0:
        print(MARK + json.dumps(result), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--scaling-n", type=int, default=512)
    parser.add_argument("--jax-n", type=int, default=None, help="default: --n")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tol", type=float, default=1e-10)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--jax", action="store_true")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    failed = False
    tables = {}
    jax_n = args.n if args.jax_n is None else args.jax_n
    for n in dict.fromkeys([args.n, args.scaling_n]):
        for ranks in args.ranks:
            options = ["--n", str(n), "--rounds", str(args.rounds), "--tol", str(args.tol)]
            if n == jax_n and ranks == 1:
                options.append("--jax")
            result, report = launch("poisson", ranks, args, script=HERE, options=options)
            if report:
                print(report, file=sys.stderr)
                failed = True
                continue
            tables[n, ranks] = result
    print(f"# Poisson, tol {args.tol:g}: median of {args.rounds} rounds, max over ranks (s)")
    header = ["n", "ranks", "CG its", "solve", "grad by hand", "distop run", "distop grad",
              "grad/solve", "distop/hand", "FD (est.)", "err"]
    rows = []
    for (n, ranks), r in tables.items():
        if n != args.n:
            continue
        rows.append([str(n), str(ranks), str(r["iterations"]), fmt(r["solve"], "s"),
                     fmt(r["grad by hand"], "s"), fmt(r["distop run"], "s"),
                     fmt(r["distop grad"], "s"), fmt(ratio(r["distop grad"], r["solve"]), "x"),
                     fmt(ratio(r["distop grad"], r["grad by hand"]), "x"),
                     f"{2 * n * n * r['solve']:.0f}", fmt(r["err"], "e")])
    print_table(f"the gradient of J at n={args.n} against one solve", header, rows)
    jax_rows = [[str(n), fmt(r["jax forward"], "s"), fmt(r["jax grad"], "s"),
                 fmt(ratio(r["jax grad"], r["jax forward"]), "x"), fmt(r["distop grad"], "s"),
                 fmt(ratio(r["jax grad"], r["distop grad"]), "x")]
                for (n, ranks), r in tables.items() if "jax grad" in r]
    if jax_rows:
        print_table("differentiating through the CG iterations in JAX (1 rank)",
                    ["n", "jax forward", "jax grad", "grad/fwd", "distop grad",
                     "jax/distop"], jax_rows)
    one = tables.get((args.scaling_n, 1))
    rows = [[str(ranks), fmt(r["grad by hand"], "s"), fmt(r["distop grad"], "s"),
             fmt(ratio(r["distop grad"], r["grad by hand"]), "x"),
             fmt(ratio(one["grad by hand"], r["grad by hand"]) if one else None, "x"),
             fmt(ratio(one["distop grad"], r["distop grad"]) if one else None, "x")]
            for (n, ranks), r in tables.items() if n == args.scaling_n]
    print_table(f"strong scaling of the gradient at n={args.scaling_n}",
                ["ranks", "by hand", "distop", "distop/hand", "hand speed-up",
                 "distop speed-up"], rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
