"""The built-in halo exchange: each rank's block of a distributed array, extended by the
rows around it that other ranks own, for stencils.

The halo of a block is the `width` global rows just before it and just after it,
wherever they live: on the neighbouring ranks, or, where those own fewer rows (or
none), on as many ranks further out as the rows span. So every block size works, zero
included, and the result is always this rank's window of the global array.

A call moves only the block's edge rows through the host: the operator call itself is
made on the `width` first and last rows of the block (`block_rows` set), and XLA places
the halo it returns around the block, so the work of a call is that of its messages,
whatever the block's size, and a reverse sweep keeps only the edge rows of each step.

Each rank plans its own part of the exchange once per set of block sizes (`_Plan`):
which ranks own its halo rows, and which ranks take rows of its block. Each call then
sends and receives one message per such peer and no other: two neighbours where every
block has at least `width` rows. Inside a Problem's program the block sizes of a call
site are fixed when the program is built, and the plan is kept with the site; elsewhere
(plain JAX code, where each rank compiles on its own) every call gathers the block sizes
first.
"""

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._operators.operator import DistributedOperator, apply, as_arrays

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
    of those rows in the order q takes them; `edge_gives` the same rows as indices into
    the block's edge rows (see `edge_rows`). A rank's own rows in its halo (a periodic
    wrap onto itself) are among both, and copied without a message. Each entry is
    (rank, indices, whether the indices are distinct), the last for the adjoint, which
    adds rows at those indices.

    The exchanges themselves are made once as `_Route`s: `forward` and `backward` for
    the edge rows (the call site's, `block_rows` set), `forward_block` and
    `backward_block` for a whole block.
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
        self.takes = [_entry(p, np.flatnonzero(mine == p)) for p in np.unique(mine[mine >= 0])]
        wanting = np.flatnonzero((owners == rank).any(axis=1))
        self.gives = [_entry(q, rows[q][owners[q] == rank] - starts[rank]) for q in wanting]
        n = int(counts_[rank]) if len(counts_) else 0
        self.edge_gives = [(q, _edge_index(where, n, width), unique)
                           for q, where, unique in self.gives]
        self.forward = _Route(self.edge_gives, self.takes, rank)
        self.backward = _Route(self.takes, self.edge_gives, rank)
        self.forward_block = _Route(self.gives, self.takes, rank)
        self.backward_block = _Route(self.takes, self.gives, rank)


class _Route:
    """One direction of a plan's exchange, made once: what each call sends, receives
    and copies, each index a slice where its rows are consecutive (then a message goes
    from, and where it is not added, arrives in, the rows' own memory).

    **Arguments:**
    - `sends`: per peer, the rows to send it (a plan's entries).
    - `places`: per peer, the places its rows go (a plan's entries).
    - `rank`: this rank (its own rows are copied, not sent).
    """

    __slots__ = ("disjoint", "own", "receives", "sends")

    def __init__(self, sends: list[tuple[int, np.ndarray, bool]],
                 places: list[tuple[int, np.ndarray, bool]], rank: int) -> None:
        self.sends = [(q, _span(picks)) for q, picks, _ in sends if q != rank]
        self.receives = [(p, _span(where), distinct, len(where))
                         for p, where, distinct in places if p != rank]
        mine = [picks for q, picks, _ in sends if q == rank]
        self.own = [(_span(mine[0]), _span(where), distinct)
                    for p, where, distinct in places if p == rank and mine]
        # whether every place receives one row at most, in consecutive runs: then adding
        # into zeros is placing, and rows received in order land in their places directly
        spans = [where for _, where, _, _ in self.receives] + [w for _, w, _ in self.own]
        taken = sorted((w.start, w.stop) for w in spans if type(w) is slice)
        self.disjoint = len(taken) == len(spans) and all(
            stop <= start for (_, stop), (start, _) in zip(taken, taken[1:]))


def _span(where: np.ndarray) -> slice | np.ndarray:
    """**Returns:** `where` as a slice where its indices are consecutive and
    ascending, else itself."""
    if len(where) and (np.diff(where) == 1).all():
        return slice(int(where[0]), int(where[-1]) + 1)
    return where


def _entry(peer: Any, where: np.ndarray) -> tuple[int, np.ndarray, bool]:
    """**Returns:** a plan's entry: the peer, its indices, whether they are distinct."""
    return int(peer), where, len(np.unique(where)) == len(where)


def edge_rows(n: int, width: int) -> int:
    """**Returns:** how many edge rows a block of `n` rows sends for halos of `width`:
    the first and last `width` rows, or the whole block where those overlap."""
    return n if n <= 2 * width else 2 * width


def _edge_index(where: np.ndarray, n: int, width: int) -> np.ndarray:
    """**Returns:** the local row indices `where` of a block of `n` rows as indices into
    its edge rows (see `edge_rows`). Other ranks' halos take only edge rows: a halo
    row lies within `width` rows of the block it surrounds, and blocks do not overlap."""
    if n <= 2 * width:
        return where
    assert not ((where >= width) & (where < n - width)).any()  # (see the docstring)
    return np.where(where < width, where, where - (n - 2 * width))


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
    - `block_rows`: set by the call itself, not by users (keyword): the operator then
      takes the block's edge rows (the first and last `width`, or the whole block where
      those overlap) of a block of `block_rows` rows, and returns the halo alone (2
      `width` rows: before, then after). Calling the operator makes one such call and
      places its halo around the block in XLA.

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
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

    width: int = 1
    boundary: str = "zero"
    block_rows: int | None = eqx.field(default=None, kw_only=True)
    forward_collectives = ("allgather", "Isend", "Irecv")
    vjp_collectives = ("allgather", "Isend", "Irecv")
    jvp_collectives = ("allgather", "Isend", "Irecv")
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True
    unbatched = "expand_dims"  # (the vjp's and jvp's inputs, which they do not read)

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
        w = int(self.width)
        rows = 2 * w if self.block_rows is not None else x.shape[0] + 2 * w
        return jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype)

    def __call__(self, *inputs: Any) -> Any:
        """This rank's window: the halo of the block's edge rows (one operator call on
        them), placed around the block by XLA."""
        w = int(self.width)
        if self.block_rows is not None or len(inputs) != 1 or not w:
            return apply(self, inputs)
        (x,) = as_arrays(type(self).__name__, inputs)
        if not x.ndim:
            return apply(self, [x])  # (output_spec's error)
        n = x.shape[0]
        edges = x if n <= 2 * w else jnp.concatenate([x[:w], x[n - w:]])
        halo = apply(dataclasses.replace(self, block_rows=n), [edges])
        return jnp.concatenate([halo[:w], x, halo[w:]])

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        rows = _rows_first(x, batched)  # (n or edge rows, B, ...)
        w, block_rows = int(self.width), self.block_rows
        if block_rows is not None:
            halo = _exchange(comm, rows, _plan(self, comm, int(block_rows)).forward, 2 * w)
            return _batch_first(halo, batched)
        halo = _exchange(comm, rows, _plan(self, comm, rows.shape[0]).forward_block, 2 * w)
        return _batch_first(np.concatenate([halo[:w], rows, halo[w:]]), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        window = _rows_first(y_bar, batched)  # (n + 2w or 2w, B, ...)
        w, block_rows = int(self.width), self.block_rows
        # the transpose of the forward's exchange: halo places back to owners' rows
        if block_rows is not None:
            route = _plan(self, comm, int(block_rows)).backward
            length = edge_rows(int(block_rows), w)
            if route.disjoint:  # (each edge row's cotangent comes from one place at most)
                return _batch_first(_exchange(comm, window, route, length), batched)
            x_bar = np.zeros((length,) + window.shape[1:], window.dtype)
            _exchange(comm, window, route, 0, into=x_bar)
            return _batch_first(x_bar, batched)
        n = window.shape[0] - 2 * w
        halo_bar = np.concatenate([window[:w], window[w + n:]])
        x_bar = np.array(window[w:w + n])
        _exchange(comm, halo_bar, _plan(self, comm, n).backward_block, n, into=x_bar)
        return _batch_first(x_bar, batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return type(self).forward(self, comm, x_dot, batched=batched)


def _plan(op: HaloExchange, comm: Any, rows: int) -> _Plan:
    """**Returns:** this rank's plan for blocks of `rows` rows here: kept with the call
    site where it has one (see `GuardedComm.site`), else made from every rank's block
    size, gathered now."""
    site = getattr(comm, "site", None)
    key = ("halo", rows)
    if site is not None and key in site:
        return site[key]
    plan = _Plan(comm.allgather(rows), int(op.width), op.boundary == "periodic",
                 comm.Get_rank())
    if site is not None:
        site[key] = plan
    return plan


def _rows_first(x: np.ndarray, batched: bool) -> np.ndarray:
    """**Returns:** a method's (n, ...) argument, or its (B, n, ...) one where `batched`,
    as a C-contiguous (n, B, ...) array (a view where the batch has one row or none)."""
    if not batched:
        return x[:, None]
    if x.shape[0] == 1:
        return x.reshape((x.shape[1], 1) + x.shape[2:])
    return np.ascontiguousarray(np.moveaxis(x, 1, 0))


def _batch_first(rows: np.ndarray, batched: bool) -> np.ndarray:
    """**Returns:** an (n, B, ...) array as the method returns it: (n, ...), or a
    C-contiguous (B, n, ...) one where `batched`."""
    if not batched:
        return rows[:, 0]
    if rows.shape[1] == 1:
        return rows.reshape((1, rows.shape[0]) + rows.shape[2:])
    return np.ascontiguousarray(np.moveaxis(rows, 0, 1))


def _exchange(comm: Any, rows: np.ndarray, route: _Route, length: int,
              into: np.ndarray | None = None) -> np.ndarray:
    """Send each peer of `route` its rows of `rows`; put the rows received from each
    peer at their places in an array of `length` rows: zeros elsewhere, or, given
    `into`, added to it (a place may receive several rows). One message per peer; this
    rank's own rows are copied.

    **Returns:** that array.
    """
    tail = rows.shape[1:]
    add = into is not None
    out = np.zeros((length,) + tail, rows.dtype) if into is None else into
    received = []
    requests = []
    for p, where, distinct, count in route.receives:
        # (rows that are not added, received in order, land in their places directly)
        direct = not add and type(where) is slice
        buffer = out[where] if direct else np.empty((count,) + tail, rows.dtype)
        requests.append(comm.Irecv(buffer, source=p, tag=_TAG))
        if not direct:
            received.append((where, distinct, buffer))
    for q, picks in route.sends:  # (a slice: the rows' own memory; else a copy)
        requests.append(comm.Isend(rows[picks], dest=q, tag=_TAG))
    for picks, where, distinct in route.own:
        _put(out, where, distinct, rows[picks], add)
    if requests:
        requests[0].Waitall(requests)
    for where, distinct, buffer in received:
        _put(out, where, distinct, buffer, add)
    return out


def _put(out: np.ndarray, where: np.ndarray | slice, distinct: bool, rows: np.ndarray,
         add: bool) -> None:
    """Write (or, where `add`, add) `rows` at the places `where` of `out`; places that
    are not `distinct` receive the sum of their rows."""
    if not add:
        out[where] = rows
    elif distinct:
        out[where] += rows
    else:
        assert not isinstance(where, slice)  # (a slice's places are distinct)
        np.add.at(out, where, rows)
