"""The benchmark suite runs end to end (a small part of it, to keep it from rotting)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.mpi
# OpenMDAO is compared where installed (`pip install -e '.[bench]'`), left out elsewhere
OPENMDAO = importlib.util.find_spec("openmdao") is not None


def test_suite_runs_and_writes_its_tables_and_json(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--quick", "--ranks", "2",
         "--large-ranks", "2", "--sections", "overhead", "large", "--large-size", "2000",
         "--json", str(out)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "distop's own work per call" in proc.stdout and "new input" in proc.stdout, \
        proc.stdout
    assert "large sparse matvec" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())
    assert not results["failures"]
    large = results["results"]["large"]["2"]["rows"][0]
    assert large["error"] < 1e-12 and set(large["median"]) == {"hand", "lean"}
    overhead = results["results"]["overhead"]
    # the extra job keeps JAX's async dispatch; distop's default turns it off
    assert overhead["1 async"]["async_dispatch"] and not overhead["2"]["async_dispatch"]


def test_matvec_section_compares_every_variant_on_the_same_values(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--quick", "--ranks", "2",
         "--sections", "matvec", "--objectives", "1", "2", "--json", str(out)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lean/hand" in proc.stdout, proc.stdout
    assert ("openmdao/lean" in proc.stdout) is OPENMDAO, proc.stdout
    assert "hand+jit/hand" in proc.stdout and "lean/ffi" in proc.stdout, proc.stdout
    assert "run_and_compute_totals" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())
    assert not results["failures"]
    rows = results["results"]["matvec"]["2"]["rows"]
    assert [row["K"] for row in rows] == [1, 2]
    for row in rows:
        others = ("openmdao",) if OPENMDAO else ()
        assert {"hand", "hand+jit", "floor", "ffi", "lean", "nofuse", "io_cb",
                *others} <= set(row["median"])
        # every ordered variant, and OpenMDAO, gets the dense reference's values and
        # gradients (the unordered one may not: that is what it shows)
        for name in ("floor", "ffi", "lean", "nofuse", "io_cb", *others):
            assert row["error"][name] < 1e-12, (name, row["error"])


def test_watchdog_benchmark_prints_its_table():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "watchdog.py"), "--repeat", "1000",
         "--rounds", "1"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"Allreduce(8", "method:", "Get_rank()"}, proc.stdout
    assert all(float(value) > 0 for value in rows["Allreduce(8"][2:4]), proc.stdout


def run_benchmark(script, *options):
    """**Returns:** the finished run of benchmarks/`script` with `options` (one thread per
    rank), checked to have exited 0."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *options],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_loops_benchmark_prints_its_three_tables():
    proc = run_benchmark(
        "loops.py", "--ranks", "2", "--steps", "20", "--repeat", "1", "--sizes", "8",
        "--first-scan", "20", "--first-python", "20", "--memory", "--memory-ranks", "2",
        "--memory-steps", "16", "--memory-size", "100")
    for title in ("20 steps of u = op(u) + 0.01", "first calls on 1 rank",
                  "compute_totals over 16 steps"):
        assert title in proc.stdout, proc.stdout
    # every variant's totals agree with the hand-written reverse sweep
    for line in proc.stdout.splitlines():
        if line.strip().startswith("2 ") and ("run" in line or "totals" in line):
            assert float(line.split()[-1]) < 1e-12, line


def test_stencil_benchmark_prints_its_tables_with_exact_gradients():
    proc = run_benchmark("stencil.py", "--ranks", "2", "--sizes", "12", "--steps", "4",
                         "--split", "2", "4", "--repeat", "1", "--micro-repeat", "1")
    for title in ("heat equation, 4 steps, ", "heat equation in a scan, ",
                  "host calls that do no work, in a scan, "):
        # (two cores here: each of the two ranks is bound to one; the titles say so)
        assert title + "each rank bound to a core" in proc.stdout, proc.stdout
    # distop's values and gradients, scan and Python loop, against the hand-written ones
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.split()[:2] == ["2", "12"] and line.split()[2] in ("scan", "python")]
    assert len(rows) == 2 and all(float(row[-1]) < 1e-12 for row in rows), proc.stdout
    # the per-step split, with the floor: the same loop with a no-op FFI call, no distop
    assert "floor fwd  floor rev  fwd-floor  rev-floor" in proc.stdout, proc.stdout
    steps = [line.split() for line in proc.stdout.splitlines()
             if line.split()[:2] == ["2", "12"] and line.split()[2] not in ("scan", "python")]
    assert len(steps) == 1 and len(steps[0]) == 16, proc.stdout
    # the built-in reductions in a loop, against the same loop by hand
    assert "built-in reductions, once per step of 4 in a scan, n = 12, " in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith("2 ") and line.split()[1] in ("AllreduceSum", "Allreduce",
                                                              "Allgather")]
    assert len(rows) == 3 and all(float(row[-1]) < 1e-12 for row in rows), proc.stdout


def test_shapes_benchmark_finds_the_programs_of_shapes_seen_before():
    proc = run_benchmark("shapes.py", "--ranks", "2", "--shapes", "3", "--rounds", "1")
    assert "a Problem cycled through 3 shapes" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("2 ")]
    # P, shapes, cache, first, seen, steady, seen/steady, MiB/shape
    assert len(rows) == 1 and rows[0][:3] == ["2", "3", "64"], proc.stdout
    first, seen = float(rows[0][3]), float(rows[0][4])
    assert seen < first / 5, proc.stdout  # (a new shape compiles; one seen before does not)


def test_problems_made_and_dropped_keep_a_few_kib_each(tmp_path):
    out = tmp_path / "problems.json"
    run_benchmark("problems.py", "--ranks", "1", "--problems", "200", "--heap", "30",
                  "--json", str(out))
    r = json.loads(out.read_text())["results"]["plain 1"]
    # The budget is 10 MiB per 1,000 Problems: 10 KiB each. What JAX kept per traced
    # program before the tracing setting's values were reused was about 100 KiB.
    assert r["per_problem"] < 8, r
    assert r["heap"] < 8, r
    assert r["in_use"] == 0 and r["made"] <= 2, r  # (no Problem alive, values reused)


def test_scale_benchmark_counts_one_fixed_size_collective_per_steady_call():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--ranks", "2"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith(("run ", "compute_totals ")) and "distop" in line:
            rows.setdefault(line.split("distop")[0].strip(), []).append(line)
    # in both scenarios, distop's own traffic per steady call: one Allreduce of 24 bytes
    for entry in ("run", "compute_totals"):
        assert len(rows[entry]) == 2, proc.stdout
        for line in rows[entry]:
            assert line.split("distop")[1].split() == ["1", "/", "24"], line
    assert "point-to-point peers of a steady run, per rank (at most): P=2: 1" in proc.stdout
    assert "P=16384" in proc.stdout, proc.stdout


def test_the_hvp_benchmark_prints_its_table_with_exact_products():
    proc = run_benchmark("hvp.py", "--ranks", "2", "--matvec-size", "20", "--heat-size", "12",
                         "--steps", "3", "--repeat", "2")
    assert "Hessian-vector products against the gradient (ms)" in proc.stdout, proc.stdout
    rows = {line.split()[1]: line.split() for line in proc.stdout.splitlines()
            if line.split()[:1] == ["2"]}
    # P, model, grad, hvp K1, hvp/grad, hvp K8, K8/K1, (plain JAX: one rank only), err
    assert set(rows) == {"matvec", "heat"}, proc.stdout
    for row in rows.values():
        assert all(float(cell) > 0 for cell in row[2:7]), proc.stdout
        assert row[7:12] == ["-"] * 5 and float(row[-1]) < 1e-12, proc.stdout
