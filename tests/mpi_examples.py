"""Several examples in one MPI launch, each paying JAX's start-up once:
`mpiexec -n P python tests/mpi_examples.py NAME [ARGS...] [-- NAME [ARGS...]]...`
(run by tests/test_mpi.py).

Each example's `main()` runs in turn with its arguments, its output captured on every
rank. Then rank 0 prints every rank's output, rank by rank, in one frame per example:

    === example NAME: begin
    ...
    === example NAME: exit codes [0, 0]

so that each test reads its own example's frame. An example that raises prints its
traceback and aborts the launch.
"""

import contextlib
import importlib
import inspect
import io
import sys
import traceback

from helpers import share_compilations
from mpi4py import MPI


def run(name, args, comm):
    """Run example `name`'s `main()` with `args`; **Returns:** its exit code and what it
    printed on this rank."""
    module = importlib.import_module(name)
    printed = io.StringIO()
    argv, sys.argv = sys.argv, [module.__file__, *args]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                takes_argv = bool(inspect.signature(module.main).parameters)
                code = module.main(args) if takes_argv else module.main()
            except SystemExit as exit:  # (argparse's errors)
                code = exit.code
    except BaseException:
        print(f"rank {comm.rank} of {comm.size}: example {name} raised, after printing:\n"
              f"{printed.getvalue()}\n{traceback.format_exc()}", flush=True)
        comm.Abort(1)
    finally:
        sys.argv = argv
    return 0 if code is None else code, printed.getvalue()


def main(argv):
    comm = MPI.COMM_WORLD
    share_compilations()
    runs, current = [], None
    for word in argv:
        if word == "--" or current is None:
            current = [] if word == "--" else [word]
            runs.append(current)
        else:
            current.append(word)
    for name, *args in runs:
        code, printed = run(name, args, comm)
        codes, texts = comm.gather(code, root=0), comm.gather(printed, root=0)
        if comm.rank == 0:
            print(f"=== example {name}: begin\n"
                  + "".join(t if t.endswith("\n") or not t else t + "\n" for t in texts)
                  + f"=== example {name}: exit codes {codes}", flush=True)
        comm.Barrier()
    print(f"rank {comm.rank} of {comm.size}: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
