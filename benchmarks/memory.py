"""python benchmarks/memory.py --ranks 2

Peak memory of the large matvec scenario (M = 1e6 doubles, sparse blocks, K objectives):
the growth of each rank's peak RSS over its baseline after imports (so the data every
variant builds, the same for all, counts too), for `run` and then `compute_totals`,
distop against the hand-written numpy + mpi4py script. Every variant builds the same
data: x and W made by `distop.empty` (arrays XLA can read in place), and A's transpose
(the operator makes it in its constructor; the script, at setup too). `distop`: by
default, distop keeps one private copy of each numpy input (the caller may change its
arrays afterwards); `shared`: `Problem(..., copy=None)`, which reads them in place.
distop also pays XLA's start-up (about 45 MiB, plus a few per program). Each variant
runs in its own `mpiexec` job (peak RSS only grows), and the table shows the max over
ranks. `setup`: the growth once the data is made (and, for distop, the Problem created:
its copies of the inputs made, its programs traced), before any call; `run`,
`compute_totals`: after the calls of each. Options: --ranks P (default 2), --size M
(default 1000000), --objectives K (default 16), --calls N (default 3).
"""

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve()


def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(variant, size, objectives, calls):
    import jax
    import numpy as np
    import scipy.sparse as sp
    from mpi4py import MPI

    sys.path.insert(0, str(HERE.parent.parent / "examples"))
    import distributed_matvec as dm
    from matvec import hand_written, transpose

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    base = peak_mib()  # after imports: the data each variant builds counts as growth
    a_local = sp.random(size, size, density=4.0 / size, format="csr",
                        random_state=np.random.default_rng(comm.rank))
    x0 = distop.empty(size)
    np.sin(0.37 * np.arange(size), out=x0)
    x0 += 0.1
    w = distop.empty((objectives, size))
    np.random.default_rng(7).standard_normal((objectives, size), out=w)
    growth = {}
    if variant == "hand":
        transpose(a_local)
        growth["setup"] = peak_mib() - base
        for _ in range(calls):
            hand_written(a_local, w, x0, gradients=False)
        growth["run"] = peak_mib() - base
        for _ in range(calls):
            hand_written(a_local, w, x0)
        growth["compute_totals"] = peak_mib() - base
    else:
        op = dm.DistributedMatvec(a_local)
        # W is an input, not a constant the program would embed (a copy per program).
        problem = distop.Problem(lambda x, w: {"f": w @ op(x)}, {"x": x0, "w": w},
                                 backend="io_callback" if variant == "io_callback" else "lean",
                                 copy=None if variant == "shared" else True)
        growth["setup"] = peak_mib() - base
        for _ in range(calls):
            problem.run()
        growth["run"] = peak_mib() - base
        for _ in range(calls):
            problem.compute_totals("f", "x")
        growth["compute_totals"] = peak_mib() - base
    every = comm.gather(growth)
    if comm.rank == 0:
        print(json.dumps({k: max(g[k] for g in every) for k in growth}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--objectives", type=int, default=16)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--variant")
    args = parser.parse_args()
    if args.variant:
        return worker(args.variant, args.size, args.objectives, args.calls)
    mpiexec = pathlib.Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    results = {}
    for variant in ("hand", "distop", "shared", "io_callback"):
        out = subprocess.run([str(mpiexec if mpiexec.exists() else "mpiexec"), "-n",
                              str(args.ranks), sys.executable, str(HERE), "--variant",
                              variant, "--size", str(args.size), "--objectives",
                              str(args.objectives), "--calls", str(args.calls)],
                             capture_output=True, text=True, env=env, check=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"# peak RSS growth per rank over the post-import baseline (MiB, max over "
          f"{args.ranks} ranks), M={args.size}, K={args.objectives}, {args.calls} calls each")
    names = {"hand": "hand", "distop": "distop", "shared": "shared", "io_callback": "io_cb"}
    print(f"{'entry':<16}" + "".join(f"{n:>10}" for n in names.values())
          + "".join(f"{n + '/hand':>12}" for n in list(names.values())[1:]))
    for entry in ("setup", "run", "compute_totals"):
        r = {v: results[v][entry] for v in results}
        print(f"{entry:<16}" + "".join(f"{r[v]:>10.1f}" for v in names)
              + "".join(f"{r[v] / r['hand']:>12.2f}" for v in list(names)[1:]))


if __name__ == "__main__":
    main()
