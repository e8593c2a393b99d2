"""python benchmarks/problems.py [--ranks 1 2] [--problems 1000] [--models plain loop]

Problems made and dropped: what a rank keeps of each Problem once it is gone, as a
user's outer loop (an optimizer's restarts, a parameter sweep) makes a new Problem per
step. Each Problem is made, called once (`run` and `compute_totals`: it traces and
compiles its programs) and dropped. The models, on a distributed x of 8 entries per
rank: `plain`, f = the sum of the squares of `AllreduceSum(sin(x) * 2)`, in jax.numpy;
`loop`, the same followed by three steps z = `AllreduceSum(sin(x) * z)` / 2 in a
`lax.fori_loop` (a body traced with host calls).

Per model and rank count, one job: 20 Problems first (JAX and distop warmed), then
`--problems` more, then `--heap` more with Python's allocations traced (`tracemalloc`,
which slows them). Printed, max over ranks: the growth of the resident set over the
`--problems` Problems (MiB, and KiB per Problem); the part of it on Python's heap, per
Problem (KiB, from the traced pass); the time per Problem; and how many values of
distop's tracing setting were made (JAX keeps traced bodies per value) and how many are
still in use at the end (none should be: no Problem is alive).
"""

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent)]
from suite import MARK, fmt, launch, print_table  # noqa: E402

WARM = 20  # Problems made before measuring (JAX's and distop's first-use costs)


def resident_kib():
    """**Returns:** this process's resident set, in KiB."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def make_model(name):
    """**Returns:** the model function `name` names (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    import distop

    total = distop.AllreduceSum()

    def plain(x):
        return {"f": jnp.sum(total(jnp.sin(x) * 2.0) ** 2)}

    def loop(x):
        y = jax.lax.fori_loop(0, 3, lambda i, z: total(jnp.sin(x) * z) * 0.5,
                              total(jnp.sin(x) * 2.0))
        return {"f": jnp.sum(y ** 2)}

    return {"plain": plain, "loop": loop}[name]


def worker(args):
    """Make and drop Problems of `args.worker`'s model; rank 0 prints the result."""
    import gc
    import tracemalloc

    import jax
    import numpy as np
    from mpi4py import MPI

    import distop

    try:
        from distop._hostcalls.sessions import values
    except ImportError:  # (a distop from before the values were reused: not counted)
        values = None

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    model = make_model(args.worker)
    x = np.linspace(0.0, 1.0, 8) + comm.Get_rank()

    def one():
        problem = distop.Problem(model, {"x": x}, distributed={"x"})
        problem.run()
        problem.compute_totals("f", "x")

    for _ in range(WARM):
        one()
    gc.collect()
    comm.Barrier()
    before, started = resident_kib(), time.perf_counter()
    for _ in range(args.problems):
        one()
    seconds = (time.perf_counter() - started) / args.problems
    gc.collect()
    growth = resident_kib() - before
    tracemalloc.start()
    for _ in range(args.heap):
        one()
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] / 1024
    tracemalloc.stop()

    def most(value):
        return comm.allreduce(value, op=MPI.MAX)

    result = {"growth": most(growth), "per_problem": most(growth / args.problems),
              "heap": most(heap / max(args.heap, 1)), "seconds": most(seconds),
              "made": None if values is None else most(values().made),
              "in_use": None if values is None else most(values().in_use)}
    if comm.Get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--heap", type=int, default=100)
    parser.add_argument("--models", nargs="+", default=["plain"], choices=["plain", "loop"])
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    rows, results, failed = [], {}, False
    for model in args.models:
        for ranks in args.ranks:
            r, failure = launch(model, ranks, args, script=HERE, options=[
                "--problems", str(args.problems), "--heap", str(args.heap)])
            if failure:
                print(failure, file=sys.stderr)
                failed = True
                continue
            results[f"{model} {ranks}"] = r
            rows.append([model, str(ranks), str(args.problems), f"{r['growth'] / 1024:.2f}",
                         f"{r['per_problem']:.2f}", f"{r['heap']:.2f}",
                         fmt(r["seconds"], "ms"),
                         *("-" if r[k] is None else str(r[k]) for k in ("made", "in_use"))])
    print_table(f"Problems made, called once (run + compute_totals) and dropped, after the "
                f"first {WARM}: growth of the resident set (MiB, KiB per Problem), its "
                "Python-heap part per Problem (KiB, tracemalloc), time per Problem (ms), "
                "values of distop's tracing setting made and still in use; max over ranks",
                ["model", "P", "Problems", "MiB", "KiB/Problem", "heap KiB", "ms",
                 "values", "in use"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
