"""The README's commands are what CI runs, in the order the suite sets, its example
runs, the package says its version, and `import distop` binds everything the API pages
list."""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile

import numpy as np
from doc_blocks import blocks
from helpers import ROOT

import distop


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
               if "-m pytest" in line]
    # the README's command first, word for word (then other legs, each in a venv of its
    # own: Open MPI, Python 3.12)
    assert command and f"\n{command[0]}\n" in readme, command
    assert all(line.removeprefix("&& ").startswith((".venv-openmpi/bin/python -m pytest",
                                                    ".venv-py312/bin/python -m pytest"))
               for line in command[1:]), command


# (run in a process of its own: the suite's order, with each test's markers, as one
# worker runs it; the last line printed)
ORDER = """
import json, sys, pytest
class Order:
    def pytest_collection_finish(self, session):
        self.found = [(test.nodeid, bool(test.get_closest_marker("long")),
                       bool(test.get_closest_marker("mpi"))) for test in session.items]
order = Order()
code = pytest.main(["--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
                   plugins=[order])
print(json.dumps(order.found))
sys.exit(code)
"""


def test_the_suite_starts_the_long_launches_and_spreads_the_other_mpi_tests():
    # (a worker's own settings left out: the order of a run on one process)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run([sys.executable, "-c", ORDER], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    long = sum(is_long for _, is_long, _ in found)
    assert long and all(is_long for _, is_long, _ in found[:long]), found[:long + 1]
    single = [i for i, (_, _, mpi) in enumerate(found) if not mpi]
    # after the last single-process test: the tests that read the examples' launches
    readers = [name for name, _, _ in found[single[-1] + 1:]]
    assert readers and all(t.startswith("tests/test_mpi.py::") for t in readers), readers
    spread = [i for i, (_, is_long, mpi) in enumerate(found[:single[-1]]) if mpi and not is_long]
    # among the first half of the single-process tests, from its start to its end
    where = [sum(j < i for j in single) for i in spread]
    assert where[0] <= 1 and len(single) // 2 - len(single) // len(spread) <= where[-1] \
        <= len(single) // 2, where


def test_import_distop_binds_linalg():
    # a fresh process: here another test may have imported `distop.linalg` already
    code = "import distop; print(distop.linalg.cg is distop.linalg.__dict__['cg'])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_the_api_pages_list_every_public_name():
    listed = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        listed |= set(re.findall(r"^::: distop\.(\w+)", page.read_text(), re.M))
    public = {name for name, value in vars(distop).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    assert {"Profile", "Report", "Settings", "ConvergenceError"} <= public
    assert public <= listed, sorted(public - listed)
    assert distop.ConvergenceError is distop.linalg.ConvergenceError


def test_version():
    assert distop.__version__ == importlib.metadata.version("distop")


def test_a_source_tree_on_the_path_imports_without_being_installed():
    # (as where a cluster's users put a checkout on PYTHONPATH: no package metadata)
    code = ("import importlib.metadata as m\n"
            "def version(name, found=m.version):\n"
            "    if name == 'distop':\n"
            "        raise m.PackageNotFoundError(name)\n"
            "    return found(name)\n"
            "m.version = version\n"
            "import distop\n"
            "print(distop.__version__)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "0+unknown", done.stderr


def test_the_readme_example_runs_in_one_process_too():
    # (tests/test_docs.py runs it under mpiexec -n 4, as the README says)
    example, = blocks(ROOT / "README.md")
    scope = {"__name__": "__main__"}
    exec(example.code, scope)  # noqa: S102 - the README's own code
    problem, x = scope["problem"], np.linspace(0.0, 1.0, 4)
    A, w = scope["op"].A, np.asarray(scope["w"])
    np.testing.assert_allclose(scope["values"]["f"], w @ A @ x, rtol=1e-12)
    np.testing.assert_allclose(scope["totals"]["f", "x"], (w @ A)[None], rtol=1e-12)
    assert [e.phase for e in problem.schedule] == ["forward", "vjp"]


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
