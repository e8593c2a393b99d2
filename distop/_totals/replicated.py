"""Checks that replicated values are the same on every rank: at a Problem's initial
point (`check_replicated_inputs`, as it is made) and at any point (`check_replicated`,
for `check_totals` and `check_replicated=True`)."""

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .._agreement.coordinator import stable_hash
from .._errors import DistopError


def _canonical(array: Any) -> np.ndarray:
    """`array` with every NaN made one NaN and every negative zero a zero: values that
    compare equal then have equal bytes."""
    a = np.asarray(array)
    if a.dtype.kind == "c":
        return _canonical(a.real) + 1j * _canonical(a.imag)
    if a.dtype.kind != "f":
        return a
    return np.where(np.isnan(a), np.nan, a + 0.0)  # (-0.0 + 0.0 is 0.0)


def digest(array: Any) -> str:
    """A short hash of `array`'s values and shape, equal for arrays of equal values."""
    a = np.ascontiguousarray(_canonical(array))
    return hashlib.sha256(a.tobytes() + str(a.shape).encode()).hexdigest()[:16]


def _difference(mine: Any, ref: Any) -> str | None:
    """**Returns:** how `mine` differs from `ref` in words, or None where their values
    are equal (NaN equal to NaN, 0.0 to -0.0)."""
    mine, ref = np.asarray(mine), np.asarray(ref)
    if mine.shape != ref.shape:
        return f"has shape {mine.shape}, rank 0 {ref.shape}"
    if mine.dtype != ref.dtype:
        return f"has dtype {mine.dtype}, rank 0 {ref.dtype}"
    if digest(mine) == digest(ref):
        return None
    if mine.dtype.kind in "biu":
        mine, ref = mine.astype(np.float64), ref.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        nan_mine, nan_ref = np.isnan(mine), np.isnan(ref)
        if (nan_mine != nan_ref).any():
            i = np.unravel_index(np.argmax(nan_mine != nan_ref), mine.shape)
            return (f"has {mine[i]} at index {tuple(map(int, i))}, rank 0 {ref[i]} (NaN on "
                    "one side only)")
        gap = np.where(nan_mine, 0, np.abs(mine - ref))
        i = np.unravel_index(np.argmax(gap), mine.shape)
        return (f"differs from rank 0 by up to {float(gap[i]):.3e} (at index "
                f"{tuple(map(int, i))}: {mine[i]} against {ref[i]})")


def check_replicated(comm: Any, distributed: frozenset[str], values: dict[str, Any],
                     where: str) -> None:
    """Raise on every rank if a replicated value differs between ranks.

    Values are compared, not bytes: NaN equals NaN and 0.0 equals -0.0.

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `distributed`: the names of the distributed values.
    - `values`: name -> numpy array (inputs and outputs of one point).
    - `where`: the calling method, for the message.
    """
    names = [k for k in values if k not in distributed]
    if comm.Get_size() == 1 or not names:
        return
    every = comm.allgather([digest(values[k]) for k in names])
    bad = [i for i, k in enumerate(names) if len({d[i] for d in every}) > 1]
    if not bad:
        return
    arrays = comm.allgather([np.asarray(values[names[i]]) for i in bad])
    lines = [f"{where}: replicated values differ between ranks (they must be the same on "
             "every rank, or be declared in Problem(distributed=...)):"]
    for j, i in enumerate(bad):
        ref = arrays[0][j]
        for rank, mine in enumerate(arrays[1:], start=1):
            said = _difference(mine[j], ref)
            if said is not None:
                lines.append(f"  {names[i]!r}: rank {rank} {said}")
    raise DistopError("\n".join(lines))


# Values that ranks compute themselves may differ in their last bits: a replicated
# input counts as the same on every rank where it is within this many units in the last
# place of its largest magnitude of rank 0's value (integers and booleans: exactly).
REPLICATED_ULPS = 64


def check_replicated_inputs(comm: Any, most: Callable[[np.ndarray], np.ndarray],
                            distributed: frozenset[str], point: dict[str, Any]) -> None:
    """Raise on every rank where an input not named in `distributed` differs between
    ranks by more than its last bits (see `REPLICATED_ULPS`), as a Problem is made.

    One reduction of two numbers where every rank holds the same values; only where
    they differ, a gather of the inputs that differ, to measure by how much.

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `most`: the elementwise max over ranks of an int64 vector.
    - `distributed`: the names of the distributed values.
    - `point`: name -> numpy array, the initial point.
    """
    names = [k for k in point if k not in distributed]
    if comm.Get_size() == 1 or not names:
        return
    digests = [digest(point[k]) for k in names]
    whole = stable_hash((names, digests))
    top = most(np.array([whole, -whole], np.int64))
    if top[0] == -top[1]:
        return
    every = comm.allgather(dict(zip(names, digests)))
    bad = [k for k in names if all(k in d for d in every) and len({d[k] for d in every}) > 1]
    arrays = comm.allgather([np.asarray(point[k]) for k in bad])
    lines = []
    for j, name in enumerate(bad):
        ref = arrays[0][j]
        for rank, mine in enumerate(arrays[1:], start=1):
            said = _difference(mine[j], ref)
            if said is not None and not _last_bits(mine[j], ref):
                lines.append(f"  {name!r}: rank {rank} {said}")
    if lines:
        first = sorted({line.split("'")[1] for line in lines})
        raise DistopError(
            "Problem: inputs not named in distributed= differ between ranks, so distop "
            "would take them as replicated (the same everywhere) and sum their "
            "derivatives over the ranks:\n" + "\n".join(lines) + "\nIf each rank holds "
            f"its own block of these inputs, declare them: Problem(..., distributed="
            f"{set(first) | set(distributed)!r}); if they must be the same everywhere, "
            "give every rank the same values.")


def _last_bits(mine: np.ndarray, ref: np.ndarray) -> bool:
    """**Returns:** whether floating-point `mine` is within `REPLICATED_ULPS` units in the
    last place of `ref`'s largest magnitude (same shape and dtype)."""
    if mine.shape != ref.shape or mine.dtype != ref.dtype or mine.dtype.kind not in "fc":
        return False
    with np.errstate(invalid="ignore", over="ignore"):
        if (np.isnan(mine) != np.isnan(ref)).any():
            return False
        gap = np.where(np.isnan(ref), 0, np.abs(mine - ref))
        scale = np.max(np.where(np.isnan(ref), 0, np.abs(ref)), initial=0.0)
    eps = np.finfo(ref.dtype).eps
    return bool(np.max(gap, initial=0.0) <= REPLICATED_ULPS * eps * scale)
