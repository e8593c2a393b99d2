"""What profiling costs: `run()` per call with profiling off, on, and before it existed.

    OMP_NUM_THREADS=1 python benchmarks/profile_overhead.py [--baseline DIR] [--rounds 5]

One process. Two models of an operator on 8 doubles that does no communication
(ordered=True: the lean path): one host call (`1 call`) and 16 independent calls fused
into one host call (`16 calls`), and the host call of the first on its own, called
directly (`HostCall`: distop's work around the method, without JAX). Each worker
process times each per call (`run()` for the models), the median of many, with
profiling never enabled (`off`) and inside `problem.profile()` (`on`). With
`--baseline DIR` (a checkout of distop from before profiling, e.g.
`git archive <commit> distop | tar -x -C DIR`), workers importing that code time the
same calls (`before`), alternating with this checkout's workers, so the columns `off`
and `before` compare the same work side by side. `on - off` per method call is what
profiling costs per host call.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parent.parent


def worker(calls):
    """Time `run()` per call, off and (where this distop has it) on; print JSON."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import distop

    jax.config.update("jax_enable_x64", True)

    class Twice(distop.DistributedOperator):
        forward_collectives = ("Allreduce",)  # declared (not issued): ordered calls

        def forward(self, comm, x):
            return 2.0 * x

    x = np.linspace(0.0, 1.0, 8)
    ops = [Twice(ordered=True) for _ in range(16)]
    problems = {"1 call": distop.Problem(lambda x: {"y": ops[0](x)}, {"x": x}),
                "16 calls": distop.Problem(lambda x: {"y": jnp.stack([op(x) for op in ops])},
                                           {"x": x})}
    from distop._agreement import comm as _comm
    from distop._hostcalls.host import HostCall

    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    call = HostCall(ops[0], "forward", _comm.private(None), True, (spec,), (spec,))
    timed = {**{name: problem.run for name, problem in problems.items()},
             "HostCall": lambda: call(x)}
    out = {}
    for name, fn in timed.items():
        for _ in range(200):
            fn()
        out[name, "off"] = per_call(fn, calls)
        profile = getattr(problems["1 call"], "profile", None)
        if profile is not None:
            with profile():
                out[name, "on"] = per_call(fn, calls)
    print(json.dumps({f"{k[0]}|{k[1]}": v for k, v in out.items()}), flush=True)


def per_call(fn, calls):
    """**Returns:** the median over 5 batches of `calls // 5` calls of `fn`, in seconds
    per call."""
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        batches.append((time.perf_counter() - start) / (calls // 5))
    return statistics.median(batches)


def launch(path, calls):
    """**Returns:** the times a worker importing distop from `path` measured."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(path))
    proc = subprocess.run([sys.executable, str(HERE), "--worker", "--calls", str(calls)],
                          capture_output=True, text=True, env=env, timeout=600,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"worker with PYTHONPATH={path} failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(args, times, stat):
    """Print the table of `times` ((worker, model|mode) -> us), reduced over rounds by
    `stat`."""
    print(f"# one process, {args.rounds} worker rounds x {args.calls} calls each; "
          f"run() per call (us), {stat} of the rounds' medians")
    print(f"{'model':>10} {'before':>8} {'off':>8} {'off/before':>10} {'on':>8} "
          f"{'on - off':>8} {'per host call':>13}")
    for model, members in (("HostCall", 1), ("1 call", 1), ("16 calls", 16)):
        before = times.get(("before", f"{model}|off"))
        off, on = times[("this", f"{model}|off")], times[("this", f"{model}|on")]
        print(f"{model:>10} {f'{before:.2f}' if before else '-':>8} {off:8.2f} "
              f"{f'{off / before:.3f}' if before else '-':>10} {on:8.2f} {on - off:8.2f} "
              f"{(on - off) / members:13.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a checkout of distop before profiling")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.calls)
    found = {}
    for _ in range(args.rounds):  # alternating, so that the machine's load hits both
        for label, path in (("this", ROOT), ("before", args.baseline)):
            if path is None:
                continue
            for key, seconds in launch(path, args.calls).items():
                found.setdefault((label, key), []).append(seconds)
    for stat, name in ((statistics.median, "medians"), (min, "fastest rounds")):
        table(args, {k: stat(v) * 1e6 for k, v in found.items()}, name)
    return None


if __name__ == "__main__":
    main()
