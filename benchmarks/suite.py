"""python benchmarks/suite.py [--ranks 1 2 4] [--repeat R] [--quick] [--json PATH]

The whole performance suite in one command. The driver launches one `mpiexec -n P`
job per section and rank count (`python benchmarks/suite.py --worker SECTION ...`, the
mpiexec beside this Python if there is one, else the one on PATH; each job under a
timeout), reads the one JSON line rank 0 prints, prints one table per section and
writes every result to `--json` (default benchmarks/results.json). A failed or hung job
is reported with its output and the suite goes on (and exits non-zero).

Within a job every variant runs side by side, interleaved call by call (the variants in
a new order each round, the same on every rank), so all see the same machine state, and
ratios are of medians of the same run. Per call (ms): the max
over ranks of each rank's median over `--repeat` calls. First call (s): Problem
creation (or the first call of a jitted program) and the first `run`, then the first
`compute_totals`: tracing and compiling included. `err`: the max relative error of the
values and of each gradient over 3 calls, max over ranks. `calls`: host calls in the
`compute_totals` program (schedule entries of one fusion group make one host call).

1. `matvec`: the scenario of examples/distributed_matvec.py (M=400; K objectives
   f_k = w_k . y of one operator y = (sum_r A_r) x), `run` and `compute_totals`, and
   two rows of the values and the gradients at one point: `run+totals` and
   `run_and_compute_totals`. `hand` and `floor` compute values and gradients together
   in their `compute_totals` (and again in both rows), while distop's `compute_totals`
   returns gradients only and makes no forward call whose value nothing in the reverse
   sweep reads, so the last two rows are the like-for-like ones for distop: `run`,
   then `compute_totals` (two programs), and `run_and_compute_totals` (one program;
   OpenMDAO's model makes its two calls in both rows):
   - `hand`: numpy + mpi4py (benchmarks/matvec.py's `hand_written`: one Allreduce, and
     one batched Allreduce for the K gradients);
   - `hand+jit`: `hand` after one dispatch of a jitted one-line program of x (matvec.py's
     `hand_and_dispatch`): the least any design that runs the model as one JAX program
     per call can cost, so `hand+jit/hand` bounds from below what `lean/hand` can reach;
   - `floor`: one jitted program with bare ordered io_callbacks doing the hand-written
     work (matvec.py's `floor_programs`): the floor of a design on ordered io_callbacks;
   - `ffi`: the same program with distop's FFI host call in place of each io_callback
     (matvec.py's `ffi_floor_programs`): its Python handler, numpy views of XLA's
     buffers and the token chain, calling the hand-written work with none of distop's
     own (checks, agreement, Problem): the floor of the lean path, so `lean/ffi` is
     what distop itself adds and `ffi/hand` what the mechanism costs;
   - `lean`: distop on its lean path, fusing independent operator calls
     (`Problem(fuse=True)`, the default); `nofuse`: the same with `fuse=False`;
   - `io_cb`: distop with `backend="io_callback"`;
   - `unord`: distop with `ordered=False` operators, the naive unordered lowering (its
     `err` tells whether its results were right);
   - `mpi4jax`: floor's program with `mpi4jax.allreduce` in place of the callbacks
     (the reverse written out: mpi4jax's transpose of an allreduce is rank-local); its
     columns are left out, with a note, where mpi4jax is not installed;
   - `openmdao`: the same model in OpenMDAO (matvec.py's `OpenMDAOMatvec`: a matvec
     component with an Allreduce in `compute` and in each reverse matrix-free product),
     `run_model` and `compute_totals` (reverse mode: one linear solve, so one
     Allreduce, per objective); like distop, its `compute_totals` returns gradients
     only. Left out, with a note, where OpenMDAO is not installed.
   `X/Y`: ratio of medians. On 1 rank nothing needs ordering: `io_cb` and `unord` run
   the same unordered callbacks, while `lean` still runs its calls on the token chain
   (fused), as a Problem does whenever an operator is not set to `ordered=False`.
   The forward table: `build(..., "forward")`, K independent operator calls on the same
   x, against one operator (K=1), fused and not; `K/1` is the cost of K calls over one.
   `hand 1`, `hand K`: the same K operators by hand (matvec.py's `hand_operators`: each
   call's matvec and Allreduce; for `compute_totals` each VJP's), and `bound K/1`:
   (lean 1 + hand K - hand 1) / lean 1, the K/1 distop would reach if each further
   operator call cost nothing beyond the users' own work.
2. `chain`: N calls of a small operator (the matvec on 8 doubles: an Allreduce in
   forward and vjp), f = w . y: one chain (`chain`: y = op(y), N times), or 40
   independent chains of N/40 calls (N >= 40), written chain after chain (`groups`) or
   one step of every chain after another (`layers`; fusion joins neighbouring calls, so
   the order they are written in matters), or one chain with each result negated
   (`negated`: y = -op(y), an XLA operation between the calls, so none fuse: about 2N
   host calls per `compute_totals`, the `calls` column); distop lean fused, and io_cb
   up to N =
   --chain-io-cb (100). `/op`: per call divided by N (µs), flat where the cost grows
   linearly. `R`: repeats, `--repeat` up to N=100, then fewer (at least 3).
3. `message`: one `distop.AllreduceSum` of m doubles (`distop`: `run`) against the
   hand-written Allreduce (`hand`) and one bare ordered io_callback doing it (`floor`);
   `err`: distop's result against the hand-written one.
4. `large`: the matvec with M = --large-size doubles (1e6), sparse blocks (4 entries
   per row), K=16, W an input: hand-written against distop (`compute_totals("f", "x")`),
   `err` against the hand-written values and gradients.
5. `overhead`: distop's own work per call on an operator of 8 doubles that does no
   communication (ordered=True, so the lean path on any number of ranks): the user
   method called directly (`method`), through distop's `HostCall` (`distop/call`: its
   checks, views and watchdog), a jitted program without host calls taking the same
   arguments (`empty prog`), the lean program with one call (`handler+FFI`: what the
   FFI call and its handler add over those), with 16 independent calls fused into one
   (`per fused`: each extra member), the one-call program followed by a product of
   6400 flops (`prog 1+dot`), `Problem.run` (`run extra`: the agreement on the
   request, result views and the call count, over the program), and `run(x=...)`
   with a new x each call (`new input`: what that adds to `run()`). The row `1 async`
   is one process with `DISTOP_ASYNC_DISPATCH=1`: JAX's async dispatch kept, so XLA
   runs programs above about 1000 flops (`prog 1+dot`, `prog 16 fused`) on a worker
   thread, host calls included.
6. `stencil`: benchmarks/stencil.py (the heat equation with `HaloExchange` in a time
   loop against hand-written numpy + mpi4py, the built-in reductions once per step
   against the same loop by hand, and host calls that do no work against the bare FFI
   call), under each of `--ranks`, at `--stencil-sizes` (96 384; quick 96),
   with at most 15 repeats (40 for the microbenchmark).

Sections 1, 3, 5 and 6 run under each of `--ranks`, section 2 under `--chain-ranks`,
section 4 under `--large-ranks` (each 1 2 4). `--quick`: 5 repeats, K 1 16, N 10 100,
m 8 1e5, M 1e5, ranks 1 2 (chain and large: 2) (about a minute). Other options: --sections,
--size M, --objectives K.., --ops N.., --messages m.., --timeout S (per job; 1800,
quick 300).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from jax.experimental import io_callback

HERE = pathlib.Path(__file__).resolve()
MARK = "SUITE_JSON "  # prefixes the result line a worker prints on rank 0
SECTIONS = ("matvec", "chain", "message", "large", "overhead", "stencil")
GROUPS = 40  # independent chains in the `groups` model of the chain section
FULL = {"repeat": 50, "objectives": [1, 16, 64], "ops": [10, 100, 1000, 2000],
        "messages": [8, 1000, 100_000, 1_000_000], "ranks": [1, 2, 4], "chain_ranks": [1, 2, 4],
        "large_ranks": [1, 2, 4], "timeout": 1800, "large_size": 1_000_000,
        "stencil_sizes": [96, 384]}
QUICK = {"repeat": 5, "objectives": [1, 16], "ops": [10, 100], "messages": [8, 100_000],
         "ranks": [1, 2], "chain_ranks": [2], "large_ranks": [2], "timeout": 300,
         "large_size": 100_000, "stencil_sizes": [96]}
MATVEC = ("hand", "hand+jit", "floor", "ffi", "lean", "nofuse", "io_cb", "unord", "mpi4jax",
          "openmdao")
MATVEC_ENTRIES = ("run", "compute_totals", "run+totals", "run_and_compute_totals")
RATIOS = (("lean", "hand"), ("hand+jit", "hand"), ("ffi", "hand"), ("lean", "ffi"),
          ("lean", "floor"),
          ("lean", "mpi4jax"), ("openmdao", "lean"),
          ("nofuse", "lean"), ("io_cb", "lean"), ("unord", "lean"))


# -- worker side: runs under mpiexec -------------------------------------------------
@dataclasses.dataclass
class Bench:
    """What a worker's measurements share: options, communicator and modules (imported
    only under mpiexec: importing mpi4py's MPI or distop starts MPI)."""

    args: argparse.Namespace
    comm: object
    MPI: object
    distop: object
    dm: object  # examples/distributed_matvec.py
    mv: object  # benchmarks/matvec.py
    mpi4jax: object  # the module, or None
    openmdao: bool  # whether OpenMDAO can be imported
    missing: list  # notes on the comparisons left out (not installed)

    @classmethod
    def start(cls, args):
        import distributed_matvec as dm
        import matvec as mv
        from mpi4py import MPI

        import distop

        missing = []
        try:
            import mpi4jax
        except Exception as err:  # noqa: BLE001 - any import failure means "skip"
            mpi4jax = None
            missing.append(f"mpi4jax not available ({type(err).__name__}: {err})")
        try:
            import openmdao.api  # (only whether it imports)
            openmdao = True
        except Exception as err:  # noqa: BLE001 - any import failure means "skip"
            openmdao = False
            missing.append(f"openmdao not available ({type(err).__name__}: {err})")
        return cls(args, MPI.COMM_WORLD, MPI, distop, dm, mv, mpi4jax, openmdao, missing)

    def problem(self, model, inputs, *, fuse=True, backend="lean"):
        """A `distop.Problem` with explicit settings (the environment's defaults, such
        as DISTOP_FUSE or DISTOP_BACKEND, do not leak in)."""
        return self.distop.Problem(model, inputs, backend=backend, fuse=fuse)

    def first_calls(self, model, inputs, *, totals=True, **options):
        """Create a Problem and call each entry point once (`run` only if not `totals`),
        timing both.

        **Returns:** `(problem, [Problem creation + first run, first compute_totals])`
        in seconds, max over ranks.
        """
        return self.first_calls_of(lambda: self.problem(model, inputs, **options), totals)

    def first_calls_of(self, make, totals=True):
        """As `first_calls`, for any object with `run` and `compute_totals` that `make()`
        creates (a Problem, or the OpenMDAO model)."""
        made = {}

        def create():
            made["it"] = make()
            made["it"].run()

        first = [self.mv.first_call(create)]
        if totals:
            first.append(self.mv.first_call(made["it"].compute_totals))
        return made["it"], first

    def interleaved(self, calls, repeat=None):
        """Time `calls` (name -> tuple of functions), interleaved call by call, each
        round in its own order.

        **Returns:** name -> list of per-call times (s): the max over ranks of each
        rank's median over `repeat` (default `--repeat`) calls, one per function.
        """
        times = {name: [[] for _ in fns] for name, fns in calls.items()}
        names = list(calls)
        for r in range(repeat or self.args.repeat):
            # a new order each round, the same on every rank (the calls communicate): no
            # variant always runs first or after the same one, which warms or cools the
            # caches it then finds
            for i in np.random.default_rng(r).permutation(len(names)):
                name = names[i]
                for which, fn in enumerate(calls[name]):
                    self.comm.Barrier()
                    start = time.perf_counter()
                    fn()
                    times[name][which].append(time.perf_counter() - start)
        return {name: [self.max(float(np.median(t))) for t in lists]
                for name, lists in times.items()}

    def max(self, value):
        """**Returns:** the max of `value` over ranks."""
        return self.comm.allreduce(value, op=self.MPI.MAX)

    def allreduce(self, x):
        """mpi4jax's allreduce (older releases return a token as well)."""
        out = self.mpi4jax.allreduce(x, op=self.MPI.SUM, comm=self.comm)
        return out[0] if isinstance(out, tuple) else out


def host_calls(problem):
    """**Returns:** the number of host calls in `problem`'s compute_totals program (one
    per fusion group)."""
    return len({entry.group for entry in problem.schedule})


class Jitted:
    """Two jitted programs of the matvec scenario, values and (values, gradients), with
    the `run`/`compute_totals` interface `distributed_matvec.errors` reads."""

    def __init__(self, run, totals, x0):
        self._run, self._totals, self.x = run, totals, jnp.asarray(x0)

    def run(self, x):
        self.x = jnp.asarray(x)
        return {f"f{i}": v for i, v in enumerate(np.asarray(self._run(self.x)))}

    def compute_totals(self, mode=None):
        grads = np.asarray(self._totals(self.x)[1])
        return {(f"f{i}", "x"): g for i, g in enumerate(grads)}

    def calls(self):
        """**Returns:** the timed calls, (values, values and gradients)."""
        return (lambda: self._run(self.x).block_until_ready(),
                lambda: jax.block_until_ready(self._totals(self.x)))

    def first_calls(self, mv):
        """**Returns:** the first call of each program (s), max over ranks."""
        return [mv.first_call(fn) for fn in self.calls()]


def mpi4jax_programs(bench, a_local, w):
    """The floor's programs with `mpi4jax.allreduce` in place of the ordered callbacks.

    **Returns:** `(run, totals)`, jitted.
    """
    a = jnp.asarray(a_local.toarray())
    run = jax.jit(lambda x: w @ bench.allreduce(a @ x))
    totals = jax.jit(lambda x: (w @ bench.allreduce(a @ x), bench.allreduce(w @ a)))
    return run, totals


def matvec_variants(bench, k):
    """Build every variant of the matvec scenario with K objectives, timing first calls.

    **Returns:** `(data, variants, first)`: `data` from `distributed_matvec.setup`;
    name -> object with `run` and `compute_totals` (a Problem or a `Jitted`); name ->
    first-call times.
    """
    dm, size = bench.dm, bench.args.size
    data = a_local, _, x0, w = dm.setup(size, k, bench.comm)
    variants = {"floor": Jitted(*bench.mv.floor_programs(a_local, w, size), x0),
                "ffi": Jitted(*bench.mv.ffi_floor_programs(a_local, w, size), x0)}
    if bench.mpi4jax is not None:
        variants["mpi4jax"] = Jitted(*mpi4jax_programs(bench, a_local, w), x0)
    first = {name: v.first_calls(bench.mv) for name, v in variants.items()}
    if bench.openmdao:
        variants["openmdao"], first["openmdao"] = bench.first_calls_of(
            lambda: bench.mv.OpenMDAOMatvec(a_local, w, x0))
    options = {"lean": {}, "nofuse": {"fuse": False}, "io_cb": {"backend": "io_callback"},
               "unord": {}}
    for name, kw in options.items():
        model = dm.build(a_local, w, "reverse", ordered=False if name == "unord" else None)
        variants[name], first[name] = bench.first_calls(model, {"x": x0}, **kw)
    return data, variants, first


def timed_calls(variant):
    """**Returns:** the calls to time of a variant: run, compute_totals, and values with
    gradients twice: `run` then `compute_totals`, and `run_and_compute_totals` for a
    Problem (a `Jitted` computes both in its second program, the OpenMDAO model in its
    two calls)."""
    if isinstance(variant, Jitted):
        run, totals = variant.calls()
        return run, totals, totals, totals

    def both():
        variant.run()
        variant.compute_totals()

    return (variant.run, variant.compute_totals, both,
            getattr(variant, "run_and_compute_totals", both))


def matvec_case(bench, k):
    """The matvec scenario with K objectives: every variant, side by side."""
    (a_local, a_global, x0, w), variants, first = matvec_variants(bench, k)
    errors = {name: bench.max(bench.dm.errors(v, a_global, x0, w, "batched", calls=3))
              for name, v in variants.items()}
    hand = (lambda: bench.mv.hand_written(a_local, w, x0, gradients=False),
            lambda: bench.mv.hand_written(a_local, w, x0))
    program, x_jax = bench.mv.one_dispatch(), jnp.asarray(x0)
    program(x_jax).block_until_ready()  # (compiled before the timed calls)
    jit = (lambda: bench.mv.hand_and_dispatch(program, a_local, w, x0, x_jax,
                                              gradients=False),
           lambda: bench.mv.hand_and_dispatch(program, a_local, w, x0, x_jax))
    calls = {"hand": (*hand, hand[1], hand[1]), "hand+jit": (*jit, jit[1], jit[1])}
    calls.update({name: timed_calls(v) for name, v in variants.items()})
    return {"K": k, "median": bench.interleaved(calls), "first": first, "error": errors,
            "calls": {n: host_calls(v) for n, v in variants.items()
                      if isinstance(v, bench.distop.Problem)}}


def forward_case(bench, counts):
    """K independent operator calls on one x (`--variant forward`) for K in `counts`
    and K=1, fused and not, side by side."""
    dm = bench.dm
    a_local, a_global, x0, w = dm.setup(bench.args.size, max(counts), bench.comm)
    problems, first, errors = {}, {}, {}
    for k in [1, *counts]:
        for name in ("lean", "nofuse"):
            key = f"{name}/{k}"
            problems[key], first[key] = bench.first_calls(
                dm.build(a_local, w[:k], "forward"), {"x": x0}, fuse=name == "lean")
            errors[key] = bench.max(dm.errors(problems[key], a_global, x0, w[:k], "batched",
                                              calls=3))
    calls = {key: (p.run, p.compute_totals) for key, p in problems.items()}
    calls.update({f"hand/{k}": (lambda k=k: bench.mv.hand_operators(a_local, w[:k], x0),
                                lambda k=k: bench.mv.hand_operators(a_local, w[:k], x0,
                                                                    gradients=True))
                  for k in [1, *counts]})
    median = bench.interleaved(calls)
    return {"K": counts, "median": median, "first": first, "error": errors,
            "calls": {key: host_calls(p) for key, p in problems.items()}}


def matvec_section(bench):
    counts = [k for k in bench.args.objectives if k > 1]
    return {"rows": [matvec_case(bench, k) for k in bench.args.objectives],
            "forward": forward_case(bench, counts) if counts else None}


def chain_model(op, w, depths, by_layer=False, between=None):
    """f = sum over chains of w . y, where a chain of depth d is y = op(y), d times, from
    y = x: one chain, or several independent ones written chain after chain or, if
    `by_layer`, one step of every chain after another; with `between`, y =
    between(op(y)) (an XLA operation between the calls: no two of them fuse).

    **Returns:** the model.
    """
    if by_layer:
        order = [j for step in range(max(depths)) for j, d in enumerate(depths) if step < d]
    else:
        order = [j for j, d in enumerate(depths) for _ in range(d)]

    def model(x):
        ys = [x] * len(depths)
        for j in order:
            ys[j] = op(ys[j]) if between is None else between(op(ys[j]))
        return {"f": sum(jnp.dot(w, y) for y in ys)}
    return model


def chain_error(problem, x0, w, depths, sign=1.0):
    """The max relative error of f and its gradient: the operator shifts y by one
    place (a cyclic permutation, the sum of every rank's share), so both are exact;
    `sign`: -1 where each call's result is negated (`chain_model`'s `between`)."""
    exact_f = sum(sign ** d * w @ np.roll(x0, d) for d in depths)
    exact_g = sum(sign ** d * np.roll(w, -d) for d in depths)
    f = problem.run(x=x0)["f"]
    g = problem.compute_totals()["f", "x"].ravel()
    return max(abs(f - exact_f) / abs(exact_f),
               np.linalg.norm(g - exact_g) / np.linalg.norm(exact_g))


def chain_repeat(bench, n):
    """**Returns:** the repeats for N operator calls: `--repeat` up to N=100, fewer (at
    least 3) beyond, so the largest N stay within the job's time."""
    return max(3, min(bench.args.repeat, bench.args.repeat * 100 // n))


def chain_case(bench, n):
    """N operator calls, chained and in independent groups, side by side."""
    size = bench.comm.Get_size()
    shift = sp.csr_matrix(np.roll(np.eye(8), 1, axis=0) / size)  # sum over ranks: a shift
    op = bench.dm.DistributedMatvec(shift)
    x0, w = np.linspace(1.0, 2.0, 8), np.arange(1.0, 9.0)
    # N calls in GROUPS chains whose depths differ by at most one
    groups = [n // GROUPS + (j < n % GROUPS) for j in range(GROUPS)]
    models = {"lean chain": ([n], False, "lean"), "lean groups": (groups, False, "lean"),
              "lean layers": (groups, True, "lean"), "lean negated": ([n], False, "lean"),
              "io_cb chain": ([n], False, "io_callback"),
              "io_cb groups": (groups, False, "io_callback")}
    problems, first, errors = {}, {}, {}
    for key, (depths, by_layer, backend) in models.items():
        if len(depths) > 1 and n < GROUPS or "io_cb" in key and n > bench.args.chain_io_cb:
            continue
        between = jnp.negative if "negated" in key else None
        problems[key], first[key] = bench.first_calls(
            chain_model(op, w, depths, by_layer, between), {"x": x0}, backend=backend)
        errors[key] = bench.max(chain_error(problems[key], x0, w, depths,
                                            -1.0 if between else 1.0))
    repeat = chain_repeat(bench, n)
    median = bench.interleaved({key: (p.run, p.compute_totals) for key, p in problems.items()},
                               repeat)
    return {"N": n, "repeat": repeat, "median": median, "first": first, "error": errors,
            "calls": {key: host_calls(p) for key, p in problems.items()}}


def chain_section(bench):
    return {"rows": [chain_case(bench, n) for n in bench.args.ops]}


def floor_allreduce(bench, m):
    """**Returns:** a jitted program of one bare ordered io_callback doing an Allreduce
    of m doubles."""
    def reduce(x):
        out = np.empty(m)
        bench.comm.Allreduce([x, bench.MPI.DOUBLE], out)  # a view of a jax buffer
        return out

    spec = jax.ShapeDtypeStruct((m,), jnp.float64)
    return jax.jit(lambda x: io_callback(reduce, spec, x, ordered=True))


def message_case(bench, m):
    """One Allreduce of m doubles: hand-written, floor, distop (and mpi4jax)."""
    x = np.linspace(0.0, 1.0, m) + bench.comm.Get_rank()
    xj, out = jnp.asarray(x), np.empty(m)
    programs = {"floor": floor_allreduce(bench, m)}
    if bench.mpi4jax is not None:
        programs["mpi4jax"] = jax.jit(bench.allreduce)
    first = {name: bench.mv.first_call(lambda p=p: p(xj).block_until_ready())
             for name, p in programs.items()}
    op = bench.distop.AllreduceSum()
    # run only: the Jacobian of m outputs by m inputs would not fit for large m
    problem, (first["distop"],) = bench.first_calls(lambda x: {"s": op(x)}, {"x": x},
                                                    totals=False)
    calls = {"hand": (lambda: bench.comm.Allreduce(x, out),),
             "distop": (problem.run,)}
    calls.update({name: (lambda p=p: p(xj).block_until_ready(),) for name, p in programs.items()})
    median = {name: t[0] for name, t in bench.interleaved(calls).items()}
    bench.comm.Allreduce(x, out)
    error = float(np.max(np.abs(problem.run()["s"] - out)) / np.max(np.abs(out)))
    return {"m": m, "median": median, "first": first, "error": bench.max(error)}


def message_section(bench):
    return {"rows": [message_case(bench, m) for m in bench.args.messages]}


def large_case(bench, k):
    """The large scenario: M = --large-size doubles, sparse blocks (4 entries per row),
    K objectives; hand-written against distop (fused lean path)."""
    m, comm = bench.args.large_size, bench.comm
    a_local = sp.random(m, m, density=4.0 / m, format="csr",
                        random_state=np.random.default_rng(comm.Get_rank()))
    x0 = np.sin(0.37 * np.arange(m)) + 0.1
    w = np.random.default_rng(7).standard_normal((k, m))
    op = bench.dm.DistributedMatvec(a_local)
    first = {}
    problem, first["lean"] = bench.first_calls(lambda x, w: {"f": w @ op(x)},
                                               {"x": x0, "w": w}, totals=False)

    def totals():
        return problem.compute_totals("f", "x")

    first["lean"].append(bench.mv.first_call(totals))
    calls = {"hand": (lambda: bench.mv.hand_written(a_local, w, x0, gradients=False),
                      lambda: bench.mv.hand_written(a_local, w, x0)),
             "lean": (problem.run, totals)}
    repeat = max(3, bench.args.repeat // 5)
    median = bench.interleaved(calls, repeat)
    f, grads = bench.mv.hand_written(a_local, w, x0)
    error = max(np.max(np.abs(problem.run()["f"] - f)) / np.max(np.abs(f)),
                np.max(np.abs(totals()["f", "x"] - grads)) / np.max(np.abs(grads)))
    return {"M": m, "K": k, "repeat": repeat, "median": median, "first": first,
            "error": bench.max(float(error))}


def large_section(bench):
    return {"rows": [large_case(bench, 16)]}


def overhead_section(bench):
    """distop's own work per call, piece by piece, on an operator of 8 doubles that
    does no communication (ordered=True: the lean path on any number of ranks)."""
    from distop._agreement import comm as _comm
    from distop._hostcalls.host import HostCall

    class Twice(bench.distop.DistributedOperator):
        forward_collectives = ("Allreduce",)  # declared (not issued): ordered calls

        def forward(self, comm, x):
            return 2.0 * x

    x = np.linspace(0.0, 1.0, 8)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    ops = [Twice(ordered=True) for _ in range(16)]
    call = HostCall(ops[0], "forward", _comm.private(None), True, (spec,), (spec,))
    w = np.linspace(-1.0, 1.0, 400 * x.size).reshape(400, x.size)
    one = bench.problem(lambda x: {"y": ops[0](x)}, {"x": x})
    many = bench.problem(lambda x: {"y": jnp.stack([op(x) for op in ops])}, {"x": x})
    # 6400 flops: above what XLA's CPU client runs inline when dispatch is async
    product = bench.problem(lambda x: {"y": w @ ops[0](x)}, {"x": x})
    one.run(), many.run(), product.run()
    program = {name: next(v for key, v in p._programs.programs.items() if key[0] == "run")
               for name, p in (("one", one), ("many", many), ("product", product))}
    token, point = one._executor.token, jax.device_put(one._point)  # as on repeated calls
    empty = jax.jit(lambda t, p: (p["x"] * 2.0, t + 1.0))
    comm = _comm.private(None)
    calls = {"method": (lambda: Twice.forward(ops[0], comm, x),),
             "HostCall": (lambda: call(x),),
             "empty program": (lambda: jax.block_until_ready(empty(token, point)),),
             "program 1 call": (lambda: jax.block_until_ready(program["one"].fn(token, point)),),
             "program 16 fused": (
                 lambda: jax.block_until_ready(program["many"].fn(token, point)),),
             "program 1 call + product": (
                 lambda: jax.block_until_ready(program["product"].fn(token, point)),),
             "Problem.run": (one.run,),
             "Problem.run(x=)": (lambda: one.run(x=x),)}
    median = {name: t[0] for name, t in bench.interleaved(calls, 20 * bench.args.repeat).items()}
    return {"rows": [{"median": median}],
            "async_dispatch": bool(jax.config.read("jax_cpu_enable_async_dispatch"))}


WORKERS = {"matvec": matvec_section, "chain": chain_section, "message": message_section,
           "large": large_section, "overhead": overhead_section}


def worker(args):
    """Run one section on every rank; rank 0 prints its results as one JSON line. Any
    failure prints the traceback and aborts the job, so no rank waits forever."""
    sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "examples")]
    bench = Bench.start(args)
    start = time.perf_counter()
    try:
        result = WORKERS[args.worker](bench)
    except BaseException:  # noqa: BLE001 - reported, then the whole job ends
        print(f"rank {bench.comm.Get_rank()}: section {args.worker} failed\n"
              + traceback.format_exc(), file=sys.stderr, flush=True)
        bench.comm.Abort(1)
        return 1  # (should Abort return)
    result.update(ranks=bench.comm.Get_size(), seconds=time.perf_counter() - start,
                  jax=jax.__version__, distop=bench.distop.__version__,
                  mpi=" ".join(bench.MPI.Get_library_version().splitlines()[0].split()),
                  missing=bench.missing)
    if bench.comm.Get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)


# -- driver side ---------------------------------------------------------------------
def mpiexec():
    """**Returns:** the `mpiexec` beside this Python (the mpich wheel's), else `mpiexec`
    from PATH."""
    here = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def worker_options(args):
    """**Returns:** the command-line options a worker needs."""
    return ["--repeat", str(args.repeat), "--size", str(args.size),
            "--objectives", *map(str, args.objectives), "--ops", *map(str, args.ops),
            "--messages", *map(str, args.messages), "--chain-io-cb", str(args.chain_io_cb),
            "--large-size", str(args.large_size)]


def launch(section, ranks, args, extra_env=None, script=HERE, options=None):
    """Run one section under `mpiexec -n ranks` (with `extra_env` added to the
    environment), killing the job after `--timeout`.

    `script` and `options` name another benchmark's worker and its command-line options
    (by default this suite's, `worker_options`).

    **Returns:** `(result, None)`, or `(None, report)` if the job failed: what went
    wrong and the end of its output.
    """
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(script), "--worker", section,
           *(worker_options(args) if options is None else options)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
        what = f"exited with code {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # mpiexec and every rank: its own session
        out, err = proc.communicate()
        what = f"still running after {args.timeout} s: killed"
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(MARK):]), None
    tail = "\n".join((out + err).strip().splitlines()[-30:]) or "(none)"
    return None, f"{' '.join(cmd)}\n{what}{'' if lines else ', no result'}; output:\n{tail}"


def fmt(value, kind):
    """Format a table cell: `ms`, `us` (from seconds), `s`, `x` (ratio), `e` (error);
    None as `-`."""
    if value is None:
        return "-"
    scale, spec = {"ms": (1e3, ".3f"), "us": (1e6, ".1f"), "s": (1, ".3f"), "x": (1, ".2f"),
                   "e": (1, ".1e")}[kind]
    return format(scale * value, spec)


def ratio(a, b):
    return None if a is None or b is None else a / b


def print_table(title, header, rows):
    """Print `rows` (lists of strings) under `header`, right-aligned in columns."""
    widths = [max(map(len, column)) for column in zip(header, *rows)]
    print(f"\n# {title}")
    for row in [header, *rows]:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


def present(results, names, field="median"):
    """**Returns:** the names in `names` that some result row has (in that order)."""
    seen = {n for r in results.values() for row in r["rows"] for n in row[field]}
    return [n for n in names if n in seen]


def matvec_tables(results, args):
    names = present(results, MATVEC)
    pairs = [(a, b) for a, b in RATIOS if a in names and b in names]
    header = ["P", "K", "entry", *names, *(f"{a}/{b}" for a, b in pairs)]
    rows = []
    for p, r in results.items():
        for row in r["rows"]:
            for which, entry in enumerate(MATVEC_ENTRIES):
                m = {n: row["median"].get(n, [None] * len(MATVEC_ENTRIES))[which]
                     for n in names}
                rows.append([p, str(row["K"]), entry, *(fmt(m[n], "ms") for n in names),
                             *(fmt(ratio(m[a], m[b]), "x") for a, b in pairs)])
    print_table(f"matvec, M={args.size}: per call (ms), max over ranks of the median of "
                f"{args.repeat} interleaved calls", header, rows)
    timed = present(results, MATVEC, "first")
    header = ["P", "K", *(f"{n} {e}" for n in timed for e in ("run", "tot")),
              *(f"err {n}" for n in timed)]
    rows = [[p, str(row["K"]), *(fmt(t, "s") for n in timed for t in row["first"][n]),
             *(fmt(row["error"][n], "e") for n in timed)]
            for p, r in results.items() for row in r["rows"]]
    print_table("matvec first call (s): creation + first run, first compute_totals; "
                "max relative error", header, rows)
    forward_table({p: r["forward"] for p, r in results.items() if r.get("forward")})


def forward_table(results):
    if not results:
        return
    names = [n for n in ("lean", "nofuse") if any(f"{n}/1" in r["median"]
                                                  for r in results.values())]
    hand = all("hand/1" in r["median"] for r in results.values())
    header = ["P", "K", "entry", *(c for n in names for c in (f"{n} 1", f"{n} K", "K/1")),
              *(["nofuse/lean"] if len(names) == 2 else []),
              *(["hand 1", "hand K", "bound K/1"] if hand and "lean" in names else []),
              *(f"calls {n} {k}" for n in names for k in ("1", "K")),
              *(f"err {n}" for n in names)]
    rows = []
    for p, r in results.items():
        for k in r["K"]:
            for which, entry in enumerate(("run", "compute_totals")):
                one = {n: r["median"][f"{n}/1"][which] for n in names}
                many = {n: r["median"][f"{n}/{k}"][which] for n in names}
                rows.append([p, str(k), entry,
                             *(c for n in names for c in (fmt(one[n], "ms"), fmt(many[n], "ms"),
                                                          fmt(many[n] / one[n], "x"))),
                             *([fmt(many["nofuse"] / many["lean"], "x")] if len(names) == 2
                               else []),
                             *(_bound(r, k, which, one["lean"]) if hand and "lean" in names
                               else []),
                             *(str(r["calls"][f"{n}/{j}"]) for n in names for j in (1, k)),
                             *(fmt(r["error"][f"{n}/{k}"], "e") for n in names)])
    print_table("matvec forward variant: K independent operator calls on one x against one "
                "(K=1), per call (ms); calls: host calls per compute_totals", header,
                rows)


def _bound(r, k, which, lean_one):
    """hand 1, hand K, and the K/1 distop would reach if it added nothing per operator
    call to one call's cost but the users' own work: (lean 1 + hand K - hand 1) / lean 1."""
    one, many = r["median"]["hand/1"][which], r["median"][f"hand/{k}"][which]
    return [fmt(one, "ms"), fmt(many, "ms"), fmt((lean_one + many - one) / lean_one, "x")]


def chain_tables(results, args):
    header = ["P", "N", "R", "model", "1st run (s)", "1st tot (s)", "run (ms)", "tot (ms)",
              "run/op (us)", "tot/op (us)", "calls", "err"]
    rows = []
    for p, r in results.items():
        for row in r["rows"]:
            n = row["N"]
            for key, (run, tot) in row["median"].items():
                rows.append([p, str(n), str(row["repeat"]), key,
                             *(fmt(t, "s") for t in row["first"][key]),
                             fmt(run, "ms"), fmt(tot, "ms"), fmt(run / n, "us"),
                             fmt(tot / n, "us"), str(row["calls"][key]),
                             fmt(row["error"][key], "e")])
    print_table(f"N operator calls: one chain, or {GROUPS} independent chains of N/{GROUPS} "
                "written chain after chain (groups) or step by step (layers), or one chain "
                "y = -op(y) (negated: no call fuses); median of R interleaved calls",
                header, rows)


def message_tables(results, args):
    names = present(results, ("hand", "floor", "distop", "mpi4jax"))
    header = ["P", "m", *names, "distop/hand", "distop/floor", "floor/hand",
              *(["mpi4jax/hand"] if "mpi4jax" in names else []), "1st distop (s)", "err"]
    rows = []
    for p, r in results.items():
        for row in r["rows"]:
            m = row["median"]
            rows.append([p, str(row["m"]), *(fmt(m[n], "ms") for n in names),
                         fmt(ratio(m["distop"], m["hand"]), "x"),
                         fmt(ratio(m["distop"], m["floor"]), "x"),
                         fmt(ratio(m["floor"], m["hand"]), "x"),
                         *([fmt(ratio(m["mpi4jax"], m["hand"]), "x")] if "mpi4jax" in names
                           else []),
                         fmt(row["first"]["distop"], "s"), fmt(row["error"], "e")])
    print_table(f"message size: one Allreduce of m doubles, per call (ms), median of "
                f"{args.repeat} interleaved calls", header, rows)


def large_tables(results, args):
    header = ["P", "M", "K", "R", "entry", "hand", "lean", "lean/hand", "1st lean (s)", "err"]
    rows = []
    for p, r in results.items():
        for row in r["rows"]:
            for which, entry in enumerate(("run", "compute_totals")):
                m = {n: row["median"][n][which] for n in ("hand", "lean")}
                rows.append([p, str(row["M"]), str(row["K"]), str(row["repeat"]), entry,
                             fmt(m["hand"], "ms"), fmt(m["lean"], "ms"),
                             fmt(m["lean"] / m["hand"], "x"),
                             fmt(row["first"]["lean"][which], "s"), fmt(row["error"], "e")])
    print_table("large sparse matvec: per call (ms), median of R interleaved calls", header,
                rows)


def overhead_tables(results, args):
    header = ["P", "method", "HostCall", "empty prog", "prog 1", "prog 16 fused",
              "prog 1+dot", "run()", "run(x=)", "distop/call", "handler+FFI", "per fused",
              "run extra", "new input"]
    rows = []
    for p, r in results.items():
        m = r["rows"][0]["median"]
        rows.append([p, *(fmt(m[n], "us") for n in ("method", "HostCall", "empty program",
                                                      "program 1 call", "program 16 fused",
                                                      "program 1 call + product",
                                                      "Problem.run", "Problem.run(x=)")),
                     fmt(m["HostCall"] - m["method"], "us"),
                     fmt(m["program 1 call"] - m["empty program"] - m["HostCall"], "us"),
                     fmt((m["program 16 fused"] - m["program 1 call"]) / 15, "us"),
                     fmt(m["Problem.run"] - m["program 1 call"], "us"),
                     fmt(m["Problem.run(x=)"] - m["Problem.run"], "us")])
    print_table("distop's own work per call (us, medians): an operator on 8 doubles, no "
                "communication; '1 async': one process with JAX's async dispatch kept",
                header, rows)


def stencil_module():
    """**Returns:** benchmarks/stencil.py as a module (its jobs and tables)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stencil", HERE.parent / "stencil.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stencil_settings(args):
    """**Returns:** benchmarks/stencil.py's settings for the suite's `stencil` section:
    its defaults, with the suite's ranks, sizes, repeats and timeout."""
    return argparse.Namespace(
        ranks=args.ranks, sizes=args.stencil_sizes, steps=50, split=[25, 100],
        repeat=min(args.repeat, 15), micro_repeat=min(args.repeat, 40),
        sections=["heat", "collectives", "micro"], timeout=args.timeout, bind=True)


def stencil_tables(results, args):
    stencil_module().print_tables(results, stencil_settings(args))


TABLES = {"matvec": matvec_tables, "chain": chain_tables, "message": message_tables,
          "large": large_tables, "overhead": overhead_tables, "stencil": stencil_tables}


def run_section(section, args):
    """Run a section under every rank count it needs and print its tables.

    **Returns:** `(results, failures)`: ranks (as a string) -> worker result; reports.
    """
    results, failures = {}, []
    ranks_of = {"chain": args.chain_ranks, "large": args.large_ranks}
    jobs = [(str(ranks), section, ranks, None, HERE, None)
            for ranks in ranks_of.get(section, args.ranks)]
    if section == "overhead":  # JAX's async dispatch kept, one process
        jobs.append(("1 async", section, 1, {"DISTOP_ASYNC_DISPATCH": "1"}, HERE, None))
    if section == "stencil":  # benchmarks/stencil.py's jobs, run by its own workers
        stencil = stencil_module()
        jobs = [(key, worker, ranks, None, stencil.HERE, options) for key, worker, ranks,
                options in stencil.jobs(stencil_settings(args))]
    for key, worker_section, ranks, extra_env, script, options in jobs:
        start = time.perf_counter()
        result, report = launch(worker_section, ranks, args, extra_env, script, options)
        print(f"# {section} on {key} rank(s): {time.perf_counter() - start:.1f} s"
              + ("" if report is None else ", FAILED"), file=sys.stderr, flush=True)
        if report is None:
            results[key] = result
        else:
            failures.append({"section": section, "ranks": key, "report": report})
            print(f"\n# FAILED: {section} on {key} rank(s): {report}", flush=True)
    if results:
        TABLES[section](results, args)
    return results, failures


def notes(results):
    """**Returns:** lines about the setup, from the workers' results."""
    every = [r for section in results.values() for r in section.values()]
    if not every:
        return []
    lines = [f"# jax {every[0]['jax']}, distop {every[0]['distop']}, {every[0]['mpi']}"]
    lines += sorted({f"# note: {note}; its columns are left out"
                     for r in every for note in r["missing"]})
    return lines


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--ranks", type=int, nargs="+")
    parser.add_argument("--chain-ranks", type=int, nargs="+")
    parser.add_argument("--large-ranks", type=int, nargs="+")
    parser.add_argument("--large-size", type=lambda s: int(float(s)))
    parser.add_argument("--stencil-sizes", type=int, nargs="+")
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--size", type=int, default=400)
    parser.add_argument("--objectives", type=int, nargs="+")
    parser.add_argument("--ops", type=int, nargs="+")
    parser.add_argument("--messages", type=lambda s: int(float(s)), nargs="+")
    parser.add_argument("--chain-io-cb", type=int, default=100,
                        help="also time backend io_callback up to this N")
    parser.add_argument("--timeout", type=float, help="seconds per mpiexec job")
    parser.add_argument("--json", default=str(HERE.parent / "results.json"))
    parser.add_argument("--worker", choices=SECTIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def recorded_path(path):
    """Return `path` as the results file records it, so it names no other machine's folders.

    **Arguments:**

    - `path`: where the results are written.

    **Returns:** the path relative to the repository root when it lies inside it, else
    only its file name.
    """
    path = pathlib.Path(path).resolve()
    root = HERE.parent.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else path.name


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    results, failures = {}, []
    for section in args.sections:
        results[section], failed = run_section(section, args)
        failures += failed
    for line in ["", *notes(results)]:
        print(line)
    with open(args.json, "w") as f:
        json.dump({"settings": {**{k: v for k, v in vars(args).items() if k != "worker"},
                                "json": recorded_path(args.json)},
                   "results": results, "failures": failures}, f, indent=1)
    print(f"# results written to {args.json}"
          + (f"; {len(failures)} job(s) FAILED" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
