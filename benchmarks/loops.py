"""python benchmarks/loops.py [--ranks 1 2 4] [--steps 1000] [--repeat 7] [--memory]

Time stepping: an operator with one Allreduce in its forward and its vjp, applied N times
to a state of 64 (then 100,000) points (`u = op(u) + 0.01`, objective `sum(u**2)`), three
ways, side by
side in one job per rank count (every variant interleaved round by round; per step: the
max over ranks of each rank's median, divided by N):
- `scan`: the steps as `lax.scan` in the model;
- `python`: the steps as a Python loop in the model (unrolled when traced);
- `hand`: the same steps in numpy and mpi4py, calling the operator's methods directly
  (the reverse sweep by hand, keeping every step's input), plus one dispatch of a
  jitted JAX function (`dispatch`): the floor a one-program call cannot beat.

The second table: the first call of `run` (creating the Problem and running it once)
and of `compute_totals`, for N steps as a scan and as a Python loop, on one rank.

The third (`--memory`): N = `--memory-steps` steps of a `--memory-size`-point
distributed state, the gradient by `compute_totals` storing every step's state against
checkpointing every sqrt(N) steps (a scan of checkpointed scans): the peak resident
memory each adds over the process's baseline (max over ranks, MiB), and the time.
"""

import argparse
import json
import math
import pathlib
import resource
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent)]
from suite import MARK, fmt, launch, print_table, ratio  # noqa: E402


def operator_class():
    """**Returns:** the benchmark's operator class (made after MPI and JAX start)."""
    import numpy as np

    import distop

    class Mean(distop.DistributedOperator):
        """y = x averaged over the ranks (one Allreduce forward, one in the vjp)."""

        forward_collectives = ("Allreduce",)
        vjp_collectives = ("Allreduce",)
        batched_vjp = True

        def forward(self, comm, x, out=None):
            # (into XLA's own buffer where distop offers it: no copy of the result)
            y = np.empty_like(x) if out is None else out
            comm.Allreduce(x, y)
            y /= comm.Get_size()
            return y

        def vjp(self, comm, y_bar, x, out=None):
            x_bar = np.empty_like(y_bar) if out is None else out
            comm.Allreduce(np.ascontiguousarray(y_bar), x_bar)
            x_bar /= comm.Get_size()
            return x_bar

    return Mean


def models(op, n):
    """**Returns:** {"scan": model, "python": model} of `n` steps."""
    import jax.numpy as jnp
    from jax import lax

    def scan(u):
        u = lax.scan(lambda c, _: (op(c) + 0.01, None), u, None, length=n)[0]
        return {"f": jnp.sum(u ** 2)}

    def python(u):
        for _ in range(n):
            u = op(u) + 0.01
        return {"f": jnp.sum(u ** 2)}

    return {"scan": scan, "python": python}


def timed(fn):
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def step_worker(args):
    """Per-step times of every variant on every rank; rank 0 prints the result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm, n = MPI.COMM_WORLD, args.steps
    op = operator_class()()
    u0 = np.linspace(0.0, 1.0, args.points)
    problems = {name: distop.Problem(model, {"u": u0}) for name, model in models(op, n).items()}
    raw = comm.Dup()
    noop = jax.jit(lambda u: u)
    device_u = jnp.asarray(u0)

    # (the class's functions: equinox makes a bound method anew on every `op.forward`)
    forward, vjp = type(op).forward, type(op).vjp

    def hand_run():
        u = u0
        for _ in range(n):
            u = forward(op, raw, u) + 0.01
        return u

    def hand_totals():
        u, inputs = u0, []
        for _ in range(n):
            inputs.append(u)
            u = forward(op, raw, u) + 0.01
        u_bar = 2 * u
        for x in reversed(inputs):
            u_bar = vjp(op, raw, u_bar, x)
        return u_bar

    variants = {"dispatch": lambda: noop(device_u).block_until_ready(),
                "hand run": hand_run, "hand totals": hand_totals}
    for name, problem in problems.items():
        variants[f"{name} run"] = problem.run
        variants[f"{name} totals"] = problem.compute_totals
    exact = hand_totals()
    err = max(float(np.max(np.abs(p.compute_totals()["f", "u"][0] - exact)))
              / float(np.max(np.abs(exact))) for p in problems.values())
    times = {name: [] for name in variants}
    for round_ in range(args.repeat):
        names = list(variants)
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            comm.Barrier()
            times[name].append(timed(variants[name]))
    result = {name: comm.allreduce(statistics.median(t), op=MPI.MAX) / n
              for name, t in times.items() if name != "dispatch"}
    result["dispatch"] = comm.allreduce(statistics.median(times["dispatch"]), op=MPI.MAX)
    result["err"] = comm.allreduce(err, op=MPI.MAX)
    if comm.Get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)


def first_worker(args):
    """First-call times of one model kind and step count."""
    import jax
    import numpy as np

    import distop

    jax.config.update("jax_enable_x64", True)
    op = operator_class()()
    model = models(op, args.steps)[args.kind]
    started = time.perf_counter()
    problem = distop.Problem(model, {"u": np.linspace(0.0, 1.0, 64)})
    problem.run()
    run = time.perf_counter() - started
    totals = timed(problem.compute_totals)
    print(MARK + json.dumps({"run": run, "totals": totals}), flush=True)


def peak_mib():
    """**Returns:** this process's peak resident memory so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_worker(args):
    """Peak memory and time of compute_totals, storing every step or checkpointing."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    n, every = args.memory_steps, math.isqrt(args.memory_steps)
    local = args.memory_size // size + (rank < args.memory_size % size)
    op = operator_class()()

    def one(u, _):
        return jnp.tanh(op(u)) + 0.01 * u, None

    def model(u):
        if args.kind == "checkpoint":
            stretch = jax.checkpoint(lambda u, _: (lax.scan(one, u, None, length=every)[0],
                                                   None))
            u = lax.scan(stretch, u, None, length=n // every)[0]
        else:
            u = lax.scan(one, u, None, length=n)[0]
        return {"f": distop.AllreduceSum()(jnp.sum(u ** 2))}

    u0 = np.linspace(0.0, 1.0, local) + rank
    problem = distop.Problem(model, {"u": u0}, distributed={"u"})
    problem.run()
    base = peak_mib()
    seconds = timed(problem.compute_totals)
    grown = peak_mib() - base
    gradient = problem.compute_totals()["f", "u"][0]
    result = {"peak": comm.allreduce(grown, op=MPI.MAX),
              "seconds": comm.allreduce(seconds, op=MPI.MAX),
              "norm": float(np.linalg.norm(gradient)), "every": every}
    if rank == 0:
        print(MARK + json.dumps(result), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--points", type=int, default=64)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 100_000],
                        help="state sizes of the per-step table")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--first-scan", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--first-python", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--sections", nargs="+", default=["step", "first"],
                        choices=["step", "first", "memory"])
    parser.add_argument("--memory", action="store_true", help="the memory table too")
    parser.add_argument("--memory-ranks", type=int, default=2)
    parser.add_argument("--memory-steps", type=int, default=10_000)
    parser.add_argument("--memory-size", type=int, default=100_000)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", default=None)
    parser.add_argument("--kind", default="scan")
    args = parser.parse_args(argv)
    if args.worker:
        return {"step": step_worker, "first": first_worker,
                "memory": memory_worker}[args.worker](args)
    failed = False

    def run(section, ranks, *options):
        nonlocal failed
        result, report = launch(section, ranks, args, script=HERE, options=[
            "--steps", str(args.steps), "--repeat", str(args.repeat),
            "--memory-steps", str(args.memory_steps), "--memory-size",
            str(args.memory_size), *options])
        if report:
            print(report, file=sys.stderr)
            failed = True
        return result

    sections = set(args.sections) | ({"memory"} if args.memory else set())
    rows = []
    for ranks, points in ((r, p) for p in args.sizes for r in args.ranks
                          if "step" in sections):
        r = run("step", ranks, "--points", str(points))
        if r is None:
            continue
        for entry in ("run", "totals"):
            floor = r[f"hand {entry}"] + r["dispatch"] / args.steps
            rows.append([str(ranks), str(points), entry, fmt(r[f"scan {entry}"], "us"),
                         fmt(r[f"python {entry}"], "us"), fmt(r[f"hand {entry}"], "us"),
                         fmt(r["dispatch"], "us"),
                         fmt(ratio(r[f"scan {entry}"], r[f"python {entry}"]), "x"),
                         fmt(ratio(r[f"scan {entry}"], floor), "x"),
                         fmt(ratio(r[f"python {entry}"], floor), "x"), fmt(r["err"], "e")])
    if rows:
        print_table(f"{args.steps} steps of u = op(u) + 0.01 (one Allreduce of the state each "
                    f"way): per step (us), max over ranks of the median of {args.repeat} "
                    "interleaved calls; floor = hand + dispatch / steps",
                    ["ranks", "points", "entry", "scan", "python", "hand", "dispatch (1 call)",
                     "scan/python", "scan/floor", "python/floor", "err"], rows)
    rows = []
    for kind, counts in (("scan", args.first_scan), ("python", args.first_python)):
        for n in counts if "first" in sections else ():
            r = run("first", 1, "--kind", kind, "--steps", str(n))
            if r is not None:
                rows.append([kind, str(n), fmt(r["run"], "s"), fmt(r["totals"], "s"),
                             fmt(r["run"] / n, "ms"), fmt(r["totals"] / n, "ms")])
    if rows:
        print_table("first calls on 1 rank (s): creating the Problem and its first run; the "
                    "first compute_totals; and each per step (ms)",
                    ["model", "steps", "run", "compute_totals", "run/step", "totals/step"], rows)
    if "memory" in sections:
        rows, found = [], {}
        for kind in ("store", "checkpoint"):
            r = run("memory", args.memory_ranks, "--kind", kind)
            if r is not None:
                found[kind] = r
        for kind, r in found.items():
            store = found.get("store")
            rows.append([kind, str(r["every"]) if kind == "checkpoint" else "-",
                         f"{r['peak']:.0f}", fmt(r["seconds"], "s"),
                         fmt(ratio(r["seconds"], store["seconds"]) if store else None, "x"),
                         fmt(abs(r["norm"] - store["norm"]) / store["norm"] if store
                             else None, "e")])
        print_table(f"compute_totals over {args.memory_steps} steps of a "
                    f"{args.memory_size}-point distributed state on {args.memory_ranks} "
                    "ranks: peak memory added (MiB, max over ranks), time (s)",
                    ["adjoint", "every", "peak MiB", "time", "time/store",
                     "grad diff"], rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
