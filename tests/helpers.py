"""Shared test operators and the MPI launcher used by the tests."""

import hashlib
import importlib.util
import inspect
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
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


class NormScale(distop.DistributedOperator):
    """y = x * s with s = the sum of x**2 over the global vector (each rank holding a
    block of rows; one Allreduce per method): a nonlinear operator with every method,
    `hvp` batched. `seen` records each hvp call's (cotangent shape, tangent shape)."""

    forward_collectives = vjp_collectives = jvp_collectives = hvp_collectives = (
        "Allreduce",)
    batched_vjp = batched_jvp = batched_hvp = True
    seen: list = None

    def _sums(self, comm, *pairs):
        """**Returns:** per pair (a, b) of this rank's arrays (a batch axis first where
        a has one), the sum over the global vector of a * b, from one Allreduce."""
        local = np.stack([np.sum(a * b, axis=-1) for a, b in pairs])
        total = np.empty_like(local)
        comm.Allreduce(np.ascontiguousarray(local), total, op=MPI.SUM)
        return [t[..., None] for t in total]

    def forward(self, comm, x):
        (s,) = self._sums(comm, (x, x))
        return x * s

    def vjp(self, comm, y_bar, x):
        s, c = self._sums(comm, (x, x), (y_bar, x))
        return y_bar * s + 2 * x * c

    def jvp(self, comm, t, x):
        s, d = self._sums(comm, (x, x), (x, t))
        return t * s + 2 * x * d

    def hvp(self, comm, y_bar, t, x):
        if self.seen is not None:
            self.seen.append((y_bar.shape, t.shape))
        c, d, e = self._sums(comm, (y_bar, x), (x, t), (y_bar, t))
        return 2 * y_bar * d + 2 * t * c + 2 * x * e


def norm_scale(x):
    """`NormScale`'s forward on the whole global vector, in JAX."""
    return x * jnp.sum(x ** 2)


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


# -- what the MPI tests share (tests/mpi, tests/mpi_failures.py) ---------------------
# Blocks are uneven, and rank 1 owns none from 2 ranks on; on one rank, one block of 4.
size = MPI.COMM_WORLD.size
BLOCKS = [(3, 0, 2, 1)[r % 4] for r in range(size)] if size > 1 else [4]
STARTS = [sum(BLOCKS[:r]) for r in range(size)]
ROWS = sum(BLOCKS)


def smooth(v):
    """A nonlinear map, increasing on [-2, 2]: keeps ties and zeros of its input."""
    return jnp.sin(v) + 0.5 * v


def own(p, r, length, offset=0):
    """Rank r's rank-local part of p: `length` entries after `offset`, through `smooth`."""
    return smooth(p[offset + r * length:offset + (r + 1) * length])


def block(p, r, offset=0, width=1):
    """Rank r's block of a distributed (ROWS, width) array stored in p after `offset`."""
    rows = p[offset + STARTS[r] * width:offset + (STARTS[r] + BLOCKS[r]) * width]
    return smooth(rows).reshape(BLOCKS[r], width)


def even_rows(total):
    """**Returns:** the rows per rank of `total` split as evenly as possible."""
    return distop.Split().rows(size, total)


class Stencil(distop.DistributedOperator):
    """y_i = x_(i-1) + x_i + x_(i+1) over the global vector (zero beyond its ends), each
    rank holding a block of rows: a halo exchange of one row with each neighbour
    (Sendrecv). The stencil is symmetric, so its VJP is itself."""

    forward_collectives = ("Sendrecv",)
    vjp_collectives = ("Sendrecv",)

    def forward(self, comm, x):
        r, p = comm.Get_rank(), comm.Get_size()
        left, right = (r - 1 if r > 0 else MPI.PROC_NULL), (r + 1 if r < p - 1 else MPI.PROC_NULL)
        from_left, from_right = np.zeros(1), np.zeros(1)
        comm.Sendrecv(x[-1:].copy(), dest=right, recvbuf=from_left, source=left)
        comm.Sendrecv(x[:1].copy(), dest=left, recvbuf=from_right, source=right)
        padded = np.concatenate([from_left, x, from_right])
        return padded[:-2] + padded[1:-1] + padded[2:]

    def vjp(self, comm, y_bar, x):
        return self.forward(comm, y_bar)


class Coupled(distop.ImplicitOperator):
    """y with R(y, b, k) = k y + sum(y) - b = 0 over the global vector (the matrix
    k I + 1 1^T, coupling every rank), solved in closed form with one Allreduce; its
    adjoint is the same solve (the matrix is symmetric), batched over the seeds."""

    solve_collectives = adjoint_collectives = residual_collectives = ("Allreduce",)
    batched_adjoint = True
    fail: str = ""  # the method that fails on the last rank, for tests/mpi_failures.py

    def _solve(self, comm, rhs, k):
        """(k I + 1 1^T)^-1 rhs, rows of a batch at once."""
        sums = np.array([rhs.sum(axis=-1), np.full(rhs.shape[:-1], rhs.shape[-1], float)])
        total = np.empty_like(sums)
        comm.Allreduce(sums, total, op=MPI.SUM)
        s = total[0] / (k + total[1])
        return (rhs - s[..., None]) / k

    def solve(self, comm, b, k):
        _maybe_fail(self, comm, "solve")
        return self._solve(comm, b, k)

    def solve_adjoint(self, comm, y_bar, y, b, k):
        _maybe_fail(self, comm, "solve_adjoint")
        return self._solve(comm, y_bar, k)

    def residual_vjp(self, comm, lam, y, b, k):
        k_bar = np.empty(lam.shape[0])
        comm.Allreduce(np.ascontiguousarray(lam @ y), k_bar, op=MPI.SUM)
        if self.fail == "residual_vjp" and comm.Get_rank() == comm.Get_size() - 1:
            return -lam[:, :-1], k_bar
        return -lam, k_bar


class CubicSolve(distop.ImplicitOperator):
    """y with R(y, x, a) = d y + v (v . y) + a y**3 - x = 0 over the global vector (d and
    v this rank's blocks of two global vectors, d > 0; x distributed, a a replicated
    scalar): a nonlinear residual coupling every rank through v . y, solved by Newton's
    method, each step exact by Sherman-Morrison with one Allreduce. dR/dy = diag(d + 3 a
    y**2) + v v^T is symmetric, so the adjoint and linear solves are the same; the
    adjoint methods and `residual_hvp` are batched over the seeds. `hvp_error` plants
    that error in residual_hvp on rank 0 (for the checks)."""

    d: np.ndarray
    v: np.ndarray
    hvp_error: float = 0.0
    solve_collectives = adjoint_collectives = residual_collectives = ("Allreduce",)
    batched_adjoint = True

    def _jacobian_solve(self, comm, rhs, y, a):
        """(diag(d + 3 a y**2) + v v^T)^-1 rhs (rows of a batch at once), one Allreduce."""
        diagonal = self.d + 3 * a * y ** 2
        scaled, w = rhs / diagonal, self.v / diagonal
        local = np.append(np.atleast_1d(scaled @ self.v), self.v @ w)
        total = np.empty_like(local)
        comm.Allreduce(local, total, op=MPI.SUM)
        along = total[:-1] / (1 + total[-1])
        return scaled - (along[:, None] * w if rhs.ndim > 1 else along[0] * w)

    def solve(self, comm, x, a):
        y = x / self.d
        for _ in range(50):  # (every rank alike: the step's size is summed over them)
            coupling = np.empty(())
            comm.Allreduce(np.asarray(self.v @ y), coupling, op=MPI.SUM)
            step = self._jacobian_solve(comm, self.d * y + self.v * coupling + a * y ** 3 - x,
                                        y, a)
            y = y - step
            size = np.empty(())
            comm.Allreduce(np.asarray(np.sum(step ** 2)), size, op=MPI.SUM)
            if size < 1e-32:
                break
        return y

    def solve_adjoint(self, comm, y_bar, y, x, a):
        return self._jacobian_solve(comm, y_bar, y, a)

    def solve_linear(self, comm, rhs, y, x, a):
        return self._jacobian_solve(comm, rhs, y, a)

    def residual_vjp(self, comm, lam, y, x, a):
        # dR/dx = -I; dR/da = y**3, whose pairing with lam sums over every rank's rows
        a_bar = np.empty(lam.shape[0])
        comm.Allreduce(np.ascontiguousarray(lam @ y ** 3), a_bar, op=MPI.SUM)
        return -lam, a_bar

    def residual_jvp(self, comm, tangents, y, x, a):
        tx, ta = tangents
        return -tx + ta * y ** 3

    def residual_hvp(self, comm, lam, tangent, y, x, a):
        # L = lam . R: L_yy = diag(6 a y lam), L_ya = 3 y**2 lam, the rest zero
        ty, tx, ta = tangent
        h_a = np.empty(lam.shape[0])
        comm.Allreduce(np.ascontiguousarray(np.sum(3 * y ** 2 * lam * ty, axis=-1)), h_a,
                       op=MPI.SUM)
        h_y = 6 * a * y * lam * ty + 3 * y ** 2 * lam * ta[:, None]
        if self.hvp_error and comm.Get_rank() == 0:
            h_y = h_y + self.hvp_error * ty
        return h_y, np.zeros_like(tx), h_a


def cubic_solution(x, a, d, v, iterations=12):
    """`CubicSolve`'s y on the whole global vector, in JAX: Newton's method unrolled
    (its derivatives of every order those of the solution, to round-off)."""
    y = x / d
    for _ in range(iterations):
        residual = d * y + v * (v @ y) + a * y ** 3 - x
        y = y - jnp.linalg.solve(jnp.diag(d + 3 * a * y ** 2) + jnp.outer(v, v), residual)
    return y


def _maybe_fail(op, comm, method):
    if op.fail == method and comm.Get_rank() == comm.Get_size() - 1:
        raise RuntimeError(f"{method} did not converge in 50 iterations")


def totals_jaxpr(problem):
    """**Returns:** the jaxpr of `problem`'s default `compute_totals` program (after
    distop's rewrites), and the host calls in it (fused calls' members), in order."""
    program = next(p for k, p in problem._programs.programs.items() if k[0] == "compute_totals")
    layout = next(iter(problem._programs.layouts.values()))
    seeds = distop._compiler.layout.seeds(problem.output_names, layout,
                                          problem.comm.Get_rank(), True)
    point = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in problem._point.items()}
    jaxpr = program.fn.trace(jax.ShapeDtypeStruct((), np.float64), point, *seeds).jaxpr
    calls = [m for e in jaxpr.eqns if "call" in e.params
             for m in getattr(e.params["call"], "members", [e.params["call"]])]
    return jaxpr, calls


def without_loops(make):
    """**Returns:** what `make()` gives with distop's loops turned off (see
    `distop._compiler.stages.loops.rolled`): the program's calls one by one."""
    from distop._compiler.stages import loops

    repeats, loops.REPEATS = loops.REPEATS, 10 ** 9
    try:
        return make()
    finally:
        loops.REPEATS = repeats


def loops_since(before):
    """**Returns:** the `RolledCall`s of the lean call sites registered since `before`
    (a set of call ids: `set(distop._hostcalls.ffi._sites)`)."""
    from distop._hostcalls import ffi as _ffi
    from distop._hostcalls.rolled import RolledCall

    return [c for k, c in _ffi._sites.items()
            if k not in before and isinstance(c, RolledCall)]


def mpi_tests(name):
    """**Returns:** the tests of `tests/mpi/<name>.py`, in file order, as parameters of a
    test that runs them in one process (each named without its `test_`)."""
    import pytest

    spec = importlib.util.spec_from_file_location(f"mpi_{name}", TESTS / "mpi" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [pytest.param(f, id=n[len("test_"):]) for n, f in vars(module).items()
            if n.startswith("test_") and callable(f)]


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
    unless told otherwise. Ranks of either library spin while they wait for a message,
    taking the cores from the rank that computes when there are more processes than
    cores (other tests' included); told to yield, a waiting rank leaves them to it.
    Open MPI yields by itself only where its launcher finds more ranks than cores."""
    if "open mpi" not in MPI.Get_library_version().lower():
        return [mpiexec()], {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if (
        os.geteuid() == 0) else {}
    return [mpiexec(), "--oversubscribe"], {**env, "OMPI_MCA_mpi_yield_when_idle": "1"}


def cores():
    """**Returns:** how many cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def load_factor():
    """**Returns:** how many times longer than on an idle machine a job may take here:
    the load per core, at least 1 and at most 4. Time limits scale with it, so a busy
    machine does not fail a slow case, and a hang still ends."""
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(4.0, max(1.0, load))


# a folder shared by the processes of one run (see `share_compilations`); tests/conftest.py
# makes one for each run of the suite unless it is set already, and empty turns it off
COMPILATIONS = "DISTOP_TEST_COMPILATIONS"


# elements: a larger constant is left out of the text that names a program's lock
LOCK_ELEMENTS = 64


def share_compilations():
    """Let the processes of one run compile each JAX program once, where the run has a
    folder for it (`COMPILATIONS`): the ranks of a launch trace the same programs, and
    compiling them is most of a launch's time.

    JAX's persistent compilation cache lives in that folder. A process about to compile
    takes a lock named after the program's text, so the first compiles and writes while
    the others wait, then load what it wrote. Programs that differ only in the values
    of a large constant take turns under one lock; JAX's own key tells them apart.
    A program with host callbacks (the `io_callback` backend's) holds pointers into its
    process, so JAX never keeps it: each process compiles it at once, without the lock.
    Another program the cache does not keep (JAX decides) is compiled by each process
    in turn. Where this JAX has no hook for it (its compiler's `compile_or_get_cached`),
    every process compiles for itself. A second call changes nothing (a second lock on
    the same file would wait for the first)."""
    folder = os.environ.get(COMPILATIONS)
    if not folder:
        return
    try:
        import fcntl

        from jax._src import compiler
        compile_or_load = compiler.compile_or_get_cached
    except (ImportError, AttributeError):
        return
    if getattr(compile_or_load, "shares", False):
        return

    signature = inspect.signature(compile_or_load)

    def once(backend, computation, *args, **kwargs):
        given = signature.bind(backend, computation, *args, **kwargs).arguments
        if given.get("host_callbacks"):
            return compile_or_load(backend, computation, *args, **kwargs)
        # (constants of more than `LOCK_ELEMENTS` elements print elided: a program
        # closing over a large array is not printed and hashed with all its values again)
        text = computation.operation.get_asm(enable_debug_info=False,
                                             large_elements_limit=LOCK_ELEMENTS)
        name = hashlib.sha256(text.encode()).hexdigest()
        with open(os.path.join(folder, f"{name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # (closing the file lets it go)
            return compile_or_load(backend, computation, *args, **kwargs)

    once.shares = True
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compiler.compile_or_get_cached = once


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
    if os.environ.get("DISTOP_TEST_LAUNCH_LOG"):  # (to count the launches of a run)
        with open(os.environ["DISTOP_TEST_LAUNCH_LOG"], "a") as log:
            log.write(" ".join(cmd[1:]) + "\n")
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


def once_per_run(folder, name, make):
    """**Returns:** the text `make()` returned the one time it ran in this test run.

    The first process to ask (any xdist worker of the run) calls `make` holding a file
    lock in `folder`, a folder every worker of the run shares, and writes what it got
    there; the others wait for the lock, then read it. Where `make` raised an
    AssertionError (a failed launch), every caller raises one with its text."""
    import fcntl
    import json

    record = pathlib.Path(folder) / f"{name}.json"
    with open(pathlib.Path(folder) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (closing the file lets it go)
        if not record.exists():
            try:
                found = {"out": make(), "failed": False}
            except AssertionError as failed:  # (every caller fails, as it did)
                found = {"out": str(failed), "failed": True}
            record.write_text(json.dumps(found))
    made = json.loads(record.read_text())
    if made["failed"]:
        raise AssertionError(made["out"])
    return made["out"]


MPI_TESTS = TESTS / "mpi"
# the files of tests/mpi that were one group before: what the io_callback backend and the
# checking mode are run on
CORE = ("test_order.py", "test_agreement.py", "test_programs.py")
# seconds: a whole launch of tests/mpi, before the load factor (pytest's own limit is
# above the most that can make)
SUITE_TIMEOUT = 4000


def run_tests(nprocs, *args, timeout=900, expect_ok=True, env=None):
    """Run the tests of tests/mpi on every rank of one `mpiexec -n nprocs python -m
    pytest` (see tests/mpi/conftest.py), through `run_mpi`.

    **Arguments:**
    - `nprocs`: number of ranks.
    - `args`: files of tests/mpi (all of them if none) and pytest options.
    - `timeout`, `expect_ok`: as `run_mpi`'s; every rank's `ok` line is its pytest's
      exit status 0.
    - `env`: extra environment variables. A launch with none keeps what failed for
      `--lf` in `.pytest_cache/mpi-<nprocs>`; the others keep nothing.

    **Returns:** `(returncode, output)` of the launch.
    """
    files = [str(MPI_TESTS / a) for a in args if a.endswith(".py")] or [str(MPI_TESTS)]
    options = [a for a in args if not a.endswith(".py")]
    cache = ["-p", "no:cacheprovider"] if env else ["-o", f"cache_dir=.pytest_cache/mpi-{nprocs}"]
    # (-v: rank 0 names each test as it starts, so a launch that aborts names its test)
    return run_mpi(nprocs, "-m", "pytest", "-v", *files, *cache, *options, timeout=timeout,
                   expect_ok=expect_ok, env=env)


# seconds: a case still running then has hung (each takes a few seconds on an idle
# machine); scaled by the machine's load when the case starts, unless set
CASE_LIMIT = float(os.environ.get("DISTOP_TEST_CASE_LIMIT", 100))
SCALED = "DISTOP_TEST_CASE_LIMIT" not in os.environ


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
            limit = CASE_LIMIT * (load_factor() if SCALED else 1.0)
            timer = threading.Timer(limit, hung, (comm, name, limit))
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


def hung(comm, name, limit):
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
