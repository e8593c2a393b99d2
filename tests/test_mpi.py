"""Multi-rank tests: the tests of tests/mpi in one launch per number of ranks (2 and 4),
and in the launches that need a setting read at start-up; the examples; the launcher."""

import importlib.util
import json
import re
import time

import pytest
from helpers import CORE, SUITE_TIMEOUT, TESTS, cores, once_per_run, run_mpi, run_tests

from distop._diagnostics.report import check_trace

pytestmark = pytest.mark.mpi


@pytest.mark.long
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


@pytest.mark.long
@pytest.mark.timeout(SUITE_TIMEOUT)
def test_cases_on_the_io_callback_backend():
    run_tests(2, *CORE, "test_matvec.py", env={"DISTOP_BACKEND": "io_callback"})


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs", [2, 4])
def test_cases_with_jax_async_dispatch(nprocs):
    # (read when JAX's CPU client starts: a launch of its own)
    run_tests(nprocs, "-m", "async_dispatch", env={"DISTOP_ASYNC_DISPATCH": "1"})


PLOT = importlib.util.find_spec("matplotlib") is not None
# each test's runs of the examples: the runs of each rank count share one launch of
# tests/mpi_examples.py (see `example`)
SMALL = [
    ("distributed_matvec", ("--objectives", 16, "--repeat", 3), 1e-12),
    ("distributed_least_squares", (), 1e-8),
    ("distributed_transpose", (), 1e-12),
]
POISSON = [(2, "14,10"), (4, "7,0,10,7")]
HEAT = [(2, 0), (4, 8)]
OPTIMIZE = [(1, ""), (2, "9,7"), (4, "5,0,7,4")]
DATA_PARALLEL = [(1, ""), (2, "8,0"), (4, "4,3,3,0")]
NEWTON_KRYLOV = [(1, ""), (2, "400,0"), (4, "150,0,130,120")]
LOAD_IMBALANCE = [(2, 1, where) for where in ("method", "jax", "outside")] + [
    (4, 2, where) for where in ("method", "jax", "outside")]
# (the first test of each rank count's examples makes their launch: started first)
LAUNCHES = [pytest.param(*run, marks=pytest.mark.long) if run[2] == "method" else run
            for run in LOAD_IMBALANCE]


def _runs(nprocs, folder):
    """**Returns:** the examples' runs on `nprocs` ranks: (example, arguments)."""
    runs = [(example, args) for example, args, _ in SMALL if nprocs > 1]
    runs += [("poisson", ("--n", 24, "--split", split)) for n, split in POISSON if n == nprocs]
    runs += [("heat_equation", ("--steps", 40, "--n", 11, "--checkpoint-every", every))
             for n, every in HEAT if n == nprocs]
    runs += [("optimize", ("--split", split) if split else ())
             for n, split in OPTIMIZE if n == nprocs]
    runs += [("data_parallel", ("--split", split) if split else ())
             for n, split in DATA_PARALLEL if n == nprocs]
    runs += [("newton_krylov", ("--split", split) if split else ())
             for n, split in NEWTON_KRYLOV if n == nprocs]
    # (the slow rank does 8 times the work: its extra time stays well above what other
    # tests running beside the launch add to any rank)
    runs += [("load_imbalance", ("--where", where, "--slow-rank", slow, "--factor", 8,
                                 "--repeat", 8, "--trace", folder / f"trace-{n}-{where}.json",
                                 *(("--plot", folder / "profile.png")
                                   if n == 2 and where == "method" and PLOT else ())))
             for n, slow, where in LOAD_IMBALANCE if n == nprocs]
    return runs


@pytest.fixture(scope="session")
def example(run_folder):
    """`example(name, nprocs, index=0)`: **Returns:** `(exit codes, output)` of the
    example's run on `nprocs` ranks (its `index`-th run there). Every run of that rank
    count is in one launch, made once per test run (`once_per_run`) by the first test
    that needs it; the others read its output."""
    folder = run_folder / "examples"
    folder.mkdir(exist_ok=True)

    def frame(name, nprocs, index=0):
        def launch():
            argv = [w for each, args in _runs(nprocs, folder) for w in ("--", each, *args)]
            return run_mpi(nprocs, TESTS / "mpi_examples.py", *argv[1:], timeout=900)[1]

        out = once_per_run(folder, f"launch-{nprocs}", launch)
        frames = list(re.finditer(rf"^=== example {name}: begin\n(.*?)^=== example {name}: "
                                  r"exit codes \[([\d, ]*)\]$", out, re.MULTILINE | re.DOTALL))
        assert len(frames) > index, out
        found = frames[index]  # (the index-th run of the example in the launch)
        return [int(c) for c in found.group(2).split(",")], found.group(1)

    frame.folder = folder
    return frame


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("example_name, args, tolerance", SMALL)
def test_examples(example_name, args, tolerance, nprocs, example):
    codes, out = example(example_name, nprocs)
    assert codes == [0] * nprocs, out
    match = re.search(r"max relative error (\S+)", out)
    assert match and float(match.group(1)) <= tolerance, out


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs, split", POISSON)
def test_poisson_example(nprocs, split, example):
    codes, out = example("poisson", nprocs)
    assert codes == [0] * nprocs, out
    match = re.search(r"max relative error (\S+)", out)
    assert match and float(match.group(1)) <= 1e-8, out
    assert "check_totals on a 8 x 8 grid: ok" in out, out


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs, every", HEAT)
def test_heat_equation_example(nprocs, every, example):
    codes, out = example("heat_equation", nprocs)
    assert codes == [0] * nprocs, out
    match = re.search(r"max relative error (\S+)", out)
    assert match and float(match.group(1)) <= 1e-10, out
    assert "check_totals passed" in out, out
    assert ("checkpoint/scan[8]" in out) == bool(every), out


@pytest.mark.timeout(SUITE_TIMEOUT)
def test_optimize_example_takes_the_same_steps_on_any_number_of_ranks(example):
    found = []
    for nprocs, _ in OPTIMIZE:
        codes, out = example("optimize", nprocs)
        assert codes == [0] * nprocs, out
        error = re.search(r"max relative error (\S+)", out)
        assert error and float(error.group(1)) <= 1e-8, out
        found.append(re.search(r"(\d+) iterations", out).group(1))
    assert len(set(found)) == 1, found


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs, split", DATA_PARALLEL)
def test_data_parallel_example_trains_as_one_process_does(nprocs, split, example):
    codes, out = example("data_parallel", nprocs)
    assert codes == [0] * nprocs, out
    across = re.search(r"^parameters across ranks: max difference (\S+)$", out, re.MULTILINE)
    assert across and float(across.group(1)) == 0.0, out
    against = re.search(r"^against one process, full batch: max difference (\S+)$", out,
                        re.MULTILINE)
    assert against and float(against.group(1)) <= 1e-12, out


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs, split", NEWTON_KRYLOV)
def test_newton_krylov_example_converges_as_one_process_does(nprocs, split, example):
    codes, out = example("newton_krylov", nprocs)
    assert codes == [0] * nprocs, out
    assert "check_hvp: ok" in out, out
    error = re.search(r"max relative error (\S+)", out)
    assert error and float(error.group(1)) <= 1e-8, out
    newton = re.search(r"^Newton-Krylov +(\d+) iterations.*\|grad\| = (\S+);", out, re.MULTILINE)
    assert newton and int(newton.group(1)) <= 8 and float(newton.group(2)) <= 1e-12, out
    assert re.search(r"^trust-krylov .* (\d+) Hessian-vector products", out, re.MULTILINE), out


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


@pytest.mark.timeout(SUITE_TIMEOUT)
@pytest.mark.parametrize("nprocs, slow, where", LAUNCHES)
def test_load_imbalance_example_names_the_slow_rank(nprocs, slow, where, example):
    index = [w for n, _, w in LOAD_IMBALANCE if n == nprocs].index(where)
    codes, out = example("load_imbalance", nprocs, index)
    trace = example.folder / f"trace-{nprocs}-{where}.json"
    picture = example.folder / "profile.png"
    plot = nprocs == 2 and where == "method" and PLOT
    assert codes == [0] * nprocs, out
    assert re.search(rf"^slowest rank: {slow} ", out, re.MULTILINE), out
    assert "check_totals: ok" in out and "wait in MPI on the other ranks" in out, out
    went = {"method": "Gram.forward (computing)", "jax": "JAX",
            "outside": "its own code between calls"}[where]
    assert re.search(rf"^slowest rank: {slow} .*its extra time against the median rank: "
                     rf"{re.escape(went)} \+", out, re.MULTILINE), out
    document = json.loads(trace.read_text())
    check_trace(document)
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    for rank in range(nprocs):  # one track per rank, each with its methods and waits
        names = {e["name"] for e in events if e["pid"] == rank}
        assert {"run", "compute_totals", "Gram.forward", "Gram.vjp", "Allreduce",
                "outside distop"} <= names
    if plot:
        assert picture.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("nprocs, threads", [(2, 1), (4, 1), (2, "cores")])
def test_doctor_under_mpiexec(nprocs, threads):
    threads = cores() if threads == "cores" else threads
    code, out = run_mpi(nprocs, "-m", "distop", "doctor", expect_ok=False, timeout=120,
                        env={"OMP_NUM_THREADS": str(threads)})
    assert f"distop doctor: {nprocs} rank(s)" in out and "probe      ping-pong" in out, out
    assert out.count("distop doctor:") == 1, out  # one screen, from rank 0
    assert "  compute    numpy kernel" in out and "slowest rank" in out, out
    crowded = nprocs * threads > cores()
    # (a machine shared with other work may warn of that too)
    assert ("oversubscribed" in out) == crowded and (code == 0) == ("healthy" in out), out
    assert code == 1 or not crowded, out
