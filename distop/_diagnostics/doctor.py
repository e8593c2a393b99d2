"""`python -m distop doctor`: what this job runs on, and what would slow it down.

Run alone or under `mpiexec -n P`. Every rank reports its MPI, launcher, cores, CPU
affinity and thread settings, and runs the same compute probe at once (how long a fixed
kernel takes, and how much of a core the rank really gets); rank 0 prints one screen,
every warning with its fix.
The exit status is 0 where nothing stands in the way, 1 where a warning stands.
"""

import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._compat import x64_enabled
from .._errors import MPIUnavailableError
from .._mpi import launch as _launch
from .._mpi import runtime as _runtime

# The settings that size the thread pools of the libraries under numpy and jax, in the
# order they win for OpenBLAS (which reads OMP_NUM_THREADS when its own is unset).
THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
# A barrier whose ranks leave it further apart than this (median) is worth a warning.
SKEW_LIMIT = 0.05
# A rank whose thread gets less than this share of a core while it computes alone is
# losing its core to other processes (or to the hypervisor: CPU steal).
CPU_SHARE_LIMIT = 0.8
# CPU steal (the hypervisor running another guest on this one's cores) worth a warning.
STEAL_LIMIT = 0.05
# The slowest rank of the compute probe, as a multiple of the median rank, worth a
# warning (identical work on every rank: the rest is the machine).
SPREAD_LIMIT = 1.3


class _Alone:
    """This process as its own world, where no MPI library can be loaded."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def allgather(self, value: Any) -> list[Any]:
        return [value]

    def bcast(self, value: Any, root: int = 0) -> Any:
        return value

    def Barrier(self) -> None:
        pass


def affinity() -> list[int]:
    """**Returns:** the cores this process may run on (all of them where the system
    cannot tell)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def threads(env: Mapping[str, str], cores: int) -> tuple[int, str]:
    """How many threads the BLAS and OpenMP pools of one rank start.

    **Arguments:**
    - `env`: the rank's environment.
    - `cores`: how many cores the rank may run on (those pools' default size).

    **Returns:** (the number, where it comes from).
    """
    for name in THREAD_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            try:
                return max(1, int(value.split(",")[0])), f"{name}={value}"
            except ValueError:
                continue
    return cores, f"unset: {'/'.join(v.split('_')[0] for v in THREAD_VARIABLES)} "\
        "default to one per core"


def compress(numbers: Sequence[int]) -> str:
    """**Returns:** `numbers` as ranges: `0-3,8,10-11`."""
    spans: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if spans and spans[-1][1] == n - 1:
            spans[-1] = (spans[-1][0], n)
        else:
            spans.append((n, n))
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def facts(env: Mapping[str, str]) -> dict[str, Any]:
    """**Returns:** this rank's facts: host, pid, cores it may use, thread settings, and
    the node's load average (the last minute's, before the probes add to it)."""
    cores = affinity()
    count, source = threads(env, len(cores))
    try:
        load = float(os.getloadavg()[0])
    except (AttributeError, OSError):
        load = -1.0  # (unknown)
    return {"host": socket.gethostname(), "pid": os.getpid(), "cores": cores,
            "cpu_count": os.cpu_count() or 1, "threads": count, "threads_from": source,
            "xla_flags": env.get("XLA_FLAGS", ""), "load": load}


def _cpu_ticks() -> tuple[int, int] | None:
    """**Returns:** (steal, all) ticks of the node's CPUs since boot (Linux's
    /proc/stat), or None where the system does not tell."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(v) for v in fields[1:9]]
    return ticks[7], sum(ticks)


def _numpy_kernel(x: np.ndarray) -> float:
    """The numpy probe: elementwise work, one thread (no BLAS), the same on every rank."""
    return float(np.sum(np.sin(x) * np.cos(x)))


def compute_probe(comm: Any, rounds: int = 100) -> dict[str, float]:
    """Time the same fixed kernels on every rank at once; collective.

    A numpy kernel (elementwise, one thread) and a jitted JAX kernel, each the median of
    `rounds`; over the numpy rounds, the CPU time this thread got against the wall time,
    and the node's CPU steal.

    **Arguments:**
    - `comm`: the communicator.
    - `rounds`: repetitions of each kernel.

    **Returns:** this rank's seconds: `numpy`, `jax` (median per kernel), `cpu_share`
    (CPU time / wall time, 1.0 when the thread had a core to itself) and `steal` (the
    share of the node's CPU time the hypervisor gave elsewhere; 0.0 where unknown).
    """
    import jax
    import jax.numpy as jnp

    x = np.linspace(0.0, 1.0, 1 << 16)
    kernel = jax.jit(lambda v: jnp.sum(jnp.sin(v) * jnp.cos(v)))
    xj = jnp.asarray(x)
    kernel(xj).block_until_ready()  # (compiled before the clock starts)
    _numpy_kernel(x)
    comm.Barrier()  # (every rank computes at once, as in a job)
    ticks, cpu, wall = _cpu_ticks(), time.thread_time(), time.perf_counter()
    numpy_times = []
    for _ in range(rounds):
        start = time.perf_counter()
        _numpy_kernel(x)
        numpy_times.append(time.perf_counter() - start)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    after = _cpu_ticks()
    steal = 0.0
    if ticks is not None and after is not None and after[1] > ticks[1]:
        steal = (after[0] - ticks[0]) / (after[1] - ticks[1])
    jax_times = []
    for _ in range(rounds):
        start = time.perf_counter()
        kernel(xj).block_until_ready()
        jax_times.append(time.perf_counter() - start)
    return {"numpy": float(np.median(numpy_times)), "jax": float(np.median(jax_times)),
            "cpu_share": min(1.0, cpu / wall) if wall > 0 else 1.0, "steal": steal}


def oversubscribed(every: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Find the nodes where the ranks' threads outnumber the cores.

    **Arguments:**
    - `every`: per rank, its `facts`.

    **Returns:** (warning, fix) per such node.
    """
    found = []
    nodes: dict[str, list[int]] = {}
    for rank, mine in enumerate(every):
        nodes.setdefault(mine["host"], []).append(rank)
    for host, ranks in nodes.items():
        cores = sorted({c for r in ranks for c in every[r]["cores"]})
        wanted = sum(every[r]["threads"] for r in ranks)
        if wanted <= len(cores):
            continue
        each = max(1, len(cores) // len(ranks))
        what = (f"node {host}: {len(ranks)} ranks x {every[ranks[0]]['threads']} "
                f"threads ({every[ranks[0]]['threads_from']}) = {wanted} threads on "
                f"{len(cores)} cores: oversubscribed, ranks steal cores from each other "
                "and collectives wait for the rank descheduled last")
        if len(ranks) > len(cores):
            fix = (f"run at most {len(cores)} ranks on this node (one per core), and "
                   "export OMP_NUM_THREADS=1")
        else:
            fix = (f"export OMP_NUM_THREADS={each} OPENBLAS_NUM_THREADS={each} "
                   f"MKL_NUM_THREADS={each} before mpiexec (cores / ranks per node = "
                   f"{len(cores)} / {len(ranks)}), and bind each rank to its cores "
                   "(MPICH: mpiexec -bind-to core; Open MPI: --bind-to core; srun: "
                   "--cpu-bind=cores)")
        found.append((what, fix))
    return found


def _nodes(every: Sequence[dict[str, Any]]) -> dict[str, list[int]]:
    """**Returns:** node name -> its ranks."""
    nodes: dict[str, list[int]] = {}
    for rank, mine in enumerate(every):
        nodes.setdefault(mine["host"], []).append(rank)
    return nodes


def busy_machine(every: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Find what the machine takes from the job: other processes on the cores (the load
    average, the CPU time a rank gets against wall time), CPU steal, and a rank slower
    than the others at the same work.

    **Arguments:**
    - `every`: per rank, its `facts`, with its `compute_probe` under `"compute"`.

    **Returns:** (warning, fix) per finding.
    """
    found = []
    exclusive = ("run the job on cores no other work uses: ask the scheduler for whole "
                 "nodes (srun --exclusive, #SBATCH --exclusive), or stop the other "
                 "processes (top shows them), and bind each rank to its cores (MPICH: "
                 "mpiexec -bind-to core; Open MPI: --bind-to core; srun: --cpu-bind=cores)")
    for host, ranks in _nodes(every).items():
        first = every[ranks[0]]
        load, count = first.get("load", -1.0), first["cpu_count"]
        mine = sum(every[r]["threads"] for r in ranks)
        # (this job's own ranks count in the load at most once each)
        others = load - len(ranks)
        if load >= 0 and others > max(0.5, count - mine):
            found.append((f"node {host}: other processes keep about {others:.0f} cores "
                          f"busy (load average {load:.1f} over the last minute on "
                          f"{count} cores, {len(ranks)} of them this job's ranks): they "
                          "take turns with the ranks on the cores, and every collective "
                          "waits for the rank descheduled last", exclusive))
        computed = [(r, every[r]["compute"]) for r in ranks if "compute" in every[r]]
        starved = [(r, c["cpu_share"]) for r, c in computed if c["cpu_share"] < CPU_SHARE_LIMIT]
        if starved:
            steal = max(c["steal"] for _, c in computed)
            worst = min(share for _, share in starved)
            crowded = mine > len({c for r in ranks for c in every[r]["cores"]})
            who = ("this job's other ranks (oversubscribed, above) or other processes"
                   if crowded else "other processes")
            if steal > STEAL_LIMIT:
                who += f" or the hypervisor (CPU steal {100 * steal:.0f}%)"
            found.append((f"node {host}: rank(s) {compress([r for r, _ in starved])} got "
                          f"as little as {100 * worst:.0f}% of a core while computing "
                          f"(CPU time against wall time in the compute probe): {who} run "
                          "on its cores", exclusive))
        elif computed and max(c["steal"] for _, c in computed) > STEAL_LIMIT:
            steal = max(c["steal"] for _, c in computed)
            found.append((f"node {host}: CPU steal {100 * steal:.0f}%: the hypervisor gives "
                          "this virtual machine's cores to others",
                          "run on dedicated (bare-metal) nodes, or nodes whose virtual "
                          "CPUs are pinned"))
    spread = compute_spread(every)
    if spread is not None:
        for kernel, (slowest, ratio, _, _) in spread.items():
            if ratio > SPREAD_LIMIT:
                found.append((f"rank {slowest} (node {every[slowest]['host']}) ran the "
                              f"same {kernel} kernel {ratio:.2f}x as long as the median "
                              "rank: a busy or slower core or node, and every collective "
                              f"waits for rank {slowest}",
                              "look at that node (top, or htop per core) and bind each "
                              "rank to its own core; leave a slower node out of the job "
                              "(srun --exclude, or the hostfile)"))
                break  # (one warning: the kernels agree on what the machine is)
    return found


def compute_spread(every: Sequence[dict[str, Any]]) -> dict[str, tuple[int, float, float,
                                                                         float]] | None:
    """The spread of the compute probe across ranks.

    **Arguments:**
    - `every`: per rank, its `facts` with `"compute"`.

    **Returns:** per kernel (`numpy`, `jax`): (the slowest rank, its time / the median,
    the median, the slowest's time), seconds; None where no rank has probed.
    """
    if not every or any("compute" not in mine for mine in every):
        return None
    found = {}
    for kernel in ("numpy", "jax"):
        times = np.array([mine["compute"][kernel] for mine in every])
        median = float(np.median(times))
        slowest = int(np.argmax(times))
        found[kernel] = (slowest, float(times[slowest]) / median if median > 0 else 1.0,
                         median, float(times[slowest]))
    return found


def probe(comm: Any, rounds: int = 50) -> dict[str, float]:
    """Time a ping-pong, a small Allreduce and how far apart the ranks leave a barrier;
    collective.

    **Arguments:**
    - `comm`: the communicator.
    - `rounds`: repetitions of each.

    **Returns:** seconds: `pingpong` (one way, rank 0 and the last rank; 0 alone),
    `allreduce` (8 doubles, median), `barrier` (median time in one), `skew` (median of
    the largest gap between the ranks' exits of a barrier, by each node's clock).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return {"pingpong": 0.0, "allreduce": 0.0, "barrier": 0.0, "skew": 0.0}
    mpi = _runtime.mpi()
    buffer, last = np.zeros(1), size - 1
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            comm.Send(buffer, dest=last)
            comm.Recv(buffer, source=last)
        elif rank == last:
            comm.Recv(buffer, source=0)
            comm.Send(buffer, dest=0)
    pingpong = (time.perf_counter() - start) / (2 * rounds)
    x, y = np.ones(8), np.empty(8)
    reduces, barriers, exits = [], [], []
    for _ in range(rounds):
        start = time.perf_counter()
        comm.Allreduce(x, y, op=mpi.SUM)
        reduces.append(time.perf_counter() - start)
        start = time.perf_counter()
        comm.Barrier()
        barriers.append(time.perf_counter() - start)
        exits.append(time.time())
    every = np.array(comm.allgather(exits))  # (ranks, rounds)
    skew = float(np.median(every.max(axis=0) - every.min(axis=0)))
    return {"pingpong": float(comm.bcast(pingpong, root=0)),
            "allreduce": float(np.median(reduces)), "barrier": float(np.median(barriers)),
            "skew": skew}


def _jax_facts() -> dict[str, Any]:
    import jax
    import jaxlib

    try:
        devices = [str(d) for d in jax.devices()]
    except RuntimeError as err:
        devices = [f"none ({err})"]
    return {"jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "?"),
            "devices": devices, "x64": x64_enabled(),
            "async": bool(jax.config.read("jax_cpu_enable_async_dispatch"))}


def diagnose(env: Mapping[str, str], every: Sequence[dict[str, Any]], library: str,
             world_size: int, jax_facts: dict[str, Any],
             timings: dict[str, float]) -> list[tuple[str, str]]:
    """Every warning, with its fix.

    **Arguments:**
    - `env`: rank 0's environment.
    - `every`: per rank, its `facts`.
    - `library`: the MPI library's version text ("" without MPI).
    - `world_size`: the size of the world.
    - `jax_facts`: jax's version, devices and settings.
    - `timings`: what `probe` measured.

    **Returns:** (warning, fix) pairs; none where the job is healthy.
    """
    found = []
    if library:
        mismatch = _launch.diagnose(env, library, world_size)
        if mismatch:
            what, _, fix = mismatch.partition(" Fix: ")
            found.append((what, fix.rstrip(".") or "see docs/sharp-bits.md"))
    found += oversubscribed(every)
    found += busy_machine(every)
    if jax_facts["async"]:
        found.append(("JAX's CPU async dispatch is on: XLA runs larger programs, and the "
                      "host calls in them, on a worker thread the caller then waits for",
                      "unset DISTOP_ASYNC_DISPATCH (distop turns async dispatch off when "
                      "imported before JAX starts its CPU backend)"))
    if timings["skew"] > SKEW_LIMIT:
        found.append((f"the ranks leave a barrier {1e3 * timings['skew']:.0f} ms apart "
                      "(median): some rank is descheduled or starved",
                      "check the oversubscription above and other jobs on the nodes "
                      "(top, or htop per core)"))
    return found


def screen(env: Mapping[str, str], every: Sequence[dict[str, Any]], library: str,
           mpi4py_version: str, jax_facts: dict[str, Any], timings: dict[str, float],
           warnings: Sequence[tuple[str, str]]) -> str:
    """**Returns:** the report: one screen of lines (see `doctor`)."""
    size = len(every)
    nodes: dict[str, list[int]] = {}
    for rank, mine in enumerate(every):
        nodes.setdefault(mine["host"], []).append(rank)
    launcher, started = _launch.detect_launcher(env)
    launcher = launcher or "none detected (a single process, or an unknown launcher)"
    name = " ".join(library.splitlines()[0].split()) if library else "unavailable"
    lines = [f"distop doctor: {size} rank(s) on {len(nodes)} node(s)",
             f"  MPI        {name}; mpi4py {mpi4py_version}",
             f"  launcher   {launcher}" + (f", started {started}" if started else "")
             + f"; world size {size}"]
    for host, ranks in list(nodes.items())[:8]:
        cores = sorted({c for r in ranks for c in every[r]["cores"]})
        lines.append(f"  node {host}: {len(ranks)} rank(s) per node, {len(cores)} cores "
                     f"({compress(cores)}) of {every[ranks[0]]['cpu_count']}")
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r in ranks:
            key = (tuple(every[r]["cores"]), every[r]["threads"], every[r]["threads_from"])
            groups.setdefault(key, []).append(r)
        for (mask, count, source), members in list(groups.items())[:4]:
            lines.append(f"    rank(s) {compress(members)}: cores {compress(list(mask))}, "
                         f"{count} thread(s) each ({source})")
        if len(groups) > 4:
            lines.append(f"    ... {len(groups) - 4} more groups of ranks")
    if len(nodes) > 8:
        lines.append(f"  ... {len(nodes) - 8} more nodes")
    flags = every[0]["xla_flags"]
    lines.append(f"  XLA        XLA_FLAGS={flags or '(unset)'}; its CPU pool: a thread per "
                 "core, idle unless an operation is large")
    lines.append(f"  jax        {jax_facts['jax']} (jaxlib {jax_facts['jaxlib']}); devices "
                 f"{', '.join(jax_facts['devices'][:4])}; x64 "
                 f"{'on' if jax_facts['x64'] else 'off'}; async dispatch "
                 f"{'on' if jax_facts['async'] else 'off'}")
    if size > 1:
        lines.append(f"  probe      ping-pong 0<->{size - 1}: {1e6 * timings['pingpong']:.1f} "
                     f"us one way; Allreduce(8 doubles) {1e6 * timings['allreduce']:.1f} us; "
                     f"barrier {1e6 * timings['barrier']:.1f} us; barrier skew "
                     f"{1e6 * timings['skew']:.1f} us (median)")
    else:
        lines.append("  probe      one rank: no latency to measure")
    spread = compute_spread(every)
    if spread is not None:
        parts = []
        for kernel, (slowest, ratio, median, most) in spread.items():
            parts.append(f"{kernel} kernel {1e6 * median:.0f} us median" + (
                f", slowest rank {slowest} {1e6 * most:.0f} us ({ratio:.2f}x)"
                if size > 1 else ""))
        shares = [mine["compute"]["cpu_share"] for mine in every]
        parts.append(f"CPU time / wall time {100 * min(shares):.0f}% (the least of a rank)")
        lines.append("  compute    " + "; ".join(parts))
    loads = {host: every[ranks[0]].get("load", -1.0) for host, ranks in nodes.items()}
    known = [f"{host} {load:.1f}" for host, load in list(loads.items())[:8] if load >= 0]
    if known:
        lines.append("  load       average over the last minute: " + ", ".join(known))
    if warnings:
        for what, fix in warnings:
            lines.append(f"WARNING: {what}.\n  Fix: {fix}.")
    else:
        lines.append("healthy: no warnings")
    return "\n".join(lines)


def doctor(argv: Sequence[str] = ()) -> int:
    """Print the report on rank 0; collective on every rank of the world.

    **Arguments:**
    - `argv`: the command line after `doctor` (none is taken).

    **Returns:** the exit status: 0 when healthy, 1 when a warning stands (the same on
    every rank).
    """
    if argv:
        print(f"python -m distop doctor: unexpected arguments {list(argv)}; it takes none.",
              file=sys.stderr)
        return 2
    try:
        mpi = _runtime.mpi()
        comm = mpi.COMM_WORLD.Dup()
        library, version = mpi.Get_library_version(), _mpi4py_version()
    except MPIUnavailableError as err:
        comm, library, version = _Alone(), "", f"unavailable: {err}"
    mine = facts(os.environ)
    mine["compute"] = compute_probe(comm)
    every = comm.allgather(mine)
    timings = probe(comm)
    jax_facts = _jax_facts()
    warnings = diagnose(os.environ, every, library, comm.Get_size(), jax_facts, timings)
    if not library:
        warnings.insert(0, ("mpi4py could not load an MPI library", version))
    if comm.Get_rank() == 0:
        print(screen(os.environ, every, library, version, jax_facts, timings, warnings),
              flush=True)
    status = 1 if warnings else 0
    return int(comm.bcast(status, root=0))


def _mpi4py_version() -> str:
    import mpi4py

    return str(mpi4py.__version__)
