"""The README's commands are what CI runs, and the package says its version."""

import importlib.metadata

import distop
from helpers import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
               if "pytest" in line]
    assert len(command) == 1 and f"\n{command[0]}\n" in readme


def test_version():
    assert distop.__version__ == importlib.metadata.version("distop")
