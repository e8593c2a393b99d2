"""Profiles in one process: what they record, the report, the trace, the picture."""

import importlib.util
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Cube, RankSum

import distop
from distop._diagnostics import profile as _profile
from distop._diagnostics.report import Report, check_trace, summarize

MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture
def problem():
    op, cube = RankSum(), Cube()
    problem = distop.Problem(lambda x: {"f": jnp.sum(cube(op(x)))}, {"x": np.arange(3.0)})
    problem.run(), problem.compute_totals()
    return problem


@pytest.fixture
def profiled(problem):
    with problem.profile() as prof:
        for _ in range(3):
            problem.run()
        problem.compute_totals()
    return prof


def test_profiling_is_off_by_default_and_after_the_block(problem, profiled):
    assert _profile.active is None
    before = len(profiled.calls)
    problem.run()
    assert len(profiled.calls) == before


def test_a_profile_records_every_method_and_program_run(profiled):
    assert [r.entry for r in profiled.runs] == ["run"] * 3 + ["compute_totals"]
    names = [(c.operator, c.phase) for c in profiled.calls]
    assert names.count(("RankSum", "forward")) >= 3 and ("RankSum", "vjp") in names
    for c in profiled.calls:
        run = profiled.runs[c.run]
        # each call lies inside its program run, its MPI calls inside it
        assert run.start <= c.start <= c.end <= run.end
        assert all(c.start <= s <= e <= c.end for _, s, e in c.collectives)
        assert c.wait == sum(e - s for _, s, e in c.collectives)
    forwards = [c for c in profiled.calls if (c.operator, c.phase) == ("RankSum", "forward")]
    assert all([name for name, _, _ in c.collectives] == ["Allreduce"] for c in forwards)
    # places count the method calls of each run from 0
    assert [c.position for c in profiled.calls if c.run == 0] == [0, 1]


def test_the_report_sums_every_rank_and_names_the_slowest(profiled):
    report = profiled.report()
    assert isinstance(report, Report) and report.ranks == 1
    assert report.runs == {"run": 3, "compute_totals": 1}
    rows = {t.name: t for t in report.operators}
    assert set(rows) == {"RankSum.forward", "Cube.forward", "Cube.vjp", "RankSum.vjp"}
    forward = rows["RankSum.forward"]
    assert forward.calls == 4 and forward.compute.shape == (1,) and forward.wait[0] > 0
    assert forward.compute_min == forward.compute_median == forward.compute_max
    assert forward.slowest_rank == 0 and forward.imbalance == 1.0
    assert 0 < forward.wait_share < 1 and rows["Cube.vjp"].wait_share == 0
    assert report.wall[0] >= report.host[0] > 0 and report.jax[0] >= 0
    assert np.isclose(report.compute[0] + report.wait[0], sum(t.wall[0] for t in rows.values()))
    # the per-call rows add up to the per-operator ones
    assert sum(t.calls for t in report.calls if t.name == "RankSum.forward") == 4
    json.dumps(report.as_dict())  # plain data


def test_imbalance_across_ranks_from_gathered_summaries():
    # three ranks' summaries, rank 2 computing three times as long as the others
    def summary(compute, wait):
        return {"operators": {("Op", "forward"): [2, compute, wait, compute + wait]},
                "positions": {("run", 0, "Op", "forward"): [2, compute, wait,
                                                            compute + wait]},
                "runs": {"run": 2}, "wall": compute + wait + 10, "host": compute + wait}

    report = Report.build([summary(100, 200), summary(100, 200), summary(300, 0)])
    (row,) = report.operators
    assert row.slowest_rank == 2 and report.slowest_rank is None  # (no meetings known)
    assert row.compute_max == pytest.approx(300e-9) and row.wait_median == pytest.approx(200e-9)
    assert row.imbalance == pytest.approx(300 / (500 / 3))
    assert row.wait_share == pytest.approx(400 / 900)
    table = report.table(calls=True)
    assert "slowest rank: none" in table and "run[0] Op.forward" in table


def meeting(work, outside=0, jax=0, compute=100, names=None):
    """A rank's summary that worked `work[k]` (ns) before its meeting k, of four, each
    meeting ending 10 ms after the one before it."""
    ends = [10_000_000 * (k + 1) for k in range(4)]
    return {"operators": {("Op", "forward"): [4, compute, 0, compute]}, "positions": {},
            "runs": {"run": 4}, "wall": 10_000_000, "host": compute, "jax": jax,
            "outside": outside, "agreement": 0, "distop": 0, "ends": ends,
            "starts": [end - 10_000_000 + w for end, w in zip(ends, work)],
            "names": names or ["Allreduce", "distop: Problem: agreeing", "Allreduce",
                               "Allreduce"]}


def test_the_headline_names_the_rank_the_others_waited_for_and_where_its_time_went():
    ms = 1_000_000
    report = Report.build([meeting([ms] * 4), meeting([ms] * 4),
                           meeting([6 * ms] * 4, outside=40 * ms, jax=3 * ms)])
    assert report.slowest_rank == 2 and report.last.tolist() == [0, 0, 4]
    assert report.arrivals.shape == (3, 4) and report.arrivals[:, 1].tolist() == [
        pytest.approx(-5e-3), pytest.approx(-5e-3), 0.0]
    assert report.late[2] == pytest.approx(2 * 4 * 5e-3)  # two ranks, four meetings
    assert report.extra[0] == ("its own code between calls", pytest.approx(40e-3))
    headline = report.table().splitlines()[-1]
    assert headline.startswith("slowest rank: 2 (the others waited 40 ms in all for it, "
                               "last to arrive at 4 of 4 meetings; its extra time"), headline
    assert "its own code between calls +40 ms" in headline, headline
    # the ranks taking turns, as noise does: no rank stands out
    names = ["Allreduce"] * 4
    turns = Report.build([meeting([ms, 9 * ms, ms, ms], names=names),
                          meeting([ms, ms, ms, 9 * ms], names=names)])
    assert turns.slowest_rank is None and turns.late.tolist() == [
        pytest.approx(8e-3), pytest.approx(8e-3)]
    assert turns.headline().startswith("slowest rank: none stands out"), turns.headline()
    # ranks that met differently from some point on are compared up to it
    other = meeting([0, 0, 0, 0])
    other["names"] = other["names"][:2] + ["Bcast", "Allreduce"]
    assert Report.build([other, meeting([ms] * 4)]).arrivals.shape == (2, 2)


def test_summaries_of_no_calls_make_an_empty_report():
    report = Report.build([summarize([], [])])
    assert report.operators == () and "slowest rank: none" in report.table()


def test_the_trace_follows_the_trace_event_format(profiled, tmp_path):
    path = tmp_path / "trace.json"
    assert profiled.write_trace(str(path)) == str(path)
    document = json.loads(path.read_text())
    check_trace(document)
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in document["traceEvents"]} == {0}
    assert {e["cat"] for e in events} == {"program", "method", "mpi", "outside"}
    assert sum(e["name"] == "RankSum.forward" for e in events) == 4
    assert sum(e["name"] == "Allreduce" for e in events) == 4
    names = [e for e in document["traceEvents"] if e["ph"] == "M"]
    assert names[0]["args"]["name"] == "rank 0"


@pytest.mark.parametrize("events, problem", [
    ([{"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0}], "'dur'"),
    ([{"name": "a", "ph": "B", "pid": 0, "tid": 0, "ts": 1.0}], "never ended"),
    ([{"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 2.0, "dur": 1},
      {"name": "b", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0, "dur": 1}], "back in time"),
    ([{"name": "a", "ph": "X", "pid": 0, "ts": 1.0, "dur": 1}], "lacks"),
    ([{"name": "a", "ph": "E", "pid": 0, "tid": 0, "ts": 1.0}], "ends no open"),
])
def test_the_trace_check_refuses_broken_traces(events, problem):
    with pytest.raises(ValueError, match=problem):
        check_trace({"traceEvents": events})


@pytest.mark.skipif(not MATPLOTLIB, reason="matplotlib missing (pip install 'distop[plot]')")
def test_the_plot_is_a_png(profiled, tmp_path):
    path = tmp_path / "profile.png"
    assert profiled.plot(str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_profile_is_read_after_its_block_and_does_not_nest(problem):
    prof = problem.profile()
    with prof:
        with pytest.raises(distop.DistopError, match="still recording"):
            prof.report()
        with pytest.raises(distop.DistopError, match="do not nest"):
            problem.profile().__enter__()
    with pytest.raises(distop.DistopError, match="used already"):
        prof.__enter__()
    assert _profile.active is None


def test_a_profile_records_the_io_callback_backend_too():
    op = RankSum()
    problem = distop.Problem(lambda x: {"y": op(x)}, {"x": np.ones(2)},
                             backend="io_callback")
    problem.run()
    with problem.profile() as prof:
        problem.run()
    assert [(c.operator, c.phase) for c in prof.calls] == [("RankSum", "forward")]
    assert prof.report().operators[0].calls == 1


def test_a_timed_communicator_times_communicators_made_from_it():
    from mpi4py import MPI

    timed = _profile.TimedComm(MPI.COMM_SELF, 0)
    made = timed.Dup()
    out = np.empty(1)
    made.Allreduce(np.ones(1), out, op=MPI.SUM)
    made.Free()
    assert [name for name, _, _ in timed.slices][:2] == ["Dup", "Allreduce"]
    assert timed.Get_rank() == 0
