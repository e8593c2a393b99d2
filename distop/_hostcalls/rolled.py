"""The lean calls at one place of a repeated stretch of a program, rolled into a loop, and
the calls after it that read its stacked results."""

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


class UnstackedCall(HostCallable):
    """A lean call after a loop that reads many of the loop's stacked results, given
    them as slices of the stacks: XLA compiles one slice per stack where one per result
    would make its compile time grow with their square. The call's arguments are
    rebuilt as numpy views of the rows, in order.

    **Arguments:**
    - `call`: the call (a `HostCall` or `FusedCall`).
    - `layout`: per argument given, the number of the call's arguments it holds: 0 for
      one argument as it is, n (or -n) for n arguments that are its rows in order (or
      in reverse order).
    """

    lean = ordered = True

    def __init__(self, call: HostCallable, layout: Sequence[int]) -> None:
        self.call, self.layout = call, tuple(layout)
        self.phase = call.phase
        self.ffi_id = None  # set when lowered (see _ffi.register)

    def __repr__(self) -> str:
        return f"unstacked[{self.call!r}]"

    def shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """**Returns:** the `jax.ShapeDtypeStruct`s of the results (the call's)."""
        return self.call.shapes()

    def __call__(self, *args: np.ndarray,
                 out: Sequence[np.ndarray] | None = None) -> Sequence[np.ndarray]:
        """Run the call on the arguments, each stack's rows given one by one."""
        given: list[np.ndarray] = []
        for arg, n in zip(args, self.layout):
            if n == 0:
                given.append(arg)
            else:
                given.extend(arg if n > 0 else arg[::-1])
        return self.call(*given, out=out)
