"""The host side of an operator call: numpy views in, the user's method, checked numpy out.

One `HostCall` object is what XLA calls back into: the runner of a call's description
(a `CallSpec`, see spec.py). It owns everything per call that is not JAX: contiguous
row-major arrays for user code, the per-row loop or single batched call, and checks of
what user code returns (all but the common case in results.py); a failure goes to
`failure.fail`.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np

from .._agreement.comm import checker
from .._config import settings
from .._diagnostics import profile as _profile
from .._safety import checking as _checking
from .._safety import watchdog as _watchdog
from .._safety.guard import GuardedComm
from .base import HostCallable
from .failure import fail
from .results import check_declared, check_results
from .spec import CallSpec

Rows = slice | np.ndarray | None  # batch rows: a slice, indices, or None for every row
_NO_ROWS = np.zeros(0, np.intp)  # (no row of the batch)


def rows_of(mask: np.ndarray) -> Rows:
    """**Returns:** None if every entry of `mask` is true; else its true entries, as a
    slice where they are contiguous (views, not copies, of the rows), else as indices."""
    found = mask.nonzero()[0]
    if len(found) == len(mask):
        return None
    if len(found):
        first, last = int(found[0]), int(found[-1])
        if last - first + 1 == len(found):
            return slice(first, last + 1)
    return found


class HostCall(HostCallable):
    """The runner of one operator method as called from a compiled program.

    It holds the call's description (`spec`, a `CallSpec`) and what a run needs besides:
    the watchdog's watch, the communicator the method gets, the checker of the checking
    mode, its lean call site (`ffi_id`) and the call it stands for (`origin`).

    **Arguments:** those of `CallSpec.make`: `op`, `phase`, `comm`, `ordered`,
    `in_specs`, `out_specs`, and optionally `levels`, `batch_shape` and `lean`.

    It is compared by identity: JAX caches what it traces by the primitive's parameters.
    """

    def __init__(self, op: Any, phase: str, comm: Any, ordered: bool,
                 in_specs: Sequence[jax.ShapeDtypeStruct],
                 out_specs: Sequence[jax.ShapeDtypeStruct],
                 levels: Sequence[tuple[bool, ...]] | None = None,
                 batch_shape: tuple[int, ...] = (), lean: bool = False) -> None:
        self._hold(CallSpec.make(op, phase, comm, ordered, in_specs, out_specs, levels,
                                 batch_shape, lean))

    @classmethod
    def of(cls, spec: CallSpec) -> "HostCall":
        """**Returns:** a new runner of `spec`."""
        call = cls.__new__(cls)
        call._hold(spec)
        return call

    def _hold(self, spec: CallSpec) -> None:
        """Take `spec`, with copies of what a run reads of it, and set up the runtime
        state.

        Every attribute is set here, in one order, and none later through the
        instance's dictionary: CPython then keeps them in the object itself, where the
        reads of every run are fastest.
        """
        self.spec = spec
        self.op, self.phase, self.comm = spec.op, spec.phase, spec.comm
        # (a `jvp2` call is never run: unordered and off the chain, so that JAX drops
        # it where nothing reads it; see `CallSpec`)
        runs = spec.phase != "jvp2"
        self.ordered, self.lean = spec.ordered and runs, spec.lean and runs
        self.batch_shape, self.levels = spec.batch_shape, spec.levels
        self.slots, self.n_slots, self.n_linear = spec.slots, spec.n_slots, spec.n_linear
        self._n_cotangents = len(spec.out_specs) if spec.phase == "hvp" else None
        self.result_specs, self.n_user_results = spec.result_specs, spec.n_user_results
        self.function, self.where, self.declared = spec.function, spec.where, spec.declared
        self.batched, takes_flag, self.takes_out, _ = spec.method
        # A batched method may take a keyword `batched` to learn whether this call
        # carries the leading batch axis (it does only when distop batches).
        self.kwargs: dict[str, Any] = {"batched": bool(self.batch_shape)} if takes_flag else {}
        self._expected = spec.expected_results
        self._arg_kinds, self._arg_shapes = spec.arg_kinds, spec.arg_shapes
        self.ffi_id = None  # set when lowered (see _ffi.register)
        # the traced call this one stands for (see `narrowed`)
        self.origin: HostCall | None = None
        # The method is busy while it runs, but for its waits in MPI (reusable: no state).
        self._watch = _watchdog.watchdog.busy(
            self.where, GuardedComm(self.comm, self.declared, self.where, site=self.lean))
        # what the method receives: the communication it declared, no more, watched
        self.guarded = self._watch.comm
        self.checker: _checking.Checker | None = None
        several = self.comm is not None and self.comm.Get_size() > 1
        if settings.check_collectives and several:
            self.checker = checker(self.comm)
        # Whether this call decides on its own which rows to skip: where no rank needs
        # to agree on them (a single process, or an operator that declares no
        # collectives). Under MPI a fused call agrees on the rows of several calls with
        # one collective (`FusedCall`); one collective per call costs more than it saves.
        self._skips_alone = spec.skippable and not (several and self.declared)
        # A batch of one row for a method that takes no batch axis (a reverse sweep of
        # one seed): the method runs on the row's views, without the per-row loop.
        self._one_row = self.batch_shape == (1,) and not self.batched

    def __repr__(self) -> str:
        return repr(self.spec)

    # -- the description's, read where no run needs them -----------------------------
    @property
    def in_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The operator's unbatched input `jax.ShapeDtypeStruct`s."""
        return self.spec.in_specs

    @property
    def out_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The operator's unbatched output `jax.ShapeDtypeStruct`s."""
        return self.spec.out_specs

    @property
    def result_picks(self) -> tuple[int, ...] | None:
        """See `CallSpec.result_picks`."""
        return self.spec.result_picks

    @property
    def arg_specs(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """See `CallSpec.arg_specs`."""
        return self.spec.arg_specs

    @property
    def label(self) -> str:
        """See `CallSpec.label`."""
        return self.spec.label

    @property
    def expand_dims(self) -> bool:
        """Whether an unbatched input reaches a batched method with a batch axis of
        length 1 (see `MethodInfo`)."""
        return self.spec.method.expand_dims

    @property
    def skippable(self) -> bool:
        """See `CallSpec.skippable`."""
        return self.spec.skippable

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """**Returns:** the `jax.ShapeDtypeStruct`s of the results XLA receives (batched)."""
        return self.spec.shapes()

    # -- other forms of the call -------------------------------------------------------
    def with_phase(self, phase: str,
                   linear_levels: Sequence[tuple[bool, ...]] | None = None) -> "HostCall":
        """**Returns:** a runner of the same operator call in another phase (see
        `CallSpec.with_phase`)."""
        return HostCall.of(self.spec.with_phase(phase, linear_levels))

    def unleaned(self) -> "HostCall":
        """**Returns:** a runner of this call off the lean path: an ordered `io_callback`."""
        return HostCall.of(self.spec.unleaned())

    def narrowed(self, count: int) -> "HostCall":
        """**Returns:** a runner of this call on `count` rows of its one batch level (a
        rewritten program passes it only the rows that can be nonzero); its `origin` is
        this call (the schedule lists it in this call's place)."""
        call = HostCall.of(self.spec.narrowed(count))
        call.origin = self.origin or self
        return call

    def with_batch(self, in_batched: Sequence[bool], size: int) -> "HostCall":
        """**Returns:** a runner of this call one batch level deeper (see
        `CallSpec.with_batch`)."""
        return HostCall.of(self.spec.with_batch(in_batched, size))

    # -- what XLA calls -------------------------------------------------------------
    def __call__(self, *args: np.ndarray, out: Sequence[np.ndarray] | None = None,
                 rows: Rows | Literal[False] = False) -> tuple[np.ndarray, ...]:
        """Run the user method on XLA's arguments.

        **Arguments:**
        - `args`: the arguments (see `CallSpec`).
        - `out`: the buffers the results go to (the lean path: XLA's own, valid during
          the call), offered to a method that takes `out=`; None if there are none.
        - `rows`: the batch rows to pass, as agreed by a fused call (None: every row);
          by default this call decides (`_nonzero_rows`).

        **Returns:** the checked results (possibly `out`'s arrays themselves).
        """
        profile = _profile.active  # (None unless profiling: nothing more to do)
        with self._watch:
            try:
                comm: Any = self.guarded if profile is None else profile.started(self)
                if self.checker is not None:
                    comm = _checking.CheckedComm(comm, self.checker, self.where)
                if not self.batch_shape:
                    results = self._check(self._invoke(args, comm, out), ())
                else:
                    if rows is False:
                        rows = self._nonzero_rows(args)
                    if rows is not None:
                        results = self._call_some_rows(args, rows, comm, out)
                    elif self._one_row:
                        results = self._call_one_row(args, comm, out)
                    elif self.batched:
                        results = self._call_batched(args, comm, out)
                    else:
                        results = self._call_rows(args, comm)
                if self.checker is not None:
                    check_declared(self, comm.issued)
                    self.checker.check_same(("finished", self.where))
                if profile is not None:
                    profile.ended(self)
                return results
            except BaseException as err:  # noqa: BLE001 - every failure must be reported
                fail(self, err)

    # -- helpers --------------------------------------------------------------------
    def _invoke(self, args: Sequence[np.ndarray], comm: Any,
                out: Sequence[np.ndarray] | None = None) -> Any:
        """Call the user method; `out`: XLA's result buffers, offered (`out=`) to a method
        that takes them: one array, or a tuple in the order the method returns its
        results (None in a vjp's place for an integer input: it has no cotangent)."""
        args = [np.asarray(a, order="C") for a in args]
        if self.takes_out:
            kwargs = {**self.kwargs, "out": self._user_out(out) if out else None}
        else:
            kwargs = self.kwargs
        if self.phase == "forward" or self.n_slots == self.n_linear == 1:
            # the inputs, or one (co)tangent (passed as itself) and the inputs
            return self.function(self.op, comm, *args, **kwargs)
        linear: list[np.ndarray | None] = [None] * self.n_slots
        for slot, a in zip(self.slots, args):
            linear[slot] = a
        if self._n_cotangents is not None:  # (hvp: the cotangent, then the tangent)
            parts = (linear[:self._n_cotangents], linear[self._n_cotangents:])
            pair = [tuple(p) if len(p) > 1 else p[0] for p in parts]
            return self.function(self.op, comm, *pair, *args[self.n_linear:], **kwargs)
        given = tuple(linear) if self.n_slots > 1 else linear[0]
        return self.function(self.op, comm, given, *args[self.n_linear:], **kwargs)

    def _user_out(self, out: Sequence[np.ndarray]) -> Any:
        if self.n_user_results == 1 and len(out) == 1:
            return out[0]
        every: list[np.ndarray | None] = [None] * self.n_user_results
        for (k, _, _), buffer in zip(self._expected, out):
            every[k] = buffer
        return every[0] if self.n_user_results == 1 else tuple(every)

    def row_mask(self, args: Sequence[np.ndarray]) -> np.ndarray:
        """**Returns:** per batch row, whether some (co)tangent in `args` is nonzero
        there, on this rank."""
        n = self.batch_shape[0]
        masks = [np.asarray(a).reshape(n, -1).any(axis=1) for a in args[:self.n_linear]]
        # (numpy's stubs allow a scalar from `any(axis=1)`: never, on a 2-D array)
        return (masks[0] if len(masks) == 1  # type: ignore[return-value]
                else np.logical_or.reduce(masks))

    def _nonzero_rows(self, args: Sequence[np.ndarray]) -> Rows:
        """The rows of a batch of (co)tangents that are not all zero, so that the method
        sees only those (with K seeds, an operator that only some outputs depend on
        gets only their rows).

        **Returns:** the row indices, or None to pass every row.
        """
        if not self._skips_alone:
            return None
        if self.batch_shape == (1,):  # (one row: whether any of its entries is nonzero)
            return None if any(a.any() for a in args[:self.n_linear]) else _NO_ROWS
        return rows_of(self.row_mask(args))

    def _call_one_row(self, args: Sequence[np.ndarray], comm: Any,
                      out: Sequence[np.ndarray] | None) -> tuple[np.ndarray, ...]:
        """The method on the one row of a batch of one, given the row's views (and
        XLA's buffers' rows, where given, to write into)."""
        # (`[0, ...]`: a view, 0-d where the row is, never a numpy scalar)
        row = [a[0, ...] if lv[0] else a for a, lv in zip(args, self.levels)]
        given = [o[0, ...] for o in out] if out else None
        results = self._check(self._invoke(row, comm, given), ())
        if given is None:
            return tuple(r[None] for r in results)
        for buffer, r in zip(given, results):
            if r is not buffer:
                buffer[...] = r
        return tuple(out)  # type: ignore[arg-type]  # (given: `out` is not None)

    def _call_some_rows(self, args: Sequence[np.ndarray], rows: slice | np.ndarray, comm: Any,
                        out: Sequence[np.ndarray] | None) -> tuple[np.ndarray, ...]:
        """The method on the batch rows `rows` only; zeros in the other rows. Writes
        into `out` (XLA's buffers) when given; a batched method that takes `out=` then
        gets its part of them when the rows are contiguous."""
        part = [a[rows] if lv[0] else a for a, lv in zip(args, self.levels)]
        count = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
        results = out if out is not None else [np.empty(self.batch_shape + s.shape, s.dtype)
                                               for s in self.result_specs]
        given = None
        found: Sequence[np.ndarray | int]
        if not count:
            found = [0] * len(results)
        elif self.batched:
            if isinstance(rows, slice) and out is not None and self.takes_out:
                given = [full[rows] for full in results]
            found = self._call_batched(part, comm, given, batch_shape=(count,))
        else:
            found = self._call_rows(part, comm, (count,))
        for full, some in zip(results, found):
            if isinstance(rows, slice) and count:
                if rows.start:
                    full[:rows.start] = 0
                if rows.stop < len(full):
                    full[rows.stop:] = 0
            else:
                full[...] = 0
            if count:
                full[rows] = some  # (no copy when written in place: the same memory)
        return tuple(results)

    def _call_rows(self, args: Sequence[np.ndarray], comm: Any,
                   batch_shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, ...]:
        batch_shape = self.batch_shape if batch_shape is None else batch_shape
        outs = [np.empty(batch_shape + s.shape, s.dtype) for s in self.result_specs]
        for idx in np.ndindex(*batch_shape):
            row = [a[tuple(i for i, on in zip(idx, lv) if on)]
                   for a, lv in zip(args, self.levels)]
            for out, r in zip(outs, self._check(self._invoke(row, comm), (), idx)):
                out[idx] = r
        return tuple(outs)

    def _call_batched(self, args: Sequence[np.ndarray], comm: Any,
                      out: Sequence[np.ndarray] | None = None,
                      batch_shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, ...]:
        batch_shape = self.batch_shape if batch_shape is None else batch_shape
        n = math.prod(batch_shape)
        full = []
        for a, lv, kind, shape in zip(args, self.levels, self._arg_kinds, self._arg_shapes):
            if kind == "full":
                if len(batch_shape) > 1:
                    a = a.reshape((n,) + shape)
            elif kind == "expand" or n == 1:  # (a batch of one: the row itself)
                a = a.reshape((1,) + shape)
            else:
                a = np.asarray(a).reshape(tuple(b if on else 1 for b, on in zip(batch_shape, lv))
                                          + shape)
                a = np.broadcast_to(a, batch_shape + shape).reshape((n,) + shape)
            full.append(a)
        if out and len(batch_shape) > 1:
            out = [o.reshape((n,) + s.shape) for o, s in zip(out, self.result_specs)]
        results = self._check(self._invoke(full, comm, out), (n,))
        if len(batch_shape) == 1:
            return results
        return tuple(r.reshape(batch_shape + s.shape)
                     for r, s in zip(results, self.result_specs))

    def _check(self, result: Any, batch: tuple[int, ...],
               row: tuple[int, ...] | None = None) -> tuple[np.ndarray, ...]:
        """**Returns:** the method's results, checked (see `results.check_results`)."""
        if self.n_user_results == 1 and type(result) is np.ndarray \
                and len(self._expected) == 1:
            # (one array returned: the common case, checked here without a call more)
            _, shape, dtype = self._expected[0]
            if result.shape == batch + shape and result.dtype == dtype \
                    and result.flags.c_contiguous:
                return (result,)
        return check_results(self, result, batch, row)

    def say(self, text: str) -> str:
        """**Returns:** `text` after the method and rank it is of, for messages."""
        rank = self.comm.Get_rank() if self.comm is not None else 0
        return f"{self.where} on rank {rank}: {text}"
