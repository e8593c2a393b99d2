"""`with_kinds`: a function whose derivatives are right across ranks without `RankLocal`,
and the `Inference` a Problem runs its model through.

Each time the function is traced, its jaxpr is traced once more on its own and walked
(`analyse`): its arguments are varying where declared distributed and replicated
otherwise, its constants by whether they are the same on every rank (`agree`). Where no
replicated value meets varying data, the function is called as it is; else its jaxpr is
run again with `vary` at each such place (`emit`).
"""

import functools
import inspect
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from .._agreement import comm as _comm
from .._agreement.coordinator import stable_hash
from .._collectives.basic import AllreduceSum
from .._compiler.jaxprs import anywhere
from .._errors import DistopError, KindError
from .._hostcalls import sessions as _sessions
from .._operators.kinds import inferring
from .analysis import REPLICATED, VARYING, Info, analyse_function, inner_constants
from .emit import emit


def with_kinds(fn: Callable[..., Any], distributed: str | int | Iterable[str | int] = (),
               *, comm: Any = None) -> Callable[..., Any]:
    """`fn` with every replicated value's cotangent summed over the ranks where it meets
    varying data, as a data-parallel gradient needs.

    In plain JAX, `jax.grad` of a function that multiplies a replicated parameter by
    each rank's own data and sums the loss with `AllreduceSum` gives each rank its own
    share of the gradient, not the sum. `with_kinds` finds, when `fn` is traced, which
    values are the same on every rank (replicated) and which differ (varying), and
    passes each replicated value through `vary` where it meets varying data: the
    identity, whose transpose is the sum over the ranks (as `RankLocal`, and JAX's own
    `pvary` in `shard_map`). A `Problem` does this to its model by itself.

    Kinds come from the arguments (varying where named in `distributed`, replicated
    otherwise), the constants the function closes over (varying where they differ
    between ranks: one small collective per trace compares them), the operators'
    declared kinds (see `DistributedOperator`), and jax.numpy's rule: a result is
    varying where an operand is. Loops, branches, checkpoints and inner jits are entered.

    **Arguments:**
    - `fn`: the function; its arguments are arrays or pytrees of arrays.
    - `distributed`: the arguments that differ between ranks (each rank's own data), by
      name or position.
    - `comm`: the communicator (keyword; default `MPI.COMM_WORLD`).

    **Returns:** a function with `fn`'s signature and values, to pass to `jax.jit`,
    `jax.grad` or `jax.value_and_grad`. Trace it on every rank alike, as any collective
    (tracing compares the constants).

    **Raises:** when traced, `KindError` (a `DistopError`) where a replicated value
    that carries a derivative meets the output of an operator that declares no kinds,
    naming both; `DistopError` where the ranks close over different numbers of
    constants.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np
    from mpi4py import MPI

    import distop

    jax.config.update("jax_enable_x64", True)
    x_local = np.arange(3.0) + 3 * MPI.COMM_WORLD.Get_rank()  # this rank's data
    total = distop.AllreduceSum()
    loss = distop.with_kinds(lambda w: total(jnp.sum(w * x_local)))
    grad = jax.jit(jax.grad(loss))(jnp.ones(3))  # the sum of every rank's x_local
    assert np.allclose(grad, MPI.COMM_WORLD.allreduce(x_local))
    ```
    """
    inference = Inference(comm, distributed, compare_at_trace=True)
    return inference.wrap(fn)


_HOST_CODE = ("io_callback", "pure_callback", "ffi_call")  # a model's own host code


class Inference:
    """Kind inference for one function and communicator.

    **Arguments:**
    - `comm`: the communicator, or None for `MPI.COMM_WORLD`.
    - `distributed`: the varying arguments, by name or position.
    - `compare_at_trace`: whether each trace compares the constants across ranks at once
      (`with_kinds`); else constants not seen before count as replicated until
      `compare_constants` compares them, which a Problem calls where every rank is
      (after its run program is traced).
    """

    def __init__(self, comm: Any, distributed: Any, compare_at_trace: bool) -> None:
        self.comm = _comm.internal(comm)
        names = [distributed] if isinstance(distributed, (str, int)) else list(distributed)
        self.distributed = frozenset(names)
        self.compare_at_trace = compare_at_trace
        self.total = AllreduceSum(comm=comm)
        self.kinds: dict[int, int] = {}  # a constant's hash -> its kind, as agreed
        self.pending: list[int] = []  # hashes not compared yet (see `compare_constants`)
        self.output_kinds: Any = None  # the last trace's outputs, each leaf its kind
        # the last trace's jaxpr, the kinds of its arguments and the hashes of its
        # constants (those of the closed jaxpr, then those inside it), until `copies`
        # reads it
        self._last: tuple[Any, list[Info], list[int | None], list[Any]] | None = None
        self._replicated_names: list[str] = []  # the last trace's replicated arguments

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """**Returns:** `fn`, traced through this inference."""
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return self.call(fn, args, kwargs)
        return wrapped

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Call `fn`, with `vary` where its kinds say."""
        self.output_kinds, self._last = None, None
        token = inferring.set(True)
        try:
            if self.comm.Get_size() == 1:  # (a sum over one rank is the identity)
                return fn(*args, **kwargs)
            return self._call(fn, args, kwargs)
        finally:
            inferring.reset(token)

    def _call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """`call` with several ranks."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        kinds = jax.tree.leaves(self._argument_kinds(fn, args, kwargs))
        out_tree: list[Any] = []

        def flat(*values: Any) -> list[Any]:
            a, k = jax.tree.unflatten(tree, values)
            out, found = jax.tree.flatten(fn(*a, **k))
            out_tree.append(found)
            return out

        try:
            with _sessions.paused():
                closed = jax.make_jaxpr(flat)(*leaves)
        except Exception as err:
            if self.compare_at_trace:  # (with_kinds: never a silent call without kinds)
                raise DistopError(
                    f"with_kinds: {getattr(fn, '__name__', 'the function')} could not be "
                    f"traced on its own ({type(err).__name__}: {err}). Its arguments "
                    "must be arrays or pytrees of arrays; bind any other with "
                    "functools.partial.") from err
            return fn(*args, **kwargs)  # (a Problem: the model's own trace raises)
        inner = inner_constants(closed.jaxpr)
        hashes = [None if isinstance(c, jax.core.Tracer) else _content_hash(c)
                  for c in [*closed.consts, *inner]]
        ins = [Info(kind, True) for kind in kinds]
        self._last = (closed, ins, hashes, inner)
        self._replicated_names = self._replicated_arguments(fn, args, kwargs)
        outs, plan, copies = self._analyse(self._constant_kinds(hashes))
        if self.compare_at_trace:  # (with_kinds: the constants are compared already)
            self._last = None  # (nothing reads it again: its constants are not kept)
        if copies and self.compare_at_trace:
            raise KindError(self.copies_message(
                f"with_kinds({getattr(fn, '__name__', 'fn')})", copies, "arguments",
                "with_kinds(..., distributed=...)"))
        # (host code of the model's own may reduce values itself: their kinds are not known)
        opaque = anywhere(closed.jaxpr.eqns, lambda e: e.primitive.name in _HOST_CODE)
        self.output_kinds = None if opaque else jax.tree.unflatten(
            out_tree[0], [info.kind for info in outs])
        if not plan.varies:
            return fn(*args, **kwargs)
        outs = emit(closed.jaxpr, closed.consts, leaves, plan, self.total)
        return jax.tree.unflatten(out_tree[0], outs)

    def _analyse(self, infos: list[Info]) -> tuple[list[Info], Any, list[str]]:
        """`analyse_function` of the last trace, with its constants' `infos`."""
        assert self._last is not None
        closed, ins, _, inner = self._last
        n = len(closed.consts)
        return analyse_function(closed.jaxpr, ins, infos[:n],
                                {id(c): i for c, i in zip(inner, infos[n:])})

    def copies(self) -> list[str]:
        """**Returns:** the operators of the last traced model that combine each rank's
        own block and are given copies of one value that depends on its inputs (see
        `analyse_function`), with the constants' kinds as compared now."""
        if self._last is None:
            return []
        try:
            return self._analyse(self._constant_kinds(self._last[2]))[2]
        finally:  # (read once, as a Problem is made: its jaxpr and constants not kept)
            self._last = None

    def copies_message(self, where: str, copies: list[str], what: str, fix: str) -> str:
        """**Returns:** the error of `copies` (see `copies`) for `where`, whose inputs
        are its `what`, declared by `fix`."""
        names = ", ".join(self._replicated_names) or "none"
        return (f"{where}: {', '.join(copies)} combines each rank's own block, and is given "
                f"a value that is the same on every rank: it depends only on {what} "
                f"taken as replicated ({names}) and constants equal on every rank. Copies "
                "of one value give a wrong result there (a sum of P copies, or a rank's "
                f"own rows as its neighbours'). If one of those {what} holds each rank's "
                f"own block or data, name it in {fix}; if the copies are meant, pass the "
                "value through distop.RankLocal() first.")

    def varying_outputs(self) -> list[str]:
        """**Returns:** the names of the last traced model's outputs (a dict) that vary
        between ranks by their inferred kind (every leaf varying; constants not yet
        compared count as replicated); none where the model has host code of its own
        (`io_callback`, `pure_callback`, an FFI call), which may reduce values itself."""
        kinds = self.output_kinds
        if not isinstance(kinds, dict):
            return []
        return sorted(k for k, v in kinds.items()
                      if jax.tree.leaves(v) and all(leaf == VARYING for leaf in jax.tree.leaves(v)))

    def _argument_kinds(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """**Returns:** `(args, kwargs)` with each leaf replaced by its kind."""
        named: set[str | int] = set()
        if any(isinstance(d, str) for d in self.distributed):
            try:
                bound = inspect.signature(fn).bind(*args, **kwargs)
            except (TypeError, ValueError):
                bound = None
            if bound is not None:
                named = {k for k in bound.arguments if k in self.distributed}
                params = list(inspect.signature(fn).parameters)
                named |= {i for i, k in enumerate(params[:len(args)]) if k in named}

        def kind(value: Any, varying: bool) -> Any:
            return jax.tree.map(lambda _: VARYING if varying else REPLICATED, value)

        marked = tuple(kind(a, i in self.distributed or i in named)
                       for i, a in enumerate(args))
        return marked, {k: kind(v, k in self.distributed) for k, v in kwargs.items()}

    def _replicated_arguments(self, fn: Callable[..., Any], args: tuple,
                              kwargs: dict) -> list[str]:
        """**Returns:** the names of the arguments taken as replicated (positions where
        `fn` has no signature to read)."""
        try:
            bound = inspect.signature(fn).bind(*args, **kwargs).arguments
        except (TypeError, ValueError):
            bound = {**{str(i): a for i, a in enumerate(args)}, **kwargs}
        params = list(bound)
        return [k for i, k in enumerate(params)
                if k not in self.distributed and i not in self.distributed]

    def _constant_kinds(self, hashes: list[int | None]) -> list[Info]:
        """**Returns:** the `Info` of each constant, by its hash (None: a value of an
        enclosing trace, which counts as replicated): varying where its value differs
        between ranks (compared now, or at `compare_constants`, as `compare_at_trace`
        says)."""
        if self.compare_at_trace:
            known = [h for h in hashes if h is not None]
            kinds = dict(zip(known, kinds_by_hash(self.comm, known, strict=True)))
        else:
            kinds = self.kinds
            self.pending.extend(h for h in hashes if h is not None and h not in kinds)
        return [Info(kinds.get(h, REPLICATED) if h is not None else REPLICATED)
                for h in hashes]

    def compare_constants(self, most: Callable[[np.ndarray], np.ndarray]) -> None:
        """Compare the constants met since the last call across ranks (collective: every
        rank calls it at the same point), with `most` (the elementwise max over ranks)."""
        pending, self.pending = self.pending, []
        self.kinds.update(zip(pending, kinds_by_hash(self.comm, pending, most=most)))


def kinds_by_hash(comm: Any, hashes: list[int], strict: bool = False,
          most: Callable[[np.ndarray], np.ndarray] | None = None) -> list[int]:
    """Find which of a list of constants differ between ranks, from their hashes.

    One reduction of four numbers where every rank holds the same; a second one, of two
    numbers per constant, names those that differ.

    **Arguments:**
    - `comm`: the communicator.
    - `hashes`: this rank's hash of each constant, in the order of the trace.
    - `strict`: raise where the ranks hold different numbers of constants (else they
      count as replicated, and the Problem's check of its first totals is the net).
    - `most`: the elementwise max over ranks of an int64 vector (default: an Allreduce
      on `comm`).

    **Returns:** the kind of each constant.
    """
    if comm.Get_size() == 1:
        return [REPLICATED] * len(hashes)
    most = most or functools.partial(_comm.most, comm)
    n, whole = len(hashes), stable_hash(tuple(hashes))
    top = most(np.array([n, -n, whole, -whole], np.int64))
    if top[0] != -top[1]:
        if strict:
            raise DistopError(
                f"with_kinds: the ranks' functions close over different numbers of "
                f"constants (from {-top[1]} to {top[0]}; this rank {n}): pass the data that "
                "differs between ranks as arguments named in distributed=.")
        return [REPLICATED] * n
    if top[2] == -top[3]:
        return [REPLICATED] * n
    each = np.array(hashes, np.int64)
    top = most(np.concatenate([each, -each]))
    return [REPLICATED if high == -low else VARYING for high, low in zip(top[:n], top[n:])]


def _content_hash(value: Any) -> int:
    """**Returns:** a hash of an array's shape, dtype and bytes, the same in every
    process for the same value."""
    array = np.ascontiguousarray(np.asarray(value))
    data = array.tobytes()
    return stable_hash((array.shape, array.dtype.str, zlib.crc32(data), zlib.adler32(data)))
