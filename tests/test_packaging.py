"""The README's commands are what CI runs, its code runs, and the package says its
version."""

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile

import jax.numpy as jnp
import numpy as np
from helpers import ROOT

import distop


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
               if "-m pytest" in line]
    # the README's command first, word for word (then other legs, each in a venv of its
    # own: Open MPI, Python 3.12)
    assert command and f"\n{command[0]}\n" in readme, command
    assert all(line.startswith(("&& .venv-openmpi/bin/python -m pytest",
                                "&& .venv-py312/bin/python -m pytest"))
               for line in command[1:]), command


def test_version():
    assert distop.__version__ == importlib.metadata.version("distop")


def test_the_readme_code_runs_as_written():
    readme = (ROOT / "README.md").read_text()
    operator, usage = re.findall(r"```python\n(.*?)```", readme, re.S)[:2]
    scope = {}
    exec(operator, scope)  # noqa: S102 - the README's own code
    rng = np.random.default_rng(0)
    A = rng.standard_normal((3, 4))
    w, x0, x1, x2 = rng.standard_normal(3), np.ones(4), np.arange(4.0), np.full(4, 0.5)
    scope.update(op=scope["DistributedMatvec"](A), w=w, x0=x0, x1=x1, x2=x2, jnp=jnp)
    exec(usage, scope)  # noqa: S102
    np.testing.assert_allclose(scope["values"]["f"], w @ A @ x2, rtol=1e-12)
    np.testing.assert_allclose(scope["totals"]["f", "x"], (w @ A)[None], rtol=1e-12)
    assert [e.phase for e in scope["problem"].schedule] == ["forward", "vjp"]


def test_the_wheel_holds_every_module_and_the_typing_marker(tmp_path):
    # (an editable install finds every file in the checkout: a wheel built from a clean
    # copy, without the checkout's build products, must hold them too)
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv*", ".git", "build", "*.egg-info", "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, timeout=600)
    wheel, = tmp_path.glob("distop-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "distop").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert "distop/py.typed" in names
