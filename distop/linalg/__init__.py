"""Matrix-free distributed Krylov solvers on numpy blocks: `cg` and `gmres`.

For operators whose output solves a system (a residual R(y, x) = 0, say): the forward
method solves with the Jacobian, the `vjp` with its transpose, both in parallel. Each
rank holds a block of the global vectors, a 1-D numpy array of any length (zero
included); `matvec(v)` applies the operator to this rank's block of `v` and does its
own halo exchange. Every inner product and norm is summed over the ranks by
`comm.Allreduce` (several of them in one call where the algorithm allows), so every
rank holds the same scalars and takes the same decisions: the same iterations, the same
calls of `matvec` (and so of its halo exchanges), the same verdict. A failure (the
iteration limit, a breakdown, a bad block on one rank) is therefore raised on every rank
alike, and no rank waits in a collective the others have left.

This rests on the MPI library's `Allreduce` giving every rank the same bits, as MPICH
and Open MPI do (the MPI standard recommends it), and on every rank passing the same
options (`rtol`, `atol`, `maxiter`, `restart`).
"""

from .._errors import ConvergenceError as ConvergenceError
from ._cg import cg as cg
from ._gmres import gmres as gmres
from ._solve import SolveResult as SolveResult

__all__ = ["ConvergenceError", "SolveResult", "cg", "gmres"]
