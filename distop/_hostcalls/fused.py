"""Several lean host calls run by one host call, one after another."""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._agreement.comm import mpi
from .._safety import watchdog as _watchdog
from .base import HostCallable
from .host import HostCall, Rows, rows_of

# per member, per argument: (False, k) for the fused call's argument k, or (True, k)
# for result k of the members before it (counted over all of them)
Wiring = tuple[tuple[tuple[bool, int], ...], ...]


class FusedCall(HostCallable):
    """Several lean `HostCall`s run by one host call, in order.

    **Arguments:**
    - `members`: the `HostCall`s, in chain order.
    - `wiring`: per member, per argument: `(False, k)` for the fused call's argument k,
      or `(True, k)` for result k of the members before it (counted over all of them).
    - `returned`: the member results (same counting) that leave the fused call, in order.

    Under MPI its members may skip the (co)tangent rows that are zero on every rank,
    agreed with one collective of its own (`_agree_rows`).
    """

    lean = ordered = True
    phase = "fused"

    def __init__(self, members: Sequence[HostCall], wiring: Wiring,
                 returned: tuple[int, ...]) -> None:
        self.members, self.wiring, self.returned = tuple(members), wiring, returned
        self.ffi_id = None  # set when lowered (see _ffi.register)
        # per member: where its results sit in XLA's buffers, if all of them leave
        where, start, self._offers = {k: i for i, k in enumerate(returned)}, 0, []
        for member in self.members:
            mine = range(start, start + len(member.result_specs))
            self._offers.append(None if any(k not in where for k in mine)
                                else [where[k] for k in mine])
            start = mine.stop
        self._agreeing, self._comm = self._members_agreeing_on_rows()

    @property
    def agreeing(self) -> tuple[int, ...]:
        """The members that skip zero (co)tangent rows on rows the fused call agrees
        across ranks, by this rank's wiring (see `agree_on`)."""
        return self._agreeing

    def agree_on(self, members: Sequence[int] | set[int]) -> None:
        """Agree rows for `members` only (the agreeing members of every rank: the
        Allreduce of `_agree_rows` runs on every rank or none), at least two of them."""
        self._agreeing = tuple(sorted(members)) if len(members) >= 2 else ()

    def __repr__(self) -> str:
        return f"fused[{', '.join(map(repr, self.members))}]"

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """**Returns:** the `jax.ShapeDtypeStruct`s of the returned results."""
        every = [s for m in self.members for s in m.shapes()]
        return tuple(every[k] for k in self.returned)

    def __call__(self, *args: np.ndarray,
                 out: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Run the members in order; `out`: XLA's buffers of the returned results, each
        offered to the member that computes it when all of its results are returned."""
        rows = self._agree_rows(args) if self._agreeing else {}
        results: list[np.ndarray] = []
        for i, (member, wiring, offer) in enumerate(zip(self.members, self.wiring,
                                                        self._offers)):
            given = None if out is None or offer is None else [out[k] for k in offer]
            results.extend(member(*[_read_only(results[k]) if inner else args[k]
                                    for inner, k in wiring],
                                  out=given, rows=rows.get(i, False)))
        return [results[k] for k in self.returned]

    def _members_agreeing_on_rows(self) -> tuple[tuple[int, ...], Any]:
        """**Returns:** (the members that skip zero (co)tangent rows on rows agreed by
        the fused call, their communicator): members that can skip rows, whose
        (co)tangents come from outside the fused call, on one communicator with more
        than one rank, if there are at least two of them (else none)."""
        chosen, comm = [], None
        for i, (member, wiring) in enumerate(zip(self.members, self.wiring)):
            if (member.skippable and not any(inner for inner, _ in wiring[:member.n_linear])
                    and (comm is None or member.comm is comm)):
                chosen.append(i)
                comm = member.comm
        if len(chosen) < 2 or comm is None or comm.Get_size() == 1:
            return (), None
        return tuple(chosen), comm

    def _agree_rows(self, args: Sequence[np.ndarray]) -> dict[int, Rows]:
        """The nonzero (co)tangent rows of the agreeing members, agreed across ranks
        with ONE collective, so that they call their methods on the same rows
        everywhere.

        **Returns:** member index -> rows (None: every row).
        """
        masks = [self.members[i].row_mask(
            [args[k] for _, k in self.wiring[i][:self.members[i].n_linear]])
            for i in self._agreeing]
        every = np.concatenate(masks).astype(np.uint8)
        with _watchdog.watchdog.watch("fused call: agreeing on the nonzero rows"):
            self._comm.Allreduce(mpi().IN_PLACE, every, op=mpi().MAX)
        found, start = {}, 0
        for i, mask in zip(self._agreeing, masks):
            found[i] = rows_of(every[start:start + mask.size].astype(bool))
            start += mask.size
        return found


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view: a member's result, passed to the next, may be XLA's buffer of
    a program result (methods get read-only arguments everywhere)."""
    view = array.view()
    view.flags.writeable = False
    return view
