"""python benchmarks/stencil.py [--ranks 1 2 4] [--sizes 96 384] [--repeat 15] [--no-bind]

The users' workload: the 2-D heat equation on an n x n grid split by rows, S explicit
steps, each step `distop.HaloExchange(width=1)` then a 5-point stencil in jax.numpy
(zero boundary); objective 0.5 ||u_S - d||^2 summed over the ranks by
`distop.AllreduceSum`; the gradient with respect to u0 (distributed) by
`Problem.compute_totals`. One job per rank count and size; every variant runs side by
side, interleaved call by call (a new order each round, the same on every rank); each
figure is the max over ranks of each rank's median.

Each rank is bound to a core of its own (the i-th of the cores the job may use, by its
rank on the machine) where there are as many, as `srun --cpu-bind=cores` and `mpiexec
-bind-to core` do:
XLA then runs each rank's program on one thread, as numpy runs the hand-written one.
`--no-bind` leaves the ranks unbound: every rank's XLA then keeps a pool of threads for
every core of the machine, and on a crowded machine their wake-ups cost more than the
work of small blocks. The tables say which was used.

Variants:
- `scan`: the steps as `lax.scan` in the model; `python`: as a Python loop (unrolled
  when traced);
- `hand`: numpy + mpi4py: the same steps with two `Sendrecv` per step; the gradient by
  the adjoint steps (the step is symmetric: the same stencil on the cotangent, with its
  own two `Sendrecv`);
- `jax`: on one rank, plain JAX: `jax.jit(f)` and `jax.jit(jax.grad(f))` of the same
  steps (`jnp.pad` for the halo), no MPI.
- `floor`: on every rank, the scan in plain JAX with a no-op XLA FFI call (a ctypes
  handler copying its operand, `xla_loops.ffi_identity`) on the block's edge rows in
  place of the exchange, and on their cotangent in the reverse loop: what the loop
  costs with a host call per step, without distop's work or messages.

The first table: `run` and the gradient per rank count and size, S steps, with the
ratios to `hand`. The second: the cost per step, from S1 and S2 steps in a scan
((t(S2) - t(S1)) / (S2 - S1)), split into the forward step (`run`) and the reverse
step (the gradient's step less the forward's), distop against `hand` and against
`floor` (what distop adds to the loop's own cost).

The built-in reductions in a loop (`collectives`, one job per rank count, at the first
size): `AllreduceSum`, `Allreduce(op="max")` and `Allgather` once per step, against
the same loop by hand (see `loop_collectives.py`).

The last (`micro`, one job per rank count): an operator whose methods do no work,
called S times in a `lax.scan`, per host call: distop's forward and VJP calls against
the bare FFI call, a no-op handler registered the way distop registers its own (a
ctypes function answering XLA's metadata query, writing the token), called the same
way in the same job. `own`: what distop adds per call beyond the bare call.
"""

import argparse
import ctypes as C
import json
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve()
sys.path[:0] = [str(HERE.parent)]
import loop_collectives  # noqa: E402
import xla_loops  # noqa: E402
from suite import MARK, fmt, launch, print_table, ratio  # noqa: E402

DIFFUSION = 0.2  # the stencil's coefficient (stable below 0.25)
STARTED = time.perf_counter()


# -- worker side: runs under mpiexec -------------------------------------------------
def interleaved(comm, variants, repeat):
    """**Returns:** {name: max over ranks of the median seconds} of every variant, run
    `repeat` rounds, interleaved, a new order each round (the same on every rank)."""
    from mpi4py import MPI

    times = {name: [] for name in variants}
    for fn in variants.values():  # (warm: compiled and run once)
        fn()
    names = list(variants)
    for round_ in range(repeat):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            comm.Barrier()
            started = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - started)
    return {name: comm.allreduce(statistics.median(t), op=MPI.MAX) for name, t in times.items()}


def bind(comm):
    """Bind this rank to a core of its own, where the cores it may use are at least as
    many as the ranks on this machine; call it before JAX starts.

    **Returns:** whether it was bound.
    """
    import os

    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    cores = sorted(os.sched_getaffinity(0))
    rank, size = local.Get_rank(), local.Get_size()
    local.Free()
    if len(cores) < size:
        return False
    os.sched_setaffinity(0, {cores[rank]})
    return True


def report(comm, result, args):
    """Print `result` on rank 0 as the suite's workers do: one JSON line, with the
    versions, the job's time so far and whether its ranks were bound to cores."""
    import jax
    from mpi4py import MPI

    import distop

    result.update(seconds=time.perf_counter() - STARTED, jax=jax.__version__, bound=args.bound,
                  distop=distop.__version__, missing=[],
                  mpi=" ".join(MPI.Get_library_version().splitlines()[0].split()))
    if comm.Get_rank() == 0:
        print(MARK + json.dumps(result), flush=True)


def rows_of(n, size, rank):
    """**Returns:** this rank's rows of n, split as evenly as possible."""
    return n // size + (rank < n % size)


def jax_step(u, halo):
    """One explicit step of the heat equation on the window `halo` of the block `u`."""
    import jax.numpy as jnp

    left = jnp.pad(u[:, :-1], ((0, 0), (1, 0)))
    right = jnp.pad(u[:, 1:], ((0, 0), (0, 1)))
    return u + DIFFUSION * (halo[:-2] + halo[2:] + left + right - 4 * u)


def distop_models(steps):
    """**Returns:** {"scan": model, "python": model} of `steps` steps, with `d`."""
    import jax.numpy as jnp
    from jax import lax

    import distop

    halo, total = distop.HaloExchange(width=1), distop.AllreduceSum()

    def step(u):
        return jax_step(u, halo(u))

    def finish(u, d):
        return {"f": total(0.5 * jnp.sum((u - d) ** 2))}

    def scan(u, d):
        return finish(lax.scan(lambda u, _: (step(u), None), u, None, length=steps)[0], d)

    def python(u, d):
        for _ in range(steps):
            u = step(u)
        return finish(u, d)

    return {"scan": scan, "python": python}


def floor_program(identity, steps, d):
    """**Returns:** jitted (value, gradient) of the scan model in plain JAX with the
    exchange replaced by `identity`, a no-op FFI call on the block's edge rows (and on
    their cotangent in the reverse loop): the loop's cost with a host call per step, but
    neither distop nor messages."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def window(u):
        halo = identity(jnp.concatenate([u[:1], u[-1:]]))
        return jnp.concatenate([halo[:1], u, halo[1:]])

    def model(u):
        u = lax.scan(lambda u, _: (jax_step(u, window(u)), None), u, None, length=steps)[0]
        return 0.5 * jnp.sum((u - d) ** 2)

    return jax.jit(model), jax.jit(jax.grad(model))


class Hand:
    """The heat equation by hand: numpy + mpi4py, two `Sendrecv` per step, every
    operation into buffers made once."""

    def __init__(self, comm, u0, d):
        import numpy as np
        from mpi4py import MPI

        self.comm, self.u0, self.d = comm, u0, d
        rank, size = comm.Get_rank(), comm.Get_size()
        self.prev = rank - 1 if rank > 0 else MPI.PROC_NULL
        self.next = rank + 1 if rank < size - 1 else MPI.PROC_NULL
        self.window = np.zeros((u0.shape[0] + 2, u0.shape[1]))  # the block and its halo
        self.states = [np.empty_like(u0), np.empty_like(u0)]  # (taken in turn)
        self.sum = np.empty_like(u0)

    def step(self, u):
        """**Returns:** the next state (one of two buffers, taken in turn)."""
        import numpy as np

        w, comm, c = self.window, self.comm, DIFFUSION
        w[1:-1] = u
        w[0] = 0.0  # (PROC_NULL at a global end: nothing received, the zero stays)
        w[-1] = 0.0
        comm.Sendrecv(u[0], dest=self.prev, recvbuf=w[-1], source=self.next)
        comm.Sendrecv(u[-1], dest=self.next, recvbuf=w[0], source=self.prev)
        new = self.states[0] if u is not self.states[0] else self.states[1]
        np.add(w[:-2], w[2:], out=self.sum)
        self.sum[:, 1:] += u[:, :-1]
        self.sum[:, :-1] += u[:, 1:]
        np.multiply(u, 1 - 4 * c, out=new)
        self.sum *= c
        new += self.sum
        return new

    def run(self, steps):
        u = self.u0
        for _ in range(steps):
            u = self.step(u)
        return u

    def value(self, steps):
        from mpi4py import MPI

        u = self.run(steps)
        return self.comm.allreduce(0.5 * float(((u - self.d) ** 2).sum()), op=MPI.SUM)

    def gradient(self, steps):
        """**Returns:** this rank's block of the gradient (a copy)."""
        # the step is symmetric: its adjoint is the same stencil on the cotangent
        u_bar = self.run(steps) - self.d
        for _ in range(steps):
            u_bar = self.step(u_bar)
        return u_bar.copy()


def heat_worker(args):
    """Times of every heat-equation variant at one size on every rank; rank 0 prints
    the result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD
    size, rank, n = comm.Get_size(), comm.Get_rank(), args.size
    rng = np.random.default_rng([rank, n])
    rows = rows_of(n, size, rank)
    start = sum(rows_of(n, size, r) for r in range(rank))
    u0 = rng.standard_normal((rows, n))
    d = rng.standard_normal(u0.shape)
    raw = comm.Dup()
    hand = Hand(raw, u0, d)

    def problem(model, steps):
        made = distop.Problem(lambda u: model(u, d), {"u": u0}, distributed={"u"})
        return made, lambda: made.compute_totals("f", "u")["f", "u"]

    S, (S1, S2) = args.steps, args.split
    variants, checks = {}, {}
    identity, device_u0 = xla_loops.ffi_identity(), jnp.asarray(u0)
    for kind, model in distop_models(S).items():
        made, grad = problem(model, S)
        variants[f"{kind} run"], variants[f"{kind} grad"] = made.run, grad
        checks[kind] = (made, grad)
    variants["hand run"] = lambda: hand.value(S)
    variants["hand grad"] = lambda: hand.gradient(S)
    for steps in (S1, S2):
        made, grad = problem(distop_models(steps)["scan"], steps)
        variants[f"scan run {steps}"], variants[f"scan grad {steps}"] = made.run, grad
        variants[f"hand run {steps}"] = lambda steps=steps: hand.value(steps)
        variants[f"hand grad {steps}"] = lambda steps=steps: hand.gradient(steps)
        value, gradient = floor_program(identity, steps, d)
        variants[f"floor run {steps}"] = lambda f=value: f(device_u0).block_until_ready()
        variants[f"floor grad {steps}"] = lambda f=gradient: f(device_u0).block_until_ready()
    if size == 1:
        def plain(u):
            u = lax.scan(lambda u, _: (jax_step(u, jnp.pad(u, ((1, 1), (0, 0)))), None),
                         u, None, length=S)[0]
            return 0.5 * jnp.sum((u - d) ** 2)

        value, gradient = jax.jit(plain), jax.jit(jax.grad(plain))
        variants["jax run"] = lambda: value(device_u0).block_until_ready()
        variants["jax grad"] = lambda: gradient(device_u0).block_until_ready()
    # every variant's values and gradients against the hand-written ones
    exact_f, exact_g = hand.value(S), hand.gradient(S)
    err = 0.0
    for made, grad in checks.values():
        f = float(np.asarray(made.run()["f"]))
        err = max(err, abs(f - exact_f) / abs(exact_f),
                  float(np.max(np.abs(np.asarray(grad()).reshape(n, n)[start:start + rows]
                                 - exact_g)))
                  / float(np.max(np.abs(exact_g))))
    result = interleaved(comm, variants, args.repeat)
    result["err"] = comm.allreduce(err, op=MPI.MAX)
    report(comm, result, args)


# -- the microbenchmark: host calls that do no work, against the bare FFI call ---------
class BareCall:
    """A no-op XLA FFI handler registered as distop registers its own: a ctypes
    function that answers XLA's metadata query and writes the token plus one."""

    TARGET = "distop_bench_bare_call"

    def __init__(self):
        import jax

        from distop._hostcalls import ffi
        from distop._hostcalls.xla_ffi import EXECUTE, METADATA, Buffer, CallFrame

        data = Buffer.data.offset

        def handler(frame_pointer):
            frame = frame_pointer.contents
            extension = frame.extension_start
            if extension and extension.contents.type == METADATA:
                ffi._answer(frame_pointer, extension)  # (the check distop makes too)
                return None
            if frame.stage == EXECUTE:
                token = C.c_void_p.from_address(frame.args.values[0] + data).value
                out = C.c_void_p.from_address(frame.rets.values[0] + data).value
                C.c_double.from_address(out).value = C.c_double.from_address(token).value + 1
            return None

        self.handler = C.CFUNCTYPE(C.c_void_p, C.POINTER(CallFrame))(handler)
        jax.local_devices(backend="cpu")
        jax.ffi.register_ffi_target(
            self.TARGET, jax.ffi.pycapsule(C.cast(self.handler, C.c_void_p).value),
            platform="cpu")

    def program(self, steps):
        """**Returns:** a jitted function of (token, u): `steps` bare calls in a scan."""
        import jax
        import numpy as np
        from jax import lax

        def body(carry, _):
            token, u = carry
            token, u = jax.ffi.ffi_call(self.TARGET, (
                jax.ShapeDtypeStruct((), token.dtype),
                jax.ShapeDtypeStruct(u.shape, u.dtype)))(token, u, call_id=np.int64(1))
            return (token, u * 1.0001), None

        return jax.jit(lambda token, u: lax.scan(body, (token, u), None, length=steps)[0])


def micro_worker(args):
    """Per host call: distop's forward and VJP calls of a no-op operator in a scan,
    and the bare FFI call, on every rank; rank 0 prints the result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    comm = MPI.COMM_WORLD

    class Nothing(distop.DistributedOperator):
        """y = x, whose methods do no work: they return XLA's result buffers as given."""

        linear = True
        ordered = True  # (the lean path's ordered call, as a communicating one makes)

        def forward(self, comm, x, out=None):
            return np.empty_like(x) if out is None else out

        def vjp(self, comm, y_bar, x, out=None):
            return np.empty_like(x) if out is None else out

    op, bare, u0, token = Nothing(), BareCall(), np.ones(8), np.zeros(())
    variants = {}
    for steps in args.split:
        def model(u, steps=steps):
            return {"f": jnp.sum(lax.scan(lambda u, _: (op(u) * 1.0001, None), u, None,
                                          length=steps)[0])}

        made = distop.Problem(model, {"u": u0})
        variants[f"run {steps}"] = made.run
        variants[f"grad {steps}"] = lambda made=made: made.compute_totals("f", "u")
        program = bare.program(steps)
        variants[f"bare {steps}"] = lambda p=program: jax.block_until_ready(p(token, u0))
    report(comm, interleaved(comm, variants, args.repeat), args)


# -- driver side -----------------------------------------------------------------------
def per_step(r, name, split):
    s1, s2 = split
    return (r[f"{name} {s2}"] - r[f"{name} {s1}"]) / (s2 - s1)


def jobs(args):
    """**Returns:** (key, worker, ranks, options) of every job: one per section, rank
    count and (for `heat`) size; the suite runs the same jobs."""
    common = ["--steps", str(args.steps), "--split", *map(str, args.split),
              "--repeat", str(args.repeat), "--micro-repeat", str(args.micro_repeat)]
    if not args.bind:
        common.append("--no-bind")
    found = []
    for section in args.sections:
        for ranks in args.ranks:
            for n in args.sizes if section == "heat" else [None]:
                key = f"{section} {ranks}" + ("" if n is None else f" {n}")
                size = args.sizes[0] if n is None else n
                found.append((key, section, ranks, common + ["--size", str(size)]))
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[96, 384])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--split", type=int, nargs=2, default=[25, 100],
                        help="the two step counts of the per-step table")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--micro-repeat", type=int, default=40)
    parser.add_argument("--sections", nargs="+", default=["heat", "collectives", "micro"],
                        choices=["heat", "collectives", "micro"])
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--no-bind", dest="bind", action="store_false",
                        help="leave the ranks unbound (see above)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=96, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.worker == "micro":
            args.repeat = args.micro_repeat
        from mpi4py import MPI

        args.bound = args.bind and bind(MPI.COMM_WORLD)
        if args.worker == "collectives":
            return loop_collectives.worker(args, rows_of, interleaved, report)
        return {"heat": heat_worker, "micro": micro_worker}[args.worker](args)
    results, failed = {}, False
    for key, section, ranks, options in jobs(args):
        started = time.perf_counter()
        r, failure = launch(section, ranks, args, script=HERE, options=options)
        print(f"# {key}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if failure:
            print(failure, file=sys.stderr)
            failed = True
        else:
            results[key] = r
    print_tables(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k != "worker"},
                       "results": results}, f, indent=1)
    return 1 if failed else 0


def binding(results):
    """**Returns:** how the ranks of the jobs in `results` were placed, for the tables'
    titles."""
    bound = {r.get("bound") for r in results.values()}
    return {frozenset({True}): "each rank bound to a core",
            frozenset({False}): "ranks unbound"}.get(frozenset(bound),
                                                     "some jobs' ranks bound to cores")


def print_tables(results, args):
    """Print the heat equation's tables and the microbenchmark's, from `results` (keyed
    as `jobs` names them)."""
    S, split = args.steps, args.split
    placed = binding(results)
    rows, steps = [], []
    for key, r in results.items():
        if not key.startswith("heat "):
            continue
        ranks, n = key.split()[1:]
        for kind in ("scan", "python"):
            rows.append([ranks, n, kind, fmt(r["hand run"], "ms"), fmt(r[f"{kind} run"], "ms"),
                         fmt(ratio(r[f"{kind} run"], r["hand run"]), "x"),
                         fmt(r["hand grad"], "ms"), fmt(r[f"{kind} grad"], "ms"),
                         fmt(ratio(r[f"{kind} grad"], r["hand grad"]), "x"),
                         fmt(r.get("jax run"), "ms"), fmt(r.get("jax grad"), "ms"),
                         fmt(r["err"], "e")])
        ways = ("scan", "hand", "floor")
        fwd = {w: per_step(r, f"{w} run", split) for w in ways}
        grad = {w: per_step(r, f"{w} grad", split) for w in ways}
        rev = {w: grad[w] - fwd[w] for w in ways}
        steps.append([ranks, n, fmt(fwd["hand"], "us"), fmt(fwd["scan"], "us"),
                      fmt(fwd["scan"] - fwd["hand"], "us"), fmt(rev["hand"], "us"),
                      fmt(rev["scan"], "us"), fmt(rev["scan"] - rev["hand"], "us"),
                      fmt(grad["hand"], "us"), fmt(grad["scan"], "us"),
                      fmt(ratio(grad["scan"], grad["hand"]), "x"),
                      fmt(ratio(rev["scan"], fwd["scan"]), "x"),
                      fmt(fwd["floor"], "us"), fmt(rev["floor"], "us"),
                      fmt(fwd["scan"] - fwd["floor"], "us"),
                      fmt(rev["scan"] - rev["floor"], "us")])
    if rows:
        print_table(f"heat equation, {S} steps, {placed}: run and gradient (ms), max over ranks of "
                    f"the median of {args.repeat} interleaved calls; err: distop against "
                    "hand (values and gradients)",
                    ["P", "n", "model", "hand run", "run", "run/hand", "hand grad", "grad",
                     "grad/hand", "jax run", "jax grad", "err"], rows)
        print_table(f"heat equation in a scan, {placed}, per step (us), from {split[0]} "
                    f"and {split[1]} steps: the forward step (run), the reverse step "
                    "(gradient less forward), and the gradient's step; floor: the same "
                    "loop in plain JAX with a no-op FFI call on the edge rows in place of "
                    "the exchange (no distop, no messages), and distop beyond it",
                    ["P", "n", "hand fwd", "fwd", "fwd-hand", "hand rev", "rev", "rev-hand",
                     "hand grad", "grad", "grad/hand", "rev/fwd", "floor fwd", "floor rev",
                     "fwd-floor", "rev-floor"], steps)
    collectives = loop_collectives.rows(results, fmt, ratio)
    if collectives:
        print_table(f"built-in reductions, once per step of {S} in a scan, n = "
                    f"{args.sizes[0]}, {placed}: run and gradient (ms), against the same "
                    "loop by hand; err: distop against hand",
                    ["P", "collective", "hand run", "run", "run/hand", "hand grad", "grad",
                     "grad/hand", "jax run", "jax grad", "err"], collectives)
    micro = []
    for key, r in results.items():
        if not key.startswith("micro "):
            continue
        ranks = key.split()[1]
        fwd, grad, bare = (per_step(r, name, split) for name in ("run", "grad", "bare"))
        vjp = grad - fwd
        micro.append([ranks, fmt(bare, "us"), fmt(fwd, "us"), fmt(vjp, "us"),
                      fmt(fwd - bare, "us"), fmt(vjp - bare, "us")])
    if micro:
        print_table(f"host calls that do no work, in a scan, {placed}, per call (us), from "
                    f"{split[0]} and {split[1]} calls: the bare FFI call, distop's "
                    "forward and VJP calls, and distop's own work beyond the bare call",
                    ["P", "bare", "forward", "vjp", "own fwd", "own vjp"], micro)


if __name__ == "__main__":
    sys.exit(main())
