"""The built-in halo exchange: each rank's block of a distributed array, extended by the
rows around it that other ranks own, for stencils.

The halo of a block is the `width` global rows just before it and just after it,
wherever they live: on the neighbouring ranks, or, where those own fewer rows (or
none), on as many ranks further out as the rows span. So every block size works, zero
included, and the result is always this rank's window of the global array.

Each rank plans its own part of the exchange once per set of block sizes (`_Plan`):
which ranks own its halo rows, and which ranks take rows of its block. Each call then
sends and receives one message per such peer and no other: two neighbours where every
block has at least `width` rows. Inside a Problem's program the block sizes of a call
site are fixed when the program is built, and the plan is kept with the site; elsewhere
(plain JAX code, where each rank compiles on its own) every call gathers the block sizes
first.
"""

from typing import Any

import jax
import numpy as np

from .._operators.operator import DistributedOperator
from .blocks import batch_first, rows_first, with_batch, without_batch

_BOUNDARIES = ("zero", "periodic")
_TAG = 7  # the tag of the halo's messages (one call at a time runs on a communicator)


class _Plan:
    """This rank's part of the halo exchange, for one set of block sizes.

    **Arguments:**
    - `counts`: the rows of every rank's block.
    - `width`: the rows of each halo.
    - `periodic`: whether the global ends wrap around.
    - `rank`: this rank.

    `takes` lists, per rank p owning rows of this rank's halo (ascending), the places in
    the halo (2 * width rows: before, then after) of those rows, in p's order; `gives`
    lists, per rank q whose halo takes rows of this block (ascending), the local indices
    of those rows in the order q takes them. A rank's own rows in its halo (a periodic
    wrap onto itself) are among both, and copied without a message.
    """

    def __init__(self, counts: list[int] | tuple[int, ...], width: int, periodic: bool,
                 rank: int) -> None:
        counts_ = np.asarray(counts, dtype=np.int64)
        ends = np.cumsum(counts_)
        starts = ends - counts_
        total = int(ends[-1]) if len(counts_) else 0
        offsets = np.concatenate([np.arange(-width, 0), np.arange(width)])
        # (ranks, 2 width) global rows of every rank's halo: before its start, after its end
        rows = np.where(offsets < 0, starts[:, None], ends[:, None]) + offsets
        if periodic and total:
            rows %= total
        else:  # past a global end, or nothing to wrap around: zero rows
            rows[(rows < 0) | (rows >= total)] = -1
        owners = np.searchsorted(ends, rows, side="right")
        owners[rows < 0] = -1
        mine = owners[rank]
        self.takes = [(int(p), np.flatnonzero(mine == p))
                      for p in np.unique(mine[mine >= 0])]
        wanting = np.flatnonzero((owners == rank).any(axis=1))
        self.gives = [(int(q), rows[q][owners[q] == rank] - starts[rank]) for q in wanting]


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

    input_kinds = "varying"
    output_kinds = "varying"

    width: int = 1
    boundary: str = "zero"
    forward_collectives = ("allgather", "Isend", "Irecv")
    vjp_collectives = ("allgather", "Isend", "Irecv")
    jvp_collectives = ("allgather", "Isend", "Irecv")
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
        """**Returns:** this rank's plan for blocks of `rows` rows here: kept with the
        call site where it has one (see `GuardedComm.site`), else made from every
        rank's block size, gathered now."""
        site = getattr(comm, "site", None)
        key = ("halo", rows)
        if site is not None and key in site:
            return site[key]
        plan = _Plan(comm.allgather(rows), int(self.width), self.boundary == "periodic",
                     comm.Get_rank())
        if site is not None:
            site[key] = plan
        return plan

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        block = rows_first(with_batch(x, batched))  # (n, B, ...)
        plan = self._plan(comm, block.shape[0])
        halo = _exchange(comm, block, plan.gives, plan.takes, 2 * int(self.width))
        w = int(self.width)
        out = np.concatenate([halo[:w], block, halo[w:]])
        return without_batch(batch_first(out), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        window = rows_first(with_batch(y_bar, batched))  # (n + 2w, B, ...)
        w = int(self.width)
        n = window.shape[0] - 2 * w
        plan = self._plan(comm, n)
        halo_bar = np.concatenate([window[:w], window[w + n:]])
        # the transpose of the forward's exchange: halo places back to owners' rows
        x_bar = np.array(window[w:w + n])
        _exchange(comm, halo_bar, plan.takes, plan.gives, n, into=x_bar)
        return without_batch(batch_first(x_bar), batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


def _exchange(comm: Any, rows: np.ndarray, sends: list[tuple[int, np.ndarray]],
              places: list[tuple[int, np.ndarray]], length: int,
              into: np.ndarray | None = None) -> np.ndarray:
    """Send each rank q of `sends` the `rows` its index array picks; put the rows
    received from each rank p of `places` at its places in an array of `length` rows:
    zeros elsewhere, or, given `into`, added to it (a place may receive several rows).
    One message per peer; rows for this rank itself are copied.

    **Returns:** that array.
    """
    rank = comm.Get_rank()
    tail = rows.shape[1:]
    out = np.zeros((length,) + tail, rows.dtype) if into is None else into
    received = [(p, where, np.empty((len(where),) + tail, rows.dtype))
                for p, where in places if p != rank]
    requests = [comm.Irecv(buffer, source=p, tag=_TAG) for p, _, buffer in received]
    outgoing = [(q, np.ascontiguousarray(rows[picks])) for q, picks in sends]
    requests += [comm.Isend(data, dest=q, tag=_TAG) for q, data in outgoing if q != rank]
    own = dict(outgoing).get(rank)
    for p, where in places:
        if p == rank and own is not None:
            _put(out, where, own, into is not None)
    if requests:
        requests[0].Waitall(requests)
    for _, where, buffer in received:
        _put(out, where, buffer, into is not None)
    return out


def _put(out: np.ndarray, where: np.ndarray, rows: np.ndarray, add: bool) -> None:
    """Write (or, where `add`, add: a place may receive several rows) `rows` at the
    places `where` of `out`."""
    if add:
        np.add.at(out, where, rows)
    else:
        out[where] = rows
