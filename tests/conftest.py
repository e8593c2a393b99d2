import os
import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)
TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent / "examples"))
MPI_TESTS = TESTS / "mpi"


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: launches mpiexec (2 and 4 ranks)")
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


def pytest_xdist_auto_num_workers(config):
    """How many worker processes `-n auto` (the default) starts: none on a rank of an MPI
    launch (every rank is one pytest, see tests/mpi/conftest.py); else one per core, up
    to four (each MPI test starts ranks of its own)."""
    if any(name in os.environ for name in _LAUNCHED):
        return 0
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, min(4, cores))


def pytest_collection_modifyitems(config, items):
    """The tests that launch MPI jobs first, those that launch tests/mpi (the longest)
    before the others, so that no worker is left with a long one at the end."""
    items.sort(key=lambda item: (item.get_closest_marker("mpi") is None,
                                 not item.name.startswith("test_cases")))
