"""Built-in rooted collectives: `Reduce`, `Gather` and `Scatter`, to or from one rank.

A rooted result lives on the root only. So that every rank runs the same program on
values of the same shapes, the other ranks get zeros of the root's shape: a rooted
result is rank-local (the root's value, zeros elsewhere), and the cotangents the other
ranks give it are ignored. Pass it through `Broadcast(root=...)` to make it replicated.
The value kinds and cotangent conventions are those of `_collectives.py`.
"""

from typing import Any, ClassVar

import jax
import numpy as np

from .._agreement.comm import private
from .._mpi.runtime import mpi
from .._operators.operator import DistributedOperator
from .basic import Split
from .blocks import as_rows, batch_first, block_counts, rows_first, with_batch, without_batch


def _check_root(name: str, root: int, comm: Any) -> None:
    """Refuse a root that is not a rank of `comm` (when the program is traced, on every
    rank alike), naming the operator `name`."""
    size = private(comm).Get_size()
    if not 0 <= root < size:
        raise ValueError(f"{name}(root={root}): expected a rank of the communicator, "
                         f"0 to {size - 1}.")


def _scatter_rows(comm: Any, full: np.ndarray | None, counts: list[int], root: int,
                  out: np.ndarray) -> None:
    """Scatter the root's rows into every rank's block.

    **Arguments:**
    - `comm`: the communicator (declare `Scatterv`).
    - `full`: the root's (N, ...) rows, one contiguous piece of memory each (ignored
      elsewhere).
    - `counts`: the rows per rank.
    - `root`: the root.
    - `out`: this rank's (counts[r], ...) block, filled in place.
    """
    unit = int(np.prod(out.shape[1:], dtype=np.int64))
    send = [full, [c * unit for c in counts]] if comm.Get_rank() == root else None
    comm.Scatterv(send, out, root=root)


def _gather_rows(comm: Any, rows: np.ndarray, counts: list[int], root: int) -> np.ndarray:
    """Gather every rank's rows on the root.

    **Arguments:**
    - `comm`: the communicator (declare `Gatherv`).
    - `rows`: this rank's (counts[r], ...) rows, C-contiguous.
    - `counts`: the rows per rank.
    - `root`: the root.

    **Returns:** on the root, every rank's rows one after the other, (N, ...); zeros of
    that shape elsewhere.
    """
    unit = int(np.prod(rows.shape[1:], dtype=np.int64))
    out = np.zeros((sum(counts),) + rows.shape[1:], rows.dtype)
    recv = [out, [c * unit for c in counts]] if comm.Get_rank() == root else None
    comm.Gatherv(rows, recv, root=root)
    return out


class Reduce(DistributedOperator):
    """The sum over ranks on the root, zeros elsewhere: rank-local in and out.

    Its VJP broadcasts the root's cotangent to every rank (the other ranks' are
    ignored).
    Its JVP reduces the tangents to the root.
    Pass the result through `Broadcast(root=...)` to make it replicated.

    **Arguments:**
    - `root`: the rank that gets the sum (default 0).
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it returns the sum on the root and zeros of its
    shape elsewhere.

    **Raises:** `ValueError` when traced, where `root` is not a rank of the
    communicator.
    """

    input_kinds = "varying"
    output_kinds = "varying"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

    root: int = 0
    forward_collectives = ("Reduce",)
    vjp_collectives = ("Bcast",)
    jvp_collectives = ("Reduce",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        _check_root("Reduce", self.root, self.comm)
        return x

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.zeros_like(x)
        comm.Reduce(x, out if comm.Get_rank() == self.root else None, op=mpi().SUM,
                    root=self.root)
        return out

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        out = np.array(y_bar, copy=True)
        comm.Bcast(out, root=self.root)
        return out

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot)


class Gather(DistributedOperator):
    """Every rank's block on the root, zeros elsewhere: distributed in, rank-local out.

    Rank r passes its (n_r, ...) block; every rank gets an (N, ...) array: the
    concatenation on the root, zeros elsewhere.
    A 0-d value per rank counts as one row.
    Its VJP scatters the root's cotangent: each rank gets its rows of it (the other
    ranks' cotangents are ignored).
    Its JVP gathers the tangents.
    Finding N takes one small collective while the program is traced, as for
    `Allgather`.

    **Arguments:**
    - `root`: the rank that gets the rows (default 0).
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's block returns the (N, ...)
    array.

    **Raises:** `ValueError` when traced, where `root` is not a rank of the
    communicator.
    """

    input_kinds = "varying"
    output_kinds = "varying"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

    root: int = 0
    forward_collectives = ("Allgather", "Gatherv")
    vjp_collectives = ("Allgather", "Scatterv")
    jvp_collectives = ("Allgather", "Gatherv")
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        _check_root("Gather", self.root, self.comm)
        rows = x.shape[0] if len(x.shape) else 1
        total = sum(private(self.comm).allgather(rows))
        return jax.ShapeDtypeStruct((total,) + tuple(x.shape[1:]), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        block = rows_first(as_rows(x, batched))  # (n, B, ...)
        counts = block_counts(comm, block.shape[0])
        return without_batch(batch_first(_gather_rows(comm, block, counts, self.root)),
                             batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        block = as_rows(x, batched)
        counts = block_counts(comm, block.shape[1])
        full = rows_first(with_batch(y_bar, batched))  # (N, B, ...)
        mine = np.empty((block.shape[1],) + full.shape[1:], full.dtype)
        _scatter_rows(comm, full, counts, self.root, mine)
        x_bar = batch_first(mine)
        if x.ndim == (1 if batched else 0):  # a 0-d value per rank: its one row
            x_bar = np.ascontiguousarray(x_bar[:, 0])
        return without_batch(x_bar, batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)


class Scatter(DistributedOperator):
    """The root's array split into row blocks: rank-local in, distributed out.

    Every rank passes an (N, ...) array of the root's shape; only the root's values are
    used.
    Rank r gets its (counts[r], ...) block.
    Its VJP gathers the cotangent blocks on the root, zeros elsewhere.
    Its JVP scatters the root's tangent.

    **Arguments:**
    - `root`: the rank whose array is split (default 0).
    - `counts`: rows per rank (default: as even as possible, earlier ranks first).
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it returns this rank's block of the root's array.

    **Raises:** `ValueError` when traced, where `root` is not a rank, the input is 0-d,
    or `counts` does not add up to N.
    """

    input_kinds = "varying"
    output_kinds = "varying"
    _blocks_in: ClassVar[bool] = False  # (see `takes_blocks`)

    root: int = 0
    counts: tuple[int, ...] | None = None
    forward_collectives = ("Scatterv",)
    vjp_collectives = ("Gatherv",)
    jvp_collectives = ("Scatterv",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def _rows(self, comm: Any, total: int) -> list[int]:
        return Split(counts=self.counts).rows(comm.Get_size(), total)

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        _check_root("Scatter", self.root, self.comm)
        if not len(x.shape):
            raise ValueError("Scatter: expected an array of rows to split; got a 0-d "
                             "value.")
        comm = private(self.comm)
        mine = self._rows(comm, x.shape[0])[comm.Get_rank()]
        return jax.ShapeDtypeStruct((mine,) + tuple(x.shape[1:]), x.dtype)

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        full = rows_first(with_batch(x, batched))  # (N, B, ...)
        counts = self._rows(comm, full.shape[0])
        mine = np.empty((counts[comm.Get_rank()],) + full.shape[1:], full.dtype)
        _scatter_rows(comm, full, counts, self.root, mine)
        return without_batch(batch_first(mine), batched)

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        block = rows_first(with_batch(y_bar, batched))  # (n_r, B, ...)
        counts = self._rows(comm, with_batch(x, batched).shape[1])
        return without_batch(batch_first(_gather_rows(comm, block, counts, self.root)),
                             batched)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot, batched=batched)
