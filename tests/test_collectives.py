"""The built-in collectives in a single process: the dense-reference cases that
tests/mpi/test_builtin_collectives.py runs on 2 and 4 ranks, and the errors of their arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mpi_tests

import distop


@pytest.mark.parametrize("case", mpi_tests("test_builtin_collectives"))
def test_case(case):
    case()


def test_forward_mode_through_every_linear_collective():
    x = np.arange(6.0).reshape(3, 2)
    for op in (distop.AllreduceSum(), distop.Allgather(), distop.Split(), distop.Alltoall(),
               distop.Broadcast(), distop.RankLocal(), distop.Allreduce(op="prod"),
               distop.Scan(), distop.Exscan(), distop.Reduce(), distop.Gather(),
               distop.Scatter(), distop.HaloExchange(width=2, boundary="periodic")):
        y, y_dot = jax.jvp(op, (x,), (2 * x,))
        np.testing.assert_array_equal(y_dot, 2 * y if not isinstance(op, distop.Allreduce)
                                      else 2 * x)
        assert type(op).batched_jvp and type(op).jvp is not distop.DistributedOperator.jvp


def test_a_0d_value_per_rank_is_one_row():
    y = distop.Allgather()(jnp.float64(3.0))
    assert y.shape == (1,) and y[0] == 3.0
    assert jax.grad(lambda s: distop.Allgather()(s)[0] * 2)(3.0) == 2.0
    assert jax.jacfwd(distop.Gather())(3.0).tolist() == [1.0]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match=r"Allreduce\(op='mean'\): expected one of"):
        distop.Allreduce(op="mean")
    with pytest.raises(TypeError, match="complex numbers have no order"):
        distop.Allreduce(op="max")(jnp.ones(2, complex))
    with pytest.raises(ValueError, match=r"HaloExchange\(width=-1\)"):
        distop.HaloExchange(width=-1)
    with pytest.raises(ValueError, match=r"HaloExchange\(boundary='wrap'\)"):
        distop.HaloExchange(boundary="wrap")
    with pytest.raises(ValueError, match="got a 0-d value"):
        distop.HaloExchange()(1.0)
    with pytest.raises(ValueError, match="got a 0-d value"):
        distop.Scatter()(1.0)
    for rooted in (distop.Reduce, distop.Gather, distop.Scatter):
        with pytest.raises(ValueError, match=r"\(root=1\): expected a rank .* 0 to 0"):
            rooted(root=1)(np.ones(2))


def test_halo_of_one_rank_wraps_or_pads():
    x = np.arange(3.0)
    np.testing.assert_array_equal(distop.HaloExchange(width=2)(x), [0, 0, 0, 1, 2, 0, 0])
    np.testing.assert_array_equal(distop.HaloExchange(width=4, boundary="periodic")(x),
                                  [2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    # the VJP adds every halo row's cotangent to the row it came from
    grad = jax.grad(lambda x: jnp.sum(distop.HaloExchange(width=4, boundary="periodic")(x)))
    np.testing.assert_array_equal(grad(x), [4.0, 3.0, 4.0])
    empty = distop.HaloExchange(width=1, boundary="periodic")(np.zeros((0, 2)))
    np.testing.assert_array_equal(empty, np.zeros((2, 2)))


def test_a_halo_exchange_sends_only_the_edge_rows_through_the_host():
    halo = distop.HaloExchange(width=2)

    def step(u):
        h = halo(u)
        return u + 0.1 * (h[:-4] + h[4:] - 2 * u)

    def model(u):
        return {"f": jnp.sum(jax.lax.scan(lambda u, _: (step(u), None), u, None,
                                          length=5)[0] ** 2)}

    def plain(u):
        for _ in range(5):
            h = jnp.pad(u, ((2, 2), (0, 0)))
            u = u + 0.1 * (h[:-4] + h[4:] - 2 * u)
        return jnp.sum(u ** 2)

    u0 = np.random.default_rng(3).standard_normal((7, 3))
    problem = distop.Problem(model, {"u": u0})
    np.testing.assert_allclose(problem.run()["f"], plain(u0), rtol=1e-14)
    np.testing.assert_allclose(problem.compute_totals("f", "u")["f", "u"].reshape(7, 3),
                               jax.grad(plain)(u0), rtol=1e-13)
    # each host call moves the 2 + 2 edge rows and the 4 halo rows, not the block
    shapes = {(e.phase, e.input_shapes[-1], e.output_shapes[0]) for e in problem.schedule
              if e.operator == "HaloExchange"}
    assert shapes == {("forward", (4, 3), (4, 3)), ("vjp", (4, 3), (4, 3))}, shapes
    # a block of fewer than 2 width rows is all edges
    short = np.arange(3.0)
    np.testing.assert_array_equal(halo(short), [0, 0, 0, 1, 2, 0, 0])
    assert jax.grad(lambda x: jnp.sum(halo(x) ** 2))(short).tolist() == [0, 2, 4]
