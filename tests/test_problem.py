"""Problem in a single process: run, compute_totals in every mode, names, recompiling."""

import gc
import os
import threading
import warnings

import distributed_matvec as dm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Cube, RowScale, loops_since, totals_jaxpr, without_loops
from jax.experimental import io_callback

import distop


@pytest.fixture(scope="module")
def matvec():
    a_local, a_global, x0, w = dm.setup(40, 5)
    return a_local, a_global, x0, w


@pytest.mark.parametrize("variant", ["reverse", "forward"])
@pytest.mark.parametrize("mode", ["batched", "loop", "unrolled"])
def test_matvec_values_and_totals(matvec, variant, mode):
    a_local, a_global, x0, w = matvec
    problem = distop.Problem(dm.build(a_local, w, variant), {"x": x0})
    assert dm.errors(problem, a_global, x0, w, mode, calls=2) <= 1e-12
    J = problem.compute_totals(of=["f1", "f3"], wrt="x", mode=mode)
    assert set(J) == {("f1", "x"), ("f3", "x")} and J["f1", "x"].shape == (1, 40)
    np.testing.assert_allclose(J["f3", "x"][0], w[3] @ a_global, rtol=1e-12)


def test_run_updates_the_current_point_and_recompiles_on_new_shapes():
    problem = distop.Problem(lambda x, y: {"f": jnp.sum(Cube()(x)) * y,
                                           "g": x * 2.0}, {"x": np.ones(3), "y": 2.0})
    assert problem.input_names == ("x", "y") and problem.output_names == ("f", "g")
    assert problem.run(y=3.0)["f"] == 9.0
    J = problem.compute_totals()
    np.testing.assert_allclose(J["f", "x"], [[9.0, 9.0, 9.0]])
    np.testing.assert_allclose(J["f", "y"], [[3.0]])
    np.testing.assert_allclose(J["g", "x"], 2 * np.eye(3))
    out = problem.run(x=np.ones(5))
    assert out["g"].shape == (5,) and out["f"] == 15.0
    assert problem.compute_totals("g", "x")["g", "x"].shape == (5, 5)


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
@pytest.mark.parametrize("mode", ["batched", "loop", "unrolled"])
def test_run_and_compute_totals_is_run_then_compute_totals_in_one_call(backend, mode):
    calls = []

    class Counted(Cube):
        def forward(self, comm, x):
            calls.append("forward")
            return super().forward(comm, x)

        def vjp(self, comm, y_bar, x):
            calls.append("vjp")
            return super().vjp(comm, y_bar, x)

    def model(x, y, k):
        c = Counted()(x)
        return {"f": jnp.sum(c) * y, "g": c * 2.0, "n": k + 1}

    inputs = {"x": np.arange(1.0, 4.0), "y": 2.0, "k": np.int32(3)}
    problem = distop.Problem(model, inputs, backend=backend)
    twin = distop.Problem(model, inputs, backend=backend)
    for point, of, wrt, form in (({"y": 3.0}, None, None, "global"), ({}, "g", "x", "local"),
                                 ({"x": np.ones(3)}, ["f"], ["x", "y"], "global")):
        calls.clear()
        values, totals = problem.run_and_compute_totals(of, wrt, inputs=point, mode=mode,
                                                         return_format=form)
        # one program: the forward call once, the vjp once (batched) or once per seed
        assert calls.count("forward") == 1 and calls[0] == "forward", calls
        expected = twin.run(**point)
        assert values.keys() == expected.keys()
        for k in values:
            np.testing.assert_array_equal(values[k], expected[k])
        expected = twin.compute_totals(of, wrt, mode=mode, return_format=form)
        assert totals.keys() == expected.keys()
        for k in totals:
            np.testing.assert_array_equal(totals[k], expected[k])
        # the evaluated point became the current point
        np.testing.assert_array_equal(problem.run()["g"], twin.run()["g"])
    with pytest.raises(ValueError, match=r"run_and_compute_totals\(of=\['h'\]\): no output"):
        problem.run_and_compute_totals(["h"])
    with pytest.raises(ValueError,
                       match=r"run_and_compute_totals\(inputs=\{'z': ...\}\): no input"):
        problem.run_and_compute_totals(inputs={"z": 1.0})
    with pytest.raises(ValueError, match=r"run_and_compute_totals\(mode='fast'\)"):
        problem.run_and_compute_totals(mode="fast")
    with pytest.raises(TypeError, match=r"run_and_compute_totals\(inputs=...\): expected a dict"):
        problem.run_and_compute_totals(inputs=[("x", np.ones(3))])
    values, totals = problem.run_and_compute_totals(wrt=[], inputs={"y": 5.0})
    assert totals == {}
    np.testing.assert_array_equal(values["f"], twin.run(y=5.0)["f"])


def test_schedule_lists_forward_then_vjp(matvec):
    a_local, _, x0, w = matvec
    problem = distop.Problem(dm.build(a_local, w, "reverse"), {"x": x0})
    (fwd, vjp) = problem.schedule
    assert (fwd.operator, fwd.phase, fwd.collectives) == ("DistributedMatvec", "forward",
                                                         ("Allreduce",))
    assert vjp.phase == "vjp" and vjp.batch == (5,) and vjp.input_shapes == ((40,),)
    assert "DistributedMatvec.vjp" in vjp.describe()
    # the lean compute_totals program leaves the forward call out: the reverse sweep
    # reads x, not y; the io_callback program makes every call
    assert vjp.made and not fwd.made and "not made" in fwd.describe()
    assert fwd.group == vjp.group == 0
    safe = distop.Problem(dm.build(a_local, w, "reverse"), {"x": x0}, backend="io_callback")
    assert [e.phase for e in safe.schedule] == ["forward", "vjp"]
    assert all(e.made for e in safe.schedule)
    # an unordered operator beside it keeps its entries
    loose = dm.DistributedMatvec(a_local, ordered=False)
    mixed = distop.Problem(lambda x: {"f": jnp.sum(loose(x)), **dm.build(a_local, w,
                                                                        "reverse")(x)},
                           {"x": x0})
    assert sorted((e.phase, e.lean, e.made) for e in mixed.schedule) == [
        ("forward", False, True), ("forward", True, False), ("vjp", False, True),
        ("vjp", True, True)], mixed.schedule


def test_bad_names_and_inputs():
    problem = distop.Problem(lambda x, n: {"f": jnp.sum(x) * n}, {"x": np.ones(2), "n": 3})
    with pytest.raises(ValueError, match=r"compute_totals\(wrt=\['x3'\]\): no input named "
                                         r"'x3'; inputs are \['x', 'n'\]"):
        problem.compute_totals(wrt=["x3"])
    with pytest.raises(ValueError, match="no output named 'g'"):
        problem.compute_totals(of="g")
    with pytest.raises(ValueError, match="'n' is not floating point"):
        problem.compute_totals(wrt="n")
    with pytest.raises(ValueError, match="mode='fast'"):
        problem.compute_totals(mode="fast")
    with pytest.raises(ValueError, match=r"run\(z=...\): no input named 'z'"):
        problem.run(z=1.0)
    with pytest.raises(TypeError, match=r"run\(x=...\): got a str"):
        problem.run(x="abc")
    with pytest.raises(TypeError, match="expected a dict of output name"):
        distop.Problem(lambda x: x, {"x": np.ones(2)})
    with pytest.raises(ValueError, match=r"of=\['f', 'f'\]\): outputs \['f'\] are named more "
                                         "than once; name each output once"):
        problem.compute_totals(of=["f", "f"])
    with pytest.raises(ValueError, match=r"wrt=\['x', 'x'\]\): inputs \['x'\] are named"):
        problem.run_and_compute_totals(wrt=["x", "x"])
    for bad in (np.array(["a"]), np.zeros(2, [("a", "f8")])):
        with pytest.raises(TypeError, match="expected a numeric array or number"):
            problem.run(x=bad)


def test_user_error_in_problem_is_raised_as_itself():
    class Boom(distop.DistributedOperator):
        def forward(self, comm, x):
            raise ValueError("bad block")

    problem = distop.Problem(lambda x: {"f": Boom()(x)}, {"x": np.ones(2)})
    with pytest.raises(distop.OperatorError, match=r"Boom.forward on rank 0: raised "
                                                   r"ValueError: bad block"):
        problem.run()


def test_a_model_jax_cannot_differentiate_still_runs():
    def model(x):  # reverse mode refuses a while_loop
        y = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0]
        return {"f": jnp.sum(Cube()(y))}

    problem = distop.Problem(model, {"x": np.ones(2)})
    assert problem.run()["f"] == 2 * 8.0 ** 3
    assert [e.phase for e in problem.schedule] == ["forward"]  # (the run program's)
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        problem.compute_totals()


@pytest.mark.parametrize("ordered", [None, True])
def test_an_operator_inside_jax_checkpoint_is_refused_by_io_callback(ordered):
    op = Cube(ordered=ordered)
    with pytest.raises(distop.DistopError, match=r"Cube.forward is called inside "
                                                 r"jax.checkpoint \(jax.remat\)"):
        distop.Problem(lambda x: {"f": jnp.sum(jax.checkpoint(lambda x: jnp.sin(op(x)))(x))},
                       {"x": np.ones(2)}, backend="io_callback")
    nested = jax.checkpoint(lambda x: jax.lax.cond(True, op, lambda x: x, x))
    with pytest.raises(distop.DistopError, match="inside jax.checkpoint"):
        distop.Problem(lambda x: {"f": jnp.sum(nested(x))}, {"x": np.ones(2)},
                       backend="io_callback")


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_jax_numpy_code_checkpointed_around_an_operator_is_fine(backend):
    op = Cube()
    problem = distop.Problem(lambda x: {"f": jnp.sum(jax.checkpoint(jnp.sin)(op(x)))},
                             {"x": np.ones(2)}, backend=backend)
    np.testing.assert_allclose(problem.compute_totals()["f", "x"],
                               [3 * np.cos(1.0)] * 2 * np.ones((1, 2)), rtol=1e-12)


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_user_error_after_calls_that_worked_is_raised_as_itself(backend):
    # from the third call on, JAX runs a program through its C++ dispatch, which
    # reports a host call's error differently
    failing = []

    class LaterBoom(distop.DistributedOperator):
        def forward(self, comm, x):
            if failing:
                raise KeyError("later")
            return x

    problem = distop.Problem(lambda x: {"f": jnp.sum(LaterBoom()(x))}, {"x": np.ones(2)},
                             backend=backend)
    for _ in range(3):
        problem.run()
    failing.append(True)
    with pytest.raises(distop.OperatorError, match=r"LaterBoom.forward on rank 0: raised "
                                                   r"KeyError: 'later'"):
        problem.run()


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_an_error_message_that_cannot_be_encoded_is_raised_escaped(backend):
    # (in a process of its own: where the message reached XLA as it was, the process
    # crashed, on both backends)
    import subprocess
    import sys

    script = (
        "import jax, numpy as np, distop\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "class Boom(distop.DistributedOperator):\n"
        "    def forward(self, comm, x):\n"
        "        raise RuntimeError('bad byte \\udc80')\n"
        f"p = distop.Problem(lambda x: {{'y': Boom()(x)}}, {{'x': np.ones(3)}}, "
        f"backend={backend!r})\n"
        "try:\n"
        "    p.run()\n"
        "except distop.OperatorError as err:\n"
        "    print('raised:', ascii(str(err)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "raised: 'Boom.forward on rank 0: raised RuntimeError: bad byte \\\\udc80'" in (
        proc.stdout), proc.stdout


# -- the lean path's rewrites (ordered=True: the lean path in one process too) ----------
def _chain_model(ops, between):
    def model(x):
        for op in ops:
            x = between(op(x))
        return {"f": jnp.sum(x * x)}
    return model


def _programs(problem):
    return {name: p for (name, *_), p in problem._programs.programs.items()}


def test_only_programs_that_always_end_and_run_no_host_code_of_their_own_agree_in_a_call():
    # (under MPI, such a program's first host call makes the ranks' agreement; the
    # others make it before they run: see docs/architecture.md)
    op = dm.DistributedMatvec(dm.setup(6, 1)[0], ordered=True)
    x0 = np.linspace(-1.0, 1.0, 6)

    def looped(x):  # a while loop whose condition reads the operator's result
        y = op(x)
        return {"f": jax.lax.while_loop(lambda c: c < jnp.sum(y), lambda c: c + 1.0, 0.0)}

    def own_callback(x):
        seen = io_callback(lambda a: a, jax.ShapeDtypeStruct((), x.dtype), jnp.sum(x),
                           ordered=True)
        return {"f": jnp.sum(op(x)) + seen}

    unordered = dm.DistributedMatvec(dm.setup(6, 1)[0], ordered=False)
    models = {"plain": (lambda x: {"f": jnp.sum(op(x))}, True), "looped": (looped, False),
              "own callback": (own_callback, False),
              # (XLA may run an unordered call before the first ordered one)
              "unordered operator": (lambda x: {"f": jnp.sum(op(unordered(x)))}, False),
              "pure callback": (lambda x: {"f": jnp.sum(op(jax.pure_callback(
                  np.negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x)))}, False)}
    for name, (model, makes_agreement) in models.items():
        problem = distop.Problem(model, {"x": x0})
        problem.run()
        assert _programs(problem)["run"].makes_agreement is makes_agreement, name
    problem = distop.Problem(models["plain"][0], {"x": x0}, backend="io_callback")
    problem.run()
    assert not _programs(problem)["run"].makes_agreement
    # nor does an FFI call of the model's own (its target could communicate)
    own_ffi = jax.make_jaxpr(jax.ffi.ffi_call("a_target", jax.ShapeDtypeStruct((), x0.dtype)))
    assert [distop._compiler.programs.blocks_agreement(e) for e in own_ffi().eqns] == [True]


def test_fusion_runs_a_chain_with_nothing_between_its_calls_in_one_host_call():
    ops = [dm.DistributedMatvec(dm.setup(6, 1)[0] * 0.3, ordered=True) for _ in range(5)]
    x0 = np.linspace(-1.0, 1.0, 6)
    fused = distop.Problem(_chain_model(ops, lambda y: y), {"x": x0})
    plain = distop.Problem(_chain_model(ops, lambda y: y), {"x": x0}, fuse=False)
    assert [e.phase for e in fused.schedule] == ["forward"] * 5 + ["vjp"] * 5
    # the forward chain in one call; the reverse chain (its seed reads the last
    # forward result through x * x) in a second one
    assert [e.group for e in fused.schedule] == [0] * 5 + [1] * 5
    assert all(e.lean for e in fused.schedule)
    assert [e.group for e in plain.schedule] == list(range(10))
    assert fused.run()["f"] == plain.run()["f"]
    assert _programs(fused)["compute_totals"].n_calls == 2 and _programs(fused)["run"].n_calls == 1
    np.testing.assert_array_equal(fused.compute_totals()["f", "x"],
                                  plain.compute_totals()["f", "x"])
    a = ops[0].A.toarray()
    m = np.linalg.matrix_power(a, 5)
    np.testing.assert_allclose(fused.compute_totals()["f", "x"][0], 2 * m.T @ (m @ x0),
                               rtol=1e-12)


def test_a_long_chain_runs_in_segments_exactly_once_per_call(monkeypatch):
    from distop._compiler.stages import loops, segments

    monkeypatch.setattr(loops, "REPEATS", 10 ** 9)  # no loops: the chain as it is
    log = []

    class Logged(distop.DistributedOperator):
        index: int
        forward_collectives = ("Allreduce",)

        def forward(self, comm, x):
            log.append(self.index)
            return 0.5 * x

        def vjp(self, comm, y_bar, x):
            return 0.5 * y_bar

    n = 2 * segments.SEGMENT + 5
    ops = [Logged(i, ordered=True) for i in range(n)]
    problem = distop.Problem(_chain_model(ops, jnp.sin), {"x": np.array([0.3, -0.2])})
    log.clear()
    f = problem.run()["f"]
    assert log == list(range(n))  # every call once, in order, through the segments
    programs = _programs(problem)
    assert programs["run"].n_calls == n and programs["compute_totals"].n_calls == 2 * n
    spec = {"x": jax.ShapeDtypeStruct((2,), np.float64)}
    jaxpr = programs["run"].fn.trace(jax.ShapeDtypeStruct((), np.float64), spec).jaxpr
    assert sum(e.primitive.name == "cond" for e in jaxpr.eqns) == 3
    x = np.array([0.3, -0.2])
    for _ in range(n):
        x = np.sin(0.5 * x)
    np.testing.assert_allclose(f, np.sum(x * x), rtol=1e-12)
    J = problem.compute_totals()["f", "x"]
    reference = jax.grad(lambda x: jnp.sum(_chain_reference(x, n) ** 2))(jnp.array([0.3, -0.2]))
    np.testing.assert_allclose(J[0], reference, rtol=1e-12)


def _chain_reference(x, n):
    for _ in range(n):
        x = jnp.sin(0.5 * x)
    return x


class _Logged(distop.DistributedOperator):
    """y = scale * x, logging every call."""

    index: int
    log: list
    scale: float = 0.5
    forward_collectives = ("Allreduce",)

    def forward(self, comm, x):
        self.log.append(("forward", self.index))
        return self.scale * x

    def vjp(self, comm, y_bar, x):
        self.log.append(("vjp", self.index))
        return self.scale * y_bar


def _loops(problem, name):
    """**Returns:** the scans at the top level of an entry point's program."""
    program = _programs(problem)[name]
    spec = {"x": jax.ShapeDtypeStruct((2,), np.float64)}
    extra = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in program.extra]
    jaxpr = program.fn.trace(jax.ShapeDtypeStruct((), np.float64), spec, *extra).jaxpr
    return [e for e in jaxpr.eqns if e.primitive.name == "scan"]


def test_a_repeated_stretch_runs_as_one_loop_exactly_once_per_call_in_order():
    from distop._compiler.stages import loops

    log, n = [], 3 * loops.REPEATS + 1
    ops = [_Logged(i, log, ordered=True) for i in range(n)]
    x0 = np.array([0.3, -0.2])
    problem = distop.Problem(_chain_model(ops, jnp.sin), {"x": x0})
    log.clear()
    f = problem.run()["f"]
    assert log == [("forward", i) for i in range(n)]  # every call once, in order
    log.clear()
    J = problem.compute_totals()["f", "x"]
    assert log == ([("forward", i) for i in range(n)]
                   + [("vjp", i) for i in reversed(range(n))])
    programs = _programs(problem)
    assert programs["run"].n_calls == n and programs["compute_totals"].n_calls == 2 * n
    # one loop for the values; one forward and one reverse for the totals
    assert len(_loops(problem, "run")) == 1 and len(_loops(problem, "compute_totals")) == 2
    np.testing.assert_allclose(f, np.sum(_chain_reference(x0, n) ** 2), rtol=1e-12)
    reference = jax.grad(lambda x: jnp.sum(_chain_reference(x, n) ** 2))(jnp.array(x0))
    np.testing.assert_allclose(J[0], reference, rtol=1e-12)


def test_loops_give_what_the_calls_one_by_one_give():
    """Two operators per repetition, a result read after the loop from every
    repetition, a repetition that differs in the middle (two loops around it), and a
    derivative call that reads its forward call's input: the same values and totals
    with loops and without."""
    a = dm.setup(2, 1)[0].toarray()
    first = dm.DistributedMatvec(a * 0.9, ordered=True)
    second = dm.DistributedMatvec(np.eye(2)[::-1] * 0.8, ordered=True)

    def model(x):
        seen = []
        for i in range(60):
            x = jnp.tanh(first(x)) * (1.5 if i == 30 else 1.0)
            x = -second(x)
            seen.append(x[0])
        return {"f": jnp.sum(x * x), "seen": jnp.stack(seen)}

    x0 = np.array([0.3, -0.7])

    def make():
        problem = distop.Problem(model, {"x": x0})
        return problem, problem.run(), problem.compute_totals()

    problem, values, totals = make()
    _, flat_values, flat_totals = without_loops(make)
    assert len(_loops(problem, "run")) == 2 and len(_loops(problem, "compute_totals")) == 4
    for key in flat_values:
        np.testing.assert_allclose(values[key], flat_values[key], rtol=1e-13)
    for key in flat_totals:
        np.testing.assert_allclose(totals[key], flat_totals[key], rtol=1e-13, atol=1e-300)
    reference = jax.jacrev(lambda x: model(x)["seen"])(jnp.array(x0))
    np.testing.assert_allclose(totals["seen", "x"], reference, rtol=1e-12, atol=1e-300)


def test_loops_among_more_calls_than_one_segment_holds():
    """An outer Python loop of 8 calls and an inner one of 16 repetitions (a loop of
    its own), 10 times: more top-level calls than a segment holds, and a segment's
    64th call right before a loop."""
    inner = dm.DistributedMatvec(dm.setup(2, 1)[0].toarray() * 0.9, ordered=True)
    total = distop.AllreduceSum()

    def model(x):
        for _ in range(10):
            s = jnp.sum(x)
            for _ in range(8):
                s = jnp.cos(total(s))
            y = x * s
            for _ in range(16):
                y = -inner(y)
            x = x + 0.1 * y
        return {"f": jnp.sum(x)}

    def make():
        problem = distop.Problem(model, {"x": np.array([0.3, -0.7])})
        return problem, problem.run(), problem.compute_totals()

    problem, values, totals = make()
    _, flat_values, flat_totals = without_loops(make)
    assert len(_loops(problem, "run")) >= 10
    assert _programs(problem)["run"].n_calls == 10 * (8 + 16)
    np.testing.assert_allclose(values["f"], flat_values["f"], rtol=1e-13)
    np.testing.assert_allclose(totals["f", "x"], flat_totals["f", "x"], rtol=1e-13)


def test_loops_release_their_call_sites_with_the_program():
    import gc

    from distop._compiler.stages import loops
    from distop._hostcalls import ffi as _ffi

    log = []
    ops = [_Logged(i, log, ordered=True) for i in range(loops.REPEATS + 2)]
    problem = distop.Problem(_chain_model(ops, jnp.sin), {"x": np.array([0.3, -0.2])})
    before = set(_ffi._sites)
    problem.compute_totals()
    assert any(c.members[0].op is ops[0] for c in loops_since(before))
    del problem
    gc.collect()
    assert not loops_since(before)


def test_a_program_that_skips_a_host_call_raises():
    op = dm.DistributedMatvec(dm.setup(4, 1)[0], ordered=True)
    problem = distop.Problem(lambda x: {"f": jnp.sum(op(x))}, {"x": np.ones(4)})
    problem.run()
    _programs(problem)["run"].n_calls += 1  # what a dropped call would look like
    with pytest.raises(distop.DistopError, match="made 1.0 host calls instead of 2"):
        problem.run()


def test_methods_that_take_out_write_straight_into_the_result_buffers():
    seen = []

    class Double(distop.DistributedOperator):
        forward_collectives = ("Allreduce",)
        batched_vjp = True

        def forward(self, comm, x, out=None):
            seen.append(("forward", out is not None))
            y = np.empty_like(x) if out is None else out
            np.multiply(x, 2.0, out=y)
            return y

        def vjp(self, comm, y_bar, x, out=None):
            seen.append(("vjp", None if out is None else out.shape))
            if out is None:
                return 2.0 * y_bar
            out[...] = 2.0 * y_bar
            return out

    x0 = np.array([1.0, -2.0, 3.0])
    for ordered, fuse, offered in ((True, True, True), (True, False, True),
                                   (False, True, False)):
        a, b = Double(ordered=ordered), Double(ordered=ordered)
        problem = distop.Problem(
            lambda x, a=a, b=b: {"f": jnp.sum(a(x) ** 2) + jnp.sum(b(x))}, {"x": x0},
            fuse=fuse)
        seen.clear()
        np.testing.assert_allclose(problem.run()["f"], 4 * np.sum(x0 ** 2) + 2 * np.sum(x0))
        np.testing.assert_allclose(problem.compute_totals()["f", "x"][0], 8 * x0 + 2)
        # the lean path offers XLA's buffers (batched vjp: a leading batch axis); the
        # unordered callbacks have none to offer (and XLA may drop unused ones).
        # compute_totals calls a's forward (the reverse sweep of a(x) ** 2 reads it),
        # not b's (only f's value reads it)
        if offered:
            expected = [("forward", True)] * 3 + [("vjp", (1, 3))] * 2
            assert sorted(seen, key=str) == sorted(expected, key=str), (fuse, seen)
        else:
            assert seen and all(o in (False, None) for _, o in seen), seen

    class Sign(distop.DistributedOperator):  # an integer output, an integer input
        batched_vjp = True

        def output_spec(self, x, n):
            return x, jax.ShapeDtypeStruct(x.shape, np.int64)

        def forward(self, comm, x, n, out=None):
            seen.append(("forward", [(o.dtype, o.shape) for o in out]))
            return x * n, (x > 0).astype(np.int64)

        def vjp(self, comm, cts, x, n, out=None):
            seen.append(("vjp", [None if o is None else o.dtype for o in out]))
            return cts[0] * 3, None

    seen.clear()
    problem = distop.Problem(lambda x: dict(zip("yn", Sign()(x, 3))), {"x": x0})
    np.testing.assert_array_equal(problem.run()["n"], [1, 0, 1])
    np.testing.assert_array_equal(problem.compute_totals()["y", "x"], 3 * np.eye(3))
    # integer results get their buffers too; an integer input has no cotangent to offer
    assert seen == [("forward", [(np.float64, (3,)), (np.int64, (3,))]),
                    ("vjp", [np.float64, None])], seen



def _thp_eligible(address):
    """Whether Linux would back the memory mapping that holds `address` with
    transparent huge pages (/proc/self/smaps' THPeligible)."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, stop = (int(v, 16) for v in head.split("-"))
                found = start <= address < stop
            elif found and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="transparent huge pages are a Linux feature")
def test_large_result_buffers_get_huge_pages_as_numpy_arrays_do():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off on this machine")
    seen = []

    class Fill(distop.DistributedOperator):
        forward_collectives = ("Allreduce",)

        def forward(self, comm, x, out=None):
            # the first whole 2 MiB page of XLA's buffer, before the method writes to it
            page = -(-out.ctypes.data // (2 << 20)) * (2 << 20)
            seen.append((out.nbytes, _thp_eligible(page)))
            out[...] = x
            return out

    small, large = np.ones(1 << 10), np.ones(1 << 20)  # 8 KiB, 8 MiB
    for x0 in (large, small):
        problem = distop.Problem(lambda x: {"y": Fill()(x)}, {"x": x0})
        np.testing.assert_array_equal(problem.run()["y"], x0)
    assert seen[0] == (large.nbytes, True), seen  # (numpy's own arrays: from 4 MiB)
    assert seen[1][0] == small.nbytes, seen


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_an_operator_on_bfloat16_values_inside_a_model(backend):
    """bfloat16 is differentiable, as in JAX (numpy does not count it as inexact): its
    cotangents reach the VJP, in a Problem and in jax.grad, jitted or not."""
    class Twice(distop.DistributedOperator):
        forward_collectives = ("Allreduce",)

        def forward(self, comm, x):
            assert x.dtype == jnp.bfloat16, x.dtype
            return 2 * x

        def vjp(self, comm, y_bar, x):
            assert y_bar.dtype == jnp.bfloat16, y_bar.dtype
            return 2 * y_bar

    def model(x):
        return {"y": Twice()(x.astype(jnp.bfloat16)).astype(jnp.float64)}

    problem = distop.Problem(model, {"x": np.arange(3.0)}, backend=backend)
    np.testing.assert_array_equal(problem.run()["y"], [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(problem.compute_totals()["y", "x"], 2 * np.eye(3))

    def f(x):
        return jnp.sum(model(x)["y"])

    for grad in (jax.grad(f), jax.jit(jax.grad(f))):
        np.testing.assert_array_equal(grad(jnp.arange(3.0)), [2.0, 2.0, 2.0])
    b = distop.Problem(lambda x: {"y": Twice()(x.astype(jnp.bfloat16))}, {"x": np.arange(2.0)},
                       backend=backend)  # a bfloat16 output of a Problem
    np.testing.assert_array_equal(b.compute_totals()["y", "x"], 2 * np.eye(2))


def test_operators_given_python_scalars_on_every_path():
    """A Python number passed to an operator is a literal of the program, not a
    variable: the lean path's rewrites (rows, fusion, segments) take it as it is."""
    class Scale(distop.DistributedOperator):
        ordered = True

        def forward(self, comm, x, c):
            return x * c

        def vjp(self, comm, y_bar, x, c):
            return y_bar * c, np.sum(y_bar * x)

    op = Scale()

    def model(x, y):
        a, b = op(x, 3.0), op(y, 2.0)  # independent: fused
        for _ in range(70):  # a chain longer than one segment
            a = op(a, 1.0)
        return {"f": jnp.sum(a) + jnp.sum(b), "g": jnp.sum(op(a, 0.5))}

    point = {"x": np.ones(2), "y": np.arange(3.0)}
    want_values = {"f": 12.0, "g": 3.0}
    want_totals = {("f", "x"): [[3.0, 3.0]], ("g", "x"): [[1.5, 1.5]],
                   ("f", "y"): [[2.0, 2.0, 2.0]], ("g", "y"): [[0.0, 0.0, 0.0]]}
    for backend, fuse in [("lean", True), ("lean", False), ("io_callback", True)]:
        problem = distop.Problem(model, point, backend=backend, fuse=fuse)
        assert {k: float(v) for k, v in problem.run().items()} == want_values
        got = problem.compute_totals()
        assert {k: v.tolist() for k, v in got.items()} == want_totals, (backend, fuse)


@pytest.mark.parametrize("batched", [True, False])
def test_a_vjp_sees_only_the_seed_rows_that_reach_it(batched):
    rows_seen = []

    class Scale(distop.DistributedOperator):
        c: float
        forward_collectives = vjp_collectives = ("Allreduce",)
        batched_vjp = batched

        def forward(self, comm, x):
            return self.c * x

        def vjp(self, comm, y_bar, x):
            rows_seen.append((self.c, y_bar.shape[0] if batched else 1))
            return self.c * y_bar

    ops = [Scale(float(c), ordered=True) for c in (2, 3, 5)]
    problem = distop.Problem(
        lambda x: {f"f{i}": jnp.sum(op(x)) for i, op in enumerate(ops)}, {"x": np.ones(4)})
    J = problem.compute_totals()  # 3 seeds; each operator's cotangent is zero in 2 rows
    for i, c in enumerate((2, 3, 5)):
        np.testing.assert_array_equal(J[f"f{i}", "x"], np.full((1, 4), float(c)))
    # each VJP ran on its one nonzero row: once, with a batch of one row
    assert sorted(rows_seen) == [(2.0, 1), (3.0, 1), (5.0, 1)], rows_seen


def test_products_with_identity_matrices_are_dropped_exactly():
    from jax.extend.core import jaxpr_as_fun

    from distop._compiler.passes import identity

    def f(unit, w, v):
        return (unit @ w, w.T @ unit, jnp.einsum("ij,kj->ik", unit, w.T),
                jnp.einsum("ijk,jl->ikl", v, unit), unit @ unit, w @ w.T)

    unit, w = np.eye(3), np.arange(12.0).reshape(3, 4) - 5
    v = np.arange(24.0).reshape(2, 3, 4)
    closed = jax.make_jaxpr(f)(unit, w, v)
    simpler = identity.drop_identity_products(closed, {closed.jaxpr.invars[0]})
    names = [e.primitive.name for e in simpler.jaxpr.eqns]
    # the four products with one identity factor are gone (two by a transpose);
    # unit @ unit and w @ w.T stay
    assert names.count("dot_general") == 2 and names.count("transpose") >= 2
    got = jaxpr_as_fun(simpler)(unit, w, v)
    for a, b in zip(got, f(unit, w, v)):
        np.testing.assert_array_equal(a, b)
    assert identity.drop_identity_products(closed, set()) is None


def test_a_reverse_sweep_over_unit_seeds_does_not_multiply_by_them():
    a_local = dm.setup(8, 1)[0]
    op = dm.DistributedMatvec(a_local)
    w = np.random.default_rng(1).standard_normal((5, 8))
    x0 = np.linspace(-1.0, 1.0, 8)
    problem = distop.Problem(lambda x, w: {"f": w @ op(x)}, {"x": x0, "w": w})
    J = problem.compute_totals("f", "x")["f", "x"]
    np.testing.assert_allclose(J, w @ a_local.toarray(), rtol=1e-13)
    program = problem._programs.programs[
        "compute_totals", ("batched", ("f",), ("x",), False, "rev"),
        id(next(iter(problem._programs.layouts.values())))]
    spec = {"x": jax.ShapeDtypeStruct((8,), np.float64),
            "w": jax.ShapeDtypeStruct((5, 8), np.float64)}
    jaxpr = program.fn.trace(jax.ShapeDtypeStruct((), np.float64), spec,
                             jax.ShapeDtypeStruct((5, 5), np.float64)).jaxpr
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    # only the forward value w @ y is left (unused, XLA drops it); not seeds @ w
    assert all(e.invars[0].aval.shape == (5, 8) for e in products)


def test_values_known_before_the_program_runs_are_computed_once_exactly():
    from jax.extend.core import jaxpr_as_fun

    from distop._compiler.passes import fold

    w = np.arange(12.0).reshape(3, 4) - 5

    def f(unit, x):
        cts = sum(jnp.pad(unit[:, i:i + 1], ((0, 0), (i, 2 - i))) for i in range(3))
        seeded = cts[:, :, None] * w[None]  # reads the known input and a constant
        big = jnp.broadcast_to(cts[:, :, None], (3, 3, 100))  # over the limit
        return seeded * x, big.sum() * x, w * 2.0, (cts @ w) * x, cts[1, 1] * x  # (0-d)

    unit, x = np.eye(3), np.linspace(1.0, 2.0, 4)
    closed = jax.make_jaxpr(f)(unit, x)
    folded = fold.fold_known(closed, {closed.jaxpr.invars[0]}, limit=200)
    names = [e.primitive.name for e in folded.jaxpr.eqns]
    assert "pad" not in names and "slice" not in names and len(names) < len(closed.eqns)
    assert "broadcast_in_dim" in names  # `big`: computed by the program
    # `cts` is the identity again: its product with w is gone too; XLA reads the
    # constants through a barrier (it would fold them otherwise, to other values)
    assert "dot_general" not in names and names[0] == "optimization_barrier"
    for a, b in zip(jax.jit(jaxpr_as_fun(folded))(unit, x),
                    jax.jit(jaxpr_as_fun(closed))(unit, x)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert all(np.shape(c) == v.aval.shape
               for v, c in zip(folded.jaxpr.constvars, folded.consts))
    assert fold.fold_known(closed, set()) is None
    assert fold.fold_known(closed, {closed.jaxpr.invars[0]}, budget=8) is None
    # once `spend` elements are computed, the rest stays in the program, values the same
    thrifty = fold.fold_known(closed, {closed.jaxpr.invars[0]}, limit=200, spend=12)
    assert len(folded.jaxpr.eqns) < len(thrifty.jaxpr.eqns) < len(closed.jaxpr.eqns) + 1
    for a, b in zip(jax.jit(jaxpr_as_fun(thrifty))(unit, x),
                    jax.jit(jaxpr_as_fun(closed))(unit, x)):
        np.testing.assert_array_equal(a, b)
    # an identity larger than an operation may produce is never made
    assert fold.fold_known(closed, {closed.jaxpr.invars[0]}, limit=8) is None


def test_products_with_seeds_in_another_order_are_computed_ahead():
    from distop._compiler.passes import fold

    w = np.linspace(-1.0, 2.0, 12).reshape(3, 4)
    closed = jax.make_jaxpr(lambda s: _rows(s, [2, 0, 1]) @ w)(np.eye(3))
    folded = fold.fold_known(closed, {closed.jaxpr.invars[0]})
    assert "dot_general" not in [e.primitive.name for e in folded.jaxpr.eqns]
    np.testing.assert_array_equal(folded.consts[-1], w[[2, 0, 1]])
    # the matvec's objectives f0, f1, ..., f11 are seeded in the order of their names
    # (f0, f1, f10, f11, f2, ...): the reverse sweep's first product, with the seeds in
    # that order, is computed when the program is built, not by every call
    a_local, a_global, x0, w = dm.setup(40, 12)
    problem = distop.Problem(dm.build(a_local, w, "reverse"), {"x": x0})
    jaxpr, _ = totals_jaxpr(problem)
    # (the forward value w @ y is left, unused: XLA drops it)
    assert all(e.invars[0].aval.shape == (12, 40) for e in jaxpr.eqns
               if e.primitive.name == "dot_general"), jaxpr
    for i in range(12):
        np.testing.assert_allclose(problem.compute_totals()[f"f{i}", "x"][0],
                                   w[i] @ a_global, rtol=1e-12)


@pytest.mark.parametrize("product", [
    lambda p, w: p @ w,  # the seeds in another order, then a product with an input
    lambda p, w: w.T @ p.T,  # the same, the other way round
    lambda p, w: jnp.einsum("ij,ajb->aib", p, w[None].repeat(2, 0)),  # an inner axis
    lambda p, w: jnp.einsum("aj,ij->ai", w.T, p),  # the matrix's own axis 1, on the right
])
def test_products_with_seeds_in_another_order_and_an_input_take_its_entries(product):
    from jax.extend.core import jaxpr_as_fun

    from distop._compiler.passes import fold

    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4))
    w[0, 1], w[2, 3] = -0.0, 0.0
    closed = jax.make_jaxpr(lambda s, w: product(_rows(s, [2, 0, 1]), w))(np.eye(3), w)
    assert "dot_general" in [e.primitive.name for e in closed.jaxpr.eqns]
    folded = fold.fold_known(closed, {closed.jaxpr.invars[0]})
    assert "dot_general" not in [e.primitive.name for e in folded.jaxpr.eqns]
    # the entries themselves, the same as XLA's product bit for bit where no result is
    # a zero (XLA's sum of a negative zero and zeros is +0)
    got = jax.jit(jaxpr_as_fun(folded))(np.eye(3), w)[0]
    want = jax.jit(jaxpr_as_fun(closed))(np.eye(3), w)[0]
    nonzero = np.asarray(want) != 0
    np.testing.assert_array_equal(np.asarray(got)[nonzero], np.asarray(want)[nonzero])
    np.testing.assert_array_equal(got, want)  # (signs of zeros aside: -0.0 == 0.0)
    # a matrix that only looks like one (a 2, or two 1s in a column) stays a product
    for other in ([[0, 2, 0], [1, 0, 0], [0, 0, 1]], [[0, 1, 0], [0, 1, 0], [1, 0, 0]]):
        c = jax.make_jaxpr(lambda s, w, other=other: product(
            s[::-1] * 0 + jnp.asarray(other, float), w))(np.eye(3), w)
        f = fold.fold_known(c, {c.jaxpr.invars[0]})
        assert "dot_general" in [e.primitive.name for e in (f or c).jaxpr.eqns]


def test_the_matvec_with_an_input_w_multiplies_no_seeds_by_it():
    # f0 ... f11 are seeded in the order of their names: the cotangent of w @ y is W's
    # rows in that order, taken from W, not a (12, 12) by (12, 40) product per call
    a_local, a_global, x0, w = dm.setup(40, 12)
    op = dm.DistributedMatvec(a_local)

    def model(x, w):
        f = w @ op(x)
        return {f"f{i}": f[i] for i in range(12)}

    problem = distop.Problem(model, {"x": x0, "w": w})
    J = problem.compute_totals(wrt="x")
    jaxpr, _ = totals_jaxpr(problem)
    # (left: the forward value w @ y and the outer product of w's cotangent, both
    # unused here: XLA drops them)
    assert all(e.outvars[0].aval.shape in {(12,), (12, 12, 40)} for e in jaxpr.eqns
               if e.primitive.name == "dot_general"), jaxpr
    for i in range(12):
        np.testing.assert_allclose(J[f"f{i}", "x"][0], w[i] @ a_global, rtol=1e-12)
    assert all(c.ok for c in problem.check_totals(out_stream=None).values())


def test_a_large_output_makes_no_identity_of_its_size():
    # compute_totals' seeds for 1e5 outputs would be a 75 GiB identity: nothing makes it
    # until compute_totals is called (and then only a rank's rows)
    problem = distop.Problem(lambda x: {"y": Cube()(x)}, {"x": np.full(100_000, 2.0)})
    assert problem.run()["y"][0] == 8.0 and len(problem.schedule) == 2


def _rows(s, order):
    """The rows of `s` in `order`, moved by slices (which distop computes ahead)."""
    return jnp.concatenate([s[i:i + 1] for i in order])


@pytest.mark.parametrize("f", [
    lambda s: ((s + 0.1) / 10.0,),  # a division: XLA multiplies by the reciprocal
    lambda s: (s * 0.1 + 0.2 + 0.3,),  # XLA reassociates sums of constants
    lambda s: (s * -0.0 + 0.0,),  # and drops `+ 0`, keeping a negative zero
    lambda s: ((s[0] * (1 + 2 ** -11 + 2 ** -40)).astype(np.float16),),
    lambda s: (s * np.array([np.inf, 1.0, 2.0]),),  # NaN from 0 * inf, no warning
    lambda s: (s[:2] * 2.0 + jax.random.normal(jax.random.key(0), (2, 3)),),
    lambda s: (jnp.exp(jnp.sum(s[:, 1:] @ np.ones((2, 4)), axis=1) * 0.3),),
    # products with a permutation of the seeds, and their negatives, in every layout
    lambda s: (_rows(s, [2, 0, 1]) @ np.linspace(-2.0, 3.0, 12).reshape(3, 4),),
    lambda s: (np.linspace(0.5, 3.0, 6).reshape(2, 3) @ -_rows(s, [1, 2, 0]).T,),
    lambda s: (jnp.einsum("ij,kj->ik", np.linspace(1.0, 2.0, 9).reshape(3, 3),
                          _rows(s, [2, 1, 0])),),
    lambda s: (jnp.einsum("bij,bjk->bik",
                          jnp.concatenate([s[None], _rows(s, [1, 0, 2])[None]]),
                          np.linspace(0.1, 1.0, 24).reshape(2, 3, 4)),),
    # products that stay in the program: a zero result, a NaN, no selection
    lambda s: (s @ np.array([[1.0, 0.0], [2.0, 3.0], [4.0, 5.0]]),),
    lambda s: (s @ np.array([[np.nan, 1.0], [2.0, 3.0], [4.0, 5.0]]),),
    lambda s: ((s + _rows(s, [2, 1, 0])) @ np.linspace(1.0, 2.0, 6).reshape(3, 2) * 0.1,),
])
def test_values_computed_ahead_are_the_program_s_bit_for_bit(f):
    from jax.extend.core import jaxpr_as_fun

    from distop._compiler.passes import fold

    unit = np.eye(3)
    closed = jax.make_jaxpr(f)(unit)
    folded = fold.fold_known(closed, {closed.jaxpr.invars[0]}) or closed
    for a, b in zip(jax.jit(jaxpr_as_fun(folded))(unit), jax.jit(jaxpr_as_fun(closed))(unit)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8),
                                      np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("config", [((1, 2, 0),), ((2, -1, 1),), ((-1, 0, 2),), ((0, 0, 3),)])
def test_pads_computed_ahead_are_xla_s(config):
    from distop._compiler.passes import fold

    x = np.arange(1.0, 5.0)
    np.testing.assert_array_equal(fold._pad(x, np.float64(-7.0), config),
                                  jax.lax.pad(x, -7.0, config))


def test_operator_calls_are_never_computed_ahead_even_on_known_values():
    calls = []

    class Counted(distop.DistributedOperator):
        def forward(self, comm, x):
            calls.append("forward")
            return 2.0 * x

        def vjp(self, comm, y_bar, x):
            calls.append("vjp")
            return 2.0 * y_bar

    c = np.linspace(1.0, 2.0, 3)
    ops = [Counted(ordered=ordered) for ordered in (True, False)]
    problem = distop.Problem(lambda x: {f"f{i}": x * op(c) for i, op in enumerate(ops)},
                             {"x": np.ones(3)})
    before = len(calls)
    for _ in range(3):
        J = problem.compute_totals()
        np.testing.assert_array_equal(J["f1", "x"], np.diag(2.0 * c))
    # each operator's forward once per call (its value is the derivative), no vjp
    assert calls[before:] == ["forward"] * 6


def test_a_reverse_sweep_from_several_outputs_of_one_vector_is_folded(matvec):
    a_local, _, x0, w = matvec
    model = dm.build(a_local, w, "forward")
    lean = distop.Problem(model, {"x": x0})
    J = lean.compute_totals()
    reference = distop.Problem(model, {"x": x0}, backend="io_callback").compute_totals()
    for key in reference:
        np.testing.assert_allclose(J[key], reference[key], rtol=1e-14)
    jaxpr = totals_jaxpr(lean)[0]
    # the seeds' split into the outputs' cotangents, and their way back through the
    # model's last steps, are constants of the program; each VJP computes its one row,
    # and one concatenation puts them in place (no sum of padded rows)
    assert not {"pad", "mul", "slice", "add_any"} & {e.primitive.name for e in jaxpr.eqns}
    made = {v for e in jaxpr.eqns if "call" in e.params for v in e.outvars}
    joins = [e for e in jaxpr.eqns if e.primitive.name == "concatenate"]
    assert len(joins) == 1 and len(joins[0].invars) == len(w), joins
    assert all(v in made and v.aval.shape == (1, len(x0)) for v in joins[0].invars), joins


_INLINE_SCRIPT = """
import threading
import jax
import numpy as np
import distop

jax.config.update("jax_enable_x64", True)
threads = []

class Scale(distop.DistributedOperator):
    def forward(self, comm, x):
        threads.append(threading.current_thread() is threading.main_thread())
        return 2 * x

    def vjp(self, comm, y_bar, x):
        return 2 * y_bar

op = Scale()
w = np.random.default_rng(0).standard_normal((16, 400))
problem = distop.Problem(lambda x: {"f": w @ op(w.T @ x)}, {"x": np.ones(16)})
problem.run()
print(jax.config.read("jax_cpu_enable_async_dispatch"), all(threads), len(threads))
"""


@pytest.mark.parametrize("setting, expected", [(None, "False True"), ("1", "True")])
def test_programs_run_on_the_calling_thread_unless_async_dispatch_is_kept(setting, expected):
    # With JAX's async dispatch, a program with a few thousand flops runs on an XLA
    # worker thread, its host calls too (and each waits for the GIL there).
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DISTOP_ASYNC_DISPATCH"}
    if setting is not None:
        env["DISTOP_ASYNC_DISPATCH"] = setting
    out = subprocess.run([sys.executable, "-c", _INLINE_SCRIPT], env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(expected), out.stdout


def test_rows_of_gives_none_a_slice_or_indices():
    from distop._hostcalls.host import rows_of

    assert rows_of(np.array([True, True, True])) is None
    assert rows_of(np.array([False, True, True, False])) == slice(1, 3)
    np.testing.assert_array_equal(rows_of(np.array([True, False, True])), [0, 2])
    assert len(rows_of(np.zeros(3, bool))) == 0


def test_a_vjp_on_rows_that_are_not_contiguous_leaves_zeros_between_them():
    seen = []

    class Scale(distop.DistributedOperator):
        forward_collectives = vjp_collectives = ("Allreduce",)
        batched_vjp = True
        unbatched = "expand_dims"

        def forward(self, comm, x):
            return 3.0 * x

        def vjp(self, comm, y_bar, x, out=None):
            seen.append((y_bar.shape, x.shape))
            return 3.0 * y_bar

    op = Scale(ordered=True)
    # outputs 0 and 2 use the operator, output 1 does not: rows 0 and 2 of its cotangent
    def model(x):
        y = op(x)
        return {"a": jnp.sum(y), "b": jnp.sum(x * x), "c": jnp.sum(2.0 * y)}

    problem = distop.Problem(model, {"x": np.ones(4)})
    J = problem.compute_totals(of=["a", "b", "c"])
    np.testing.assert_array_equal(J["a", "x"], np.full((1, 4), 3.0))
    np.testing.assert_array_equal(J["b", "x"], np.full((1, 4), 2.0))
    np.testing.assert_array_equal(J["c", "x"], np.full((1, 4), 6.0))
    assert seen == [((2, 4), (1, 4))], seen


def test_a_vjp_whose_cotangents_are_constants_is_given_only_their_nonzero_rows():
    seen = []
    ops = [RowScale(2.0, seen), RowScale(3.0, seen)]

    # 5 seeds: the first operator's cotangent is nonzero in row 0 only, the second's in
    # rows 1 and 3 (fixed by the seeds: constants of the program)
    def model(x):
        y, z = ops[0](x), ops[1](x)
        return {"a": jnp.sum(y), "b": jnp.sum(z), "c": jnp.sum(x * x), "d": jnp.sum(2.0 * z),
                "e": jnp.sum(x)}

    problem = _same_totals_as_io_callback(model, np.linspace(0.5, 2.0, 4))
    _, calls = totals_jaxpr(problem)
    # given rows 0..0 and 1..3 of the 5; the second skips row 2 (zero) when it runs
    assert sorted(c.batch_shape for c in calls if c.phase == "vjp") == [(1,), (3,)], calls
    seen.clear()
    J = problem.compute_totals()
    assert sorted(seen) == [(2.0, 1), (3.0, 2)], seen
    np.testing.assert_array_equal(J["d", "x"], np.full((1, 4), 6.0))
    # the schedule still shows the whole batch of seeds each call covers
    assert [e.batch for e in problem.schedule if e.phase == "vjp"] == [(5,), (5,)]


def test_vjp_rows_that_overlap_are_added_not_placed():
    ops = [RowScale(2.0), RowScale(3.0)]

    def model(x):  # rows 0-1 of the seeds reach the first operator, rows 1-2 the second
        y, z = ops[0](x), ops[1](x)
        return {"a": jnp.sum(y), "b": jnp.sum(y) + jnp.sum(z), "c": jnp.sum(z),
                "d": jnp.sum(x)}

    problem = _same_totals_as_io_callback(model, np.linspace(0.5, 2.0, 3))
    np.testing.assert_array_equal(problem.compute_totals()["b", "x"], np.full((1, 3), 5.0))
    names = [e.primitive.name for e in totals_jaxpr(problem)[0].eqns]
    assert names.count("pad") == 2 and "concatenate" not in names, names


def test_sums_with_other_terms_keep_their_order_and_rounding():
    ops = [RowScale(0.1), RowScale(0.7)]

    def model(x):  # each operator's row, padded, is summed with terms of x
        y, z = ops[0](x), ops[1](x)
        return {"a": jnp.sum(y) + jnp.sum(jnp.sin(x)) + jnp.sum(x * x * 1.3)
                + jnp.sum(jnp.exp(x)), "b": jnp.sum(z) + jnp.sum(jnp.cos(x))}

    lean = _same_totals_as_io_callback(model, np.array([0.3, 1.7, 2.9, 4.1]))
    reference = distop.Problem(model, {"x": lean._point["x"]}, backend="io_callback")
    for x in np.random.default_rng(0).standard_normal((20, 4)) * 10:
        lean.run(x=x)
        reference.run(x=x)
        J, R = lean.compute_totals(), reference.compute_totals()
        for key in R:
            np.testing.assert_array_equal(J[key], R[key])


def test_a_method_that_reshapes_its_argument_changes_no_later_call():
    class Flat(distop.DistributedOperator):
        def forward(self, comm, x):
            rows = x.shape[0]
            with warnings.catch_warnings():  # (deprecated from numpy 2.5 on, still done)
                warnings.simplefilter("ignore", DeprecationWarning)
                x.shape = (x.size,)  # numpy reshapes this view in place
            return (rows * x).reshape(2, 2)

    op = Flat()
    x0 = np.arange(4.0).reshape(2, 2)
    problem = distop.Problem(lambda x: {"y": op(x)}, {"x": x0})
    for _ in range(3):
        np.testing.assert_array_equal(problem.run(x=x0)["y"], 2 * x0)


def _same_totals_as_io_callback(model, x0):
    """**Returns:** a lean Problem of `model` at x0, after checking that its
    `compute_totals` gives the io_callback backend's results bit for bit."""
    problem = distop.Problem(model, {"x": x0})
    J = problem.compute_totals()
    reference = distop.Problem(model, {"x": x0}, backend="io_callback").compute_totals()
    for key in reference:
        np.testing.assert_array_equal(J[key], reference[key])
    return problem


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_an_integer_output_is_left_out_of_the_totals_in_every_mode(backend):
    problem = distop.Problem(lambda x: {"f": jnp.sum(x ** 2), "n": jnp.argmax(x)},
                             {"x": np.array([1.0, 2.0])}, backend=backend)
    for mode in distop._problem.problem.MODES:
        J = problem.compute_totals(mode=mode)
        assert list(J) == [("f", "x")], (mode, J)
        np.testing.assert_array_equal(J["f", "x"], [[2.0, 4.0]])


def test_inputs_are_private_copies_that_the_programs_read_in_place():
    from distop._problem.inputs import REUSES as _REUSES

    problem = distop.Problem(lambda x: {"s": jnp.sum(Cube()(x)), "y": Cube()(x) + 1.0},
                             {"x": np.ones(3)})
    x = np.array([1.0, 2.0, 3.0])
    out = problem.run(x=x)
    x[0] = 10.0  # the caller's array changed afterwards: distop's copy is not
    assert problem.run()["s"] == 36.0 and out["s"] == 36.0
    np.testing.assert_array_equal(problem.compute_totals("s", "x")["s", "x"], [[3, 12, 27]])
    # a scalar output is a 0-d read-only numpy view; so is a vector output
    for v in (out["s"], out["y"]):
        assert isinstance(v, np.ndarray) and not v.flags.writeable
    assert out["s"].shape == () and out["y"].shape == (3,)
    # a new input goes to the program as it is; one used again, as a JAX array made
    # once that shares its memory (no copy of a large input, in either form)
    mine = problem._point["x"]
    assert mine.ctypes.data % 64 == 0 and problem._executor.on_device(problem._point)["x"] is mine
    for _ in range(_REUSES):
        passed = problem._executor.on_device(problem._point)["x"]
    assert isinstance(passed, jax.Array) and passed.unsafe_buffer_pointer() == mine.ctypes.data
    assert problem._executor.on_device(problem._point)["x"] is passed
    assert problem.run()["s"] == 36.0
    # a JAX array input is read in place too, not copied
    jx = jnp.array([1.0, 1.0, 2.0])
    assert problem.run(x=jx)["s"] == 10.0
    assert problem._point["x"].ctypes.data == jx.unsafe_buffer_pointer()


def test_a_program_is_compiled_once_whatever_form_its_inputs_take():
    compiles = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    problem = distop.Problem(lambda x, y: {"s": jnp.sum(Cube()(x)) * y,
                                           "v": Cube()(x) + y}, {"x": np.ones(3), "y": 2.0})
    problem.run()
    problem.compute_totals()
    inputs = (None, np.zeros(3), jnp.ones(3))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        # numpy arrays first, JAX arrays once used again and again, a new x, a JAX array
        for x in inputs:
            for _ in range(12):
                problem.run(**({} if x is None else {"x": x}))
                problem.compute_totals()
                x = None
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_inputs_of_ml_dtypes_floats(dtype):
    for x in (np.arange(3).astype(dtype), jnp.arange(3, dtype=dtype)):
        problem = distop.Problem(lambda x: {"s": jnp.sum(x.astype(jnp.float32) * 2),
                                            "y": x * 2}, {"x": x})
        out = problem.run()
        assert out["s"] == 6.0 and out["y"].dtype == dtype
        J = problem.compute_totals("s", "x")["s", "x"]
        assert J.dtype == dtype and J.tolist() == [[2, 2, 2]]


def test_inputs_in_the_other_byte_order_are_taken_in_the_machine_s():
    other = ">f8" if np.little_endian else "<f8"
    x = np.array([1.0, 2.0, 3.0], dtype=other)
    problem = distop.Problem(lambda x: {"s": jnp.sum(Cube()(x))}, {"x": x})
    assert problem.run()["s"] == 36.0 and problem.run(x=x[::-1])["s"] == 36.0
    np.testing.assert_array_equal(problem.compute_totals()["s", "x"], [[27, 12, 3]])


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128, np.int32,
                                   jnp.bfloat16, ">f8"])
@pytest.mark.parametrize("shape", [(), 0, 5, (3, 4), (16, 1001)])
def test_empty_makes_arrays_that_xla_reads_in_place(shape, dtype):
    a = distop.empty(shape, dtype)
    assert a.shape == ((shape,) if isinstance(shape, int) else shape)
    assert a.dtype == np.dtype(dtype).newbyteorder("=") and a.dtype.isnative
    assert a.flags.c_contiguous and a.flags.writeable
    if a.size:  # (an empty array has no memory)
        assert a.ctypes.data % 64 == 0
        a[...] = 1
        assert jax.device_put(a).unsafe_buffer_pointer() == a.ctypes.data
    assert distop.empty(7).dtype == np.float64
    assert distop.Problem(lambda x: {"s": jnp.sum(x)}, {"x": a}, copy=False)._point["x"] is a


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_copy_none_shares_the_inputs_xla_reads_in_place_and_copies_the_others(backend):
    from distop._problem.inputs import REUSES as _REUSES

    x = distop.empty(3)
    x[:] = [1.0, 2.0, 3.0]
    offset = np.arange(5.0)[1:4]  # 8 bytes past numpy's own alignment
    assert offset.ctypes.data % 64
    others = {"offset": offset, "strided": np.arange(6.0)[::2],
              "swapped": np.array([0.0, 1.0, 2.0], ">f8" if np.little_endian else "<f8")}
    problem = distop.Problem(
        lambda x, **o: {"s": jnp.sum(Cube()(x)) + sum(jnp.sum(v) for v in o.values())},
        {"x": x, **others}, backend=backend, copy=None)
    assert problem._point["x"] is x
    for k, v in others.items():
        assert not np.shares_memory(problem._point[k], v), k
    assert problem.run()["s"] == 36.0 + 6 + 6 + 3
    np.testing.assert_array_equal(problem.compute_totals("s", "x")["s", "x"], [[3, 12, 27]])
    # a new point: the new array itself, read in place by the program once used again
    y = distop.empty(3)
    y[:] = 1.0
    for _ in range(_REUSES + 1):
        assert problem.run(x=y)["s"] == 3.0 + 15
    assert problem._point["x"] is y
    assert problem._executor.on_device(problem._point)["x"].unsafe_buffer_pointer() == y.ctypes.data
    # numbers and lists are made into distop's own arrays
    assert problem.run(x=[2.0, 0.0, 0.0])["s"] == 8.0 + 15


def test_copy_false_refuses_an_input_that_needs_a_copy_and_names_why():
    x = distop.empty(4)
    x[:] = 1.0
    def model(x, a):
        return {"s": jnp.sum(x) * a}

    problem = distop.Problem(model, {"x": x, "a": 2.0}, copy=False)
    assert problem._point["x"] is x and problem.run()["s"] == 8.0
    swapped = np.ones(4, ">f8" if np.little_endian else "<f8")
    for bad, why in [(np.arange(5.0)[1:], "bytes off 64-byte alignment"),
                     (np.ones(8)[::2], "not C-contiguous"),
                     (swapped, "machine's byte order")]:
        with pytest.raises(ValueError, match=rf"run\(x=...\): Problem\(copy=False\).*{why}"):
            problem.run(x=bad)
        with pytest.raises(ValueError, match=rf"inputs=\{{'x'.*copy=False.*{why}"):
            distop.Problem(model, {"x": bad, "a": 2.0}, copy=False)
    assert problem._point["x"] is x and problem.run()["s"] == 8.0  # nothing changed
    with pytest.raises(ValueError, match=r"Problem\(copy='no'\): expected True, None or False"):
        distop.Problem(model, {"x": x, "a": 2.0}, copy="no")
    # by default, an array XLA could read in place is copied all the same
    assert not np.shares_memory(distop.Problem(model, {"x": x, "a": 2.0})._point["x"], x)


def test_copy_takes_numpy_s_bools_and_refuses_other_values():
    x = distop.empty(2)
    x[:] = 1.0
    def model(x):
        return {"s": jnp.sum(x)}
    assert not np.shares_memory(distop.Problem(model, {"x": x}, copy=np.True_)._point["x"], x)
    assert distop.Problem(model, {"x": x}, copy=np.False_)._point["x"] is x
    for bad in (1, 0, 1.0, "no", [True]):
        with pytest.raises(ValueError, match=r"Problem\(copy=.*\): expected True, None or False"):
            distop.Problem(model, {"x": x}, copy=bad)


def test_empty_refuses_what_numpy_refuses():
    for shape, error, text in [(-1, ValueError, "negative dimensions"),
                               ((2, -1), ValueError, "negative dimensions"),
                               (3.0, TypeError, "an int or a tuple of ints"),
                               ((2.0,), TypeError, "an int or a tuple of ints")]:
        with pytest.raises(error, match=rf"distop.empty\(shape=.*\): .*{text}"):
            distop.empty(shape)
    for dtype in (object, "U", "U3", "S5", "M8[s]", [("a", "f8")]):
        with pytest.raises(TypeError, match=r"distop.empty\(dtype=.*\): expected a numeric"):
            distop.empty(2, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.uint64, np.complex128])
def test_in_32_bit_mode_an_input_jax_would_narrow_is_refused(dtype):
    made_in_64_bits = jnp.ones(3, dtype)  # (a JAX array made while x64 was on)
    jax.config.update("jax_enable_x64", False)
    try:
        for x, copies in ((distop.empty(3, dtype), (True, None, False)),
                          (made_in_64_bits, (True,))):
            for copy in copies:
                with pytest.raises(TypeError, match=r"32-bit mode and would silently make "):
                    distop.Problem(lambda x: {"y": x * 2}, {"x": x}, copy=copy)
        # float32 works, with a float32 token (no float64 in a program in this mode)
        p = distop.Problem(lambda x: {"s": jnp.sum(Cube(ordered=True)(x))},
                           {"x": np.ones(3, np.float32)})
        for _ in range(3):
            assert p.run()["s"] == 3.0 and p._executor.token.dtype == np.float32
        assert p.compute_totals()["s", "x"].tolist() == [[3.0, 3.0, 3.0]]
    finally:
        jax.config.update("jax_enable_x64", True)


def test_in_32_bit_mode_numbers_and_lists_are_made_as_jax_makes_them():
    jax.config.update("jax_enable_x64", False)
    try:
        p = distop.Problem(lambda x, a, n: {"y": Cube(ordered=True)(x) * a + n},
                           {"x": [1.0, 2.0], "a": 2.0, "n": 3})
        out = p.run()["y"]
        assert out.dtype == np.float32 and out.tolist() == [5.0, 19.0]
        assert p.run(x=[0.5, 1.0])["y"].tolist() == [3.25, 5.0]
        with pytest.raises(TypeError, match=r"run\(n=...\): 1099511627776 does not fit in "
                                            r"int32"):
            p.run(n=2 ** 40)
    finally:
        jax.config.update("jax_enable_x64", True)


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_a_problem_called_in_the_other_precision_raises(backend):
    p = distop.Problem(lambda x: {"s": jnp.sum(Cube(ordered=True)(x))},
                       {"x": np.ones(3)}, backend=backend)
    assert p.run()["s"] == 3.0
    jax.config.update("jax_enable_x64", False)
    try:
        for call in (p.run, p.compute_totals, p.run_and_compute_totals, p.check_totals):
            with pytest.raises(distop.DistopError, match=r"made with jax_enable_x64=True and "
                                                         r"is called with False"):
                call()
    finally:
        jax.config.update("jax_enable_x64", True)
    assert p.run()["s"] == 3.0 and p.compute_totals()["s", "x"].tolist() == [[3.0] * 3]


def test_the_token_count_restarts_before_it_could_lose_exactness(monkeypatch):
    monkeypatch.setattr(distop._hostcalls.ffi, "TOKEN_RESTART", 5)
    p = distop.Problem(lambda x: {"s": jnp.sum(Cube(ordered=True)(x))}, {"x": np.ones(2)})
    seen = []
    for _ in range(12):
        assert p.run()["s"] == 2.0
        seen.append(p._executor.token_value)
    assert max(seen) == 4 and seen.count(0) == 2, seen


def test_masked_arrays_are_refused_not_unmasked():
    with pytest.raises(TypeError, match=r"got a masked array; pass an array of its values"):
        distop.Problem(lambda x: {"y": x * 2}, {"x": np.ma.array([1.0, 2.0], mask=[0, 1])})


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_a_model_that_differentiates_an_operator_itself_runs(backend):
    op = Cube()
    problem = distop.Problem(lambda x: {"g": jax.grad(lambda x: jnp.sum(op(x)))(x)},
                             {"x": np.array([1.0, 2.0])}, backend=backend)
    np.testing.assert_array_equal(problem.run()["g"], [3.0, 12.0])
    assert [e.phase for e in problem.schedule] == ["forward", "vjp"]  # run's schedule
    with pytest.raises(distop.SecondDerivativeError, match="Cube does not implement jvp"):
        problem.compute_totals()


def test_models_with_nothing_to_differentiate():
    ints_in = distop.Problem(lambda n: {"a": n * 2.0}, {"n": np.array([1, 2])})
    assert ints_in.run()["a"].tolist() == [2.0, 4.0] and ints_in.compute_totals() == {}
    assert ints_in.check_totals(out_stream=None) == {}
    ints_out = distop.Problem(lambda x: {"k": jnp.round(Cube()(x)).astype(int)},
                              {"x": np.arange(3.0)})
    assert ints_out.run()["k"].tolist() == [0, 1, 8] and ints_out.compute_totals() == {}
    assert [e.phase for e in ints_out.schedule] == ["forward"]
    assert ints_out.run_and_compute_totals()[1] == {}


def test_threads_calling_one_problem_take_turns_and_lose_no_result():
    op = Cube(ordered=True)
    problem = distop.Problem(lambda x: {"s": jnp.sum(op(x))}, {"x": np.ones(2)})
    other = distop.Problem(lambda x: {"s": 2.0 * jnp.sum(op(x))}, {"x": np.ones(2)})
    failures = []

    def work(p, k, c):
        for i in range(200):
            x = np.array([float(i), float(k)])
            try:
                s = p.run(x=x)["s"] if i % 3 else p.run_and_compute_totals(
                    inputs={"x": x})[0]["s"]
                if s != c * np.sum(x ** 3):
                    failures.append((k, i, s))
            except Exception as err:  # noqa: BLE001 - collected for the assertion
                failures.append((k, i, repr(err)))

    threads = [threading.Thread(target=work, args=args)
               for args in ((problem, 1, 1.0), (problem, 2, 1.0), (other, 3, 2.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_a_dtype_change_of_a_differentiable_input_is_refused_at_the_call():
    problem = distop.Problem(lambda x, n: {"s": jnp.sum(x * x) * n}, {"x": np.ones(3), "n": 2})
    with pytest.raises(TypeError, match=r"run\(x=...\): input 'x' is float64 .* int64.*"
                                        r"x.astype\(numpy.float64\)"):
        problem.run(x=np.arange(3))
    with pytest.raises(TypeError, match="is float64 at this Problem's point, and the array "
                                        "passed is float32"):
        problem.run_and_compute_totals(inputs={"x": np.ones(3, np.float32)})
    assert problem.run(x=[1, 2, 3])["s"] == 28.0  # numbers take the input's dtype
    assert problem.run(n=3)["s"] == 42.0  # an integer input may change as it likes
    np.testing.assert_array_equal(problem.compute_totals()["s", "x"], [[6.0, 12.0, 18.0]])


def test_shapes_that_come_back_find_their_programs_kept():
    # a user's outer loop over more shapes than a handful: every shape's programs are
    # kept by default, so the second round over them builds nothing
    problem = distop.Problem(lambda x: {"s": jnp.sum(x ** 3)}, {"x": np.ones(1)})
    made = []
    for _ in range(2):
        for n in range(1, 41):
            assert problem.run(x=np.ones(n))["s"] == n
            np.testing.assert_array_equal(problem.compute_totals()["s", "x"],
                                          np.full((1, n), 3.0))
        made.append({id(p) for p in problem._programs.programs.values()})
    assert len(made[0]) == 2 * 40 and made[1] == made[0]


def test_the_programs_of_the_least_recently_used_shapes_are_let_go(monkeypatch):
    monkeypatch.setenv("DISTOP_CACHE_SIZE", "2")
    op = Cube(ordered=True)
    problem = distop.Problem(lambda x: {"s": jnp.sum(op(x))}, {"x": np.ones(1)})
    before = len(distop._hostcalls.ffi._sites)
    for n in [2, 3, 4, 5, 6, 2, 7, 8]:
        assert problem.run(x=np.ones(n))["s"] == n
        np.testing.assert_array_equal(problem.compute_totals()["s", "x"], np.full((1, n), 3.0))
        assert len(problem._programs.layouts) <= 2
    gc.collect()
    assert len(distop._hostcalls.ffi._sites) - before <= 2 * 3  # (run, totals: their call sites)
    monkeypatch.setenv("DISTOP_CACHE_SIZE", "0")
    with pytest.raises(ValueError, match="DISTOP_CACHE_SIZE='0': expected a whole number"):
        distop.Problem(lambda x: {"s": jnp.sum(x)}, {"x": np.ones(1)})


def test_replicated_values_compare_as_values():
    from distop._totals.replicated import _difference
    from distop._totals.replicated import digest as _digest

    assert _digest(np.array([0.0, np.nan])) == _digest(np.array([-0.0, np.nan]))
    assert _difference(np.array([-0.0, np.nan]), np.array([0.0, np.nan])) is None
    assert "by up to 1.000e+00 (at index (1,)" in _difference(np.array([1.0, 3.0]),
                                                             np.array([1.0, 2.0]))
    assert "NaN on one side only" in _difference(np.array([np.nan]), np.array([1.0]))
    assert "has shape (2,), rank 0 (1,)" in _difference(np.ones(2), np.ones(1))


def test_a_problems_configuration_is_read_only():
    problem = distop.Problem(lambda x: {"f": jnp.sum(x ** 2)}, {"x": np.arange(3.0)},
                             fuse=False, copy=None)
    assert (problem.fuse, problem.copy) == (False, None)
    assert problem.backend in ("lean", "io_callback") and callable(problem.model)
    for name in ("model", "backend", "fuse", "copy"):
        with pytest.raises(AttributeError):
            setattr(problem, name, getattr(problem, name))


def test_the_default_backend_follows_jax_s_default_device(monkeypatch):
    monkeypatch.delenv("DISTOP_BACKEND", raising=False)
    model, inputs = (lambda x: {"y": Cube()(x)}), {"x": np.arange(3.0)}
    assert distop.Problem(model, inputs).backend == "lean"
    # where JAX's default device is an accelerator, the FFI calls of the lean path,
    # which are CPU calls, cannot be compiled: io_callback is the default there
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    problem = distop.Problem(model, inputs)
    assert problem.backend == "io_callback"
    np.testing.assert_allclose(problem.run()["y"], np.arange(3.0) ** 3)
    for chosen in ({"backend": "lean"}, {}):
        if not chosen:
            monkeypatch.setenv("DISTOP_BACKEND", "lean")
        with pytest.raises(ValueError, match=r"Problem\(backend='lean'\): the lean path "
                           r"calls operators from programs that run on the CPU, and "
                           r"JAX's default device here is 'tpu'\. Pass "
                           r"backend='io_callback'"):
            distop.Problem(model, inputs, **chosen)


def test_inputs_may_be_pytrees_with_totals_keyed_by_their_leaves():
    import equinox as eqx

    class Linear(eqx.Module):
        w: jax.Array
        b: jax.Array

    data = np.linspace(-1.0, 1.0, 12).reshape(4, 3)

    def model(params, model, scale):
        pred = data @ params["w"] + params["b"] + data @ model.w + model.b
        return {"loss": scale * jnp.sum(pred ** 2)}

    params = {"w": np.array([0.1, -0.2, 0.3]), "b": np.array(0.5)}
    linear = Linear(jnp.array([1.0, 2.0, 3.0]), jnp.array(-1.0))
    problem = distop.Problem(model, {"params": params, "model": linear, "scale": [1.0]})
    assert problem.input_names == ("params['b']", "params['w']", "model.w", "model.b",
                                   "scale")
    J = problem.compute_totals("loss", ["params", "model"])
    want = jax.grad(lambda p, m: model(p, m, 1.0)["loss"], argnums=(0, 1))(params, linear)
    np.testing.assert_allclose(J["loss", "params['w']"][0], want[0]["w"])
    np.testing.assert_allclose(J["loss", "params['b']"][0], [want[0]["b"]])
    np.testing.assert_allclose(J["loss", "model.w"][0], want[1].w)
    # a leaf by its own name, and a tree of the same structure in run
    assert set(problem.compute_totals("loss", "params['w']")) == {("loss", "params['w']")}
    moved = {"w": np.zeros(3), "b": np.array(0.0)}
    assert problem.run(params=moved)["loss"] == model(moved, linear, 1.0)["loss"]
    with pytest.raises(ValueError, match=r"input 'params' is a tree of another structure "
                                         r"than at the Problem's point"):
        problem.run(params={"w": np.zeros(3)})
    problem.check_totals(raise_on_error=True, out_stream=None)
