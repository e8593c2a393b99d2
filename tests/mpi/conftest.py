"""Runs the tests of this folder on every rank of one MPI launch:
`mpiexec -n 2 python -m pytest tests/mpi` (and `-n 4`); tests/test_mpi.py starts both.

Every rank runs every test, in the same order. After each phase of a test (setup, call,
teardown) the ranks compare their outcomes, so a test that fails on one rank fails on
all of them: `-x` stops every rank after the same test, and rank 0's report shows the
first failing rank's traceback once. Only rank 0 prints pytest's report; the others
print their last line (`rank R of N: ok`, which tests/test_mpi.py checks) and what went
wrong before any test ran. A test still running after its limit prints where every rank
stands and aborts the job, naming the test.
"""

import os
import sys
import threading

import pytest
from helpers import CASE_LIMIT, SCALED, hung, load_factor, share_compilations
from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.rank, world.size
comm = world.Dup()  # (the harness's own messages can never match a test's)
share_compilations()  # (with the other ranks, and the run's other launches)

_EXIT = pytest.StashKey[int]()
# the harness's own watchdog, tested by tests/test_mpi.py
collect_ignore = [] if os.environ.get("DISTOP_TEST_HANGS") == "1" else ["test_hang.py"]


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if rank == 0:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:  # (rank 0 reports for every rank)
        config.pluginmanager.unregister(reporter)
        quiet = open(os.devnull, "w")  # (for the whole session)
        config.add_cleanup(quiet.close)
        config.pluginmanager.register(pytest.TerminalReporter(config, quiet),
                                      "terminalreporter")
    if getattr(config, "cache", None) is not None:  # (rank 0 writes what --lf reads)
        config.cache.set = lambda key, value: None


def _say(text):
    """Print `text` on this rank's own output, past pytest's capture, in one write (so
    that mpiexec does not interleave it with another rank's lines)."""
    sys.__stdout__.write(text + "\n")
    sys.__stdout__.flush()


def pytest_collectreport(report):
    if report.failed and rank != 0:
        _say(f"rank {rank} of {size}: collecting {report.nodeid or 'the tests'} failed:\n"
             f"{report.longreprtext}")


def pytest_collection_finish(session):
    """Every rank runs the tests rank 0 selected (`-k`, `--lf`, ...), or none."""
    mine = [item.nodeid for item in session.items]
    chosen = comm.bcast(mine, root=0)
    differ = comm.allgather(mine != chosen)
    if any(differ):
        ranks = [r for r, d in enumerate(differ) if d]
        pytest.exit(f"rank(s) {ranks} of {size} selected other tests than rank 0 "
                    f"({len(mine)} here, {len(chosen)} on rank 0): run the same command "
                    "with the same files on every rank.", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = CASE_LIMIT * (load_factor() if SCALED else 1.0)
    timer = threading.Timer(limit, _hung, (item, limit))
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()


def _hung(item, limit):
    """A test's watchdog: say where this rank stands, past pytest's capture, and abort."""
    capture = item.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=False)
    hung(world, item.nodeid, limit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """One outcome on every rank for each phase of a test: failed where any rank failed,
    skipped where every rank skipped."""
    report = yield
    outcomes = comm.allgather(report.outcome)
    texts = comm.gather(report.longreprtext if report.failed else None, root=0)
    failed = [r for r, o in enumerate(outcomes) if o == "failed"]
    skipped = [r for r, o in enumerate(outcomes) if o == "skipped"]
    if failed:
        first, also = failed[0], failed[1:]
        where = f"failed on rank {first} of {size}" + (
            f" (and on rank(s) {also})" if also else "")
        if rank == 0 and first == 0:
            if also:
                report.sections.append(("MPI", where))
        elif rank == 0:
            report.outcome, report.longrepr = "failed", f"{where}:\n{texts[first]}"
        else:
            report.outcome, report.longrepr = "failed", where
    elif skipped and len(skipped) < size:
        report.outcome = "failed"
        report.longrepr = (f"skipped on rank(s) {skipped} of {size} only: a test skips on "
                           "every rank or on none")
    return report


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Every rank's last line: tests/test_mpi.py checks that each says ok."""
    status = config.stash.get(_EXIT, None)
    _say(f"rank {rank} of {size}: " + ("ok" if status == 0 else f"exit status {status}"))
