"""distop.linalg: Krylov solves of an uneven stencil against dense solves, their
failures on every rank, and an implicit operator solved by them."""

import numpy as np
from helpers import (
    all_close_everywhere,
)
from mpi4py import MPI

import distop

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


# -- distop.linalg: Krylov solvers on blocks ------------------------------------------
class Stencil3:
    """A 1-D three-point stencil (lower, diagonal, upper) on N rows split over the ranks
    as `counts`, its halos exchanged by Sendrecv between the nearest ranks that hold rows
    (a rank with none takes no part)."""

    def __init__(self, counts, lower, diagonal, upper):
        self.counts, self.coefficients = counts, (lower, diagonal, upper)
        self.start, self.n = sum(counts[:rank]), counts[rank]
        holders = [r for r in range(size) if counts[r] > 0]
        at = holders.index(rank) if self.n else None
        self.left = holders[at - 1] if at else MPI.PROC_NULL
        self.right = (holders[at + 1] if at is not None and at + 1 < len(holders)
                      else MPI.PROC_NULL)

    def matvec(self, comm, v):
        from_left, from_right = np.zeros(1), np.zeros(1)
        if self.n:
            comm.Sendrecv(v[-1:].copy(), dest=self.right, recvbuf=from_left, source=self.left)
            comm.Sendrecv(v[:1].copy(), dest=self.left, recvbuf=from_right, source=self.right)
        padded = np.concatenate([from_left, v, from_right])
        lower, diagonal, upper = self.coefficients
        return lower * padded[:-2] + diagonal * padded[1:-1] + upper * padded[2:]

    def transposed(self):
        lower, diagonal, upper = self.coefficients
        return Stencil3(self.counts, upper, diagonal, lower)

    def dense(self):
        lower, diagonal, upper = self.coefficients
        total = sum(self.counts)
        return (np.diag(np.full(total, diagonal)) + np.diag(np.full(total - 1, lower), -1)
                + np.diag(np.full(total - 1, upper), 1))

    def mine(self, whole):
        return np.array(whole[self.start:self.start + self.n])


def uneven_rows(total=37):
    """Rows per rank: more on later ranks, none on rank 1 from 3 ranks on."""
    weights = [0 if (r == 1 and size >= 3) else r + 1 for r in range(size)]
    counts = [total * w // sum(weights) for w in weights]
    counts[-1] += total - sum(counts)
    return counts


def same_everywhere(*values):
    every = comm.allgather(values)
    assert all(v == every[0] for v in every), every


def test_krylov_solves_of_an_uneven_stencil_match_a_dense_solve():
    from distop.linalg import cg, gmres

    counts = uneven_rows()
    assert size < 3 or counts[1] == 0, counts
    b_whole = np.random.default_rng(5).standard_normal(sum(counts))
    laplacian = Stencil3(counts, -1.0, 2.0, -1.0)
    flow = Stencil3(counts, -1.3, 2.5, -0.7)  # convection-diffusion: not symmetric
    runs = [(cg, laplacian, {}), (cg, laplacian, {"precondition": lambda r: r / 2.0}),
            (gmres, laplacian, {"restart": 40}), (gmres, flow, {"restart": 8}),
            (gmres, flow.transposed(), {"restart": 8}),
            (gmres, flow, {"precondition": lambda r: r / 2.5})]
    for solver, stencil, options in runs:
        b = stencil.mine(b_whole)
        result = solver(comm, lambda v, s=stencil: s.matvec(comm, v), b, **options)
        assert result.converged and result.x.shape == b.shape
        x_whole = np.concatenate(comm.allgather(result.x))
        expected = np.linalg.solve(stencil.dense(), b_whole)
        all_close_everywhere(comm, x_whole, expected, rtol=1e-8, atol=1e-10)
        same_everywhere(result.iterations, result.residual_norm, result.converged)
        r = b - stencil.matvec(comm, result.x)
        direct = np.sqrt(comm.allreduce(float(r @ r)))
        assert abs(result.residual_norm - direct) <= 1e-6 * direct, (result, direct)
        assert result.residual_norm <= 1e-10 * np.linalg.norm(b_whole)


def test_krylov_failures_raise_on_every_rank():
    from distop.linalg import ConvergenceError, cg, gmres

    counts = uneven_rows()
    laplacian = Stencil3(counts, -1.0, 2.0, -1.0)
    b = laplacian.mine(np.random.default_rng(6).standard_normal(sum(counts)))

    def outcome(call):
        try:
            call()
        except (ConvergenceError, distop.DistopError, ValueError) as err:
            return type(err).__name__, str(err), getattr(err, "elsewhere", False)
        return "returned", "", False

    for solver in (cg, gmres):
        kind, message, _ = outcome(lambda s=solver: s(
            comm, lambda v: laplacian.matvec(comm, v), b, maxiter=3, name="Heat.solve_adjoint"))
        assert kind == "ConvergenceError", (kind, message)
        for part in (f"Heat.solve_adjoint on rank {rank} of {size}", "after 3 iterations",
                     "misses the tolerance", "raise maxiter"):
            assert part in message, (part, message)
        same_everywhere(kind, message.replace(f"rank {rank} of", "rank of"))
        result = solver(comm, lambda v: laplacian.matvec(comm, v), b, maxiter=3,
                        raise_on_failure=False)
        assert not result.converged
        same_everywhere(result.iterations, result.residual_norm, result.converged)

    # a negative definite operator: p^T A p < 0 on every rank at once
    negated = Stencil3(counts, 1.0, -2.0, 1.0)
    kind, message, _ = outcome(lambda: cg(comm, lambda v: negated.matvec(comm, v), b))
    assert kind == "ConvergenceError" and "not positive definite" in message, message
    same_everywhere(kind)

    # a wrong block on the last rank only: its own error there, a report elsewhere
    last = size - 1

    def short_on_the_last_rank(v):
        out = laplacian.matvec(comm, v)
        return out[:-1] if rank == last else out

    kind, message, elsewhere = outcome(lambda: cg(comm, short_on_the_last_rank, b))
    if rank == last:
        assert kind == "ValueError" and f"cg on rank {last} of {size}: matvec returned" in message
    else:
        assert kind == "DistopError" and elsewhere and f"rank(s) [{last}]" in message, message
    kind, message, elsewhere = outcome(lambda: gmres(
        comm, lambda v: laplacian.matvec(comm, v), b if rank else b[None]))
    if rank == 0:
        assert kind == "ValueError" and "b has shape" in message, message
    else:
        assert kind == "DistopError" and elsewhere and "rank(s) [0]" in message, message


class ImplicitFlow(distop.DistributedOperator):
    """y solving A y = x for a non-symmetric stencil A, by GMRES; its VJP solves with
    A^T."""

    stencil: Stencil3
    forward_collectives = ("Sendrecv", "Allreduce")
    vjp_collectives = ("Sendrecv", "Allreduce")

    def forward(self, comm, x):
        from distop.linalg import gmres

        return gmres(comm, lambda v: self.stencil.matvec(comm, v), x,
                     name="ImplicitFlow.forward").x

    def vjp(self, comm, y_bar, x):
        from distop.linalg import gmres

        adjoint = self.stencil.transposed()
        return gmres(comm, lambda v: adjoint.matvec(comm, v), y_bar,
                     name="ImplicitFlow.vjp").x


def test_an_implicit_operator_solves_forward_and_adjoint_with_krylov():
    counts = uneven_rows(13)
    flow = Stencil3(counts, -1.3, 2.5, -0.7)
    x = flow.mine(np.linspace(0.5, 1.5, sum(counts)))
    problem = distop.Problem(lambda x: {"y": ImplicitFlow(flow)(x)}, {"x": x},
                             distributed=["x", "y"])
    y = np.concatenate(comm.allgather(np.asarray(problem.run()["y"])))
    all_close_everywhere(comm, y, np.linalg.solve(flow.dense(), np.linspace(0.5, 1.5, 13)),
                         rtol=1e-8)
    J = problem.compute_totals("y", "x")["y", "x"]
    all_close_everywhere(comm, J, np.linalg.inv(flow.dense()), rtol=1e-8, atol=1e-10)
    assert all(c.ok for c in problem.check_totals(out_stream=None).values())


def test_a_convergence_error_in_a_method_is_caught_as_one_in_the_checking_mode(capfd):
    from distop.linalg import ConvergenceError

    counts = uneven_rows(13)
    flow = Stencil3(counts, -1.3, 2.5, -0.7)

    class Unconverged(ImplicitFlow):
        def forward(self, comm, x):
            from distop.linalg import gmres

            return gmres(comm, lambda v: self.stencil.matvec(comm, v), x, maxiter=1,
                         name="Unconverged.forward").x

    x = flow.mine(np.linspace(0.5, 1.5, sum(counts)))
    before = distop.configure().check_collectives
    distop.configure(check_collectives=True)
    capfd.readouterr()
    try:
        mine = comm.Dup()
        problem = distop.Problem(lambda x: {"y": Unconverged(flow)(x)}, {"x": x},
                                 distributed=["x", "y"], comm=mine)
        try:
            problem.run()
        except ConvergenceError as err:  # (as the docs suggest)
            caught = err
        else:
            raise AssertionError("no ConvergenceError")
    finally:
        distop.configure(check_collectives=before)
    assert isinstance(caught, distop.OperatorError), type(caught).__mro__
    assert f"Unconverged.forward on rank {rank}" in str(caught)
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err and "Unconverged" not in printed.err, printed.err
    mine.Free()  # (distop's private communicator goes with it, however long the error
    # and its frames, holding the Problem, live on)
