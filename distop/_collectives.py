"""Built-in differentiable collective operators, written with the public operator API.

Values follow distop's conventions: *replicated* (the same on every rank; its cotangent
is the full derivative, the same on every rank), *rank-local* (its own value on each
rank; its cotangent is this rank's), *distributed* (each rank holds a block along axis
0; sizes may differ and be zero). Every method takes a whole batch at once, so a batch
costs one collective.
"""

from typing import Any

import jax
import numpy as np

from ._blocks import (
    as_rows,
    even_counts,
    gather_blocks,
    transpose_blocks,
    with_batch,
    without_batch,
)
from ._comm import private
from ._operator import DistributedOperator
from ._runtime import mpi


class AllreduceSum(DistributedOperator):
    """s = sum over ranks of x_r: rank-local in, replicated out. Its VJP hands every rank
    the full output cotangent (no communication); its JVP sums the tangents."""

    forward_collectives = ("Allreduce",)
    jvp_collectives = ("Allreduce",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=mpi().SUM)
        return out

    def vjp(self, comm: Any, s_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return s_bar.copy()

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot)


class Allgather(DistributedOperator):
    """Distributed (n_r, ...) in, replicated (N, ...) out. Its VJP keeps this rank's
    rows of the full cotangent (no communication); its JVP gathers the tangents.

    A 0-d value per rank counts as one row: the output is then the (size,) vector of
    every rank's value. Finding N takes one small collective while the program is
    traced, which every rank does at the same point of the same program.
    """

    forward_collectives = ("Allgather", "Allgatherv")
    vjp_collectives = ("Allgather",)
    jvp_collectives = ("Allgather", "Allgatherv")
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        rows = x.shape[0] if len(x.shape) else 1
        total = sum(private(self.comm).allgather(rows))
        return jax.ShapeDtypeStruct((total,) + tuple(x.shape[1:]), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        return without_batch(gather_blocks(comm, as_rows(x, batched)), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        n = as_rows(x, batched).shape[1]
        start = sum(comm.allgather(n)[:comm.Get_rank()])
        mine = with_batch(y_bar, batched)[:, start:start + n]
        if x.ndim == (1 if batched else 0):  # a 0-d value per rank: its one row
            mine = mine[:, 0]
        return without_batch(np.ascontiguousarray(mine), batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


class Split(DistributedOperator):
    """Replicated (N, ...) in, distributed out: rank r keeps rows
    [start_r, start_r + counts[r]). Its VJP gathers the cotangent blocks into the full
    cotangent on every rank (Allgatherv); its JVP keeps this rank's rows of the tangent
    (no communication).

    Fields: `counts`, rows per rank (default: as even as possible, earlier ranks first).
    """

    counts: tuple[int, ...] | None = None
    vjp_collectives = ("Allgather", "Allgatherv")
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def rows(self, size: int, total: int) -> list[int]:
        """**Returns:** the rows per rank for `size` ranks and `total` rows."""
        counts = (list(self.counts) if self.counts is not None
                  else even_counts(total, size))
        if len(counts) != size or sum(counts) != total or min(counts) < 0:
            raise ValueError(f"Split(counts={counts}): needs one count >= 0 per rank "
                             f"({size}) adding up to the {total} rows of the input.")
        return counts

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        comm = private(self.comm)
        counts = self.rows(comm.Get_size(), x.shape[0])
        return jax.ShapeDtypeStruct((counts[comm.Get_rank()],) + tuple(x.shape[1:]), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        x = with_batch(x, batched)
        counts = self.rows(comm.Get_size(), x.shape[1])
        start = sum(counts[:comm.Get_rank()])
        return without_batch(np.ascontiguousarray(x[:, start:start + counts[comm.Get_rank()]]),
                             batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return without_batch(gather_blocks(comm, with_batch(y_bar, batched)), batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


class Alltoall(DistributedOperator):
    """The distributed transpose: a 2-D array split by rows, (n_r, M) on rank r, in;
    the row blocks of its transpose, (m_r, N), out. Its VJP is the transpose back; its
    JVP the transpose of the tangent.

    Fields: `counts`, how the M columns are split into output rows per rank (default: as
    even as possible).
    """

    counts: tuple[int, ...] | None = None
    forward_collectives = ("Allgather", "Alltoallv")
    vjp_collectives = ("Allgather", "Alltoallv")
    jvp_collectives = ("Allgather", "Alltoallv")
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

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
        x = with_batch(x, batched)
        counts = self._out_counts(comm.Get_size(), x.shape[2])
        return without_batch(transpose_blocks(comm, x, counts), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        x_rows = comm.allgather(x.shape[1] if batched else x.shape[0])
        return without_batch(transpose_blocks(comm, with_batch(y_bar, batched), x_rows),
                             batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


class Broadcast(DistributedOperator):
    """The root's value, replicated on every rank: rank-local in (only the root's
    matters), replicated out. Its VJP gives the root the full cotangent, zeros elsewhere;
    its JVP broadcasts the root's tangent.

    Fields: `root` (default 0).
    """

    root: int = 0
    forward_collectives = ("Bcast",)
    jvp_collectives = ("Bcast",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.array(x, copy=True)
        comm.Bcast(out, root=self.root)
        return out

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return y_bar.copy() if comm.Get_rank() == self.root else np.zeros_like(y_bar)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot)


class RankLocal(DistributedOperator):
    """A replicated value viewed as rank-local: the identity forward and JVP; the VJP
    sums the per-rank cotangents (Allreduce) into the full one.

    Use it where replicated data enters rank-dependent code (a `jnp.where` on the rank,
    a per-rank weight): each rank's cotangent is then only its share, and the sum makes
    the replicated value's cotangent full and the same on every rank again.
    """

    vjp_collectives = ("Allreduce",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        return x.copy()

    def vjp(self, comm: Any, x_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        out = np.empty_like(x_bar)
        comm.Allreduce(x_bar, out, op=mpi().SUM)
        return out

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return x_dot.copy()
