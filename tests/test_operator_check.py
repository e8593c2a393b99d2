"""`check_operator` in a single process (the same cases run under MPI from
test_mpi.py: see `check_operator_passes_the_built_ins_and_names_a_wrong_vjp`)."""

import io

import numpy as np
import pytest
from helpers import Cube

import distop


class Power(distop.DistributedOperator):
    """y = x ** n for an integer input n, with a jvp off by the factor `off`."""

    off: float = 1.0

    def forward(self, comm, x, n):
        return x ** n

    def vjp(self, comm, y_bar, x, n):
        return n * x ** (n - 1) * y_bar, None

    def jvp(self, comm, tangents, x, n):
        return self.off * n * x ** (n - 1) * tangents[0]


def test_pairs_of_the_methods_an_operator_has():
    x = np.linspace(0.5, 1.5, 4)
    assert set(distop.check_operator(Cube(), x, out_stream=None)) == {
        "vjp vs fd", "forward batched", "vjp batched"}  # no jvp: its pairs left out
    results = distop.check_operator(Power(), x, np.int64(3), out_stream=None)
    assert len(results) == 6 and all(r.ok for r in results.values()), results
    z = x * (1 + 0.5j)  # complex values: the real parts of the pairings
    assert all(r.ok for r in distop.check_operator(Power(), z, np.int64(3),
                                                   out_stream=None).values())


def test_a_wrong_jvp_is_named():
    out = io.StringIO()
    results = distop.check_operator(Power(off=1.01), np.linspace(0.5, 1.5, 4), np.int64(2),
                                    out_stream=out)
    assert {p for p, r in results.items() if not r.ok} == {"jvp vs fd", "vjp vs jvp"}
    r = results["jvp vs fd"]
    assert r.abs_error > r.allowed and r.rank == 0 and r.where.startswith("rank 0, entry")
    assert "Power.jvp is wrong: it disagrees with finite differences, which vjp agrees" in (
        out.getvalue()), out.getvalue()


def test_replicated_positions_are_checked():
    with pytest.raises(ValueError, match=r"replicated_outputs=...\): 1 is not the position "
                                         r"of one of its 1 outputs"):
        distop.check_operator(Cube(), np.ones(2), replicated_outputs=[1])
