"""Shared test operators and the MPI launcher used by the tests."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
from mpi4py import MPI

import distop

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"


# -- operators ------------------------------------------------------------------------
class RankSum(distop.DistributedOperator):
    """s = sum over ranks of x_r (x rank-local, s replicated); its VJP hands every rank
    the full output cotangent."""

    forward_collectives = ("Allreduce",)
    batched_vjp = True

    def forward(self, comm, x):
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, s_bar, x):
        return s_bar.copy()


class ScaledSum(distop.DistributedOperator):
    """Two inputs, two outputs: (sum_r c_r * a, sum_r c_r * b * t) with a 0-d t, where
    c_r = rank + 1 is this rank's weight. Replicated in, replicated out."""

    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)

    def output_spec(self, a, b, t):
        return a, b

    def _weights(self, comm):
        return float(comm.Get_size() * (comm.Get_size() + 1) // 2)

    def forward(self, comm, a, b, t):
        assert t.ndim == 0 and a.flags.c_contiguous and b.flags.c_contiguous
        c = np.array(comm.Get_rank() + 1.0)
        total = np.empty(())
        comm.Allreduce(c, total, op=MPI.SUM)
        return total * a, total * b * t

    def vjp(self, comm, cts, a, b, t):
        a_bar, b_bar = cts
        c = np.array(comm.Get_rank() + 1.0)
        total = np.empty(())
        comm.Allreduce(c, total, op=MPI.SUM)
        return total * a_bar, total * b_bar * t, np.array(total * np.sum(b_bar * b))


class Cube(distop.DistributedOperator):
    """A purely local operator: y = x**3 (no collectives)."""

    def forward(self, comm, x):
        return x ** 3

    def vjp(self, comm, y_bar, x):
        return 3 * x ** 2 * y_bar


class RowScale(distop.DistributedOperator):
    """y = c * x with a batched vjp that records `(c, rows it was given)` in `seen` and
    sums its whole batch over the ranks (one Allreduce: ranks passing different rows
    to it fail)."""

    c: float
    seen: list
    forward_collectives = vjp_collectives = ("Allreduce",)
    batched_vjp = True

    def __init__(self, c, seen=None):
        self.c, self.seen, self.comm, self.ordered = c, [] if seen is None else seen, None, True

    def forward(self, comm, x):
        return self.c * x

    def vjp(self, comm, y_bar, x):
        self.seen.append((self.c, y_bar.shape[0]))
        total = np.empty_like(y_bar)
        comm.Allreduce(np.ascontiguousarray(y_bar), total, op=MPI.SUM)
        return self.c * total / comm.Get_size()  # (replicated cotangents: c * y_bar)


def totals_jaxpr(problem):
    """**Returns:** the jaxpr of `problem`'s default `compute_totals` program (after
    distop's rewrites), and the host calls in it (fused calls' members), in order."""
    program = next(p for k, p in problem._programs.programs.items() if k[0] == "compute_totals")
    layout = next(iter(problem._programs.layouts.values()))
    seeds = distop._layout.seeds(problem.output_names, layout, problem.comm.Get_rank(), True)
    point = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in problem._point.items()}
    jaxpr = program.fn.trace(jax.ShapeDtypeStruct((), np.float64), point, *seeds).jaxpr
    calls = [m for e in jaxpr.eqns if "call" in e.params
             for m in getattr(e.params["call"], "members", [e.params["call"]])]
    return jaxpr, calls


def without_loops(make):
    """**Returns:** what `make()` gives with distop's loops turned off (see
    `distop._passes.loops.rolled`): the program's calls one by one."""
    from distop._passes import loops

    repeats, loops.REPEATS = loops.REPEATS, 10 ** 9
    try:
        return make()
    finally:
        loops.REPEATS = repeats


def loops_since(before):
    """**Returns:** the `RolledCall`s of the lean call sites registered since `before`
    (a set of call ids: `set(distop._ffi._calls)`)."""
    from distop import _ffi
    from distop._calls.rolled import RolledCall

    return [c for k, c in _ffi._calls.items()
            if k not in before and isinstance(c, RolledCall)]


# -- launching MPI jobs ---------------------------------------------------------------
def mpiexec():
    """**Returns:** the `mpiexec` beside this Python (the mpich wheel's), else on PATH."""
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: pip install 'distop[mpich]'")
    return found


def launcher():
    """**Returns:** (the mpiexec command, the environment it needs) for the MPI library
    mpi4py loaded here: Open MPI's refuses more ranks than cores and, as root, any job,
    unless told otherwise."""
    if "open mpi" not in MPI.Get_library_version().lower():
        return [mpiexec()], {}
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if (
        os.geteuid() == 0) else {}
    return [mpiexec(), "--oversubscribe"], env


def load_factor():
    """**Returns:** how many times longer than on an idle machine a job may take here:
    the load per core, at least 1 and at most 4. Time limits scale with it, so a busy
    machine does not fail a slow case, and a hang still ends."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(4.0, max(1.0, load))


def run_mpi(nprocs, script, *args, timeout=120, expect_ok=True, env=None):
    """Run `script` under `mpiexec -n nprocs` with a watchdog.

    mpi-pytest launches one job per test, and every launch pays seconds of JAX start-up
    on each rank; this launcher runs a script that groups many cases per launch instead.
    A hung job is killed (its whole process group) after `timeout` seconds and the test
    fails with what every rank printed.

    **Arguments:**
    - `nprocs`: number of ranks.
    - `script`: path of the Python script.
    - `args`: its command-line arguments.
    - `timeout`: the watchdog, in seconds.
    - `expect_ok`: if True, assert exit code 0 and that every rank printed its
      `rank R of N: ok` line (so every rank's own exit is checked, not only mpiexec's).
    - `env`: extra environment variables.

    **Returns:** `(returncode, output)` with stdout and stderr merged.
    """
    command, launch_env = launcher()
    cmd = [*command, "-n", str(nprocs), sys.executable, str(script), *map(str, args)]
    environment = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join([str(TESTS), str(EXAMPLES), str(ROOT)]),
                       **launch_env)
    environment.update(env or {})
    timeout *= load_factor()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            text=True, env=environment, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"watchdog: {' '.join(cmd)} still running after {timeout} s; "
                             f"killed. Output of every rank:\n{output}") from None
    if expect_ok:
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{output}"
        for r in range(nprocs):
            assert f"rank {r} of {nprocs}: ok" in output, (
                f"rank {r} did not report success:\n{output}")
    return proc.returncode, output


# seconds: a case still running then has hung (each takes a few seconds on an idle
# machine); scaled by the machine's load when the case starts, unless set
CASE_LIMIT = float(os.environ.get("DISTOP_TEST_CASE_LIMIT", 100))
_SCALED = "DISTOP_TEST_CASE_LIMIT" not in os.environ


def run_cases(cases, comm=None):
    """Run `cases` (functions) in order on every rank, then print the success line. Any
    failure prints the traceback and aborts the job, so no rank waits forever; so does a
    case still running after `CASE_LIMIT` seconds, with where every rank stands."""
    import traceback

    comm = MPI.COMM_WORLD if comm is None else comm
    name = "?"
    try:
        for fn in cases:
            name = fn.__name__
            limit = CASE_LIMIT * (load_factor() if _SCALED else 1.0)
            timer = threading.Timer(limit, _hung, (comm, name, limit))
            timer.daemon = True
            timer.start()
            try:
                fn()
                comm.Barrier()
            finally:
                timer.cancel()
    except BaseException:
        print(f"rank {comm.rank} of {comm.size}: FAILED in {name}\n"
              + traceback.format_exc(), flush=True)
        comm.Abort(1)
    finish(comm)


def _hung(comm, name, limit):
    """A case's watchdog: print where this rank stands (every thread's stack), give the
    other ranks' watchdogs a moment to print theirs, and abort the job."""
    import faulthandler

    print(f"rank {comm.rank} of {comm.size}: {name} still running after {limit:g} s "
          "(hung); where this rank stands:", flush=True)
    faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
    sys.stdout.flush()
    time.sleep(3)
    comm.Abort(1)


def finish(comm=None):
    """Print this rank's success line (checked by `run_mpi`)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    print(f"rank {comm.rank} of {comm.size}: ok", flush=True)


def all_close_everywhere(comm, a, b, rtol=1e-12, atol=0.0):
    """Assert on every rank that `a` and `b` agree; **Returns:** the max relative error."""
    a, b = np.asarray(a), np.asarray(b)
    err = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300), initial=0.0))
    ok = np.allclose(a, b, rtol=rtol, atol=atol)
    assert ok, f"rank {comm.rank}: max relative error {err:.1e}"
    return err
