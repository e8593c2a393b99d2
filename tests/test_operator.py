"""DistributedOperator in a single process: transformations, batching, checks of user code."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Cube, NormScale, ScaledSum, norm_scale
from jax import lax

import distop


class Sin(distop.DistributedOperator):
    scale: float
    forward_collectives = ("Allreduce",)
    calls: list = None

    def forward(self, comm, x):
        self.calls.append(("forward", x.shape))
        return self.scale * np.sin(x)

    def vjp(self, comm, y_bar, x):
        self.calls.append(("vjp", y_bar.shape, x.shape))
        return self.scale * np.cos(x) * y_bar


class BatchedSin(Sin):
    batched_forward = True
    batched_vjp = True


class OrderedSin(Sin):
    ordered = True


class ExpandedSin(BatchedSin):
    unbatched = "expand_dims"


def sin(cls=OrderedSin, **kw):
    return cls(2.0, calls=[], **kw)


X = np.arange(3.0) + 0.5


def test_fields_without_defaults_and_ordered_settings():
    assert not sin(Sin).is_ordered()  # one rank: nothing to order
    assert sin(OrderedSin).is_ordered()  # the class body's setting
    assert not sin(OrderedSin, ordered=False).is_ordered()  # per instance
    assert sin(Sin, ordered=True).is_ordered()


@pytest.mark.parametrize("cls", [Sin, OrderedSin, BatchedSin, ExpandedSin])
def test_jit_grad_jacrev_vmap(cls):
    op = sin(cls)
    np.testing.assert_allclose(jax.jit(op)(X), 2 * np.sin(X), rtol=1e-15)
    np.testing.assert_allclose(jax.grad(lambda x: op(x).sum())(X), 2 * np.cos(X), rtol=1e-15)
    op.calls.clear()
    np.testing.assert_allclose(jax.jacrev(op)(X), np.diag(2 * np.cos(X)), atol=1e-15)
    vjps = [c for c in op.calls if c[0] == "vjp"]
    if cls is BatchedSin:  # one call for the whole (3, 3) cotangent block
        assert vjps == [("vjp", (3, 3), (3, 3))]
    elif cls is ExpandedSin:  # x as it is, with a batch axis of length 1
        assert vjps == [("vjp", (3, 3), (1, 3))]
    else:  # one callback, one user call per row, x not copied per row
        assert vjps == [("vjp", (3,), (3,))] * 3
    xs = np.stack([X, X + 1])
    np.testing.assert_allclose(jax.vmap(op)(xs), 2 * np.sin(xs), rtol=1e-15)
    np.testing.assert_allclose(jax.vmap(jax.vmap(op))(xs[:, None]),
                               2 * np.sin(xs[:, None]), rtol=1e-15)


def test_scan_and_fori_loop_are_ordered_and_differentiable():
    op = sin()

    def f(x):
        y, _ = lax.scan(lambda c, _: (op(c), None), x, None, length=3)
        return jnp.sum(lax.fori_loop(0, 2, lambda i, c: op(c), y))

    def ref(x):
        for _ in range(5):
            x = 2 * jnp.sin(x)
        return jnp.sum(x)

    np.testing.assert_allclose(jax.jit(f)(X), ref(X), rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(X), jax.grad(ref)(X), rtol=1e-13)
    jaxpr = jax.make_jaxpr(f)(X)
    assert "OrderedSin.forward[ordered]" in str(jaxpr) and jaxpr.effects


def test_unused_output_and_0d_input():
    op = ScaledSum()
    a, b, t = jnp.ones(3), jnp.ones(2), jnp.array(3.0)
    g = jax.grad(lambda t: jnp.sum(op(a, b, t)[1]))(t)
    assert g.shape == () and float(g) == 2.0
    ga = jax.grad(lambda a: jnp.sum(op(a, b, t)[0]))(a)
    np.testing.assert_array_equal(ga, np.ones(3))


def test_local_operator_uses_unordered_callbacks():
    jaxpr = jax.make_jaxpr(Cube())(X)
    assert "Cube.forward[unordered]" in str(jaxpr) and not jaxpr.effects
    np.testing.assert_allclose(jax.grad(lambda x: Cube()(x).sum())(X), 3 * X ** 2)


def test_integer_inputs_get_no_cotangent():
    class Shift(distop.DistributedOperator):
        def forward(self, comm, x, n):
            return x + n

        def vjp(self, comm, y_bar, x, n):
            return y_bar, None

    g = jax.grad(lambda x: Shift()(x, 2).sum())(X)
    np.testing.assert_array_equal(g, np.ones(3))


class Bad(distop.DistributedOperator):
    result: object = None

    def forward(self, comm, x):
        return self.result

    def vjp(self, comm, y_bar, x):
        return self.result


@pytest.mark.parametrize("result, expected", [
    (np.ones(2),
     r"Bad.forward on rank 0: returned output 0 with shape \(2,\) .*expected shape \(3,\)"
     r".*come from Bad.output_spec.*define output_spec\(self, \*input_specs\).*"
     r"\(Bad.forward is at .*test_operator.py:\d+\)"),
    (np.ones(3, np.float32), r"dtype float32; expected shape \(3,\) and dtype float64"),
    (None, r"returned None for output 0; return an array"),
    ((np.ones(3), np.ones(3)), r"returned a tuple of length 2; expected 1 output"),
])
def test_bad_forward_results_name_operator_phase_and_expectation(result, expected):
    with pytest.raises(Exception, match=expected):
        jax.jit(Bad(result))(X).block_until_ready()


def test_bad_vjp_result_and_missing_methods():
    class BadVjp(Bad):
        def vjp(self, comm, y_bar, x):
            return y_bar[:2]

    with pytest.raises(Exception, match=r"BadVjp.vjp on rank 0: returned input cotangent 0 "
                                        r"with shape \(2,\).*A vjp returns one array per "
                                        r"input, shaped as that input"):
        jax.grad(lambda x: BadVjp(np.ones(3))(x).sum())(X).block_until_ready()

    class NoneVjp(Bad):
        def vjp(self, comm, y_bar, x):
            return None

    with pytest.raises(Exception, match=r"returned None for input cotangent 0; return zeros "
                                        r"for a zero input cotangent"):
        jax.grad(lambda x: NoneVjp(np.ones(3))(x).sum())(X).block_until_ready()

    class NoVjp(distop.DistributedOperator):
        def forward(self, comm, x):
            return x

    class NoForward(distop.DistributedOperator):
        pass

    np.testing.assert_array_equal(NoVjp()(X), X)
    with pytest.raises(distop.OperatorError, match="NoVjp does not implement vjp"):
        jax.grad(lambda x: NoVjp()(x).sum())(X)
    with pytest.raises(distop.OperatorError, match="NoForward does not implement forward"):
        NoForward()(X)
    with pytest.raises(TypeError, match=r"Cube\(...\): input 0 is a str"):
        Cube()("x")


def test_user_exception_names_operator_and_phase():
    class Boom(distop.DistributedOperator):
        def forward(self, comm, x):
            raise KeyError("missing block")

    with pytest.raises(Exception, match=r"Boom.forward on rank 0: raised KeyError"):
        jax.jit(Boom())(X).block_until_ready()


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_methods_get_read_only_arguments(backend):
    class InPlace(distop.DistributedOperator):
        def forward(self, comm, x):
            x *= 2.0  # would change a program input or constant in place
            return x

    x0 = np.ones(3)
    problem = distop.Problem(lambda x: {"y": InPlace()(x)}, {"x": x0}, backend=backend)
    with pytest.raises(distop.OperatorError,
                       match=r"InPlace.forward on rank 0: raised ValueError: .*read-only"):
        problem.run()
    # neither the caller's array nor distop's copy of it changed
    np.testing.assert_array_equal(x0, 1.0)
    np.testing.assert_array_equal(problem._point["x"], 1.0)

    class Unlock(distop.DistributedOperator):
        def forward(self, comm, x):
            if backend == "lean":  # its view is made on the argument's bytes, no more
                assert bytes(np.asarray(x.base).view(np.uint8)) == x.tobytes(), x.base
            x.flags.writeable = True  # numpy refuses where the memory is read-only
            x *= 2.0
            return x

    problem = distop.Problem(lambda x: {"y": Unlock()(x)}, {"x": x0}, backend=backend)
    with pytest.raises(distop.OperatorError, match=r"Unlock.forward on rank 0: raised "
                                                   r"ValueError: cannot set WRITEABLE"):
        problem.run()
    np.testing.assert_array_equal(problem._point["x"], 1.0)


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_a_method_that_reshapes_its_views_in_place_gets_them_whole_each_step(backend):
    def flatten(*views):
        with warnings.catch_warnings():  # (NumPy 2.5 deprecates setting a shape)
            warnings.simplefilter("ignore", DeprecationWarning)
            for v in views:
                v.shape = (6,)  # the view itself, not the array XLA holds

    class Flatten(distop.DistributedOperator):
        linear = True

        def forward(self, comm, x):
            assert x.shape == (2, 3), x.shape  # (each step, as declared)
            flatten(x)
            return (2.0 * x).reshape(2, 3)

        def vjp(self, comm, y_bar, x):
            assert y_bar.shape == (2, 3) and x.shape == (2, 3), (y_bar.shape, x.shape)
            flatten(y_bar, x)
            return (2.0 * y_bar).reshape(2, 3)

    op = Flatten()

    def model(x):
        return {"y": jnp.sum(jax.lax.scan(lambda u, _: (op(u) + 1.0, None), x, None,
                                          length=4)[0])}

    problem = distop.Problem(model, {"x": np.ones((2, 3))}, backend=backend)
    for _ in range(2):
        np.testing.assert_allclose(problem.run()["y"], 6 * (16 + 8 + 4 + 2 + 1))
        np.testing.assert_allclose(problem.compute_totals("y", "x")[("y", "x")],
                                   np.full((1, 6), 16.0))


class SinWithJvp(Sin):
    batched_jvp = True

    def jvp(self, comm, x_dot, x, *, batched=False):
        self.calls.append(("jvp", x_dot.shape, batched))
        return self.scale * np.cos(x) * x_dot


def test_forward_mode_with_a_jvp():
    op = SinWithJvp(2.0, calls=[])
    y, y_dot = jax.jit(lambda x, t: jax.jvp(op, (x,), (t,)))(X, np.ones(3))
    np.testing.assert_allclose(y_dot, 2 * np.cos(X), rtol=1e-15)
    op.calls.clear()
    np.testing.assert_allclose(jax.jacfwd(op)(X), np.diag(2 * np.cos(X)), atol=1e-15)
    assert [c for c in op.calls if c[0] == "jvp"] == [("jvp", (3, 3), True)]  # one call
    np.testing.assert_allclose(jax.jacrev(op)(X), np.diag(2 * np.cos(X)), atol=1e-15)
    np.testing.assert_allclose(jax.hessian(lambda x: 0.5 * jnp.sum(x ** 2))(X), np.eye(3))


def test_forward_mode_without_a_jvp_names_the_operator():
    with pytest.raises(distop.MissingMethodError,
                       match=r"OrderedSin does not implement jvp\(self, comm, tangent"):
        jax.jacfwd(sin())(X)


class Mul(distop.DistributedOperator):
    ordered = True

    def forward(self, comm, x, y):
        return x * y

    def vjp(self, comm, g, x, y):
        return g * y, g * x

    def jvp(self, comm, tangents, x, y):
        return tangents[0] * y + x * tangents[1]


def test_derivatives_of_a_vmap_with_unbatched_arguments():
    a, b = np.arange(6.0).reshape(3, 2) + 1, np.array([0.5, -2.0])

    def f(a, b):
        return jnp.sum(jax.vmap(Mul(), in_axes=(0, None))(a, b) ** 2)

    def ref(a, b):
        return jnp.sum((a * b) ** 2)

    for got, want in zip(jax.grad(f, argnums=(0, 1))(a, b), jax.grad(ref, argnums=(0, 1))(a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-14)  # b's cotangent: summed over rows
    np.testing.assert_allclose(jax.jacfwd(f, argnums=1)(a, b), jax.jacfwd(ref, argnums=1)(a, b),
                               rtol=1e-14)
    np.testing.assert_allclose(jax.vmap(jax.grad(f, argnums=1), in_axes=(None, 0))(a, a[:, ::-1]),
                               jax.vmap(jax.grad(ref, argnums=1), in_axes=(None, 0))(a, a[:, ::-1]),
                               rtol=1e-14)


def test_unbatched_must_be_broadcast_or_expand_dims():
    class Odd(BatchedSin):
        unbatched = "repeat"

    with pytest.raises(distop.OperatorError, match=r"Odd.unbatched = 'repeat': expected "
                                                   r"'broadcast' or 'expand_dims'"):
        jax.jacrev(Odd(2.0, calls=[]))(X)


def test_expand_dims_leaves_an_unbatched_cotangent_or_tangent_broadcast():
    # vmap over x with one fixed cotangent (or tangent): that argument carries no batch
    # axis, yet the method's results must have one; only inputs are expanded
    op = ExpandedSin(2.0, calls=[])
    xs = np.stack([X, X + 1.0, 2.0 * X])
    got = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(op(x) * X))))(xs)
    np.testing.assert_allclose(got, 2.0 * np.cos(xs) * X, rtol=1e-14)
    assert ("vjp", (3, 3), (3, 3)) in op.calls


class ExpandedSinWithJvp(ExpandedSin):
    batched_jvp = True

    def jvp(self, comm, x_dot, x):
        return self.scale * np.cos(x) * x_dot


def test_expand_dims_jvp_with_a_fixed_tangent():
    op = ExpandedSinWithJvp(2.0, calls=[])
    xs = np.stack([X, X + 1.0])
    got = jax.jit(jax.vmap(lambda x: jax.jvp(op, (x,), (np.ones(3),))[1]))(xs)
    np.testing.assert_allclose(got, 2.0 * np.cos(xs), rtol=1e-14)


@pytest.mark.parametrize("lean", [False, True])
def test_linearization_rule_gives_the_program_jax_derives_from_the_jvp_rule(lean, monkeypatch):
    """Reverse mode traces each forward call through the primitive's own linearization
    rule (fast to trace); the program, and so every gradient, is the one JAX derives
    from its JVP rule: for several inputs and outputs, an integer input, a 0-d input, a
    batch of seeds; on both paths."""
    from distop._compat import primitive_linearizations
    from distop._hostcalls import sessions as _sessions
    from distop._operators.primitive import host_call_p

    op, mul = ScaledSum(), Mul()

    class Shift(distop.DistributedOperator):
        def forward(self, comm, x, n):
            return x + n

        def vjp(self, comm, y_bar, x, n):
            return y_bar, None

    def f(a, b, t):
        u, v = op(a, b, t)
        return jnp.concatenate([Shift()(mul(u, a), 2), jnp.sin(v) * t])

    def program():
        def traced(a, b, t):
            token = jnp.zeros(())
            if not lean:
                return jax.jacrev(f, argnums=(0, 1, 2))(a, b, t)
            with _sessions.tracing(token) as session:
                out = jax.jacrev(f, argnums=(0, 1, 2))(a, b, t)
            return out, session.token
        return jax.make_jaxpr(traced)(jnp.arange(1.0, 4.0), jnp.arange(2.0), jnp.array(0.5))

    if not lean:
        a, b, t = np.arange(1.0, 4.0), np.arange(2.0), 0.5
        want = jax.jacrev(lambda a, b, t: jnp.concatenate([a * a + 2,
                                                          jnp.sin(b * t) * t]),
                          argnums=(0, 1, 2))(a, b, t)
        for got, w in zip(jax.jit(jax.jacrev(f, argnums=(0, 1, 2)))(a, b, t), want):
            np.testing.assert_allclose(got, w, rtol=1e-14)
    if jax.__version__ == "0.10.2":  # (later releases may call such rules otherwise)
        assert host_call_p in primitive_linearizations
    if primitive_linearizations is not None:
        with_rule = program()
        monkeypatch.delitem(primitive_linearizations, host_call_p)
        assert str(program()) == str(with_rule)


class _SelfExchange(distop.DistributedOperator):
    """y = x, sent to itself with comm.Sendrecv: communication its class may not declare."""

    def forward(self, comm, x):
        out = np.empty_like(x)
        comm.Sendrecv(x, dest=comm.Get_rank(), recvbuf=out, source=comm.Get_rank())
        return out

    def vjp(self, comm, y_bar, x):
        return y_bar


def test_a_method_is_refused_communication_its_class_did_not_declare():
    problem = distop.Problem(lambda x: {"y": _SelfExchange()(x)}, {"x": np.ones(2)})
    with pytest.raises(distop.OperatorError, match=(
            r"_SelfExchange.forward.*issued \['Sendrecv'\], not declared in "
            r"forward_collectives=\(\).*Add 'Sendrecv' to _SelfExchange.forward_collectives")):
        problem.run()

    class Declared(_SelfExchange):
        forward_collectives = ("Sendrecv",)

    problem = distop.Problem(lambda x: {"y": Declared()(x)}, {"x": np.arange(2.0)})
    np.testing.assert_array_equal(problem.run()["y"], [0.0, 1.0])
    np.testing.assert_array_equal(problem.compute_totals()["y", "x"], np.eye(2))


def test_declared_names_are_checked_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"Typo.vjp_collectives names 'Allreduse', which is "
                                        r"not .* Did you mean 'Allreduce'\?"):
        class Typo(distop.DistributedOperator):
            vjp_collectives = ("Allreduse",)
    with pytest.raises(TypeError, match=r"Text.forward_collectives = 'Allreduce': expected "
                                        "a tuple of names"):
        class Text(distop.DistributedOperator):
            forward_collectives = "Allreduce"

    class Both(distop.DistributedOperator):  # either spelling of mpi4py's methods
        forward_collectives = ("allreduce", "Sendrecv", "Isend", "Irecv")

    assert Both.forward_collectives[0] == "allreduce"


def test_messages_say_what_to_return_and_why_inputs_are_read_only():
    class Listed(distop.DistributedOperator):
        def forward(self, comm, x):
            return list(x)

    class InPlace(distop.DistributedOperator):
        def forward(self, comm, x):
            x *= 2.0
            return x

    with pytest.raises(distop.OperatorError, match=r"Listed.forward on rank 0: returned a "
                                                   r"list; return its one output as a numpy"):
        distop.Problem(lambda x: {"y": Listed()(x)}, {"x": np.ones(8)}).run()
    with pytest.raises(distop.OperatorError, match=r"InPlace.forward on rank 0: raised "
                                                   r"ValueError: .*read-only.*read-only by "
                                                   r"design.*x = x.copy\(\)"):
        distop.Problem(lambda x: {"y": InPlace()(x)}, {"x": np.ones(8)}).run()


class ForwardCube(Cube):
    def jvp(self, comm, tangent, x):
        return 3 * x ** 2 * tangent


class OrderedCube(Cube):
    ordered = True  # (as an operator that communicates on P > 1, outside a Problem)


@pytest.mark.parametrize("make", [Cube, OrderedCube, ForwardCube, distop.AllreduceSum],
                         ids=["user", "ordered user", "user with jvp", "built-in"])
def test_a_discarded_derivative_of_a_derivative_raises_nothing(make):
    op = make()
    f = lambda x: jnp.sum(op(x) ** 2)  # noqa: E731
    ref = lambda x: jnp.sum((x ** 3 if make is not distop.AllreduceSum else x) ** 2)  # noqa: E731
    outer = lambda f: lambda x: jax.value_and_grad(f)(x)[0]  # noqa: E731  (grad unused)
    want = jax.grad(ref)(X)
    np.testing.assert_allclose(jax.grad(outer(f))(X), want, rtol=1e-13)
    np.testing.assert_allclose(jax.jit(jax.grad(outer(f)))(X), want, rtol=1e-13)
    np.testing.assert_allclose(jax.vmap(jax.grad(outer(f)))(np.stack([X, 2 * X]))[0], want,
                               rtol=1e-13)
    for backend in ("lean", "io_callback"):
        problem = distop.Problem(lambda x: {"f": outer(f)(x)}, {"x": X}, backend=backend)
        np.testing.assert_allclose(problem.compute_totals()["f", "x"][0], want, rtol=1e-13)


def test_a_second_derivative_through_an_operator_without_hvp_raises_naming_it():
    op = ForwardCube()
    f = lambda x: jnp.sum(op(x) ** 2)  # noqa: E731
    evaluated = {
        "hessian": jax.hessian(f), "jit hessian": jax.jit(jax.hessian(f)),
        "grad of grad": jax.grad(lambda x: jax.grad(f)(x)[0]),
        "jit grad of grad": jax.jit(jax.grad(lambda x: jax.grad(f)(x)[0])),
        "jacfwd of grad": jax.jacfwd(jax.grad(f)),
        "grad of jvp": jax.grad(lambda x: jax.jvp(f, (x,), (x,))[1]),
        "jit grad of jvp": jax.jit(jax.grad(lambda x: jax.jvp(f, (x,), (X,))[1])),
        "times zero": jax.grad(lambda x: 0.0 * jax.grad(f)(x)[0] + f(x)),
    }
    for name, fn in evaluated.items():
        with pytest.raises(distop.SecondDerivativeError,
                           match=r"ForwardCube.vjp on rank 0: ForwardCube does not implement "
                                 r"hvp\(self, comm, y_bar, tangent, \*inputs\).*linear = "
                                 "True") if "jvp" not in name else pytest.raises(
                distop.SecondDerivativeError, match=r"ForwardCube.jvp on rank 0: "
                                                    r"ForwardCube does not implement hvp"):
            fn(X)
            pytest.fail(f"{name}: no error")
    for fn in (jax.hessian, lambda f: jax.grad(lambda x: jax.grad(f)(x)[0])):
        with pytest.raises((distop.MissingMethodError, distop.SecondDerivativeError),
                           match=r"Cube does not implement jvp"):
            fn(lambda x: jnp.sum(Cube()(x) ** 2))(X)  # (every second derivative: jvp)


class HvpSin(distop.DistributedOperator):
    """y = a sin(x) for two inputs x and a, with every method; records its hvp calls."""

    forward_collectives = vjp_collectives = jvp_collectives = hvp_collectives = (
        "Allreduce",)
    seen: list = None

    def output_spec(self, x, a):
        return x

    def forward(self, comm, x, a):
        return a * np.sin(x)

    def vjp(self, comm, y_bar, x, a):
        return a * np.cos(x) * y_bar, np.sin(x) * y_bar

    def jvp(self, comm, tangent, x, a):
        t_x, t_a = tangent
        return a * np.cos(x) * t_x + np.sin(x) * t_a

    def hvp(self, comm, y_bar, tangent, x, a):
        self.seen.append((y_bar.shape, tangent[0].shape))
        t_x, t_a = tangent
        return (-a * np.sin(x) * y_bar * t_x + np.cos(x) * y_bar * t_a,
                np.cos(x) * y_bar * t_x)


class BatchedHvpSin(HvpSin):
    batched_vjp = batched_jvp = batched_hvp = True


class OrderedHvpSin(HvpSin):
    ordered = True


def _second_derivatives(f, z, v):
    """**Returns:** {composition: its Hessian-vector product of f at z along v}."""
    vs = np.stack([v, 2.0 * v])
    grad_dot = lambda z, w: jax.grad(f)(z) @ w  # noqa: E731

    def scanned(z):  # (two hvps inside lax.scan, summed)
        def step(c, w):
            return c + jax.jvp(jax.grad(f), (z,), (w,))[1], None
        return lax.scan(step, jnp.zeros_like(z), vs)[0] / 3.0

    return {
        "hessian": jax.hessian(f)(z) @ v,
        "jit hessian": jax.jit(jax.hessian(f))(z) @ v,
        "jacfwd of jacrev": jax.jacfwd(jax.jacrev(f))(z) @ v,
        "jvp of grad": jax.jvp(jax.grad(f), (z,), (v,))[1],
        "jit jvp of grad": jax.jit(lambda z, v: jax.jvp(jax.grad(f), (z,), (v,))[1])(z, v),
        "grad of grad": jax.grad(grad_dot)(z, v),
        "jit grad of grad": jax.jit(jax.grad(grad_dot))(z, v),
        "grad of jvp": jax.grad(lambda z: jax.jvp(f, (z,), (v,))[1])(z),
        "jit grad of jvp": jax.jit(jax.grad(lambda z, v: jax.jvp(f, (z,), (v,))[1]))(z, v),
        "vmap jvp of grad": jax.vmap(lambda w: jax.jvp(jax.grad(f), (z,), (w,))[1])(vs)[1] / 2,
        "vmap grad of grad": jax.vmap(lambda w: jax.grad(grad_dot)(z, w))(vs)[1] / 2,
        "vmap grad of jvp": jax.vmap(
            lambda w: jax.grad(lambda z: jax.jvp(f, (z,), (w,))[1])(z))(vs)[1] / 2,
        "jit scan of jvp of grad": jax.jit(scanned)(z),
    }


@pytest.mark.parametrize("cls", [HvpSin, BatchedHvpSin, OrderedHvpSin])
def test_second_derivatives_match_a_dense_hessian(cls):
    op = cls(seen=[])

    def model(op):
        return lambda z: jnp.sum(op(z[:3], z[3:]) ** 2) + jnp.sum(op(z[:3], z[3:]) * z[:3])

    z = np.array([0.3, 1.2, -0.7, 1.5, 0.4, 2.0])
    v = np.array([0.1, -0.3, 0.7, 0.2, 0.5, -1.0])
    want = jax.hessian(model(lambda x, a: a * jnp.sin(x)))(z) @ v
    for name, got in _second_derivatives(model(op), z, v).items():
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-14, err_msg=name)
    op.seen.clear()
    jax.hessian(model(op))(z)  # (6 directions: one hvp call per operator call)
    if cls is BatchedHvpSin:
        assert op.seen == [((6, 3), (6, 3))] * 2
    else:
        assert op.seen == [((3,), (3,))] * 12


def test_a_distributed_operators_second_derivatives_in_one_process():
    op = NormScale(seen=[])
    f = lambda x: jnp.sum(jnp.sin(op(x)))  # noqa: E731
    ref = lambda x: jnp.sum(jnp.sin(norm_scale(x)))  # noqa: E731
    want = jax.hessian(ref)(X) @ (X[::-1] - 1.0)
    for name, got in _second_derivatives(f, X, X[::-1] - 1.0).items():
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=name)


def test_a_linear_operator_needs_no_hvp():
    class Doubled(distop.DistributedOperator):  # (no hvp: its second derivative is zero)
        linear = True

        def forward(self, comm, x):
            return 2.0 * x

        def vjp(self, comm, y_bar, x):
            return 2.0 * y_bar

        def jvp(self, comm, t, x):
            return 2.0 * t

    for op, scale in ((Doubled(), 2.0), (distop.AllreduceSum(), 1.0)):
        f = lambda x: jnp.sum(jnp.sin(op(x)) * x)  # noqa: E731, B023
        ref = lambda x: jnp.sum(jnp.sin(scale * x) * x)  # noqa: E731, B023
        want = jax.hessian(ref)(X) @ X
        for name, got in _second_derivatives(f, X, X).items():
            np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=name)


def test_forward_over_forward_raises_pointing_to_hessian():
    op = HvpSin(seen=[])
    f = lambda z: jnp.sum(op(z[:3], z[3:]) ** 2)  # noqa: E731
    z = np.arange(6.0) + 0.5
    for fn in (jax.jacfwd(jax.jacfwd(f)), jax.jit(jax.jacfwd(jax.jacfwd(f))),
               lambda z: jax.jvp(lambda z: jax.jvp(f, (z,), (z,))[1], (z,), (z,))[1]):
        with pytest.raises(distop.SecondDerivativeError,
                           match=r"HvpSin.jvp on rank 0: forward mode over forward mode.*"
                                 r"Use jax.hessian"):
            fn(z)
    # (traced and discarded: no error)
    g = jax.grad(lambda z: jax.value_and_grad(f)(z)[0])(z)
    np.testing.assert_allclose(g, jax.grad(f)(z), rtol=1e-14)


@pytest.mark.parametrize("backend", ["lean", "io_callback"])
def test_a_model_with_a_second_derivative_inside_a_problem(backend):
    op = NormScale()
    f = lambda x: jnp.sum(jnp.sin(op(x)))  # noqa: E731
    ref = lambda x: jnp.sum(jnp.sin(norm_scale(x)))  # noqa: E731
    model = lambda x, v: {"hv": jax.jvp(jax.grad(f), (x,), (v,))[1],  # noqa: E731
                          "g": jax.grad(lambda x: jax.grad(f)(x) @ v)(x)}
    problem = distop.Problem(model, {"x": X, "v": X - 1.0}, backend=backend)
    got = problem.run()
    want = jax.hessian(ref)(X) @ (X - 1.0)
    np.testing.assert_allclose(got["hv"], want, rtol=1e-12)
    np.testing.assert_allclose(got["g"], want, rtol=1e-12)
    assert "hvp" in [e.phase for e in problem.schedule]


def test_jax_refusing_ordered_calls_raises_distops_error_naming_the_operator_and_the_fix():
    op = sin()  # (ordered = True: an io_callback with JAX's ordered effect, as on P > 1)
    f = lambda x: jnp.sum(jax.checkpoint(op)(x))  # noqa: E731
    with pytest.raises(distop.OrderedEffectError, match=r"OrderedSin.forward on rank 0 is "
                       r"called inside jax.checkpoint.*To fix: call the model inside a "
                       r"distop.Problem.*or call the operator outside jax.checkpoint"):
        jax.grad(f)(X)
    with pytest.raises(NotImplementedError, match="jax.checkpoint"):  # (JAX's own kind)
        jax.jit(jax.grad(f))(X)
    np.testing.assert_allclose(jax.checkpoint(op)(X), 2.0 * np.sin(X))  # (no derivative)
    problem = distop.Problem(lambda x: {"f": f(x)}, {"x": X})  # the fix
    np.testing.assert_allclose(problem.compute_totals()["f", "x"][0], 2.0 * np.cos(X))

    def branch(x):
        return jnp.sum(lax.cond(x[0] > 0, op, lambda v: v, x))

    with pytest.raises(distop.OrderedEffectError, match=r"OrderedSin.\w+ on rank 0 is "
                       r"called inside lax.cond.*jnp.where"):
        jax.vmap(jax.grad(branch))(np.stack([X, -X]))
    with pytest.raises(distop.OrderedEffectError, match="inside lax.while_loop"):
        jax.vmap(lambda x: lax.while_loop(lambda c: c[0] < 2.0, lambda c: op(c) + 1.0, x))(
            np.stack([X, X]))
    unordered = sin(ordered=False)  # (nothing refused: JAX's own errors stay its own)
    got = jax.vmap(lambda x: lax.cond(x[0] > 0, unordered, lambda v: v, x))(np.stack([X, -X]))
    np.testing.assert_allclose(got, np.stack([2.0 * np.sin(X), -X]))
    problem = distop.Problem(lambda x: {"f": jax.vmap(jax.grad(branch))(x)},
                             {"x": np.stack([X, -X])})
    np.testing.assert_allclose(problem.run()["f"][0], 2.0 * np.cos(X))


def test_second_derivatives_with_an_integer_input():
    class Power(distop.DistributedOperator):  # y = n x ** 2, n an integer
        def forward(self, comm, x, n):
            return n * x ** 2

        def vjp(self, comm, y_bar, x, n):
            return 2 * n * x * y_bar, None

        def jvp(self, comm, tangent, x, n):
            assert tangent[1] is None  # (an integer input has no tangent)
            return 2 * n * x * tangent[0]

        def hvp(self, comm, y_bar, tangent, x, n):
            assert tangent[1] is None
            return 2 * n * y_bar * tangent[0], None

    f = lambda x: jnp.sum(jnp.sin(Power()(x, 3)))  # noqa: E731
    want = jax.hessian(lambda x: jnp.sum(jnp.sin(3 * x ** 2)))(X) @ X[::-1]
    for name, got in _second_derivatives(f, X, X[::-1].copy()).items():
        np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=name)
    problem = distop.Problem(lambda x, n: {"f": jnp.sum(jnp.sin(Power()(x, n)))},
                             {"x": X, "n": np.array(3)})
    np.testing.assert_allclose(problem.compute_hvp("f", "x", {"x": X[::-1]})["x"], want,
                               rtol=1e-13)
