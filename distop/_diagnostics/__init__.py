"""What a user reads about a job: profiles (`profile`) and their reports (`report`),
`python -m distop doctor` (`doctor`), and the progress of long work (`progress`).

May import `_safety`, `_mpi` and the leaf modules."""
