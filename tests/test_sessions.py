"""Tracing sessions: a value of distop's JAX setting is reused once no body JAX keeps
under it holds a host call, so Problems made and dropped leave nothing in JAX's caches."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import distop
from distop._hostcalls import sessions

jax.config.update("jax_enable_x64", True)

X = np.linspace(0.1, 0.9, 4)


class Wave(distop.DistributedOperator):
    """y = sin(x) * x (no collectives: one process)."""

    def forward(self, comm, x):
        return np.sin(x) * x

    def vjp(self, comm, y_bar, x):
        return y_bar * (np.cos(x) * x + np.sin(x))


def wave(x):
    """What `Wave` computes, in jax.numpy: the reference."""
    return jnp.sin(x) * x


def models(f):
    """name -> model of x on `f`: jax.numpy around it, and a loop whose body (made anew
    by each trace) calls it."""
    return {"plain": lambda x: {"f": jnp.sum(jnp.tanh(f(x)) ** 2)},
            "loop": lambda x: {"f": jnp.sum(lax.fori_loop(0, 3, lambda i, c: f(c) * 0.5,
                                                           f(x)) ** 2)}}


def checked(model, reference):
    """**Returns:** a Problem of `model`, its values and totals checked against JAX's."""
    problem = distop.Problem(model, {"x": X})
    np.testing.assert_allclose(problem.run()["f"], reference(X)["f"], rtol=1e-13)
    np.testing.assert_allclose(problem.compute_totals("f", "x")["f", "x"][0],
                               jax.grad(lambda x: reference(x)["f"])(X), rtol=1e-13)
    return problem


@pytest.mark.parametrize("name", ["plain", "loop"])
def test_problems_made_and_dropped_reuse_the_values_of_the_setting(name):
    model, reference = models(Wave())[name], models(wave)[name]
    checked(model, reference)  # (dropped at once; the first may make values)
    start = sessions.values()  # (other tests' bodies JAX keeps may hold some for good)
    for _ in range(3):
        checked(model, reference)
        now = sessions.values()
        assert now.made == start.made and now.in_use <= start.in_use, (start, now)


def test_problems_alive_together_share_a_value_where_jax_keeps_no_call():
    # (the totals programs' calls in jax.vjp's tangent trace keep no value either)
    model, reference = models(Wave())["plain"], models(wave)["plain"]
    before = sessions.values()  # (other tests' bodies JAX keeps may hold some for good)
    first = checked(model, reference)
    made = sessions.values().made
    second = checked(model, reference)
    now = sessions.values()
    assert now.made == made and now.in_use <= before.in_use, (before, now)
    del first, second


def test_a_body_jax_keeps_with_calls_keeps_its_value_until_jax_lets_it_go():
    # JAX keeps a branch's body by its function, here the operator: the body's calls
    # stay with it, so its value may serve no other session while JAX keeps it (for
    # good here, since the calls hold the operator, JAX's key)
    op = Wave()

    def model(x):
        return {"f": jnp.sum(lax.cond(x.sum() > 0, op, lambda v: v * 2, x))}

    def reference(x):
        return {"f": jnp.sum(wave(x))}

    gc.collect()
    before = sessions.values()
    checked(model, reference)
    gc.collect()
    kept = sessions.values()
    assert kept.in_use > before.in_use
    checked(model, reference)  # (traced afresh under another value, kept too: exact)
    gc.collect()
    assert sessions.values().in_use > kept.in_use
    jax.clear_caches()
    gc.collect()
    assert sessions.values().in_use <= before.in_use
