"""The program passes one by one on small traced programs, and the driver's order and
exchanges (other ranks simulated by the exchange)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import RowScale
from jax.extend.core import jaxpr_as_fun

from distop._compiler import pipeline
from distop._compiler.jaxprs import chained, lean_calls
from distop._compiler.passes import base, fold, fuse, identity, rows, unused
from distop._hostcalls import sessions as _sessions
from distop._hostcalls.fused import FusedCall

X = np.array([0.5, 2.0])
TOKEN = jax.ShapeDtypeStruct((), np.float64)


def lean(fn, *args):
    """`jax.make_jaxpr` of `fn(session, *args)` on the lean path: the token enters first
    and leaves last, as in a `Problem`'s programs."""
    def traced(token, *args):
        with _sessions.tracing(token) as session:
            out = fn(session, *args)
        return (*out, session.token)

    return jax.make_jaxpr(traced)(TOKEN, *args)


def sweep(f, seeds, session, x):
    """The reverse sweep of `f` at `x` over `seeds`, one row each, as `Problem` traces
    it: the token leaves `jax.vjp` and the `vmap` as an output of its own."""
    (_, session.token), pullback = jax.vjp(lambda x: (f(x), session.token), x)
    cts, session.token = jax.vmap(lambda s: (pullback((s, jnp.zeros(())))[0], session.token),
                                  out_axes=(0, None))(seeds)
    return (cts,)


def two_sums(x, ops=None):
    """Three outputs: the sums of two operators' values and of `x`."""
    a, b = ops or (RowScale(2.0), RowScale(3.0))
    return jnp.stack([jnp.sum(a(x)), jnp.sum(b(x)), jnp.sum(x)])


def constant_seeds():
    """A lean reverse sweep of one operator over constant seeds nonzero in row 1 only."""
    seeds = np.zeros((3, 2))
    seeds[1] = 1.0
    op = RowScale(2.0)
    return lean(lambda session, x: sweep(op, seeds, session, x), X)


def totals():
    """A lean reverse sweep of `two_sums` over identity seeds, an input (as in
    `compute_totals`)."""
    return lean(lambda session, x, seeds: sweep(two_sums, seeds, session, x), X, np.eye(3))


def run(closed, *args):
    """**Returns:** the results of a lean program but its token, from token 0."""
    return jax.jit(jaxpr_as_fun(closed))(0.0, *args)[:-1]


def names(closed):
    """**Returns:** the primitives of `closed`'s equations, in order."""
    return [e.primitive.name for e in closed.jaxpr.eqns]


def same(a, b):
    """Assert that two sequences of arrays are equal, bit for bit."""
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# -- each pass ------------------------------------------------------------------------
def test_identity_products_go_where_an_input_is_the_identity():
    w = np.arange(12.0).reshape(3, 4)
    closed = jax.make_jaxpr(lambda unit, w: (unit @ w, w.T @ unit))(np.eye(3), w)
    step = identity.DropIdentityProducts()
    proposal = step.analyse(closed, base.Context(identities=(0,)))
    assert proposal == (0,) and step.merge([proposal]) == (0,)
    done = step.apply(closed, step.merge([proposal]))
    assert "dot_general" not in names(done)
    same(jaxpr_as_fun(done)(np.eye(3), w), jaxpr_as_fun(closed)(np.eye(3), w))
    assert step.apply(closed, step.analyse(closed, base.Context())) is closed
    with pytest.raises(ValueError):  # a pass of this rank alone merges one proposal
        step.merge([(0,), (0,)])


def test_fold_computes_what_reads_only_the_identity_inputs():
    def f(unit, x):
        return (jnp.pad(unit[:, 1:], ((0, 0), (1, 0))) @ x,)

    closed = jax.make_jaxpr(f)(np.eye(3), np.ones(3))
    step = fold.FoldKnown()
    done = step.apply(closed, step.merge([step.analyse(closed, base.Context((0,)))]))
    assert "pad" not in names(done) and "slice" not in names(done)
    same(jaxpr_as_fun(done)(np.eye(3), X[[0, 1, 1]]),
         jaxpr_as_fun(closed)(np.eye(3), X[[0, 1, 1]]))
    assert step.apply(closed, step.analyse(closed, base.Context())) is closed


def test_rows_narrow_a_derivative_call_to_its_constant_rows():
    closed = constant_seeds()
    step = rows.KnownRows()
    proposal = step.analyse(closed, base.Context())
    assert proposal == {0: (1, 2)}
    done = step.apply(closed, step.merge([proposal]))
    call = lean_calls(done.jaxpr)[1]
    assert call.batch_shape == (1,) and call.origin.batch_shape == (3,)
    same(run(done, X), run(closed, X))
    # a forward program has no derivative call to narrow
    forward = lean(lambda session, x: (RowScale(2.0)(x),), X)
    assert step.analyse(forward, base.Context()) == {}
    assert step.apply(forward, step.merge([{}])) is forward


def test_rows_merge_takes_the_union_of_the_ranks_rows_for_calls_all_found():
    step = rows.KnownRows()
    assert step.merge([{0: (1, 2)}, {0: (2, 4)}]) == {0: (1, 4)}
    assert step.merge([{0: (0, 0)}, {0: (2, 3)}]) == {0: (2, 3)}  # no rows here
    assert step.merge([{0: (0, 0)}, {0: (0, 0)}]) == {0: (0, 0)}
    assert step.merge([{0: (1, 2), 1: (0, 1)}, {1: (0, 1)}]) == {1: (0, 1)}
    done = step.apply(constant_seeds(), {0: (1, 3)})
    assert lean_calls(done.jaxpr)[1].batch_shape == (2,)


def test_unused_forward_calls_are_dropped():
    closed = constant_seeds()
    step = unused.DropUnused()
    proposal = step.analyse(closed, base.Context())
    assert proposal == (0,)  # the forward call: a reverse sweep reads x, not y
    done = step.apply(closed, step.merge([proposal]))
    assert [c.phase for c in lean_calls(done.jaxpr)] == ["vjp"] and chained(done)
    same(run(done, X), run(closed, X))
    assert step.analyse(closed, base.Context(allowed=frozenset())) == ()
    # a forward program returns what its call makes
    forward = lean(lambda session, x: (RowScale(2.0)(x),), X)
    assert step.analyse(forward, base.Context()) == ()
    assert step.apply(forward, step.merge([()])) is forward


def test_unused_merge_drops_what_every_rank_drops_and_asks_again_until_they_agree():
    step = unused.DropUnused()
    assert step.merge([(0, 2), (0, 2)]) == unused.Drops((0, 2), True)
    decision = step.merge([(0, 1, 2), (1, 2, 3)])
    assert decision == unused.Drops((1, 2), False) and not step.unanimous(decision)
    assert step.again(base.Context(), decision).allowed == {1, 2}
    assert step.shared and step.optimistic


def test_fuse_joins_neighbours_where_every_rank_can():
    closed = unused.drop_calls(totals(), (0, 1))  # the vjps alone, reading x and seeds
    step = fuse.Fuse()
    proposal = step.analyse(closed, base.Context())
    assert proposal == (False, True)
    assert step.analyse(closed, base.Context(fuse=False)) is None
    done = step.apply(closed, step.merge([proposal]))
    (call,) = lean_calls(done.jaxpr)
    assert isinstance(call, FusedCall) and [m.phase for m in call.members] == ["vjp"] * 2
    same(run(done, X, np.eye(3)), run(closed, X, np.eye(3)))
    # another rank that cannot join them, does not fuse, or has another chain
    assert step.merge([(False, True), (False, False)]) == (False, False)
    assert step.apply(closed, (False, False)) is closed
    assert step.merge([(False, True), None]) is None
    assert step.merge([(False, True), (False,)]) is None
    assert step.apply(closed, None) is closed


def test_fused_calls_agree_on_rows_for_the_members_every_rank_proposes():
    closed = unused.drop_calls(totals(), (0, 1))
    fused = fuse.Fuse().apply(closed, (False, True))
    step = fuse.AgreeRows()
    assert step.analyse(fused, base.Context()) == ((),)  # one process: none agrees
    assert step.analyse(closed, base.Context()) == ()  # no fused call
    assert step.merge([((0, 1),), ((1, 0),)]) == ((0, 1),)
    assert step.merge([((0, 1, 2),), ((1, 2),)]) == ((1, 2),)
    assert step.merge([((0, 1),), ()]) is None
    (call,) = fuse.fused_calls(fused)
    assert step.apply(fused, ((0, 1),)) is fused and call.agreeing == (0, 1)
    step.apply(fused, None)
    assert call.agreeing == ()


# -- the driver ------------------------------------------------------------------------
class Ranks:
    """An `exchange` of `lean_program` for this rank and simulated others: `others(what,
    share)` gives the other ranks' shares. Records each exchange's `what`."""

    def __init__(self, others=lambda what, share: []):
        self.others, self.seen = others, []

    def __call__(self, what, thunk, share, steps):
        result = thunk()
        mine = share(result)
        self.seen.append(what.split(": ", 1)[1])
        return result, pipeline.merged(steps, [mine, *self.others(what, mine)])


def lean_totals(exchange, *, fuse=True):
    """**Returns:** (`totals()`, its `lean_program` through `exchange`)."""
    closed = totals()
    found = pipeline.Found(None, {"out": ((3, 2), np.float64)}, closed)
    made = pipeline.lean_program("t", found, exchange=exchange, unit_seeds=(0,),
                                 fuse=fuse, inputs={"x": jax.ShapeDtypeStruct((2,), float)},
                                 specs=(jax.ShapeDtypeStruct((3, 3), float),))
    return closed, made


def test_the_passes_run_in_their_declared_order():
    assert [type(p) for p in pipeline.PASSES] == [
        identity.DropIdentityProducts, fold.FoldKnown, rows.KnownRows, unused.DropUnused,
        fuse.Fuse]
    assert [type(p) for p in pipeline.AFTER_REWRITE] == [fuse.AgreeRows]
    assert [p.shared for p in pipeline.PASSES] == [False, False, True, True, True]


def test_the_driver_rewrites_a_sweep_over_unit_seeds_with_two_exchanges():
    exchange = Ranks()
    closed, made = lean_totals(exchange)
    assert exchange.seen == ["agreeing on the lean path", "rewriting the program"]
    # the seeds folded, the forward calls dropped, each vjp given its one row, and the
    # two fused into one host call
    (call,) = lean_calls(made.closed.jaxpr)
    assert [(m.phase, m.batch_shape) for m in call.members] == [("vjp", (1,))] * 2
    assert made.outputs == {"out": ((3, 2), np.float64)}
    x = np.array([0.5, 2.0])
    same(made.fn(0.0, {"x": x}, np.eye(3))[:-1], run(closed, x, np.eye(3)))
    _, plain = lean_totals(Ranks(), fuse=False)
    assert [c.phase for c in lean_calls(plain.closed.jaxpr)] == ["vjp", "vjp"]


def test_the_driver_agrees_on_the_calls_to_drop_in_rounds():
    def others(what, share):
        if what.endswith("lean path"):  # another rank reads the first forward call
            _, drops, joins = share
            return [({0: (0, 0), 1: (2, 3)}, drops[1:], joins)]
        return [share]

    exchange = Ranks(others)
    _, made = lean_totals(exchange)
    assert exchange.seen == ["agreeing on the lean path", "agreeing on the calls to drop",
                             "rewriting the program"]
    # the first forward call is kept for the other rank; the first vjp gets its one
    # row, the second its row here and the other rank's: its whole batch
    calls = [m for c in lean_calls(made.closed.jaxpr) for m in getattr(c, "members", [c])]
    assert [(c.phase, c.batch_shape) for c in calls] == [("forward", ()), ("vjp", (1,)),
                                                         ("vjp", (3,))]


def test_the_driver_leaves_a_program_with_nothing_to_rewrite_as_traced():
    closed = lean(lambda session, x: (RowScale(2.0)(x),), X)
    found = pipeline.Found("traced", {}, closed)
    made = pipeline.lean_program("run", found, exchange=Ranks(), unit_seeds=(), fuse=True,
                                 inputs={"x": jax.ShapeDtypeStruct((2,), float)}, specs=())
    assert tuple(made) == found


def test_the_driver_takes_the_lean_path_on_every_rank_or_none():
    exchange = Ranks(lambda what, share: [None])  # another rank's program is no chain
    assert lean_totals(exchange)[1] is None
    assert exchange.seen == ["agreeing on the lean path"]
    exchange = Ranks()
    assert pipeline.lean_program("t", None, exchange=exchange, unit_seeds=(), fuse=True,
                                 inputs={}, specs=()) is None
    assert exchange.seen == ["agreeing on the lean path"]


def _proposals(step, rng):
    """**Returns:** a random proposal of a shared pass, of the shapes its analysis gives."""
    if isinstance(step, rows.KnownRows):
        spans = {}
        for position in rng.choice(6, size=rng.integers(0, 5), replace=False):
            start = int(rng.integers(0, 4))
            spans[int(position)] = (start, start + int(rng.integers(0, 3)))
        return spans
    if isinstance(step, unused.DropUnused):
        return tuple(sorted(int(p) for p in rng.choice(6, size=rng.integers(0, 5),
                                                     replace=False)))
    if isinstance(step, fuse.Fuse):
        return None if rng.random() < 0.2 else tuple(
            bool(b) for b in rng.integers(0, 2, size=int(rng.integers(3, 5))))
    return tuple(tuple(sorted(int(m) for m in rng.choice(5, size=rng.integers(0, 4),
                                                        replace=False)))
                 for _ in range(int(rng.integers(1, 3))))


@pytest.mark.parametrize("step", [rows.KnownRows(), unused.DropUnused(), fuse.Fuse(),
                                  fuse.AgreeRows()], ids=lambda s: type(s).__name__)
def test_proposals_decided_by_reductions_merge_as_the_proposals_themselves(step):
    # what the ranks decide from the largest of their encodings (a fixed size, whatever
    # their number) is what `merge` decides from every rank's proposal
    rng = np.random.default_rng(7)
    for _ in range(300):
        every = [(_proposals(step, rng),) for _ in range(int(rng.integers(1, 5)))]
        assert pipeline.merged([step], every) == [step.merge([p for (p,) in every])], every
    # a rank without proposals, or with proposals of fewer passes: no decisions
    assert pipeline.merged([step], [(_proposals(step, rng),), None]) is None
    assert pipeline.merged([step], [(_proposals(step, rng),), ()]) is None
