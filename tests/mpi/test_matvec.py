"""The distributed matvec example under MPI: every variant and mode against a dense
reference, and the seeds and schedule of its batched calls."""


import distributed_matvec as dm
import jax
import numpy as np
from helpers import (
    all_close_everywhere,
)
from mpi4py import MPI

import distop

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


# -- the matvec scenario --------------------------------------------------------------
def matvec_scenario(objectives, variants, modes):
    for k in objectives:
        a_local, a_global, x0, w = dm.setup(60, k, comm)
        for variant in variants:
            problem = distop.Problem(dm.build(a_local, w, variant), {"x": x0})
            for mode in modes:
                err = comm.allreduce(dm.errors(problem, a_global, x0, w, mode, calls=3),
                                     op=MPI.MAX)
                assert err <= 1e-12, f"K={k} {variant} {mode}: error {err:.1e}"


def test_matvec_batched_and_loop():
    matvec_scenario((1, 9, 10, 16, 32), ("reverse", "forward"), ("batched", "loop"))


def test_matvec_unrolled():
    matvec_scenario((1, 9, 10, 16, 32), ("reverse",), ("unrolled",))
    matvec_scenario((1, 9, 10, 16), ("forward",), ("unrolled",))


def test_one_vector_objective_drops_the_unit_seed_product_on_every_rank():
    # one output f = W y: its seeds are the identity, the same on every rank, so every
    # rank's program skips seeds @ W (and its VJP gets x once, expand_dims)
    a_local, a_global, x0, w = dm.setup(40, 6, comm)
    op = dm.DistributedMatvec(a_local)
    problem = distop.Problem(lambda x, w: {"f": w @ op(x)}, {"x": x0, "w": w})
    for _ in range(2):
        J = problem.compute_totals("f", "x")["f", "x"]
        all_close_everywhere(comm, J, w @ a_global, atol=1e-12)
    if problem.backend != "lean":  # only lean programs are rewritten
        return
    program = next(p for key, p in problem._programs.programs.items()
                   if key[0] == "compute_totals" and key[1][1:3] == (("f",), ("x",)))
    jaxpr = program.fn.trace(jax.ShapeDtypeStruct((), np.float64),
                             {"x": jax.ShapeDtypeStruct(x0.shape, x0.dtype),
                              "w": jax.ShapeDtypeStruct(w.shape, w.dtype)},
                             jax.ShapeDtypeStruct((6, 6), np.float64)).jaxpr
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert all(e.invars[0].aval.shape == w.shape for e in products), products


def test_matvec_ordered_is_default_and_verified():
    a_local, _, x0, w = dm.setup(20, 4, comm)
    problem = distop.Problem(dm.build(a_local, w, "forward"), {"x": x0})
    phases = [e.phase for e in problem.schedule]
    assert phases == ["forward"] * 4 + ["vjp"] * 4, phases
    assert all(e.ordered and e.collectives == ("Allreduce",) for e in problem.schedule)
    assert [e.batch for e in problem.schedule[4:]] == [(4,)] * 4
