"""Built-in reductions over ranks: `Allreduce` with any of sum, max, min and prod, and
the prefix sums `Scan` and `Exscan`.

All take a rank-local value, the same shape on every rank, and reduce elementwise
across the ranks. The value kinds and cotangent conventions are those of
`_collectives.py`.
"""

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._agreement.comm import reversed_ranks
from .._mpi.runtime import mpi
from .._operators.operator import DistributedOperator

_OPS = ("sum", "max", "min", "prod")
# MPI's (value, int) pair types, by the value's dtype (for the owner of an extreme),
# each with numpy's layout of the pair
_OWNER_PAIRS = {np.dtype(t): (name, np.dtype([("value", t), ("rank", np.intc)], align=True))
                for t, name in ((np.float64, "DOUBLE_INT"), (np.float32, "FLOAT_INT"))}


def _others_product(comm: Any, x: np.ndarray) -> np.ndarray:
    """**Returns:** per element, the product of every other rank's x (exact where some
    are zero: no division): the product of the ranks before this one (`Exscan`) times
    that of the ranks after it (`Exscan` over the ranks in reverse order)."""
    if comm.Get_size() == 1:
        return np.ones_like(x)
    x = np.ascontiguousarray(x)
    return (_exclusive(comm, x, mpi().PROD, 1)
            * _exclusive(_reversed(comm), x, mpi().PROD, 1))


def _exclusive(comm: Any, x: np.ndarray, op: Any, empty: float) -> np.ndarray:
    """**Returns:** the exclusive prefix reduction of `x` by `op` over `comm`'s ranks,
    `empty` on its first rank (where MPI leaves it undefined)."""
    out = np.full_like(x, empty)
    comm.Exscan(x, out, op=op)
    if comm.Get_rank() == 0:
        out[...] = empty
    return out


def _others_product_derivative(comm: Any, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """**Returns:** per element, the derivative of `_others_product` along the tangent
    `t` (every rank its own): the sum over the other ranks s of t_s times the product of
    the rest, exact where some values are zero (no division). The products before and
    after this rank are taken of (value, derivative) pairs, multiplied by the product
    rule, in one `Exscan` each."""
    if comm.Get_size() == 1:
        return np.zeros_like(x)
    pairs = np.ascontiguousarray(np.stack(np.broadcast_arrays(x, t), axis=-1))
    before = _exclusive_pairs(comm, pairs)
    after = _exclusive_pairs(_reversed(comm), pairs)
    return before[..., 1] * after[..., 0] + before[..., 0] * after[..., 1]


_PAIRS: dict[Any, tuple[Any, Any]] = {}  # dtype -> (MPI datatype of a pair, its product)


def _pair_product(dtype: np.dtype) -> tuple[Any, Any]:
    """**Returns:** the MPI datatype of one (value, derivative) pair of `dtype` and the
    MPI operation that multiplies such pairs by the product rule, made once per dtype."""
    found = _PAIRS.get(dtype)
    if found is None:
        MPI = mpi()

        def multiply(into: Any, inout: Any, datatype: Any) -> None:
            a = np.frombuffer(into, dtype).reshape(-1, 2)
            b = np.frombuffer(inout, dtype).reshape(-1, 2)
            b[:, 1] = a[:, 0] * b[:, 1] + a[:, 1] * b[:, 0]
            b[:, 0] *= a[:, 0]

        pair = MPI.BYTE.Create_contiguous(2 * dtype.itemsize).Commit()
        found = _PAIRS[dtype] = (pair, MPI.Op.Create(multiply, commute=True))
    return found


def _exclusive_pairs(comm: Any, pairs: np.ndarray) -> np.ndarray:
    """**Returns:** the exclusive prefix product of (value, derivative) `pairs` (the
    last axis) over `comm`'s ranks; (1, 0) on its first rank."""
    datatype, op = _pair_product(pairs.dtype)
    out = np.zeros_like(pairs)
    out[..., 0] = 1
    count = pairs.size // 2
    comm.Exscan([pairs, count, datatype], [out, count, datatype], op=op)
    if comm.Get_rank() == 0:
        out[..., 0], out[..., 1] = 1, 0
    return out


def _reversed(comm: Any) -> Any:
    """**Returns:** the operator's private communicator with its ranks reversed (see
    `_comm.reversed_ranks`): a method's `comm` wraps the private one (`raw`)."""
    return reversed_ranks(getattr(comm, "raw", comm))


class Allreduce(DistributedOperator):
    """The elementwise sum, maximum, minimum or product over ranks.

    `Allreduce(op)(x)` reduces every rank's x_r: rank-local in, replicated out.
    Each rank gets the derivative of y with respect to its own x_r:
    - `"sum"`: as `AllreduceSum`.
    - `"max"`, `"min"`: all of an element's derivative goes to the rank holding the
      extreme; where several ranks hold it (a tie), to the lowest of them, on every rank
      alike. The others get zero (all of them where the extreme is NaN). Real values
      only.
    - `"prod"`: the cotangent times the product of the other ranks' values, computed
      without division, so exact where some values are zero.

    The VJP of max and min issues one Allreduce of (value, rank) pairs (two for 16-bit
    floats: the extreme, then the rank that owns it), the JVP one more; that of prod
    two exclusive prefix products (`Exscan`), over the ranks and over the ranks in
    reverse order (a communicator made once, `Split`).
    Second derivatives: max and min are linear where they are differentiable (their
    `hvp` is zero, with no communication); prod's `hvp` takes two exclusive prefix
    products of (value, derivative) pairs.

    **Arguments:**
    - `op`: `"sum"` (default), `"max"`, `"min"` or `"prod"`.
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's x returns the reduction, shaped
    as x.

    **Raises:** `ValueError` for another `op`; `TypeError` when traced, for `"max"` or
    `"min"` of complex values.
    """

    input_kinds = "varying"
    output_kinds = "replicated"

    op: str = "sum"
    linear = True  # (with op="sum" only: see `is_linear`)
    complex_step = True  # (not with max or min: see `takes_complex_step`)
    forward_collectives = ("Allreduce",)
    vjp_collectives = ("Allreduce", "Exscan", "Split")
    jvp_collectives = ("Allreduce", "Exscan", "Split")
    hvp_collectives = ("Exscan", "Split")
    batched_forward = True
    batched_vjp = True
    batched_jvp = True
    batched_hvp = True

    @property
    def _blocks_in(self) -> bool:
        """A sum or product of copies differs from one copy; their max or min does not
        (see `takes_blocks`)."""
        return self.op in ("sum", "prod")

    def __check_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Allreduce(op={self.op!r}): expected one of {list(_OPS)}.")

    def output_spec(self, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if self.op in ("max", "min") and jnp.issubdtype(x.dtype, jnp.complexfloating):
            raise TypeError(f"Allreduce(op={self.op!r}) got a {x.dtype} value: complex "
                            "numbers have no order. Reduce their real part or their "
                            "modulus instead.")
        return x

    def is_linear(self) -> bool:
        """**Returns:** whether the reduction is linear: the sum only."""
        return self.op == "sum"

    def takes_complex_step(self) -> bool:
        """**Returns:** whether complex values may be reduced: not by max or min."""
        return self.op in ("sum", "prod")

    def _mpi_op(self) -> Any:
        return getattr(mpi(), self.op.upper())

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=self._mpi_op())
        return out

    def _owns(self, comm: Any, x: np.ndarray) -> np.ndarray:
        """**Returns:** per element of x, whether this rank is the lowest one holding
        the extreme: one Allreduce of (value, rank) pairs where MPI has their type
        (MAXLOC and MINLOC give the lowest rank among equal values), else two."""
        rank = comm.Get_rank()
        paired = _OWNER_PAIRS.get(x.dtype)
        if paired is not None:
            name, layout = paired
            pairs, MPI = np.empty(x.shape, layout), mpi()
            pairs["value"], pairs["rank"] = x, rank
            found, kind = np.empty_like(pairs), getattr(MPI, name)
            comm.Allreduce([pairs, kind], [found, kind],
                           op=MPI.MAXLOC if self.op == "max" else MPI.MINLOC)
            # (a NaN extreme has no holder: every rank gets zero)
            return (found["rank"] == rank) & (found["value"] == x)
        extreme = self.forward(comm, x)
        holds = np.where(x == extreme, rank, comm.Get_size()).astype(np.int64)
        lowest = np.empty_like(holds)
        comm.Allreduce(holds, lowest, op=mpi().MIN)
        return lowest == rank

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        if self.op == "sum":
            return y_bar.copy()
        if self.op == "prod":
            return y_bar * _others_product(comm, x)
        return np.where(self._owns(comm, x), y_bar, np.zeros((), y_bar.dtype))

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        if self.op == "sum":
            share = x_dot
        elif self.op == "prod":
            share = x_dot * _others_product(comm, x)
        else:
            share = np.where(self._owns(comm, x), x_dot, np.zeros((), x_dot.dtype))
        out = np.empty_like(share)
        comm.Allreduce(np.ascontiguousarray(share), out, op=mpi().SUM)
        return out

    def hvp(self, comm: Any, y_bar: np.ndarray, tangent: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        if self.op != "prod":  # (the sum is linear, max and min piecewise linear)
            return np.zeros(np.broadcast_shapes(y_bar.shape, x.shape), y_bar.dtype)
        return y_bar * _others_product_derivative(comm, x, tangent)


def _suffix_sum(comm: Any, y_bar: np.ndarray, inclusive: bool) -> np.ndarray:
    """**Returns:** the sum of `y_bar` over this rank (if `inclusive`) and every later
    one: the reverse prefix sum, the transpose of a prefix sum. A prefix sum over the
    ranks in reverse order: O(log P) steps and the memory of one `y_bar`."""
    y_bar = np.ascontiguousarray(y_bar)
    if comm.Get_size() == 1:
        return y_bar.copy() if inclusive else np.zeros_like(y_bar)
    reverse = _reversed(comm)
    if not inclusive:
        return _exclusive(reverse, y_bar, mpi().SUM, 0)
    out = np.empty_like(y_bar)
    reverse.Scan(y_bar, out, op=mpi().SUM)
    return out


class Scan(DistributedOperator):
    """The inclusive prefix sum over ranks: rank-local in and out.

    Rank r gets y_r = x_0 + ... + x_r.
    Its VJP is the reverse prefix sum, x_bar_r = y_bar_r + ... + y_bar_(P-1) (a `Scan`
    over the ranks in reverse order, on a communicator made once by `Split`).
    Its JVP is the prefix sum of the tangents.

    **Arguments:**
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's x returns y_r, shaped as x.

    **Raises:** nothing when made. A call raises as any operator's does (see
    `DistributedOperator`).
    """

    input_kinds = "varying"
    output_kinds = "varying"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

    forward_collectives = ("Scan",)
    vjp_collectives = ("Scan", "Split")
    jvp_collectives = ("Scan",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.empty_like(x)
        comm.Scan(x, out, op=mpi().SUM)
        return out

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return _suffix_sum(comm, y_bar, inclusive=True)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot)


class Exscan(DistributedOperator):
    """The exclusive prefix sum over ranks: rank-local in and out.

    Rank r gets y_r = x_0 + ... + x_(r-1); rank 0 gets zeros.
    Its VJP is the exclusive reverse prefix sum, x_bar_r = y_bar_(r+1) + ... +
    y_bar_(P-1) (an `Exscan` over the ranks in reverse order, on a communicator made
    once by `Split`).
    Its JVP is the exclusive prefix sum of the tangents.

    **Arguments:**
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).
    - `ordered`: forces the calls ordered or not (keyword; default: ordered under MPI).

    **Returns:** an operator; calling it on this rank's x returns y_r, shaped as x.

    **Raises:** nothing when made. A call raises as any operator's does (see
    `DistributedOperator`).
    """

    input_kinds = "varying"
    output_kinds = "varying"
    _blocks_in: ClassVar[bool] = True  # (see `takes_blocks`)

    forward_collectives = ("Exscan",)
    vjp_collectives = ("Exscan", "Split")
    jvp_collectives = ("Exscan",)
    linear = True
    complex_step = True
    batched_forward = True
    batched_vjp = True
    batched_jvp = True

    def forward(self, comm: Any, x: np.ndarray, *, batched: bool = False) -> np.ndarray:
        out = np.zeros_like(x)
        comm.Exscan(x, out, op=mpi().SUM)
        if comm.Get_rank() == 0:  # (MPI leaves rank 0's result undefined)
            out[...] = 0
        return out

    def vjp(self, comm: Any, y_bar: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return _suffix_sum(comm, y_bar, inclusive=False)

    def jvp(self, comm: Any, x_dot: np.ndarray, x: np.ndarray, *,
            batched: bool = False) -> np.ndarray:
        return self.forward(comm, x_dot)
