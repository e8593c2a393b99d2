"""Multi-rank tests: the tests of tests/mpi in one launch per number of ranks (2 and 4),
and in the launches that need a setting read at start-up; the examples; the launcher."""

import importlib.util
import json
import os
import re
import time

import pytest
from helpers import CORE, ROOT, SUITE_TIMEOUT, run_mpi, run_tests

from distop._profile_report import check_trace

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_cases(nprocs):
    run_tests(nprocs)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_hung_case_ends_its_launch_with_where_every_rank_stands(nprocs):
    started = time.monotonic()
    code, out = run_tests(nprocs, "test_hang.py", timeout=90, expect_ok=False,
                          env={"DISTOP_TEST_HANGS": "1", "DISTOP_TEST_CASE_LIMIT": "5"})
    assert code != 0 and time.monotonic() - started < 60, out
    hung = "tests/mpi/test_hang.py::test_a_case_that_hangs still running after 5 s"
    for r in range(nprocs):
        assert f"rank {r} of {nprocs}: {hung}" in out, out
    assert "in test_a_case_that_hangs" in out, out  # (the stacks)


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_cases_on_the_io_callback_backend():
    run_tests(2, *CORE, "test_matvec.py", env={"DISTOP_BACKEND": "io_callback"})


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_cases_with_jax_async_dispatch(nprocs):
    # (read when JAX's CPU client starts: a launch of its own)
    run_tests(nprocs, "-m", "async_dispatch", env={"DISTOP_ASYNC_DISPATCH": "1"})


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("example, args, tolerance", [
    ("distributed_matvec", ("--objectives", 16, "--repeat", 3), 1e-12),
    ("distributed_least_squares", (), 1e-8),
    ("distributed_transpose", (), 1e-12),
])
def test_examples(example, args, tolerance, nprocs):
    code, out = run_mpi(nprocs, ROOT / "examples" / f"{example}.py", *args, expect_ok=False)
    assert code == 0, out
    match = re.search(r"max relative error (\S+)", out)
    assert match and float(match.group(1)) <= tolerance, out


@pytest.mark.parametrize("nprocs, split", [(2, "14,10"), (4, "7,0,10,7")])
def test_poisson_example(nprocs, split):
    code, out = run_mpi(nprocs, ROOT / "examples" / "poisson.py", "--n", 24, "--split",
                        split, expect_ok=False)
    assert code == 0, out
    match = re.search(r"max relative error (\S+)", out)
    assert match and float(match.group(1)) <= 1e-8, out
    assert "check_totals on a 8 x 8 grid: ok" in out, out


@pytest.mark.parametrize("nprocs, every", [(2, 0), (4, 8)])
def test_heat_equation_example(nprocs, every):
    code, out = run_mpi(nprocs, ROOT / "examples" / "heat_equation.py", "--steps", 40,
                        "--n", 11, "--checkpoint-every", every, expect_ok=False)
    assert code == 0, out
    match = re.search(r"max relative error (\S+)", out)
    assert match and float(match.group(1)) <= 1e-10, out
    assert "check_totals passed" in out, out
    assert ("checkpoint/scan[8]" in out) == bool(every), out


def test_optimize_example_takes_the_same_steps_on_any_number_of_ranks():
    found = []
    for nprocs, split in [(1, ""), (2, "9,7"), (4, "5,0,7,4")]:
        args = ("--split", split) if split else ()
        code, out = run_mpi(nprocs, ROOT / "examples" / "optimize.py", *args,
                            expect_ok=False)
        assert code == 0, out
        error = re.search(r"max relative error (\S+)", out)
        assert error and float(error.group(1)) <= 1e-8, out
        found.append(re.search(r"(\d+) iterations", out).group(1))
    assert len(set(found)) == 1, found


def test_watchdog_kills_a_hung_job(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("from mpi4py import MPI\n"
                      "if MPI.COMM_WORLD.rank == 0:\n    MPI.COMM_WORLD.Barrier()\n"
                      "else:\n    import time; time.sleep(600)\n")
    with pytest.raises(AssertionError, match="watchdog"):
        run_mpi(2, script, timeout=10)


def test_a_failing_rank_fails_the_launch(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys\nfrom mpi4py import MPI\n"
                      "from helpers import finish\n"
                      "if MPI.COMM_WORLD.rank == 1:\n    sys.exit(3)\nfinish()\n")
    code, out = run_mpi(2, script, timeout=60, expect_ok=False)
    assert code != 0 and "rank 1 of 2: ok" not in out, out


@pytest.mark.parametrize("nprocs, slow", [(2, 1), (4, 2)])
def test_load_imbalance_example_names_the_slow_rank(nprocs, slow, tmp_path):
    trace, picture = tmp_path / "trace.json", tmp_path / "profile.png"
    plot = nprocs == 2 and importlib.util.find_spec("matplotlib") is not None
    code, out = run_mpi(nprocs, ROOT / "examples" / "load_imbalance.py", "--slow-rank", slow,
                        "--factor", 4, "--repeat", 8, "--trace", trace,
                        *(("--plot", picture) if plot else ()), expect_ok=False, timeout=180)
    assert code == 0, out
    assert re.search(rf"^slowest rank: {slow} ", out, re.MULTILINE), out
    assert "check_totals: ok" in out and "wait in MPI on the other ranks" in out, out
    document = json.loads(trace.read_text())
    check_trace(document)
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    for rank in range(nprocs):  # one track per rank, each with its methods and waits
        names = {e["name"] for e in events if e["pid"] == rank}
        assert {"run", "compute_totals", "Gram.forward", "Gram.vjp", "Allreduce"} <= names
    if plot:
        assert picture.read_bytes()[:4] == b"\x89PNG"


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("nprocs, threads", [(2, 1), (4, 1), (2, "cores")])
def test_doctor_under_mpiexec(nprocs, threads):
    threads = _cores() if threads == "cores" else threads
    code, out = run_mpi(nprocs, "-m", "distop", "doctor", expect_ok=False, timeout=120,
                        env={"OMP_NUM_THREADS": str(threads)})
    assert f"distop doctor: {nprocs} rank(s)" in out and "probe      ping-pong" in out, out
    assert out.count("distop doctor:") == 1, out  # one screen, from rank 0
    crowded = nprocs * threads > _cores()
    assert code == (1 if crowded else 0), out
    assert ("oversubscribed" in out) == crowded and ("healthy" in out) != crowded, out
