"""mpiexec -n 4 python benchmarks/matvec.py

The distributed matvec scenario (M=400, K objectives f_k = w_k . y, y = (sum_r A_r) x),
timed side by side in one run, interleaved call by call:
- `hand`: a hand-written numpy + mpi4py script computing the same values and gradients
  (forward Allreduce; gradients with K per-objective Allreduces, `hand-K`, or one
  batched Allreduce of the (K, M) block, `hand`);
- `floor`: the same jnp work in one jitted program with one bare ordered io_callback in
  the forward and one batched one in the reverse, each doing only the hand-written
  numpy + Allreduce work: the floor of any design built on ordered io_callbacks;
- `distop`: `Problem.run` and `Problem.compute_totals()` (batched mode), default
  settings (the lean host-call path); `io_cb`: the same with
  `backend="io_callback"` (JAX's ordered io_callback); `no-watch`: the same with the
  watchdog off (the cost of the default safety net); `checking`: with the run-time
  checking mode on (DISTOP_CHECK_COLLECTIVES=1);
- `naive`: distop with `ordered=False` and `mode="unrolled"`: per-objective unordered
  pure callbacks, the lowering graph frameworks emit today (its error is printed too).
Per-call times are the max over ranks of the median over `--repeat` calls; first-call
times include tracing and compiling. Options: --objectives 1 16 64, --size M, --repeat R.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import distributed_matvec as dm  # noqa: E402

import distop  # noqa: E402

jax.config.update("jax_enable_x64", True)
comm = MPI.COMM_WORLD


_transposes = {}  # id(a_local) -> (a_local, its transpose): made once, as a script would


def transpose(a_local):
    """**Returns:** `a_local.T` as CSR, made on first use."""
    found = _transposes.get(id(a_local))
    if found is None or found[0] is not a_local:
        found = _transposes[id(a_local)] = (a_local, a_local.T.tocsr())
    return found[1]


def hand_written(a_local, w, x, batched=True, gradients=True):
    """Values and (optionally) gradients with numpy + mpi4py only."""
    y = np.empty(a_local.shape[0])
    comm.Allreduce(a_local @ x, y, op=MPI.SUM)
    f = w @ y
    if not gradients:
        return f
    if batched:
        local = np.ascontiguousarray((transpose(a_local) @ w.T).T)
        grads = np.empty_like(local)
        comm.Allreduce(local, grads, op=MPI.SUM)
    else:
        grads = np.empty_like(w)
        for k in range(w.shape[0]):
            comm.Allreduce(np.ascontiguousarray(transpose(a_local) @ w[k]), grads[k],
                           op=MPI.SUM)
    return f, grads


class _BareCall:
    """A host call for distop's FFI target with none of distop's own work: XLA's
    buffers as numpy views in, `work(*args, out)` writes the result."""

    lean = True
    gate = None  # (no agreement for its first call to make: see `HostCallable.gate`)

    def __init__(self, work):
        self.work, self.ffi_id = work, None

    def __call__(self, *args, out):
        self.work(*args, out[0])
        return out


def ffi_floor_programs(a_local, w, size):
    """`floor_programs` on distop's FFI host call instead of io_callback: the same jnp
    work, each host call a bare call of the FFI target (its Python handler, numpy views
    of XLA's buffers, the token chain) doing only the hand-written work, with nothing
    of distop's own (no checks, no Problem): the floor of the lean path.

    **Returns:** `(run, totals)`, each a function of x."""
    from distop._hostcalls import ffi as _ffi

    def forward(x, y):
        comm.Allreduce(a_local @ x, y, op=MPI.SUM)

    def backward(y_bar, x_bar):
        comm.Allreduce(np.ascontiguousarray((transpose(a_local) @ y_bar.T).T), x_bar,
                       op=MPI.SUM)

    token = jnp.zeros((), jnp.float64)
    ids = [_ffi.register(_BareCall(work)) for work in (forward, backward)]

    def host(which, shape, *args):
        call = jax.ffi.ffi_call(_ffi.TARGET, (jax.ShapeDtypeStruct((), jnp.float64),
                                             jax.ShapeDtypeStruct(shape, jnp.float64)))
        return call(*args, call_id=np.int64(ids[which]))

    def run(t, x):
        t, y = host(0, (size,), t, x)
        return w @ y, t

    def totals(t, x):
        t, y = host(0, (size,), t, x)
        t, grads = host(1, w.shape, t, jnp.eye(w.shape[0]) @ w)
        return (w @ y, grads), t

    run, totals = jax.jit(run), jax.jit(totals)
    return (lambda x: run(token, x)[0]), (lambda x: totals(token, x)[0])


def one_dispatch():
    """**Returns:** a jitted program taking the matvec's x and returning a scalar, made
    and compiled once: the least JAX work a design that runs its model as one jitted
    program per call adds to the hand-written script (`hand_and_dispatch`)."""
    return jax.jit(lambda x: x[0])


def hand_and_dispatch(program, a_local, w, x, x_jax, gradients=True):
    """`hand_written`, after one dispatch of `program` (see `one_dispatch`) on `x_jax`:
    the floor of any design that runs one JAX program per call, on the same work."""
    program(x_jax).block_until_ready()
    return hand_written(a_local, w, x, gradients=gradients)


def hand_operators(a_local, w, x, gradients=False):
    """The forward variant by hand: K operator calls on x, each a matvec and its own
    Allreduce, f_k = w_k . y_k; with `gradients`, the K gradients alone (what distop's
    `compute_totals` computes), each through its operator's VJP and its own Allreduce.
    The work of the K users' methods, without any framework."""
    out = np.empty((w.shape[0], a_local.shape[1] if gradients else a_local.shape[0]))
    for k in range(w.shape[0]):
        local = transpose(a_local) @ w[k] if gradients else a_local @ x
        comm.Allreduce(local, out[k], op=MPI.SUM)
    return out if gradients else np.einsum("km,km->k", w, out)


def floor_programs(a_local, w, size):
    """Jitted programs with the same jnp work and bare ordered callbacks."""
    spec = jax.ShapeDtypeStruct((size,), jnp.float64)

    def forward(x):
        y = np.empty(size)
        comm.Allreduce(a_local @ x, y, op=MPI.SUM)
        return y

    def backward(y_bar):
        local = np.ascontiguousarray((transpose(a_local) @ y_bar.T).T)
        x_bar = np.empty_like(local)
        comm.Allreduce(local, x_bar, op=MPI.SUM)
        return x_bar

    def run(x):
        y = io_callback(forward, spec, x, ordered=True)
        return w @ y

    def totals(x):
        y = io_callback(forward, spec, x, ordered=True)
        f = w @ y
        y_bar = jnp.eye(w.shape[0]) @ w  # one cotangent row per objective
        grads = io_callback(backward, jax.ShapeDtypeStruct(w.shape, jnp.float64), y_bar,
                            ordered=True)
        return f, grads

    return jax.jit(run), jax.jit(totals)


class OpenMDAOMatvec:
    """The matvec scenario as an OpenMDAO model, written as its users would: each rank runs
    its own OpenMDAO problem (`comm=MPI.COMM_SELF`; every rank holds x whole) whose
    matvec component reduces over the ranks, one Allreduce in `compute` and one per
    reverse matrix-free product (`compute_jacvec_product`), and an objectives
    component f = W y with W as its constant partial derivatives. `compute_totals` is
    OpenMDAO's reverse mode: one linear solve per objective, each with its Allreduce,
    in the same order on every rank. The interface is `distop.Problem`'s, as far as the
    benchmarks use it (`run(x=...)`, `compute_totals()`: the K gradients as (1, M)
    blocks).
    """

    def __init__(self, a_local, w, x0):
        import openmdao.api as om

        reduce_comm = comm.Dup()
        a_t = transpose(a_local)

        class Matvec(om.ExplicitComponent):
            def setup(self):
                self.add_input("x", shape=a_local.shape[1])
                self.add_output("y", shape=a_local.shape[0])

            def compute(self, inputs, outputs):
                y = np.empty(a_local.shape[0])
                reduce_comm.Allreduce(a_local @ inputs["x"], y, op=MPI.SUM)
                outputs["y"] = y

            def compute_jacvec_product(self, inputs, d_inputs, d_outputs, mode):
                if mode == "rev" and "x" in d_inputs:
                    total = np.empty(a_local.shape[1])
                    reduce_comm.Allreduce(a_t @ d_outputs["y"], total, op=MPI.SUM)
                    d_inputs["x"] += total

        class Objectives(om.ExplicitComponent):
            def setup(self):
                self.add_input("y", shape=w.shape[1])
                self.add_output("f", shape=w.shape[0])
                self.declare_partials("f", "y", val=w)

            def compute(self, inputs, outputs):
                outputs["f"] = w @ inputs["y"]

        self.k = w.shape[0]
        model = om.Group()
        model.add_subsystem("matvec", Matvec(), promotes=["*"])
        model.add_subsystem("objectives", Objectives(), promotes=["*"])
        self.problem = om.Problem(model, comm=MPI.COMM_SELF, reports=False)
        self.problem.setup(mode="rev", check=False)
        self.problem.set_val("x", x0)
        self.problem.final_setup()

    def run(self, x=None):
        if x is not None:
            self.problem.set_val("x", x)
        self.problem.run_model()
        return {f"f{i}": v for i, v in enumerate(self.problem.get_val("f"))}

    def compute_totals(self, mode=None):
        grads = self.problem.compute_totals(of=["f"], wrt=["x"])["f", "x"]
        return {(f"f{i}", "x"): grads[i:i + 1] for i in range(self.k)}


def without_watchdog(fn):
    def call():
        watchdog = distop.configure().watchdog
        distop.configure(watchdog=0)
        try:
            return fn()
        finally:
            distop.configure(watchdog=watchdog)
    return call


def first_call(fn):
    comm.Barrier()
    t = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - t, op=MPI.MAX)


def measure(k, size, repeat):
    a_local, a_global, x0, w = dm.setup(size, k, comm)
    floor_run, floor_totals = floor_programs(a_local, w, size)
    xj = jnp.asarray(x0)
    first = {}
    first["floor"] = (first_call(lambda: floor_run(xj).block_until_ready()),
                      first_call(lambda: jax.block_until_ready(floor_totals(xj))))
    holder = {}

    def make(name, backend=None, **kw):
        holder[name] = distop.Problem(dm.build(a_local, w, "reverse", **kw), {"x": x0},
                                      backend=backend)
        holder[name].run()

    mode = {"distop": "batched", "naive": "unrolled", "checking": "batched",
            "io_cb": "batched"}
    first["distop"] = (first_call(lambda: make("distop")),
                       first_call(lambda: holder["distop"].compute_totals()))
    first["io_cb"] = (first_call(lambda: make("io_cb", backend="io_callback")),
                      first_call(lambda: holder["io_cb"].compute_totals()))
    first["naive"] = (first_call(lambda: make("naive", ordered=False)),
                      first_call(lambda: holder["naive"].compute_totals(mode="unrolled")))
    distop.configure(check_collectives=True)  # applies to programs traced from now on
    make("checking")
    holder["checking"].compute_totals()
    distop.configure(check_collectives=False)
    first["hand"] = (0.0, 0.0)
    errors = {name: comm.allreduce(dm.errors(holder[name], a_global, x0, w, mode[name]),
                                   op=MPI.MAX) for name in holder}
    calls = {
        "hand": (lambda: hand_written(a_local, w, x0, gradients=False),
                 lambda: hand_written(a_local, w, x0)),
        "hand-K": (lambda: hand_written(a_local, w, x0, gradients=False),
                   lambda: hand_written(a_local, w, x0, batched=False)),
        "floor": (lambda: floor_run(xj).block_until_ready(),
                  lambda: jax.block_until_ready(floor_totals(xj))),
        "distop": (holder["distop"].run, holder["distop"].compute_totals),
        "io_cb": (holder["io_cb"].run, holder["io_cb"].compute_totals),
        "no-watch": (without_watchdog(holder["distop"].run),
                     without_watchdog(holder["distop"].compute_totals)),
        "checking": (holder["checking"].run, holder["checking"].compute_totals),
        "naive": (holder["naive"].run,
                  lambda: holder["naive"].compute_totals(mode="unrolled")),
    }
    times = {(name, which): [] for name in calls for which in (0, 1)}
    for _ in range(repeat):  # interleaved: every variant sees the same machine state
        for name, fns in calls.items():
            for which, fn in enumerate(fns):
                comm.Barrier()
                t = time.perf_counter()
                fn()
                times[name, which].append(time.perf_counter() - t)
    med = {key: comm.allreduce(float(np.median(v)), op=MPI.MAX) for key, v in times.items()}
    return med, first, errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--objectives", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--size", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    rows = []
    for k in args.objectives:
        med, first, errors = measure(k, args.size, args.repeat)
        rows.append((k, med, first, errors))
    if comm.rank != 0:
        return
    print(f"# distributed matvec, {comm.size} ranks, M={args.size}; per call: max over ranks "
          f"of the median of {args.repeat} interleaved calls (ms); jax {jax.__version__}")
    names = ("hand", "hand-K", "floor", "distop", "io_cb", "no-watch", "checking", "naive")
    print(f"{'K':>3} {'entry':<15}" + "".join(f"{n:>9}" for n in names)
          + f"{'d/floor':>9}{'d/hand':>8}{'io/d':>6}{'d/no-w':>8}{'chk/d':>7}{'naive/d':>9}")
    for k, med, _, _ in rows:
        for which, entry in enumerate(("run", "compute_totals")):
            m = {name: 1e3 * med[name, which] for name in names}
            print(f"{k:>3} {entry:<15}" + "".join(f"{m[n]:>9.3f}" for n in names)
                  + f"{m['distop'] / m['floor']:>9.2f}{m['distop'] / m['hand']:>8.2f}"
                  + f"{m['io_cb'] / m['distop']:>6.2f}{m['distop'] / m['no-watch']:>8.2f}"
                  + f"{m['checking'] / m['distop']:>7.2f}"
                  + f"{m['naive'] / m['distop']:>9.2f}")
    print("\n# first call (s): Problem creation + first run, then first compute_totals; "
          "and max relative error of values and gradients")
    print(f"{'K':>3} {'floor run':>10}{'floor tot':>10}{'distop run':>11}{'distop tot':>11}"
          f"{'io_cb run':>10}{'io_cb tot':>10}{'naive run':>10}{'naive tot':>10}"
          f"{'distop err':>11}{'io_cb err':>10}{'naive err':>10}{'check err':>10}")
    for k, _, first, errors in rows:
        print(f"{k:>3} {first['floor'][0]:>10.3f}{first['floor'][1]:>10.3f}"
              f"{first['distop'][0]:>11.3f}{first['distop'][1]:>11.3f}"
              f"{first['io_cb'][0]:>10.3f}{first['io_cb'][1]:>10.3f}"
              f"{first['naive'][0]:>10.3f}{first['naive'][1]:>10.3f}"
              f"{errors['distop']:>11.1e}{errors['io_cb']:>10.1e}{errors['naive']:>10.1e}"
              f"{errors['checking']:>10.1e}")


if __name__ == "__main__":
    main()
