"""The harness of these launches: the ranks share JAX's compilations."""

import fcntl
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPILATIONS
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


SHARED = pytest.mark.skipif(not os.environ.get(COMPILATIONS),
                            reason=f"nothing shared: {COMPILATIONS} is not set (the suite sets it)")


@SHARED
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


@SHARED
def test_a_program_with_host_callbacks_is_compiled_by_each_rank_without_waiting(monkeypatch):
    # (JAX keeps no program with host callbacks: a rank waiting for another's would
    # wait for nothing, then compile it all the same)
    locks = []
    flock = fcntl.flock
    monkeypatch.setattr(fcntl, "flock", lambda *args: (locks.append(args), flock(*args))[1])
    shift = comm.bcast(float(np.random.default_rng().random()), root=0)
    x = np.float32(2.0)
    shape = jax.ShapeDtypeStruct((), np.float32)
    y = np.asarray(jax.jit(lambda x: jax.pure_callback(
        lambda v: np.float32(np.sin(v) * 3 + shift), shape, x))(x))
    called = len(locks)
    jax.jit(lambda x: jnp.sin(x) * 3 + shift + 1)(x)  # (a program JAX keeps: locked)
    found = comm.allgather((called, len(locks) - called,
                            bool(np.isclose(y, np.sin(x) * 3 + shift, rtol=1e-6))))
    assert found == [(0, 1, True)] * size, found
