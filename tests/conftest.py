import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import pytest

jax.config.update("jax_enable_x64", True)
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent / "examples"))
MPI_TESTS = TESTS / "mpi"


def _cache_bytecode():
    """Let this process and every process it starts cache compiled modules outside the
    source tree, where the environment asks Python to write none (PYTHONDONTWRITEBYTECODE).

    Without it, every rank of every launch compiles distop's modules and the tests'
    from source again. The cache lives in the temporary folder
    (`PYTHONPYCACHEPREFIX`), so the tree stays as clean as the setting wanted."""
    if not sys.dont_write_bytecode:
        return
    prefix = os.environ.get("PYTHONPYCACHEPREFIX") or os.path.join(
        tempfile.gettempdir(), f"distop-tests-pycache-{os.getuid()}")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    sys.pycache_prefix, sys.dont_write_bytecode = prefix, False


_cache_bytecode()


@pytest.fixture(scope="session")
def run_folder(tmp_path_factory):
    """A folder that every worker process of this test run shares."""
    base = tmp_path_factory.getbasetemp()
    # (each worker has a folder of its own under the run's)
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


def pytest_configure(config):
    _share_compilations(config)
    config.addinivalue_line("markers", "mpi: launches mpiexec (2 and 4 ranks)")
    config.addinivalue_line("markers", "long: makes one of the longest launches (minutes); "
                                       "started first, each on a worker of its own")
    config.addinivalue_line("markers", "async_dispatch: also runs with JAX's async dispatch "
                                       "on (DISTOP_ASYNC_DISPATCH=1), in a launch of its own")


def pytest_ignore_collect(collection_path, config):
    """tests/mpi runs on every rank of an MPI launch (tests/test_mpi.py starts them); a
    plain `pytest` collects it only when asked for it by path."""
    if collection_path == MPI_TESTS:
        asked = [Path(arg.split("::")[0]).resolve() for arg in config.args]
        return not any(a == MPI_TESTS or MPI_TESTS in a.parents for a in asked)
    return None


# set on every rank by the launchers (MPICH's, Open MPI's, Slurm's through PMI)
_LAUNCHED = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def _share_compilations(config):
    """Give the MPI launches of this run one folder in which to share JAX's compilations
    (`helpers.share_compilations`), removed when the run ends: made by the pytest that
    was started, before its workers start, unless the environment names one already.
    A rank of a launch, or a worker, finds it in its environment."""
    from helpers import COMPILATIONS

    if COMPILATIONS in os.environ or any(name in os.environ for name in _LAUNCHED):
        return
    folder = tempfile.mkdtemp(prefix="distop-tests-jax-")
    os.environ[COMPILATIONS] = folder
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


def pytest_xdist_auto_num_workers(config):
    """How many worker processes `-n auto` (the default) starts: none on a rank of an MPI
    launch (every rank is one pytest, see tests/mpi/conftest.py); else one per core and
    one more, up to eight. A launch runs more ranks than the worker that made it, so
    one worker per core keeps the cores busy; the one more fills the time an MPI test
    leaves them idle (its ranks start, or wait out a watchdog's limit). More workers
    only make more ranks share the cores: a rank waiting in MPI still polls, and a
    rank its peers wait for runs less often, so the same tests take more CPU time."""
    if any(name in os.environ for name in _LAUNCHED):
        return 0
    from helpers import cores  # (on the path set above)

    return max(1, min(8, cores() + 1))


def pytest_collection_modifyitems(config, items):
    """The longest launches first, one on each worker, then the other MPI tests woven
    into the single-process tests, and last the tests that only read the examples'
    launches.

    xdist's load scheduler (with `--maxschedchunk 1`, see pyproject.toml) hands each
    worker two tests at the start, then one more whenever it finishes one. So a short
    test after each of the first long ones gives every worker one long launch at once,
    and the others go to the workers that free up first. Many of the other MPI tests
    leave the cores idle while they wait (for ranks to start, a job to abort, a
    watchdog's limit to pass): spread over the first half of the single-process tests,
    they run beside tests that keep the cores busy, and none is left to run alone at
    the end. A test reading the examples' launch waits for the launch to end (see
    tests/test_mpi.py's `example`): placed last, it finds it done."""
    def rank(item):
        if item.get_closest_marker("long"):
            return 0
        if "example" in getattr(item, "fixturenames", ()):
            return 3
        return 1 if item.get_closest_marker("mpi") else 2

    mpi, single = ([item for item in items if rank(item) == kind] for kind in (1, 2))
    spread = 0.5 * len(single) / max(1, len(mpi))
    woven = sorted([(i * spread, 0, i) for i in range(len(mpi))]
                   + [(j, 1, j) for j in range(len(single))])
    items[:] = ([item for item in items if rank(item) == 0]
                + [(mpi, single)[kind][i] for _, kind, i in woven]
                + [item for item in items if rank(item) == 3])
    long = sum(rank(item) == 0 for item in items)
    # (xdist tells its workers how many there are; one process runs the tests in order)
    first = min(long, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0)))
    if first and len(items) >= 2 * first:
        # each of the first long ones, then a short one
        shorts = items[long:long + first]
        paired = [test for pair in zip(items[:first], shorts) for test in pair]
        items[:] = paired + items[first:long] + items[long + first:]
