"""Finite-difference checks of totals, and the cross-rank consistency checks they rely
on."""

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from .._compiler.layout import Layout
from .._compiler.tracing import FDOptions
from .._diagnostics import progress as _progress
from .._errors import DerivativeCheckError, DistopError
from .assembly import Blocks, flat_counts, gather_columns, gather_rows
from .differences import (
    JUDGEABLE,
    Estimate,
    better_step,
    default_step,
    estimate,
    judge,
    multiples,
    needs_base,
    terms_rounding,
)
from .replicated import check_replicated, digest

Say = Callable[[str], None]  # prints a line (on rank 0), or nothing



@dataclasses.dataclass
class TotalsCheck:
    """The result of checking one `(of, wrt)` block with `check_totals`.

    An entry fails where |J - J_fd| > atol + rtol |J_fd| + e_fd, e_fd being the error
    the finite-difference estimate J_fd carries itself (see `fd_error`).

    **Arguments:**
    - `J`: the block from `compute_totals`.
    - `J_fd`: the block from finite differences or the complex step.
    - `abs_error`, `rel_error`: |J - J_fd| and |J - J_fd| / |J_fd| at the worst entry.
    - `ok`: whether every entry is within its allowance, on every rank, and the ranks
      agree.
    - `inconsistent_ranks`: the ranks whose J or J_fd differ from the majority's.
    - `worst`: the (row, column) whose error is the largest share of its allowance;
      None for an empty block.
    - `allowed`: that entry's allowance; the block passes where `abs_error <= allowed`.
    - `fd_error`: e_fd per entry: its rounding, from the values' magnitude and
      precision, plus its truncation, from estimates at the step and twice the step.
    """

    J: np.ndarray
    J_fd: np.ndarray
    abs_error: float
    rel_error: float
    ok: bool
    inconsistent_ranks: list[int]
    worst: tuple[int, int] | None = None
    allowed: float = 0.0
    fd_error: np.ndarray | None = None


class _Stdout:
    """`check_totals`'s default stream: `sys.stdout` as it is when called, not as it was
    at import (a redirection, or pytest's capture, replaces it)."""

    def __repr__(self) -> str:
        return "sys.stdout"


STDOUT = _Stdout()


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


def check_totals(evaluations: Evaluations, of: tuple[str, ...], wrt: tuple[str, ...], *,
                 method: str, form: str, step: float | None, atol: float, rtol: float,
                 out_stream: Any, raise_on_error: bool, show_only_incorrect: bool,
                 progress: bool = True) -> dict[tuple[str, str], TotalsCheck]:
    """See `Problem.check_totals`: `of`, `wrt` and the options checked already."""
    if out_stream is STDOUT:
        out_stream = sys.stdout
    comm, rank = evaluations.comm, evaluations.comm.Get_rank()
    say: Say = (lambda text: print(text, file=out_stream, flush=True)) if (
        out_stream is not None and rank == 0) else (lambda text: None)
    if not of or not wrt:
        say("check_totals: nothing to check (no floating-point outputs or inputs)")
        return {}
    if step is None:
        layout = evaluations.layout
        step = default_step(method, [layout.outputs[o].dtype for o in of]
                            + [layout.inputs[w].dtype for w in wrt])
    shown = out_stream if progress and rank == 0 else None
    with _progress.Progress("check_totals", 4, shown) as steps:
        if shown is not None:
            say = steps.say  # (past the bar on a terminal)
        steps.next("checking that replicated values agree across ranks")
        check_replicated(comm, evaluations.distributed,
                         {**evaluations.point, **evaluations.run()}, "check_totals")
        started = time.perf_counter()
        steps.next("computing the totals")
        J = evaluations.compute_totals(of, wrt)
        J_fd = _differences(evaluations, of, wrt, method, form, step, say, steps)
        if time.perf_counter() - started > 5:
            say(f"check_totals: derivatives computed in {time.perf_counter() - started:.1f}"
                " s; comparing on every rank")
        steps.next("comparing on every rank")
        results = _judge(comm, of, wrt, J, J_fd, atol, rtol)

    if out_stream is not None and rank == 0:
        _table(results, say, show_only_incorrect)
        _say_steps(J_fd, method, form, step, rtol, say)
    failed = [k for k, r in results.items() if not r.ok]
    if raise_on_error and failed:
        raise DerivativeCheckError(
            "check_totals: derivatives disagree with " + (
                "the complex step" if method == "cs" else "finite differences")
            + " or between ranks for " + ", ".join(f"({o!r}, {w!r})" + (
                f" [inconsistent ranks {results[o, w].inconsistent_ranks}]"
                if results[o, w].inconsistent_ranks else _worst_words(results[o, w]))
                for o, w in failed))
    return results


@dataclasses.dataclass(frozen=True)
class HvpEvaluations:
    """What `check_hvp` evaluates: a Problem's entry points at its current point.

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `layout`: the `Layout` of the current point.
    - `point`: the current point.
    - `compute_hvp`: the Problem's `compute_hvp` (of, wrt, tangent).
    - `gradient`: the gradient of the output along the `wrt` inputs (name -> its whole
      flat vector, on every rank) at the point moved by deltas (name -> this rank's
      delta), leaving the current point as it was.
    """

    comm: Any
    layout: Layout
    point: dict[str, Any]
    compute_hvp: Callable[..., dict[str, Any]]
    gradient: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def check_hvp(evaluations: HvpEvaluations, of: str, wrt: tuple[str, ...], *,
              directions: int, seed: int, step: float | None, atol: float, rtol: float,
              out_stream: Any, raise_on_error: bool, show_only_incorrect: bool,
              progress: bool = True) -> dict[tuple[str, str], TotalsCheck]:
    """See `Problem.check_hvp`: `of`, `wrt` and the options checked already."""
    if out_stream is STDOUT:
        out_stream = sys.stdout
    comm, layout, point = evaluations.comm, evaluations.layout, evaluations.point
    rank = comm.Get_rank()
    say: Say = (lambda text: print(text, file=out_stream, flush=True)) if (
        out_stream is not None and rank == 0) else (lambda text: None)
    dtypes = [layout.outputs[of].dtype] + [layout.inputs[w].dtype for w in wrt]
    step = default_step("fd", dtypes) if step is None else step
    # the same global directions on every rank; each rank perturbs its own block
    rng = np.random.default_rng(seed)
    drawn = {w: rng.standard_normal((directions, layout.global_size(w))) for w in wrt}
    tangent = {}
    for w in wrt:
        start, stop = layout.local_rows(w, rank)
        tangent[w] = drawn[w][:, start:stop].reshape((directions, *point[w].shape)).astype(
            point[w].dtype)
    shown = out_stream if progress and rank == 0 else None
    with _progress.Progress("check_hvp", 3, shown) as steps:
        if shown is not None:
            say = steps.say  # (past the bar on a terminal)
        steps.next("computing the Hessian-vector products")
        found = evaluations.compute_hvp(of, wrt, tangent)
        steps.next(f"computing the gradient at {4 * directions} points")
        values = _gradients(evaluations, wrt, tangent, directions, step)
        steps.next("comparing on every rank")
        results = _judge_hvp(evaluations, of, wrt, found, values, directions, step, dtypes,
                             atol, rtol)
    say(f"check_hvp: {of!r}: compute_hvp along {directions} random directions (rows) "
        f"against central differences of compute_totals at step={step:g}")
    if out_stream is not None and rank == 0:
        _table(results, say, show_only_incorrect)
    failed = [k for k, r in results.items() if not r.ok]
    if raise_on_error and failed:
        raise DerivativeCheckError(
            "check_hvp: Hessian-vector products disagree with finite differences of the "
            "gradient or between ranks for " + ", ".join(f"({o!r}, {w!r})" + (
                f" [inconsistent ranks {results[o, w].inconsistent_ranks}]"
                if results[o, w].inconsistent_ranks else _worst_words(results[o, w]))
                for o, w in failed))
    return results


def _gradients(evaluations: HvpEvaluations, wrt: tuple[str, ...], tangent: dict[str, Any],
               directions: int, step: float) -> list[np.ndarray]:
    """**Returns:** per multiple of the step (see `multiples`), the gradients at the
    point moved along each direction: one row per direction."""
    factors = [f.real for f in multiples("fd", "central")]
    return [np.stack([np.concatenate([g[w] for w in wrt]) for g in (
        evaluations.gradient({w: factor * step * tangent[w][k] for w in wrt})
        for k in range(directions))]) for factor in factors]


def _judge_hvp(evaluations: HvpEvaluations, of: str, wrt: tuple[str, ...],
               found: dict[str, Any], values: list[np.ndarray], directions: int,
               step: float, dtypes: list[Any], atol: float,
               rtol: float) -> dict[tuple[str, str], TotalsCheck]:
    """Judge the products `found` against the central differences of the gradients
    `values`, block by block, on every rank."""
    comm, layout, point = evaluations.comm, evaluations.layout, evaluations.point
    J = {(of, w): (gather_columns(comm, np.ascontiguousarray(found[w].reshape(directions, -1)),
                                  flat_counts(layout, w))
                   if w in layout.counts else np.asarray(found[w]).reshape(directions, -1))
         for w in wrt}
    factors = [f.real for f in multiples("fd", "central")]
    eps = max(float(jnp.finfo(d).eps) for d in dtypes)
    fd = estimate("fd", "central", values, None,
                  [np.full((directions, 1), factor * step) for factor in factors], eps)
    # the inputs round x + h t too: by eps |x| / h of each entry's derivative
    scale = max([float(np.max(np.abs(point[w]), initial=0.0)) for w in wrt] + [0.0])
    scale = max(comm.allgather(scale))  # (the same allowance on every rank)
    rounding = fd.rounding + eps * max(scale, 1.0) / step * np.abs(fd.value)
    estimates, offset = {}, 0
    for w in wrt:
        n = layout.global_size(w)
        estimates[of, w] = Estimate(fd.value[:, offset:offset + n],
                                    rounding[:, offset:offset + n],
                                    fd.truncation[:, offset:offset + n], eps, scale)
        offset += n
    return _judge(comm, (of,), wrt, J, estimates, atol, rtol)


def _judge(comm: Any, of: tuple[str, ...], wrt: tuple[str, ...], J: Blocks,
           J_fd: dict[tuple[str, str], Estimate], atol: float,
           rtol: float) -> dict[tuple[str, str], TotalsCheck]:
    """Judge every block on every rank, and find the ranks whose blocks differ."""
    results: dict[tuple[str, str], TotalsCheck] = {}
    keys = [(o, w) for o in of for w in wrt]
    every = comm.allgather([digest(J[k]) + digest(J_fd[k].value) for k in keys])
    for i, k in enumerate(keys):
        digests = [d[i] for d in every]
        majority = max(set(digests), key=lambda d: (digests.count(d), d == digests[0]))
        inconsistent = [r for r, d in enumerate(digests) if d != majority]
        results[k] = _compare(J[k], J_fd[k], atol, rtol, inconsistent)
    oks = comm.allgather([r.ok for r in results.values()])
    for i, r in enumerate(results.values()):
        r.ok = all(o[i] for o in oks) and not r.inconsistent_ranks
    return results


def _compare(J: np.ndarray, fd: Estimate, atol: float, rtol: float,
             inconsistent: list[int]) -> TotalsCheck:
    """Judge every entry of `J` against the estimate `fd` and the error it carries."""
    with np.errstate(invalid="ignore", over="ignore"):  # (inf, NaN: not ok)
        tolerated = atol + rtol * np.abs(fd.value)
        allowed = tolerated + fd.error
        # within only by the estimate's own error, where that error is a visible share of
        # the block: a wrong derivative would pass there, so the entry cannot pass
        scale = np.max(np.abs(fd.value), initial=0.0)
        inexact = (np.abs(J - fd.value) > tolerated) & (fd.error > JUDGEABLE * scale)
    diff, within, share = judge(J, fd.value, allowed, inexact)
    if not diff.size:
        return TotalsCheck(J, fd.value, 0.0, 0.0, True, inconsistent, None, 0.0, fd.error)
    flat = int(np.argmax(share))
    worst = tuple(int(i) for i in np.unravel_index(flat, diff.shape))
    abs_error = float(diff[worst])
    scale = float(np.abs(fd.value[worst]))
    rel_error = abs_error / scale if scale else (0.0 if abs_error == 0 else math.inf)
    return TotalsCheck(J, fd.value, abs_error, rel_error, bool(np.all(within)), inconsistent,
                       (worst[0], worst[1]), float(allowed[worst]), fd.error)


def _worst_words(r: TotalsCheck) -> str:
    """**Returns:** the worst entry of a failed block in words, for messages."""
    if r.worst is None:
        return ""
    return (f" [at {r.worst}: J {_number(r.J[r.worst])}, J_fd {_number(r.J_fd[r.worst])}, "
            f"error {r.abs_error:.2e} > allowed {r.allowed:.2e}]")


def _number(value: Any) -> str:
    value = complex(value)
    if value.imag == 0:
        return f"{value.real:.4e}"
    return f"{value.real:.3e}{value.imag:+.3e}j"


def _say_steps(J_fd: dict[tuple[str, str], Estimate], method: str, form: str, step: float,
               rtol: float, say: Say) -> None:
    """Tell, per block, where the estimate's own error is more than `rtol` of the block's
    largest entry (there a wrong derivative that errs by less cannot be told from a
    right one), and at which step it would be least."""
    what = "complex step" if method == "cs" else f"{form} differences"
    for (o, w), fd in J_fd.items():
        if not fd.value.size:
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            scale = float(np.max(np.abs(fd.value)))
            rounding, truncation = float(np.max(fd.rounding)), float(np.max(fd.truncation))
        error = rounding + truncation
        if math.isfinite(error) and error <= rtol * scale:
            continue
        if not math.isfinite(error):
            say(f"check_totals: ({o!r}, {w!r}): {what} at step={step:g} are not finite: "
                "take a smaller step.")
            continue
        relative = f"{error / scale:.0e} of its largest entry" if scale else "with no entry"
        judged = ("entries within their allowance only by that error cannot be judged, "
                  "and fail" if error > JUDGEABLE * scale else
                  "each entry is judged with its own")
        line = (f"check_totals: ({o!r}, {w!r}): {what} at step={step:g} carry an error of "
                f"about {error:.0e} (rounding {rounding:.0e}, truncation {truncation:.0e}), "
                f"{relative}, more than rtol={rtol:g}; {judged}")
        best = better_step(method, form, step, rounding, truncation, fd.eps, fd.scale)
        say(line + (f". About step={best:.0e} would make it less." if best else "."))


def _differences(evaluations: Evaluations, of: tuple[str, ...], wrt: tuple[str, ...],
                 method: str, form: str, step: float, say: Say,
                 progress: _progress.Progress) -> dict[tuple[str, str], Estimate]:
    """Every perturbation of every `wrt` entry, at the step and twice the step, as one
    batched program call, and the estimates they give with their own errors.

    The derivatives are those `compute_totals` gives, in JAX's convention: of an
    output's real part (that of a real output itself), along each entry of a real input,
    and for an entry z = x + iy of a complex input, d/dx - i d/dy of it (for a
    holomorphic function, its complex derivative): a complex entry is perturbed along
    both axes. The complex step perturbs a real entry along the imaginary axis."""
    factors = multiples(method, form)
    inputs = _perturbed_inputs(evaluations.layout, wrt)
    n = inputs[-1].offset + inputs[-1].size * len(inputs[-1].directions)
    steps = np.zeros((len(factors), n))  # the step each perturbation really took
    deltas: dict[str, np.ndarray] = {}
    magnitudes: dict[str, np.ndarray] = {}  # |x| of each input, every entry
    for w in inputs:
        deltas[w.name], magnitudes[w.name] = _perturb(evaluations, w, method, factors, step,
                                                      steps)
    if len(factors) * n > 256:
        say(f"check_totals: evaluating {len(factors) * n} perturbed points in one batched "
            "call")
    progress.next(f"evaluating {len(factors) * n} perturbed points")
    values = evaluations.perturbed(FDOptions(tuple(wrt), form, step, method), deltas)
    base = evaluations.run() if needs_base(method, form) else None
    estimates: dict[tuple[str, str], Estimate] = {}
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # (not ok)
        for o in of:
            v = np.asarray(values[o]).reshape(len(factors) * n, -1)
            if method == "cs" and not np.iscomplexobj(v):
                raise DistopError(_dropped_imaginary(o))
            at = [v[k * n:(k + 1) * n] for k in range(len(factors))]
            for w in inputs:
                estimates[o, w.name] = _estimate_block(
                    evaluations, o, w, method, form, at, base, steps,
                    float(np.max(magnitudes[w.name], initial=0.0)))
            # the size of the terms each entry of o is made of, over every input perturbed
            terms = sum(np.abs(estimates[o, w].value) @ magnitudes[w] for w in wrt)
            for w in inputs:
                found = estimates[o, w.name]
                found.rounding = found.rounding + len(w.directions) * terms_rounding(
                    method, form, [s[w.rows(0)] for s in steps], found.eps,
                    np.asarray(terms))
    return estimates


class _Perturbed(NamedTuple):
    """Where one input's perturbations sit among those of every input, in the rows of
    one multiple of the step: one row per entry and axis, axis by axis.

    **Arguments:**
    - `name`: the input.
    - `offset`: its first row.
    - `size`: its number of entries, over every rank.
    - `directions`: the axes it is perturbed along: (1,), or (1, 1j) for a complex input.
    """

    name: str
    offset: int
    size: int
    directions: tuple[complex, ...]

    def rows(self, axis: int) -> slice:
        """**Returns:** the rows of its perturbations along `directions[axis]`."""
        return slice(self.offset + axis * self.size, self.offset + (axis + 1) * self.size)


def _perturbed_inputs(layout: Layout, wrt: tuple[str, ...]) -> list[_Perturbed]:
    """**Returns:** where the perturbations of each input of `wrt` sit, in order."""
    found, offset = [], 0
    for w in wrt:
        # (an input's own sizes: an output may have its name)
        size = (sum(flat_counts(layout, w)) if w in layout.counts
                else math.prod(layout.inputs[w].shape))
        complex_input = np.issubdtype(layout.inputs[w].dtype, np.complexfloating)
        directions: tuple[complex, ...] = (1, 1j) if complex_input else (1,)
        found.append(_Perturbed(w, offset, size, directions))
        offset += size * len(directions)
    return found


def _perturb(evaluations: Evaluations, w: _Perturbed, method: str,
             factors: tuple[complex, ...], step: float,
             steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The deltas of one input: this rank perturbs the entries it owns, per multiple of
    the step and axis.

    **Arguments:**
    - `evaluations`: what `check_totals` evaluates.
    - `w`: the input and where its perturbations sit.
    - `method`, `step`: those of `check_totals`.
    - `factors`: the multiples of the step (see `multiples`).
    - `steps`: (multiples, rows of one multiple): the step each perturbation really
      took; the input's columns are filled here, from every rank's entries.

    **Returns:** (its deltas, one batch row per perturbation of every input; |x| of each
    of its entries, on every rank).
    """
    layout, rank = evaluations.layout, evaluations.comm.Get_rank()
    spec, n = layout.inputs[w.name], steps.shape[1]
    dtype = np.result_type(spec.dtype, np.complex64) if method == "cs" else spec.dtype
    x = np.asarray(evaluations.point[w.name]).reshape(-1)
    start, stop = layout.local_rows(w.name, rank) if w.name in layout.counts else (0, w.size)
    delta = np.zeros((len(factors) * n, x.size), dtype)
    # per multiple and axis, the step each entry really took; last, |x| itself
    taken = np.zeros((len(factors) * len(w.directions) + 1, x.size))
    taken[-1] = np.abs(x)
    for k, factor in enumerate(factors):
        for a, direction in enumerate(w.directions):
            amount = factor * step * direction
            d = np.full(x.size, amount if np.iscomplexobj(delta) else amount.real, dtype)
            delta[k * n + w.rows(a).start + np.arange(start, stop), np.arange(x.size)] = d
            # (x + d) - x is exact: the step as the input's precision rounds it,
            # signed, along the axis perturbed (the imaginary one for the complex step)
            axis = direction * (1j if method == "cs" else 1)
            taken[k * len(w.directions) + a] = (((x + d) - x) * np.conj(axis)).real
    if w.name in layout.counts:
        taken = gather_columns(evaluations.comm, taken, flat_counts(layout, w.name))
    for k in range(len(factors)):
        for a in range(len(w.directions)):
            steps[k, w.rows(a)] = taken[k * len(w.directions) + a]
    return delta.reshape((len(factors) * n,) + spec.shape), taken[-1]


def _estimate_block(evaluations: Evaluations, o: str, w: _Perturbed, method: str,
                    form: str, at: list[np.ndarray], base: dict[str, Any] | None,
                    steps: np.ndarray, scale: float) -> Estimate:
    """The estimate of one block, with the error it carries, on every rank.

    **Arguments:**
    - `evaluations`: what `check_totals` evaluates.
    - `o`: the output.
    - `w`: the input and where its perturbations sit.
    - `method`, `form`: those of `check_totals`.
    - `at`: per multiple of the step, this rank's values of `o` at every perturbation.
    - `base`: the outputs at the point itself, where the form needs them.
    - `steps`: the step each perturbation really took (see `_perturb`).
    - `scale`: the largest magnitude of the input's entries.

    **Returns:** the block's `Estimate`, every row of `o` on every rank.
    """
    layout = evaluations.layout
    eps = max(float(jnp.finfo(layout.outputs[o].dtype).eps),
              float(jnp.finfo(layout.inputs[w.name].dtype).eps))
    parts = [estimate(method, form, [a_[w.rows(a)] for a_ in at],
                      None if base is None else np.asarray(base[o]).reshape(1, -1),
                      [s[w.rows(a), None] for s in steps], eps)
             for a in range(len(w.directions))]
    value = parts[0].value if len(parts) == 1 else parts[0].value - 1j * parts[1].value
    blocks: list[np.ndarray] = [
        value, np.sum([p.rounding for p in parts], axis=0),
        np.sum([p.truncation for p in parts], axis=0)]
    # local rows of o, gathered from every rank where o is distributed
    blocks = [np.ascontiguousarray(b.T) for b in blocks]
    if o in layout.counts:
        counts = flat_counts(layout, o)
        blocks = [gather_rows(evaluations.comm, b, counts) for b in blocks]
    return Estimate(blocks[0], blocks[1], blocks[2], eps, scale)


def _dropped_imaginary(name: str) -> str:
    return (f"check_totals(method='cs'): output {name!r} is real when its inputs are "
            "complex: the model drops the imaginary part the complex step puts in (jnp.abs, "
            "jnp.real, a cast to a real dtype, an operator whose output_spec is real). "
            "Keep every step from the inputs to this output analytic, or use method='fd'.")


def _table(results: dict[tuple[str, str], TotalsCheck], say: Say,
           show_only_incorrect: bool) -> None:
    """Print one row per block: its worst entry, the error there and what it is allowed
    (the block passes where `abs error <= allowed`, at every entry and so at this one)."""
    head = (f"{'of':<12} {'wrt':<12} {'shape':<10} {'worst':<9} {'J':>11} {'J_fd':>11} "
            f"{'abs error':>10} {'rel error':>10} {'allowed':>10}  flag")
    say(head)
    say("-" * len(head))
    for (o, w), r in results.items():
        if show_only_incorrect and r.ok:
            continue
        flag = "" if r.ok else ("<-- inconsistent ranks " + str(r.inconsistent_ranks)
                                if r.inconsistent_ranks else "<-- FAILED")
        if r.worst is None:
            say(f"{o:<12} {w:<12} {str(r.J.shape):<10} {'-':<9} {'':>11} {'':>11} "
                f"{'':>10} {'':>10} {'':>10}  {flag}")
            continue
        say(f"{o:<12} {w:<12} {str(r.J.shape):<10} {str(r.worst):<9} "
            f"{_number(r.J[r.worst]):>11} {_number(r.J_fd[r.worst]):>11} "
            f"{r.abs_error:>10.2e} {r.rel_error:>10.2e} {r.allowed:>10.2e}  {flag}")
    say("(worst: the entry whose error is the largest share of what it is allowed, atol + "
        "rtol |J_fd| + the error of J_fd itself)")
