"""What every object a compiled program calls back into provides."""

import abc
from collections.abc import Sequence

import jax
import numpy as np


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
    """

    lean: bool = False
    ordered: bool = False
    phase: str
    ffi_id: int | None = None

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
