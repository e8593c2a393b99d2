"""Built-in differentiable collective operators, written with the public operator API.

Values follow distop's conventions: *replicated* (the same on every rank; its cotangent
is the full derivative, the same on every rank), *rank-local* (its own value on each
rank; its cotangent is this rank's), *distributed* (each rank holds a block along axis
0; sizes may differ and be zero). Every method takes a whole batch at once, so a batch
costs one collective.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._comm import private
from ._operator import DistributedOperator
from ._runtime import mpi


def _even_counts(total: int, parts: int) -> list[int]:
    base, extra = divmod(int(total), parts)
    return [base + (r < extra) for r in range(parts)]


def _gather_blocks(comm: Any, block: np.ndarray) -> np.ndarray:
    """(B, n_r, ...) on every rank -> (B, N, ...) on every rank (uneven blocks)."""
    counts = comm.allgather(block.shape[1])
    moved = np.ascontiguousarray(np.moveaxis(block, 1, 0))  # blocks contiguous per rank
    tail = int(np.prod(moved.shape[1:]))
    out = np.empty((sum(counts),) + moved.shape[1:], block.dtype)
    comm.Allgatherv(moved, [out, [c * tail for c in counts]])
    return np.ascontiguousarray(np.moveaxis(out, 0, 1))


def _transpose_blocks(comm: Any, a: np.ndarray, out_counts: Sequence[int]) -> np.ndarray:
    """The distributed transpose: `a` is (B, n_r, C), this rank's rows of a global
    (B, R, C); returns (B, out_counts[r], R), this rank's rows of its transpose."""
    size, rank = comm.Get_size(), comm.Get_rank()
    row_counts = comm.allgather(a.shape[1])
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


def _batch(x: np.ndarray, batched: bool) -> np.ndarray:
    return x if batched else x[None]


def _unbatch(x: np.ndarray, batched: bool) -> np.ndarray:
    return x if batched else x[0]


class AllreduceSum(DistributedOperator):
    """s = sum over ranks of x_r: rank-local in, replicated out. Its VJP hands every rank
    the full output cotangent (no communication)."""

    forward_collectives = ("Allreduce",)
    batched_forward = True
    batched_vjp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=mpi().SUM)
        return out

    def vjp(self, comm: Any, s_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return s_bar.copy()


class Allgather(DistributedOperator):
    """Distributed (n_r, ...) in, replicated (N, ...) out. Its VJP keeps this rank's
    rows of the full cotangent (no communication).

    Finding N takes one small collective while the program is traced, which every rank
    does at the same point of the same program.
    """

    forward_collectives = ("Allgather", "Allgatherv")
    vjp_collectives = ("Allgather",)
    batched_forward = True
    batched_vjp = True

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        total = sum(private(self.comm).allgather(x.shape[0]))
        return jax.ShapeDtypeStruct((total,) + tuple(x.shape[1:]), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        return _unbatch(_gather_blocks(comm, _batch(x, batched)), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        n = _batch(x, batched).shape[1]
        start = sum(comm.allgather(n)[:comm.Get_rank()])
        return _unbatch(np.ascontiguousarray(_batch(y_bar, batched)[:, start:start + n]),
                        batched)


class Split(DistributedOperator):
    """Replicated (N, ...) in, distributed out: rank r keeps rows
    [start_r, start_r + counts[r]). Its VJP gathers the cotangent blocks into the full
    cotangent on every rank (Allgatherv).

    Fields: `counts`, rows per rank (default: as even as possible, earlier ranks first).
    """

    counts: tuple[int, ...] | None = None
    vjp_collectives = ("Allgather", "Allgatherv")
    batched_forward = True
    batched_vjp = True

    def rows(self, size: int, total: int) -> list[int]:
        """**Returns:** the rows per rank for `size` ranks and `total` rows."""
        counts = (list(self.counts) if self.counts is not None
                  else _even_counts(total, size))
        if len(counts) != size or sum(counts) != total or min(counts) < 0:
            raise ValueError(f"Split(counts={counts}): needs one count >= 0 per rank "
                             f"({size}) adding up to the {total} rows of the input.")
        return counts

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        comm = private(self.comm)
        counts = self.rows(comm.Get_size(), x.shape[0])
        return jax.ShapeDtypeStruct((counts[comm.Get_rank()],) + tuple(x.shape[1:]), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        x = _batch(x, batched)
        counts = self.rows(comm.Get_size(), x.shape[1])
        start = sum(counts[:comm.Get_rank()])
        return _unbatch(np.ascontiguousarray(x[:, start:start + counts[comm.Get_rank()]]),
                        batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return _unbatch(_gather_blocks(comm, _batch(y_bar, batched)), batched)


class Alltoall(DistributedOperator):
    """The distributed transpose: a 2-D array split by rows, (n_r, M) on rank r, in;
    the row blocks of its transpose, (m_r, N), out. Its VJP is the transpose back.

    Fields: `counts`, how the M columns are split into output rows per rank (default: as
    even as possible).
    """

    counts: tuple[int, ...] | None = None
    forward_collectives = ("Allgather", "Alltoallv")
    vjp_collectives = ("Allgather", "Alltoallv")
    batched_forward = True
    batched_vjp = True

    def _out_counts(self, size: int, columns: int) -> list[int]:
        return Split(counts=self.counts).rows(size, columns)

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if len(x.shape) != 2:
            raise ValueError(f"Alltoall: expected a 2-D block (rows, columns); got shape "
                             f"{tuple(x.shape)}.")
        comm = private(self.comm)
        total_rows = sum(comm.allgather(x.shape[0]))
        m = self._out_counts(comm.Get_size(), x.shape[1])[comm.Get_rank()]
        return jax.ShapeDtypeStruct((m, total_rows), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        x = _batch(x, batched)
        counts = self._out_counts(comm.Get_size(), x.shape[2])
        return _unbatch(_transpose_blocks(comm, x, counts), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        x_rows = comm.allgather(x.shape[1] if batched else x.shape[0])
        return _unbatch(_transpose_blocks(comm, _batch(y_bar, batched), x_rows), batched)


class Broadcast(DistributedOperator):
    """The root's value, replicated on every rank: rank-local in (only the root's
    matters), replicated out. Its VJP gives the root the full cotangent, zeros elsewhere.

    Fields: `root` (default 0).
    """

    root: int = 0
    forward_collectives = ("Bcast",)
    batched_forward = True
    batched_vjp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.array(x, copy=True)
        comm.Bcast(out, root=self.root)
        return out

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return y_bar.copy() if comm.Get_rank() == self.root else np.zeros_like(y_bar)


class RankLocal(DistributedOperator):
    """A replicated value viewed as rank-local: the identity forward; the VJP sums the
    per-rank cotangents (Allreduce) into the full one.

    Use it where replicated data enters rank-dependent code (a `jnp.where` on the rank,
    a per-rank weight): each rank's cotangent is then only its share, and the sum makes
    the replicated value's cotangent full and the same on every rank again.
    """

    vjp_collectives = ("Allreduce",)
    batched_forward = True
    batched_vjp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        return x.copy()

    def vjp(self, comm: Any, x_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        out = np.empty_like(x_bar)
        comm.Allreduce(x_bar, out, op=mpi().SUM)
        return out
