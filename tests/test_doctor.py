"""`python -m distop doctor` in one process, and its checks on made-up jobs."""

import os
import subprocess
import sys

import pytest
from helpers import ROOT

from distop import __main__ as cli
from distop._diagnostics import doctor as _doctor


def rank(host="node0", cores=(0, 1, 2, 3), threads=1, source="OMP_NUM_THREADS=1"):
    return {"host": host, "pid": 1, "cores": list(cores), "cpu_count": 8,
            "threads": threads, "threads_from": source, "xla_flags": ""}


def test_threads_come_from_the_settings_else_one_per_core():
    assert _doctor.threads({"OMP_NUM_THREADS": "2"}, 8) == (2, "OMP_NUM_THREADS=2")
    # OpenBLAS reads its own setting before OpenMP's
    assert _doctor.threads({"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "1"}, 8)[0] == 1
    assert _doctor.threads({}, 8)[0] == 8
    assert _doctor.threads({"OMP_NUM_THREADS": "x"}, 3)[0] == 3


def test_oversubscription_is_found_per_node_with_its_fix():
    healthy = [rank(cores=(0, 1)), rank(cores=(2, 3))]
    assert _doctor.oversubscribed(healthy) == []
    crowded = [rank(threads=4, source="unset"), rank(threads=4, source="unset"),
               rank(host="node1", threads=1)]
    ((what, fix),) = _doctor.oversubscribed(crowded)
    assert "node node0: 2 ranks x 4 threads" in what and "4 cores" in what
    assert "export OMP_NUM_THREADS=2" in fix and "bind" in fix
    too_many = [rank(cores=(0,)) for _ in range(3)]
    ((_, fix),) = _doctor.oversubscribed(too_many)
    assert "at most 1 ranks" in fix


def test_warnings_make_the_exit_status():
    facts = {"jax": "0", "jaxlib": "0", "devices": ["cpu:0"], "x64": True, "async": False}
    quiet = {"pingpong": 0.0, "allreduce": 0.0, "barrier": 0.0, "skew": 0.0}
    assert _doctor.diagnose({}, [rank()], "MPICH Version: 4", 1, facts, quiet) == []
    found = _doctor.diagnose({}, [rank()], "MPICH Version: 4", 1, {**facts, "async": True},
                             {**quiet, "skew": 1.0})
    assert len(found) == 2 and "DISTOP_ASYNC_DISPATCH" in found[0][1]
    # the launcher checks are _launch's
    mismatch = _doctor.diagnose({"OMPI_COMM_WORLD_SIZE": "4"}, [rank()], "MPICH Version: 4",
                                1, facts, quiet)
    assert mismatch and "separate one-rank jobs" in mismatch[0][0] and mismatch[0][1]
    text = _doctor.screen({}, [rank()], "MPICH Version: 4", "4.0", facts, quiet, found)
    assert text.count("WARNING: ") == 2 and text.count("  Fix: ") == 2


def test_compress_writes_ranges():
    assert _doctor.compress([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"


def test_the_command_line_knows_its_commands(capsys):
    assert cli.main(["--help"]) == 0 and "doctor" in capsys.readouterr().out
    assert cli.main(["cure"]) == 2


def doctor(**env):
    return subprocess.run([sys.executable, "-m", "distop", "doctor"], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env))


@pytest.mark.parametrize("threads", ["1", "4096"])
def test_doctor_alone(threads):
    proc = doctor(OMP_NUM_THREADS=threads)
    out = proc.stdout
    for line in ("distop doctor: 1 rank(s) on 1 node(s)", "  MPI ", "mpi4py", "  launcher ",
                 "cores", f"OMP_NUM_THREADS={threads}", "  jax ", "x64", "async dispatch"):
        assert line in out, out + proc.stderr
    if threads == "1":
        assert proc.returncode == 0 and "healthy" in out, out + proc.stderr
    else:
        assert proc.returncode == 1, out + proc.stderr
        assert "WARNING: node" in out and "Fix: export OMP_NUM_THREADS=" in out, out
