"""The lean calls at one place of a repeated stretch of a program, rolled into a loop."""

from collections.abc import Sequence

import jax
import numpy as np

from .base import HostCallable


class RolledCall(HostCallable):
    """The lean calls at one place of a stretch of the program repeated `len(members)`
    times, rolled into a loop: iteration i runs `members[i]` (whose argument and result
    shapes are all the same). Its first argument after the token is i.

    **Arguments:**
    - `members`: the calls (`HostCall`s or `FusedCall`s), one per repetition, in order.
    """

    lean = ordered = True
    phase = "rolled"

    def __init__(self, members: Sequence[HostCallable]) -> None:
        self.members = tuple(members)
        self.ffi_id = None  # set when lowered (see _ffi.register)

    def __repr__(self) -> str:
        return f"rolled[{len(self.members)} x {self.members[0]!r}]"

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """**Returns:** the `jax.ShapeDtypeStruct`s of the results (the members')."""
        return self.members[0].shapes()

    def __call__(self, *args: np.ndarray,
                 out: Sequence[np.ndarray] | None = None) -> Sequence[np.ndarray]:
        """Run the member of iteration `args[0]` (the index) on the other arguments."""
        return self.members[int(args[0])](*args[1:], out=out)
