"""mpiexec -n 4 python examples/data_parallel.py --split 4,3,3,0

Data-parallel training in plain JAX: an equinox MLP trained with optax, its parameters
replicated (the same on every rank), its samples split over the ranks, one rank possibly
holding none. The loss is the sum over ranks (`distop.AllreduceSum`) of each rank's sum
of squared errors, over the global sample count. The training step is
`jax.value_and_grad(distop.with_kinds(loss, distributed="batch"))` under `jax.jit`:
`with_kinds` sums each parameter's gradient over the ranks, with no `RankLocal`.

The samples come from two sites. Those of site B come last, so they land on the last
ranks that hold any, and the model gives them a head of their own: a parameter that only
some ranks use. Data selects it (`jnp.where` over the samples), not a test of the rank,
so every rank traces the same program and its collectives match the others'. A rank
without site-B samples still gets that head's gradient, summed from the ranks that
have them.

Every rank also trains the same model on all the samples in one process (it makes them
all from one seed). On rank 0 it prints `parameters across ranks: max difference <x>`
(bit for bit: must be 0.0) and `against one process, full batch: max difference <x>`
(must be at most 1e-12), and every rank exits with status 1 where either bound fails.

Options: --split C0,C1,... (samples per rank, one count per rank; default: an even split
of --samples by `distop.shard`), --samples N (default 10; with --split, the sum of the
counts), --steps S (default 40).
"""

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)
BOUND = 1e-12


class Model(eqx.Module):
    """Shared features, a head for every sample and a second head for site B's."""

    body: eqx.nn.MLP
    head: eqx.nn.Linear
    site_b_head: eqx.nn.Linear

    def __init__(self, key):
        body, head, site_b_head = jax.random.split(key, 3)
        self.body = eqx.nn.MLP(2, 8, width_size=8, depth=1, activation=jnp.tanh, key=body)
        self.head = eqx.nn.Linear(8, "scalar", key=head)
        self.site_b_head = eqx.nn.Linear(8, "scalar", key=site_b_head)

    def __call__(self, x, at_site_b):
        features = self.body(x)
        return jnp.where(at_site_b, self.site_b_head(features), self.head(features))


def samples(n, seed=0):
    """**Returns:** all `n` samples as a dict of arrays (the same on every rank): inputs
    `x`, targets `y`, and `site_b`, True for the last third."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2))
    site_b = np.arange(n) >= n - n // 3
    y = np.sin(x[:, 0]) + 0.5 * x[:, 1] ** 2 + np.where(site_b, 1.0, 0.0)
    return {"x": x, "y": y, "site_b": site_b}


def train(loss, params, batch, steps):
    """Run `steps` Adam steps of `loss(params, batch)` under `jax.jit`.

    **Returns:** the trained parameters and the first and last losses."""
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state, values = optimizer.init(params), []
    for _ in range(steps):
        params, state, value = step(params, state, batch)
        values.append(float(value))
    return params, values[0], values[-1]


def flat(params):
    """**Returns:** every parameter in one float64 vector."""
    return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(params)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--split", default="")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    counts = [int(c) for c in args.split.split(",")] if args.split else None
    n = sum(counts) if counts else args.samples
    everything = samples(n)
    # this rank's samples, padded to the largest share with weight 0
    indices, weights = distop.shard(n, comm, counts=counts)
    mine = {key: value[indices] for key, value in everything.items()} | {"weight": weights}

    params, static = eqx.partition(Model(jax.random.PRNGKey(0)), eqx.is_inexact_array)
    total = distop.AllreduceSum()

    def loss(params, batch):
        model = eqx.combine(params, static)
        pred = jax.vmap(model)(batch["x"], batch["site_b"])
        return total(jnp.sum(batch["weight"] * (pred - batch["y"]) ** 2)) / n

    trained, first, last = train(distop.with_kinds(loss, distributed="batch"), params,
                                 mine, args.steps)

    def whole(params, batch):  # one process, every sample
        model = eqx.combine(params, static)
        return jnp.mean((jax.vmap(model)(batch["x"], batch["site_b"]) - batch["y"]) ** 2)

    reference, _, _ = train(whole, params, everything, args.steps)

    every = comm.allgather(flat(trained))
    across = float(max(np.max(np.abs(p - every[0])) for p in every))
    against = float(np.max(np.abs(flat(trained) - flat(reference))))
    against = comm.allreduce(against, op=MPI.MAX)
    held = comm.allgather(int(np.sum(weights)))
    site_b = comm.allgather(bool(np.any(mine["site_b"] & (weights > 0))))
    if comm.rank == 0:
        print(f"{comm.size} ranks, samples per rank {held}, site B's samples on ranks "
              f"{[r for r, has in enumerate(site_b) if has]}; loss {first:.3e} -> "
              f"{last:.3e} after {args.steps} Adam steps")
        print(f"parameters across ranks: max difference {across!r}")
        print(f"against one process, full batch: max difference {against:.1e}", flush=True)
    return 0 if across == 0.0 and against <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
