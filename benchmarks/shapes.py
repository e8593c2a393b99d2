"""python benchmarks/shapes.py [--ranks 1 2] [--shapes 50] [--rounds 3]

Shapes that come back: one Problem called at K input shapes in turn, as a user's outer
loop over grids or batch sizes calls it. The model: a distributed x of 8 + k entries per
rank (k = 0 .. K-1), a `HaloExchange` and f = sum of the stencil's squares over the
ranks by `AllreduceSum`; each call is a `run` and a `compute_totals`.

Per rank count, one job: every shape visited once (each compiles its programs), then
`--rounds` rounds over the K shapes (each call at a shape seen before, a different one
from the call before), then as many calls at one shape in a row (steady). Printed: the
median of each, max over ranks; the Problem's cache size (`DISTOP_CACHE_SIZE`, the
shapes it keeps programs for), and the memory each shape kept costs (the growth of the
resident set over the K first visits, divided by K, max over ranks).
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent)]
from suite import MARK, fmt, launch, print_table, ratio  # noqa: E402


def resident_mib():
    """**Returns:** this process's resident set, in MiB."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(args):
    """Time a Problem cycled through `args.shapes` shapes; rank 0 prints the result."""
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    halo, total = distop.HaloExchange(width=1), distop.AllreduceSum()

    def model(x):
        h = halo(x)
        return {"f": total(jnp.sum((h[:-2] - 2 * h[1:-1] + h[2:]) ** 2))}

    problem = distop.Problem(model, {"x": np.ones(8)}, distributed={"x"})
    points = [np.linspace(0, 1, 8 + k) + comm.Get_rank() for k in range(args.shapes)]

    def call(x):
        problem.run(x=x)
        problem.compute_totals("f", "x")

    call(np.ones(7))  # (JAX and distop warmed at a shape of its own)
    gc.collect()
    before, first = resident_mib(), []
    for x in points:
        comm.Barrier()
        started = time.perf_counter()
        call(x)
        first.append(time.perf_counter() - started)
    gc.collect()
    kept = (resident_mib() - before) / args.shapes
    seen, steady = [], []
    for _ in range(args.rounds):
        for x in points:
            started = time.perf_counter()
            call(x)
            seen.append(time.perf_counter() - started)
    for _ in range(args.rounds * args.shapes):
        started = time.perf_counter()
        call(points[0])
        steady.append(time.perf_counter() - started)
    result = {name: comm.allreduce(statistics.median(t), op=MPI.MAX)
              for name, t in (("first", first), ("seen", seen), ("steady", steady))}
    result.update(kept=comm.allreduce(kept, op=MPI.MAX), cache=problem._programs.size)
    if comm.Get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    rows, results, failed = [], {}, False
    for ranks in args.ranks:
        r, failure = launch("shapes", ranks, args, script=HERE, options=[
            "--shapes", str(args.shapes), "--rounds", str(args.rounds)])
        if failure:
            print(failure, file=sys.stderr)
            failed = True
            continue
        results[ranks] = r
        rows.append([str(ranks), str(args.shapes), str(r["cache"]), fmt(r["first"], "ms"),
                     fmt(r["seen"], "ms"), fmt(r["steady"], "ms"),
                     fmt(ratio(r["seen"], r["steady"]), "x"), f"{r['kept']:.2f}"])
    print_table(f"a Problem cycled through {args.shapes} shapes: run + compute_totals per "
                "call (ms), median, max over ranks; first: a new shape (compiles); seen: "
                "a shape seen before; steady: one shape call after call; MiB/shape: "
                "memory each shape kept costs",
                ["P", "shapes", "cache", "first", "seen", "steady", "seen/steady",
                 "MiB/shape"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
