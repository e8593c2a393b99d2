"""The built-in collectives against dense references, in forward and reverse mode,
and check_operator on them (also run in one process by tests/test_collectives.py)."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    BLOCKS,
    ROWS,
    STARTS,
    Cube,
    all_close_everywhere,
    block,
    even_rows,
    own,
    smooth,
)
from mpi4py import MPI

import distop

# (the built-ins are differentiated in plain JAX here on purpose, their kinds handled by
# the cases themselves: `RankLocal` where rank-dependent code takes a replicated value)
pytestmark = pytest.mark.filterwarnings("ignore::distop.KindWarning")
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size


# -- the built-in collectives against dense references --------------------------------
# Every rank runs `local` on its own part of a replicated parameter vector p; the
# results of every rank, gathered, are a replicated function of p, the same on every
# rank, which `dense` computes in one process for every rank at once (rank by rank).
# Blocks are uneven, and rank 1 owns none from 2 ranks on.
def check_collectives(cases, p):
    """Compare values, jvp, jacfwd, jacrev and vmap of every case with its dense
    reference, outside a Problem and inside one (forward mode on the io_callback
    backend, totals on the lean path).

    **Arguments:**
    - `cases`: {name: (local, dense, enters, replicated)}: `local(q)` this rank's
      result from the parameters q; `dense(p, r)` rank r's result; `enters`: whether q
      is p through `RankLocal` (local code takes rank-dependent parts of it) or p
      itself (a replicated input); `replicated`: whether the result is replicated
      (compared as it is) or rank-local or distributed (gathered from every rank).
    - `p`: the parameters, the same on every rank.
    """
    def model(p):
        entered = distop.RankLocal()(p)
        found = {}
        for name, (local, _, enters, replicated) in cases.items():
            y = jnp.ravel(local(entered if enters else p))
            found[name] = y if replicated else distop.Allgather()(y)
        return found

    def dense(p):
        return {name: jnp.concatenate([jnp.ravel(jnp.asarray(reference(p, r)))
                                       for r in range(1 if replicated else size)])
                for name, (_, reference, _, replicated) in cases.items()}

    t = np.random.default_rng(7).standard_normal(p.shape)
    values, J = jax.jit(dense)(p), jax.jit(jax.jacfwd(dense))(p)
    got, tangents = jax.jvp(model, (p,), (t,))  # (op by op: each operator call eagerly)
    forward, reverse = jax.jit(jax.jacfwd(model))(p), jax.jit(jax.jacrev(model))(p)
    twice = jax.jit(jax.vmap(model))(np.stack([p, 2 * p]))
    in_problem = distop.Problem(
        lambda p: {**{f"J {k}": v for k, v in jax.jacfwd(model)(p).items()},
                   **{f"t {k}": v for k, v in jax.jvp(model, (p,), (t,))[1].items()}},
        {"p": p}, backend="io_callback").run()
    totals = distop.Problem(model, {"p": p}).compute_totals(wrt="p")
    doubled = jax.jit(dense)(2 * p)
    for name in cases:
        found = {"value": (got[name], values[name]), "vmap": (twice[name][1], doubled[name]),
                 "jvp": (tangents[name], J[name] @ t),
                 "jvp in a Problem": (in_problem[f"t {name}"], J[name] @ t),
                 "jacfwd": (forward[name], J[name]), "jacrev": (reverse[name], J[name]),
                 "jacfwd in a Problem": (in_problem[f"J {name}"], J[name]),
                 "compute_totals": (totals[name, "p"], J[name])}
        for what, (a, b) in found.items():
            try:
                all_close_everywhere(comm, a, b, atol=1e-14)
            except AssertionError as err:
                raise AssertionError(f"{name}, {what}: {err}") from None


def test_linear_collectives_in_forward_and_reverse_mode():
    m, width = 3, 2
    p = np.linspace(-1.5, 1.5, size * m + ROWS * width + 1)
    root = size - 1
    counts = tuple(BLOCKS)
    cases = {
        "AllreduceSum": (lambda q: distop.AllreduceSum()(own(q, rank, m)),
                         lambda p, r: sum(own(p, s, m) for s in range(size)), True, True),
        "Allgather": (lambda q: distop.Allgather()(block(q, rank)),
                      lambda p, r: jnp.concatenate([block(p, s) for s in range(size)]),
                      True, True),
        "Allgather of 0-d": (lambda q: distop.Allgather()(jnp.sum(own(q, rank, m))),
                             lambda p, r: jnp.stack([jnp.sum(own(p, s, m))
                                                     for s in range(size)]), True, True),
        "Split": (lambda p: distop.Split(counts=counts)(smooth(p[:ROWS])),
                  lambda p, r: smooth(p[STARTS[r]:STARTS[r] + BLOCKS[r]]), False, False),
        "Split evenly": (lambda p: distop.Split()(smooth(p[:5]) * 2),
                         lambda p, r: smooth(p[:5])[
                             sum(even_rows(5)[:r]):sum(even_rows(5)[:r + 1])] * 2,
                         False, False),
        "Alltoall": (lambda q: distop.Alltoall()(block(q, rank, width=width)),
                     lambda p, r: jnp.concatenate([block(p, s, width=width)
                                                   for s in range(size)]).T[
                         sum(even_rows(width)[:r]):sum(even_rows(width)[:r + 1])],
                     True, False),
        "Broadcast": (lambda q: distop.Broadcast(root=root)(own(q, rank, m)),
                      lambda p, r: own(p, root, m), True, True),
        "RankLocal": (lambda p: distop.RankLocal()(smooth(p[:m])) * (rank + 1),
                      lambda p, r: smooth(p[:m]) * (r + 1), False, False),
    }
    check_collectives(cases, p)


def ranks_by_column():
    """Rank-local values, (size, 6), with ties and zeros across ranks: per column, a
    tie of every rank; the extremes on the first and last ranks; one zero; two zeros
    (a tie of ranks 0 and 1); a tie of the last two ranks only; all distinct."""
    r = np.arange(size)[:, None]
    return np.hstack([np.full((size, 1), 0.7), 0.1 * r - 0.3, np.where(r == 0, 0.0, 0.5 + 0.1 * r),
                      np.where(r < 2, 0.0, -0.4),
                      np.where(r >= size - 2, 1.1, 0.2 * r - 0.9), 1.2 - 0.25 * r])


def test_reductions_over_ranks_in_forward_and_reverse_mode():
    values = ranks_by_column()
    m = values.shape[1]
    p = values.ravel()

    def extreme(p, pick):  # the lowest rank holding the extreme takes the derivative
        every = jnp.stack([own(p, s, m) for s in range(size)])
        return every[pick(every, axis=0), jnp.arange(m)]

    def product(p):
        found = own(p, 0, m)
        for s in range(1, size):
            found = found * own(p, s, m)
        return found

    cases = {f"Allreduce {op}": (lambda q, op=op: distop.Allreduce(op=op)(own(q, rank, m)),
                                 reference, True, True)
             for op, reference in [
                 ("sum", lambda p, r: sum(own(p, s, m) for s in range(size))),
                 ("max", lambda p, r: extreme(p, jnp.argmax)),
                 ("min", lambda p, r: extreme(p, jnp.argmin)),
                 ("prod", lambda p, r: product(p))]}
    cases["Scan"] = (lambda q: distop.Scan()(own(q, rank, m)),
                     lambda p, r: sum(own(p, s, m) for s in range(r + 1)), True, False)
    cases["Exscan"] = (lambda q: distop.Exscan()(own(q, rank, m)),
                       lambda p, r: sum((own(p, s, m) for s in range(r)), jnp.zeros(m)),
                       True, False)
    cases["Scan of 2-D values"] = (
        lambda q: distop.Scan()(own(q, rank, m).reshape(2, 3)),
        lambda p, r: sum(own(p, s, m) for s in range(r + 1)).reshape(2, 3), True, False)
    check_collectives(cases, p)
    # the rule for ties: the lowest rank holding the extreme, on every rank alike
    # (float64 and float32 find the owner by pairs of value and rank, float16 by two
    # reductions)
    for dtype in (np.float64, np.float32, np.float16):
        x = jnp.asarray(values[rank], dtype)
        for op, pick in (("max", np.argmax), ("min", np.argmin)):
            grad = jax.grad(lambda x, op=op: jnp.sum(distop.Allreduce(op=op)(x)))(x)
            expected = pick(values.astype(dtype), axis=0) == rank
            all_close_everywhere(comm, np.asarray(grad, float), expected.astype(float))
    x = jnp.asarray(values[rank])
    grad = jax.grad(lambda x: jnp.sum(distop.Allreduce(op="prod")(x)))(x)
    others = np.prod(np.delete(values, rank, axis=0), axis=0)
    all_close_everywhere(comm, grad, others)  # exact where some values are zero


def test_rooted_collectives_in_forward_and_reverse_mode():
    m = 3
    p = np.linspace(-1.4, 1.3, max(size * m, size * ROWS) + 2)
    last = size - 1
    counts = tuple(BLOCKS)

    def on(r, root, value):
        return value if r == root else jnp.zeros_like(value)

    cases = {
        "Reduce": (lambda q: distop.Reduce(root=last)(own(q, rank, m)),
                   lambda p, r: on(r, last, sum(own(p, s, m) for s in range(size))), True, False),
        "Reduce to 0": (lambda q: distop.Reduce()(own(q, rank, m).reshape(1, m)),
                        lambda p, r: on(r, 0, sum(own(p, s, m) for s in range(size))),
                        True, False),
        "Gather": (lambda q: distop.Gather()(block(q, rank)),
                   lambda p, r: on(r, 0, jnp.concatenate([block(p, s)
                                                          for s in range(size)])), True, False),
        "Gather of 0-d": (lambda q: distop.Gather(root=last)(jnp.sum(own(q, rank, m))),
                          lambda p, r: on(r, last, jnp.stack([jnp.sum(own(p, s, m))
                                                              for s in range(size)])), True, False),
        "Scatter": (lambda q: distop.Scatter(root=last, counts=counts)(own(q, rank, ROWS)),
                    lambda p, r: own(p, last, ROWS)[STARTS[r]:STARTS[r] + BLOCKS[r]], True, False),
        "Scatter evenly": (lambda q: distop.Scatter()(own(q, rank, 4).reshape(2, 2)),
                           lambda p, r: own(p, 0, 4).reshape(2, 2)[
                               sum(even_rows(2)[:r]):sum(even_rows(2)[:r + 1])], True, False),
    }
    check_collectives(cases, p)


def test_halo_exchanges_in_forward_and_reverse_mode():
    columns = 2
    p = np.linspace(-1.2, 1.4, ROWS * columns + 1)

    def window(p, r, w, boundary):
        every = jnp.concatenate([block(p, s, width=columns) for s in range(size)])
        padded = jnp.pad(every, ((w, w), (0, 0)),
                         mode="wrap" if boundary == "periodic" else "constant")
        return padded[STARTS[r]:STARTS[r] + BLOCKS[r] + 2 * w]

    cases = {}
    # widths beyond the smallest blocks, and beyond every row (periodic: rows repeat)
    for w in (0, 1, 2, ROWS + 2):
        for boundary in ("zero", "periodic"):
            cases[f"HaloExchange({w}, {boundary})"] = (
                lambda q, w=w, b=boundary: distop.HaloExchange(width=w, boundary=b)(
                    block(q, rank, width=columns)),
                lambda p, r, w=w, b=boundary: window(p, r, w, b), True, False)
    cases["HaloExchange of 1-D blocks"] = (
        lambda q: distop.HaloExchange(boundary="periodic")(block(q, rank)[:, 0]),
        lambda p, r: jnp.pad(jnp.concatenate([block(p, s) for s in range(size)])[:, 0],
                             1, mode="wrap")[STARTS[r]:STARTS[r] + BLOCKS[r] + 2], True, False)
    check_collectives(cases, p)


def test_a_stencil_on_a_halo_in_a_problem_with_distributed_input_and_output():
    xg = np.linspace(0.3, 1.4, ROWS)

    def stencil(h):
        return h[:-2] * h[1:-1] + jnp.sin(h[2:])

    def model(x):
        y = stencil(distop.HaloExchange(boundary="periodic")(x))
        return {"y": y, "f": distop.AllreduceSum()(jnp.sum(y ** 2))}

    def dense(x):
        y = stencil(jnp.pad(x, 1, mode="wrap"))
        return {"y": y, "f": jnp.sum(y ** 2)}

    problem = distop.Problem(model, {"x": xg[STARTS[rank]:STARTS[rank] + BLOCKS[rank]]},
                             distributed=["x", "y"])
    J, expected = problem.compute_totals(), jax.jacrev(dense)(xg)
    all_close_everywhere(comm, J["y", "x"], expected["y"], atol=1e-14)
    all_close_everywhere(comm, J["f", "x"], expected["f"][None], atol=1e-14)
    assert all(c.ok for c in problem.check_totals(out_stream=None).values())


class OffOnTheLastRank(distop.DistributedOperator):
    """The sum over ranks, rank-local in, replicated out, whose vjp is wrong on the last
    rank only (its forward and jvp are right)."""

    forward_collectives = jvp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    def vjp(self, comm, y_bar, x):
        return y_bar * (1.5 if comm.Get_rank() == comm.Get_size() - 1 else 1.0)

    def jvp(self, comm, t, x):
        return self.forward(comm, t)


PAIRS = {"jvp vs fd", "vjp vs fd", "vjp vs jvp", "forward batched", "jvp batched",
         "vjp batched"}
HVP_PAIRS = {"hvp vs fd", "hvp symmetry", "hvp batched"}


def test_check_operator_passes_the_built_ins_and_names_a_wrong_vjp():
    rng = np.random.default_rng([3, rank])
    mine = rng.uniform(0.5, 1.5, 3)  # rank-local: each rank's own
    rows = rng.uniform(0.5, 1.5, (BLOCKS[rank], 2))  # a distributed block, maybe empty
    p = np.linspace(0.5, 1.5, ROWS)  # replicated
    last = size - 1
    cases = [(distop.AllreduceSum(), (mine,), dict(replicated_outputs=[0])),
             (distop.Allreduce(op="prod"), (mine,), dict(replicated_outputs=[0])),
             (distop.Allreduce(op="max"), (mine,), dict(replicated_outputs=[0])),
             (distop.Scan(), (mine,), {}), (distop.Exscan(), (mine,), {}),
             (distop.Allgather(), (rows,), dict(replicated_outputs=[0])),
             (distop.Split(counts=tuple(BLOCKS)), (p,), dict(replicated_inputs=[0])),
             (distop.Alltoall(), (rows,), {}),
             (distop.Broadcast(root=last), (mine,), dict(replicated_outputs=[0])),
             (distop.RankLocal(), (p,), dict(replicated_inputs=[0])),
             (distop.Reduce(root=last), (mine,), {}), (distop.Gather(), (rows,), {}),
             (distop.Scatter(root=last, counts=tuple(BLOCKS)), (p * (rank + 1),), {}),
             (distop.HaloExchange(width=2, boundary="periodic"), (rows,), {})]
    for op, args, kinds in cases:
        results = distop.check_operator(op, *args, out_stream=None, **kinds)
        # (an hvp of its own where nonlinear: prod and max)
        pairs = PAIRS | (HVP_PAIRS if isinstance(op, distop.Allreduce) else set())
        assert set(results) == pairs and all(r.ok for r in results.values()), (op, results)
    if size > 1:  # a replicated output summed over ranks as if rank-local: P times too much
        assert not distop.check_operator(distop.AllreduceSum(), mine,
                                         out_stream=None)["vjp vs jvp"].ok

    out = io.StringIO()
    results = distop.check_operator(OffOnTheLastRank(), mine, replicated_outputs=[0],
                                    out_stream=out)
    failed = {pair for pair, r in results.items() if not r.ok}
    assert failed == {"vjp vs fd", "vjp vs jvp"}, results
    if rank == 0:
        text = out.getvalue()
        assert f"OffOnTheLastRank on {size} rank(s)" in text and "<-- FAILED" in text, text
        assert ("check_operator: OffOnTheLastRank.vjp is wrong: it disagrees with finite "
                "differences, which jvp agrees with") in text, text
    else:
        assert out.getvalue() == ""
    try:
        distop.check_operator(OffOnTheLastRank(), mine, replicated_outputs=[0],
                              out_stream=None, raise_on_error=True)
    except distop.DerivativeCheckError as err:
        assert "check_operator(OffOnTheLastRank): vjp vs fd: error" in str(err), err
    else:
        raise AssertionError("no DerivativeCheckError")


def test_linear_operators_transpose_into_their_vjp():
    rng = np.random.default_rng([5, rank])
    mine = rng.uniform(0.5, 1.5, 3)
    rows = rng.uniform(0.5, 1.5, (BLOCKS[rank], 2))
    p = np.linspace(0.5, 1.5, ROWS)
    last = size - 1
    for op, x in [(distop.AllreduceSum(), mine), (distop.Allreduce(), mine),
                  (distop.Scan(), mine), (distop.Exscan(), mine),
                  (distop.Allgather(), rows), (distop.Split(counts=tuple(BLOCKS)), p),
                  (distop.Alltoall(), rows), (distop.Broadcast(root=last), mine),
                  (distop.RankLocal(), p), (distop.Reduce(root=last), mine),
                  (distop.Gather(), rows), (distop.Scatter(root=last, counts=tuple(BLOCKS)), p),
                  (distop.HaloExchange(width=2, boundary="periodic"), rows)]:
        y = op(x)
        c = np.random.default_rng([6, rank]).standard_normal(y.shape)
        transpose = jax.linear_transpose(op, x)
        expected = jax.vjp(op, x)[1](c)[0]
        for found in (transpose(c)[0], jax.jit(transpose)(c)[0],
                      jax.vmap(transpose)(np.stack([c, 2 * c]))[0][1] / 2):
            all_close_everywhere(comm, found, expected, atol=1e-14)
    for op, text in [(distop.Allreduce(op="max"), "Allreduce.forward on rank "
                      f"{rank} is not linear with these fields"),
                     (Cube(), f"Cube.forward on rank {rank} is not declared linear")]:
        try:
            jax.linear_transpose(op, mine)(mine)
        except distop.DistopError as err:
            assert f"jax.linear_transpose: {text}" in str(err), err
        else:
            raise AssertionError(f"no DistopError for {type(op).__name__}")

    # the adjoint of a halo exchange inside a model, run by a Problem: each rank's
    # window, squared and weighted, added back onto the rows it came from
    def model(x):
        halo = distop.HaloExchange()
        return {"y": jax.linear_transpose(halo, x)(halo(x) ** 2 * (rank + 1.0))[0]}

    def dense(xg):
        padded = jnp.pad(xg, 1)
        total = jnp.zeros(ROWS + 2)
        for r in range(size):
            window = slice(STARTS[r], STARTS[r] + BLOCKS[r] + 2)
            total = total.at[window].add(padded[window] ** 2 * (r + 1.0))
        return total[1:-1]

    xg = np.linspace(0.3, 1.4, ROWS)
    problem = distop.Problem(model, {"x": xg[STARTS[rank]:STARTS[rank] + BLOCKS[rank]]},
                             distributed=["x", "y"])
    y = np.concatenate(comm.allgather(np.asarray(problem.run()["y"])))
    all_close_everywhere(comm, y, dense(xg), atol=1e-14)
    all_close_everywhere(comm, problem.compute_totals()["y", "x"], jax.jacrev(dense)(xg),
                         atol=1e-14)
    assert problem.check_totals(out_stream=None)["y", "x"].ok
