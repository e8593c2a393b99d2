"""MPI itself: starting it and checking the launcher (`runtime`, `launch`), aborting,
failure notices and exit, tracebacks without distop's frames (`tracebacks`), and the
names of the MPI calls that communicate (`names`).

Imports only `_errors` and `_config` of the package."""
