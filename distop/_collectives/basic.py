"""Built-in differentiable collective operators, written with the public operator API.

Values follow distop's conventions: *replicated* (the same on every rank; its cotangent
is the full derivative, the same on every rank), *rank-local* (its own value on each
rank; its cotangent is this rank's), *distributed* (each rank holds a block along axis
0; sizes may differ and be zero). Every method takes a whole batch at once, so a batch
costs one collective.
"""

from typing import Any, ClassVar

import jax
import numpy as np

from .._agreement.comm import private
from .._mpi.runtime import mpi
from .._operators.operator import DistributedOperator
from .blocks import (
    as_rows,
    block_counts,
    even_counts,
    gather_blocks,
    transpose_blocks,
    with_batch,
    without_batch,
)


class AllreduceSum(DistributedOperator):
    """The sum over ranks: rank-local in, replicated out.

    `AllreduceSum()(x)` is x_0 + ... + x_(P-1), the same on every rank.
    Its VJP hands every rank the full output cotangent (no communication).
    Its JVP sums the tangents.

    **Arguments:**
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's x returns the sum, shaped as x.

    **Raises:** nothing when made. A call raises as any operator's does (see
    `DistributedOperator`).

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np

    import distop

    jax.config.update("jax_enable_x64", True)
    total = distop.AllreduceSum()
    problem = distop.Problem(lambda x: {"s": total(jnp.sum(x))}, {"x": np.ones(3)},
                             distributed={"x"})
    assert problem.run()["s"] == 3.0  # in one process; P * 3.0 on P ranks
    ```
    """

    input_kinds = "varying"
    output_kinds = "replicated"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

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
    """Every rank's block, on every rank: distributed in, replicated out.

    Rank r passes its (n_r, ...) block; every rank gets the (N, ...) concatenation.
    A 0-d value per rank counts as one row: the output is then the (P,) vector of every
    rank's value.
    Its VJP keeps this rank's rows of the full cotangent (no communication).
    Its JVP gathers the tangents.
    Finding N takes one small collective while the program is traced, which every rank
    does at the same point of the same program.

    **Arguments:**
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's block returns the (N, ...)
    array.

    **Raises:** nothing when made. A call raises as any operator's does (see
    `DistributedOperator`).
    """

    input_kinds = "varying"
    output_kinds = "replicated"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

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
        start = sum(block_counts(comm, n)[:comm.Get_rank()])
        mine = with_batch(y_bar, batched)[:, start:start + n]
        if x.ndim == (1 if batched else 0):  # a 0-d value per rank: its one row
            mine = mine[:, 0]
        return without_batch(np.ascontiguousarray(mine), batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


class Split(DistributedOperator):
    """This rank's rows of a replicated array: replicated in, distributed out.

    Rank r keeps rows [start_r, start_r + counts[r]) of the (N, ...) input.
    Its VJP gathers the cotangent blocks into the full cotangent on every rank
    (Allgatherv).
    Its JVP keeps this rank's rows of the tangent (no communication).

    **Arguments:**
    - `counts`: rows per rank (default: as even as possible, earlier ranks first).
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on the (N, ...) array returns this rank's
    (counts[r], ...) block.

    **Raises:** `ValueError` when traced, where `counts` does not give one count >= 0
    per rank adding up to N.
    """

    output_kinds = "varying"

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
    """The distributed transpose of a 2-D array split by rows.

    Rank r passes its (n_r, M) rows, and gets its (m_r, N) rows of the transpose:
    distributed in and out.
    Its VJP is the transpose back; its JVP the transpose of the tangent.

    **Arguments:**
    - `counts`: how the M columns are split into output rows per rank (default: as even
      as possible).
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's (n_r, M) block returns its (m_r,
    N) block.

    **Raises:** `ValueError` when traced, where a block is not 2-D or `counts` does not
    add up to M.
    """

    input_kinds = "varying"
    output_kinds = "varying"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

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
        x_rows = block_counts(comm, x.shape[1] if batched else x.shape[0])
        return without_batch(transpose_blocks(comm, with_batch(y_bar, batched), x_rows),
                             batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


class Broadcast(DistributedOperator):
    """The root's value on every rank: rank-local in, replicated out.

    Only the root's value matters; every rank passes an array of the root's shape.
    Its VJP gives the root the full cotangent, zeros elsewhere.
    Its JVP broadcasts the root's tangent.

    **Arguments:**
    - `root`: the rank whose value is sent (default 0).
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it returns the root's value, the same on every
    rank.

    **Raises:** nothing when made. A call raises as any operator's does (see
    `DistributedOperator`).
    """

    input_kinds = "varying"
    output_kinds = "replicated"
    _blocks_in: ClassVar[bool] = False  # (see `takes_blocks`)

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
    """A replicated value viewed as rank-local: the identity, with a summing VJP.

    Its forward and JVP are the identity.
    Its VJP sums the per-rank cotangents (Allreduce) into the full one.
    Use it where replicated data enters rank-dependent code: a `jnp.where` on the rank,
    or a per-rank weight.
    Each rank's cotangent is then only its share; the sum makes the replicated value's
    cotangent full and the same on every rank again.

    **Arguments:**
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it returns its input unchanged.

    **Raises:** nothing when made. A call raises as any operator's does (see
    `DistributedOperator`).
    """

    output_kinds = "varying"

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
