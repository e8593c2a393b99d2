"""`python -m distop doctor`: check what a job runs on (see `_doctor`)."""

import sys
from collections.abc import Sequence

USAGE = """usage: python -m distop doctor
       mpiexec -n P python -m distop doctor

doctor: the MPI library and launcher, ranks per node, cores, CPU affinity and threads
per rank, jax's settings, a latency probe, the same compute probe on every rank (the
slowest named), the load average and the CPU time the ranks get, every warning with
its fix; exit status 0 when healthy, 1 when a warning stands."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command named on the command line.

    **Arguments:**
    - `argv`: the arguments after `python -m distop` (default: `sys.argv[1:]`).

    **Returns:** the exit status (2 for an unknown command).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "doctor":
        print(f"python -m distop: unknown command {argv[0]!r}.\n{USAGE}", file=sys.stderr)
        return 2
    from ._diagnostics.doctor import doctor

    return doctor(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
