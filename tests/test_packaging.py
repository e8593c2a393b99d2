"""The README's commands are what CI runs, and the package says its version."""

import importlib.metadata

import distop
from helpers import ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
               if "pytest" in line]
    # the README's command first, word for word (then, where there is a Python 3.12, the
    # same suite in a venv of its own)
    assert command and f"\n{command[0]}\n" in readme, command
    assert all(".venv-py312/bin/python -m pytest" in line for line in command[1:]), command


def test_version():
    assert distop.__version__ == importlib.metadata.version("distop")
