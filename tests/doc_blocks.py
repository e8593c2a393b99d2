"""The fenced Python blocks of the Markdown docs, and a runner for one page's blocks.

Every block fenced as `python` runs. A block right after the line
`<!-- mpiexec -n P -->` runs under `mpiexec -n P`. A page's blocks with the same
launch run in one process (or one MPI job), in page order, in one namespace, so a block
may use what an earlier block of its launch defined. Blocks that must not run (shell
commands, output) use other fence languages: `text`, `sh`.

A `text` block right after the line `<!-- output -->` is what the launch of the Python
block before it prints: the tests compare them, with every number and run of spaces
masked (the digits differ between machines and versions, the words and rows do not).

The docstrings of the public API hold Python blocks too (the API pages show them); they
run in one process, each in a namespace of its own.

`python tests/doc_blocks.py PAGE... P` runs the blocks of each PAGE marked for P ranks
(P=1: the unmarked ones), a page at a time, each page's output in a frame of its own;
`python tests/doc_blocks.py --docstrings` runs the docstrings' blocks. Then each prints
this rank's success line. A failing block prints its traceback and aborts the job.
"""

import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*mpiexec -n (\d+)\s*-->")
FENCE = re.compile(r"^(\s*)(`{3,})(\S*)[^\n]*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced Python block: its page, first line of code, ranks and code."""

    page: pathlib.Path
    line: int
    ranks: int
    code: str


def pages():
    """**Returns:** the Markdown files whose Python blocks run: README.md and docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page):
    """**Returns:** the Python blocks of `page`, in order."""
    return blocks_in(pathlib.Path(page).read_text(), pathlib.Path(page))


def blocks_in(text, page):
    """**Returns:** the Python blocks of the Markdown `text`, found in `page`, in order."""
    lines = text.splitlines()
    found, i, marked = [], 0, None
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            if lines[i].strip():
                match = MARKER.fullmatch(lines[i].strip())
                marked = int(match.group(1)) if match else None
            i += 1
            continue
        indent, ticks, language = fence.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        if language == "python":
            body = [line[len(indent):] for line in lines[i + 1:end]]
            found.append(Block(page, i + 2, marked or 1,
                               "\n".join(body) + "\n"))
        marked, i = None, end + 1
    return found


OUTPUT = "<!-- output -->"


def outputs(page):
    """**Returns:** `(ranks, text)` for every `text` block of `page` marked as output, with
    the ranks of the launch whose Python block comes before it."""
    lines = pathlib.Path(page).read_text().splitlines()
    found, ranks, marked = [], None, False
    python = {b.line - 1: b.ranks for b in blocks(page)}  # fence line (1-based) -> ranks
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            if lines[i].strip():
                marked = lines[i].strip() == OUTPUT
            i += 1
            continue
        ticks, language = fence.group(2), fence.group(3)
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        if i + 1 in python:
            ranks = python[i + 1]
        elif language == "text" and marked:
            found.append((ranks, "\n".join(lines[i + 1:end])))
        marked, i = False, end + 1
    return found


def masked(text):
    """**Returns:** `text`'s non-blank lines with numbers and runs of spaces masked."""
    number = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
    return [" ".join(number.sub("#", line).split()) for line in text.splitlines()
            if line.strip()]


def launches(page):
    """**Returns:** the rank counts `page`'s blocks run under, each once, in order."""
    return list(dict.fromkeys(b.ranks for b in blocks(page)))


def public():
    """**Returns:** (qualified name, object) for every public name of `distop` and
    `distop.linalg`, and their public members defined in distop."""
    import inspect

    import distop
    import distop.linalg

    found = [(f"distop.{n}", getattr(distop, n)) for n in dir(distop)
             if not n.startswith("_") and n not in ("importlib", "linalg")]
    found += [(f"distop.linalg.{n}", getattr(distop.linalg, n)) for n in distop.linalg.__all__]
    found.append(("distop.linalg", distop.linalg))
    members = []
    for name, obj in found:
        if inspect.isclass(obj):
            members += [(f"{name}.{m}", v) for m, v in vars(obj).items()
                        if not m.startswith("_") and (callable(v) or isinstance(v, property))]
    return found + members


def docstring_blocks():
    """**Returns:** the Python blocks of the public API's docstrings."""
    import inspect

    found = []
    for name, obj in public():
        doc = inspect.getdoc(obj) or ""
        found += blocks_in(doc, pathlib.Path(name))
    return found


def run_docstrings():
    """Run every docstring's blocks in one process, each in a namespace of its own."""
    import traceback

    import jax

    for block in docstring_blocks():
        jax.config.update("jax_enable_x64", False)  # JAX's default, as in a new process
        try:
            exec(compile(block.code, f"{block.page} docstring", "exec"),  # noqa: S102
                 {"__name__": "__main__"})
        except BaseException:
            print(f"FAILED in the docstring block of {block.page}\n" + traceback.format_exc(),
                  flush=True)
            sys.exit(1)
    print("rank 0 of 1: ok", flush=True)


def run(pages_, ranks):
    """Run the blocks of each page of `pages_` for `ranks` ranks, a page at a time, each in
    one namespace of its own as in a process of its own, in page order. Rank 0 prints
    what every rank printed during each page in one frame (`=== page PAGE: begin` ...
    `=== page PAGE: end`), then every rank its success line."""
    import contextlib
    import io
    import traceback

    import jax
    from mpi4py import MPI

    import distop

    comm = MPI.COMM_WORLD
    for page in pages_:
        where, printed = "?", io.StringIO()
        settings = distop.configure()
        saved = {"check_collectives": settings.check_collectives, "watchdog": settings.watchdog}
        jax.config.update("jax_enable_x64", False)  # JAX's default, as in a new process
        scope = {"__name__": "__main__"}
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                for block in blocks(page):
                    if block.ranks == ranks:
                        where = f"{block.page.relative_to(ROOT)}:{block.line}"
                        # (blank lines first, so that a traceback's line numbers are the
                        # page's)
                        code = compile("\n" * (block.line - 1) + block.code,
                                       str(block.page.relative_to(ROOT)), "exec")
                        exec(code, scope)  # noqa: S102 - the docs' own code
        except BaseException:
            print(f"{printed.getvalue()}\nrank {comm.rank} of {comm.size}: FAILED in the "
                  f"block at {where}\n" + traceback.format_exc(), flush=True)
            if comm.size > 1:
                comm.Abort(1)
            sys.exit(1)
        distop.configure(**saved)
        texts = comm.gather(printed.getvalue(), root=0)
        if comm.rank == 0:
            name = page.relative_to(ROOT)
            print(f"=== page {name}: begin\n"
                  + "".join(t if t.endswith("\n") or not t else t + "\n" for t in texts)
                  + f"=== page {name}: end", flush=True)
    comm.Barrier()  # (every page's output first, then the success lines)
    print(f"rank {comm.rank} of {comm.size}: ok", flush=True)


def frame(printed, page):
    """**Returns:** what every rank printed while `run` ran `page` (a path under ROOT)."""
    name = re.escape(str(page))
    found = re.search(rf"^=== page {name}: begin\n(.*?)^=== page {name}: end$", printed,
                      re.MULTILINE | re.DOTALL)
    assert found, f"no output of {page}:\n{printed}"
    return found.group(1)


if __name__ == "__main__":
    if sys.argv[1:] == ["--docstrings"]:
        run_docstrings()
    else:  # (PAGE... RANKS)
        run([ROOT / page for page in sys.argv[1:-1]], int(sys.argv[-1]))
