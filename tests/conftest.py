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
