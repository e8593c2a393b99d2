"""Samples split over the ranks for data-parallel work: `shard`, padded so that every
rank runs the same steps."""

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._agreement import comm as _comm
from .._agreement.coordinator import stable_hash
from .._mpi.runtime import world


def shard(n_samples: int, comm: Any = None,
          counts: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split `n_samples` over the ranks so that every rank gets the same count.

    Rank r takes a contiguous share: as even as can be (sizes differ by at most one),
    or `counts[r]` samples. It pads its share by wrap-around to the largest share.
    Padding samples carry weight 0, so a weighted loss is exact.
    Every rank then runs the same number of steps and collectives.

    **Arguments:**
    - `n_samples`: the number of samples, N >= 1.
    - `comm`: the communicator (default `MPI.COMM_WORLD`).
    - `counts`: how many samples each rank takes, in rank order: P non-negative
      integers summing to N, the same on every rank (checked with one small
      collective). A rank may take none. Default: an even split.

    **Returns:** `(indices, weights)`: int64 and float64 arrays, of length ceil(N / P)
    by default and max(counts) with `counts`.

    **Raises:** `ValueError` for fewer than one sample, or `counts` that are not P
    non-negative integers summing to N (on every rank, where the ranks pass different
    `counts`).

    ```python
    import distop

    indices, weights = distop.shard(10)
    assert len(indices) == len(weights)  # ceil(10 / P) on every rank
    ```
    """
    comm = world() if comm is None else comm
    size, rank = comm.Get_size(), comm.Get_rank()
    if int(n_samples) < 1:
        raise ValueError(f"shard(n_samples={n_samples}): need at least one sample.")
    n = int(n_samples)
    if counts is None:
        base, extra = divmod(n, size)
        start, count = rank * base + min(rank, extra), base + (rank < extra)
        per_rank = -(-n // size)
    else:
        shares = _checked_counts(n, counts, comm)
        start, count, per_rank = sum(shares[:rank]), shares[rank], max(shares)
    indices = (start + np.arange(per_rank)) % n
    weights = (np.arange(per_rank) < count).astype(np.float64)
    return indices.astype(np.int64), weights


def _checked_counts(n: int, counts: Sequence[int], comm: Any) -> list[int]:
    """**Returns:** `counts` as a list of ints, after checking that they split `n`
    samples over `comm`'s ranks alike on every rank.

    **Raises:** `ValueError` on every rank, where counts are wrong on some rank or
    differ between ranks (found by one reduction of three numbers)."""
    size = comm.Get_size()
    try:
        shares = [operator.index(c) for c in counts]
    except TypeError:
        shares = []
    wrong = len(shares) != size or min(shares, default=0) < 0 or sum(shares) != n
    h = stable_hash(tuple(shares))
    # (wrong where some rank raised the flag)
    top = _comm.most(comm, np.array([h, -h, int(wrong)], np.int64))
    where = f"shard(n_samples={n}, counts={list(counts)!r}) on rank {comm.Get_rank()}"
    if top[2]:
        raise ValueError(f"{where}: expected {size} non-negative integers (one per rank) "
                         f"summing to {n}{'' if wrong else ' (on some other rank)'}.")
    if top[0] != -top[1]:
        raise ValueError(f"{where}: the ranks passed different counts; pass the same "
                         "counts on every rank.")
    return shares
