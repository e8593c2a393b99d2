"""Operators inside the model's own loops, branches and checkpoints take the lean path;
long Python loops compile in linear time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import distop
from distop._compiler.stages import loops

jax.config.update("jax_enable_x64", True)


class Wave(distop.DistributedOperator):
    """y = sin(x) * x, counting its calls per phase (no collectives: one process)."""

    calls: dict

    def forward(self, comm, x):
        self.calls["forward"] = self.calls.get("forward", 0) + 1
        return np.sin(x) * x

    def vjp(self, comm, y_bar, x):
        self.calls["vjp"] = self.calls.get("vjp", 0) + 1
        return y_bar * (np.cos(x) * x + np.sin(x))


def wave(x):
    """What `Wave` computes, in jax.numpy: the reference."""
    return jnp.sin(x) * x


def models(op):
    """name -> (model on the operator, the same model on `wave`) of (u, k)."""
    def scan(f):
        def model(u, k):
            u, ys = lax.scan(lambda c, _: (jnp.tanh(f(c)) * k, c.sum()), u, None, length=7)
            return {"f": jnp.sum(u ** 2) + ys.sum()}
        return model

    def fori(f):
        return lambda u, k: {"f": jnp.sum(lax.fori_loop(0, 5, lambda i, c: f(c) * k, u) ** 2)}

    def cond(f):
        def model(u, k):
            c = lax.cond(k > 0, lambda v: f(v) * 2, lambda v: f(f(v)), u)
            return {"f": jnp.sum(lax.switch(1, [f, lambda v: f(f(v)) * k], c) ** 2)}
        return model

    def checkpointed(f):
        def model(u, k):
            step = jax.checkpoint(lambda v: jnp.tanh(f(v)) * k)
            for _ in range(3):
                u = step(u)
            return {"f": jnp.sum(u ** 2)}
        return model

    def scan_of_checkpoints(f):
        def model(u, k):
            body = jax.checkpoint(lambda c, _: (jnp.tanh(f(c)) * k, None))
            return {"f": jnp.sum(lax.scan(body, u, None, length=6)[0] ** 2)}
        return model

    def nested_scans_and_jit(f):
        def model(u, k):
            g = jax.jit(lambda v: f(v) * k)
            inner = lambda c, _: (g(c), None)  # noqa: E731
            outer = lambda c, _: (lax.scan(inner, jnp.tanh(c), None, length=3)[0], None)  # noqa: E731
            return {"f": jnp.sum(f(lax.scan(outer, u, None, length=2)[0]) ** 2)}
        return model

    found = {}
    for make in (scan, fori, cond, checkpointed, scan_of_checkpoints, nested_scans_and_jit):
        found[make.__name__] = (make(op), make(wave))
    return found


NAMES = list(models(None))


@pytest.mark.parametrize("name", NAMES)
def test_operators_in_loops_branches_and_checkpoints_are_lean_and_exact(name):
    op = Wave({})
    model, reference = models(op)[name]
    inputs = {"u": np.linspace(0.1, 0.9, 5), "k": np.array(0.9)}
    problem = distop.Problem(model, inputs)
    assert problem.schedule and all(e.lean for e in problem.schedule), problem.schedule
    assert any(e.context for e in problem.schedule), problem.schedule
    value = float(reference(**{k: jnp.asarray(v) for k, v in inputs.items()})["f"])
    grad = jax.grad(lambda u, k: reference(u, k)["f"], argnums=(0, 1))(inputs["u"],
                                                                        inputs["k"])
    for _ in range(2):  # (the second time through JAX's C++ dispatch)
        np.testing.assert_allclose(problem.run()["f"], value, rtol=1e-13)
        for mode in ("batched", "loop", "unrolled"):
            J = problem.compute_totals(mode=mode)
            np.testing.assert_allclose(J["f", "u"][0], grad[0], rtol=1e-12)
            np.testing.assert_allclose(J["f", "k"][0, 0], grad[1], rtol=1e-12)
    assert all(c.ok for c in problem.check_totals().values())


def nestings(f):
    """name -> model of (u, k) on `f`: the model's transformations nested both ways,
    with unused and duplicated outputs."""
    xs = jnp.linspace(0.5, 1.5, 4)

    def checkpoint_of_scan(u, k):  # (y's totals need none of the forward's values)
        body = jax.checkpoint(lambda v: lax.scan(lambda c, _: (f(c), None), v, None,
                                                 length=3)[0])
        return {"y": body(u) + k, "f": jnp.sum(body(u) * k)}

    def checkpoint_of_scan_with_duplicated_outputs(u, k):
        body = jax.checkpoint(lambda v, xs: lax.scan(
            lambda c, x: (f(c) * x * k, (f(c), f(c))), v, xs))
        carry, (first, _) = body(u, xs)  # the second stack unused
        return {"f": jnp.sum(first ** 2), "g": jnp.sum(carry)}

    def scan_of_checkpoint_with_duplicated_outputs(u, k):
        step = jax.checkpoint(lambda c, x: (f(c) * x, (f(c) * k, f(c))))
        _, (_, second) = lax.scan(step, u, xs)  # the carry and the first stack unused
        return {"f": jnp.sum(second * k)}

    def checkpoint_of_scan_of_cond(u, k):
        step = lambda c, x: (lax.cond(x > 1.0, f, lambda v: f(f(v)) * k, c), f(c))  # noqa: E731
        carry, ys = jax.checkpoint(lambda v: lax.scan(step, v, xs))(u)
        return {"f": jnp.sum(carry ** 2) + jnp.sum(ys)}

    def scan_of_checkpoint_of_cond(u, k):
        def branch(v):
            return lax.cond(v.sum() > 0.0, lambda w: (f(w), f(w)), lambda w: (w, f(w)), v)

        step = jax.checkpoint(lambda c, x: (branch(c)[0] * x, branch(c * k)))
        carry, (_, second) = lax.scan(step, u, xs)
        return {"f": jnp.sum(carry) + jnp.sum(second ** 2)}

    def cond_of_checkpoint_of_scan(u, k):
        looped = jax.checkpoint(lambda v: lax.scan(lambda c, _: (f(c) * k, f(c)), v, None,
                                                   length=2))
        carry, ys = lax.cond(k > 0, looped, lambda v: (f(v), jnp.stack([v, v])), u)
        return {"f": jnp.sum(carry) * jnp.sum(ys[1])}

    return {model.__name__: model for model in (
        checkpoint_of_scan, checkpoint_of_scan_with_duplicated_outputs,
        scan_of_checkpoint_with_duplicated_outputs, checkpoint_of_scan_of_cond,
        scan_of_checkpoint_of_cond, cond_of_checkpoint_of_scan)}


@pytest.mark.parametrize("name", list(nestings(wave)))
def test_checkpoints_and_scans_nested_both_ways_give_jax_values_and_totals(name):
    model, reference = nestings(Wave({}))[name], nestings(wave)[name]
    inputs = {"u": np.linspace(0.1, 0.9, 5), "k": np.array(0.9)}
    problem = distop.Problem(model, inputs)
    values = reference(**{k: jnp.asarray(v) for k, v in inputs.items()})
    for out in values:
        jacobians = jax.jacrev(lambda u, k, out=out: reference(u, k)[out], argnums=(0, 1))(
            *inputs.values())
        np.testing.assert_allclose(problem.run()[out], values[out], rtol=1e-13)
        for mode in ("batched", "loop", "unrolled"):
            J = problem.compute_totals(of=out, mode=mode)
            for name, want in zip(inputs, jacobians):
                np.testing.assert_allclose(J[out, name], np.reshape(want, J[out, name].shape),
                                           rtol=1e-12, atol=1e-15)
        values_and_totals = problem.run_and_compute_totals(of=out)
        np.testing.assert_allclose(values_and_totals[0][out], values[out], rtol=1e-13)


def test_a_checkpointed_operator_runs_again_once_per_recomputation():
    calls = {}
    model = models(Wave(calls))["checkpointed"][0]
    problem = distop.Problem(model, {"u": np.linspace(0.1, 0.9, 5), "k": np.array(0.9)})
    calls.clear()
    problem.compute_totals()
    # three steps forward; in the reverse sweep each step is recomputed once, then its vjp
    assert calls == {"forward": 6, "vjp": 3}, calls
    phases = [(e.phase, e.context) for e in problem.schedule]
    assert phases.count(("forward", "checkpoint")) == 3, phases
    calls.clear()
    problem.run()
    assert calls == {"forward": 3}, calls


def test_calls_inside_a_scan_run_once_per_iteration_in_order():
    calls = {}
    model = models(Wave(calls))["scan"][0]
    problem = distop.Problem(model, {"u": np.linspace(0.1, 0.9, 5), "k": np.array(0.9)})
    calls.clear()
    problem.run()
    assert calls == {"forward": 7}
    calls.clear()
    problem.compute_totals()
    assert calls == {"forward": 7, "vjp": 7}


def test_a_while_loop_and_a_branch_deciding_on_values_run_lean():
    calls = {}
    op = Wave(calls)

    def model(u):
        c, n = lax.while_loop(lambda c: jnp.sum(c[0]) > 0.05, lambda c: (op(c[0]), c[1] + 1),
                              (u, 0))
        return {"f": jnp.sum(c), "n": n}

    problem = distop.Problem(model, {"u": np.linspace(0.1, 0.5, 3)})
    assert [(e.phase, e.context, e.lean) for e in problem.schedule] == [
        ("forward", "while", True)]
    x, n = np.linspace(0.1, 0.5, 3), 0
    while x.sum() > 0.05:
        x, n = np.sin(x) * x, n + 1
    for _ in range(3):  # (the count of calls is read off the token, not known ahead)
        calls.clear()
        out = problem.run()
        assert int(out["n"]) == n and calls == {"forward": n}
        np.testing.assert_allclose(out["f"], x.sum(), rtol=1e-13)


def test_an_operator_in_a_while_loops_condition_takes_io_callback():
    op = Wave({})

    def model(u):
        return {"f": lax.while_loop(lambda c: jnp.sum(op(c)) > 0.05, lambda c: c * 0.5, u).sum()}

    problem = distop.Problem(model, {"u": np.linspace(0.1, 0.5, 3)})
    assert [(e.context, e.lean) for e in problem.schedule] == [("while", False)]
    x = np.linspace(0.1, 0.5, 3)
    while (np.sin(x) * x).sum() > 0.05:
        x = x * 0.5
    np.testing.assert_allclose(problem.run()["f"], x.sum(), rtol=1e-13)


def test_a_call_reading_every_step_of_a_python_loop_reads_slices_of_its_stacks():
    # A linear step: the reverse sweep's vjps fuse into one call reading every step's
    # input, which the rolled loop keeps stacked; that call gets the stack, not one
    # slice per step (each slice of a loop's result costs XLA compile time).
    class Linear(distop.DistributedOperator):
        batched_vjp = True

        def forward(self, comm, x):
            return 0.5 * x

        def vjp(self, comm, y_bar, x):
            return 0.5 * y_bar

    op, n = Linear(), 40

    def model(u):
        for _ in range(n):
            u = op(u) + 0.01
        return {"f": jnp.sum(u)}

    made = []
    rolled = loops.rolled

    def spy(program, repeats=None):
        found = rolled(program, repeats)
        made.append(found)
        return found

    loops.rolled = spy
    try:
        problem = distop.Problem(model, {"u": np.linspace(0.1, 0.9, 4)})
        J = problem.compute_totals()
    finally:
        loops.rolled = rolled
    unstacked = [c for found in made if found for c in found.host_calls
                 if type(c).__name__ == "UnstackedCall"]
    assert unstacked, made
    slices = [e for found in made if found for e in found.program.jaxpr.eqns
              if e.primitive.name == "slice"]
    assert len(slices) <= 4, slices

    def reference(u):
        for _ in range(n):
            u = 0.5 * u + 0.01
        return jnp.sum(u)

    np.testing.assert_allclose(J["f", "u"][0], jax.grad(reference)(np.linspace(0.1, 0.9, 4)),
                               rtol=1e-12)


def test_a_body_traced_in_a_problem_is_traced_afresh_elsewhere():
    # JAX caches the traced bodies of loops and branches by function: an operator used
    # as a branch in one Problem, in another, and outside any, gets calls of each's own
    op = Wave({})
    x = np.linspace(0.1, 0.9, 3)

    def model(x):
        return {"f": jnp.sum(lax.cond(x.sum() > 0, op, lambda v: v * 2, x))}

    def reference(x):
        return jnp.sum(wave(x))

    first = distop.Problem(model, {"x": x})
    np.testing.assert_allclose(first.compute_totals()["f", "x"][0], jax.grad(reference)(x),
                               rtol=1e-13)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: model(x)["f"]))(x),
                               jax.grad(reference)(x), rtol=1e-13)
    second = distop.Problem(model, {"x": x})
    del first  # (its programs' call sites go with it)
    np.testing.assert_allclose(second.compute_totals()["f", "x"][0], jax.grad(reference)(x),
                               rtol=1e-13)
    np.testing.assert_allclose(second.run()["f"], reference(x), rtol=1e-13)
