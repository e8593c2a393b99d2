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
    assert "  compute    numpy kernel" in out and "jax kernel" in out, out
    if threads == "1":
        # (a machine shared with other work may warn of that, and only of that)
        assert "oversubscribed" not in out, out
        assert (proc.returncode == 0) == ("healthy" in out), out + proc.stderr
    else:
        assert proc.returncode == 1, out + proc.stderr
        assert "WARNING: node" in out and "Fix: export OMP_NUM_THREADS=" in out, out


def probed(numpy=1e-3, share=1.0, steal=0.0, **kwargs):
    return {**rank(**kwargs), "load": kwargs.get("load", 0.5),
            "compute": {"numpy": numpy, "jax": numpy / 2, "cpu_share": share,
                        "steal": steal}}


def test_other_processes_on_the_cores_are_found_with_their_fix():
    quiet = [probed(cores=(0, 1)), probed(cores=(2, 3))]
    assert _doctor.busy_machine(quiet) == []
    loaded = [{**probed(), "load": 14.0}, {**probed(), "load": 14.0}]
    ((what, fix),) = _doctor.busy_machine(loaded)
    assert "node node0: other processes keep about 12 cores busy" in what, what
    assert "load average 14.0" in what and "--exclusive" in fix and "bind" in fix
    starved = [probed(share=0.4), probed(share=0.95), probed(share=0.3, steal=0.2)]
    ((what, fix),) = _doctor.busy_machine(starved)
    assert "rank(s) 0,2 got as little as 30% of a core" in what, what
    assert "CPU steal 20%" in what and "--exclusive" in fix


def test_the_slowest_rank_of_the_compute_probe_is_named():
    every = [probed(numpy=1e-3), probed(numpy=1e-3), probed(numpy=3e-3), probed()]
    ((what, fix),) = _doctor.busy_machine(every)
    assert what.startswith("rank 2 (node node0) ran the same numpy kernel 3.00x"), what
    assert "waits for rank 2" in what and fix
    facts = {"jax": "0", "jaxlib": "0", "devices": ["cpu:0"], "x64": True, "async": False}
    quiet = {"pingpong": 0.0, "allreduce": 0.0, "barrier": 0.0, "skew": 0.0}
    text = _doctor.screen({}, every, "MPICH Version: 4", "4.0", facts, quiet, [])
    assert "numpy kernel 1000 us median, slowest rank 2 3000 us (3.00x)" in text, text
    assert "  load       average over the last minute: node0 0.5" in text, text


def test_the_doctor_warns_where_other_processes_load_the_cores():
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(3 * (os.cpu_count() or 1))]
    try:
        proc = doctor(OMP_NUM_THREADS="1")
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "of a core while computing" in out and "  Fix: run the job on cores no " \
        "other work uses" in out, out
