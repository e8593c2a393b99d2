"""What a user reads about a job: profiles (`profile`) and their reports (`report`),
and `python -m distop doctor` (`doctor`).

May import `_safety`, `_mpi` and the leaf modules."""
