"""Moving the row blocks of distributed arrays between ranks, for the built-in collectives.

Every helper takes a whole batch at once, a leading axis B before the rows, so that a
batch costs one collective. Blocks may differ in size between ranks and be empty.
"""

import math
from collections.abc import Sequence
from typing import Any

import numpy as np


def even_counts(total: int, parts: int) -> list[int]:
    """**Returns:** `total` rows split into `parts` counts, as even as possible, the
    larger ones first."""
    base, extra = divmod(int(total), parts)
    return [base + (r < extra) for r in range(parts)]


def with_batch(x: np.ndarray, batched: bool) -> np.ndarray:
    """**Returns:** `x` with a leading batch axis: itself if `batched`, else `x[None]`."""
    return x if batched else x[None]


def without_batch(x: np.ndarray, batched: bool) -> np.ndarray:
    """**Returns:** `x` as the method returns it: itself if `batched`, else `x[0]`."""
    return x if batched else x[0]


def as_rows(x: np.ndarray, batched: bool) -> np.ndarray:
    """**Returns:** `x` as a (B, n, ...) block; a 0-d value per rank as one row."""
    x = with_batch(x, batched)
    return x[:, None] if x.ndim == 1 else x


def rows_first(block: np.ndarray) -> np.ndarray:
    """**Returns:** a (B, n, ...) block as a C-contiguous (n, B, ...) array, whose rows
    are each one contiguous piece of memory (what a v-collective counts in)."""
    return np.ascontiguousarray(np.moveaxis(block, 1, 0))


def batch_first(rows: np.ndarray) -> np.ndarray:
    """**Returns:** an (n, B, ...) array as a C-contiguous (B, n, ...) block."""
    return np.ascontiguousarray(np.moveaxis(rows, 0, 1))


def block_counts(comm: Any, rows: int, what: str = "rows") -> list[int]:
    """Every rank's `rows`, the size of one of a method's blocks.

    Gathered (one `allgather`) the first time a call site asks, and kept with the site
    where it has one (`GuardedComm.site`: in a Problem's program, where the shapes of
    every call site were agreed when it was built); gathered on every call elsewhere.

    **Arguments:**
    - `comm`: the method's communicator (declare `Allgather`).
    - `rows`: this rank's size.
    - `what`: which size of the method this is (a method asking for two keeps both).

    **Returns:** the sizes, one per rank.
    """
    site = getattr(comm, "site", None)
    key = ("counts", what, int(rows))
    if site is not None and key in site:
        return site[key]
    counts = list(comm.allgather(int(rows)))
    if site is not None:
        site[key] = counts
    return counts


def gather_blocks(comm: Any, block: np.ndarray) -> np.ndarray:
    """Gather every rank's row block on every rank.

    **Arguments:**
    - `comm`: the communicator (declare `Allgather` and `Allgatherv`).
    - `block`: this rank's (B, n_r, ...) block.

    **Returns:** the (B, N, ...) concatenation of every rank's block, on every rank.
    """
    counts = block_counts(comm, block.shape[1], "gathered")
    if block.shape[0] == 1:  # (one batch row: its rows are already rows first)
        moved = np.ascontiguousarray(block[0])
        out = np.empty((sum(counts),) + moved.shape[1:], block.dtype)
        tail = math.prod(moved.shape[1:])
        comm.Allgatherv(moved, [out, [c * tail for c in counts]])
        return out[None]
    moved = rows_first(block)
    tail = int(np.prod(moved.shape[1:]))
    out = np.empty((sum(counts),) + moved.shape[1:], block.dtype)
    comm.Allgatherv(moved, [out, [c * tail for c in counts]])
    return batch_first(out)


def transpose_blocks(comm: Any, a: np.ndarray, out_counts: Sequence[int]) -> np.ndarray:
    """The distributed transpose of a 2-D array split by rows.

    **Arguments:**
    - `comm`: the communicator (declare `Allgather` and `Alltoallv`).
    - `a`: (B, n_r, C), this rank's rows of a global (B, R, C).
    - `out_counts`: the rows of the transpose per rank (adding up to C).

    **Returns:** (B, out_counts[r], R), this rank's rows of the transpose.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    row_counts = block_counts(comm, a.shape[1], "transposed")
    cols = np.cumsum([0] + list(out_counts))
    batch = a.shape[0]
    send = np.concatenate([a[:, :, cols[s]:cols[s + 1]].ravel() for s in range(size)])
    send_counts = [batch * a.shape[1] * out_counts[s] for s in range(size)]
    recv_counts = [batch * row_counts[q] * out_counts[rank] for q in range(size)]
    recv = np.empty(sum(recv_counts), a.dtype)
    comm.Alltoallv([send, send_counts], [recv, recv_counts])
    pieces = np.split(recv, np.cumsum(recv_counts)[:-1])
    stacked = np.concatenate([p.reshape(batch, row_counts[q], out_counts[rank])
                              for q, p in enumerate(pieces)], axis=1)  # (B, R, m_r)
    return np.ascontiguousarray(stacked.transpose(0, 2, 1))
