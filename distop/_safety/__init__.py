"""What keeps a job from hanging or going silently wrong: the watchdog that ends a
stuck job (`watchdog`, `watchdog_channel`), checking mode (`checking`) and the guard on
the communicators given to user methods (`guard`).

May import `_mpi` and the leaf modules."""
