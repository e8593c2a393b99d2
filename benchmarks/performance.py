"""python benchmarks/performance.py [--json benchmarks/results.json] [--check]

Write docs/performance.md: the page's text from benchmarks/performance.md.in, with the
line `<!-- suite tables -->` replaced by every table of the suite, rendered from the
results file that `benchmarks/suite.py` writes. The tables are printed by the suite's
own table functions, so they read as the suite printed them; the settings, versions and
any failed job of that run are stated above them. Nothing else on the page is generated:
the template says which tables it quotes as recorded, and the command behind each.

`--check` writes nothing and exits 1 where docs/performance.md is not what this script
would write (the tests run it so).
"""

import argparse
import contextlib
import importlib.util
import io
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TEMPLATE = HERE / "performance.md.in"
PAGE = ROOT / "docs" / "performance.md"
MARK = "<!-- suite tables -->"
TITLES = {"matvec": "The matvec", "chain": "Chains of operator calls",
          "message": "Message size", "large": "The large sparse matvec",
          "overhead": "distop's own work per call"}


def _suite():
    """**Returns:** benchmarks/suite.py as a module (its table functions)."""
    spec = importlib.util.spec_from_file_location("suite", HERE / "suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _words(value):
    """**Returns:** a setting as it is written on the suite's command line."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def tables(recorded):
    """Render every section of a results file as the suite prints it.

    **Arguments:**
    - `recorded`: the results file's contents (`settings`, `results`, `failures`).

    **Returns:** Markdown: the run's settings and versions, then one heading and one
    `text` block per section, and a note per failed job.
    """
    suite = _suite()
    settings = argparse.Namespace(**recorded["settings"])
    results, failures = recorded["results"], recorded.get("failures", [])
    versions = [line.removeprefix("# ") for line in suite.notes(results)]
    options = " ".join(
        f"--{name.replace('_', '-')} {_words(value)}"
        for name, value in sorted(recorded["settings"].items())
        if name not in ("json", "quick", "sections", "timeout", "worker") and value is not None)
    lines = ["The tables below are rendered by `benchmarks/performance.py` from "
             "`benchmarks/results.json`, which `benchmarks/suite.py` wrote "
             f"({'with `--quick`, ' if settings.quick else ''}settings: `{options}`).",
             *(f"Run with {line}." if line.startswith("jax ") else
               f"{line[0].upper()}{line[1:]}." for line in versions), ""]
    for section, by_ranks in results.items():
        if not by_ranks:
            continue
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            suite.TABLES[section](by_ranks, settings)
        ranks = ", ".join(by_ranks)
        seconds = sum(r["seconds"] for r in by_ranks.values())
        lines += [f"### {TITLES.get(section, section)}", "",
                  f"Section `{section}`, on {ranks} rank(s); its jobs took {seconds:.0f} s.",
                  "", "```text", printed.getvalue().strip("\n"), "```", ""]
    for failure in failures:
        lines += [f"The `{failure['section']}` job on {failure['ranks']} rank(s) failed; "
                  "its tables lack those rows.", ""]
    return "\n".join(lines)


def page(results_path):
    """**Returns:** the text of docs/performance.md for the results at `results_path`."""
    template = TEMPLATE.read_text()
    if template.count(MARK) != 1:
        raise SystemExit(f"{TEMPLATE}: expected the line {MARK} once")
    recorded = json.loads(pathlib.Path(results_path).read_text())
    return template.replace(MARK, tables(recorded).rstrip("\n"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--json", default=str(HERE / "results.json"))
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = page(args.json)
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is not what {__file__} makes of {args.json}: run it again")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
