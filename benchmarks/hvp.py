"""mpiexec -n 4 python benchmarks/hvp.py

Hessian-vector products against gradients: the time of one `Problem.compute_hvp` call
(K=1 direction, and K=8 in one call) against one `Problem.compute_totals` call (the
gradient) of the same scalar objective, and in one process against the same product in
plain JAX (`jax.jvp` of `jax.grad`, jitted, no operator).

The model: a distributed vector x of `--size` rows in all, split evenly over the ranks,
through `--depth` nonlinear operators y = x * sum(x**2) (one Allreduce each, the sum over
every rank's rows), each followed by `sin`, summed over the ranks into one scalar.
Per-call times are the max over ranks of the median over `--repeat` calls, after a
first call that traces and compiles. Targets: HVP <= 2.5 x compute_totals, and K=8 <=
4 x K=1; the table says whether each is met. Options: --size N, --depth L, --repeat R.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)
comm = MPI.COMM_WORLD


class NormScale(distop.DistributedOperator):
    """y = x * s, s the sum of x**2 over every rank's rows; every method, batched."""

    forward_collectives = vjp_collectives = jvp_collectives = hvp_collectives = (
        "Allreduce",)
    batched_vjp = batched_jvp = batched_hvp = True

    def _sums(self, comm, *pairs):
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
        c, d, e = self._sums(comm, (y_bar, x), (x, t), (y_bar, t))
        return 2 * y_bar * d + 2 * t * c + 2 * x * e


def objective(apply, depth, total):
    """**Returns:** the model's scalar, with `apply` as the operator and `total` the
    sum over the ranks."""
    def f(x):
        for _ in range(depth):
            x = jnp.sin(apply(x))
        return total(jnp.sum(x))
    return f


def timed(fn, repeat):
    """**Returns:** the max over ranks of the median time of `fn()` over `repeat` calls
    (after one call that compiles)."""
    fn()
    times = []
    for _ in range(repeat):
        comm.Barrier()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return max(comm.allgather(float(np.median(times))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--size", type=int, default=4000)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = [args.size // size + (r < args.size % size) for r in range(size)]
    start = sum(rows[:rank])
    rng = np.random.default_rng(0)
    xg = rng.uniform(-1, 1, args.size) / np.sqrt(args.size)
    tg = rng.standard_normal((8, args.size))
    x, t = xg[start:start + rows[rank]], tg[:, start:start + rows[rank]]

    f = objective(NormScale(), args.depth, distop.AllreduceSum())
    problem = distop.Problem(lambda x: {"f": f(x)}, {"x": x}, distributed="x")
    totals = timed(lambda: problem.compute_totals("f", "x"), args.repeat)
    one = timed(lambda: problem.compute_hvp("f", "x", {"x": t[0]}), args.repeat)
    eight = timed(lambda: problem.compute_hvp("f", "x", {"x": t}), args.repeat)
    rows_out = [("compute_totals (gradient)", totals, ""),
                ("compute_hvp, K=1", one, f"{one / totals:.2f} x gradient (target <= 2.5)"),
                ("compute_hvp, K=8", eight, f"{eight / one:.2f} x K=1 (target <= 4)")]
    if size == 1:  # the same product in plain JAX, no operator
        plain = objective(lambda x: x * jnp.sum(x ** 2), args.depth, lambda v: v)
        hvp = jax.jit(lambda x, t: jax.jvp(jax.grad(plain), (x,), (t,))[1])
        grad = jax.jit(jax.grad(plain))
        jx, jt = jnp.asarray(x), jnp.asarray(t[0])
        rows_out += [("plain JAX gradient", timed(lambda: grad(jx).block_until_ready(),
                                                  args.repeat), ""),
                     ("plain JAX HVP, K=1", timed(lambda: hvp(jx, jt).block_until_ready(),
                                                 args.repeat), "")]
    if rank == 0:
        print(f"hvp benchmark: {size} rank(s), {args.size} rows, depth {args.depth}, "
              f"median of {args.repeat} calls, max over ranks")
        print(f"{'call':<28} {'time':>10}  ratio")
        for name, seconds, note in rows_out:
            print(f"{name:<28} {seconds * 1e6:>8.0f} us  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
