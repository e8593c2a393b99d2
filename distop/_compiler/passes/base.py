"""The shape every program pass has: analyse on this rank, merge across ranks, apply."""

import abc
import dataclasses
from collections.abc import Sequence
from typing import ClassVar, Generic, TypeVar

import numpy as np
from jax.extend.core import ClosedJaxpr

Proposal = TypeVar("Proposal")
Decision = TypeVar("Decision")


@dataclasses.dataclass(frozen=True)
class Context:
    """What the analyses need to know besides the program, the same on every rank.

    Fields:
    - `identities`: the positions, among the program's inputs, of those that hold
      identity matrices (the unit seeds of `compute_totals`).
    - `fuse`: whether calls may be fused (`Problem(fuse=...)`).
    - `allowed`: the chain positions of the forward calls that may be dropped (None:
      any); set by the driver while the ranks agree on them (see pipeline.py).
    """

    identities: tuple[int, ...] = ()
    fuse: bool = True
    allowed: frozenset[int] | None = None


class Pass(abc.ABC, Generic[Proposal, Decision]):
    """One transformation of a traced lean program, in three steps. An abstract base:
    a subclass implements `analyse`, `merge` and `apply` (Python raises a `TypeError`
    naming any it lacks when one is made).

    1. `analyse(program, context)`: this rank's proposal, what it would do on its own
       (small and picklable: it may be sent to the other ranks).
    2. `merge(proposals)`: the decision, from the proposals of every rank in rank
       order; pure, so every rank that merges the same proposals decides alike.
    3. `apply(program, decision)`: the program rewritten as decided: a new
       `ClosedJaxpr`, or `program` itself where nothing changes.

    A shared pass also says how its proposals cross ranks in reductions of a size that
    does not grow with the number of ranks (see pipeline.py's `decided`):
    `sizes(proposal)` (`dimensions` numbers: how much its encoding needs; the ranks
    take the largest of each), `encode(proposal, sizes)` (int64 numbers), and
    `decode(largest, sizes)`, which gives from the elementwise largest of every
    rank's encoding what `merge` gives from every rank's proposal.

    Attributes:
    - `shared`: whether the proposals cross ranks. The driver (pipeline.py) sends them
      in its exchanges; a pass that is not shared is merged on this rank's proposal
      alone and applied at once.
    - `optimistic`: whether a shared pass is applied with this rank's own proposal before
      the exchange, for the passes after it to analyse the program it leaves. Its
      merge then tells whether every rank proposed the same (`unanimous`); where not,
      the driver analyses it again in the context `again` gives, and exchanges again,
      until they do.
    """

    shared: ClassVar[bool] = False
    optimistic: ClassVar[bool] = False
    dimensions: ClassVar[int] = 0  # how many numbers `sizes` gives (a shared pass)

    @abc.abstractmethod
    def analyse(self, program: ClosedJaxpr, context: Context) -> Proposal:
        """**Returns:** this rank's proposal for `program`."""

    @abc.abstractmethod
    def merge(self, proposals: Sequence[Proposal]) -> Decision:
        """**Returns:** the decision, from every rank's proposal (rank order)."""

    @abc.abstractmethod
    def apply(self, program: ClosedJaxpr, decision: Decision) -> ClosedJaxpr:
        """**Returns:** `program` rewritten as `decision` says, or `program` itself."""

    def unanimous(self, decision: Decision) -> bool:
        """Whether every rank proposed what `decision` decides (an `optimistic` pass)."""
        return True

    def sizes(self, proposal: Proposal) -> tuple[int, ...]:
        """**Returns:** the sizes `encode` needs for this rank's proposal (a shared
        pass)."""
        raise NotImplementedError(f"{type(self).__name__} is not a shared pass.")

    def encode(self, proposal: Proposal, sizes: tuple[int, ...]) -> np.ndarray:
        """**Returns:** `proposal` as int64 numbers, for `sizes` (every rank's largest):
        as many on every rank (a shared pass)."""
        raise NotImplementedError(f"{type(self).__name__} is not a shared pass.")

    def decode(self, largest: np.ndarray, sizes: tuple[int, ...]) -> Decision:
        """**Returns:** the decision, from the elementwise largest of every rank's
        `encode` (a shared pass)."""
        raise NotImplementedError(f"{type(self).__name__} is not a shared pass.")

    def again(self, context: Context, decision: Decision) -> Context:
        """**Returns:** the context to analyse an `optimistic` pass again in, where the ranks
        did not agree on `decision`."""
        raise NotImplementedError(f"{type(self).__name__} is not an `optimistic` pass.")


# Below every number an encoding holds: the largest over ranks where none holds one.
NONE = np.iinfo(np.int64).min


class LocalPass(Pass[Proposal, Proposal]):
    """A pass that needs nothing from the other ranks: its decision is its proposal."""

    def merge(self, proposals: Sequence[Proposal]) -> Proposal:
        """**Returns:** the one proposal (this rank's)."""
        (only,) = proposals
        return only
