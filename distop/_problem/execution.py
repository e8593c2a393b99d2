"""Running a program: the token, the count of host calls, errors, and the results."""

import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._compat import JaxRuntimeError
from .._compiler.packing import unpack
from .._compiler.programs import Program
from .._diagnostics import profile as _profile
from .._errors import DistopError
from .._hostcalls import ffi as _ffi
from .._hostcalls.failure import take_error
from .._safety import watchdog as _watchdog
from .inputs import DeviceCache

# One program at a time in this process: the error a host call leaves is the process's,
# not a Problem's (XLA reports it without saying which program it came from).
_RUNNING = threading.RLock()


class Executor:
    """Runs one Problem's programs, one at a time, on its token chain.

    **Arguments:**
    - `comm`: the Problem's communicator (its rank names it in messages).
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.token = jnp.zeros((), _ffi.token_dtype())
        self.token_value = 0.0  # the token's value: lean host calls run so far
        self.on_device = DeviceCache()

    def __call__(self, program: Program, point: dict,
                 extra: tuple[Any, ...] | None = None) -> dict:
        """Run `program` at `point`; `extra`: the arguments after the point, where they
        change from call to call (default: the program's own, made once).

        **Returns:** its results, unpacked (name -> read-only numpy view).

        **Raises:** the error of a host call as the method raised it.
        """
        with _RUNNING:
            try:
                return self._run(program, point, extra)
            except (JaxRuntimeError, ValueError) as err:
                # A host call's error: JAX raises ValueError where its C++ dispatch runs
                # the program (as of jax 0.10.2), else JaxRuntimeError; with its text.
                cause = take_error()
                if isinstance(err, ValueError) and str(cause) not in str(err):
                    cause = None  # a ValueError of its own
                if cause is not None:
                    # (JAX's error hidden; the method's own traceback kept as the cause)
                    raise cause from cause.__cause__
                raise

    def _run(self, program: Program, point: dict, extra: tuple[Any, ...] | None) -> dict:
        """`__call__` without the translation of host calls' errors."""
        profile = _profile.active
        if profile is not None:
            profile.program_started(program.entry)
        gate = program.gate
        try:
            *packed, token = program.fn(self.token, self.on_device(point),
                                        *(program.extra if extra is None else extra))
            if gate is not None and gate.pending is not None:
                # Not made yet: with JAX's async dispatch the program may still run
                # on an XLA thread, and its first host call must find the agreement.
                token.block_until_ready()
        finally:
            if gate is not None:
                gate.pending = None
        values = unpack(packed, program.plan)
        # Kept only once the program has ended well: with JAX's async dispatch a host
        # call's error arrives here, in the token too, and every later program would
        # fail with it. (float() of a JAX array costs more than through numpy.)
        count = float(np.asarray(token))
        if profile is not None:  # (the program has finished: its token is read)
            profile.program_ended(program.entry)
        self.token = token
        if program.n_calls != 0:
            self._count(program, count)
        if program.checker is not None:
            # A rank whose program skipped a collective (rank-dependent control flow)
            # meets the others' next collective here, and every rank raises.
            with _watchdog.watchdog.watch("Problem: end of program"):
                program.checker.check_same(("end of program",))
        return values

    def _count(self, program: Program, count: float) -> None:
        """Check that the token grew by the program's number of host calls, where it is
        known before the run."""
        before, self.token_value = self.token_value, count
        made = self.token_value - before
        if program.n_calls is not None and made != program.n_calls:
            raise DistopError(
                f"rank {self.comm.Get_rank()}: the program made "
                f"{made} host calls instead of {program.n_calls}; "
                "please report this as a bug of distop, with your jax version. "
                "Problem(..., backend='io_callback') avoids the lean path.")
        if self.token_value >= _ffi.TOKEN_RESTART:
            self.token, self.token_value = jnp.zeros((), self.token.dtype), 0
