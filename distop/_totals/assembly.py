"""Total derivatives assembled from a program's sweeps into `(of, wrt)` blocks on global
vectors, and checked to be the same on every rank."""

from typing import Any

import numpy as np

from .._compiler.layout import Layout
from .._config import settings
from .._errors import DistopError
from .._mpi.runtime import mpi

Blocks = dict[tuple[str, str], np.ndarray]  # (of, wrt) -> 2-D array
# how far the blocks of a replicated input may differ between ranks, relative to their
# size, before `agree` calls them different (round-off of collectives aside)
TOLERANCE = 1e-8


def assembled(comm: Any, layout: Layout, swept: dict[str, Any], of: tuple[str, ...],
              wrt: tuple[str, ...], return_format: str, direction: str,
              check: bool = True) -> Blocks:
    """The `(of, wrt)` blocks of a program's sweeps (see `assemble` and
    `assemble_forward`), checked to be the same on every rank (see `agree`) unless
    `check` is False."""
    if direction == "fwd":
        totals = assemble_forward(comm, layout, swept, of, wrt, return_format)
    else:
        totals = assemble(comm, layout, swept, of, wrt, return_format)
    if check:
        check_replicated_totals(comm, layout, totals, return_format)
    return totals


def assemble(comm: Any, layout: Layout, cts: dict[str, Any], of: tuple[str, ...],
             wrt: tuple[str, ...], return_format: str) -> Blocks:
    """Cut the batched cotangents of a reverse pass into `(of, wrt)` blocks.

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `layout`: the `Layout` of the current point.
    - `cts`: wrt name -> array (global rows of `of`, *local shape of wrt).
    - `of`, `wrt`: the names, in order.
    - `return_format`: `"global"` gathers distributed `wrt` columns from every rank;
      `"local"` keeps this rank's columns and this rank's rows of distributed `of`.

    **Returns:** dict `(of, wrt)` -> 2-D numpy array.
    """
    rank = comm.Get_rank()
    offsets = layout.offsets(of)
    local = [] if return_format != "local" else [  # this rank's rows of a distributed `of`
        (o, offsets[i]) + layout.local_rows(o, rank) for i, o in enumerate(of)
        if o in layout.counts]
    totals: Blocks = {}
    for w in wrt:
        block = cts[w].reshape(offsets[-1], -1)
        if w in layout.counts and return_format == "global":
            block = gather_columns(comm, block, flat_counts(layout, w))
        # views of the program's result (read-only), not copies
        for o, start, stop in zip(of, offsets, offsets[1:]):
            totals[o, w] = block[start:stop]
        for o, offset, start, stop in local:
            totals[o, w] = block[offset + start:offset + stop]
    return totals


def assemble_forward(comm: Any, layout: Layout, tangents: dict[str, Any],
                     of: tuple[str, ...], wrt: tuple[str, ...],
                     return_format: str) -> Blocks:
    """Cut the batched tangents of a forward pass into `(of, wrt)` blocks.

    **Arguments:**
    - `tangents`: of name -> array (global entries of `wrt`, *local shape of of).
    - the others: as for `assemble`.

    **Returns:** dict `(of, wrt)` -> 2-D numpy array.
    """
    rank = comm.Get_rank()
    offsets = layout.offsets(wrt)
    totals: Blocks = {}
    for o in of:
        block = np.asarray(tangents[o]).reshape(offsets[-1], -1).T
        if o in layout.counts and return_format == "global":
            block = gather_rows(comm, block, flat_counts(layout, o))
        for w, start, stop in zip(wrt, offsets, offsets[1:]):
            if w in layout.counts and return_format == "local":
                low, high = layout.local_rows(w, rank)
                start, stop = start + low, start + high
            totals[o, w] = block[:, start:stop]
    return totals


def flat_counts(layout: Layout, name: str) -> list[int]:
    spec = layout.spec(name)
    tail = int(np.prod(spec.shape[1:]))
    return [c * tail for c in layout.counts[name]]


def gather_columns(comm: Any, block: np.ndarray, counts: list[int]) -> np.ndarray:
    """**Returns:** the columns of `block` from every rank, side by side (`counts[r]`
    columns from rank r), on every rank."""
    if comm.Get_size() == 1:
        return block
    rows = block.shape[0]
    recv = np.empty((sum(counts), rows), block.dtype)
    comm.Allgatherv(np.ascontiguousarray(block.T), [recv, [c * rows for c in counts]])
    return recv.T


def gather_rows(comm: Any, block: np.ndarray, counts: list[int]) -> np.ndarray:
    """**Returns:** the rows of `block` from every rank, stacked (`counts[r]` rows from
    rank r), on every rank."""
    if comm.Get_size() == 1:
        return block
    cols = block.shape[1]
    recv = np.empty((sum(counts), cols), block.dtype)
    comm.Allgatherv(np.ascontiguousarray(block), [recv, [c * cols for c in counts]])
    return recv


def unchecked(program: Any, return_format: str) -> bool:
    """**Returns:** whether the totals of `program` in `return_format` are to be
    checked by `check_replicated_totals`: on its first call in that format, and on every call in the
    checking mode. What decides it is alike on every rank (programs are built and
    called in the same order everywhere)."""
    return return_format not in program.totals_checked or settings.check_collectives


def check_replicated_totals(comm: Any, layout: Layout, totals: Blocks, return_format: str) -> None:
    """Check that the blocks of every replicated input are the same on every rank (in
    the `"local"` format, those of replicated outputs: the rows of a distributed one are
    each rank's own).

    Every rank runs every sweep, so a correct model gives each rank the whole derivative
    with respect to a replicated input. A model that uses a replicated input in
    rank-dependent computation without `RankLocal` (or the right collective) gives each
    rank only its own share instead. One small collective compares two weighted sums of
    each such block across ranks.

    **Raises:** `DistopError` on every rank, naming the first block that differs and
    the fix.
    """
    blocks = [(key, block) for key, block in totals.items() if key[1] not in layout.counts
              and (return_format == "global" or key[0] not in layout.counts)]
    if comm.Get_size() == 1 or not blocks:
        return
    sums = []
    for _, block in blocks:
        flat = np.abs(block).ravel() if np.iscomplexobj(block) else block.ravel()
        weights = np.cos(np.arange(flat.size))  # (the same on every rank)
        sums.append([flat.sum(), flat @ weights, np.abs(flat).sum()])
    mine = np.array(sums, dtype=float)
    extremes = np.empty((2,) + mine.shape)
    comm.Allreduce(np.stack([mine, -mine]), extremes, op=mpi().MAX)
    high, low = extremes[0], -extremes[1]
    spread = np.abs(high - low)[:, :2].max(axis=1)
    for (key, _), differs, size in zip(blocks, spread, high[:, 2]):
        if differs > TOLERANCE * max(size, np.finfo(float).tiny):
            of, wrt = key
            raise DistopError(
                f"compute_totals: the derivatives of {of!r} with respect to the replicated "
                f"input {wrt!r} differ between ranks, so each rank holds only its own "
                f"share. {wrt!r} is used in computation that differs between ranks (with "
                "a distributed value, or on one rank's block) without a collective that "
                f"sums its cotangent. Pass it through distop.RankLocal()({wrt}) where "
                "it enters that computation, or through the collective that makes its "
                "result the same everywhere (AllreduceSum, say); or declare it "
                "distributed if each rank holds its own.")

