"""Total-derivative assembly on global vectors, finite-difference checks, and the
cross-rank consistency checks they rely on."""

import dataclasses
import hashlib
import math
import numbers
import sys
import time
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._errors import DerivativeCheckError, DistopError
from ._layout import Layout
from ._runtime import world
from ._tracing import FDOptions

Say = Callable[[str], None]  # prints a line (on rank 0), or nothing
Blocks = dict[tuple[str, str], np.ndarray]  # (of, wrt) -> 2-D array

FORMS = {"central": (1.0, -1.0), "forward": (1.0,), "backward": (-1.0,)}


@dataclasses.dataclass
class TotalsCheck:
    """The result of checking one `(of, wrt)` block with `check_totals`.

    **Arguments:**
    - `J`: the block from `compute_totals`.
    - `J_fd`: the block from finite differences.
    - `abs_error`: the norm of J - J_fd.
    - `rel_error`: abs_error / the norm of J_fd.
    - `ok`: whether |J - J_fd| <= atol + rtol |J_fd| everywhere, on every rank.
    - `inconsistent_ranks`: the ranks whose J or J_fd differ from the majority's.
    """

    J: np.ndarray
    J_fd: np.ndarray
    abs_error: float
    rel_error: float
    ok: bool
    inconsistent_ranks: list[int]


def assemble(comm: Any, layout: Layout, cts: dict[str, Any], of: tuple[str, ...],
             wrt: tuple[str, ...], return_format: str) -> Blocks:
    """Cut the batched cotangents of a reverse pass into `(of, wrt)` blocks.

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `layout`: the `Layout` of the current point.
    - `cts`: wrt name -> array (global rows of `of`, *local shape of wrt).
    - `of`, `wrt`: the names, in order.
    - `return_format`: `"global"` gathers distributed `wrt` columns from every rank;
      `"local"` keeps this rank's columns and this rank's rows of distributed `of`.

    **Returns:** dict `(of, wrt)` -> 2-D numpy array.
    """
    rank = comm.Get_rank()
    offsets = layout.offsets(of)
    local = [] if return_format != "local" else [  # this rank's rows of a distributed `of`
        (o, offsets[i]) + layout.local_rows(o, rank) for i, o in enumerate(of)
        if o in layout.counts]
    totals: Blocks = {}
    for w in wrt:
        block = cts[w].reshape(offsets[-1], -1)
        if w in layout.counts and return_format == "global":
            block = gather_columns(comm, block, _flat_counts(layout, w))
        # views of the program's result (read-only), not copies
        for o, start, stop in zip(of, offsets, offsets[1:]):
            totals[o, w] = block[start:stop]
        for o, offset, start, stop in local:
            totals[o, w] = block[offset + start:offset + stop]
    return totals


def _flat_counts(layout: Layout, name: str) -> list[int]:
    spec = layout.spec(name)
    tail = int(np.prod(spec.shape[1:]))
    return [c * tail for c in layout.counts[name]]


def gather_columns(comm: Any, block: np.ndarray, counts: list[int]) -> np.ndarray:
    """**Returns:** the columns of `block` from every rank, side by side (`counts[r]`
    columns from rank r), on every rank."""
    if comm.Get_size() == 1:
        return block
    rows = block.shape[0]
    recv = np.empty((sum(counts), rows), block.dtype)
    comm.Allgatherv(np.ascontiguousarray(block.T), [recv, [c * rows for c in counts]])
    return recv.T


def gather_rows(comm: Any, block: np.ndarray, counts: list[int]) -> np.ndarray:
    """**Returns:** the rows of `block` from every rank, stacked (`counts[r]` rows from
    rank r), on every rank."""
    if comm.Get_size() == 1:
        return block
    cols = block.shape[1]
    recv = np.empty((sum(counts), cols), block.dtype)
    comm.Allgatherv(np.ascontiguousarray(block), [recv, [c * cols for c in counts]])
    return recv


def _canonical(array: Any) -> np.ndarray:
    """`array` with every NaN made one NaN and every negative zero a zero: values that
    compare equal then have equal bytes."""
    a = np.asarray(array)
    if a.dtype.kind == "c":
        return _canonical(a.real) + 1j * _canonical(a.imag)
    if a.dtype.kind != "f":
        return a
    return np.where(np.isnan(a), np.nan, a + 0.0)  # (-0.0 + 0.0 is 0.0)


def _digest(array: Any) -> str:
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
    if _digest(mine) == _digest(ref):
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
    every = comm.allgather([_digest(values[k]) for k in names])
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


class _Stdout:
    """`check_totals`'s default stream: `sys.stdout` as it is when called, not as it was
    at import (a redirection, or pytest's capture, replaces it)."""

    def __repr__(self) -> str:
        return "sys.stdout"


STDOUT = _Stdout()


def request_key(value: Any, names: bool = False) -> Any:
    """An argument as the ranks compare it in a request: equal arguments give equal keys
    on every rank (`1e-6` and `np.float64(1e-6)`; `"batched"` and `np.str_("batched")`;
    with `names`, `"f"`, `["f"]` and `("f",)`), and every key can be hashed. The argument
    itself is checked after the agreement, so that a bad one is an error on every rank."""
    if isinstance(value, str):
        return (str(value),) if names else str(value)
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        try:
            return float(value)
        except (OverflowError, ValueError, TypeError):
            pass
    elif names and isinstance(value, (list, tuple, set, frozenset)) and all(
            isinstance(v, str) for v in value):
        # (a set's order differs between processes: Python salts string hashes)
        ordered = sorted(value) if isinstance(value, (set, frozenset)) else value
        return tuple(map(str, ordered))
    return repr(value)


@dataclasses.dataclass(frozen=True)
class Evaluations:
    """What `check_totals` evaluates: a Problem's entry points at its current point.

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `distributed`: the names of its distributed values.
    - `layout`: the `Layout` of the current point.
    - `point`: the current point.
    - `run`: the Problem's `run`.
    - `compute_totals`: the Problem's `compute_totals`.
    - `perturbed`: runs the finite-difference program of `FDOptions` on perturbations
      (name -> batch of deltas) of the point; returns the batched outputs.
    """

    comm: Any
    distributed: frozenset[str]
    layout: Layout
    point: dict[str, Any]
    run: Callable[[], dict[str, Any]]
    compute_totals: Callable[..., Blocks]
    perturbed: Callable[[FDOptions, dict[str, np.ndarray]], dict[str, Any]]


def check_options(method: str, form: str, step: float, atol: float,
                  rtol: float) -> tuple[float, float, float]:
    """**Returns:** `check_totals`'s `step`, `atol` and `rtol` as floats, checked with
    its `method` and `form`."""
    if method != "fd":
        raise ValueError(f"check_totals(method={method!r}): only 'fd' is available.")
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"check_totals(form={form!r}): expected one of {list(FORMS)}.")
    for name, value, least in (("step", step, 0), ("atol", atol, None), ("rtol", rtol, None)):
        if not (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
                and math.isfinite(value) and (value > 0 if least == 0 else value >= 0)):
            raise ValueError(f"check_totals({name}={value!r}): expected a "
                             f"{'positive' if least == 0 else 'non-negative'} number.")
    return float(step), float(atol), float(rtol)  # (a Fraction, say)


def check_totals(evaluations: Evaluations, of: tuple[str, ...], wrt: tuple[str, ...], *,
                 form: str, step: float, atol: float, rtol: float, out_stream: Any,
                 raise_on_error: bool,
                 show_only_incorrect: bool) -> dict[tuple[str, str], TotalsCheck]:
    """See `Problem.check_totals`: `of`, `wrt` and the options checked already."""
    if out_stream is STDOUT:
        out_stream = sys.stdout
    comm, rank, layout = evaluations.comm, evaluations.comm.Get_rank(), evaluations.layout
    say: Say = (lambda text: print(text, file=out_stream, flush=True)) if (
        out_stream is not None and rank == 0) else (lambda text: None)
    if not of or not wrt:
        say("check_totals: nothing to check (no floating-point outputs or inputs)")
        return {}
    check_replicated(comm, evaluations.distributed, {**evaluations.point, **evaluations.run()},
                     "check_totals")
    started = time.perf_counter()
    J = evaluations.compute_totals(of, wrt)
    J_fd = _finite_differences(evaluations, of, wrt, form, step, say)
    say_progress = time.perf_counter() - started > 5
    if say_progress:
        say(f"check_totals: derivatives computed in {time.perf_counter() - started:.1f} s; "
            "comparing on every rank")

    results: dict[tuple[str, str], TotalsCheck] = {}
    keys = [(o, w) for o in of for w in wrt]
    every = comm.allgather([_digest(J[k]) + _digest(J_fd[k]) for k in keys])
    with np.errstate(invalid="ignore", over="ignore"):  # (inf, NaN: not ok)
        for i, k in enumerate(keys):
            diff = np.abs(J[k] - J_fd[k])
            abs_error = float(np.linalg.norm(J[k] - J_fd[k]))
            norm_fd = float(np.linalg.norm(J_fd[k]))
            rel_error = abs_error / norm_fd if norm_fd else (0.0 if abs_error == 0 else np.inf)
            # (an infinite or NaN derivative on either side fails: inf <= inf would pass)
            ok = bool(np.all(np.isfinite(diff)) and np.all(diff <= atol + rtol * np.abs(J_fd[k])))
            digests = [d[i] for d in every]
            majority = max(set(digests), key=lambda d: (digests.count(d), d == digests[0]))
            inconsistent = [r for r, d in enumerate(digests) if d != majority]
            results[k] = TotalsCheck(J[k], J_fd[k], abs_error, rel_error, ok, inconsistent)
    oks = comm.allgather([r.ok for r in results.values()])
    for i, r in enumerate(results.values()):
        r.ok = all(o[i] for o in oks) and not r.inconsistent_ranks

    if out_stream is not None and rank == 0:
        _table(results, say, show_only_incorrect)
        _say_precision(layout, of, wrt, form, step, rtol, say)
    failed = [k for k, r in results.items() if not r.ok]
    if raise_on_error and failed:
        raise DerivativeCheckError(
            "check_totals: derivatives disagree with finite differences or between ranks "
            "for " + ", ".join(f"({o!r}, {w!r})" + (
                f" [inconsistent ranks {results[o, w].inconsistent_ranks}]"
                if results[o, w].inconsistent_ranks else
                f" [rel error {results[o, w].rel_error:.2e}]") for o, w in failed))
    return results


def _say_precision(layout: Layout, of: tuple[str, ...], wrt: tuple[str, ...], form: str,
                   step: float, rtol: float, say: Say) -> None:
    """Tell where `rtol` asks for less error than finite differences of this form, at
    this step and in the values' precision, make (about eps/step for the rounding plus
    step (one-sided) or step**2 (central) for the truncation, for values and derivatives
    of order one); the defaults (step 1e-6, rtol 1e-6) suit central differences in
    float64."""
    epss = {str(d): float(jnp.finfo(d).eps) for d in
            [layout.outputs[n].dtype for n in of] + [layout.inputs[n].dtype for n in wrt]}
    eps = max(epss.values())
    order = 2 if form == "central" else 1
    error = eps / step + (step ** order if step < 1e100 else math.inf)
    if rtol < error:
        best_step = eps ** (1 / (order + 1))
        coarse = sorted(d for d, e in epss.items() if e == eps)
        say(f"check_totals: with {'/'.join(coarse)} values, {form} differences at "
            f"step={step:g} have a relative error of about {error:.0e}, more than "
            f"rtol={rtol:g}; at best about {eps / best_step + best_step ** order:.0e}, "
            f"near step={best_step:.0e}. Pass step= and rtol= to suit.")


def _finite_differences(evaluations: Evaluations, of: tuple[str, ...], wrt: tuple[str, ...],
                        form: str, step: float, say: Say) -> Blocks:
    """All perturbations of all `wrt` entries as one batched program call.

    The derivatives are those `compute_totals` gives, in JAX's convention: of an
    output's real part (that of a real output itself), along each entry of a real input,
    and for an entry z = x + iy of a complex input, d/dx - i d/dy of it (for a
    holomorphic function, its complex derivative): a complex entry is perturbed along
    both axes."""
    comm, rank, layout = evaluations.comm, evaluations.comm.Get_rank(), evaluations.layout
    signs = FORMS[form]
    sizes = [layout.global_size(w) for w in wrt]
    axes = [(1, 1j) if np.issubdtype(layout.inputs[w].dtype, np.complexfloating) else (1,)
            for w in wrt]
    offsets = np.cumsum([0] + [size * len(a) for size, a in zip(sizes, axes)])
    n = offsets[-1]
    deltas: dict[str, np.ndarray] = {}
    for w, offset, size, directions in zip(wrt, offsets, sizes, axes):
        spec = layout.inputs[w]
        delta = np.zeros((len(signs) * n, int(np.prod(spec.shape))), spec.dtype)
        start, stop = layout.local_rows(w, rank)
        for s, sign in enumerate(signs):  # this rank perturbs the entries it owns
            for a, direction in enumerate(directions):
                delta[s * n + offset + a * size + np.arange(start, stop),
                      np.arange(stop - start)] = sign * step * direction
        deltas[w] = delta.reshape((len(signs) * n,) + spec.shape)
    if len(signs) * n > 256:
        say(f"check_totals: evaluating {len(signs) * n} perturbed points in one batched call")
    values = evaluations.perturbed(FDOptions(tuple(wrt), form, step), deltas)
    base = None if len(signs) == 2 else evaluations.run()
    J_fd: Blocks = {}
    with np.errstate(invalid="ignore", over="ignore"):  # (inf, NaN: not ok)
        for o in of:
            v = values[o].reshape(len(signs) * n, -1)
            if base is None:  # (central differences)
                d = (v[:n] - v[n:]) / (2 * step)
            else:
                d = signs[0] * (v - base[o].reshape(1, -1)) / step
            d = d.real
            for w, offset, size, directions in zip(wrt, offsets, sizes, axes):
                block = d[offset:offset + size]
                if len(directions) == 2:
                    block = block - 1j * d[offset + size:offset + 2 * size]
                block = np.ascontiguousarray(block.T)  # local rows of o
                if o in layout.counts:
                    block = gather_rows(comm, block, _flat_counts(layout, o))
                J_fd[o, w] = block
    return J_fd


def _table(results: dict[tuple[str, str], TotalsCheck], say: Say,
           show_only_incorrect: bool) -> None:
    head = (f"{'of':<12} {'wrt':<12} {'shape':<12} {'|J|':>11} {'|J_fd|':>11} "
            f"{'abs error':>11} {'rel error':>11}  flag")
    say(head)
    say("-" * len(head))
    for (o, w), r in results.items():
        if show_only_incorrect and r.ok:
            continue
        flag = "" if r.ok else ("<-- inconsistent ranks " + str(r.inconsistent_ranks)
                                if r.inconsistent_ranks else "<-- FAILED")
        say(f"{o:<12} {w:<12} {str(r.J.shape):<12} {np.linalg.norm(r.J):>11.4e} "
            f"{np.linalg.norm(r.J_fd):>11.4e} {r.abs_error:>11.4e} {r.rel_error:>11.4e}  "
            f"{flag}")


def shard(n_samples: int, comm: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Split `n_samples` over the ranks so that every rank gets the same count.

    Rank r takes its contiguous share (sizes differ by at most one) and pads it by
    wrap-around to ceil(N / P) samples.
    Padding samples carry weight 0, so a weighted loss is exact.
    Every rank then runs the same number of steps and collectives.

    **Arguments:**
    - `n_samples`: the number of samples, N >= 1.
    - `comm`: the communicator (default `MPI.COMM_WORLD`).

    **Returns:** `(indices, weights)`: int64 and float64 arrays of length ceil(N / P).

    **Raises:** `ValueError` for fewer than one sample.

    ```python
    import distop

    indices, weights = distop.shard(10)
    assert len(indices) == len(weights)  # ceil(10 / P) on every rank
    ```
    """
    comm = world() if comm is None else comm
    size, rank = comm.Get_size(), comm.Get_rank()
    if int(n_samples) < 1:
        raise ValueError(f"shard(n_samples={n_samples}): need at least one sample.")
    n = int(n_samples)
    per_rank = -(-n // size)
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    count = base + (rank < extra)
    indices = (start + np.arange(per_rank)) % n
    weights = (np.arange(per_rank) < count).astype(np.float64)
    return indices.astype(np.int64), weights
