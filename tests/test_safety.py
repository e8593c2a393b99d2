"""Failures end loudly on every rank, never in a hang; launcher guardrails; checking mode."""

import contextlib
import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CORE, ROOT, SUITE_TIMEOUT, TESTS, run_mpi, run_tests

import distop
from distop import _config
from distop._mpi import notices as _notices
from distop._mpi.launch import diagnose
from distop._mpi.tracebacks import format_exception
from distop._safety import watchdog as _watchdog
from distop._safety.watchdog import State

MPICH = "MPICH Version:      5.0.2\nMPICH ABI:          18:2:6\n"
OPEN_MPI = "Open MPI v5.0.3, package: Open MPI Distribution, ident: 5.0.3"

SCENARIOS = [  # (scenario, checking mode, text that must appear, with {bad} the bad rank)
    ("forward_raises", False, "Flaky.forward on rank {bad}: raised RuntimeError"),
    ("vjp_raises", False, "Flaky.vjp on rank {bad}: raised RuntimeError"),
    ("forward_raises", True, "Rank {bad} is running step #1: failed Flaky.forward"),
    ("vjp_raises", True, "Cause: rank {bad} failed in Flaky.vjp: its error, raised there"),
    ("rank_skips_operator", False, "of {n} has waited"),
    ("rank_skips_operator", True, "Rank {bad} is running step #1: end of program"),
    ("while_trip_count_differs", False, "of {n} has waited"),
    ("while_trip_count_differs", True, "end of program"),
    ("rank_exits_early", False, "of {n} has waited"),
    ("rank_exits_early", True, "the checking mode is on, and that rank answers no check"),
    # a declared collective on one rank only meets no collective of distop's own: no
    # value comes back wrong, and the watchdog (or the checking mode) names the method
    ("stray_collective", False, "rank 0: waiting in Stray.forward, collective Allreduce"),
    ("stray_collective", True, "Rank 0 is running collective #1: Allreduce in Stray.forward"),
    ("undeclared_collective", True, "issued ['Barrier'], not declared"),
    ("undeclared_collective", False, "issued ['Barrier'], not declared"),
    ("undeclared_point_to_point", False, "issued ['Sendrecv'], not declared in "
                                         "forward_collectives=()"),
    ("implicit_solve", False, "Coupled.solve on rank {bad}: raised RuntimeError: solve did "
                              "not converge"),
    ("implicit_solve_adjoint", False, "Coupled.solve_adjoint on rank {bad}: raised "
                                      "RuntimeError: solve_adjoint did not converge"),
    ("implicit_solve_adjoint", True, "Rank {bad} is running step #"),
    ("implicit_residual_vjp", False, "Coupled.residual_vjp on rank {bad}: returned input "
                                     "cotangent 0 with shape (1, 2)"),
    ("raises_before_any_problem", False, "uncaught RuntimeError on rank {bad}; aborting all"),
    ("rank_exits_before_any_problem", False, "s in Problem: duplicating the communicator"),
]


# the scenarios where every rank does the same wrong thing: the number of ranks is not
# their point, so they run on 2 ranks only (the others, where one rank misbehaves while
# the others wait, also run on 4, where some ranks only look on)
EVERY_RANK = {"undeclared_collective", "undeclared_point_to_point"}


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, checking, expected, nprocs", [
    pytest.param(s, c, e, n, id=f"{s}{'-checking' if c else ''}-{n}")
    for n in (2, 4) for s, c, e in SCENARIOS if n == 2 or s not in EVERY_RANK])
def test_failure_ends_every_rank_with_a_clear_message(scenario, checking, expected, nprocs):
    env = {"DISTOP_WATCHDOG": "8", "DISTOP_CHECK_COLLECTIVES": "1" if checking else "0"}
    started = time.monotonic()
    code, out = run_mpi(nprocs, TESTS / "mpi_failures.py", scenario, timeout=90,
                        expect_ok=False, env=env)
    assert time.monotonic() - started <= 60, out
    assert code != 0, out
    assert expected.format(bad=nprocs - 1, n=nprocs) in out, out
    if "distop watchdog:" in out:  # it says where the rank waits
        assert any(w in out for w in ("Flaky.forward", "agreeing", "duplicating")), out


REPORTS = [  # (scenario, checking mode, the user's line that raised, what other ranks say)
    ("vjp_raises", False, 'raise RuntimeError("singular block")',
     "distop: rank {r} of {n} stopped: rank {bad} failed in Flaky.vjp (see its traceback)."),
    ("forward_raises", True, 'raise RuntimeError("disk quota exceeded")',
     ("distop: rank {r} of {n} stopped: rank {bad} failed in Flaky.forward (see its "
      "traceback).")),
    ("implicit_solve_adjoint", False,
     'raise RuntimeError(f"{method} did not converge in 50 iterations")',
     ("distop: rank {r} of {n} stopped: rank {bad} failed in Coupled.solve_adjoint (see "
      "its traceback).")),
    ("every_rank_raises", False, "raise ValueError(\"no input named 'x3'\")",
     ("distop: rank {r} of {n} stopped: it raised ValueError, as rank 0 did (see rank 0's "
      "traceback).")),
    ("every_rank_raises_highest_first", False, "raise ValueError(\"no input named 'x3'\")",
     ("distop: rank {r} of {n} stopped: it raised ValueError, as rank 0 did (see rank 0's "
      "traceback).")),
]


@pytest.mark.mpi
@pytest.mark.parametrize("scenario, checking, raised, stopped", REPORTS,
                         ids=[f"{s}{'-checking' if c else ''}" for s, c, _, _ in REPORTS])
def test_a_failure_is_reported_once_and_every_other_rank_says_why_it_stops(
        scenario, checking, raised, stopped):
    n = 4
    env = {"DISTOP_WATCHDOG": "8", "DISTOP_CHECK_COLLECTIVES": "1" if checking else "0"}
    code, out = run_mpi(n, TESTS / "mpi_failures.py", scenario, timeout=90,
                        expect_ok=False, env=env)
    assert code != 0, out
    bad = 0 if scenario.startswith("every_rank_raises") else n - 1
    assert out.count(raised) == 1, out  # (the user's frame, in one traceback)
    for r in set(range(n)) - {bad}:
        assert out.count(stopped.format(r=r, n=n, bad=bad)) == 1, out
    assert out.count("distop: rank ") == n - 1, out  # (nothing else from the others)
    if not checking:  # (the checking mode also prints the failing call as it fails)
        assert out.count("Traceback (most recent call last)") == 1, out
        assert f'File "{ROOT / "distop"}' not in out, out  # (distop's frames left out)
    lines = [line for line in out.splitlines() if line.strip()]
    # (the launchers frame their own notice of the abort with rules: Open MPI's of
    # dashes, MPICH's of equals signs when it kills a rank that was still running)
    repeated = {line for line in lines if lines.count(line) > 1
                and not line.lstrip().startswith(("Traceback", "File ", "[", "^"))
                and set(line.strip()) not in ({"-"}, {"="})}
    assert not repeated, out


class _Raising(distop.DistributedOperator):
    """An operator whose forward raises, as a user's code may."""

    def output_specs(self, x):
        return x

    def forward(self, comm, x):
        raise RuntimeError("disk quota exceeded")

    def vjp(self, comm, x, out, ct):
        return ct


def test_a_report_leaves_out_the_frames_of_every_module_of_distop():
    problem = distop.Problem(lambda x: {"y": _Raising()(x)}, {"x": np.ones(2)})
    with pytest.raises(distop.OperatorError) as caught:
        problem.run()
    shown = format_exception(caught.value)
    assert 'raise RuntimeError("disk quota exceeded")' in shown, shown
    assert f'File "{ROOT / "distop"}' not in shown, shown
    assert "inside distop left out]" in shown, shown


class _Eight:
    """A stand-in for the runtime's communicator of 8 ranks."""

    def Get_size(self):
        return 8


def test_a_failing_rank_tells_the_relay_only_which_passes_on_the_news(monkeypatch):
    sent = []
    monkeypatch.setattr(_notices, "_post", lambda comm, data, ranks: sent.append(list(ranks)))
    for name, empty in (("_heard", []), ("_failed", set()), ("_arrived", {})):
        monkeypatch.setattr(_notices, name, empty)
    _notices._send(_Eight(), _notices._Notice(5, True, "d", "failed in X.forward"))
    _notices._send(_Eight(), _notices._Notice(0, True, "d", "failed in X.forward"))
    assert sent == [[0], list(range(1, 8))]  # (the relay's own: to every other rank)
    # the relay heard ranks 3-7 fail alike, and rank 2 report a failure elsewhere
    for r in (7, 3, 5, 4, 6):
        assert _notices._learn(_notices._Notice(r, True, "d", "failed in X.forward"))
    assert not _notices._learn(_notices._Notice(3, True, "d", "failed in X.forward"))
    _notices._learn(_notices._Notice(2, False, "e", "raised DistopError"))
    news = _notices._news()
    monkeypatch.setattr(_notices, "_failed", set())
    # a rank that reads it learns the lowest notice of each kind, and every rank that failed
    assert [(n.rank, n.own) for n in _notices._read(news, 0)] == [(2, False), (3, True)]
    assert _notices._failed == {2, 3, 4, 5, 6, 7}


@pytest.mark.mpi
@pytest.mark.long
@pytest.mark.timeout(SUITE_TIMEOUT)
class _Truncated(distop.DistributedOperator):
    """An operator whose forward meets MPI's error of collectives that do not match."""

    forward_collectives = ("Allreduce",)

    def forward(self, comm, x):
        from mpi4py import MPI

        raise MPI.Exception(MPI.ERR_TRUNCATE)


def test_an_mpi_error_in_a_method_names_the_operator_and_the_checking_mode():
    problem = distop.Problem(lambda x: {"y": _Truncated()(x)}, {"x": np.ones(2)})
    with pytest.raises(distop.OperatorError, match=r"_Truncated.forward on rank 0: raised "
                       r"Exception: .*truncat.*An MPI error inside a method: .*collectives "
                       r"did not match.*DISTOP_CHECK_COLLECTIVES=1"):
        problem.run()


def test_checking_mode_passes_correct_programs():
    run_tests(2, *CORE, "test_distributed.py", env={"DISTOP_CHECK_COLLECTIVES": "1"})


@pytest.mark.parametrize("env, library, world, expected", [
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "job"}, MPICH, None, "unsupported PMI version PMIx"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, MPICH, None, "Open MPI's mpiexec"),
    ({"PMI_SIZE": "4", "PMI_RANK": "1", "PMI_FD": "9"}, OPEN_MPI, None, "world of size 1"),
    ({"PMI_SIZE": "4", "PMI_RANK": "1"}, MPICH, 1, "started 4 processes"),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}, MPICH, 1, "srun --mpi=pmi2"),
    ({"PMI_SIZE": "4", "PMI_RANK": "1"}, MPICH, None, None),
    ({"PMI_SIZE": "4", "PMI_RANK": "1"}, MPICH, 4, None),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, OPEN_MPI, 2, None),
    ({}, MPICH, 1, None),
])
def test_launcher_diagnosis(env, library, world, expected):
    found = diagnose(env, library, world)
    if expected is None:
        assert found is None
    else:
        assert expected in found and "Fix:" in found


def _python(code, **env):
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, timeout=120)


def test_import_under_a_mismatched_launcher_fails_clearly():
    from mpi4py import MPI

    if "open mpi" in MPI.Get_library_version().lower():  # (under MPICH's launcher)
        wrong, family = {"PMI_SIZE": "2", "PMI_RANK": "1"}, "Open MPI"
    else:  # (under a PMIx launcher: Open MPI's, or srun --mpi=pmix)
        wrong, family = {"PMIX_RANK": "0", "PMIX_NAMESPACE": "job"}, "MPICH"
    proc = _python("import distop", **wrong)
    assert proc.returncode != 0
    assert "LauncherMismatchError" in proc.stderr and family in proc.stderr, proc.stderr
    ok = _python("import distop", **wrong, DISTOP_SKIP_LAUNCH_CHECK="1")
    assert "LauncherMismatchError" not in ok.stderr


@pytest.mark.parametrize("missing", [
    {"code": "import sys; sys.modules['mpi4py.MPI'] = None\n"},  # (ImportError)
    {"code": "", "MPI4PY_LIBMPI": "/nonexistent/libmpi.so.12"},  # (mpi4py: RuntimeError)
], ids=["no-mpi4py", "no-libmpi"])
def test_without_an_mpi_library_single_process_use_works_and_says_what_to_install(missing):
    missing = dict(missing)
    proc = _python(
        missing.pop("code")
        + "import jax, numpy as np, jax.numpy as jnp, distop\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "class Twice(distop.DistributedOperator):\n"
        "    def forward(self, comm, x): return 2 * x\n"
        "    def vjp(self, comm, g, x): return 2 * g\n"
        "p = distop.Problem(lambda x: {'y': Twice()(x)}, {'x': np.ones(2)})\n"
        "assert p.compute_totals()['y', 'x'].tolist() == [[2, 0], [0, 2]]\n"
        "q = distop.Problem(lambda x: {'s': distop.AllreduceSum()(x)}, {'x': np.ones(2)})\n"
        "for call in (lambda: distop.AllreduceSum()(jnp.ones(2)).block_until_ready(),\n"
        "             q.run):\n"
        "    try:\n"
        "        call()\n"
        "    except distop.MPIUnavailableError as err:\n"
        "        print('ERROR', err)\n", **missing)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert "AllreduceSum.forward on rank 0" in line, line
        assert "pip install 'distop[mpich]'" in line, line


def test_without_an_mpi_library_under_a_launcher_import_fails_clearly():
    # each of the launched processes would run alone: refused, as a launcher mismatch is
    proc = _python("import distop", MPI4PY_LIBMPI="/nonexistent/libmpi.so.12",
                   PMI_SIZE="2", PMI_RANK="1")
    assert proc.returncode != 0
    assert "MPIUnavailableError: this process is one of 2 started by" in proc.stderr
    assert "pip install 'distop[mpich]'" in proc.stderr


def test_configure_and_environment():
    before = distop.configure()
    try:
        s = distop.configure(check_collectives=True, watchdog=5)
        assert s.check_collectives and s.watchdog == 5.0
    finally:
        distop.configure(check_collectives=before.check_collectives, watchdog=600)
    proc = _python("import distop; s = distop.configure(); "
                   "print(s.check_collectives, s.watchdog)",
                   DISTOP_CHECK_COLLECTIVES="1", DISTOP_WATCHDOG="42")
    assert proc.stdout.split() == ["True", "42.0"], proc.stderr


@pytest.mark.parametrize("value, expected", [
    ("1", True), ("TRUE", True), ("yes", True), ("On", True), ("2", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False), ("-0", False),
    ("", None),
])
def test_yes_no_variables_take_the_usual_spellings(value, expected, monkeypatch):
    monkeypatch.setenv("DISTOP_FUSE", value)
    assert _config.env_flag("DISTOP_FUSE", None) is expected
    if expected is not None:
        problem = distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": np.ones(2)})
        assert problem.fuse is expected


def test_a_setting_that_cannot_be_read_is_an_error_naming_it(monkeypatch):
    for value in ("maybe", "+-1", "²"):
        monkeypatch.setenv("DISTOP_FUSE", value)
        with pytest.raises(ValueError, match=re.escape(f"DISTOP_FUSE='{value}': expected 1")):
            distop.Problem(lambda x: {"f": jnp.sum(x)}, {"x": np.ones(2)})
    proc = _python("import distop", DISTOP_WATCHDOG="ten")
    assert proc.returncode != 0
    assert "DISTOP_WATCHDOG='ten': expected a number of seconds" in proc.stderr, proc.stderr
    proc = _python("import distop", DISTOP_CHECK_COLLECTIVES="sometimes")
    assert proc.returncode != 0 and "DISTOP_CHECK_COLLECTIVES='sometimes'" in proc.stderr


class Seen(distop.DistributedOperator):
    log: list

    def forward(self, comm, x):
        self.log.append((x.flags.c_contiguous, x.copy()))
        return x.sum(axis=0)

    def output_spec(self, x):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)


def test_user_code_gets_row_major_arrays_whatever_xla_did():
    a = np.arange(12.0).reshape(3, 4)
    log = []
    f = jax.jit(lambda a: Seen(log)(jnp.transpose(a.reshape(4, 3))[::-1]))
    np.testing.assert_array_equal(f(a), a.reshape(4, 3).T[::-1].sum(axis=0))
    contiguous, seen = log[0]
    assert contiguous
    np.testing.assert_array_equal(seen, a.reshape(4, 3).T[::-1])


# -- the watchdog: waiting counts, computing does not ---------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
def test_watchdog_lets_ranks_compute_longer_than_its_limit(nprocs):
    # each case computes 5 s with a limit of 2 s: on every rank, or on one rank while
    # the others wait for it in a collective, in requests, or in the next call's agreement
    run_mpi(nprocs, TESTS / "mpi_watchdog.py", "healthy", timeout=240,
            env={"DISTOP_WATCHDOG": "2"})


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("scenario, expected", [
    ("exits_early", ("has waited {s} s in Problem: agreeing on the inputs' shapes",
                     "rank {last}: at its exit for")),
    ("another_collective", ("has waited {s} s in Solve.forward, collective Allreduce",
                            "rank {last}: waiting in Other.forward, collective Barrier for")),
])
def test_watchdog_reports_a_hang_at_its_limit_with_what_every_rank_does(scenario, expected,
                                                                        nprocs):
    limit, started = 2, time.monotonic()
    code, out = run_mpi(nprocs, TESTS / "mpi_watchdog.py", scenario, timeout=120,
                        expect_ok=False, env={"DISTOP_WATCHDOG": str(limit)})
    assert time.monotonic() - started <= 60, out
    assert code != 0 and "finished without an error" not in out, out
    waited = [float(s) for s in re.findall(r"of \d+ has waited ([\d.]+) s", out)]
    assert waited and max(waited) <= limit + 1, out  # (reported at the limit)
    first, peer = expected
    assert re.search(re.escape(first).replace(r"\{s\}", r"[\d.]+"), out), out
    assert peer.format(last=nprocs - 1) in out, out


class _Comm:
    """A stand-in communicator of two ranks whose calls record where the watchdog
    stands while they run."""

    def __init__(self, seconds=0.0):
        self.seconds, self.seen = seconds, []

    def Get_size(self):
        return 2

    def _record(self, *args):
        self.seen.append(_watchdog.watchdog._active.get(threading.get_ident()))
        time.sleep(self.seconds)

    Allreduce = Recv = Isend = _record

    def Split(self, color):
        self._record()
        return _Comm(self.seconds)


def test_watchdog_sees_each_mpi_call_of_a_method_as_a_wait_and_the_rest_as_computing():
    comm = _Comm()
    busy = _watchdog.watchdog.busy("Solve.forward", comm)
    assert isinstance(busy.comm, _watchdog.WatchedComm) and busy.comm.seconds == 0.0
    with busy:
        key = threading.get_ident()
        mark = _watchdog.watchdog._active[key]
        assert (mark.state, mark.where, mark.detail) == (State.COMPUTING, "Solve.forward", None)
        busy.comm.Allreduce(np.ones(8), np.empty(8))
        busy.comm.Recv(np.empty(8), 1)
        assert _watchdog.watchdog._active[key].state == State.COMPUTING
        sub = busy.comm.Split(0)
        assert isinstance(sub, _watchdog.WatchedComm)
        busy.comm.Isend(np.ones(8), 1)  # (the method may wait on the request unseen)
        mark = _watchdog.watchdog._active[key]
        assert (mark.state, mark.where, mark.detail) == (State.UNSEEN, "Solve.forward", "Isend")
    assert key not in _watchdog.watchdog._active
    assert [s[:3] for s in comm.seen] == [(State.WAITING, "Solve.forward", name)
                                          for name in ("Allreduce", "Recv", "Split")] + [
        (State.UNSEEN, "Solve.forward", "Isend")]
    one = _Comm()
    one.Get_size = lambda: 1
    assert _watchdog.watchdog.busy("Solve.forward", one).comm is one  # (no peer to wait for)


@pytest.fixture
def aborts(monkeypatch):
    """The watchdog's aborts, recorded instead of ending the process; a limit of 0.3 s."""
    found = []
    monkeypatch.setattr(_watchdog, "abort", lambda comm, message: found.append(message))
    limit = distop.configure().watchdog
    distop.configure(watchdog=0.3)
    yield found
    distop.configure(watchdog=limit)


def test_watchdog_counts_a_method_waiting_in_mpi_but_not_computing(aborts):
    busy = _watchdog.watchdog.busy("Solve.forward", _Comm(seconds=1.0))
    with busy:
        time.sleep(1.0)  # computing: more than three times the limit
    assert aborts == []
    with busy:
        busy.comm.Allreduce(np.ones(8), np.empty(8))
    assert aborts, "a wait past the limit was not reported"
    assert re.search(r"has waited 0\.\d s in Solve\.forward, collective Allreduce \(limit "
                     r"DISTOP_WATCHDOG=0\.3 s", aborts[0]), aborts[0]
    assert "Where the other ranks stand is unknown" in aborts[0], aborts[0]


def test_watchdog_waits_on_while_a_peer_computes(aborts):
    dog = _watchdog.Watchdog()
    now = time.monotonic()
    dog._heard = {1: (now, State.COMPUTING, "Solve.forward", 100.0)}
    assert dog._held(now, 0.3, longest=1000.0)  # however long
    dog._heard = {1: (now - 1.0, State.COMPUTING, "Solve.forward", 100.0)}
    assert not dog._held(now, 0.3, longest=1.0)  # (no news within the limit)
    for state in (State.OUTSIDE, State.UNSEEN):  # (it may be waiting, unseen)
        dog._heard = {1: (now, state, "", 1.0)}
        assert dog._held(now, 0.3, longest=2.9) and not dog._held(now, 0.3, longest=3.1)
    for state in (State.WAITING, State.EXITING):
        dog._heard = {1: (now, state, "Solve.forward, collective Allreduce", 1.0)}
        assert not dog._held(now, 0.3, longest=0.5)


def test_watchdog_report_says_where_every_rank_stands(monkeypatch):
    monkeypatch.setattr(_watchdog.settings, "check_collectives", False)  # (its hint)
    now = 1000.0
    heard = {1: (now, State.WAITING, "Solve.forward, collective Allreduce", 61.2),
             2: (now - 0.5, State.WAITING, "Solve.forward, collective Allreduce", 60.6),
             3: (now - 2.0, State.COMPUTING, "Solve.forward", 70.0),
             5: (now - 90.0, State.OUTSIDE, "", 1.0),
             6: (now, State.EXITING, "its exit", 3.0)}
    asked = dict.fromkeys(range(1, 8), now - 1.0)
    stuck = [(State.WAITING, "Solve.forward, collective Allreduce", 61.4, 60.0)]
    text = _watchdog.report(0, 8, stuck, 60.0, now, heard, asked, "")
    assert text.splitlines() == [
        "distop watchdog: rank 0 of 8 has waited 61 s in Solve.forward, collective "
        "Allreduce (limit DISTOP_WATCHDOG=60 s of waiting; time a method spends computing "
        "does not count).",
        "Where the other ranks stand, as they last answered:",
        "  ranks 1-2: waiting in Solve.forward, collective Allreduce for 61 s",
        "  rank 3: computing in Solve.forward for 72 s (answered 2.0 s ago)",
        "  ranks 4, 7: no answer (asked 1.0 s ago): it may have exited or crashed, or hold "
        "the GIL in a long computation",
        "  rank 5: no answer for 90 s; before that, outside distop for 91 s (in its own "
        "code, or tracing or compiling)",
        "  rank 6: at its exit for 3.0 s: its program has ended",
        "No other rank is known to be computing: one failed, exited, or runs a different "
        "schedule (rank-dependent control flow; DISTOP_CHECK_COLLECTIVES=1 names it). "
        "Aborting the job."]


def test_watchdog_report_from_a_relay_names_every_rank_it_heard(monkeypatch):
    monkeypatch.setattr(_watchdog.settings, "check_collectives", False)  # (its hint)
    wait, now = "Solve.forward, collective Allreduce", 1000.0
    relay = _watchdog.Watchdog()  # (rank 0 of 5, as the world is here)
    relay._heard = {1: (now, State.WAITING, wait, 61.0),
                    2: (now - 0.5, State.WAITING, wait, 60.5),
                    3: (now - 2.0, State.COMPUTING, "Solve.forward", 70.0)}
    relay._asked = dict.fromkeys(range(1, 5), now - 1.0)
    summary = relay._summary(lambda: (State.WAITING, wait, 61.0), now, 60.0)
    # rank 1, a second later: it asked the relay only, and heard only its summary
    relayed = {0: (now, _watchdog.groups_of(summary))}
    stuck = [(State.WAITING, wait, 61.0, 60.0)]
    # (asked again since the summary came, and not yet answered: the summary stands)
    text = _watchdog.report(1, 5, stuck, 60.0, now + 1.0, {}, {0: now + 0.9}, "", relayed)
    assert text.splitlines()[1:-1] == [
        "Where the other ranks stand, as they last answered:",
        "  ranks 0, 2: waiting in Solve.forward, collective Allreduce for 62 s "
        "(answered 1.5 s ago)",
        "  rank 3: computing in Solve.forward for 73 s (answered 3.0 s ago)",
        "  rank 4: no answer (asked 2.0 s ago): it may have exited or crashed, or hold "
        "the GIL in a long computation"]
    asker = _watchdog.Watchdog()
    asker._relayed, asker._asked = relayed, {0: now + 0.9}
    assert asker._held(now + 1.0, 60.0, longest=61.0)  # (rank 3 computes)
    asker._relayed = {0: (now - 59.0, relayed[0][1])}  # (news older than the limit)
    assert not asker._held(now + 1.0, 60.0, longest=61.0)


def test_the_watchdog_names_a_step_of_making_a_problem_once(monkeypatch):
    from distop._agreement import coordinator as _coordinator

    class TwoRanks:  # (a stand-in: every rank's part is this one's)
        def Get_size(self):
            return 2

        def Allreduce(self, flag, found, op=None):
            found[...] = flag

    watched = []
    monkeypatch.setattr(_watchdog.watchdog, "watch",
                        lambda where: watched.append(where) or contextlib.nullcontext())
    coordinator = object.__new__(_coordinator.Coordinator)
    coordinator.comm = TwoRanks()
    coordinator.collective_step("Problem: checking its arguments", lambda: 1)
    coordinator.collective_step("run: tracing the program", lambda: 2)
    assert watched == ["Problem: checking its arguments", "Problem: run: tracing the program"]
