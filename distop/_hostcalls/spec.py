"""What an operator call is: the method, its arguments and results, its batch levels.

A `CallSpec` is the description a `HostCall` runs: frozen, it holds what the call was
made with and what follows from that alone (which arguments are (co)tangents, the
shapes of the results, the method and what it takes). A derivative or batched form of
a call is a new description (`with_phase`, `with_batch`, ...).
"""

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .._dtypes import inexact_spec
from .._errors import OperatorError

Specs = tuple[jax.ShapeDtypeStruct, ...]
Levels = tuple[tuple[bool, ...], ...]


class MethodInfo(NamedTuple):
    """What an operator class's method of one phase takes and returns."""

    batched: bool  # whether it takes a leading batch axis
    takes_batched: bool  # whether it takes the keyword `batched`
    takes_out: bool  # whether it takes the keyword `out`
    expand_dims: bool  # whether an unbatched input gets a batch axis of length 1


@functools.cache
def _method_info(cls: type, phase: str) -> MethodInfo:
    """**Returns:** what `cls.<phase>` takes; computed once per class, as tracing meets
    every call site."""
    batched = bool(getattr(cls, "batched_" + phase, False))
    parameters = inspect.signature(getattr(cls, phase)).parameters
    unbatched = getattr(cls, "unbatched", "broadcast")
    if unbatched not in ("broadcast", "expand_dims"):
        raise OperatorError(f"{cls.__name__}.unbatched = {unbatched!r}: expected "
                            "'broadcast' or 'expand_dims'.")
    return MethodInfo(batched, batched and "batched" in parameters, "out" in parameters,
                      unbatched == "expand_dims")


def _sides(phase: str, in_specs: Specs, out_specs: Specs) -> tuple[Specs, Specs]:
    """**Returns:** (the specs of the values a `phase` method takes (co)tangents of, those
    of the values it returns): none and the outputs (`forward`), the inputs and the
    outputs (`jvp`), the outputs and the inputs (`vjp`), the outputs and inputs (the
    cotangent and the tangent) and the inputs (`hvp`), the inputs twice (the tangent and
    the direction it is differentiated in) and the outputs (`jvp2`)."""
    if phase == "forward":
        return (), out_specs
    if phase == "hvp":
        return out_specs + in_specs, in_specs
    if phase == "jvp2":
        return in_specs + in_specs, out_specs
    return (in_specs, out_specs) if phase == "jvp" else (out_specs, in_specs)


def _derived() -> Any:
    """A field of `CallSpec` that follows from the others (set by `__post_init__`)."""
    return dataclasses.field(init=False, repr=False)


def _inexact(specs: Specs) -> tuple[int, ...]:
    """**Returns:** the indices of the floating-point `specs`."""
    return tuple(i for i, s in enumerate(specs) if inexact_spec(s))


def _derived_values(spec: "CallSpec") -> dict[str, Any]:
    """**Returns:** {name: value} of what follows from the fields of `spec` (see
    `CallSpec`)."""
    phase, levels, batch_shape = spec.phase, spec.levels, spec.batch_shape
    linear, returned = _sides(phase, spec.in_specs, spec.out_specs)
    cls: type = type(spec.op)  # (`type`: mypy finds `type[Any]` unhashable)
    slots = _inexact(linear)
    n_linear = len(slots)
    picks = None if phase == "forward" else _inexact(returned)
    result_specs = returned if picks is None else tuple(returned[k] for k in picks)
    arg_specs = tuple(linear[i] for i in slots) + spec.in_specs
    # (`jvp2` is never run: see `CallSpec`)
    method = _method_info(cls, phase) if phase != "jvp2" else MethodInfo(False, False,
                                                                        False, False)
    first = len(_inexact(spec.out_specs if phase == "hvp" else spec.in_specs))
    named = "jvp" if phase == "jvp2" else phase  # (a jvp2 call is its jvp's derivative)
    label = getattr(cls, "phase_labels", {}).get(named, named)
    return {
        "slots": slots, "n_slots": len(linear), "n_linear": n_linear,
        "n_first": first if phase in ("hvp", "jvp2") else n_linear,
        "result_picks": picks, "result_specs": result_specs,
        "n_user_results": len(returned), "arg_specs": arg_specs,
        "function": getattr(cls, phase, None), "method": method,
        "label": label, "where": f"{cls.__name__}.{label}",
        "declared": tuple(getattr(cls, phase + "_collectives", ())),
        "expected_results": tuple(
            (k, tuple(s.shape), np.dtype(s.dtype))
            for k, s in zip(range(len(returned)) if picks is None else picks, result_specs)),
        "arg_shapes": tuple(s.shape for s in arg_specs),
        "arg_kinds": tuple(
            "full" if all(lv) else "expand" if (method.expand_dims and not any(lv)
                                                and i >= n_linear)
            else "broadcast" for i, lv in enumerate(levels)),
        "skippable": (phase != "forward" and len(batch_shape) == 1 and n_linear > 0
                      and batch_shape[0] > 1 and all(lv[0] for lv in levels[:n_linear])),
    }


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class CallSpec:
    """One operator method as a compiled program calls it.

    **Arguments:**
    - `op`: the `DistributedOperator`.
    - `phase`: `"forward"`, `"jvp"`, `"vjp"` or `"hvp"`; or `"jvp2"`, the derivative
      of a `jvp` call with respect to its inputs, which is never run (forward mode over
      forward mode is refused) but transposes into an `hvp` call. A `jvp2` call's
      `ordered` and `lean` are those of the `hvp` call it transposes into (see
      `HostCall`: it runs neither ordered nor lean).
    - `comm`: the private communicator handed to user code.
    - `ordered`: whether the call is ordered (and so may communicate).
    - `in_specs`, `out_specs`: the operator's unbatched input and output
      `jax.ShapeDtypeStruct`s.
    - `levels`: per argument, one bool per batch level (outermost first): whether the
      argument carries that batch axis.
    - `batch_shape`: the size of every batch level (outermost first).
    - `lean`: whether the call takes the lean path.

    The arguments XLA passes are the inputs (`forward`), or the tangents of the
    floating-point inputs (`jvp`) or cotangents of the floating-point outputs (`vjp`)
    followed by the inputs. Integer values have no (co)tangent: user code gets None.

    What follows from the arguments alone, set when made:
    - `slots`: the method's (co)tangent arguments that XLA passes, as indices of the
      floating-point inputs (`jvp`) or outputs (`vjp`); none for `forward`.
    - `n_slots`: the (co)tangents the method takes, integer ones (None) included.
    - `n_linear`: the (co)tangent arguments XLA passes, before the inputs.
    - `n_first`: of those, the first group's: an `hvp` call's cotangents (then come
      its tangents), a `jvp2` call's tangents (then come its directions); `n_linear`
      for the other phases.
    - `result_picks`: the method's results that XLA receives, as indices of its
      floating-point ones; None for `forward` (every one).
    - `result_specs`, `arg_specs`: the unbatched specs of the results XLA receives and
      of the arguments it passes.
    - `n_user_results`: the method's results, integer inputs' (None) included.
    - `function`: the method, taken from the class (no bound method is made per call).
    - `method`: what the method takes (`MethodInfo`).
    - `label`: the phase as users know it (an implicit operator's `solve`, say).
    - `where`: `Class.label`, for messages.
    - `declared`: the collectives the method declares.
    - `expected_results`: per result XLA receives, (its index among the method's
      results, its unbatched shape, its dtype).
    - `arg_shapes`: the unbatched shapes of the arguments XLA passes.
    - `arg_kinds`: per argument, how a batched call receives it: `"full"` (it carries
      every batch level), `"expand"` (an input, not a (co)tangent, that carries none,
      and the method takes it with a batch axis of length 1) or `"broadcast"`. A
      (co)tangent is always broadcast: the method's results follow its batch axis.
    - `skippable`: whether zero rows of the (co)tangents may be skipped: a `jvp`/`vjp`
      (linear in them: zero rows give zero results) over one batch level of at least
      two rows that every (co)tangent carries.

    Compared by identity, as its operator and communicator are.
    """

    op: Any
    phase: str
    comm: Any
    ordered: bool
    in_specs: Specs
    out_specs: Specs
    levels: Levels
    batch_shape: tuple[int, ...] = ()
    lean: bool = False
    slots: tuple[int, ...] = _derived()
    n_slots: int = _derived()
    n_linear: int = _derived()
    n_first: int = _derived()
    result_picks: tuple[int, ...] | None = _derived()
    result_specs: Specs = _derived()
    n_user_results: int = _derived()
    arg_specs: Specs = _derived()
    function: Any = _derived()
    method: MethodInfo = _derived()
    label: str = _derived()
    where: str = _derived()
    declared: tuple[str, ...] = _derived()
    expected_results: tuple[tuple[int, tuple[int, ...], np.dtype], ...] = _derived()
    arg_shapes: tuple[tuple[int, ...], ...] = _derived()
    arg_kinds: tuple[str, ...] = _derived()
    skippable: bool = _derived()

    def __post_init__(self) -> None:
        # (frozen: set in the instance's dictionary, as `functools.cached_property` does)
        self.__dict__.update(_derived_values(self))

    @classmethod
    def make(cls, op: Any, phase: str, comm: Any, ordered: bool,
             in_specs: Sequence[jax.ShapeDtypeStruct],
             out_specs: Sequence[jax.ShapeDtypeStruct],
             levels: Sequence[tuple[bool, ...]] | None = None,
             batch_shape: Sequence[int] = (), lean: bool = False) -> "CallSpec":
        """A description from the arguments of `HostCall`.

        **Arguments:** as the class's, but any sequences; `levels` None (the default)
        for every argument carrying every batch level.

        **Returns:** the description.
        """
        in_specs, out_specs, batch_shape = tuple(in_specs), tuple(out_specs), tuple(batch_shape)
        if levels is None:
            linear, _ = _sides(phase, in_specs, out_specs)
            n_args = len(_inexact(linear)) + len(in_specs)
            levels = ((True,) * len(batch_shape),) * n_args
        return cls(op, phase, comm, ordered, in_specs, out_specs, tuple(levels),
                   batch_shape, lean)

    def __repr__(self) -> str:
        batch = f" batch={list(self.batch_shape)}" if self.batch_shape else ""
        kind = "lean" if self.lean else "ordered" if self.ordered else "unordered"
        return f"{self.where}[{kind}{batch}]"

    def shapes(self) -> Specs:
        """**Returns:** the `jax.ShapeDtypeStruct`s of the results XLA receives (batched)."""
        return self._shapes

    @functools.cached_property
    def _shapes(self) -> Specs:
        return tuple(jax.ShapeDtypeStruct(self.batch_shape + s.shape, s.dtype)
                     for s in self.result_specs)

    # -- other forms of the call ----------------------------------------------------------
    def with_phase(self, phase: str,
                   linear_levels: Sequence[tuple[bool, ...]] | None = None) -> "CallSpec":
        """The same operator call in another phase, at the same batch levels.

        **Arguments:**
        - `phase`: `"jvp"` or `"vjp"`.
        - `linear_levels`: the batch levels of the new call's (co)tangent arguments;
          default: every level.

        **Returns:** the new description.
        """
        if linear_levels is None:
            linear, _ = _sides(phase, self.in_specs, self.out_specs)
            linear_levels = [(True,) * len(self.batch_shape)] * len(_inexact(linear))
        return CallSpec(self.op, phase, self.comm, self.ordered, self.in_specs,
                        self.out_specs, (*linear_levels, *self.levels[self.n_linear:]),
                        self.batch_shape, self.lean)

    def unleaned(self) -> "CallSpec":
        """**Returns:** this call off the lean path: an ordered `io_callback`."""
        return CallSpec(self.op, self.phase, self.comm, True, self.in_specs,
                        self.out_specs, self.levels, self.batch_shape)

    def narrowed(self, count: int) -> "CallSpec":
        """**Returns:** this call on `count` rows of its one batch level."""
        return CallSpec(self.op, self.phase, self.comm, self.ordered, self.in_specs,
                        self.out_specs, self.levels, (count,), self.lean)

    def with_batch(self, in_batched: Sequence[bool], size: int) -> "CallSpec":
        """**Returns:** this call one batch level deeper (a new outermost batch axis of
        `size`, carried by the arguments flagged in `in_batched`)."""
        return CallSpec(self.op, self.phase, self.comm, self.ordered, self.in_specs,
                        self.out_specs, tuple((b,) + lv for b, lv in zip(in_batched,
                                                                         self.levels)),
                        (size,) + self.batch_shape, self.lean)
