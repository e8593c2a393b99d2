import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: launches mpiexec (2 and 4 ranks)")
