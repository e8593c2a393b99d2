"""Failure scenarios, one per launch: `mpiexec -n P python tests/mpi_failures.py NAME`.

Each must end quickly with a non-zero exit code and a message naming the rank and the
operator (tests/test_safety.py runs them with a short watchdog).
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from mpi4py import MPI

import distop

jax.config.update("jax_enable_x64", True)
comm = MPI.COMM_WORLD
BAD = comm.size - 1  # the misbehaving rank: never rank 0


class Flaky(distop.DistributedOperator):
    """An allreduce-sum whose forward or vjp raises on one rank."""

    fail_in: str = ""
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        if self.fail_in == "forward" and comm.Get_rank() == BAD:
            raise RuntimeError("disk quota exceeded")
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, y_bar, x):
        if self.fail_in == "vjp" and comm.Get_rank() == BAD:
            raise RuntimeError("singular block")
        out = np.empty_like(y_bar)
        comm.Allreduce(y_bar, out, op=MPI.SUM)
        return out


class Undeclared(distop.DistributedOperator):
    forward_collectives = ("Allreduce",)

    def forward(self, comm, x):
        comm.Barrier()
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out


class Stray(distop.DistributedOperator):
    """y = 2 x, whose forward makes an Allreduce (declared) on rank 0 only."""

    forward_collectives = ("Allreduce",)

    def forward(self, comm, x):
        y = 2 * x
        if comm.Get_rank() == 0:
            comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM)
        return y


def main(scenario):
    x = np.ones(3)
    if scenario in ("forward_raises", "vjp_raises"):
        op = Flaky(fail_in=scenario.split("_")[0])
        problem = distop.Problem(lambda x: {"f": jnp.sum(op(x))}, {"x": x})
        problem.run()
        problem.compute_totals()
    elif scenario == "rank_skips_operator":
        op = Flaky()
        skip = comm.rank == BAD
        problem = distop.Problem(
            lambda x: {"f": lax.cond(skip, lambda x: x, lambda x: op(x), x).sum()}, {"x": x})
        problem.run()
    elif scenario == "while_trip_count_differs":
        op = Flaky()
        steps = 3 + (comm.rank == BAD)
        problem = distop.Problem(
            lambda x: {"f": lax.while_loop(lambda c: c[1] < steps,
                                           lambda c: (op(c[0]) / 2, c[1] + 1), (x, 0))[0]},
            {"x": x})
        problem.run()
    elif scenario == "rank_exits_early":
        op = Flaky()
        problem = distop.Problem(lambda x: {"f": jnp.sum(op(x))}, {"x": x})
        if comm.rank == BAD:
            print(f"rank {comm.rank}: exiting early", flush=True)
            sys.exit(0)
        problem.run()
    elif scenario == "raises_before_any_problem":
        if comm.rank == BAD:  # before distop made anything: only `import distop` ran
            raise RuntimeError("no such input file")
        comm.Barrier()
    elif scenario == "rank_exits_before_any_problem":
        if comm.rank == BAD:
            sys.exit(0)
        distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": x}).run()
    elif scenario == "undeclared_point_to_point":  # (a halo exchange declared as local)
        from helpers import Stencil

        class Local(Stencil):
            forward_collectives = vjp_collectives = ()

        distop.Problem(lambda x: {"y": Local()(x)}, {"x": x}, distributed=["x", "y"]).run()
    elif scenario.startswith("implicit_"):  # ("implicit_" + the method that fails)
        from helpers import Coupled

        op = Coupled(fail=scenario[len("implicit_"):])
        problem = distop.Problem(lambda b: {"f": distop.AllreduceSum()(jnp.sum(op(b, 2.0)))},
                                 {"b": x}, distributed=["b"])
        problem.run()
        problem.compute_totals()
    elif scenario == "stray_collective":  # (its partner could only be distop's own)
        block = np.ones(2 + comm.rank)  # uneven blocks
        problem = distop.Problem(lambda x: {"y": Stray()(x)}, {"x": block},
                                 distributed=["x", "y"])
        for _ in range(3):
            y = problem.run()["y"]
            assert np.array_equal(y, 2 * block), f"rank {comm.rank}: a wrong value {y}"
    elif scenario == "undeclared_collective":
        problem = distop.Problem(lambda x: {"f": jnp.sum(Undeclared()(x))}, {"x": x})
        problem.run()
    elif scenario.startswith("every_rank_raises"):  # (the same mistake on every rank)
        distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": x}).run()
        if scenario.endswith("_highest_first"):  # (each rank a moment after the next)
            time.sleep(0.4 * (comm.size - 1 - comm.rank))
        raise ValueError("no input named 'x3'")
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(f"rank {comm.rank}: scenario {scenario} finished without an error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
