"""How the ranks agree: the private communicator (`comm`) and the coordinator that
compares every rank's request before a call runs (`coordinator`).

May import `_safety`, `_mpi` and the leaf modules."""
