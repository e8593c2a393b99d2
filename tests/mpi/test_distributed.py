"""Distributed variables, check_totals and the built-in collectives (also run in one
process by tests/test_totals.py). Blocks are uneven and some ranks own none."""

import io

import jax
import jax.numpy as jnp
import numpy as np
from distributed_least_squares import Residual
from distributed_matvec import DistributedMatvec
from helpers import all_close_everywhere, loops_since, without_loops
from mpi4py import MPI

import distop

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
COUNTS = [(3, 0, 2, 1)[r % 4] for r in range(size)] if size > 1 else [4]
START = sum(COUNTS[:rank])
N = sum(COUNTS)


def mine(global_array):
    """This rank's rows of a global array."""
    return np.array(global_array[START:START + COUNTS[rank]])


def check(problem, **kw):
    out = io.StringIO()
    results = problem.check_totals(out_stream=out, **kw)
    assert all(r.ok for r in results.values()), out.getvalue()
    if rank == 0:
        assert "rel error" in out.getvalue()
    return results


# -- built-in collectives -------------------------------------------------------------
def test_builtins_pass_check_totals_with_uneven_and_empty_blocks():
    rng = np.random.default_rng(0)
    xg = rng.standard_normal(N)
    c = rng.standard_normal(N)

    def model(x, p):
        s = distop.AllreduceSum()(jnp.sum(x ** 3))
        y = distop.Allgather()(jnp.sin(x))
        q = distop.Split(counts=tuple(COUNTS))(p * p)
        b = distop.Broadcast(root=size - 1)(jnp.sum(x) * jnp.ones(2))
        return {"s": s, "f": jnp.dot(c, y) * s, "q": q * x, "b": b}

    problem = distop.Problem(model, {"x": mine(xg), "p": xg + 1.0},
                             distributed={"x", "q"})
    out = problem.run()
    all_close_everywhere(comm, out["s"], np.sum(xg ** 3))
    all_close_everywhere(comm, out["q"], mine((xg + 1) ** 2 * xg))
    J = problem.compute_totals()
    all_close_everywhere(comm, J["s", "x"], 3 * xg[None] ** 2)
    all_close_everywhere(comm, J["q", "p"], np.diag(2 * (xg + 1) * xg))
    last = sum(COUNTS[:size - 1])
    expected_b = np.zeros((2, N))
    expected_b[:, last:last + COUNTS[-1]] = 1.0
    all_close_everywhere(comm, J["b", "x"], expected_b)
    check(problem)
    if len(set(COUNTS)) > 1:  # an uneven split shows its global size in the schedule
        split = [e for e in problem.schedule if e.operator == "Split"][0]
        assert split.output_distributed == (True,) and split.output_shapes == ((N,),), split
    local = problem.compute_totals("q", "x", return_format="local")["q", "x"]
    assert local.shape == (COUNTS[rank], COUNTS[rank])


class ComplexScale(distop.DistributedOperator):
    """y = a * z, elementwise, for this rank's block of complex a."""

    a: np.ndarray
    batched_vjp = True

    def forward(self, comm, z):
        return self.a * z

    def vjp(self, comm, y_bar, z):  # JAX's convention: a holomorphic map's cotangent
        return y_bar * self.a


def test_complex_values_in_jax_s_convention_with_check_totals_agreeing():
    rng = np.random.default_rng(3)
    zg = rng.standard_normal(N) + 1j * rng.standard_normal(N)
    ag = rng.standard_normal(N) + 1j * rng.standard_normal(N)
    op = ComplexScale(mine(ag))

    def model(z, x):
        y = op(z)  # distributed, holomorphic in z
        return {"y": y, "n": distop.AllreduceSum()(jnp.sum(jnp.abs(y) ** 2)),  # real
                "c": distop.AllreduceSum()(jnp.sum(jnp.conj(y))),  # antiholomorphic
                "w": x ** 2 * (1 + 2j)}  # complex of a real input

    x = np.array([0.5, -1.5])
    problem = distop.Problem(model, {"z": mine(zg), "x": x}, distributed=["z", "y"])
    check(problem)
    J = problem.compute_totals()
    # J is the derivative of the output's real part, in JAX's convention: d/dx - i d/dy
    # along a complex input z = x + iy (a holomorphic map's complex derivative)
    all_close_everywhere(comm, J["y", "z"], np.diag(ag))
    all_close_everywhere(comm, J["n", "z"], [2 * np.abs(ag) ** 2 * np.conj(zg)])
    all_close_everywhere(comm, J["c", "z"], [ag])  # Re(conj(a z)) = Re(a z)
    all_close_everywhere(comm, J["w", "x"], np.diag(2 * x))
    assert J["y", "z"].dtype == np.complex128 and J["w", "x"].dtype == np.float64

    class Conjugated(ComplexScale):  # a vjp with a conjugate too many: check_totals sees it
        def vjp(self, comm, y_bar, z):
            return y_bar * np.conj(self.a)

    bad = distop.Problem(lambda z: {"y": Conjugated(mine(ag))(z)}, {"z": mine(zg)},
                         distributed=["z", "y"])
    assert not bad.check_totals(out_stream=None)["y", "z"].ok


class Stepped(distop.DistributedOperator):
    """y = x**3 elementwise, declared fit for the complex step; `off` makes its vjp
    wrong by that fraction."""

    off: float = 0.0
    complex_step = True

    def forward(self, comm, x):
        return x ** 3

    def vjp(self, comm, y_bar, x):
        return (3 + 3 * self.off) * x ** 2 * y_bar


def test_complex_step_checks_a_distributed_model_and_names_an_operator_refusing_it():
    xg = np.linspace(0.4, 1.3, N)

    def model(x, p):
        h = distop.HaloExchange(boundary="periodic")(Stepped()(x))
        y = h[:-2] * h[2:] + jnp.sin(h[1:-1])
        s = distop.Allreduce(op="prod")(distop.RankLocal()(p) * (rank + 1.0))
        return {"y": y, "f": distop.AllreduceSum()(jnp.sum(y ** 2)) * jnp.sum(s),
                "g": jnp.sum(distop.Allgather()(y)) * distop.Broadcast(root=size - 1)(
                    distop.RankLocal()(p[:1]) * (rank + 1.0))}

    problem = distop.Problem(model, {"x": mine(xg), "p": np.array([0.7, 1.1])},
                             distributed=["x", "y"])
    check(problem, method="cs")
    # at a tiny step the complex step has no truncation and no difference to round:
    # J_fd to a few units in the last place
    results = check(problem, method="cs", step=1e-30)
    assert all(r.abs_error <= 1e-14 * max(1, np.max(np.abs(r.J)))
               for r in results.values()), results
    # a vjp wrong by 1e-11: within what finite differences carry, not the complex step
    wrong = distop.Problem(lambda x: {"y": Stepped(1e-11)(x)}, {"x": mine(xg)},
                           distributed=["x", "y"])
    tight = dict(out_stream=None, atol=0, rtol=1e-12)
    assert wrong.check_totals(**tight)["y", "x"].ok
    r = wrong.check_totals(method="cs", step=1e-20, **tight)["y", "x"]
    assert not r.ok and r.abs_error > r.allowed, r

    class Unstepped(Stepped):  # (its forward would take complex values: undeclared)
        complex_step = False

    refused = distop.Problem(lambda x: {"y": Unstepped()(jnp.sin(Stepped()(x)))},
                             {"x": mine(xg)}, distributed=["x", "y"])
    raises(distop.DistopError, f"check_totals(method='cs'): Unstepped.forward on rank "
           f"{rank} (and every rank alike): its forward would get complex inputs",
           lambda: refused.check_totals(method="cs"))
    assert refused.check_totals(out_stream=None)["y", "x"].ok  # (and nothing is stuck)
    for model, text in [(lambda x: {"y": distop.Allreduce(op="max")(x)},
                         "Allreduce.forward on rank"),
                        (lambda x: {"y": jnp.abs(x)}, "output 'y' is real when its inputs")]:
        raises(distop.DistopError, text, lambda model=model: distop.Problem(
            model, {"x": np.ones(2)}).check_totals(method="cs"))
    raises(ValueError, "inputs ['z'] are complex", lambda: distop.Problem(
        lambda z: {"y": jnp.sum(z).real}, {"z": np.ones(2, complex)}).check_totals(
            method="cs"))


def test_alltoall_transpose_and_its_gradient():
    m = 5
    xg = np.arange(N * m, dtype=float).reshape(N, m) / 7.0
    cols = [m // size + (r < m % size) for r in range(size)]
    start = sum(cols[:rank])

    def model(x):
        t = distop.Alltoall()(x.T.T * 2.0)  # a jitted double transpose first
        return {"t": jnp.sin(t)}

    problem = distop.Problem(model, {"x": mine(xg)}, distributed={"x", "t"})
    t = problem.run()["t"]
    all_close_everywhere(comm, t, np.sin(2 * xg.T[start:start + cols[rank]]))
    check(problem)
    jax_t = jax.jit(lambda x: distop.Alltoall()(jnp.transpose(x.reshape(m, -1)).T.T))
    assert jax_t(mine(xg).T.copy().reshape(-1)).shape == (cols[rank], N)


# -- totals on global vectors ---------------------------------------------------------
def test_totals_in_all_four_combinations_match_dense_references():
    rng = np.random.default_rng(1)
    n = 4
    a = rng.standard_normal((N, n))
    bg = rng.standard_normal(N)
    x = rng.standard_normal(n)
    op = Residual(mine(a))

    def model(x, b):
        r = op(x, b)
        return {"r": r, "loss": distop.AllreduceSum()(jnp.sum(r ** 2))}

    problem = distop.Problem(model, {"x": x, "b": mine(bg)}, distributed={"b", "r"})
    residual = a @ x - bg
    for mode in ("batched", "loop", "unrolled"):
        J = problem.compute_totals(mode=mode)
        all_close_everywhere(comm, J["r", "x"], a)  # distributed of, replicated wrt
        all_close_everywhere(comm, J["r", "b"], -np.eye(N))  # distributed, distributed
        all_close_everywhere(comm, J["loss", "x"], 2 * residual[None] @ a)  # repl., repl.
        all_close_everywhere(comm, J["loss", "b"], -2 * residual[None])  # repl., distr.
    J = problem.compute_totals(return_format="local")
    all_close_everywhere(comm, J["r", "x"], mine(a))
    assert J["r", "b"].shape == (COUNTS[rank], COUNTS[rank])
    assert J["loss", "b"].shape == (1, COUNTS[rank])
    check(problem)
    # an `of` subset that leaves an operator's outputs unused: every VJP still runs
    only_loss = problem.compute_totals(of="loss", wrt="x")
    all_close_everywhere(comm, only_loss["loss", "x"], 2 * residual[None] @ a)
    # forward sweeps, one per global entry of wrt (the columns of b on their owners)
    tangent_op = WithJvp(mine(a))

    def tangent_model(x, b):
        r = tangent_op(x, b)
        return {"r": r, "loss": distop.AllreduceSum()(jnp.sum(r ** 2))}

    forward = distop.Problem(tangent_model, {"x": x, "b": mine(bg)}, distributed={"b", "r"})
    for mode in ("batched", "loop", "unrolled"):
        for return_format in ("global", "local"):
            want = problem.compute_totals(mode=mode, return_format=return_format)
            got = forward.compute_totals(mode=mode, return_format=return_format,
                                         direction="fwd")
            assert set(got) == set(want), (got.keys(), want.keys())
            for key in want:
                all_close_everywhere(comm, got[key], want[key])


class WithJvp(Residual):
    """`Residual` with its jvp: r_dot = A x_dot - b_dot."""

    def jvp(self, comm, tangents, x, b):
        x_dot, b_dot = tangents
        return self.A @ x_dot - b_dot


# -- VJP bugs on one rank -------------------------------------------------------------
class Scale(distop.DistributedOperator):
    """y = 3 x (local); the VJP is wrong on `bad_rank` only."""

    bad_rank: int
    spread: bool
    vjp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        return 3 * x

    def vjp(self, comm, y_bar, x):
        g = 3 * y_bar * (1.5 if comm.Get_rank() == self.bad_rank else 1.0)
        if not self.spread:
            return g
        # spread: the bug goes through a collective to every rank
        total = np.empty_like(g)
        comm.Allreduce(g / comm.Get_size() if comm.Get_rank() != self.bad_rank
                       else g - 3 * y_bar * (comm.Get_size() - 1) / comm.Get_size(),
                       total, op=MPI.SUM)
        return total


def test_check_totals_flags_a_vjp_bug_on_one_non_root_rank():
    if size == 1:
        return
    for spread in (False, True):
        op = Scale(bad_rank=size - 1, spread=spread)
        problem = distop.Problem(lambda x, op=op: {"y": jnp.sum(op(x))}, {"x": np.ones(3)})
        out = io.StringIO()
        results = problem.check_totals(out_stream=out)
        r = results["y", "x"]
        assert not r.ok, (spread, r)
        if spread:  # every rank has the same wrong J
            assert r.inconsistent_ranks == [] and r.rel_error > 0.1, r
        else:  # only the bad rank's J is wrong
            assert r.inconsistent_ranks == [size - 1], r
        if rank == 0:
            assert ("inconsistent ranks" in out.getvalue()) != spread, out.getvalue()
        try:
            problem.check_totals(out_stream=None, raise_on_error=True)
        except distop.DerivativeCheckError as err:
            assert "('y', 'x')" in str(err), str(err)
        else:
            raise AssertionError("no DerivativeCheckError")


def test_objective_using_an_operator_on_one_rank_only():
    a_r = np.arange(9.0).reshape(3, 3) + rank
    a = sum(np.arange(9.0).reshape(3, 3) + r for r in range(size))
    x = np.array([0.5, -1.0, 2.0])
    op = DistributedMatvec(a_r)
    exact = 2 * (a @ x) @ a

    # Naive: an objective computed on rank 0 only is rank-local, not replicated: a clear
    # error from the replicated-value checks, never a hang.
    naive = distop.Problem(lambda x: {"f": jnp.where(rank == 0, jnp.sum(op(x) ** 2), 0.0)},
                           {"x": x}, check_replicated=True)
    if size > 1:
        raises(distop.DistopError, "'f': rank 1 differs from rank 0", naive.run)
        raises(distop.DistopError, "replicated values differ",
               lambda: naive.check_totals(out_stream=None))

    # Exact: enter rank-dependent code through RankLocal, leave it through AllreduceSum.
    def model(x):
        y = distop.RankLocal()(op(x))
        return {"f": distop.AllreduceSum()(jnp.where(rank == 0, jnp.sum(y ** 2), 0.0))}

    problem = distop.Problem(model, {"x": x})
    all_close_everywhere(comm, problem.run()["f"], np.sum((a @ x) ** 2))
    all_close_everywhere(comm, problem.compute_totals()["f", "x"][0], exact)
    check(problem)


class Shift(distop.DistributedOperator):
    """y = x + the sum of every rank's x: distributed blocks in and out."""

    forward_collectives = vjp_collectives = ("Allreduce",)

    def forward(self, comm, x):
        total = np.empty(())
        comm.Allreduce(np.array(x.sum()), total, op=MPI.SUM)
        return x + total

    def vjp(self, comm, y_bar, x):
        total = np.empty(())
        comm.Allreduce(np.array(y_bar.sum()), total, op=MPI.SUM)
        return y_bar + total


def test_a_result_read_on_some_ranks_only_is_made_on_every_rank():
    # JAX's reverse sweep of cumprod and where reads y on a block of several rows, not
    # on one of one row or none: every rank must still make the forward call (and fuse
    # its calls alike), or their collectives would not match.
    shift = Shift()

    def model(x):
        y = shift(x)
        return {"f": jnp.cumprod(y), "g": jnp.where(y > 0, y, 0.0)}

    x = mine(np.linspace(-1.0, 2.0, N))
    totals = {}
    for backend in ("lean", "io_callback"):
        problem = distop.Problem(model, {"x": x}, distributed={"x", "f", "g"},
                                 backend=backend)
        assert all(e.made for e in problem.schedule), problem.schedule
        totals[backend] = problem.compute_totals()
        check(problem)
    for key, block in totals["lean"].items():
        np.testing.assert_allclose(block, totals["io_callback"][key], rtol=1e-12, atol=0)


def test_calls_kept_for_other_ranks_keep_what_they_read():
    # Y's result feeds X only on ranks with rows; X's result is read only on ranks
    # without: a rank with rows could drop both, one without only Y, but X stays (some
    # rank reads it), so Y stays too. The ranks agree after a second round. (No vjp:
    # the reverse sweeps would differ between the ranks; the run program does not.)
    class Forward(distop.DistributedOperator):
        forward_collectives = ("Allreduce",)
        forward = Shift.forward

    y_op, x_op = Forward(), Forward()

    def model(x):
        rows = x.shape[0] > 0
        y = y_op(x)
        z = x_op(y if rows else x)
        return {"g": 2 * x if rows else z}

    x = mine(np.arange(float(N)))
    problem = distop.Problem(model, {"x": x}, distributed={"x", "g"})
    # (in one process, or where every rank has rows, nothing reads either result)
    made = 0 in COUNTS
    assert [e.made for e in problem.schedule if e.phase == "forward"] == [made, made], (
        problem.schedule)
    np.testing.assert_array_equal(problem.run()["g"], 2 * x if len(x) else x)


class Counted(distop.DistributedOperator):
    """y = 2 x; counts the calls of each phase (batched methods)."""

    calls: list
    vjp_collectives = ("Allreduce",)
    batched_forward = True
    batched_vjp = True

    def forward(self, comm, x, *, batched=False):
        self.calls.append(("forward", x.shape))
        return 2 * x

    def vjp(self, comm, y_bar, x, *, batched=False):
        self.calls.append(("vjp", y_bar.shape))
        out = np.empty_like(y_bar)
        comm.Allreduce(2 * y_bar / size, out, op=MPI.SUM)
        return out


def test_of_subsets_still_run_every_vjp_and_fd_is_one_batched_call():
    a, b = Counted([]), Counted([])
    problem = distop.Problem(lambda x: {"u": jnp.sum(a(x)), "v": jnp.sum(b(x) ** 2)},
                             {"x": np.ones(3)})
    b.calls.clear()
    J = problem.compute_totals(of="u")  # b's outputs do not reach `of`
    all_close_everywhere(comm, J["u", "x"], 2 * np.ones((1, 3)))
    assert ("vjp", (1, 3)) in b.calls, b.calls  # ... but its VJP ran, with zeros
    a.calls.clear()
    problem.check_totals(out_stream=None)
    batched = [c for c in a.calls if c[0] == "forward" and len(c[1]) == 2]
    # central differences at the step and twice it: every perturbation of x (2 x 2 x 3
    # rows) in ONE batched call
    assert batched == [("forward", (12, 3))], a.calls


# -- bad input ------------------------------------------------------------------------
def raises(exc, text, fn):
    try:
        fn()
    except exc as err:
        assert text in str(err), str(err)
    else:
        raise AssertionError(f"no {exc.__name__}")


def test_a_replicated_input_added_into_distributed_computation_needs_no_rank_local():
    # xs is replicated, xd and y distributed: where xs meets xd, each rank's cotangent
    # of xs is its share, and the kinds sum the shares, as RankLocal would
    xd, xs = mine(np.arange(N, dtype=float)), np.array([1.0, 2.0])
    problem = distop.Problem(lambda xd, xs: {"y": xd ** 2 + jnp.sum(xs ** 2),
                                             "s": distop.AllreduceSum()(jnp.sum(xd) * xs[0])},
                             {"xd": xd, "xs": xs}, distributed={"xd", "y"})

    def with_rank_local(xd, xs):  # (explicit: not summed twice)
        xl = distop.RankLocal()(xs)
        return {"y": xd ** 2 + jnp.sum(xl ** 2), "s": distop.AllreduceSum()(jnp.sum(xd) * xl[0])}

    explicit = distop.Problem(with_rank_local, {"xd": xd, "xs": xs}, distributed={"xd", "y"})
    for p in (problem, explicit):
        for direction in ("rev", "fwd"):
            J = p.compute_totals(direction=direction)
            all_close_everywhere(comm, J["y", "xs"], np.tile([[2.0, 4.0]], (N, 1)))
            all_close_everywhere(comm, J["s", "xs"], [[np.arange(N).sum(), 0.0]])
        # (in the local format each rank keeps its own rows of y)
        all_close_everywhere(comm, p.compute_totals(return_format="local")["y", "xs"],
                             np.tile([[2.0, 4.0]], (COUNTS[rank], 1)))
        p.check_totals(raise_on_error=True, out_stream=None)


def test_bad_input_raises_on_every_rank():
    if size > 1:
        x = np.ones((2, 3 if rank == 0 else 4))
        raises(distop.DistopError, "different shapes",
               lambda: distop.Problem(lambda x: {"y": x}, {"x": x}, distributed={"x"}))
        problem = distop.Problem(lambda p: {"y": p * 2.0}, {"p": np.ones(2)},
                                 check_replicated=True)
        raises(distop.DistopError, f"'p': rank {size - 1} differs from rank 0",
               lambda: problem.run(p=np.ones(2) * (1 + (rank == size - 1))))
        # made at a point that differs between ranks: refused as it is made
        raises(distop.DistopError, f"'p': rank {size - 1} differs from rank 0",
               lambda: distop.Problem(lambda p: {"y": p * 2.0},
                                      {"p": np.ones(2) * (1 + (rank == size - 1))}))
        # moved there by run (which checks only with check_replicated=True)
        differing = distop.Problem(lambda p: {"y": p * 2.0}, {"p": np.ones(2)})
        differing.run(p=np.ones(2) * (1 + (rank == size - 1)))
        raises(distop.DistopError, "replicated values differ",
               lambda: differing.check_totals(out_stream=None))
        class Ragged(distop.DistributedOperator):  # axis 1 differs between ranks
            def output_spec(self, x):
                return jax.ShapeDtypeStruct((2, 1 + rank), x.dtype)

            def forward(self, comm, x):
                return np.zeros((2, 1 + rank))

        raises(distop.ScheduleMismatchError, "only axis 0 may be distributed",
               lambda: distop.Problem(lambda x: {"y": jnp.sum(Ragged()(x))}, {"x": np.ones(2)}))
    problem = distop.Problem(lambda x: {"y": jnp.sum(x)}, {"x": np.ones(2)})
    raises(ValueError, "no input named 'z'", lambda: problem.check_totals(wrt="z"))
    raises(ValueError, "no output named 'q'", lambda: problem.compute_totals(of="q"))
    raises(ValueError, "no input or output named ['w']",
           lambda: distop.Problem(lambda x: {"y": x}, {"x": np.ones(2)}, distributed={"w"}))


def test_shard_gives_every_rank_the_same_count():
    for n in (1, 5, 13):
        idx, w = distop.shard(n)
        every = comm.allgather((idx, w))
        assert len({len(i) for i, _ in every}) == 1
        real = np.concatenate([i[w > 0] for i, w in every])
        assert sorted(real.tolist()) == list(range(n))
        weighted = comm.allreduce(float(np.sum(w * np.arange(n)[idx])))
        assert weighted == n * (n - 1) / 2


def test_shard_takes_the_counts_it_is_given_a_rank_may_take_none():
    counts = {1: [10], 2: [7, 0], 4: [4, 3, 3, 0]}.get(size, [1] * (size - 1) + [0])
    n = sum(counts)
    idx, w = distop.shard(n, comm, counts=counts)
    assert len(idx) == len(w) == max(counts)  # (the same on every rank)
    assert idx[w > 0].tolist() == list(range(sum(counts[:rank]), sum(counts[:rank + 1])))
    assert sorted(sum(comm.allgather(idx[w > 0].tolist()), [])) == list(range(n))
    for bad in ([n] * (size + 1), [n + 1] + [0] * (size - 1), [n + 1, -1] + [0] * (size - 2)):
        raises(ValueError, "non-negative integers (one per rank) summing to",
               lambda bad=bad: distop.shard(n, comm, counts=bad))
    if size > 1:  # counts that differ between ranks, or are wrong on one, raise on every rank
        mine = [n] + [0] * (size - 1) if rank == 0 else [0] * (size - 1) + [n]
        raises(ValueError, "the ranks passed different counts",
               lambda: distop.shard(n, comm, counts=mine))
        mine = [n + 1] + [0] * (size - 1) if rank == size - 1 else counts
        raises(ValueError, "summing to", lambda: distop.shard(n, comm, counts=mine))


def test_a_loop_over_uneven_and_empty_blocks_gives_what_the_calls_one_by_one_give():
    from distop._compiler.stages import loops
    from distop._hostcalls import ffi as _ffi

    rng = np.random.default_rng(2)
    xg = rng.standard_normal(N)
    n = loops.REPEATS + 4

    def model(x):
        for _ in range(n):  # one loop, on every rank
            s = distop.RankLocal()(distop.AllreduceSum()(jnp.sum(x * x)))
            x = jnp.sin(x) * (1.0 + 0.01 * s)
        return {"f": distop.AllreduceSum()(jnp.sum(x)), "x": x}

    def make():
        problem = distop.Problem(model, {"x": mine(xg)}, distributed={"x"})
        return problem, problem.run(), problem.compute_totals()

    before = set(_ffi._sites)
    problem, values, totals = make()
    assert loops_since(before)
    _, flat_values, flat_totals = without_loops(make)
    for key in flat_values:
        all_close_everywhere(comm, values[key], flat_values[key], rtol=1e-13)
    for key in flat_totals:
        all_close_everywhere(comm, totals[key], flat_totals[key], rtol=1e-13)
    check(problem)


def test_a_forgotten_distributed_declaration_raises_as_the_problem_is_made():
    halo, total = distop.HaloExchange(), distop.AllreduceSum()

    def stencil(u):
        h = halo(u)
        return h[:-2] - 2 * h[1:-1] + h[2:]

    def scalar(u):
        return {"f": total(jnp.sum(stencil(u) ** 2))}

    block = np.linspace(0.0, 1.0, 4) + rank  # equal block sizes, other values per rank
    if size > 1:
        # a distributed input left out of distributed=
        raises(distop.DistopError, "'u': rank 1 differs from rank 0",
               lambda: distop.Problem(scalar, {"u": block}))
        # ... at an initial point the same everywhere, which no comparison can see: the
        # halo exchange is given copies of one value
        raises(distop.KindError, "HaloExchange combines each rank's own block, and is "
               "given a value that is the same on every rank: it depends only on inputs "
               "taken as replicated (u)", lambda: distop.Problem(scalar, {"u": np.zeros(4)}))
        # a distributed output left out of distributed=
        raises(distop.KindError, "outputs ['v'] vary between ranks",
               lambda: distop.Problem(lambda u: {"v": stencil(u)}, {"u": block},
                                      distributed={"u"}))
    # no false alarm: each declared, a replicated input equal everywhere, and one that
    # differs in its last bits only (as values a rank computes itself may)
    declared = distop.Problem(lambda u, p: {"v": stencil(u) * p[0], "f": scalar(u)["f"]},
                              {"u": block, "p": np.array([1.0, 2.0]) + rank * np.finfo(float).eps},
                              distributed={"u", "v"})
    J = declared.compute_totals("f", "u")["f", "u"]
    assert J.shape == (1, 4 * size)
    reduced = distop.Problem(scalar, {"u": block}, distributed={"u"})
    all_close_everywhere(comm, reduced.run()["f"], declared.run()["f"])


class ScaledVjp(distop.DistributedOperator):
    """y = (sum over ranks of A_r) x, its vjp scaled by `factor` (1: right)."""

    A: np.ndarray
    factor: float = 1.0
    forward_collectives = vjp_collectives = ("Allreduce",)

    def output_spec(self, x):
        return jax.ShapeDtypeStruct((self.A.shape[0],), x.dtype)

    def forward(self, comm, x):
        y = np.empty(self.A.shape[0], x.dtype)
        comm.Allreduce((self.A @ x).astype(x.dtype), y, op=MPI.SUM)
        return y

    def vjp(self, comm, y_bar, x):
        x_bar = np.empty(self.A.shape[1], y_bar.dtype)
        comm.Allreduce((self.A.T @ y_bar).astype(y_bar.dtype), x_bar, op=MPI.SUM)
        return x_bar * np.asarray(self.factor, y_bar.dtype)


def test_check_totals_fails_a_planted_vjp_bug_in_float32_and_float64_by_default():
    w = np.array([1.0, -2.0, 0.5])
    for dtype in (np.float32, np.float64):
        A = np.random.default_rng([8, rank]).standard_normal((3, 4)).astype(dtype)
        for factor in (1.0, 1.1, 1.3, 0.7):
            op = ScaledVjp(A, factor)

            def model(x, op=op):
                y = op(x)
                return {"f": jnp.dot(w.astype(x.dtype), y), "g": jnp.sum(y ** 2)}

            problem = distop.Problem(model, {"x": np.linspace(0.0, 1.0, 4).astype(dtype)})
            results = problem.check_totals(out_stream=None)
            assert all(r.ok for r in results.values()) == (factor == 1.0), (dtype, factor)
    # float32 at float64's step: too inexact to judge, so it fails and says which step
    out = io.StringIO()
    problem = distop.Problem(lambda x: {"g": jnp.sum(ScaledVjp(A.astype(np.float32))(x) ** 2)},
                             {"x": np.linspace(0.0, 1.0, 4).astype(np.float32)})
    results = problem.check_totals(step=1e-6, out_stream=out)
    assert not results["g", "x"].ok
    if rank == 0:
        assert "cannot be judged, and fail" in out.getvalue() and "About step=" in \
            out.getvalue(), out.getvalue()


def test_tree_inputs_replicated_and_distributed():
    # the parameters a tree of replicated arrays, the data a tree of each rank's rows
    # (uneven, none on one rank from 2 ranks on)
    rows = 3 if rank != 1 else 0
    rng = np.random.default_rng(rank)
    batch = {"X": rng.standard_normal((rows, 2)), "y": rng.standard_normal(rows)}
    params = {"w": np.array([0.5, -1.0]), "b": np.array(0.25)}
    total = distop.AllreduceSum()

    def model(params, batch):
        return {"loss": total(jnp.sum((batch["X"] @ params["w"] + params["b"]
                                       - batch["y"]) ** 2))}

    problem = distop.Problem(model, {"params": params, "batch": batch},
                             distributed=["batch"])
    J = problem.compute_totals("loss", "params")
    X = np.concatenate(comm.allgather(batch["X"]))
    y = np.concatenate(comm.allgather(batch["y"]))
    want = jax.grad(lambda p: jnp.sum((X @ p["w"] + p["b"] - y) ** 2))(params)
    all_close_everywhere(comm, J["loss", "params['w']"][0], want["w"])
    all_close_everywhere(comm, J["loss", "params['b']"][0], [want["b"]])
    local = problem.compute_totals("loss", "batch", return_format="local")
    assert local["loss", "batch['X']"].shape == (1, rows * 2)
    problem.check_totals(raise_on_error=True, out_stream=None)
