"""The walk of a traced function's kinds, in one process: which operands are places,
what a loop varies once, and where an undeclared operator output raises (the sums
themselves run under MPI: tests/mpi/test_kinds.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import distop
from distop._inference.analysis import (
    MIXED,
    REPLICATED,
    UNKNOWN,
    VARYING,
    Info,
    analyse,
)

R, V = Info(REPLICATED, True), Info(VARYING, True)


def walk(fn, *kinds):
    """**Returns:** (output infos, plan) of `fn` traced on float vectors of 3, its
    arguments of the given kinds."""
    closed = jax.make_jaxpr(fn)(*[jnp.ones(3)] * len(kinds))
    return closed.jaxpr, *analyse(closed.jaxpr, kinds, [Info(REPLICATED)] * len(closed.consts))


def places(jaxpr, plan):
    """**Returns:** (primitive, operand index) of every place of the top level."""
    return [(e.primitive.name, i) for e, s in zip(jaxpr.eqns, plan.steps) for i in s.vary]


def test_a_replicated_value_meeting_a_varying_one_is_a_place():
    jaxpr, outs, plan = walk(lambda w, x: (w * x, w * 2.0), R, V)
    assert places(jaxpr, plan) == [("mul", 0)] and plan.varies
    assert [o.kind for o in outs] == [VARYING, REPLICATED]


def test_values_alike_everywhere_need_nothing():
    jaxpr, outs, plan = walk(lambda w, x: jnp.sin(w) * x, R, R)
    assert not plan.varies and outs[0].kind == REPLICATED


def test_a_varying_input_of_an_operator_is_a_place_and_its_output_is_declared():
    jaxpr, outs, plan = walk(lambda w: distop.AllreduceSum()(w), R)
    assert places(jaxpr, plan) == [("distop_host_call", 0)] and outs[0].kind == REPLICATED
    jaxpr, outs, plan = walk(lambda w: distop.RankLocal()(w), R)
    assert not plan.varies and outs[0].kind == VARYING  # (RankLocal sums itself)


def test_a_loop_constant_met_only_at_places_is_varied_once_before_the_loop():
    def body(w, x):  # w reaches x through sin: replicated computation only x reads
        return lax.scan(lambda c, row: (c + jnp.sum(jnp.sin(w) * row), None), 0.0,
                        x[None])[0]

    jaxpr, outs, plan = walk(body, R, V)
    scan = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"][0]
    assert plan.steps[scan].vary == (0,)  # w, before the loop
    assert not plan.steps[scan].subs[0].varies  # nothing inside it
    assert outs[0].kind == VARYING


def test_a_loop_constant_used_alike_everywhere_too_stays_inside():
    def body(w, x):  # a varying carry and a replicated one
        def step(c, row):
            return (c[0] + jnp.sum(w * row), c[1] + jnp.sum(w ** 2)), None
        return lax.scan(step, (0.0, 0.0), x[None])[0]

    jaxpr, outs, plan = walk(body, R, V)
    scan = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"][0]
    assert plan.steps[scan].vary == () and plan.steps[scan].subs[0].varies
    assert [o.kind for o in outs] == [VARYING, REPLICATED]


def test_a_carry_that_becomes_varying_stays_varying():
    def body(w, x):
        return lax.fori_loop(0, 3, lambda i, c: c * w + x, jnp.zeros(3))

    _, outs, _ = walk(body, R, V)
    assert outs[0].kind == VARYING


def test_a_branch_taken_by_rank_makes_its_operands_places():
    def body(w, x):
        return lax.cond(x[0] > 0, lambda v: v * 2.0, lambda v: v, w)

    jaxpr, outs, plan = walk(body, R, V)
    assert ("cond", 1) in places(jaxpr, plan) and outs[0].kind == VARYING


class Undeclared(distop.DistributedOperator):
    def forward(self, comm, x):
        return x


def test_an_undeclared_output_is_unknown_then_mixed_then_refused_at_varying_data():
    _, outs, _ = walk(lambda w: Undeclared()(w), R)
    assert outs[0].kind == UNKNOWN
    _, outs, _ = walk(lambda w: Undeclared()(w) * w, R)
    assert outs[0].kind == MIXED  # harmless on its own
    with pytest.raises(distop.KindError, match=r"Undeclared declares no output_kinds.*"
                       r"`mul`.*test_kinds.py.*`add`.*Declare output_kinds"):
        walk(lambda w, x: Undeclared()(w) * w + x, R, V)
    with pytest.raises(distop.KindError, match="`distop_host_call`"):
        walk(lambda w: distop.AllreduceSum()(Undeclared()(w) * w), R)


def test_declarations_are_checked():
    class Wrong(Undeclared):
        output_kinds = ("replicated", "varying")  # (one output)

    with pytest.raises(TypeError, match="Wrong.output_kinds declares 2 kinds"):
        walk(lambda w, x: Wrong()(w) * x, R, V)

    class Unknown(Undeclared):
        output_kinds = "sometimes"

    with pytest.raises(TypeError, match="'replicated', 'varying' or None"):
        walk(lambda w: Unknown()(w), R)


def test_on_one_rank_with_kinds_is_the_function_itself():
    f = distop.with_kinds(lambda w: distop.AllreduceSum()(jnp.sum(w * np.arange(3.0))))
    np.testing.assert_allclose(jax.grad(f)(jnp.ones(3)), np.arange(3.0))
    assert distop.Kind("varying") is distop.Kind.VARYING
