"""The work behind a Problem's entry points: each call's request, its arguments checked
once the ranks agree on them, its program, and its results assembled.

`Problem` holds the public methods, their documentation and the current point; each
method hands its work to `Entries` (one per Problem), whose calls go down the layers
once (see `calls.py`).
"""

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from .._compiler.layout import Layout
from .._compiler.programs import Program
from .._compiler.tracing import FDOptions, HvpOptions, TotalsOptions
from .._totals import assembly as _assembly
from .._totals import totals as _totals
from .arguments import (
    check_comparison_options,
    check_complex_step,
    check_names,
    check_scalar,
    check_totals_options,
    hvp_request,
    request_key,
)
from .calls import Call, Calls
from .trees import Trees

Names = str | Iterable[str] | None  # what `of` and `wrt` take


class Request(NamedTuple):
    """A totals call's request, agreed and checked: its layout, the `of` and `wrt`
    names, and the direction of the sweeps (`"rev"` or `"fwd"`)."""

    layout: Layout
    of: tuple[str, ...]
    wrt: tuple[str, ...]
    direction: str


class Swept(NamedTuple):
    """What a totals call's attempt gives: its request, and the program and its results
    (None where there is nothing to sweep)."""

    request: Request
    program: Program | None
    found: dict[Any, Any] | None


class Entries:
    """The work of one Problem's entry points (see the module's docstring).

    **Arguments:**
    - `comm`: the Problem's communicator.
    - `distributed`: the names of its distributed values.
    - `trees`: its tree inputs (`Trees`).
    - `input_names`, `output_names`: its inputs' and outputs' names.
    - `calls`: its `Calls`.
    """

    def __init__(self, comm: Any, distributed: frozenset[str], trees: Trees,
                 input_names: tuple[str, ...], output_names: tuple[str, ...],
                 calls: Calls) -> None:
        self.comm, self.distributed, self.trees = comm, distributed, trees
        self.input_names, self.output_names, self.calls = input_names, output_names, calls

    def run(self, point: dict[str, Any], refused: BaseException | None,
            current: dict[str, Any]) -> dict[str, np.ndarray]:
        """`Problem.run` at `point` (`refused`: see `Call.agree`)."""
        def attempt(call: Call) -> dict[str, np.ndarray]:
            layout = call.agree(point, ("run",), refused, current)
            return call.run(call.program("run", (), layout), point)

        return self.calls(attempt)

    def totals(self, point: dict[str, Any], of: Names, wrt: Names, mode: str,
               return_format: str, direction: str,
               check_ranks: bool) -> dict[tuple[str, str], np.ndarray]:
        """`Problem.compute_totals` at `point`; `check_ranks=False` leaves out the check
        that the blocks of replicated inputs are the same on every rank."""
        def attempt(call: Call) -> Swept:
            request = self.request(call, "compute_totals", point, point, of, wrt, mode,
                                   return_format, direction)
            if not request.of or not request.wrt:
                return Swept(request, None, None)
            program = call.program("compute_totals", TotalsOptions(
                mode, request.of, request.wrt, False, request.direction), request.layout)
            return Swept(request, program, call.run(program, point))

        request, program, cts = self.calls(attempt)
        if program is None or cts is None:
            return {}
        check = check_ranks and _assembly.unchecked(program, return_format)
        totals = _assembly.assembled(self.comm, request.layout, cts, request.of,
                                     request.wrt, return_format, request.direction, check)
        if check_ranks:
            program.totals_checked.add(return_format)
        return totals

    def run_and_totals(self, point: dict[str, Any], refused: BaseException | None,
                       current: dict[str, Any], of: Names, wrt: Names, mode: str,
                       return_format: str, direction: str,
                       ) -> tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray]]:
        """`Problem.run_and_compute_totals` at `point`. **Returns:** (values, totals)."""
        def attempt(call: Call) -> Swept:
            request = self.request(call, "run_and_compute_totals", point, current, of, wrt,
                                   mode, return_format, direction, refused)
            if not request.of or not request.wrt:  # nothing to differentiate: `run`'s
                program = call.program("run", (), request.layout)
            else:
                program = call.program("compute_totals", TotalsOptions(
                    mode, request.of, request.wrt, True, request.direction),
                    request.layout)
            return Swept(request, program, call.run(program, point))

        request, program, out = self.calls(attempt)
        assert program is not None and out is not None  # (always a program to run)
        if not request.of or not request.wrt:
            return out, {}
        values = {k: v for (kind, k), v in out.items() if kind == "value"}  # as run's
        swept = request.of if request.direction == "fwd" else request.wrt
        totals = _assembly.assembled(self.comm, request.layout,
                                     {k: out["total", k] for k in swept}, request.of,
                                     request.wrt, return_format, request.direction,
                                     _assembly.unchecked(program, return_format))
        program.totals_checked.add(return_format)
        return values, totals

    def hvp(self, point: dict[str, Any], of: str, wrt: Names,
            tangent: dict[str, Any]) -> dict[str, np.ndarray]:
        """`Problem.compute_hvp` at `point`."""
        method = "compute_hvp"
        if not isinstance(of, str):
            raise TypeError(f"{method}(of={of!r}): expected the name of one scalar output.")
        key = request_key
        expanded, tangents, count, refused = hvp_request(method, wrt, tangent, self.trees,
                                                         self.input_names, point)
        count_key = count if count is not None or refused is None else "refused"

        def attempt(call: Call) -> dict[str, Any]:
            request = (method, key(of, names=True), key(expanded, names=True),
                       key(count_key))
            layout = call.agree(point, request, refused, point)
            wrt = check_names(method, "wrt", expanded, self.input_names,
                              layout.differentiable["inputs"])
            (out,) = check_names(method, "of", of, self.output_names,
                                 layout.differentiable["outputs"])
            check_scalar(method, of, out, layout.outputs[out].shape, self.distributed)
            program = call.program(method, HvpOptions(out, wrt, count), layout,
                                   make_extra=lambda: (tangents,))
            found = call.run(program, point, (tangents,))
            if _assembly.unchecked(program, "global"):
                _assembly.check_replicated_totals(
                    self.comm, layout, {(out, w): found[w] for w in wrt}, "global")
                program.totals_checked.add("global")
            return found

        return self.calls(attempt)

    def request(self, call: Call, method: str, point: dict[str, Any],
                current: dict[str, Any], of: Names, wrt: Names, mode: str,
                return_format: str, direction: str,
                refused: BaseException | None = None) -> Request:
        """Agree on a request for totals at `point` as part of `call` and check its
        arguments (`current`: the point taken where this rank refuses the call)."""
        key = request_key
        request = (method, key(of, names=True), key(wrt, names=True), key(mode),
                   key(return_format), key(direction))
        layout = call.agree(point, request, refused, current)
        of = check_names(method, "of", of, self.output_names,
                         layout.differentiable["outputs"])
        wrt = check_names(method, "wrt", self.trees.expand(wrt), self.input_names,
                          layout.differentiable["inputs"])
        check_totals_options(method, mode, return_format, direction)
        if direction == "auto":  # (the same on every rank: the layout is)
            rows = sum(layout.global_size(o) for o in of)
            columns = sum(layout.global_size(w) for w in wrt)
            direction = "fwd" if columns < rows else "rev"
        return Request(layout, of, wrt, direction)

    def check_totals(self, point: dict[str, Any], of: Names, wrt: Names, method: str,
                     form: str, step: float | None, atol: float, rtol: float,
                     evaluate: Callable[..., Any], reporting: dict[str, Any],
                     ) -> dict[tuple[str, str], _totals.TotalsCheck]:
        """`Problem.check_totals` at `point`; `evaluate(layout, perturbed)` makes its
        `Evaluations`, `reporting`: its reporting options."""
        key = request_key
        layout = self.calls.agreed(point, (
            "check_totals", key(of, names=True), key(wrt, names=True), key(method),
            key(form), key(step), key(atol), key(rtol)))
        step, atol, rtol = check_comparison_options(method, form, step, atol, rtol)
        of = check_names("check_totals", "of", of, self.output_names,
                         layout.differentiable["outputs"])
        wrt = check_names("check_totals", "wrt", self.trees.expand(wrt), self.input_names,
                          layout.differentiable["inputs"])
        if method == "cs":
            check_complex_step(layout, of, wrt)
        programs, executor = self.calls.programs, self.calls.executor

        def perturbed(options: FDOptions, deltas: dict[str, np.ndarray]) -> dict[str, Any]:
            program = programs.program("fd", options, layout, make_extra=lambda: (deltas,))
            return executor(program, point)

        return _totals.check_totals(evaluate(layout, perturbed), of, wrt, method=method,
                                    form=form, step=step, atol=atol, rtol=rtol, **reporting)

    def check_hvp(self, point: dict[str, Any], of: str, wrt: Names, directions: int,
                  seed: int, step: float | None, atol: float, rtol: float,
                  gradient_at: Callable[..., Any], products: Callable[..., Any],
                  restore: Callable[[dict[str, Any]], Any], reporting: dict[str, Any],
                  ) -> dict[tuple[str, str], _totals.TotalsCheck]:
        """`Problem.check_hvp` at `point`; `gradient_at(out, wrt, moved)`: the gradient
        of `out` at the point moved by `moved`; `products`: `Problem.compute_hvp`;
        `restore(inputs)`: runs the model at the inputs given, to leave the point as it
        was."""
        key = request_key
        layout = self.calls.agreed(point, (
            "check_hvp", key(of, names=True), key(wrt, names=True), key(directions),
            key(seed), key(step), key(atol), key(rtol)))
        step, atol, rtol = check_comparison_options("fd", "central", step, atol, rtol)
        if not isinstance(directions, int) or directions < 1:
            raise ValueError(f"check_hvp(directions={directions!r}): expected a whole "
                             "number of directions, at least 1.")
        (out,) = check_names("check_hvp", "of", [of] if isinstance(of, str) else of,
                             self.output_names, layout.differentiable["outputs"])
        wrt = check_names("check_hvp", "wrt", self.trees.expand(wrt), self.input_names,
                          layout.differentiable["inputs"])

        def gradient(deltas: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return gradient_at(out, wrt, {w: point[w] + deltas[w] for w in deltas})

        evaluations = _totals.HvpEvaluations(self.comm, layout, point, products, gradient)
        try:
            return _totals.check_hvp(evaluations, out, wrt, directions=directions,
                                     seed=seed, step=step, atol=atol, rtol=rtol, **reporting)
        finally:
            restore({w: point[w] for w in wrt})  # (the current point, as it was)
