"""Two versions of distop side by side: the suite's matvec and overhead tables of each,
and their ratios, measured in one run with the versions alternating.

    OMP_NUM_THREADS=1 python benchmarks/compare.py --base REV [--ranks 1 2 4] [--rounds 2]

`REV` is any git revision (a commit, a tag, `main~3`), checked out into a temporary
worktree, or a folder that holds the other version's tree (as `git archive` writes
it, for a machine without the repository's history); each version runs its own
`benchmarks/suite.py` with its own package (`PYTHONPATH`), so private details the
suite reads may differ between them.
Every cell is the median over the rounds of what the suite reports (per-call times,
the max over ranks of each rank's median). Columns that are the same code in both
versions (`hand`, the hand-written script) show how much the machine itself varied.
Failed suite jobs of either version are printed after the tables, and the script then
exits non-zero.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENTRIES = ("run", "compute_totals", "run+totals", "run_and_compute_totals")
MATVEC = ("hand", "lean", "io_cb")  # (hand: the same code in both: the machine's noise)
OVERHEAD = ("HostCall", "empty program", "program 1 call", "program 16 fused",
            "Problem.run", "Problem.run(x=)")


def run_suite(tree, args, out):
    """Run `tree`'s suite with `tree`'s distop. **Returns:** its JSON (`results`, `failures`)."""
    command = [sys.executable, str(tree / "benchmarks" / "suite.py"), "--sections",
               *args.sections, "--ranks", *map(str, args.ranks), "--json", str(out)]
    if args.quick:
        command.append("--quick")
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if proc.returncode != 0 and not out.exists():
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


def cells(results):
    """**Returns:** (table, row, column) -> seconds, from one run of the suite."""
    found = {}
    for p, section in results.get("matvec", {}).items():
        for row in section["rows"]:
            for variant in MATVEC:
                for entry, value in zip(ENTRIES, row["median"].get(variant, ())):
                    found["matvec", (p, row["K"], entry), variant] = value
    for p, section in results.get("overhead", {}).items():
        medians = section["rows"][0]["median"]
        for name in OVERHEAD:
            if name in medians:
                found["overhead", (p,), name] = medians[name]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True,
                        help="the git revision, or the folder of a tree, to compare with")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sections", nargs="+", default=["matvec", "overhead"],
                        choices=["matvec", "overhead"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        given = pathlib.Path(args.base)
        base = given.resolve() if given.is_dir() else pathlib.Path(tmp) / "base"
        if not given.is_dir():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                            str(base), args.base], check=True)
        try:
            seen = {"base": [], "new": []}
            failed = {"base": [], "new": []}
            for r in range(args.rounds):
                for name, tree in (("base", base), ("new", ROOT)):
                    out = pathlib.Path(tmp) / f"{name}-{r}.json"
                    recorded = run_suite(tree, args, out)
                    seen[name].append(cells(recorded["results"]))
                    failed[name] += [(r + 1, f) for f in recorded.get("failures", [])]
                    print(f"# round {r + 1} of {args.rounds}: {name} done", flush=True)
        finally:
            if not given.is_dir():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(base)], check=False)
    medians = {name: {key: statistics.median(run[key] for run in runs if key in run)
                      for key in set().union(*runs)} for name, runs in seen.items()}
    print(f"\n# new (this tree) against base ({args.base}): per call (us), median over "
          f"{args.rounds} alternating rounds; ratio new/base")
    for table in args.sections:
        columns = MATVEC if table == "matvec" else OVERHEAD
        keys = sorted({k[1] for k in medians["new"] if k[0] == table},
                      key=lambda k: (int(k[0]), *k[1:]) if k[0].isdigit() else (99, *k[1:]))
        head = ["P", "K", "entry"] if table == "matvec" else ["P"]
        print(f"\n# {table}")
        print("  ".join(f"{h:>22}" for h in head + [f"{c} base/new/ratio" for c in columns]))
        for key in keys:
            row = [f"{k!s:>22}" for k in key]
            for column in columns:
                b = medians["base"].get((table, key, column))
                n = medians["new"].get((table, key, column))
                row.append(f"{'-':>22}" if b is None or n is None else
                           f"{b * 1e6:8.1f} {n * 1e6:8.1f} {n / b:4.2f}")
            print("  ".join(row))
    for name, failures in failed.items():
        for r, failure in failures:
            report = "\n".join(failure["report"].splitlines()[-20:])
            print(f"\n# FAILED: {name}, round {r}: section {failure['section']} on "
                  f"{failure['ranks']} rank(s)\n{report}", file=sys.stderr)
    return 1 if failed["base"] or failed["new"] else 0


if __name__ == "__main__":
    sys.exit(main())
