"""Kinds inferred when a model is traced: a replicated value's cotangent is summed over
the ranks where it meets varying data, with no RankLocal, in a Problem and through
`with_kinds` in plain JAX; inside scan, cond, vmap and checkpoint bodies."""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, all_close_everywhere
from jax import lax
from mpi4py import MPI

import distop

sys.path.insert(0, str(ROOT / "benchmarks"))
import mpi_counts  # noqa: E402

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
X_LOCAL = np.arange(3.0) + 3 * rank  # this rank's data
X_SUM = sum(np.arange(3.0) + 3 * r for r in range(size))
total = distop.AllreduceSum()


def test_the_data_parallel_gradient_is_the_sum_over_ranks_in_plain_jax():
    def loss(w):
        return total(jnp.sum(w * X_LOCAL))

    grad = jax.jit(jax.grad(distop.with_kinds(loss)))(jnp.ones(3))
    all_close_everywhere(comm, grad, X_SUM)
    if size > 1:  # (without the transform each rank gets its own share, and a warning)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", distop.KindWarning)
            np.testing.assert_allclose(jax.jit(jax.grad(loss))(jnp.ones(3)), X_LOCAL)


def test_plain_jax_differentiating_a_collective_warns_once(monkeypatch):
    from distop._operators import primitive

    monkeypatch.setattr(primitive, "_warned_outside_kinds", False)

    def loss(w):
        return total(jnp.sum(w * X_LOCAL))

    jax.grad(distop.with_kinds(loss))(jnp.ones(3))  # (inside with_kinds: no warning)
    distop.Problem(lambda w: {"f": loss(w)}, {"w": np.ones(3)}).compute_totals()  # (nor here)
    if size == 1:  # (a sum over one rank: nothing to warn of)
        jax.grad(loss)(jnp.ones(3))
        return
    with pytest.warns(distop.KindWarning, match=r"AllreduceSum: JAX differentiates it "
                      r"outside distop.with_kinds and a Problem.*category=distop.KindWarning"):
        jax.grad(loss)(jnp.ones(3))
    jax.grad(loss)(jnp.ones(3))  # (once per process: warnings are errors here)


def test_with_kinds_refuses_data_taken_as_replicated_that_reach_a_sum():
    X = np.random.default_rng(rank).standard_normal((5 + rank, 3))  # uneven, per rank
    y = np.linspace(0.0, 1.0, 5 + rank)

    def loss(w, X, y):
        return total(jnp.sum((X @ w - y) ** 2))

    w = jnp.array([0.5, -1.0, 2.0])
    if size > 1:
        with pytest.raises(distop.KindError, match=r"with_kinds\(loss\): AllreduceSum combines "
                           r"each rank's own block.*arguments taken as replicated \(w, X, "
                           r"y\).*name it in with_kinds\(\.\.\., distributed=\.\.\.\)"):
            jax.jit(jax.grad(distop.with_kinds(loss)))(w, X, y)
    grad = jax.jit(jax.grad(distop.with_kinds(loss, distributed=("X", "y"))))(w, X, y)
    full_X, full_y = np.concatenate(comm.allgather(X)), np.concatenate(comm.allgather(y))
    all_close_everywhere(comm, grad, jax.grad(lambda w: jnp.sum((full_X @ w - full_y) ** 2))(w))
    # copies summed on purpose: through RankLocal, as the error says
    counted = distop.with_kinds(lambda w: total(distop.RankLocal()(jnp.sum(w))))(w)
    all_close_everywhere(comm, counted, size * 1.5)


def test_a_training_step_with_value_and_grad_and_a_distributed_argument():
    def loss(params, batch):
        pred = batch @ params["w"] + params["b"]
        return total(jnp.sum(pred ** 2)) + 0.5 * jnp.sum(params["w"] ** 2)  # + a prior

    batch = np.random.default_rng(rank).standard_normal((rank + 1, 3))  # uneven
    params = {"w": jnp.array([0.1, -0.2, 0.3]), "b": jnp.array(0.5)}
    step = jax.jit(jax.value_and_grad(distop.with_kinds(loss, distributed="batch")))
    value, grad = step(params, batch)
    full = np.concatenate(comm.allgather(batch))  # one process, the whole batch
    want_value, want = jax.value_and_grad(
        lambda p: jnp.sum((full @ p["w"] + p["b"]) ** 2) + 0.5 * jnp.sum(p["w"] ** 2))(params)
    all_close_everywhere(comm, value, want_value)
    all_close_everywhere(comm, grad["w"], want["w"])
    all_close_everywhere(comm, grad["b"], want["b"])


def test_a_closed_over_rank_dependent_constant_in_a_problem():
    problem = distop.Problem(lambda w: {"loss": total(jnp.sum(w * X_LOCAL))}, {"w": np.ones(3)})
    for direction in ("rev", "fwd"):
        all_close_everywhere(comm, problem.compute_totals(direction=direction)["loss", "w"],
                             [X_SUM])
    problem.check_totals(raise_on_error=True, out_stream=None)


def test_rank_local_given_explicitly_is_not_summed_twice():
    def model(w):
        local = distop.RankLocal()(w)
        return {"a": total(jnp.sum(local * X_LOCAL)), "b": total(jnp.sum(w * X_LOCAL))}

    J = distop.Problem(model, {"w": np.ones(3)}).compute_totals()
    all_close_everywhere(comm, J["a", "w"], [X_SUM])
    all_close_everywhere(comm, J["b", "w"], [X_SUM])


def test_a_replicated_term_beside_the_varying_one_is_not_summed():
    # w ** 2 is the same on every rank: its cotangent is whole, only w * x's is a share
    problem = distop.Problem(lambda w: {"f": total(jnp.sum(w * X_LOCAL)) + jnp.sum(w ** 2)},
                             {"w": np.array([1.0, 2.0, 3.0])})
    all_close_everywhere(comm, problem.compute_totals()["f", "w"],
                         [X_SUM + 2 * np.array([1.0, 2.0, 3.0])])


def model_with(body):
    """A Problem of `body(w, x)` with x distributed, and its totals against one process
    computing the same on the whole x (every rank's block, gathered)."""
    x = X_LOCAL.reshape(1, 3) * np.array([[1.0], [2.0]])[: 1 + rank % 2]  # uneven rows
    problem = distop.Problem(lambda w, x: {"f": total(body(w, x))},
                             {"w": np.array([0.5, -1.0, 2.0]), "x": x}, distributed="x")
    whole = [np.asarray(b) for b in comm.allgather(x)]
    want = jax.grad(lambda w: sum(body(w, jnp.asarray(b)) for b in whole))(
        jnp.array([0.5, -1.0, 2.0]))
    for direction in ("rev", "fwd"):
        all_close_everywhere(comm, problem.compute_totals(direction=direction)["f", "w"],
                             [want])
    return problem


def test_scan_bodies_sum_once_after_the_sweep():
    def body(w, x):
        return lax.scan(lambda c, row: (c + jnp.sum(jnp.sin(w) * row), None), 0.0, x)[0]

    problem = model_with(body)
    # the shares of w meet in one Allreduce after the reverse sweep, not one per step
    sums = [e for e in problem.schedule if e.operator == "AllreduceSum"
            and e.input_shapes == ((3,),)]
    assert len(sums) == (size > 1) and all("scan" not in e.context for e in sums), sums


def test_cond_bodies():
    def body(w, x):
        return lax.cond(jnp.sum(w) > 0, lambda v: jnp.sum(v * x), lambda v: jnp.sum(v ** 2 * x), w)

    model_with(body)


def test_vmap_bodies():
    def body(w, x):
        return jnp.sum(jax.vmap(lambda row: jnp.dot(w, row) ** 2)(x))

    model_with(body)


def test_checkpoint_bodies():
    def body(w, x):
        return jax.checkpoint(lambda v: jnp.sum(jnp.tanh(v * x)))(w)

    model_with(body)


class Opaque(distop.DistributedOperator):
    """A rank's own scaling of x, declaring no kinds."""

    def forward(self, comm, x):
        return x * (comm.Get_rank() + 1.0)

    def vjp(self, comm, y_bar, x):
        return y_bar * (comm.Get_rank() + 1.0)


class Declared(Opaque):
    input_kinds = "varying"  # (its vjp returns this rank's share)
    output_kinds = "varying"


class Twice(distop.DistributedOperator):
    """2 x, the same on every rank, declaring no kinds."""

    def forward(self, comm, x):
        return 2.0 * x

    def vjp(self, comm, y_bar, x):
        return 2.0 * y_bar


@pytest.mark.skipif(size == 1, reason="one rank: a sum over one rank is the identity")
def test_an_undeclared_operator_at_a_place_raises_when_the_problem_is_made():
    def model(w):
        return {"f": total(jnp.sum(Opaque()(w) * w))}

    with pytest.raises(distop.KindError, match=r"Opaque declares no output_kinds.*`mul`.*"
                       r"test_kinds.py.*output_kinds = 'replicated' or 'varying'"):
        distop.Problem(model, {"w": np.ones(3)})
    # declared, the same model is decided: d/dw sum_r (r + 1) w^2 = 2 w sum_r (r + 1)
    J = distop.Problem(lambda w: {"f": total(jnp.sum(Declared()(w) * w))},
                       {"w": np.ones(3)}).compute_totals()
    all_close_everywhere(comm, J["f", "w"], [np.full(3, 2.0 * sum(range(1, size + 1)))])
    # an undeclared output that meets no varying data keeps working as before
    J = distop.Problem(lambda w: {"f": jnp.sum(Twice()(w) * w)}, {"w": np.ones(3)})
    all_close_everywhere(comm, J.compute_totals()["f", "w"], [np.full(3, 4.0)])


def test_compute_totals_makes_no_collective_of_its_own_for_the_kinds():
    counted = mpi_counts.CountingComm(comm.Dup())
    try:
        add = distop.AllreduceSum(comm=counted)
        problem = distop.Problem(lambda w: {"loss": add(jnp.sum(w * X_LOCAL))},
                                 {"w": np.ones(3)}, comm=counted)
        problem.compute_totals()  # (the first call checks the totals once)
        with mpi_counts.counting() as tally:
            problem.compute_totals()
        own = {} if size == 1 else {"Allreduce": 1}  # (the call's agreement only)
        assert tally.calls.get("own", {}) == own, tally
        if size > 1:  # the summed cotangent of w (the forward call is left out)
            assert tally.calls["operator"] == {"Allreduce": 1}, tally
    finally:
        counted.Free()


def _with_rank_local(fn, names):
    """`fn(**inputs)` with the replicated inputs `names` passed through RankLocal first."""
    def model(**inputs):
        return fn(**{k: distop.RankLocal()(v) if k in names else v for k, v in inputs.items()})
    return model


# Models in the manner of OpenMDAO's distributed-derivative tests: a replicated input
# added or multiplied straight into distributed computation (x distributed, a and b
# replicated), with distributed and replicated outputs. (Every use of a and b meets x:
# the RankLocal version is then exact.)
DISTRIBUTED_MODELS = {
    "added": lambda x, a, b: {"y": x * a[0] + b[1], "s": total(jnp.sum(x ** 2) * b[0])},
    "scaled": lambda x, a, b: {"y": jnp.sin(x) * jnp.sum(a * b),
                               "s": total(jnp.sum(jnp.cos(x * a[1])))},
    "broadcast": lambda x, a, b: {"y": x[:, None] * a[None, :] + b[None, :],
                                  "s": total(jnp.sum(x * a[0]))},
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTED_MODELS))
def test_replicated_inputs_in_distributed_computation_match_rank_local(name):
    fn = DISTRIBUTED_MODELS[name]
    x = np.linspace(0.1, 0.9, (3, 0, 2, 1)[rank % 4] if size > 1 else 4) + rank
    point = {"x": x, "a": np.array([0.7, -1.3]), "b": np.array([0.2, 0.5])}
    inferred = distop.Problem(fn, point, distributed={"x", "y"})
    explicit = distop.Problem(_with_rank_local(fn, {"a", "b"}), point, distributed={"x", "y"})
    for options in ({}, {"direction": "fwd"}, {"return_format": "local"}):
        got, want = inferred.compute_totals(**options), explicit.compute_totals(**options)
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-13, atol=1e-15,
                                       err_msg=f"{key} {options}")
    inferred.check_totals(raise_on_error=True, out_stream=None)


@pytest.mark.skipif(size == 1, reason="one rank: nothing is inferred")
def test_with_kinds_refuses_arguments_it_cannot_trace_instead_of_skipping_the_sums():
    loss = distop.with_kinds(lambda w, act: total(jnp.sum(act(w) * X_LOCAL)))
    with pytest.raises(distop.DistopError, match="(?s)with_kinds: <lambda> could not be traced.*"
                       "functools.partial"):
        loss(jnp.ones(3), jnp.tanh)


def test_a_constant_an_inner_jit_closes_over_is_compared_too():
    inner = jax.jit(lambda w: w * X_LOCAL)  # (the inner jit keeps X_LOCAL as its own)
    grad = jax.jit(jax.grad(distop.with_kinds(lambda w: total(jnp.sum(inner(w))))))(jnp.ones(3))
    all_close_everywhere(comm, grad, X_SUM)


def test_with_kinds_around_the_gradient_says_where_it_belongs():
    X = np.random.default_rng(rank).standard_normal((4, 3))

    def loss(w, X):
        return total(jnp.sum((X @ w) ** 2))

    w = jnp.ones(3)
    for wrong in (jax.grad(loss), jax.jit(jax.grad(loss))):
        if size == 1:  # (one rank: nothing to sum, nothing placed)
            distop.with_kinds(wrong, distributed="X")(w, X)
            continue
        with pytest.raises(distop.DistopError, match=r"AllreduceSum.vjp: the function "
                           r"differentiates an operator itself.*jax.grad\(distop.with_kinds"
                           r"\(loss, distributed=...\)\), not distop.with_kinds\(jax.grad"):
            distop.with_kinds(wrong, distributed="X")(w, X)
