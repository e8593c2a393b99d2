"""Problem in a single process: run, compute_totals in every mode, names, recompiling."""

import jax.numpy as jnp
import numpy as np
import pytest

import distop
import distributed_matvec as dm
from helpers import Cube


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


def test_schedule_lists_forward_then_vjp(matvec):
    a_local, _, x0, w = matvec
    problem = distop.Problem(dm.build(a_local, w, "reverse"), {"x": x0})
    (fwd, vjp) = problem.schedule
    assert (fwd.operator, fwd.phase, fwd.collectives) == ("DistributedMatvec", "forward",
                                                         ("Allreduce",))
    assert vjp.phase == "vjp" and vjp.batch == (5,) and vjp.input_shapes == ((40,),)
    assert "DistributedMatvec.vjp" in vjp.describe()


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


def test_user_error_in_problem_is_raised_as_itself():
    class Boom(distop.DistributedOperator):
        def forward(self, comm, x):
            raise ValueError("bad block")

    problem = distop.Problem(lambda x: {"f": Boom()(x)}, {"x": np.ones(2)})
    with pytest.raises(distop.OperatorError, match=r"Boom.forward on rank 0: raised "
                                                   r"ValueError: bad block"):
        problem.run()
