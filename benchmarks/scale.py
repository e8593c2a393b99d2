"""python benchmarks/scale.py [--ranks 1 2 4 8] [--alpha 2e-6] [--beta 1e-10] [--json PATH]

distop's own MPI traffic per call against its operators', counted at a few rank counts
and projected to many.

The driver launches one `mpiexec -n P` job per rank count (this script with `--worker`,
the mpiexec beside this Python if there is one, else the one on PATH; 8 ranks
oversubscribe a small machine: counts, not times, are what it reports). Each job builds
two Problems on a counting communicator (benchmarks/mpi_counts.py) and counts the MPI
calls of the main thread, and the bytes each rank receives, per entry point:
`Problem(...)`, the first `run`, a steady-state `run` (the third call), the first and a
steady-state `compute_totals` (`return_format="local"`: each rank's own columns of a
distributed input), a steady-state `compute_totals` in the global format (which gathers
a distributed input's columns from every rank: the result itself grows with P), and one
`check_totals`. A call is the operator's where an operator's method makes it, else
distop's own.

1. `matvec`: the README's example (y = (sum_r A_r) x, two objectives of y): one
   Allreduce per forward and per batched VJP.
2. `stencil`: a `HaloExchange` stencil, y = h[:-2] - 2 h[1:-1] + h[2:] of the halo h
   of a distributed x, ten steps in a row (8 rows per rank), and f = sum of y^2
   summed over the ranks.

The projection: a latency-bandwidth model, `--alpha` seconds per message step and
`--beta` seconds per byte, gives each call's cost at P ranks from what it moved at the
largest P measured. An Allreduce, Bcast, Reduce, Scan or Barrier of n bytes takes
ceil(log2 P) steps and 2n bytes; an Allgather (or Gather) ceil(log2 P) steps and the
bytes of every rank's part (its part stays, the total grows with P); an Alltoall P - 1
steps; a point-to-point message one step and its bytes. Printed: the modelled time of
distop's own calls and of the operators' per steady-state call at 1,024 and 16,384 ranks.
"""

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ENTRIES = ("Problem(...)", "first run", "run", "first compute_totals", "compute_totals",
           "compute_totals global", "check_totals")
LOG_STEPS = {"Allreduce", "allreduce", "Bcast", "bcast", "Reduce", "reduce", "Scan", "scan",
             "Exscan", "exscan", "Barrier", "barrier"}
GATHERS = {"Allgather", "allgather", "Allgatherv", "Gather", "gather", "Gatherv"}
ALL_TO_ALL = {"Alltoall", "alltoall", "Alltoallv", "Alltoallw"}


# -- the worker: one job ----------------------------------------------------------------
def worker() -> None:
    """Count every entry point of both scenarios; rank 0 prints one JSON line."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, str(HERE))
    import mpi_counts

    import distop

    jax.config.update("jax_enable_x64", True)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = mpi_counts.CountingComm(world)

    def matvec() -> tuple:
        op = mpi_counts.Matvec(np.random.default_rng(rank).standard_normal((3, 4)), comm=comm)
        w = jnp.array([1.0, -2.0, 0.5])

        def model(x):
            y = op(x)
            return {"f": jnp.dot(w, y), "g": jnp.sum(y ** 2)}
        return model, {"x": np.ones(4)}, (), ("f", "g"), ("x",)

    def stencil() -> tuple:
        halo = distop.HaloExchange(comm=comm)
        total = distop.AllreduceSum(comm=comm)

        def model(x):
            for _ in range(10):
                h = halo(x)
                x = h[:-2] - 2 * h[1:-1] + h[2:]
            return {"f": total(jnp.sum(x ** 2))}
        x0 = np.linspace(0.0, 1.0, 8 * size)[8 * rank:8 * rank + 8]
        return model, {"x": x0}, ("x",), ("f",), ("x",)

    found = {}
    for name, make in (("matvec", matvec), ("stencil", stencil)):
        model, inputs, distributed, of, wrt = make()
        steps = {}
        with mpi_counts.counting() as steps["Problem(...)"]:
            problem = distop.Problem(model, inputs, distributed=distributed, comm=comm)
        with mpi_counts.counting() as steps["first run"]:
            problem.run()
        problem.run()
        with mpi_counts.counting() as steps["run"]:
            problem.run()
        with mpi_counts.counting() as steps["first compute_totals"]:
            problem.compute_totals(of, wrt, return_format="local")
        problem.compute_totals(of, wrt, return_format="local")
        with mpi_counts.counting() as steps["compute_totals"]:
            problem.compute_totals(of, wrt, return_format="local")
        problem.compute_totals(of, wrt)
        with mpi_counts.counting() as steps["compute_totals global"]:
            problem.compute_totals(of, wrt)
        with mpi_counts.counting() as steps["check_totals"]:
            problem.check_totals(of, wrt, out_stream=None)
        mine = {entry: {whose: {"calls": tally.calls.get(whose, {}),
                                "received": tally.received.get(whose, 0)}
                        for whose in ("own", "operator")} | {"peers": sorted(tally.peers)}
                for entry, tally in steps.items()}
        found[name] = world.gather(mine)
    if rank == 0:
        print("RESULT " + json.dumps({"ranks": size, "scenarios": found}), flush=True)


# -- the driver -------------------------------------------------------------------------
def mpiexec() -> list[str]:
    """**Returns:** the mpiexec command for the MPI library mpi4py loads here."""
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise SystemExit("no mpiexec found: pip install 'distop[mpich]'")
    from mpi4py import MPI

    extra = ["--oversubscribe"] if "open mpi" in MPI.Get_library_version().lower() else []
    return [found, *extra]


def launch(ranks: int) -> dict:
    """Run one job of `ranks` ranks; **Returns:** what its rank 0 printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = subprocess.run([*mpiexec(), "-n", str(ranks), sys.executable, __file__,
                           "--worker"], capture_output=True, text=True, env=env,
                          timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"the job on {ranks} ranks failed ({done.returncode}):\n"
                     f"{done.stdout}\n{done.stderr}")


def per_rank(every: list[dict], entry: str, whose: str) -> tuple[int, int, bool]:
    """**Returns:** (calls, bytes received) of the rank that received most, and whether
    every rank made the same calls."""
    rows = [(sum(r[entry][whose]["calls"].values()), r[entry][whose]["received"],
             json.dumps(r[entry][whose]["calls"], sort_keys=True)) for r in every]
    worst = max(rows, key=lambda row: (row[1], row[0]))
    return worst[0], worst[1], len({row[2] for row in rows}) == 1


def modelled(calls: dict[str, int], received: int, measured: int, ranks: int,
             alpha: float, beta: float) -> float:
    """**Returns:** the modelled seconds of `calls` (method -> count), which received
    `received` bytes on `measured` ranks, at `ranks` ranks (see the module docstring)."""
    count = sum(calls.values()) or 1
    each = received / count  # bytes per call, spread evenly (the model's resolution)
    steps = max(1, math.ceil(math.log2(ranks)))
    total = 0.0
    for method, n in calls.items():
        if method in LOG_STEPS:
            total += n * (steps * alpha + 2 * each * beta)
        elif method in GATHERS:
            total += n * (steps * alpha + each / max(measured, 1) * ranks * beta)
        elif method in ALL_TO_ALL:
            total += n * ((ranks - 1) * alpha + each * beta)
        else:  # a point-to-point message
            total += n * (alpha + each * beta)
    return total


def main() -> None:
    """Parse the options, run the jobs, print the tables."""
    if "--worker" in sys.argv:
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--alpha", type=float, default=2e-6,
                        help="seconds per message step (default 2e-6)")
    parser.add_argument("--beta", type=float, default=1e-10,
                        help="seconds per byte (default 1e-10: 10 GB/s)")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args()
    results = {p: launch(p) for p in args.ranks}
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    for scenario in ("matvec", "stencil"):
        print(f"\n{scenario}: MPI calls / bytes received per rank (the rank receiving most)")
        print(f"{'entry point':22s} {'whose':9s}" + "".join(f"{'P=' + str(p):>16s}"
                                                           for p in args.ranks))
        for entry in ENTRIES:
            for whose in ("own", "operator"):
                cells = []
                for p in args.ranks:
                    calls, received, alike = per_rank(
                        results[p]["scenarios"][scenario], entry, whose)
                    cells.append(f"{calls:>5d} / {received:>7d}{'' if alike else '*'}")
                label = "distop" if whose == "own" else "operators"
                print(f"{entry:22s} {label:9s}" + "".join(f"{c:>16s}" for c in cells))
        if scenario == "stencil":
            most = {p: max(len(set(r["run"]["peers"]))
                           for r in results[p]["scenarios"][scenario]) for p in args.ranks}
            print("point-to-point peers of a steady run, per rank (at most):",
                  ", ".join(f"P={p}: {n}" for p, n in most.items()))
    largest = max(args.ranks)
    print(f"\nmodelled time per steady-state call (alpha={args.alpha:g} s, "
          f"beta={args.beta:g} s/byte), from the counts at P={largest}")
    targets = (1024, 16384)
    print(f"{'scenario':9s} {'entry point':16s} {'whose':9s}"
          + "".join(f"{'P=' + str(t):>14s}" for t in targets))
    for scenario in ("matvec", "stencil"):
        every = results[largest]["scenarios"][scenario]
        for entry in ("run", "compute_totals"):
            for whose in ("own", "operator"):
                worst = max(every, key=lambda r, e=entry, w=whose: r[e][w]["received"])
                calls, received = worst[entry][whose]["calls"], worst[entry][whose]["received"]
                cells = [modelled(calls, received, largest, t, args.alpha, args.beta) * 1e6
                         for t in targets]
                label = "distop" if whose == "own" else "operators"
                print(f"{scenario:9s} {entry:16s} {label:9s}"
                      + "".join(f"{c:>11.1f} us" for c in cells))
    print("\n* where ranks made different calls")


if __name__ == "__main__":
    main()
