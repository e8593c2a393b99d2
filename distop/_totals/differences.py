"""Finite and complex differences: where to evaluate, the derivative they estimate, and
the error that estimate carries itself.

A difference quotient errs in two ways. Rounding: each value is off by some units in
its last place, and dividing their difference by the step magnifies that. Truncation:
the quotient is the slope of a secant, not of the tangent. Every estimate here is made
at the step h and again at 2h: the two differ by about the truncation (three times
it, for central and complex differences, whose truncation grows as h**2; once, for
one-sided ones, whose truncation grows as h). The rounding follows from the values'
magnitude and precision, and from that of the terms they are made of: a value that
cancels larger terms (x0 - 2 x1 + x2, say) rounds as they do. Their sum is the error the
estimate carries, entry by entry.
"""

import dataclasses
import math

import numpy as np

FORMS = {"central": (1.0, -1.0), "forward": (1.0,), "backward": (-1.0,)}
METHODS = ("fd", "cs")
# units of roundoff (eps |value|) allowed per evaluated value: a model's own sums and
# products round several times before its outputs
ROUNDING_UNITS = 2.0
# units of roundoff (eps times the size of the terms) per evaluated value, for the
# terms an output entry is made of, which may cancel
TERMS_UNITS = 1.0


# The default step of finite differences, by the precision of the values (bits of the
# least precise input or output checked): near the step where rounding and truncation
# balance for values of order one. The complex step has no rounding to balance.
DEFAULT_STEPS = {64: 1e-6, 32: 1e-3, 16: 3e-2}
COMPLEX_STEP = 1e-6
# An entry within its allowance only by the error of its own estimate, where that error
# is more than this share of its block's largest entry, cannot be judged: it fails.
JUDGEABLE = 0.05


def default_step(method: str, dtypes: list) -> float:
    """**Returns:** the default step for values of `dtypes` (see `DEFAULT_STEPS`)."""
    if method == "cs":
        return COMPLEX_STEP
    bits = min(np.finfo(np.dtype(d)).bits for d in dtypes) if dtypes else 64
    return DEFAULT_STEPS.get(bits, DEFAULT_STEPS[64] if bits > 64 else DEFAULT_STEPS[16])


def multiples(method: str, form: str) -> tuple[complex, ...]:
    """**Returns:** the multiples of the step at which a function is evaluated besides
    the point itself (the step's first, then twice the step's): one or two per step
    for finite differences, an imaginary one for the complex step."""
    if method == "cs":
        return (1j, 2j)
    signs = FORMS[form]
    return tuple(complex(s * m) for m in (1, 2) for s in signs)


def needs_base(method: str, form: str) -> bool:
    """**Returns:** whether the estimate reads the value at the point itself."""
    return method == "fd" and len(FORMS[form]) == 1


@dataclasses.dataclass
class Estimate:
    """A derivative estimated by differences, with the error it carries.

    Fields: `value` (the estimate at the step), `rounding` and `truncation` (its
    estimated errors of each kind, entry by entry; `error` their sum), `eps` (the
    machine epsilon of the values), `scale` (the largest magnitude of the inputs
    perturbed).
    """

    value: np.ndarray
    rounding: np.ndarray
    truncation: np.ndarray
    eps: float = 0.0
    scale: float = 1.0

    @property
    def error(self) -> np.ndarray:
        return self.rounding + self.truncation


def estimate(method: str, form: str, values: list[np.ndarray], base: np.ndarray | None,
             steps: list[np.ndarray], eps: float) -> Estimate:
    """Estimate a derivative from values at the multiples of the step.

    **Arguments:**
    - `method`, `form`: as for `check_totals`.
    - `values`: per multiple (in the order of `multiples`), the values there, one row
      per perturbed entry (complex for the complex step).
    - `base`: the values at the point itself (one row), for one-sided differences.
    - `steps`: per multiple, the step each row's entry really took (x + d - x, as the
      input's precision rounds it; the imaginary part for the complex step), one row.
    - `eps`: the machine epsilon of the values.

    **Returns:** the `Estimate` of the derivative of the values' real parts.
    """
    units = ROUNDING_UNITS * eps
    if method == "cs":  # no difference of values: only the imaginary part's own rounding
        d1, d2 = values[0].imag / steps[0], values[1].imag / steps[1]
        return Estimate(d1, units * np.abs(d1), np.abs(d1 - d2) / 3)
    if base is None:  # central: values at +h, -h, +2h, -2h
        width1, width2 = steps[0] - steps[1], steps[2] - steps[3]
        d1 = (values[0].real - values[1].real) / width1
        d2 = (values[2].real - values[3].real) / width2
        rounding = units * (np.abs(values[0]) + np.abs(values[1])) / np.abs(width1)
        return Estimate(d1, rounding, np.abs(d1 - d2) / 3)
    d1 = (values[0].real - base.real) / steps[0]
    d2 = (values[1].real - base.real) / steps[1]
    rounding = units * (np.abs(values[0]) + np.abs(base)) / np.abs(steps[0])
    return Estimate(d1, rounding, np.abs(d1 - d2))


def terms_rounding(method: str, form: str, steps: list[np.ndarray], eps: float,
                   terms: np.ndarray) -> np.ndarray:
    """The rounding a difference carries from the terms its values are made of.

    A value that cancels larger terms is off by some units of those terms' last place,
    not of its own; its difference quotient magnifies that. The size of the terms of
    output entry i is taken as sum_j |J_ij| |x_j| over the entries perturbed: exact for
    a linear function's terms, the size of each input's contribution otherwise.

    **Arguments:**
    - `method`, `form`: as for `check_totals`.
    - `steps`: per multiple, the step each column's entry really took (as `estimate`).
    - `eps`: the machine epsilon of the values.
    - `terms`: per output entry, the size of its terms.

    **Returns:** the rounding, one row per output entry, one column per input entry
    (zeros for the complex step, which takes no difference).
    """
    width = (np.abs(steps[0] - steps[1]) if len(FORMS[form]) == 2 else np.abs(steps[0])
             ).reshape(-1)
    if method == "cs":
        return np.zeros((terms.size, width.size))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # (not ok)
        return (2 * TERMS_UNITS * eps) * terms.reshape(-1, 1) / width.reshape(1, -1)


def judge(got: np.ndarray, ref: np.ndarray, allowed: np.ndarray,
          inexact: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Judge each entry of `got` against `ref` and what it is `allowed`.

    **Arguments:**
    - `got`, `ref`, `allowed`: the values, the reference and the allowance, entry by entry.
    - `inexact`: where given, the entries whose reference is too inexact to judge them
      (they fail where they differ from it by more than the tolerances alone allow).

    **Returns:** `(diff, within, share)`: |got - ref|; whether it is within the
    allowance (an infinite or NaN difference or allowance is not: inf <= inf would
    pass); the difference as a share of the allowance (inf where not within).
    """
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        diff = np.abs(got - ref)
        within = np.isfinite(diff) & np.isfinite(allowed) & (diff <= allowed)
        if inexact is not None:
            within &= ~inexact
        share = np.where(within, np.where(diff > 0, diff / allowed, 0.0), np.inf)
    return diff, within, share


def better_step(method: str, form: str, step: float, rounding: float, truncation: float,
                eps: float, scale: float) -> float | None:
    """The step at which the estimated error would be about least.

    Rounding falls as 1/h, truncation grows as h**2 (central) or h (one-sided). Where
    the truncation seen stands out of the rounding, the step follows from the two;
    where it does not, the truncation is too small to be seen at this step, and the
    step is at least the usual one for inputs of this size, eps**(1/3) max(1, |x|)
    (central) or eps**(1/2) max(1, |x|) (one-sided). The complex step has no
    rounding to balance: only a smaller step where its truncation shows.

    **Arguments:**
    - `method`, `form`, `step`: as for `check_totals`.
    - `rounding`, `truncation`: the largest estimated errors of each kind at `step`.
    - `eps`: the machine epsilon of the values.
    - `scale`: the largest magnitude of the inputs perturbed.

    **Returns:** that step, or None where `step` is within a factor of two of it.
    """
    if not (math.isfinite(rounding) and math.isfinite(truncation)):
        return None
    if method == "cs":
        best = step * math.sqrt(rounding / truncation) / 2 if truncation > rounding else step
    else:
        order = 1 if len(FORMS[form]) == 1 else 2
        best = step * (rounding / (order * truncation)) ** (1 / (order + 1)) if (
            truncation > 0) else math.inf
        if truncation <= rounding:  # (unseen: at least the usual step)
            best = max(min(best, 1e3 * step), eps ** (1 / (order + 1)) * max(1.0, scale))
    return best if not 0.5 <= best / step <= 2 else None
