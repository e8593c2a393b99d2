"""The built-in halo exchange: each rank's block of a distributed array, extended by the
rows around it that other ranks own, for stencils.

The halo of a block is the `width` global rows just before it and just after it,
wherever they live: on the neighbouring ranks, or, where those own fewer rows (or
none), on as many ranks further out as the rows span. So every block size works, zero
included, and the result is always this rank's window of the global array. One
`Alltoallv` moves every rank's rows (only the ranks that send or receive rows move
data).
"""

from typing import Any

import jax
import numpy as np

from ._blocks import batch_first, rows_first, with_batch, without_batch
from ._operator import DistributedOperator

_BOUNDARIES = ("zero", "periodic")


class _Plan:
    """Where the halo rows of every rank come from, for one set of block sizes.

    **Arguments:**
    - `counts`: the rows of every rank's block.
    - `width`: the rows of each halo.
    - `periodic`: whether the global ends wrap around.

    Per rank q, `needed[q]` lists the 2 * width global rows of its halo (-1 for a zero
    row past a global end) and `owners[q]` the rank owning each (-1 for none).
    """

    def __init__(self, counts: list[int], width: int, periodic: bool) -> None:
        self.counts = counts
        ends = np.cumsum(counts)
        self.starts = ends - np.asarray(counts, dtype=ends.dtype)
        total = int(ends[-1]) if len(counts) else 0
        self.needed, self.owners = [], []
        for start, end in zip(self.starts, ends):
            rows = np.concatenate([np.arange(start - width, start),
                                   np.arange(end, end + width)]).astype(np.int64)
            if periodic and total:
                rows %= total
            else:  # past a global end, or nothing to wrap around: zero rows
                rows[(rows < 0) | (rows >= total)] = -1
            owner = np.searchsorted(ends, rows, side="right")
            owner[rows < 0] = -1
            self.needed.append(rows)
            self.owners.append(owner)

    def sent_to(self, dest: int, rank: int) -> np.ndarray:
        """**Returns:** the rows of `rank`'s block (local indices) that `dest`'s halo
        takes, in the order it takes them."""
        return self.needed[dest][self.owners[dest] == rank] - self.starts[rank]

    def taken_from(self, source: int, rank: int) -> np.ndarray:
        """**Returns:** the places in `rank`'s halo of the rows that `source` owns."""
        return np.flatnonzero(self.owners[rank] == source)


class HaloExchange(DistributedOperator):
    """This rank's block with `width` rows of halo on each side.

    Distributed (n_r, ...) in; this rank's (n_r + 2 width, ...) window of the global
    array out (rank-local).
    The halo rows are the global rows just before and just after the block.
    They come from the previous and next ranks that own rows, and from ranks further out
    where those own fewer than `width` (empty blocks are skipped).
    A rank with no rows gets the 2 width rows around its place.
    Past the global ends the halo is zeros (`boundary="zero"`) or wraps around
    (`boundary="periodic"`; with no rows at all, zeros).
    Its VJP sends the halo's cotangents back to the ranks owning those rows, which add
    them to their rows' cotangents.
    Its JVP exchanges the tangents' halos.

    **Arguments:**
    - `width`: the rows of each halo (default 1; 0 returns the block).
    - `boundary`: `"zero"` (default) or `"periodic"`.
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's block returns its window.

    **Raises:** `ValueError` for a `width` that is not an integer >= 0 or another
    `boundary`; `ValueError` when traced, for a 0-d input.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np

    import distop

    jax.config.update("jax_enable_x64", True)
    halo = distop.HaloExchange()
    stencil = distop.Problem(lambda x: {"y": (lambda h: h[:-2] + h[1:-1] + h[2:])(halo(x))},
                             {"x": np.arange(4.0)}, distributed={"x", "y"})
    assert list(stencil.run()["y"]) == [1.0, 3.0, 6.0, 5.0]  # in one process
    ```
    """

    width: int = 1
    boundary: str = "zero"
    forward_collectives = ("Allgather", "Alltoallv")
    vjp_collectives = ("Allgather", "Alltoallv")
    jvp_collectives = ("Allgather", "Alltoallv")
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def __check_init__(self) -> None:
        if isinstance(self.width, bool) or not isinstance(self.width, (int, np.integer)) \
                or self.width < 0:
            raise ValueError(f"HaloExchange(width={self.width!r}): expected an integer "
                             ">= 0, the rows of each halo.")
        if self.boundary not in _BOUNDARIES:
            raise ValueError(f"HaloExchange(boundary={self.boundary!r}): expected one of "
                             f"{list(_BOUNDARIES)}.")

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if not len(x.shape):
            raise ValueError("HaloExchange: expected a block of rows (an array of at "
                             "least one dimension); got a 0-d value.")
        rows = x.shape[0] + 2 * int(self.width)
        return jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype)

    def _plan(self, comm: Any, rows: int) -> _Plan:
        return _Plan(comm.allgather(rows), int(self.width),
                     self.boundary == "periodic")

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        block = rows_first(with_batch(x, batched))  # (n, B, ...)
        rank, size = comm.Get_rank(), comm.Get_size()
        plan = self._plan(comm, block.shape[0])
        sends = [plan.sent_to(q, rank) for q in range(size)]
        places = [plan.taken_from(p, rank) for p in range(size)]
        halo = self._exchange(comm, block, sends, places, 2 * int(self.width))
        w = int(self.width)
        out = np.concatenate([halo[:w], block, halo[w:]])
        return without_batch(batch_first(out), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        window = rows_first(with_batch(y_bar, batched))  # (n + 2w, B, ...)
        rank, size = comm.Get_rank(), comm.Get_size()
        w = int(self.width)
        n = window.shape[0] - 2 * w
        plan = self._plan(comm, n)
        halo_bar = np.concatenate([window[:w], window[w + n:]])
        # the transpose of the forward's exchange: halo places back to owners' rows
        sends = [plan.taken_from(q, rank) for q in range(size)]
        places = [plan.sent_to(p, rank) for p in range(size)]
        x_bar = np.array(window[w:w + n])
        self._exchange(comm, halo_bar, sends, places, n, into=x_bar)
        return without_batch(batch_first(x_bar), batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)

    @staticmethod
    def _exchange(comm: Any, rows: np.ndarray, sends: list[np.ndarray],
                  places: list[np.ndarray], length: int,
                  into: np.ndarray | None = None) -> np.ndarray:
        """Send rank q the `rows` indexed by `sends[q]`; put the rows received from
        rank p at `places[p]` of an array of `length` rows: zeros elsewhere, or, given
        `into`, added to it (a place may receive several rows).

        **Returns:** that array.
        """
        tail = rows.shape[1:]
        unit = int(np.prod(tail, dtype=np.int64))
        send = np.concatenate([rows[s] for s in sends]) if sends else rows[:0]
        recv = np.empty((sum(len(p) for p in places),) + tail, rows.dtype)
        comm.Alltoallv([np.ascontiguousarray(send), [len(s) * unit for s in sends]],
                       [recv, [len(p) * unit for p in places]])
        out = np.zeros((length,) + tail, rows.dtype) if into is None else into
        offset = 0
        for p in places:
            if into is None:
                out[p] = recv[offset:offset + len(p)]
            else:
                np.add.at(out, p, recv[offset:offset + len(p)])
            offset += len(p)
        return out
