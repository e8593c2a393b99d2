"""One call of an entry point, down the layers once: agreed, its program found, run.

A call of `run`, `compute_totals`, `run_and_compute_totals` or `compute_hvp` agrees
across ranks once (`Coordinator.request`), finds its layout and program by one lookup
each (`Programs`), and runs it (`Executor`). Where the request and the shapes were
seen before, the agreement is left pending and handed to the program's first host
call through the program's `Gate`: the ranks then meet once per call, in that call.
It is made before anything else communicates: before a program is built, or before a
program runs that cannot make it. Where it finds that the ranks disagree, no method
runs on any rank, and the call is made again with what every rank sent (raising on
every rank, or running the right program).
"""

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .._agreement.coordinator import CallAgreement, Coordinator, Missed
from .._compat import x64_enabled
from .._compiler.layout import Layout
from .._compiler.programs import Options, Program, Programs
from .._errors import DistopError
from .execution import Executor

Result = TypeVar("Result")


class Calls:
    """The calls of one Problem's entry points (see the module's docstring).

    **Arguments:**
    - `coordinator`, `programs`, `executor`: the Problem's.
    """

    def __init__(self, coordinator: Coordinator, programs: Programs,
                 executor: Executor) -> None:
        self.coordinator, self.programs, self.executor = coordinator, programs, executor

    def __call__(self, attempt: "Callable[[Call], Result]") -> Result:
        """Make one call: `attempt(call)` does its work through `call` (`Call.agree`,
        then `Call.program` and `Call.run`).

        **Returns:** what `attempt` returns, once the ranks are found to agree.

        **Raises:** what `attempt` raises where the ranks agree; where they turn out to
        disagree, what the attempt made again with every rank's request raises.
        """
        call = Call(self, defer=True)
        try:
            result = attempt(call)
        except Missed:
            pass
        except BaseException:
            if not call.ranks_disagree():  # (raised before the agreement was made, say)
                raise
        else:
            if not call.ranks_disagree():
                return result
        return attempt(Call(self, defer=False, gathered=call.gathered()))

    def agreed(self, point: dict[str, Any], request: tuple[Any, ...]) -> Layout:
        """Agree on `request` at `point` before anything else (Problem construction and
        the checks, whose further steps communicate), and return its `Layout`."""
        return Call(self, defer=False).agree(point, request)


class Call:
    """One call of an entry point (see `Calls`).

    **Arguments:**
    - `calls`: the Problem's `Calls`.
    - `defer`: the agreement may be left pending, for the program to make.
    - `gathered`: every rank's row of the pending agreement of this call's first
      attempt, which found that the ranks disagree.
    """

    __slots__ = ("calls", "defer", "every", "pending")

    def __init__(self, calls: Calls, defer: bool, gathered: np.ndarray | None = None) -> None:
        self.calls, self.defer, self.every = calls, defer, gathered
        self.pending: CallAgreement | None = None

    def agree(self, point: dict[str, Any], request: tuple[Any, ...],
              refused: BaseException | None = None,
              current: dict[str, Any] | None = None) -> Layout:
        """Agree with every rank on the request (the entry point and its arguments) and
        the shapes of `point` (one small collective per call, perhaps left pending).

        **Arguments:**
        - `point`: the inputs of the call.
        - `request`: the entry point and its arguments.
        - `refused`: the error of an argument this rank refused (see
          `Coordinator.request`); then `point` is the current one.
        - `current`: the current point, taken instead of `point` where this rank
          refuses the call.

        **Returns:** the `Layout` of the point.
        """
        programs = self.calls.programs
        if refused is None and x64_enabled() != programs.x64:
            point, refused = current if current is not None else point, DistopError(
                f"{request[0]}: this Problem was made with jax_enable_x64="
                f"{programs.x64} and is called with {not programs.x64}: its programs and "
                "values are in the other precision. Change jax_enable_x64 back, or make "
                "a new Problem after changing it.")
        local = tuple([(k, v.shape, v.dtype.str) for k, v in point.items()])
        own = [v.shape[0] for k, v in point.items() if k in programs.distributed]
        counts, self.pending = self.calls.coordinator.request(
            local, request, own, refused, self.defer, self.every)
        return programs.layout(point, local, counts, self.pending is not None)

    def program(self, name: str, options: Options, layout: Layout,
                make_extra: Callable[[], tuple[Any, ...]] = tuple,
                caller: str | None = None) -> Program:
        """The program of an entry point for `layout`: one lookup, or built (see
        `Programs.program`) once the agreement is made, since building communicates.

        **Raises:** `Missed` where the agreement finds that the ranks disagree.
        """
        programs = self.calls.programs
        found = programs.built(name, options, layout)
        if found is None:
            self._settle()
            found = programs.program(name, options, layout, make_extra, caller)
        return found

    def run(self, program: Program, point: dict[str, Any],
            extra: tuple[Any, ...] | None = None) -> dict:
        """Run `program` at `point` (see `Executor.__call__`), handing the pending
        agreement to its first host call where it can make it, else making it first.

        **Raises:** `Missed` where the agreement, made first, finds that the ranks
        disagree; what the program's host calls raise.
        """
        if self.pending is not None:
            if program.gate is None:
                self._settle()
            else:
                program.gate.pending = self.pending
        return self.calls.executor(program, point, extra)

    def ranks_disagree(self) -> bool:
        """Make the pending agreement, if there is one (the program may have made it).

        **Returns:** whether the ranks disagree.
        """
        return self.pending is not None and self.pending.ranks_disagree()

    def gathered(self) -> np.ndarray | None:
        """**Returns:** every rank's row of an agreement that found the ranks disagree."""
        return None if self.pending is None else self.pending.every

    def _settle(self) -> None:
        """Make the pending agreement now. **Raises:** `Missed` where the ranks disagree."""
        if self.ranks_disagree():
            raise Missed
