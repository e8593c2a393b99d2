"""python benchmarks/hvp.py [--ranks 1 2 4] [--models matvec heat] [--repeat 30] [--no-bind]

Hessian-vector products against gradients: per call, one `Problem.compute_hvp` (K=1
direction, and K=8 directions in one call: every operator call batched over them)
against one `Problem.compute_totals` (the gradient) of the same scalar objective, and,
in one process, against the same products in plain JAX (`jax.jvp` of `jax.grad`,
jitted; K=8 under `jax.vmap`) of the same model without MPI.

The models:
- `matvec`: the README's operator, y = (sum over ranks of A_r) x with x and y
  replicated and a dense A_r of `--matvec-size` squared per rank (examples/
  distributed_matvec.py's `DistributedMatvec`: an Allreduce in each method, batched,
  declared linear), with the nonlinear objective f = sum(log(1 + y**2)).
- `heat`: the heat equation of benchmarks/stencil.py, an n x n grid (`--heat-size`)
  split by rows, `--steps` explicit steps in `lax.scan`, each `distop.HaloExchange`
  then the 5-point stencil, with a cubic reaction term: u + c (laplacian(u) - u**3),
  objective 0.5 ||u_S - d||^2 summed over the ranks; with respect to u0 (distributed).

One `mpiexec -n P` job per model and rank count (`--worker`); every variant of a job
runs side by side, interleaved call by call (a new order each round, the same on every
rank), and each figure is the max over ranks of each rank's median over `--repeat`
calls. Each rank is bound to a core of its own where there are as many
(benchmarks/stencil.py's `bind`; `--no-bind` leaves them unbound). `hvp/grad` and
`K8/K1` are ratios of those medians (targets: hvp/grad <= 2.5, K8/K1 <= 4); `err`: the
largest difference of distop's 8 products from plain JAX's on the whole (gathered)
model, relative to the largest entry, max over ranks.
"""

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "examples")]
from stencil import DIFFUSION, bind, interleaved, jax_step, report, rows_of  # noqa: E402
from suite import fmt, launch, print_table, ratio  # noqa: E402

MODELS = ("matvec", "heat")
DIRECTIONS = 8  # K of the batched products


# -- worker side: runs under mpiexec -------------------------------------------------
def timings(comm, problem, of, wrt, tangents, plain, point, args):
    """Time the gradient and the products of `problem` (and, on one rank, of `plain`,
    the same objective in plain JAX on the whole model) interleaved; rank 0 prints the
    result, with `err` from distop's K products against plain JAX's.

    **Arguments:**
    - `problem`: the `distop.Problem`; `of`, `wrt`: its scalar output and input.
    - `tangents`: (this rank's block of the K global directions, the K global ones).
    - `plain`: the objective in plain JAX, of the whole input; `point`: the whole input.
    """
    import jax
    import numpy as np
    from mpi4py import MPI

    mine, every = tangents
    grad = jax.jit(jax.grad(plain))
    hvp = jax.jit(lambda x, t: jax.jvp(jax.grad(plain), (x,), (t,))[1])
    hvps = jax.jit(jax.vmap(lambda x, t: jax.jvp(jax.grad(plain), (x,), (t,))[1],
                            in_axes=(None, 0)))
    variants = {
        "grad": lambda: problem.compute_totals(of, wrt),
        "hvp 1": lambda: problem.compute_hvp(of, wrt, {wrt: mine[0]}),
        f"hvp {DIRECTIONS}": lambda: problem.compute_hvp(of, wrt, {wrt: mine}),
    }
    if comm.Get_size() == 1:
        x, t = jax.device_put(point), jax.device_put(every)
        variants["jax grad"] = lambda: grad(x).block_until_ready()
        variants["jax hvp 1"] = lambda: hvp(x, t[0]).block_until_ready()
        variants[f"jax hvp {DIRECTIONS}"] = lambda: hvps(x, t).block_until_ready()
    # distop's products against plain JAX's on the whole model (this rank's block)
    got = np.asarray(problem.compute_hvp(of, wrt, {wrt: mine})[wrt])
    want = np.asarray(hvps(point, every))
    block = want if got.shape == want.shape else want[:, args.start:args.start + got.shape[1]]
    err = float(np.max(np.abs(got - block), initial=0.0)) / float(np.max(np.abs(want)))
    result = interleaved(comm, variants, args.repeat)
    result["err"] = comm.allreduce(err, op=MPI.MAX)
    report(comm, result, args)


def matvec_worker(args):
    """The README's matvec with a nonlinear objective (see the module docstring)."""
    import distributed_matvec as dm
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    rank, size, m = comm.Get_rank(), comm.Get_size(), args.size

    class Matvec(dm.DistributedMatvec):
        linear = True  # (its second derivative is zero: no hvp)

    # the README's A_r (this rank's own, seeded by its rank), scaled so that y is O(1)
    a_local = np.random.default_rng(rank).standard_normal((m, m)) / np.sqrt(m * size)
    x0 = np.sin(0.37 * np.arange(m)) + 0.1
    directions = np.random.default_rng(1).standard_normal((DIRECTIONS, m))  # (replicated)

    def objective(y):
        return jnp.sum(jnp.log1p(y ** 2))

    op = Matvec(a_local)
    problem = distop.Problem(lambda x: {"f": objective(op(x))}, {"x": x0})
    a_global = comm.allreduce(a_local, op=MPI.SUM)  # (for plain JAX's reference)
    args.start = 0
    timings(comm, problem, "f", "x", (directions, directions),
            lambda x: objective(a_global @ x), x0, args)


def heat_worker(args):
    """The heat equation with a cubic term (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    size, rank, n, steps = comm.Get_size(), comm.Get_rank(), args.size, args.steps
    rows = rows_of(n, size, rank)
    args.start = start = sum(rows_of(n, size, r) for r in range(rank))
    # the global data, the same on every rank (each takes its rows)
    rng = np.random.default_rng(n)
    u0, d = rng.uniform(-1, 1, (n, n)), 0.1 * rng.standard_normal((n, n))
    directions = rng.standard_normal((DIRECTIONS, n, n))
    halo, total = distop.HaloExchange(width=1), distop.AllreduceSum()

    def step(u, window):  # u + c (laplacian(u) - u**3), on the block and its halo rows
        return jax_step(u, window) - DIFFUSION * u ** 3

    def model(u):
        u = lax.scan(lambda u, _: (step(u, halo(u)), None), u, None, length=steps)[0]
        return {"f": total(0.5 * jnp.sum((u - d[start:start + rows]) ** 2))}

    def plain(u):  # the whole grid in one process: zero halo rows beyond its ends
        u = lax.scan(lambda u, _: (step(u, jnp.pad(u, ((1, 1), (0, 0)))), None), u, None,
                     length=steps)[0]
        return 0.5 * jnp.sum((u - d) ** 2)

    problem = distop.Problem(model, {"u": u0[start:start + rows]}, distributed={"u"})
    timings(comm, problem, "f", "u", (directions[:, start:start + rows], directions),
            plain, u0, args)


# -- driver side -----------------------------------------------------------------------
def jobs(args):
    """**Returns:** (key, worker, ranks, options) of every job: one per model and rank
    count."""
    common = ["--steps", str(args.steps), "--repeat", str(args.repeat)]
    if not args.bind:
        common.append("--no-bind")
    sizes = {"matvec": args.matvec_size, "heat": args.heat_size}
    return [(f"{model} {ranks}", model, ranks, common + ["--size", str(sizes[model])])
            for model in args.models for ranks in args.ranks]


def print_tables(results, args):
    """Print one table of every job in `results` (keyed as `jobs` names them)."""
    K = DIRECTIONS
    rows = []
    for key, r in results.items():
        model, ranks = key.split()
        rows.append([ranks, model, fmt(r["grad"], "ms"), fmt(r["hvp 1"], "ms"),
                     fmt(ratio(r["hvp 1"], r["grad"]), "x"), fmt(r[f"hvp {K}"], "ms"),
                     fmt(ratio(r[f"hvp {K}"], r["hvp 1"]), "x"),
                     fmt(r.get("jax grad"), "ms"), fmt(r.get("jax hvp 1"), "ms"),
                     fmt(ratio(r.get("jax hvp 1"), r.get("jax grad")), "x"),
                     fmt(r.get(f"jax hvp {K}"), "ms"),
                     fmt(ratio(r.get(f"jax hvp {K}"), r.get("jax hvp 1")), "x"),
                     fmt(r["err"], "e")])
    bound = {r.get("bound") for r in results.values()}
    placed = {frozenset({True}): "each rank bound to a core",
              frozenset({False}): "ranks unbound"}.get(frozenset(bound),
                                                       "some jobs' ranks bound to cores")
    print_table(
        f"Hessian-vector products against the gradient (ms), {placed}: matvec "
        f"M={args.matvec_size}; heat n={args.heat_size}, {args.steps} steps; max over ranks "
        f"of the median of {args.repeat} interleaved calls; targets: hvp/grad <= 2.5, "
        f"K{K}/K1 <= 4; jax: plain JAX in one process; err: distop's {K} products against "
        "plain JAX's",
        ["P", "model", "grad", "hvp K1", "hvp/grad", f"hvp K{K}", f"K{K}/K1", "jax grad",
         "jax K1", "jax hvp/grad", f"jax K{K}", f"jax K{K}/K1", "err"], rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--matvec-size", type=int, default=400)
    parser.add_argument("--heat-size", type=int, default=96)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-bind", dest="bind", action="store_false",
                        help="leave the ranks unbound (see above)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from mpi4py import MPI

        args.bound = args.bind and bind(MPI.COMM_WORLD)
        return {"matvec": matvec_worker, "heat": heat_worker}[args.worker](args)
    results, failed = {}, False
    for key, model, ranks, options in jobs(args):
        started = time.perf_counter()
        r, failure = launch(model, ranks, args, script=HERE, options=options)
        print(f"# {key}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if failure:
            print(failure, file=sys.stderr)
            failed = True
        else:
            results[key] = r
    print_tables(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
