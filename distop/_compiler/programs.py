"""Programs: the model traced, checked, rewritten and jitted, one per entry point and
layout, built once on every rank alike."""

import contextlib
import dataclasses
import gc
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, JaxprEqn, jaxpr_as_fun

from .._agreement import comm as _comm
from .._agreement.coordinator import Coordinator, stable_hash
from .._compat import x64_enabled
from .._config import settings
from .._errors import DistopError
from .._hostcalls import ffi as _ffi
from .._hostcalls import sessions as _sessions
from .._hostcalls.base import Gate
from .._hostcalls.host import HostCall
from .._safety import checking as _checking
from .._safety import watchdog as _watchdog
from . import pipeline
from . import schedule as _schedule
from .jaxprs import anywhere, chained, lean_calls
from .layout import Layout, TracingInputs, seeds, tangent_seeds, unit_seeds
from .packing import pack, unpack_plan
from .schedule import ScheduleEntry
from .stages import nested
from .tracing import Options, TotalsOptions, build


class Traced(NamedTuple):
    """An entry point's program as `Programs.trace` makes it.

    Fields: `fn` (the jitted function), `outputs` (name -> (shape, dtype) of its results
    before packing), `closed` (the program before segments: its schedule), `host_calls`
    (the lean calls as traced, in chain order, or None: see `_schedule.extract`).
    """

    fn: Callable[..., Any]
    outputs: pipeline.Outputs
    closed: ClosedJaxpr
    host_calls: tuple[HostCall, ...] | None


@dataclasses.dataclass
class Program:
    """A compiled entry point: the jitted function, its schedule, and the fixed
    arguments after the point (built on first use: they may be large)."""

    fn: Callable[..., Any]
    schedule: tuple[ScheduleEntry, ...]
    outputs: pipeline.Outputs  # of the program's results, before packing
    make_extra: Callable[[], tuple[Any, ...]] = tuple
    checker: _checking.Checker | None = None
    # lean host calls per run, each adding one to the token; None where the values
    # decide (a while loop, branches making different numbers of calls)
    n_calls: int | None = 0
    # where its first host call may make the agreement of the call (see `CallAgreement`):
    # what its host calls share while it runs; else None
    gate: Gate | None = None
    entry: str = ""  # its entry point: `run`, `compute_totals` ... (for profiles)
    # the return formats in which its totals were found the same on every rank (see
    # `_assembly.check_replicated_totals`): the check runs on a program's first call per format only
    totals_checked: set[str] = dataclasses.field(default_factory=set)
    _extra: tuple[Any, ...] | None = None
    _plan: tuple[Any, ...] | None = None

    @property
    def makes_agreement(self) -> bool:
        """Whether its first host call may make the agreement of the call."""
        return self.gate is not None

    @property
    def plan(self) -> tuple[Any, ...]:
        """How the results unpack (see `unpack_plan`), made once."""
        if self._plan is None:
            self._plan = unpack_plan(self.outputs)
        return self._plan

    @property
    def extra(self) -> tuple[Any, ...]:
        """The arguments after the point, on the device, made once."""
        if self._extra is None:
            self._extra = jax.device_put(self.make_extra())
        return self._extra



class Programs:
    """The programs of one Problem, built on first use and kept.

    **Arguments:**
    - `model`: the Problem's model.
    - `coordinator`: the `Coordinator` of its ranks.
    - `backend`, `fuse`: the Problem's options of the same names.
    - `size`: how many layouts (shapes of the inputs) it keeps, with their programs;
      past that the least recently used goes, on every rank alike (every rank makes
      the same calls in the same order).
    - `after_trace`: called on every rank after the model is traced for a new layout,
      with the coordinator's elementwise max over ranks (the model's kinds compare the
      constants it closes over there: see `_inference`).
    """

    def __init__(self, model: Callable[..., Any], coordinator: Coordinator, backend: str,
                 fuse: bool, size: int,
                 after_trace: Callable[[Callable[[np.ndarray], np.ndarray]], None] = (
                     lambda most: None)) -> None:
        self.model = model
        self.after_trace = after_trace
        self.coordinator = coordinator
        self.comm = coordinator.comm
        self.distributed = coordinator.distributed
        self.backend, self.fuse, self.size = backend, fuse, size
        self.x64 = x64_enabled()  # the precision its programs are traced in
        # (shapes, block sizes) -> Layout, least recently used first
        self.layouts: dict[tuple[Any, ...], Layout] = {}
        # (entry point, options, id(layout)) -> Program
        self.programs: dict[tuple[str, Options, int], Program] = {}
        # (inputs, traced run program) of the newest layout
        self._traced_run: tuple[dict[str, jax.ShapeDtypeStruct], Traced] | None = None
        self._warned_loop = False

    def layout(self, point: dict[str, Any], local: tuple, counts: tuple,
               guessed: bool = False) -> Layout:
        """The `Layout` of `point` for the block sizes the ranks agreed on (traced once
        per new shapes, on every rank).

        **Arguments:**
        - `point`: the inputs of the call.
        - `local`: (name, shape, dtype) of every input of the point.
        - `counts`: every rank's block sizes per distributed input, in point order
          (`Coordinator.request`).
        - `guessed`: the sizes are those of last time, their agreement still pending:
          the layout was made before (nothing may communicate before the agreement is
          made, so it is never built here).
        """
        key = (local, counts)
        layout = self.layouts.pop(key) if guessed else self.layouts.pop(key, None)
        if layout is None:
            dist_inputs = [k for k in point if k in self.distributed]
            with collector_paused():
                layout = self._new_layout(point, dict(zip(dist_inputs, counts)))
            while len(self.layouts) >= self.size:
                self._evict(next(iter(self.layouts)))
        self.layouts[key] = layout  # (the most recently used, last)
        return layout

    def _evict(self, key: tuple[Any, ...]) -> None:
        """Forget the layout of `key`, its programs, and the agreements made for it."""
        gone = id(self.layouts.pop(key))
        for found in [k for k in self.programs if k[2] == gone]:
            del self.programs[found]
        self.coordinator.forget(key[0])

    def _exchange(self, what: str, thunk: Callable[[], Any],
                  share: Callable[[Any], tuple[Any, ...] | None],
                  steps: Sequence[Any]) -> tuple[Any, list[Any] | None]:
        """The passes' cross-rank step (see pipeline.py): `thunk()` and this rank's
        proposals `share(thunk())` made alike on every rank (`Coordinator.collective_step`: raised
        on every rank where one raised), then every rank's proposals decided by
        reductions of a fixed size (`pipeline.decided`)."""
        def made() -> tuple[Any, tuple[Any, ...] | None]:
            result = thunk()
            return result, share(result)

        result, mine = self.coordinator.collective_step(what, made)
        return result, pipeline.decided(steps, mine, self.coordinator.most)

    def _new_layout(self, point: dict[str, Any], counts: dict[str, tuple[int, ...]]) -> Layout:
        """The `Layout` of a point with new shapes (traces the model, on every rank)."""
        inputs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in point.items()}
        # The run program, traced now: its outputs are the layout's (one trace of the
        # model serves both), and `_program` takes it over once the layout exists.
        run = self.trace("run", (), TracingInputs(inputs), (), True)
        self.after_trace(self.coordinator.most)
        outputs = {k: jax.ShapeDtypeStruct(*run.outputs[k]) for k in sorted(run.outputs)}
        self._traced_run = (inputs, run)
        if self.comm.Get_size() == 1:
            counts.update({k: (s.shape[0],) for k, s in outputs.items()
                           if k in self.distributed and s.ndim})
            counts.update({k: (point[k].shape[0],) for k in point if k in self.distributed})
            return Layout(inputs, outputs, counts)
        mine = {k: (s.shape, str(s.dtype)) for k, s in outputs.items()}
        # Every rank's shapes are gathered only where they differ otherwise than in the
        # axis 0 of distributed outputs, to name them; else the ranks send the hash of
        # what must agree, and the axis 0 of their distributed outputs.
        fixed = stable_hash(sorted((k, (s[0][1:], s[1], len(s[0])) if k in self.distributed
                                    else s) for k, s in mine.items()))
        top = self.coordinator.most(np.array([fixed, -fixed], np.int64),
                                    "Problem: agreeing on the outputs' shapes")
        shared = sorted(k for k, s in outputs.items() if k in self.distributed and s.ndim)
        if top[0] != -top[1] or len(shared) < sum(k in self.distributed for k in outputs):
            shapes = self.comm.allgather(mine)
        else:  # (all alike but axis 0: every rank's, of the distributed outputs)
            heads = np.empty((self.comm.Get_size(), len(shared)), np.int64)
            self.comm.Allgather(np.array([outputs[k].shape[0] for k in shared], np.int64),
                                heads)
            shapes = [{k: (((int(row[shared.index(k)]),) + mine[k][0][1:]) if k in shared
                           else mine[k][0], mine[k][1]) for k in mine} for row in heads]
        for name, spec in outputs.items():
            seen = [s[name] for s in shapes]
            if name in self.distributed:
                if spec.ndim == 0 or len({(s[0][1:], s[1]) for s in seen}) > 1:
                    raise DistopError(f"distributed output {name!r}: local shapes "
                                      f"{[s[0] for s in seen]} on ranks 0..; a distributed "
                                      "value needs axis 0 and the same other axes and "
                                      "dtype everywhere.")
                counts[name] = tuple(s[0][0] for s in seen)
            elif len(set(seen)) > 1:
                raise DistopError(f"output {name!r} has shapes {[s[0] for s in seen]} on ranks "
                                  f"0..{len(seen) - 1}: a replicated output must be the same "
                                  "everywhere. Declare it in Problem(distributed=...) if each "
                                  "rank holds a block of it.")
        return Layout(inputs, outputs, counts)

    def built(self, name: str, options: Options, layout: Layout) -> Program | None:
        """**Returns:** the program of an entry point for `layout`, if it is built."""
        return self.programs.get((name, options, id(layout)))

    def program(self, name: str, options: Options, layout: Layout,
                make_extra: Callable[[], tuple[Any, ...]] = tuple,
                caller: str | None = None) -> Program:
        """The jitted program of an entry point for `layout`, traced, checked and agreed
        by every rank the first time it is needed (building one communicates: a pending
        agreement of the call is made first, see `_problem/calls.py`).

        **Arguments:**
        - `name`, `options`: the entry point and what selects its program.
        - `layout`: the `Layout` of the point.
        - `make_extra`: builds the arguments after the point (default none; the seeds
          for `compute_totals`).
        - `caller`: what the user called, for messages, where not the entry point
          (`Problem(...)`, which builds a program for its schedule).
        """
        key = (name, options, id(layout))
        found = self.programs.get(key)
        if found is None:
            with collector_paused():
                found = self._new_program(key, name, options, layout, make_extra,
                                          caller or name)
        return found

    def _new_program(self, key: tuple[str, Options, int], name: str, options: Options,
                     layout: Layout, make_extra: Callable[[], tuple[Any, ...]],
                     caller: str) -> Program:
        """Trace, rewrite and agree on a program not built before (see `program`;
        `caller` names it in messages)."""
        extra_maker, specs = self._arguments_after(options, layout, make_extra)
        pending = self._traced_run if name == "run" else None
        try:
            if pending is not None and pending[0] is layout.inputs:
                self._traced_run = None
                fn, outputs, jaxpr, traced = pending[1]
            else:
                fn, outputs, jaxpr, traced = self.trace(name, options, layout, specs,
                                                         True)
        except NotImplementedError as err:
            if "not supported in vmap" not in str(err):
                raise
            # jax refuses to vmap ordered callbacks inside lax.cond: run the seeds or
            # perturbations one after another instead, in a loop.
            if not self._warned_loop:
                self._warned_loop = True
                entry = ("run_and_compute_totals" if isinstance(options, TotalsOptions)
                         and options.with_values else name)
                warnings.warn(f"{entry}: the model has an operator inside lax.cond (or "
                              "another construct jax cannot vmap with ordered "
                              "callbacks), so seeds and finite-difference perturbations "
                              "run in a loop, one per iteration, instead of one batch.",
                              stacklevel=3)
            fn, outputs, jaxpr, traced = self.trace(name, options, layout, specs,
                                                     False)
        with _watchdog.watchdog.watch(f"Problem: agreeing on the {name} schedule"):
            schedule = _schedule.check_schedules(self.comm, caller,
                                       _schedule.extract(jaxpr, traced))
        checker = (_comm.checker(self.comm) if settings.check_collectives
                   and self.comm.Get_size() > 1 else None)
        host_calls = nested.host_calls(jaxpr.jaxpr)
        gate = (Gate() if checker is None and may_make_agreement(jaxpr, host_calls)
                else None)
        for call in host_calls:
            call.gate = gate
        found = self.programs[key] = Program(fn, schedule, outputs, extra_maker, checker,
                                              nested.count(jaxpr.jaxpr), gate,
                                              _entry_name(name, options))
        # the lean call sites live as long as the program
        weakref.finalize(found, _ffi.release, host_calls)
        return found

    def _arguments_after(self, options: Options, layout: Layout,
                         make_extra: Callable[[], tuple[Any, ...]]
                         ) -> tuple[Callable[[], tuple[Any, ...]], Any]:
        """The arguments a program takes after the point, and their specs.

        **Arguments:**
        - `options`: what selects the program; `compute_totals` takes its seeds there.
        - `layout`: the `Layout` of the point.
        - `make_extra`: builds the arguments of any other entry point.

        **Returns:** (what builds the arguments, their `ShapeDtypeStruct`s).
        """
        if not isinstance(options, TotalsOptions):
            return make_extra, jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), make_extra())
        rank = self.comm.Get_rank()

        def totals_seeds() -> tuple[Any, ...]:
            if options.direction == "fwd":
                return tangent_seeds(options.wrt, layout, rank)
            return seeds(options.of, layout, rank)
        specs = (tangent_seeds(options.wrt, layout, rank, specs_only=True)
                 if options.direction == "fwd"
                 else seeds(options.of, layout, rank, specs_only=True))
        return totals_seeds, specs

    def trace(self, name: str, options: Options, layout: Layout | TracingInputs, specs: Any,
              vectorize: bool) -> Traced:
        """Trace an entry point's program, on the lean path if the backend says so and
        the program allows it on every rank (its lean calls form one token chain), else
        with ordered `io_callback`s. The lean program is rewritten alike on every rank
        (see `_compiler.pipeline`).

        **Returns:** (function, outputs, the program before segments: its schedule, the
        lean calls as traced in chain order or None: see `_schedule.extract`)."""
        if self.backend == "lean":
            try:
                found = self._trace_with(name, options, layout, specs, vectorize, True)
            except Exception:  # noqa: BLE001 - same on every rank; io_callback decides
                # Typically the model moved the token into a loop, a branch or its own
                # transformation (UnexpectedTracerError). Any genuine error of the model
                # comes back from the io_callback trace below.
                found = None
            units: tuple[int, ...] = ()
            if isinstance(options, TotalsOptions) and options.direction == "rev":
                assert isinstance(layout, Layout)  # (only `run` is traced before its layout)
                units = unit_seeds(options.of, layout, self.distributed, self.comm.Get_size())
            lean = pipeline.lean_program(name, found, exchange=self._exchange,
                                         unit_seeds=units, fuse=self.fuse,
                                         inputs=layout.inputs, specs=specs)
            if lean is not None:
                assert found is not None  # (a lean program is made of what was traced)
                if nested.nested(found.closed.jaxpr):  # (compiled as traced: all made)
                    return Traced(*lean, None)
                host_calls = lean_calls(found.closed.jaxpr)
                traced = tuple(c for c in host_calls if isinstance(c, HostCall))
                assert len(traced) == len(host_calls)  # (as traced: none fused or rolled)
                return Traced(*lean, traced)
        return Traced(*self._trace_with(name, options, layout, specs, vectorize, False), None)

    def _trace_with(self, name: str, options: Options, layout: Layout | TracingInputs,
                    specs: Any, vectorize: bool, lean: bool) -> pipeline.Found:
        body = build(self.model, name, options, layout, vectorize)
        outputs: pipeline.Outputs = {}

        def packed(token: Any, *args: Any) -> tuple[Any, ...]:
            if lean:
                with _sessions.tracing(token) as session:
                    values = body(*args)
                token = session.token
            else:
                values = body(*args)
            outputs.update({k: (v.shape, v.dtype) for k, v in values.items()})
            return pack(values) + (token,)

        fn = jax.jit(packed)
        token = jax.ShapeDtypeStruct((), _ffi.token_dtype())

        def traced() -> tuple[ClosedJaxpr, bool]:
            """**Returns:** (the program, whether it is `fn`'s own)."""
            closed = fn.trace(token, layout.inputs, *specs).jaxpr
            if not lean:
                return _schedule.refuse_checkpoint(closed), True
            if chained(closed):
                return closed, True
            # calls inside the model's own loops and branches, or jvp calls (forward
            # mode), which read the token but do not move it on: the token threaded
            return nested.threaded(closed), False

        closed, own = self.coordinator.collective_step(f"{name}: tracing the program", traced)
        if not own:
            fn = pipeline.function(jaxpr_as_fun(closed))
        return pipeline.Found(fn, outputs, closed)



@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a program is traced: tracing makes
    hundreds of thousands of objects, and the collector would walk every live one again
    and again. What is garbage is collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


BLOCKS_AGREEMENT = ("while", "pure_callback", "ffi_call")  # (see `Program.makes_agreement`)


def may_make_agreement(jaxpr: ClosedJaxpr, host_calls: Sequence[Any]) -> bool:
    """Whether a program's first host call may make the agreement (see `CallAgreement`).

    It may where nothing else in the program runs host code (a callback or FFI call of
    the model's own, which could communicate before it, or a call of an operator set to
    ordered=False, which XLA may run before it) and the program ends whatever its calls
    return (no loop or branch of the model's own, whose condition could read the zeros
    of calls that did not run).

    **Arguments:**
    - `jaxpr`: the program.
    - `host_calls`: its lean host calls.

    **Returns:** whether it may.
    """
    return bool(host_calls) and not jaxpr.jaxpr.effects \
        and not anywhere(jaxpr.jaxpr.eqns, blocks_agreement) \
        and not nested.nested(jaxpr.jaxpr)


def blocks_agreement(eqn: JaxprEqn) -> bool:
    """Whether `eqn` keeps its program from making the agreement in its first host call
    (see `may_make_agreement`)."""
    return eqn.primitive.name in BLOCKS_AGREEMENT or (
        eqn.primitive.name == "distop_host_call" and not eqn.params["call"].lean)


def _entry_name(name: str, options: Options) -> str:
    """**Returns:** the entry point a program serves, as users call it."""
    if isinstance(options, TotalsOptions) and options.with_values:
        return "run_and_compute_totals"
    return name
