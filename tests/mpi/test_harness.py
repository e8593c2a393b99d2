"""The harness of these launches: the ranks share JAX's compilations."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPILATIONS
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


@pytest.mark.skipif(not os.environ.get(COMPILATIONS),
                    reason=f"nothing shared: {COMPILATIONS} is not set (the suite sets it)")
def test_the_ranks_compile_a_program_once():
    hits = []
    jax.monitoring.register_event_listener(lambda event, **_: hits.append(event))
    # a program no other test or earlier run compiled: its constant is new
    shift = comm.bcast(float(np.random.default_rng().random()), root=0)
    x = np.float32(2.0)
    y = np.asarray(jax.jit(lambda x: jnp.sin(x) * 3 + shift)(x))
    found = comm.allgather((hits.count("/jax/compilation_cache/cache_hits"),
                            bool(np.isclose(y, np.sin(x) * 3 + shift, rtol=1e-6))))
    # one rank compiled and wrote it, every other loaded it
    assert sorted(found) == [(0, True)] + [(1, True)] * (size - 1), found
