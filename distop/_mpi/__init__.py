"""MPI itself: starting it and checking the launcher (`runtime`, `launch`), aborting and
exit (`runtime`), the failure notices by which the ranks report a failure once
(`notices`), tracebacks without distop's frames (`tracebacks`), and the names of the MPI
calls that communicate (`names`).

Imports only `_errors` and `_config` of the package."""
