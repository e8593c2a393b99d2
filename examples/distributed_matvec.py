"""mpiexec -n 4 python examples/distributed_matvec.py

A distributed sparse matvec y = (sum over ranks of A_r) x, with an Allreduce in its
forward and another in its VJP, feeding K objectives f_k = w_k . y (`--variant reverse`)
or K independent operator calls on the same x (`--variant forward`). Values and all K
gradients are checked against the dense global matrix, gathered once at setup.

Options: --objectives K (default 16), --variant reverse|forward, --mode
batched|loop|unrolled, --unordered (ordered=False: the naive lowering, to show what it
does), --size M (default 400), --repeat R (timed calls, default 20).
Prints `max relative error <x.xe-xx>` on rank 0 and exits non-zero above 1e-12.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)


class DistributedMatvec(distop.DistributedOperator):
    """y = (sum over ranks of A_r) x for a replicated x: each rank holds a sparse A_r."""

    A: sp.csr_matrix
    AT: sp.csr_matrix  # A's transpose, made once: scipy takes longer to transpose than
    #                    to multiply a matrix of this size
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)
    jvp_collectives = ("Allreduce",)
    output_kinds = "replicated"  # y is the same on every rank
    batched_vjp = True
    batched_jvp = True
    unbatched = "expand_dims"  # x as it is (a batch axis of 1), not copied K times

    def __init__(self, A, *, comm=None, ordered=None):
        self.A = A
        self.AT = A.T.tocsr() if sp.issparse(A) else np.ascontiguousarray(A.T)
        self.comm, self.ordered = comm, ordered

    # `out`, where distop offers it, is the buffer the result goes to: reducing straight
    # into it saves a copy of the result (it is None where there is none to offer).
    def forward(self, comm, x, out=None):
        y = np.empty(self.A.shape[0]) if out is None else out
        comm.Allreduce(self.A @ x, y, op=MPI.SUM)
        return y

    def jvp(self, comm, x_dot, x, out=None):
        # x_dot is (M,) or, when distop batches, (B, M): one Allreduce either way.
        local = np.ascontiguousarray((self.A @ x_dot.T).T)
        y_dot = np.empty_like(local) if out is None else out
        comm.Allreduce(local, y_dot, op=MPI.SUM)
        return y_dot

    def vjp(self, comm, y_bar, x, out=None):
        # y_bar is (M,) or, when distop batches, (B, M): one Allreduce either way.
        local = np.ascontiguousarray((self.AT @ y_bar.T).T)
        x_bar = np.empty_like(local) if out is None else out
        comm.Allreduce(local, x_bar, op=MPI.SUM)
        return x_bar


def setup(size, objectives, comm=MPI.COMM_WORLD, seed=7):
    """The scenario's data: this rank's block, the dense global matrix, x0 and W."""
    rank = comm.Get_rank()
    a_local = sp.random(size, size, density=0.01 * (rank + 1), format="csr",
                        random_state=np.random.default_rng(rank))
    a_global = sum(b.toarray() for b in comm.allgather(a_local))
    x0 = np.sin(0.37 * np.arange(size)) + 0.1
    w = np.random.default_rng(seed).standard_normal((objectives, size))
    return a_local, a_global, x0, w


def build(a_local, w, variant, ordered=None):
    """The model: K objectives of one matvec, or K independent matvecs of one x.

    The objectives are computed together (`w @ y`, one matrix product) and then named:
    XLA on CPU runs K separate small dot products far slower than one product."""
    k = w.shape[0]
    if variant == "reverse":
        op = DistributedMatvec(a_local, ordered=ordered)

        def model(x):
            f = w @ op(x)
            return {f"f{i}": f[i] for i in range(k)}
    else:
        ops = [DistributedMatvec(a_local, ordered=ordered) for _ in range(k)]

        def model(x):
            f = jnp.sum(w * jnp.stack([op(x) for op in ops]), axis=1)
            return {f"f{i}": f[i] for i in range(k)}
    return model


def errors(problem, a_global, x0, w, mode, calls=1):
    """Max relative error of the values (as one vector) and of each gradient, over
    `calls` repeated calls."""
    k = w.shape[0]
    exact_f = w @ (a_global @ x0)
    exact_g = w @ a_global  # row i: the gradient of f_i
    worst = 0.0
    for _ in range(calls):
        values = problem.run(x=x0)
        totals = problem.compute_totals(mode=mode)
        f = np.array([values[f"f{i}"] for i in range(k)])
        g = np.stack([totals[f"f{i}", "x"].ravel() for i in range(k)])
        worst = max(worst, np.linalg.norm(f - exact_f) / np.linalg.norm(exact_f),
                    *(np.linalg.norm(g[i] - exact_g[i]) / np.linalg.norm(exact_g[i])
                      for i in range(k)))
    return worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--objectives", type=int, default=16)
    parser.add_argument("--variant", choices=("reverse", "forward"), default="reverse")
    parser.add_argument("--mode", choices=distop._problem.problem.MODES, default="batched")
    parser.add_argument("--unordered", action="store_true")
    parser.add_argument("--size", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD

    a_local, a_global, x0, w = setup(args.size, args.objectives, comm)
    model = build(a_local, w, args.variant, ordered=False if args.unordered else None)
    t0 = time.perf_counter()
    problem = distop.Problem(model, {"x": x0})
    problem.run()
    t_first_run = time.perf_counter() - t0
    t0 = time.perf_counter()
    problem.compute_totals(mode=args.mode)
    t_first_totals = time.perf_counter() - t0

    err = comm.allreduce(errors(problem, a_global, x0, w, args.mode, calls=3), op=MPI.MAX)

    def median(fn):
        times = []
        for _ in range(args.repeat):
            comm.Barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return comm.allreduce(float(np.median(times)), op=MPI.MAX)

    t_run = median(problem.run)
    t_totals = median(lambda: problem.compute_totals(mode=args.mode))
    if comm.rank == 0:
        print(f"{comm.size} ranks, M={args.size}, K={args.objectives}, variant={args.variant}, "
              f"mode={args.mode}, {'unordered' if args.unordered else 'ordered'}; "
              f"{sum(e.made for e in problem.schedule)} operator calls in the batched "
              "totals program (problem.schedule)")
        print(f"first run {t_first_run:.3f} s, first compute_totals {t_first_totals:.3f} s; "
              f"median run {1e3 * t_run:.3f} ms, compute_totals {1e3 * t_totals:.3f} ms")
        print(f"max relative error {err:.1e}", flush=True)
    return 0 if err <= 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
