"""The checks a Problem makes as it is made, alike on every rank: the distributed
names every rank gives, the kinds of its values, and what a totals program that fails
then means for the others."""

import numpy as np

from .._agreement.coordinator import Coordinator, Failure, stable_hash
from .._compiler.layout import Layout
from .._compiler.programs import Programs
from .._compiler.schedule import ScheduleEntry
from .._compiler.tracing import TotalsOptions
from .._errors import (
    DistopError,
    KindError,
    MissingMethodError,
    OrderedEffectError,
    SecondDerivativeError,
)
from .._inference.transform import Inference


def agree_on_distributed(coordinator: Coordinator, point: dict) -> None:
    """Check that every rank names the same distributed values, and widen the agreement
    rows on the communicator to the widest any rank's Problem sends: one reduction of a
    fixed size.

    **Arguments:**
    - `coordinator`: the Problem's `Coordinator` (its `distributed` names).
    - `point`: the Problem's inputs.

    **Raises:** `DistopError` on every rank, naming every rank's names, where they differ.
    """
    distributed = coordinator.distributed
    names = sorted(distributed)
    named = stable_hash(names)
    top = coordinator.most(np.array(
        [2 + sum(k in distributed for k in point), named, -named], np.int64),
        "Problem: agreeing on the distributed names")
    if top[1] != -top[2]:
        every = coordinator.comm.allgather(names)
        raise DistopError(
            "Problem(distributed=...): the ranks named different distributed values:\n"
            + "\n".join(f"  rank {r}: {names}" for r, names in enumerate(every))
            + "\nName the same inputs and outputs on every rank.")
    coordinator.widen([int(top[0])])

def check_kinds(inference: Inference, distributed: frozenset[str]) -> None:
    """Raise `KindError` where the traced model gives an operator that combines each
    rank's own block copies of one value (an input left out of `distributed=`, almost
    always), or where an output varies between ranks but is not declared distributed."""
    copies = inference.copies()
    if copies:
        raise KindError(inference.copies_message("Problem", copies, "inputs",
                                                 "Problem(distributed=...)"))
    check_output_kinds(inference.varying_outputs(), distributed)


def check_output_kinds(varying: list[str], distributed: frozenset[str]) -> None:
    """Raise where an output that varies between ranks is not declared distributed:
    compute_totals would take it as replicated and sum its derivatives over the ranks."""
    undeclared = [k for k in varying if k not in distributed]
    if undeclared:
        raise KindError(
            f"Problem: outputs {undeclared} vary between ranks (each rank computes its own "
            "from distributed data, and nothing reduces them), but they are not named in "
            "distributed=, so compute_totals would take them as replicated and sum their "
            "derivatives over the ranks. If each rank holds a block of them along axis 0, "
            f"declare them: Problem(..., distributed={set(undeclared) | set(distributed)!r}); "
            "else reduce them to one value on every rank, e.g. distop.AllreduceSum()(...).")


# The plain types JAX raises where it cannot differentiate a model (reverse mode of a
# while_loop is a ValueError), matched exactly: a subclass of them (one of distop's own
# errors, or one of JAX's tracer errors) says that something else went wrong.
JAX_CANNOT_DIFFERENTIATE = (ValueError, TypeError, NotImplementedError)


def failure(err: BaseException) -> Failure:
    """This rank's view of a `compute_totals` program that failed as a Problem was made:
    `LEFT_FOR_LATER` where the model can still run (an operator has no vjp, the model
    itself differentiates an operator, or JAX cannot differentiate it: a while_loop, say)
    and `compute_totals` raises the error when called; `ON_OTHER_RANKS` where it failed
    because another rank did; else `RAISE_NOW`. The ranks decide together
    (`Coordinator.go_on_without`)."""
    if isinstance(err, (MissingMethodError, SecondDerivativeError,
                        OrderedEffectError)) or type(err) in JAX_CANNOT_DIFFERENTIATE:
        return Failure.LEFT_FOR_LATER
    if getattr(err, "elsewhere", False):
        return Failure.ON_OTHER_RANKS
    return Failure.RAISE_NOW


def first_schedule(programs: Programs, coordinator: Coordinator,
                   layout: Layout) -> tuple[ScheduleEntry, ...]:
    """Build a Problem's first program, agreed on every rank, for its schedule: the
    default `compute_totals` program, or `run`'s where there is nothing to differentiate
    or the ranks leave the totals program's failure for later (see `failure`).

    **Returns:** the program's schedule.
    """
    differentiable = layout.differentiable
    if differentiable["outputs"] and differentiable["inputs"]:
        try:
            return programs.program(
                "compute_totals", TotalsOptions("batched", differentiable["outputs"],
                                                differentiable["inputs"]),
                layout, caller="Problem(...)").schedule
        except Exception as err:  # left for later or raised, on every rank
            if not coordinator.go_on_without(failure(err)):
                raise
    return programs.program("run", (), layout, caller="Problem(...)").schedule
