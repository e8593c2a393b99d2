"""Distributed variables, check_totals and built-in collectives in a single process
(the same cases run under MPI from test_mpi.py)."""

import io

import jax.numpy as jnp
import numpy as np
import pytest

import distop
import mpi_distributed


@pytest.mark.parametrize("case", mpi_distributed.CASES, ids=lambda f: f.__name__)
def test_case(case):
    case()


def test_check_totals_options_and_table():
    problem = distop.Problem(lambda x: {"y": jnp.sin(x), "z": jnp.sum(x ** 2)},
                             {"x": np.arange(3.0)})
    for form in ("central", "forward", "backward"):
        out = io.StringIO()
        results = problem.check_totals(form=form, out_stream=out, step=1e-7, atol=1e-6)
        assert set(results) == {("y", "x"), ("z", "x")}
        r = results["z", "x"]
        assert r.ok and r.inconsistent_ranks == [] and r.rel_error < 1e-5
        np.testing.assert_allclose(r.J, [[0.0, 2.0, 4.0]])
        text = out.getvalue()
        assert "of" in text and "|J_fd|" in text and "abs error" in text and "z" in text
    quiet = io.StringIO()
    problem.check_totals(out_stream=quiet, show_only_incorrect=True)
    assert "z " not in quiet.getvalue()
    assert problem.check_totals(out_stream=None, of="y", wrt="x")["y", "x"].J_fd.shape == (3, 3)
    with pytest.raises(ValueError, match="form='sideways'"):
        problem.check_totals(form="sideways")


def test_check_totals_flags_a_wrong_vjp():
    class Wrong(distop.DistributedOperator):
        def forward(self, comm, x):
            return x ** 2

        def vjp(self, comm, y_bar, x):
            return 3 * x * y_bar

    problem = distop.Problem(lambda x: {"y": Wrong()(x)}, {"x": np.ones(2)})
    out = io.StringIO()
    r = problem.check_totals(out_stream=out)["y", "x"]
    assert not r.ok and "FAILED" in out.getvalue()
    with pytest.raises(distop.DerivativeCheckError, match=r"\('y', 'x'\)"):
        problem.check_totals(out_stream=None, raise_on_error=True)
    assert issubclass(distop.DerivativeCheckError, ValueError)
