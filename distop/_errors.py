"""Exception types raised by distop."""

from typing import Any


class DistopError(Exception):
    """The base class of every error distop raises on purpose.

    Under MPI distop raises an error on every rank alike.
    Where one rank's argument is refused, the other ranks raise a `DistopError` naming
    it.
    A failure inside an operator's method aborts the job instead, outside the checking
    mode.
    """

    elsewhere = False  # whether it reports a failure on another rank, not this one's


class OperatorError(DistopError, RuntimeError):
    """A user operator failed or returned something unexpected.

    The message names the operator, the phase (`forward`, `vjp`, `jvp`), the rank and
    what was expected.
    It is also raised where a method makes an MPI call its phase did not declare.
    """


_both: dict[type, type] = {}  # a DistopError subclass -> its OperatorError twin


def operator_error(message: str, cause: BaseException) -> OperatorError:
    """The `OperatorError` reporting `cause`, raised in an operator's method.

    Where `cause` is a `DistopError` of another kind (a `ConvergenceError` of a solve
    inside the method, say), the error is of both kinds, so that an `except` for the
    original kind still catches it; it keeps the original's attributes (`result`).

    **Arguments:**
    - `message`: the message, naming the operator, the phase and the rank.
    - `cause`: the exception the method raised.

    **Returns:** the error (its `__cause__` left to the caller).
    """
    kind = type(cause)
    if not isinstance(cause, DistopError) or isinstance(cause, OperatorError):
        return OperatorError(message)
    both = _both.get(kind)
    if both is None:
        both = _both[kind] = type(kind.__name__, (OperatorError, kind),
                                  {"__module__": kind.__module__,
                                   "__qualname__": kind.__qualname__,
                                   "__doc__": f"An `OperatorError` that is a "
                                              f"`{kind.__name__}` too."})
    err = both(message)
    err.__dict__.update(cause.__dict__)
    return err


class MissingMethodError(OperatorError, NotImplementedError):
    """An operator lacks a method the requested computation needs.

    Forward mode (`jax.jvp`, `jax.jacfwd`) through an operator without `jvp` raises it,
    naming the operator.
    """


class SecondDerivativeError(DistopError, NotImplementedError):
    """A second derivative through an operator cannot be computed.

    A Hessian, `jax.jvp` of `jax.grad`, `jax.grad` of `jax.grad` or `compute_hvp`
    through a nonlinear operator without `hvp` (or `jvp`) raises it where the second
    derivative is evaluated, naming the operator and the method to add; so do forward
    mode over forward mode (`jax.jacfwd` of `jax.jacfwd`: use `jax.hessian`) and third
    derivatives.
    """


class OrderedEffectError(DistopError, NotImplementedError):
    """JAX cannot transform an operator's ordered calls where they are.

    Outside a `Problem`, the calls of an operator that communicates on more than one
    rank (or declares `ordered = True`) are ordered `io_callback`s, which JAX cannot
    differentiate inside `jax.checkpoint`, nor vmap inside `lax.cond` or `while_loop`.
    The message names the operator and the fix: a `Problem`, whose lean path does
    these, or the documented alternative.
    """


class ScheduleMismatchError(DistopError, RuntimeError):
    """Ranks compiled different collective schedules for the same entry point.

    Raised on every rank, with the first differing schedule entry of each rank.
    """


class CollectiveMismatchError(DistopError, RuntimeError):
    """In the checking mode, ranks were about to issue different collectives.

    It is also raised where one rank was elsewhere.
    Raised on every rank, naming what each rank was doing.
    """


class LauncherMismatchError(DistopError, RuntimeError):
    """The launcher and the MPI library do not match.

    Raised at `import distop` or when MPI starts, naming the library, the launcher and
    the fix.
    """


class MPIUnavailableError(DistopError, ImportError):
    """mpi4py cannot load an MPI library, but MPI was needed."""


class DerivativeCheckError(DistopError, ValueError):
    """`check_totals(raise_on_error=True)` found a block that fails.

    Raised on every rank.
    """


class ConvergenceError(DistopError, RuntimeError):
    """An iterative solver of `distop.linalg` stopped short of its tolerance.

    That is its iteration limit, or a breakdown.
    Raised on every rank alike, naming the solver, the iterations, the residual against
    the tolerance and the fix.
    Its `result` holds the `SolveResult` reached.
    """

    result: Any = None


class KindError(DistopError):
    """The kinds of a model cannot tell whether a replicated value's derivative is the
    sum of every rank's share, or say that a declaration is missing.

    That is where a replicated value meets the output of an operator that declares no
    `output_kinds`, or where an operator that combines each rank's own block (such as
    `AllreduceSum` or `HaloExchange`) is given a value that depends only on inputs
    taken as replicated: an input left out of `distributed=`, almost always.
    Raised when the model is traced (a Problem's construction), on every rank alike,
    naming the operator, the jax.numpy operation or the inputs, and the fix.
    """


class KindWarning(UserWarning):
    """JAX differentiates a collective outside `with_kinds` and a Problem.

    There, the derivative of a replicated value that meets each rank's own data is that
    rank's share only, unless the function passes it through `RankLocal` itself.
    Warned once per process; `warnings.filterwarnings("ignore",
    category=distop.KindWarning)` silences it where the derivatives are right already.
    """
