"""What every object a compiled program calls back into provides."""

import abc
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


class Gate:
    """What the host calls of one program share while it runs: the agreement of the
    call, where the program's first host call is to make it (see
    `_agreement.coordinator.CallAgreement`), else None.

    The caller sets `pending` before the program runs and clears it after; the FFI
    handler reaches it through the host call it runs, so no module holds it.
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: Any = None


class HostCallable(abc.ABC):
    """A host call of a compiled program: what the FFI handler (see ffi.py) and the
    `io_callback` lowering call. An abstract base: a subclass implements `shapes`,
    `__call__` and `__repr__` (Python raises a `TypeError` naming any it lacks when
    one is made).

    Attributes every subclass sets:
    - `lean`: whether the call takes the lean path (the token chain of ffi.py).
    - `ordered`: whether the call is ordered (and so may communicate).
    - `phase`: `"forward"`, `"jvp"` or `"vjp"` for one method; what it groups else.
    - `ffi_id`: the id of its lean call site once lowered (see `_ffi.register`), else None.
    - `gate`: the `Gate` of its program, where the program's first host call may make
      the agreement of the call, else None.
    """

    lean: bool = False
    ordered: bool = False
    phase: str
    ffi_id: int | None = None
    gate: Gate | None = None

    @abc.abstractmethod
    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """**Returns:** the `jax.ShapeDtypeStruct`s of the results XLA receives."""

    @abc.abstractmethod
    def __call__(self, *args: np.ndarray,
                 out: Sequence[np.ndarray] | None = None) -> Sequence[np.ndarray]:
        """Run the call on XLA's arguments.

        **Arguments:**
        - `args`: numpy views of XLA's arguments, read-only (the token left out).
        - `out`: XLA's buffers of the results, valid during the call (the lean path),
          or None.

        **Returns:** the results, in order (possibly `out`'s arrays themselves).
        """

    @abc.abstractmethod
    def __repr__(self) -> str:
        """**Returns:** a short description, for messages and `Problem.schedule`."""
