"""The checks of a Problem's arguments, the same for every entry point.

Besides the Problem's own, they check the names of `of` and `wrt`, the options of
`compute_totals` (`check_totals_options`) and those of `check_totals` and `check_hvp`
(`check_comparison_options`, `check_complex_step`). `request_key` gives the key under
which the ranks compare an argument in a request.
"""

import math
import numbers
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._compiler.layout import Layout
from .._dtypes import inexact_dtype as inexact
from .._totals.differences import FORMS, METHODS
from .inputs import as_input
from .trees import Trees

CACHE_SIZE = 64  # the input shapes a Problem keeps programs for, by default

MODES = ("batched", "loop", "unrolled")
BACKENDS = ("lean", "io_callback")
FORMATS = ("global", "local")
DIRECTIONS = ("rev", "fwd", "auto")  # compute_totals: seeded by `of`, by `wrt`, the fewer


def check_arguments(model: Callable, inputs: dict, backend: str | None, copy: bool | None,
                    distributed: frozenset) -> tuple:
    """**Returns:** (the backend, `copy` as a bool or None, the point: one input per
    leaf of a tree input, its `Trees`) after checking `Problem`'s arguments; the backend
    None is the default for JAX's default device."""
    if not callable(model):
        raise TypeError(f"Problem(model=...): got a {type(model).__name__}; expected "
                        "a function called as model(**inputs) returning a dict.")
    if not isinstance(inputs, dict) or not inputs:
        raise TypeError("Problem(inputs=...): expected a non-empty dict of name -> "
                        f"array; got {type(inputs).__name__}.")
    platform = jax.default_backend()
    if backend is None:  # (the lean path's FFI calls are CPU calls)
        backend = "lean" if platform == "cpu" else "io_callback"
    if backend not in BACKENDS:
        raise ValueError(f"Problem(backend={backend!r}): expected one of "
                         f"{list(BACKENDS)} (or set DISTOP_BACKEND).")
    if backend == "lean" and platform != "cpu":
        raise ValueError(
            f"Problem(backend='lean'): the lean path calls operators from programs that "
            f"run on the CPU, and JAX's default device here is {platform!r}. Pass "
            f"backend='io_callback', the default on {platform!r} (or unset "
            "DISTOP_BACKEND), or make the CPU JAX's default device (JAX_PLATFORMS=cpu).")
    if not (copy is None or isinstance(copy, (bool, np.bool_))):
        raise ValueError(f"Problem(copy={copy!r}): expected True, None or False.")
    copy = None if copy is None else bool(copy)
    trees = Trees(inputs)
    inputs = trees.flat("Problem(inputs=...)", inputs)
    point = {name: as_input(f"Problem(inputs={{'{name}': ...}})", value, copy)
             for name, value in inputs.items()}
    for name in frozenset(trees.names(distributed)) & set(point):
        if point[name].ndim == 0:
            raise ValueError(f"Problem(distributed=[{name!r}]): input {name!r} is "
                             "0-d; a distributed value needs an axis 0 to split.")
    return backend, copy, point, trees


def cache_size() -> int:
    """**Returns:** how many layouts a Problem keeps (env `DISTOP_CACHE_SIZE`, at least
    one; default `CACHE_SIZE`)."""
    text = os.environ.get("DISTOP_CACHE_SIZE", "").strip()
    if not text:
        return CACHE_SIZE
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f"DISTOP_CACHE_SIZE={text!r}: expected a whole number of input "
                         "shapes, at least 1.")
    return size


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


def check_names(method: str, arg: str, names: Any, known: tuple,
                differentiable: tuple) -> tuple:
    """**Returns:** the names an `of` or `wrt` argument asks for, checked.

    **Arguments:**
    - `method`, `arg`: the call and its argument, for messages.
    - `names`: what was passed: None (every differentiable name), a name, or several.
    - `known`: every output (for `of`) or input (for `wrt`).
    - `differentiable`: those of them with derivatives.
    """
    if names is None:
        return differentiable
    names = ([names] if isinstance(names, str) else sorted(names)
             if isinstance(names, (set, frozenset)) else list(names))
    kind = "output" if arg == "of" else "input"
    for n in names:
        if n not in known:
            raise ValueError(f"{method}({arg}={names!r}): no {kind} named {n!r}; "
                             f"{kind}s are {list(known)}.")
        if n not in differentiable:
            raise ValueError(f"{method}({arg}={names!r}): {kind} {n!r} is not "
                             "floating point, so it has no derivative.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{method}({arg}={names!r}): {kind}s {twice} are named more "
                         f"than once; name each {kind} once.")
    return tuple(names)


def hvp_request(method: str, wrt: Any, tangent: Any, trees: Trees, input_names: tuple,
                point: dict) -> tuple[Any, dict, int | None, BaseException | None]:
    """Check the `wrt` and `tangent` arguments of a Hessian-vector product.

    **Returns:** (the `wrt` names, a tree input's name replaced by its leaves'; the
    tangents by name; how many directions they hold, or None for one; this rank's
    refusal of the arguments, or None). A refusal gives no tangents: the call's
    agreement raises it on every rank.
    """
    names = trees.expand([wrt] if isinstance(wrt, str) else wrt)
    try:
        if isinstance(tangent, dict):  # (a tree input's tangent: a tree alike)
            tangent = trees.flat(f"{method}(tangent=...)", tangent)
        checked = check_names(method, "wrt", names, input_names, input_names)
        tangents, count = hvp_tangents(method, checked, tangent, point)
    except (TypeError, ValueError) as err:
        return names, {}, None, err
    return names, tangents, count, None


def check_totals_options(method: str, mode: str, return_format: str, direction: str) -> None:
    """**Raises:** `ValueError` for an unknown `mode`, `return_format` or `direction` of
    a call of totals."""
    if mode not in MODES:
        raise ValueError(f"{method}(mode={mode!r}): expected one of {list(MODES)}.")
    if return_format not in FORMATS:
        raise ValueError(f"{method}(return_format={return_format!r}): expected one of "
                         f"{list(FORMATS)}.")
    if direction not in DIRECTIONS:
        raise ValueError(f"{method}(direction={direction!r}): expected one of "
                         f"{list(DIRECTIONS)}.")


def check_comparison_options(method: str, form: str, step: float | None,
                             atol: float, rtol: float) -> tuple[float | None, float, float]:
    """**Returns:** `check_totals`'s `step` (None: the default, see `default_step`),
    `atol` and `rtol` as floats, checked with its `method` and `form`."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"check_totals(method={method!r}): expected 'fd' (finite "
                         "differences) or 'cs' (complex step).")
    if not isinstance(form, str) or form not in FORMS:
        raise ValueError(f"check_totals(form={form!r}): expected one of {list(FORMS)}.")
    for name, value, least in (("step", step, 0), ("atol", atol, None), ("rtol", rtol, None)):
        if name == "step" and value is None:
            continue
        if not (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
                and math.isfinite(value) and (value > 0 if least == 0 else value >= 0)):
            raise ValueError(f"check_totals({name}={value!r}): expected a "
                             f"{'positive' if least == 0 else 'non-negative'} number.")
    return (None if step is None else float(step)), float(atol), float(rtol)  # (a Fraction)


def check_complex_step(layout: Layout, of: tuple[str, ...], wrt: tuple[str, ...]) -> None:
    """Refuse `check_totals(method="cs")` of complex inputs or outputs: the complex
    step perturbs real values along the imaginary axis, and reads the derivative off
    the imaginary part of real outputs."""
    for kind, names, specs in (("input", wrt, layout.inputs), ("output", of, layout.outputs)):
        found = [n for n in names if np.issubdtype(specs[n].dtype, np.complexfloating)]
        if found:
            raise ValueError(
                f"check_totals(method='cs'): {kind}s {found} are complex; the complex step "
                "perturbs real inputs along the imaginary axis and reads real outputs' "
                f"imaginary parts. Leave them out ({'wrt' if kind == 'input' else 'of'}"
                "=...) or use method='fd'.")


def check_scalar(method: str, of: Any, out: str, shape: tuple, distributed: frozenset) -> None:
    """**Raises:** `ValueError` where the output `out` that `of` names is not a
    replicated scalar."""
    if shape != () or out in distributed:
        raise ValueError(f"{method}(of={of!r}): output {out!r} has shape {shape}; expected "
                         "a scalar (a replicated 0-d output). Sum or reduce it in the model.")


def _same_dtype(where: str, name: str, new: np.ndarray, value: Any, old: np.ndarray,
                copy: bool | None) -> np.ndarray:
    """**Returns:** `new`, the input `name` a call passes, where its dtype is that of
    the current point's `old` or `old` is not differentiable; a number or list made in
    `old`'s dtype where it casts safely.

    **Raises:** TypeError for an array of another dtype: it would trace the model again
    at another precision or kind, where its derivatives may not exist.
    """
    if new.dtype == old.dtype or not inexact(old.dtype):
        return new
    if not hasattr(value, "dtype") and np.can_cast(new.dtype, old.dtype, "same_kind"):
        return as_input(where, np.asarray(value, old.dtype), copy)
    raise TypeError(f"{where}: input {name!r} is {old.dtype} at this Problem's point, "
                    f"and the array passed is {new.dtype}. A differentiable input keeps its "
                    f"dtype on every call. Pass `{name}.astype(numpy.{old.dtype})`, or make "
                    "a new Problem for the other dtype.")


def moved(method: str, inputs: Any, current: dict, copy: bool | None,
          keywords: bool = True, trees: Trees | None = None,
          ) -> tuple[dict, BaseException | None]:
    """The point a call asks for: the current one with `inputs` in it.

    **Arguments:**
    - `method`: the call, for messages.
    - `inputs`: name -> array, the inputs to change.
    - `current`: the current point.
    - `copy`: the Problem's `copy` option.
    - `keywords`: whether the method takes them as keywords (`run(x=...)`) or as a dict
      (`inputs={'x': ...}`), for the messages.
    - `trees`: the Problem's tree inputs, whose values `inputs` may give as trees.

    **Returns:** (the point, None), or (the current point, the error) where this rank
    refuses them: the call's agreement then raises it on every rank.
    """
    try:
        if not isinstance(inputs, dict):
            raise TypeError(f"{method}(inputs=...): expected a dict of name -> array; "
                            f"got a {type(inputs).__name__}.")
        if trees is not None:
            inputs = trees.flat(f"{method}(...)", inputs)
        point = dict(current)
        for name, value in inputs.items():
            where = (f"{method}({name}=...)" if keywords
                     else f"{method}(inputs={{'{name}': ...}})")
            if name not in point:
                raise ValueError(f"{where}: no input named '{name}'; "
                                 f"inputs are {list(current)}.")
            point[name] = _same_dtype(where, name, as_input(where, value, copy), value,
                                      current[name], copy)
    except (TypeError, ValueError) as err:
        return current, err
    return point, None


def hvp_tangents(method: str, wrt: tuple, tangent: Any, point: dict,
                 ) -> tuple[dict, int | None]:
    """`compute_hvp`'s `tangent`, checked against the inputs `wrt` at `point`.

    **Arguments:**
    - `method`: the call, for messages.
    - `wrt`: the input names, checked.
    - `tangent`: what was passed: a dict of name -> array shaped like this rank's value
      of the input, or with a leading axis of directions, the same for every name.
    - `point`: the current point.

    **Returns:** (name -> C-contiguous array in the input's dtype, in the order of
    `wrt`; the number of directions, or None where there is no axis of them).
    """
    if not isinstance(tangent, dict):
        raise TypeError(f"{method}(tangent=...): expected a dict of input name -> array; "
                        f"got a {type(tangent).__name__}.")
    if set(tangent) != set(wrt):
        raise ValueError(f"{method}(tangent=...): its names {sorted(map(str, tangent))} "
                         f"are not those of wrt, {list(wrt)}; pass one array per input "
                         "of wrt.")
    found: dict = {}
    counts: set[int | None] = set()
    for name in wrt:
        value, want = np.asarray(tangent[name]), point[name]
        if not np.issubdtype(value.dtype, np.number) or (
                np.iscomplexobj(value) and not np.iscomplexobj(want)):
            raise TypeError(f"{method}(tangent={{'{name}': ...}}): got {value.dtype} "
                            f"values for a {want.dtype} input; pass {want.dtype} ones.")
        if value.shape == want.shape:
            counts.add(None)
        elif value.shape[1:] == want.shape and value.ndim == want.ndim + 1:
            counts.add(value.shape[0])
        else:
            raise ValueError(
                f"{method}(tangent={{'{name}': ...}}): shape {value.shape}; expected "
                f"{want.shape} (this rank's value of the input) or (K, *{want.shape}) "
                "for K directions at once.")
        found[name] = np.array(value, dtype=want.dtype, order="C")  # (0-d stays 0-d)
    if len(counts) > 1:
        raise ValueError(f"{method}(tangent=...): some arrays have a leading axis of "
                         "directions and some do not, or their numbers differ; give "
                         "every input the same number of directions.")
    directions = counts.pop()
    if directions == 0:
        raise ValueError(f"{method}(tangent=...): no directions (a leading axis of 0).")
    return found, directions
