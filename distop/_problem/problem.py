"""`Problem`: trace a model of jax.numpy and operators into checked, jitted entry points.

`Problem` is a facade: it checks arguments and runs the steps of each entry point,
whose work lives in modules of one concern each (see docs/architecture.md).
"""

import functools
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .._agreement import comm as _comm
from .._agreement.coordinator import Coordinator
from .._compiler.layout import Layout
from .._compiler.programs import Programs
from .._compiler.schedule import ScheduleEntry
from .._config import env_flag
from .._diagnostics import profile as _profile
from .._inference.transform import Inference
from .._totals import replicated as _replicated
from .._totals import totals as _totals
from .arguments import (
    MODES,
    cache_size,
    check_arguments,
    moved,
)
from .calls import Calls
from .construction import agree_on_distributed, check_kinds, first_schedule
from .entries import Entries, Names
from .execution import Executor
from .inputs import empty
from .locking import one_at_a_time

__all__ = ["MODES", "Problem", "empty"]




class Problem:
    """A model compiled into jitted programs whose collectives run in one order everywhere.

    Every rank makes the Problem and calls its methods in the same order: each call is
    collective.

    **Arguments:**
    - `model`: called as `model(**inputs)`; returns a dict of named outputs, computed
      with jax.numpy and operator calls.
    - `inputs`: dict of name -> array, the starting point.
    - `comm`: the MPI communicator the model runs on (default `MPI.COMM_WORLD`); distop
      uses a private duplicate for its own agreement and checks.
    - `distributed`: names of inputs and outputs that are distributed: each rank holds
      its own block along axis 0 (sizes may differ, and be zero). Everything else is
      replicated (the same on every rank).
    - `check_replicated`: if True, every `run` checks that replicated inputs and outputs
      are equal on all ranks and raises on every rank if not.
    - `backend`: how operators are called from the programs: `"lean"` (an XLA FFI call
      on the CPU, ordered by a token chain; programs where the chain cannot be proven
      fall back to `"io_callback"`) or `"io_callback"` (JAX's ordered `io_callback`,
      which also runs where JAX's default device is an accelerator). Default from
      `DISTOP_BACKEND`, else `"lean"` where JAX's default device is the CPU and
      `"io_callback"` elsewhere.
    - `fuse`: on the lean path, run neighbouring operator calls that one host call can
      run in ONE host call, in schedule order: the same calls, collectives and results,
      fewer dispatches (`schedule` shows the groups). Under MPI a fused group of
      derivative calls of communicating operators whose zero (co)tangent rows are found
      only when the program runs agrees on them with one collective of its own and skips
      them; unfused calls get every row. Default True, or `DISTOP_FUSE=0`.
    - `copy`: whether distop copies numpy array inputs, here and in `run` and
      `run_and_compute_totals`. True (default): it keeps its own copy of each, so
      changing the caller's array later changes nothing here. None: an array XLA can
      read in place (C-contiguous, in the machine's byte order, 64-byte aligned, as
      `distop.empty` makes them) is shared, not copied; the caller must then not change
      it while this Problem may read it. False: as None, but an array that needs a copy
      is a `ValueError`. JAX arrays are always shared, and numbers and lists always
      converted.

    **Returns:** the Problem. Its attributes: `schedule`, `input_names`, `output_names`,
    `distributed`, and the configuration it was made with, read-only: `model`,
    `backend`, `fuse`, `copy`.

    **Raises:** `TypeError` for a model that is not callable or inputs that are not a
    non-empty dict; `ValueError` for an unknown `backend`, `copy` or name in
    `distributed`; `TypeError` for a float64 input in JAX's 32-bit mode. An argument
    refused on some ranks raises its own `TypeError` or `ValueError` there, and a
    `DistopError` naming it on the others; ranks that call with different arguments get
    a `DistopError` on every rank. `ScheduleMismatchError` on every rank where the
    ranks' programs differ. `DistopError` on every rank where an input not named in
    `distributed` differs between ranks (beyond its last bits) at the initial point;
    `KindError` where an output varies between ranks by its inferred kind and is not
    named there.

    ```python
    import jax
    import jax.numpy as jnp
    import numpy as np

    import distop

    jax.config.update("jax_enable_x64", True)
    problem = distop.Problem(lambda x: {"f": jnp.sum(x ** 2)}, {"x": np.arange(3.0)})
    assert problem.run()["f"] == 5.0
    assert problem.compute_totals()["f", "x"].tolist() == [[0.0, 2.0, 4.0]]
    ```
    """

    def __init__(self, model: Callable[..., dict[str, Any]], inputs: dict[str, Any], *,
                 comm: Any = None, distributed: str | Iterable[str] = (),
                 check_replicated: bool = False, backend: str | None = None,
                 fuse: bool | None = None, copy: bool | None = True) -> None:
        self.comm = _comm.internal(comm)  # (distop's own messages: no method's)
        self._model = model
        self.distributed = frozenset([distributed] if isinstance(distributed, str)
                                     else distributed)
        self.check_replicated = check_replicated
        self._coordinator = Coordinator(self.comm, self.distributed)
        self._lock = threading.RLock()  # (see `_one_at_a_time`)
        fused = bool(env_flag("DISTOP_FUSE", True) if fuse is None else fuse)
        # arguments refused on some ranks raise on every rank; every agreement on this
        # communicator sends rows of one width, the most any rank's Problem sends,
        # whichever Problem the call is of (see `CallAgreement`)
        checked = self._coordinator.collective_step(
            "Problem: checking its arguments",
            lambda: (*check_arguments(model, inputs, backend or os.environ.get(
                "DISTOP_BACKEND") or None, copy, self.distributed), cache_size()))
        self._backend, self._copy, self._point, self._trees, size = checked
        # (a tree input declared distributed: each of its leaves)
        self.distributed = self._coordinator.distributed = frozenset(
            self._trees.names(self.distributed))
        agree_on_distributed(self._coordinator, self._point)
        _replicated.check_replicated_inputs(self.comm, self._coordinator.most, self.distributed,
                                        self._point)
        self._fuse = fused
        self.input_names = tuple(self._point)
        # (the model's kinds: where a replicated input meets varying data, its
        # cotangent is summed over the ranks; see `_inference`)
        inference = Inference(comm, self.distributed, compare_at_trace=False)
        self._programs = Programs(inference.wrap(self._trees.model(model)),
                                  self._coordinator, self.backend,
                                  self.fuse, size, inference.compare_constants)
        self._executor = Executor(self.comm)
        self._calls = Calls(self._coordinator, self._programs, self._executor)
        # (the options that shape the programs are part of the first request)
        layout = self._calls.agreed(self._point, ("Problem", f"backend={self.backend}",
                                                  f"fuse={self.fuse}", f"cache={size}"))
        self.output_names = tuple(layout.outputs)
        self._entries = Entries(self.comm, self.distributed, self._trees, self.input_names,
                                self.output_names, self._calls)
        unknown = self.distributed - set(self.input_names) - set(self.output_names)
        if unknown:
            raise ValueError(f"Problem(distributed={sorted(self.distributed)}): no input or "
                             f"output named {sorted(unknown)}; inputs are "
                             f"{list(self.input_names)}, outputs {list(self.output_names)}.")
        self._coordinator.collective_step(
            "Problem: checking the kinds of its values",
            lambda: check_kinds(inference, self.distributed))
        self._schedule: tuple[ScheduleEntry, ...] = first_schedule(
            self._programs, self._coordinator, layout)

    # -- configuration, fixed at construction ---------------------------------------
    @property
    def model(self) -> Callable[..., dict[str, Any]]:
        """The model function this Problem traces."""
        return self._model

    @property
    def backend(self) -> str:
        """How operators are called from the programs: `"lean"` or `"io_callback"`."""
        return self._backend

    @property
    def fuse(self) -> bool:
        """Whether neighbouring operator calls on the lean path run in one host call."""
        return self._fuse

    @property
    def copy(self) -> bool | None:
        """Whether distop copies numpy array inputs: True, None or False (see `Problem`)."""
        return self._copy

    # -- public entry points --------------------------------------------------------
    @property
    def schedule(self) -> tuple[ScheduleEntry, ...]:
        """The operator calls of the default `compute_totals` program, in program order.

        It lists the `run` program's calls where there is no `compute_totals` program:
        an operator has no `vjp`, or JAX cannot differentiate the model.
        Reading it never communicates, so any subset of ranks may do so.

        **Returns:** a tuple of `ScheduleEntry`.
        """
        return self._schedule

    def profile(self) -> _profile.Profile:
        """Record where each rank's time goes while the returned profile is active.

        Use it as `with problem.profile() as prof:`.
        Entering it is collective: one barrier, so that every rank's clock starts
        together.
        While it is active every host call records its method's time outside MPI calls
        (compute) and inside them (wait: for peers, and the transfer).
        Every program run records its wall time once finished; the rest is JAX's time
        between host calls.
        Then, collectively: `prof.report()` (a `Report`), `prof.print_report()` (its
        table, on rank 0), `prof.write_trace(path)` (Chrome trace-event JSON, for
        Perfetto) and `prof.plot(path)` (a PNG; needs `distop[plot]`).
        Off, profiling costs nothing.

        **Returns:** the `Profile` (not yet active).
        """
        return _profile.Profile(self.comm)

    @one_at_a_time
    def run(self, **inputs: Any) -> dict[str, np.ndarray]:
        """Evaluate the model at `inputs`; the other inputs keep their current values.

        **Arguments:**
        - `inputs`: name=array for the inputs to change (this rank's block for
          distributed inputs).

        **Returns:** dict of output name -> numpy array (this rank's block for
        distributed outputs). The arrays are read-only views of the program's results,
        like JAX's own arrays (`.copy()` one to change it). The evaluated point becomes
        the current point; distop keeps its own copy of numpy inputs unless
        `Problem(copy=...)` says otherwise.

        **Raises:** `ValueError` for an unknown input name; `TypeError` for an array
        whose dtype differs from a differentiable input's. An argument refused on some
        ranks raises its own `TypeError` or `ValueError` there, and a `DistopError`
        naming it on the others; ranks that call with different arguments get a
        `DistopError` on every rank. `DistopError` on every rank where
        `check_replicated` finds replicated values that differ.
        """
        point, refused = moved("run", inputs, self._point, self.copy, trees=self._trees)
        outs = self._entries.run(point, refused, self._point)
        if self.check_replicated:
            _replicated.check_replicated(self.comm, self.distributed, {**point, **outs}, "run")
        self._point = point
        return outs

    @one_at_a_time
    def compute_totals(self, of: Names = None, wrt: Names = None, *, mode: str = "batched",
                       return_format: str = "global",
                       direction: str = "rev") -> dict[tuple[str, str], np.ndarray]:
        """Total derivatives of outputs with respect to inputs, at the current point.

        **Arguments:**
        - `of`: output name(s); None means every floating-point output.
        - `wrt`: input name(s); None means every floating-point input.
        - `mode`: `"batched"` (every seed in one vmapped reverse sweep: one callback per
          operator), `"loop"` (one sweep per seed inside a `lax.scan`) or `"unrolled"`
          (one independent sweep per seed, unrolled in the program).
        - `return_format`: `"global"` (every rank gets the whole Jacobian of the global
          vectors) or `"local"` (no gathering: this rank's rows of distributed `of`, all
          rows of replicated `of`; this rank's columns of distributed `wrt`).
        - `direction`: `"rev"` (reverse sweeps, one per global entry of `of`), `"fwd"`
          (forward sweeps, one per global entry of `wrt`: every operator on the path
          needs a `jvp`) or `"auto"` (the direction with fewer sweeps; reverse on a
          tie). Every rank runs every sweep, as in reverse.

        **Returns:** dict of `(of, wrt)` -> numpy array of shape (of size, wrt size),
        identical on every rank for the global format. The arrays are views of the
        program's result, read-only like `run`'s values where no gathering copied them
        (`.copy()` one to change it). For a complex output, in JAX's convention: the
        derivatives of its real part, along a complex input z = x + iy as d/dx - i d/dy
        (a holomorphic function's complex derivative); take `jnp.real` and `jnp.imag` of
        it as two outputs for both parts.

        **Raises:** `ValueError` for an unknown name in `of` or `wrt`, or an unknown
        `mode`, `return_format` or `direction`. An argument refused on some ranks raises
        its own error there, and a `DistopError` naming it on the others; ranks that
        call with different arguments get a `DistopError` on every rank. A
        `DistopError` on every rank where the derivatives with respect to a replicated
        input differ between ranks (it is used in rank-dependent computation without
        `RankLocal`). `MissingMethodError` naming an operator without the `vjp` (or,
        forward, the `jvp`) the sweeps need. `SecondDerivativeError` where the model
        itself differentiates through an operator.
        """
        return self._compute_totals(of, wrt, mode=mode, return_format=return_format,
                            direction=direction)

    def _compute_totals(self, of: Names, wrt: Names, *, mode: str = "batched",
                        return_format: str = "global", direction: str = "rev",
                        check_ranks: bool = True) -> dict[tuple[str, str], np.ndarray]:
        """`compute_totals`; `check_ranks=False` leaves out the check that the blocks of
        replicated inputs are the same on every rank (`check_totals` reports ranks that
        differ in its own way)."""
        return self._entries.totals(self._point, of, wrt, mode, return_format, direction,
                                    check_ranks)

    @one_at_a_time
    def compute_hvp(self, of: str, wrt: Names, tangent: dict[str, Any],
                    ) -> dict[str, np.ndarray]:
        """Hessian-vector products of a scalar output, at the current point.

        The derivative of the gradient of `of` with respect to the inputs `wrt`, along
        `tangent`: H t, H being the Hessian of `of` with respect to `wrt` together. Every
        operator on the path needs `vjp`, `jvp` and (unless linear) `hvp`. With K
        directions, all of them run in one program: one call of each operator method,
        one collective each, for all K.

        **Arguments:**
        - `of`: the name of a scalar floating-point output.
        - `wrt`: an input name or several.
        - `tangent`: dict of `wrt` name -> array shaped like the input (this rank's
          block for a distributed input), or with a leading axis of K directions, the
          same K for every name.

        **Returns:** dict of `wrt` name -> numpy array shaped like its tangent: this
        rank's block for a distributed input, the whole product (the same on every
        rank) for a replicated one. The arrays are read-only views of the program's
        results.

        **Raises:** `ValueError` for an unknown name, an output that is not a scalar, or
        tangents of the wrong shapes; `TypeError` for tangents of the wrong dtype. An
        argument refused on some ranks raises its own error there, and a `DistopError`
        naming it on the others. `MissingMethodError` naming an operator without the
        `jvp` the products need, `SecondDerivativeError` one without `hvp`. A
        `DistopError` on every rank where the products for a replicated input differ
        between ranks.
        """
        return self._entries.hvp(self._point, of, wrt, tangent)

    @one_at_a_time
    def run_and_compute_totals(
            self, of: Names = None, wrt: Names = None, *, inputs: dict[str, Any] | None = None,
            mode: str = "batched", return_format: str = "global", direction: str = "rev",
    ) -> tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray]]:
        """`run` and then `compute_totals`, in one program.

        It gives the values and the total derivatives at one point, with one dispatch
        and one agreement across ranks where the two calls make two.
        Each forward call is made once: the values and the reverse sweep share it.

        **Arguments:**
        - `of`, `wrt`, `mode`, `return_format`, `direction`: as for `compute_totals`.
        - `inputs`: dict of name -> array, the inputs to change first, as for
          `run(**inputs)`; None: the current point.

        **Returns:** `(values, totals)`: what `run` and `compute_totals` return, the
        totals to round-off (XLA compiles the reverse sweep beside the values, and may
        order its arithmetic otherwise). The evaluated point becomes the current point.

        **Raises:** what `run` and `compute_totals` raise.
        """
        point, refused = moved("run_and_compute_totals", {} if inputs is None else inputs,
                               self._point, self.copy, keywords=False, trees=self._trees)
        values, totals = self._entries.run_and_totals(point, refused, self._point, of, wrt,
                                                      mode, return_format, direction)
        if self.check_replicated:
            _replicated.check_replicated(self.comm, self.distributed, {**point, **values},
                                     "run_and_compute_totals")
        self._point = point
        return values, totals

    @one_at_a_time
    def check_totals(self, of: Names = None, wrt: Names = None, *, method: str = "fd",
                     form: str = "central", step: float | None = None, atol: float = 1e-8,
                     rtol: float = 1e-6, out_stream: Any = _totals.STDOUT,
                     raise_on_error: bool = False, show_only_incorrect: bool = False,
                     progress: bool = True,
                     ) -> dict[tuple[str, str], _totals.TotalsCheck]:
        """Compare `compute_totals` with finite differences, on every rank.

        A block fails where |J - J_fd| > atol + rtol * |J_fd| + e_fd at some entry, e_fd
        being the error J_fd carries itself (its rounding and truncation, estimated from
        evaluations at the step and twice the step), or where ranks disagree on J. An
        entry within that only by e_fd, where e_fd is more than 5% of the block's largest
        entry, cannot be judged and fails (a note names a step that would do).
        Perturbations run as one batched program call.
        It first checks that replicated inputs and outputs agree across ranks.

        **Arguments:**
        - `of`, `wrt`: as for `compute_totals`.
        - `method`: `"fd"` (finite differences) or `"cs"` (complex step: the imaginary
          part of f(x + i h) / h, free of rounding in the difference; real inputs and
          outputs, and every operator given complex values declares `complex_step`).
        - `form`: `"central"`, `"forward"` or `"backward"` (finite differences).
        - `step`: the step; by default 1e-6 for float64 values, 1e-3 for float32 and
          3e-2 for 16-bit ones (the least precise input or output checked), and 1e-6
          for the complex step.
        - `atol`, `rtol`: the tolerances.
        - `out_stream`: where rank 0 prints the table: by default `sys.stdout` as it is
          at the call (redirected or captured, say); None prints nothing.
        - `raise_on_error`: raise `DerivativeCheckError` on every rank if a block fails.
        - `show_only_incorrect`: print only failing blocks.
        - `progress`: where the check runs longer than a few seconds, show its progress
          on rank 0's `out_stream` (a bar on a terminal, else a line every few
          seconds); False shows none.

        **Returns:** dict of `(of, wrt)` -> `TotalsCheck` with `J`, `J_fd`, `abs_error`,
        `rel_error`, `ok`, `inconsistent_ranks`, `worst`, `allowed` and `fd_error`.

        **Raises:** `DerivativeCheckError` on every rank if `raise_on_error` and a block
        fails; `ValueError` for another `method` or `form`, or a bad `step`, `atol` or
        `rtol`; `DistopError` on every rank where replicated values differ between
        ranks; what `compute_totals` raises.
        """
        # the arguments are checked once the ranks agree on them: an error on every rank
        point = self._point

        def evaluations(layout: Layout, perturbed: Callable[..., Any]) -> Any:
            return _totals.Evaluations(
                self.comm, self.distributed, layout, point, self.run,
                functools.partial(self._compute_totals, check_ranks=False), perturbed)

        return self._entries.check_totals(point, of, wrt, method, form, step, atol, rtol,
                                          evaluations, dict(
                                              out_stream=out_stream,
                                              raise_on_error=raise_on_error,
                                              show_only_incorrect=show_only_incorrect,
                                              progress=progress))

    @one_at_a_time
    def check_hvp(self, of: str, wrt: Names = None, *, directions: int = 2, seed: int = 0,
                  step: float | None = None, atol: float = 1e-8, rtol: float = 1e-6,
                  out_stream: Any = _totals.STDOUT, raise_on_error: bool = False,
                  show_only_incorrect: bool = False, progress: bool = True,
                  ) -> dict[tuple[str, str], _totals.TotalsCheck]:
        """Compare `compute_hvp` with central differences of `compute_totals`.

        Along `directions` random directions t (the same global ones on every rank),
        H t from `compute_hvp` is compared entry by entry with (g(x + h t) - g(x - h t))
        / 2h, g the gradient of `of` from `compute_totals` (and again at 2h, for the
        error the difference carries), as `check_totals` judges its blocks. The current
        point stays as it was.

        **Arguments:**
        - `of`: the name of a scalar floating-point output.
        - `wrt`: input name(s); None means every floating-point input.
        - `directions`: how many random directions (the rows of each block).
        - `seed`: seeds the directions.
        - `step`, `atol`, `rtol`, `out_stream`, `raise_on_error`,
          `show_only_incorrect`, `progress`: as for `check_totals`.

        **Returns:** dict of `(of, wrt)` -> `TotalsCheck`, whose `J` holds H t (one row
        per direction, the whole global vector) and `J_fd` its estimate.

        **Raises:** `DerivativeCheckError` on every rank if `raise_on_error` and a block
        fails; what `compute_hvp` and `compute_totals` raise.
        """
        def gradient_at(out: str, wrt: tuple[str, ...],
                        moved: dict[str, Any]) -> dict[str, np.ndarray]:
            found = self.run_and_compute_totals([out], wrt, inputs=moved)[1]
            return {w: found[out, w][0] for w in wrt}

        return self._entries.check_hvp(
            self._point, of, wrt, directions, seed, step, atol, rtol, gradient_at,
            self.compute_hvp, lambda inputs: self.run(**inputs), dict(
                out_stream=out_stream, raise_on_error=raise_on_error,
                show_only_incorrect=show_only_incorrect, progress=progress))
