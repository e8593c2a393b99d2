"""Every Python block of the README and the docs runs, as written: the blocks of a page
run in one process, or under `mpiexec -n P` where marked (see doc_blocks.py); the pages
of one rank count share one process or launch, a page at a time."""

import os
import subprocess
import sys

import pytest
from doc_blocks import (
    ROOT,
    blocks,
    docstring_blocks,
    frame,
    launches,
    masked,
    outputs,
    pages,
)
from helpers import EXAMPLES, TESTS, load_factor, once_per_run, run_mpi

LAUNCHES = [(page, ranks) for page in pages() for ranks in launches(page)]


def _id(page, ranks):
    return f"{page.relative_to(ROOT)}-{ranks}"


def _run_one_process(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), str(EXAMPLES), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(TESTS / "doc_blocks.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300 * load_factor())
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "rank 0 of 1: ok" in output, output
    return output


def _printed(folder, ranks):
    """**Returns:** what the one launch of every page's blocks for `ranks` ranks printed
    (made once per test run, see `once_per_run`; each page's output in a frame of its
    own)."""
    where = [str(page.relative_to(ROOT)) for page, n in LAUNCHES if n == ranks]

    def launch():
        if ranks > 1:
            return run_mpi(ranks, TESTS / "doc_blocks.py", *where, ranks,
                           timeout=300 + 120 * len(where))[1]
        try:
            return _run_one_process(*where, "1")
        except subprocess.TimeoutExpired as late:  # (every page fails)
            raise AssertionError(str(late)) from None

    return once_per_run(folder, f"doc-blocks-{ranks}", launch)


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("page, ranks", [
    pytest.param(page, ranks, id=_id(page, ranks),
                 marks=[pytest.mark.mpi] if ranks > 1 else [])
    for page, ranks in LAUNCHES])
def test_the_blocks_of_a_page_run(page, ranks, run_folder):
    where = str(page.relative_to(ROOT))
    printed = frame(_printed(run_folder, ranks), where)
    seen = set(masked(printed))
    for launch, expected in outputs(page):
        if launch == ranks:
            for line in masked(expected):
                assert line in seen, f"{where}: printed no line like {line!r}:\n{printed}"


def test_the_docstring_examples_run():
    assert len(docstring_blocks()) >= 5
    _run_one_process("--docstrings")


def test_the_performance_page_is_what_its_generator_makes_of_the_results():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "performance.py"),
                           "--check"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_readme_example_runs_under_mpiexec_on_4_ranks():
    example = blocks(ROOT / "README.md")
    assert len(example) == 1 and example[0].ranks == 4, example
    # (the venv's mpiexec and python, as the README's install makes them)
    assert ("OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 4 .venv/bin/python example.py"
            in (ROOT / "README.md").read_text())
    for name in ("distop.Problem(", ".run(", ".compute_totals(", ".check_totals("):
        assert name in example[0].code, name


def test_printed_output_is_found_after_its_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- mpiexec -n 2 -->\n```python\nprint(1.5)\n```\n\n<!-- output -->\n"
                    "```text\n1.5\n```\n\n```text\nnot output\n```\n")
    assert outputs(page) == [(2, "1.5")]
    assert masked("f = -7.08  df/dx = [[ 1.2e-03 4 ]]\n\n") == ["f = # df/dx = [[ # # ]]"]


def test_blocks_are_found_with_their_marker_and_language(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\na = 1\n```\n\n<!-- mpiexec -n 3 -->\n"
                    "```python\nb = 2\n```\n\n```sh\nls\n```\n\n<!-- mpiexec -n 2 -->\n\n"
                    "prose\n\n```python\nc = 3\n```\n\n- item\n\n    ```python\n    d = 4\n"
                    "    ```\n")
    found = blocks(page)
    assert [(b.line, b.ranks, b.code) for b in found] == [
        (4, 1, "a = 1\n"), (9, 3, "b = 2\n"), (21, 1, "c = 3\n"), (27, 1, "d = 4\n")]
    assert launches(page) == [1, 3]
