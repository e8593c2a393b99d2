"""`Problem`: trace a model of jax.numpy and operators into checked, jitted entry points."""

import contextlib
import dataclasses
import gc
import hashlib
import itertools
import math
import operator
import os
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _comm, _ffi, _safety, _schedule, _totals
from ._calls.host import inexact_dtype, take_error
from ._compat import JaxRuntimeError, x64_enabled
from ._errors import DistopError, MissingMethodError, SecondDerivativeError
from ._passes import pipeline
from ._passes.jaxprs import lean_calls

MODES = ("batched", "loop", "unrolled")
BACKENDS = ("lean", "io_callback")
FORMATS = ("global", "local")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the values of one point live: local specs and, for distributed names, the
    axis-0 size on every rank (the same on every rank)."""

    inputs: dict
    outputs: dict
    counts: dict  # name -> tuple of axis-0 sizes, one per rank (distributed names only)

    def spec(self, name):
        """**Returns:** the local `jax.ShapeDtypeStruct` of input or output `name`."""
        return self.inputs[name] if name in self.inputs else self.outputs[name]

    def __post_init__(self):
        sizes = {}  # computed once: every compute_totals reads them
        for name, spec in {**self.inputs, **self.outputs}.items():
            tail = math.prod(spec.shape[1:]) if spec.shape else 1
            sizes[name] = (sum(self.counts[name]) * tail if name in self.counts
                           else math.prod(spec.shape))
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_offsets", {})
        object.__setattr__(self, "differentiable", {
            which: tuple(k for k, s in specs.items() if inexact_dtype(s.dtype))
            for which, specs in (("inputs", self.inputs), ("outputs", self.outputs))})

    def global_size(self, name):
        """**Returns:** the flat size of `name` over all ranks (its own if replicated)."""
        return self._sizes[name]

    def offsets(self, names):
        """**Returns:** where each of `names` (a tuple) starts in their global flat
        vectors side by side, and their total size (cached: every compute_totals reads
        them)."""
        found = self._offsets.get(names)
        if found is None:
            found = self._offsets[names] = tuple(
                itertools.accumulate((self._sizes[n] for n in names), initial=0))
        return found

    def local_rows(self, name, rank):
        """**Returns:** (start, stop) of this rank's flat entries within `name`'s global
        flat vector (all of it if replicated)."""
        if name not in self.counts:
            return 0, self.global_size(name)
        spec = self.spec(name)
        tail = math.prod(spec.shape[1:])
        start = sum(self.counts[name][:rank]) * tail
        return start, start + self.counts[name][rank] * tail


@dataclasses.dataclass
class Program:
    """A compiled entry point: the jitted function, its schedule, and the fixed
    arguments after the point (built on first use: they may be large)."""

    fn: object
    schedule: tuple
    outputs: dict  # name -> (shape, dtype) of the program's results, before packing
    make_extra: object = tuple
    checker: object = None
    calls: int = 0  # lean host calls per run: each adds one to the token
    ahead: bool = False  # whether its first host call may make the ranks' agreement
    _extra: tuple | None = None
    _plan: tuple | None = None

    @property
    def plan(self):
        if self._plan is None:
            self._plan = _unpack_plan(self.outputs)
        return self._plan

    @property
    def extra(self):
        if self._extra is None:
            self._extra = jax.device_put(self.make_extra())
        return self._extra


class Problem:
    """A model compiled into jitted programs whose collectives run in one order everywhere.

    **Arguments:**
    - `model`: called as `model(**inputs)`; returns a dict of named outputs, computed
      with jax.numpy and `DistributedOperator` calls.
    - `inputs`: dict of name -> array, the starting point.
    - `comm`: the MPI communicator the model runs on (default `MPI.COMM_WORLD`); distop
      uses a private duplicate for its own agreement and checks.
    - `distributed`: names of inputs and outputs that are distributed: each rank holds
      its own block along axis 0 (sizes may differ, and be zero). Everything else is
      replicated (the same on every rank).
    - `check_replicated`: if True, every `run` checks that replicated inputs and outputs
      are equal on all ranks and raises on every rank if not.
    - `backend`: how communicating operators are called from the programs: `"lean"`
      (default; an XLA FFI call ordered by a token chain, see docs/architecture.md;
      programs where the chain cannot be proven fall back to `"io_callback"`) or
      `"io_callback"` (JAX's ordered `io_callback`). Default from `DISTOP_BACKEND`.
    - `fuse`: on the lean path, run operator calls that are independent of each other
      and next to each other in the schedule in ONE host call, one after another in
      schedule order (the same calls and collectives in the same order, the same
      results, fewer dispatches; `schedule` shows the groups). Under MPI a fused
      group of derivative calls of communicating operators whose zero (co)tangent rows
      are found only when the program runs agrees on them with one collective of its
      own and skips them, so its methods may get fewer rows than unfused (which then
      get every row: one collective per call would cost more than it saves), with the
      same results to round-off. Default True, or `DISTOP_FUSE=0`.
    - `copy`: whether distop copies numpy array inputs, here and in `run` and
      `run_and_compute_totals`, with numpy's meanings. True (default): it keeps its own
      copy of each, so changing the caller's array later changes nothing here. None: an
      array XLA can read in place (C-contiguous, in the machine's byte order, at a
      64-byte-aligned address, as `distop.empty` makes them) is shared, not copied, and
      others are copied; the caller must then not change a shared array while this
      Problem may read it (pass a new array to `run` instead). False: as None, but an
      array that needs a copy is a ValueError. JAX arrays are always shared (they are
      immutable), and other values (numbers, lists) always converted.

    Attributes: `schedule` (the operator calls of the `compute_totals` program, in
    program order: forward, then vjp; the `run` program's, only forward, where there
    is no compute_totals program: an operator has no `vjp`, or JAX cannot differentiate
    the model),
    `input_names`, `output_names`, `distributed`.
    """

    def __init__(self, model, inputs, *, comm=None, distributed=(), check_replicated=False,
                 backend=None, fuse=None, copy=True):
        self.comm = _comm.private(comm)
        # Which Problem on this communicator (they are made in the same order on every
        # rank, each construction agreeing across ranks): part of every request, so that
        # ranks calling two different Problems raise instead of running both.
        self._serial = next(_serials.setdefault(self.comm.py2f(), itertools.count()))
        self.model = model
        self.distributed = frozenset([distributed] if isinstance(distributed, str)
                                     else distributed)
        self.check_replicated = check_replicated
        self._x64 = x64_enabled()  # the precision its programs are traced in
        self.fuse = _safety.env_flag("DISTOP_FUSE", True) if fuse is None else bool(fuse)
        # arguments refused on some ranks raise on every rank; every agreement on this
        # communicator sends rows of one width, the most any rank's Problem sends, whichever
        # Problem the call is of (see `_Agreement`)
        (self.backend, self.copy, self._point), every = self._agree(
            "Problem: checking its arguments",
            lambda: self._arguments(model, inputs, backend or os.environ.get(
                "DISTOP_BACKEND", "lean"), copy),
            share=lambda made: (2 + sum(k in self.distributed for k in made[2]),
                                sorted(self.distributed)))
        if any(names != every[0][1] for _, names in every):
            raise DistopError(
                "Problem(distributed=...): the ranks named different distributed values:\n"
                + "\n".join(f"  rank {r}: {names}" for r, (_, names) in enumerate(every))
                + "\nName the same inputs and outputs on every rank.")
        self.input_names = tuple(self._point)
        self._handle = self.comm.py2f()
        _widths[self._handle] = max(_widths.get(self._handle, 2), *(w for w, _ in every))
        self._layouts = {}
        self._fixed = {}
        self._guesses = {}  # (shapes, request) -> the block sizes they were agreed with
        self._pending = None  # the `_Agreement` a program is to make
        self._gathered = None  # every rank's part of an agreement made, for `_layout`
        self._programs = {}
        self._device = {}
        self._traced_run = None  # (inputs, traced run program) of the newest layout
        self._warned_loop = False
        self._token = jnp.zeros((), _ffi.token_dtype())
        self._calls = 0  # the token's value: lean host calls run so far
        # (the options that shape the programs are part of the first request)
        layout = self._layout(self._point, ("Problem", f"backend={self.backend}",
                                            f"fuse={self.fuse}"))
        self.output_names = tuple(layout.outputs)
        unknown = self.distributed - set(self.input_names) - set(self.output_names)
        if unknown:
            raise ValueError(f"Problem(distributed={sorted(self.distributed)}): no input or "
                             f"output named {sorted(unknown)}; inputs are "
                             f"{list(self.input_names)}, outputs {list(self.output_names)}.")
        self._schedule = None
        if layout.differentiable["outputs"] and layout.differentiable["inputs"]:
            try:
                self._schedule = self._program(
                    "compute_totals", ("batched", layout.differentiable["outputs"],
                                       layout.differentiable["inputs"]),
                    layout).schedule
            except Exception as err:  # left for later or raised, on every rank
                if not self._totals_later(err):
                    raise
        if self._schedule is None:  # (or nothing to differentiate)
            self._schedule = self._program("run", (), layout).schedule

    def _totals_later(self, err):
        """Whether the constructor goes on without the `compute_totals` program that
        failed with `err`: the model can still run where an operator has no vjp, the
        model itself differentiates an operator, or JAX cannot differentiate it (a
        while_loop, say); `compute_totals` raises the error when called. The ranks decide
        together: where the program failed on some ranks only, the others hold a
        `DistopError` saying so."""
        if isinstance(err, (MissingMethodError, SecondDerivativeError)) or type(err) in (
                ValueError, TypeError, NotImplementedError):
            mine = "later"
        elif getattr(err, "elsewhere", False):
            mine = "others"
        else:
            mine = "raise"
        every = [mine]
        if self.comm.Get_size() > 1:
            with _safety.watchdog.watch("Problem: agreeing on a failed compute_totals"):
                every = self.comm.allgather(mine)
        return "later" in every and "raise" not in every

    def _arguments(self, model, inputs, backend, copy):
        """**Returns:** (the backend, `copy` as a bool or None, the point) after checking
        `Problem`'s arguments."""
        if not callable(model):
            raise TypeError(f"Problem(model=...): got a {type(model).__name__}; expected "
                            "a function called as model(**inputs) returning a dict.")
        if not isinstance(inputs, dict) or not inputs:
            raise TypeError("Problem(inputs=...): expected a non-empty dict of name -> "
                            f"array; got {type(inputs).__name__}.")
        if backend not in BACKENDS:
            raise ValueError(f"Problem(backend={backend!r}): expected one of "
                             f"{list(BACKENDS)} (or set DISTOP_BACKEND).")
        if not (copy is None or isinstance(copy, (bool, np.bool_))):
            raise ValueError(f"Problem(copy={copy!r}): expected True, None or False.")
        copy = None if copy is None else bool(copy)
        point = {name: _as_input(f"Problem(inputs={{'{name}': ...}})", value, copy)
                 for name, value in inputs.items()}
        for name in self.distributed & set(point):
            if point[name].ndim == 0:
                raise ValueError(f"Problem(distributed=[{name!r}]): input {name!r} is "
                                 "0-d; a distributed value needs an axis 0 to split.")
        return backend, copy, point

    # -- public entry points --------------------------------------------------------
    @property
    def schedule(self):
        """The operator calls of the default `compute_totals` program, in program order
        (of the `run` program where there is none: see the class docstring).

        Local: reading it never communicates, so any subset of ranks may do so.
        """
        return self._schedule

    def run(self, **inputs):
        """Evaluate the model at `inputs` (others keep their current values).

        **Arguments:**
        - `inputs`: name=array for the inputs to change (this rank's block for
          distributed inputs).

        **Returns:** dict of output name -> numpy array (this rank's block for
        distributed outputs): read-only views of the program's results, like JAX's
        own arrays (`.copy()` one to change it). The evaluated point becomes the
        current point; distop keeps its own copy of numpy inputs unless
        `Problem(copy=...)` says otherwise (JAX arrays, being immutable, are shared).
        """
        point, refused = self._moved("run", inputs)
        outs = self._agreed(lambda: self._execute(self._program(
            "run", (), self._layout(point, ("run",), refused, ahead=True)), point))
        if self.check_replicated:
            _totals.check_replicated(self, {**point, **outs}, "run")
        self._point = point
        return outs

    def compute_totals(self, of=None, wrt=None, *, mode="batched", return_format="global"):
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

        **Returns:** dict of `(of, wrt)` -> numpy array of shape (of size, wrt size),
        identical on every rank for the global format: views of the program's
        result, read-only like `run`'s values where no gathering copied them
        (`.copy()` one to change it). For a complex output, in JAX's convention: the
        derivatives of its real part, along a complex input z = x + iy as d/dx - i d/dy
        (a holomorphic function's complex derivative); take `jnp.real` and `jnp.imag`
        of it as two outputs for both parts.
        """
        def attempt():
            layout, names, ins = self._totals_request("compute_totals", self._point, of,
                                                      wrt, mode, return_format)
            if not names or not ins:
                return layout, names, ins, None
            program = self._program("compute_totals", (mode, names, ins), layout)
            return layout, names, ins, self._execute(program, self._point)

        layout, of, wrt, cts = self._agreed(attempt)
        if cts is None:
            return {}
        return _totals.assemble(self, layout, cts, of, wrt, return_format)

    def run_and_compute_totals(self, of=None, wrt=None, *, inputs=None, mode="batched",
                               return_format="global"):
        """`run` and then `compute_totals`, in one program: the values and the total
        derivatives at one point, with one dispatch and one agreement across ranks
        where the two calls make two, and each forward call made once (the values and
        the reverse sweep share it).

        **Arguments:**
        - `of`, `wrt`, `mode`, `return_format`: as for `compute_totals`.
        - `inputs`: dict of name -> array, the inputs to change first, as for
          `run(**inputs)`; None: the current point.

        **Returns:** `(values, totals)`: what `run` and `compute_totals` return, the
        totals to round-off (XLA compiles the reverse sweep beside the values, and may
        order its arithmetic otherwise). The evaluated point becomes the current point.
        """
        point, refused = self._moved("run_and_compute_totals",
                                     {} if inputs is None else inputs, keywords=False)

        def attempt():
            layout, names, ins = self._totals_request("run_and_compute_totals", point, of,
                                                      wrt, mode, return_format, refused)
            if not names or not ins:  # nothing to differentiate: `run`'s program
                return layout, names, ins, self._execute(self._program("run", (), layout),
                                                         point)
            return layout, names, ins, self._execute(self._program(
                "compute_totals", (mode, names, ins, True), layout), point)

        layout, of, wrt, out = self._agreed(attempt)
        if of and wrt:
            values = {k: v for (kind, k), v in out.items() if kind == "value"}  # as run's
            totals = _totals.assemble(self, layout, {k: out["total", k] for k in wrt}, of,
                                      wrt, return_format)
        else:
            values, totals = out, {}
        if self.check_replicated:
            _totals.check_replicated(self, {**point, **values}, "run_and_compute_totals")
        self._point = point
        return values, totals

    def check_totals(self, of=None, wrt=None, *, method="fd", form="central", step=1e-6,
                     atol=1e-8, rtol=1e-6, out_stream=_totals.STDOUT, raise_on_error=False,
                     show_only_incorrect=False):
        """Compare `compute_totals` with finite differences, on every rank.

        A block fails where |J - J_fd| > atol + rtol * |J_fd| anywhere, or where ranks
        disagree on J. Perturbations run as one batched program call.

        **Arguments:**
        - `of`, `wrt`: as for `compute_totals`.
        - `method`: `"fd"` (finite differences).
        - `form`: `"central"`, `"forward"` or `"backward"`.
        - `step`: the finite-difference step.
        - `atol`, `rtol`: the tolerances.
        - `out_stream`: where rank 0 prints the table: by default `sys.stdout` as it is
          at the call (redirected or captured, say); None prints nothing.
        - `raise_on_error`: raise `DerivativeCheckError` on every rank if a block fails.
        - `show_only_incorrect`: print only failing blocks.

        **Returns:** dict of `(of, wrt)` -> `TotalsCheck` with `J`, `J_fd`, `abs_error`,
        `rel_error`, `ok` and `inconsistent_ranks`.
        """
        return _totals.check_totals(self, of, wrt, method=method, form=form, step=step,
                                    atol=atol, rtol=rtol, out_stream=out_stream,
                                    raise_on_error=raise_on_error,
                                    show_only_incorrect=show_only_incorrect)

    def _moved(self, method, inputs, keywords=True):
        """**Returns:** (the current point with `inputs` (name -> array) in it, None), or
        (the current point, the error) if this rank refuses them: `_layout` raises it on
        every rank. `keywords`: whether the method takes them as keywords (`run(x=...)`)
        or as a dict (`inputs={'x': ...}`), for the messages."""
        try:
            if not isinstance(inputs, dict):
                raise TypeError(f"{method}(inputs=...): expected a dict of name -> array; "
                                f"got a {type(inputs).__name__}.")
            point = dict(self._point)
            for name, value in inputs.items():
                where = (f"{method}({name}=...)" if keywords
                         else f"{method}(inputs={{'{name}': ...}})")
                if name not in point:
                    raise ValueError(f"{where}: no input named '{name}'; "
                                     f"inputs are {list(self.input_names)}.")
                point[name] = _as_input(where, value, self.copy)
        except (TypeError, ValueError) as err:
            return self._point, err
        return point, None

    def _totals_request(self, method, point, of, wrt, mode, return_format, refused=None):
        """Agree on a request for totals at `point` and check its arguments.

        **Returns:** (the `Layout`, the `of` names, the `wrt` names)."""
        key = _totals.request_key
        request = (method, key(of, names=True), key(wrt, names=True), key(mode),
                   key(return_format))
        layout = self._layout(point, request, refused, ahead=True)
        of = self._names(method, "of", of, self.output_names,
                         layout.differentiable["outputs"])
        wrt = self._names(method, "wrt", wrt, self.input_names,
                          layout.differentiable["inputs"])
        if mode not in MODES:
            raise ValueError(f"{method}(mode={mode!r}): expected one of {list(MODES)}.")
        if return_format not in FORMATS:
            raise ValueError(f"{method}(return_format={return_format!r}): expected one of "
                             f"{list(FORMATS)}.")
        return layout, of, wrt

    # -- programs -------------------------------------------------------------------
    def _call_model(self, point):
        out = self.model(**point)
        if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
            raise TypeError(f"Problem: the model returned a {type(out).__name__}; expected "
                            "a dict of output name -> array.")
        return {k: jnp.asarray(v) for k, v in out.items()}

    def _build(self, name, options, layout, vectorize=True):
        """The function of an entry point; `vectorize=False` replaces `vmap` over seeds
        or perturbations by a sequential loop (for models JAX cannot vmap)."""
        def batch(fn, xs):
            if not vectorize:
                return lax.map(fn, xs)
            session = _ffi.session()
            if session is None:
                return jax.vmap(fn)(xs)
            # The lean path's token leaves the vmap as an unbatched output.
            out, session.token = jax.vmap(lambda x: (fn(x), session.token),
                                          out_axes=(0, None))(xs)
            return out

        if name == "run":
            return lambda point: self._call_model(point)
        if name == "fd":
            return lambda point, deltas: batch(
                lambda d: self._call_model({**point, **{k: point[k] + d[k] for k in d}}),
                deltas)
        mode, _, wrt, *with_values = options  # (with_values: run_and_compute_totals)
        if mode == "batched" and not vectorize:
            mode = "loop"
        diff_names = wrt  # differentiate only what was asked for

        def totals(point, *packed):
            seeds = self._split_seeds(packed, layout)
            diff = {k: point[k] for k in diff_names}
            rest = {k: v for k, v in point.items() if k not in diff}
            order = []  # the model's order of its outputs (jax.vjp's is sorted)

            def model(d):
                values = self._call_model({**rest, **d})
                order[:] = values
                return values

            values, pullback = self._pullback(model, diff)
            if mode == "batched":
                cts = batch(lambda seed: pullback(seed)[0], seeds)
            elif mode == "loop":
                cts = lax.scan(lambda carry, seed: (carry, pullback(seed)), None, seeds)[1][0]
            else:
                n = next(iter(seeds.values())).shape[0]
                rows = [pullback({k: _row(v, i) for k, v in seeds.items()})[0]
                        for i in range(n)]
                cts = {k: jnp.stack([r[k] for r in rows]) for k in diff_names}
            if not with_values:
                return cts
            # (packed in the model's order, as `run` packs them: XLA then makes no copy
            # of the slices of a vector)
            return {**{("value", k): values[k] for k in order},
                    **{("total", k): v for k, v in cts.items()}}

        return totals

    @staticmethod
    def _pullback(fn, diff):
        """`jax.vjp(fn, diff)`: the values and the pullback; on the lean path the token
        leaves `jax.vjp` as an output of its own (with a zero cotangent), so the
        backward calls continue the forward calls' chain."""
        session = _ffi.session()
        if session is None:
            return jax.vjp(fn, diff)
        (values, session.token), pullback = jax.vjp(lambda d: (fn(d), session.token), diff)
        zero = jnp.zeros(())
        return values, lambda seed: pullback((seed, zero))

    def _seeds(self, of, layout, specs_only=False):
        """One unit cotangent per global row of the requested outputs: a row of a
        distributed output only on the rank that owns it, a row of a replicated output on
        every rank; zeros for the other outputs, so every operator's VJP runs whatever
        `of` asks for. Packed as one (rows, columns) array per dtype, the outputs' columns
        side by side (`_split_seeds` undoes it in the program). Program arguments, not
        constants: XLA would spend long constant-folding them in unrolled programs."""
        rank = self.comm.Get_rank()
        sizes = {o: layout.global_size(o) for o in of}
        offsets = dict(zip(of, np.cumsum([0] + [sizes[o] for o in of])))
        total = sum(sizes.values())
        groups = _seed_groups(layout)
        widths = {d: sum(int(np.prod(layout.outputs[k].shape)) for k in names)
                  for d, names in groups.items()}
        if specs_only:
            return tuple(jax.ShapeDtypeStruct((total, widths[d]), d) for d in groups)
        packed = []
        for dtype, names in groups.items():
            seed, column = np.zeros((total, widths[dtype]), dtype), 0
            for name in names:
                if name in sizes:
                    start, stop = layout.local_rows(name, rank)
                    seed[offsets[name] + np.arange(start, stop),
                         column + np.arange(stop - start)] = 1
                column += int(np.prod(layout.outputs[name].shape))
            packed.append(seed)
        return tuple(packed)

    def _unit_seeds(self, of, layout):
        """**Returns:** the indices of the packed seeds of `_seeds` that are identity
        matrices, the same on every rank: `of` is every output of that dtype, in
        order, and no output is distributed (a rank's seeds would then hold its own
        rows only, and the program rewrite, which can change how calls fuse, must be
        the same everywhere)."""
        if self.comm.Get_size() > 1 and any(k in self.distributed for k in layout.outputs):
            return ()
        return tuple(i for i, names in enumerate(_seed_groups(layout).values())
                     if list(of) == names)

    @staticmethod
    def _split_seeds(packed, layout):
        """The per-output cotangent seeds of `_seeds`, inside the program."""
        seeds, total = {}, None
        for seed, names in zip(packed, _seed_groups(layout).values()):
            total, column = seed.shape[0], 0
            for name in names:
                spec = layout.outputs[name]
                n = math.prod(spec.shape)
                seeds[name] = seed[:, column:column + n].reshape((total,) + spec.shape)
                column += n
        for name, spec in layout.outputs.items():
            if name not in seeds:
                seeds[name] = np.zeros((total,) + spec.shape, jax.dtypes.float0)
        return {name: seeds[name] for name in layout.outputs}

    def _layout(self, point, request, refused=None, ahead=False):
        """Agree with every rank on the request (the entry point and its arguments) and
        the shapes of `point` (one small collective per call), and return its `Layout`
        (traced once per new shapes, on every rank).

        `refused`: the error of an argument this rank refused (then `point` is the
        current one). This rank takes its place in the agreement with a mark instead of
        a request and raises the error; the other ranks raise a `DistopError` naming it.
        No rank runs the call, and none waits for another.

        `ahead`: the caller runs inside `_agreed`, so the agreement may be left to the
        program (see `_Agreement`): for a request and shapes seen before, the layout
        of the other ranks' block sizes of last time is returned at once."""
        if refused is None and x64_enabled() != self._x64:
            point, refused = self._point, DistopError(
                f"{request[0]}: this Problem was made with jax_enable_x64="
                f"{self._x64} and is called with {not self._x64}: its programs and values "
                "are in the other precision. Change jax_enable_x64 back, or make a new "
                "Problem after changing it.")
        local = tuple((k, v.shape, v.dtype.str) for k, v in point.items())
        dist_inputs = [k for k in point if k in self.distributed]
        counts = ()
        if self.comm.Get_size() > 1:
            if refused is not None:  # (a hash is never negative)
                fixed = ((_REFUSED, f"{type(refused).__name__}: {refused}", None), -1)
            else:
                fixed = self._fixed.get((local, request))
            if fixed is None:  # what must agree, and its hash: once per shapes and request
                shapes = tuple((k, s[1:] if k in self.distributed else s, d)
                               for k, s, d in local)
                fixed = self._fixed[local, request] = (
                    (request, shapes, self._serial),
                    _stable_hash((self._serial, request, shapes)))
            own = [point[k].shape[0] for k in dist_inputs]
            every, self._gathered = self._gathered, None
            if every is None:
                guess = self._guesses.get((local, request)) if ahead and refused is None \
                    else None
                if guess is not None:
                    self._pending = _Agreement(self.comm, [fixed[1], guess[1], *own],
                                               _widths[self._handle], guess[0])
                    return self._layouts[local, guess[0]]
                every = _Agreement(self.comm, [fixed[1], -1, *own],
                                   _widths[self._handle]).gather()
            if (every[:, 0] != every[0, 0]).any():
                shapes = self.comm.allgather(fixed[0])
                others = [f"  rank {r}: {s}" for r, (c, s, _) in enumerate(shapes)
                          if c == _REFUSED]
                if refused is not None:
                    raise refused
                if others:
                    raise DistopError("other ranks refused their arguments to the same call, "
                                      "so no rank runs it:\n" + "\n".join(others))
                raise DistopError(
                    "the ranks called different entry points, of different Problems (#: "
                    "the order of their making on this communicator), with different "
                    "arguments, or passed inputs of different shapes or dtypes, so they "
                    "would run different programs:\n"
                    + "\n".join(f"  rank {r}: {c} {s} (Problem #{n})"
                                for r, (c, s, n) in enumerate(shapes))
                    + "\nCall the same methods with the same arguments and shapes on every "
                    "rank; only inputs named in Problem(distributed=...) may differ, and "
                    "only in axis 0.")
            counts = _counts(every, len(dist_inputs))
            if ahead:
                self._guesses[local, request] = (counts, _stable_hash(counts))
        if refused is not None:  # (every rank refused, or there is only this one)
            raise refused
        key = (local, counts)
        layout = self._layouts.get(key)
        if layout is None:
            with _collector_paused():
                layout = self._layouts[key] = self._new_layout(
                    point, dict(zip(dist_inputs, counts)))
        return layout

    def _new_layout(self, point, counts):
        """The `Layout` of a point with new shapes (traces the model, on every rank)."""
        inputs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in point.items()}
        # The run program, traced now: its outputs are the layout's (one trace of the
        # model serves both), and `_program` takes it over once the layout exists.
        run = self._trace("run", (), _Inputs(inputs), (), True)
        outputs = {k: jax.ShapeDtypeStruct(*run[1][k]) for k in sorted(run[1])}
        self._traced_run = (inputs, run)
        if self.comm.Get_size() == 1:
            counts.update({k: (s.shape[0],) for k, s in outputs.items()
                           if k in self.distributed and s.ndim})
            counts.update({k: (point[k].shape[0],) for k in point if k in self.distributed})
            return Layout(inputs, outputs, counts)
        shapes = self.comm.allgather({k: (s.shape, str(s.dtype)) for k, s in outputs.items()})
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

    def _program(self, name, options, layout, make_extra=tuple):
        """The jitted program of an entry point for `layout`, traced, checked and agreed
        by every rank the first time it is needed.

        **Arguments:**
        - `name`, `options`: the entry point and what selects its program.
        - `layout`: the `Layout` of the point.
        - `make_extra`: builds the arguments after the point (default none; the seeds
          for `compute_totals`).
        """
        key = (name, options, id(layout))
        found = self._programs.get(key)
        if found is None:
            if self._settled_missed():  # (building one communicates: agree first)
                raise _Missed
            with _collector_paused():
                found = self._new_program(key, name, options, layout, make_extra)
        return found

    def _new_program(self, key, name, options, layout, make_extra):
        """Trace, rewrite and agree on a program not built before (see `_program`)."""
        if name == "compute_totals":
            def make_extra():
                return self._seeds(options[1], layout)
            specs = self._seeds(options[1], layout, specs_only=True)
        else:
            specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                 make_extra())
        pending = self._traced_run if name == "run" else None
        try:
            if pending is not None and pending[0] is layout.inputs:
                self._traced_run = None
                fn, outputs, jaxpr, traced = pending[1]
            else:
                fn, outputs, jaxpr, traced = self._trace(name, options, layout, specs,
                                                         True)
        except NotImplementedError as err:
            if "not supported in vmap" not in str(err):
                raise
            # jax refuses to vmap ordered callbacks inside lax.cond: run the seeds or
            # perturbations one after another instead, in a loop.
            if not self._warned_loop:
                self._warned_loop = True
                entry = "run_and_compute_totals" if options[3:] == (True,) else name
                warnings.warn(f"{entry}: the model has an operator inside lax.cond (or "
                              "another construct jax cannot vmap with ordered "
                              "callbacks), so seeds and finite-difference perturbations "
                              "run in a loop, one per iteration, instead of one batch.",
                              stacklevel=3)
            fn, outputs, jaxpr, traced = self._trace(name, options, layout, specs,
                                                     False)
        with _safety.watchdog.watch(f"Problem: agreeing on the {name} schedule"):
            schedule = _schedule.agree(self.comm, name,
                                       _schedule.extract(jaxpr, traced))
        checker = (_comm.checker(self.comm) if _safety.settings.check_collectives
                   and self.comm.Get_size() > 1 else None)
        calls = lean_calls(jaxpr.jaxpr)
        # Its first host call may make the agreement (see `_Agreement`) where nothing
        # else in it runs host code (a callback or FFI call of the model's own, which
        # could communicate before it, or a call of an operator set to ordered=False,
        # which XLA may run before it) and it ends whatever its calls return (no while
        # loop, whose condition could read the zeros of calls that did not run).
        ahead = bool(calls) and checker is None and not jaxpr.jaxpr.effects and not \
            _ffi.anywhere(jaxpr.jaxpr.eqns, _not_ahead)
        found = self._programs[key] = Program(fn, schedule, outputs, make_extra, checker,
                                              len(calls), ahead)
        # the lean call sites live as long as the program
        weakref.finalize(found, _ffi.release, calls)
        return found

    def _trace(self, name, options, layout, specs, vectorize):
        """Trace an entry point's program, on the lean path if the backend says so and
        the program allows it on every rank (its lean calls form one token chain), else
        with ordered `io_callback`s. The lean program is rewritten alike on every rank
        (see `_passes.pipeline`).

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
            units = self._unit_seeds(options[1], layout) if name == "compute_totals" else ()
            lean = pipeline.lean_program(name, found, exchange=self._agree, unit_seeds=units,
                                         fuse=self.fuse, inputs=layout.inputs, specs=specs)
            if lean is not None:
                return (*lean, lean_calls(found[2].jaxpr))
        return (*self._trace_with(name, options, layout, specs, vectorize, False), None)

    def _trace_with(self, name, options, layout, specs, vectorize, lean):
        body, outputs = self._build(name, options, layout, vectorize), {}

        def packed(token, *args):
            if lean:
                with _ffi.tracing(token) as session:
                    values = body(*args)
                token = session.token
            else:
                values = body(*args)
            outputs.update({k: (v.shape, v.dtype) for k, v in values.items()})
            return _pack(values) + (token,)

        fn = jax.jit(packed)
        token = jax.ShapeDtypeStruct((), _ffi.token_dtype())
        traced = self._agree(f"{name}: tracing the program",
                             lambda: _schedule.refuse_checkpoint(
                                 fn.trace(token, layout.inputs, *specs)))
        return fn, outputs, traced.jaxpr

    def _agreed(self, attempt):
        """`attempt()`, an entry point's work from its `_layout(..., ahead=True)` on,
        with the agreement that layout left pending made (by the program, or here after
        it): where the ranks turn out not to agree (different requests, or other block
        sizes than the layout's), the attempt is made again with what every rank sent,
        as if agreed first (then raising on every rank, or running the right program)."""
        try:
            result = attempt()
        except _Missed:
            pass
        except BaseException:
            if not self._settled_missed():  # (raised before the agreement was made, say)
                raise
        else:
            if not self._settled_missed():
                return result
        return attempt()

    def _settled_missed(self):
        """Make the pending agreement, if there is one. **Returns:** whether the ranks
        disagree (then `_layout` finds what they sent in `_gathered`)."""
        pending, self._pending = self._pending, None
        if pending is None or not pending.settle():
            return False
        self._gathered = pending.every
        return True

    def _execute(self, program, point):
        if self._pending is not None and not program.ahead and self._settled_missed():
            raise _Missed
        _ffi.agreement = self._pending  # (still pending only where the program makes it)
        try:
            try:
                *packed, token = program.fn(self._token, self._on_device(point),
                                            *program.extra)
                if _ffi.agreement is not None:
                    # Not made yet: with JAX's async dispatch the program may still run
                    # on an XLA thread, and its first host call must find the agreement.
                    token.block_until_ready()
            finally:
                _ffi.agreement = None
            values = _unpack(packed, program.plan)
            # Kept only once the program has ended well: with JAX's async dispatch a host
            # call's error arrives here, in the token too, and every later program would
            # fail with it. (float() of a JAX array costs ten times more than through
            # numpy.)
            count = float(np.asarray(token))
            self._token = token
            if program.calls:
                calls, self._calls = self._calls, count
                if self._calls - calls != program.calls:
                    raise DistopError(
                        f"rank {self.comm.Get_rank()}: the program made "
                        f"{self._calls - calls} host calls instead of {program.calls}; "
                        "please report this as a bug of distop, with your jax version. "
                        "Problem(..., backend='io_callback') avoids the lean path.")
                if self._calls >= _ffi.TOKEN_RESTART:
                    self._token, self._calls = jnp.zeros((), self._token.dtype), 0
            if self._settled_missed():
                raise _Missed
            if program.checker is not None:
                # A rank whose program skipped a collective (rank-dependent control flow)
                # meets the others' next collective here, and every rank raises.
                with _safety.watchdog.watch("Problem: end of program"):
                    program.checker.agree(("end of program",))
            return values
        except (JaxRuntimeError, ValueError) as err:
            # A host call's error: JAX raises ValueError where its C++ dispatch runs the
            # program (as of jax 0.10.2), else JaxRuntimeError; with the error's text.
            cause = take_error()
            if isinstance(err, ValueError) and str(cause) not in str(err):
                cause = None  # a ValueError of its own
            if cause is not None:
                raise cause from None
            raise

    def _on_device(self, point):
        """The point's arrays as the program takes them: a new array as it is (XLA reads
        an aligned numpy array in place, see `_aligned_copy`), and one passed `_REUSES`
        times as a JAX array of it, made once. A program takes a JAX array 1-2 us faster
        than a numpy one; making one costs 15-30 us, the cost of `run(x=...)` on every
        call before if made at once."""
        cache = self._device
        out = {}
        for k, v in point.items():
            found = cache.get(k)
            if found is None or found[0] is not v:
                found = cache[k] = [v, 0, v]
            found[1] += 1
            if found[1] == _REUSES:
                found[2] = _device(v)
            out[k] = found[2]
        return out

    def _agree(self, what, thunk, share=None):
        """Run `thunk` on every rank; if it raises on any rank, raise on every rank.

        **Returns:** its result; with `share` (a function of the result), also every
        rank's `share(result)`, from the same collective."""
        try:
            result, error = thunk(), None
            shared = share(result) if share is not None else None
        except Exception as err:  # noqa: BLE001 - reported collectively below
            result, shared, error = None, None, err
        mine = (None if error is None else f"{type(error).__name__}: {error}", shared)
        every = [mine]
        if self.comm.Get_size() > 1:
            with _safety.watchdog.watch(f"Problem: {what}"):
                every = self.comm.allgather(mine)
            if any(m for m, _ in every) and error is None:
                failed = DistopError(f"{what} failed on other ranks:\n" + "\n".join(
                    f"  rank {r}: {m}" for r, (m, _) in enumerate(every) if m))
                failed.elsewhere = True  # (this rank's step itself went well)
                raise failed
        if error is not None:
            raise error
        return result if share is None else (result, [shared for _, shared in every])

    # -- names ----------------------------------------------------------------------
    def _names(self, method, arg, names, known, differentiable):
        if names is None:
            return differentiable
        names = ([names] if isinstance(names, str) else sorted(names)
                 if isinstance(names, (set, frozenset)) else list(names))
        kind = "output" if arg == "of" else "input"
        for n in names:
            if n not in known:
                raise ValueError(f"{method}({arg}={names!r}): no {kind} named {n!r}; "
                                 f"{kind}s are {list(known)}.")
            if n not in differentiable:
                raise ValueError(f"{method}({arg}={names!r}): {kind} {n!r} is not "
                                 "floating point, so it has no derivative.")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{method}({arg}={names!r}): {kind}s {twice} are named more "
                             f"than once; name each {kind} once.")
        return tuple(names)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a program is traced: tracing makes
    hundreds of thousands of objects, and the collector would walk every live one again
    and again (a model of 2000 operator calls traced in 2.35 s instead of 2.82). What is
    garbage is collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What tracing needs of a `Layout` before the layout exists: the inputs."""

    inputs: dict


def _as_input(where, value, copy=True):
    """An input as distop keeps it: see `Problem`'s `copy` (True, None or False)."""
    if isinstance(value, jax.Array) and value.is_fully_addressable:
        # immutable already: a read-only view of its memory, no copy (see `_device`)
        try:
            host = np.asarray(value)
        except Exception as err:  # a deleted (or donated) array, say
            raise TypeError(f"{where}: could not read the JAX array: {err}") from err
        if host.flags.c_contiguous and _numeric(host.dtype) and not _narrows(host.dtype):
            return host  # (one JAX would narrow is refused below)
    if isinstance(value, np.ma.MaskedArray):  # (np.asarray would drop the mask)
        raise TypeError(f"{where}: got a masked array; pass an array of its values, "
                        "`a.filled(...)`, as JAX does.")
    try:
        array = np.asarray(value)
    except Exception as err:
        raise TypeError(f"{where}: could not make an array of a {type(value).__name__}.") from err
    if not _numeric(array.dtype):
        raise TypeError(f"{where}: got a {type(value).__name__} ({array.dtype}); expected a "
                        "numeric array or number.")
    narrow = _narrows(array.dtype)
    if narrow is not None:
        if isinstance(value, (np.ndarray, np.generic, jax.Array)):  # the caller's dtype
            raise TypeError(f"{where}: a {array.dtype} input, but JAX is in 32-bit mode "
                            f"and would silently make it {narrow}. Call "
                            "jax.config.update('jax_enable_x64', True) first, or pass "
                            f"{narrow}.")
        # a Python number or list: made in 32 bits, as JAX makes it
        narrowed = array.astype(narrow)
        if narrow.kind in "iu" and (narrowed != array).any():
            raise TypeError(f"{where}: {value!r} does not fit in {narrow}, JAX's "
                            "integers in 32-bit mode.")
        array = narrowed
    if copy is True or not isinstance(value, np.ndarray):
        return _aligned_copy(array)
    why = _copy_needed(array)
    if why is None:
        return array
    if copy is None:
        return _aligned_copy(array)
    raise ValueError(f"{where}: Problem(copy=False), but XLA cannot read this array in "
                     f"place ({why}), so it needs a copy. Make it with distop.empty, or "
                     "pass copy=None to copy such arrays.")


def _narrows(dtype):
    """**Returns:** the narrower dtype JAX would make of `dtype` (in its 32-bit mode),
    or None."""
    if x64_enabled():
        return None
    narrow = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    return narrow if narrow.itemsize < dtype.itemsize else None


def _numeric(dtype):
    """Whether JAX takes arrays of `dtype` as numbers (bfloat16 and the other ml_dtypes
    floats included: numpy gives them kind 'V')."""
    return dtype.kind in "biufc" or (dtype.kind == "V" and not dtype.fields
                                     and jnp.issubdtype(dtype, jnp.inexact))


ALIGN = 64  # the alignment at which XLA's CPU client reads a host buffer in place


def empty(shape, dtype=float):
    """A new, uninitialized numpy array that XLA can read in place: C-contiguous, at a
    64-byte-aligned address (numpy's own are usually 16 bytes off it, and XLA copies
    those). With `Problem(..., copy=None)`, an input made here is shared, not copied:
    fill it in place first (`out=` of numpy's functions, or `a[...] = ...`).

    **Arguments:**
    - `shape`: int or tuple of ints.
    - `dtype`: numpy dtype (default float64), in the machine's byte order.
    """
    dtype = np.dtype(dtype).newbyteorder("=")
    if not _numeric(dtype) or not dtype.itemsize:
        raise TypeError(f"distop.empty(dtype={dtype}): expected a numeric dtype.")
    try:
        shape = tuple(map(operator.index, [shape] if np.ndim(shape) == 0 else shape))
    except TypeError as err:
        raise TypeError(f"distop.empty(shape={shape!r}): expected an int or a tuple of "
                        "ints.") from err
    if any(n < 0 for n in shape):
        raise ValueError(f"distop.empty(shape={shape}): negative dimensions are not allowed.")
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _copy_needed(array):
    """**Returns:** why XLA would not read `array` in place (see `empty`), or None."""
    if not array.flags.c_contiguous:
        return "it is not C-contiguous"
    if not array.dtype.isnative:
        return "it is not in the machine's byte order"
    if array.size and array.ctypes.data % ALIGN:  # (an empty array has no memory)
        return f"its address is {array.ctypes.data % ALIGN} bytes off {ALIGN}-byte alignment"
    return None


def _aligned_copy(array):
    """distop's own copy of an input (so that changing the caller's array later changes
    nothing here), made by `empty`: `_device` then hands it to the programs without a
    second copy. In the machine's byte order (JAX takes no other)."""
    out = empty(array.shape, array.dtype)
    out[...] = array
    return out


def _row(seeds, i):
    """Row `i` of a batch of seeds: an array even where the seeds are `float0` (the
    cotangent of an integer output), which numpy would index to a scalar JAX refuses."""
    if seeds.dtype == jax.dtypes.float0:
        return np.zeros(seeds.shape[1:], seeds.dtype)
    return seeds[i]


def _seed_groups(layout):
    """dtype -> the floating-point outputs of that dtype, in the layout's order: one
    packed seed array each (see `Problem._seeds`)."""
    groups = {}
    for name, spec in layout.outputs.items():
        if inexact_dtype(spec.dtype):
            groups.setdefault(np.dtype(spec.dtype), []).append(name)
    return groups


_REUSES = 8  # (see `Problem._on_device`)
_serials = {}  # private communicator's handle -> count of the Problems made on it
_widths = {}  # private communicator's handle -> the width of its agreements' rows
_REFUSED = "refused"  # (see `Problem._layout`)


_NOT_AHEAD = ("while", "pure_callback", "ffi_call")  # (see `Program.ahead`)


def _not_ahead(eqn):
    """Whether `eqn` keeps its program from making the agreement in its first host call
    (see `Problem._new_program`)."""
    return eqn.primitive.name in _NOT_AHEAD or (
        eqn.primitive.name == "distop_host_call" and not eqn.params["call"].lean)


class _Agreement:
    """The agreement of one call of an entry point across ranks. Every rank sends
    (`mine`) the hash of its request and shapes, the hash of the block sizes its
    layout was made for (-1 where it has made no layout yet) and the block sizes of
    its distributed inputs, padded with zeros to the `width` of every agreement on its
    communicator (the most any rank's Problem made on it sends, agreed as each Problem
    is made, so the same on every rank: ranks calling Problems with other numbers of
    distributed inputs send rows of one size, and raise the error of differing
    requests instead of MPI's of differing message sizes). The ranks have agreed on a
    layout made in advance (that of
    the sizes of the request's last call) when all send the same two hashes and the
    block sizes are those the layout was made for (`expect`): a test of what every
    rank sent, so every rank decides alike.

    Made before the program where the rank made no layout in advance, or where the
    program cannot make it (see `Program.ahead`); else by the program's first host
    call, right before its method (`_ffi.agreement`): one collective beside the
    method's own, where one before the program would make the ranks meet once more.
    Every rank makes it before any method of the call runs, the same single Allgather
    wherever it is made. Where the ranks disagree, no host call of the program runs a
    method (each returns zeros), and `Problem._agreed` goes on as if the agreement
    had been made first."""

    __slots__ = ("comm", "every", "expect", "mine", "missed", "sizes")

    def __init__(self, comm, mine, width, expect=None):
        self.comm, self.expect, self.sizes = comm, expect, len(mine) - 2
        self.mine = np.array(mine + [0] * (width - len(mine)), np.int64)
        self.every = self.missed = None

    def gather(self):
        """**Returns:** every rank's `mine`, one row per rank."""
        every = np.empty((self.comm.Get_size(), self.mine.size), np.int64)
        with _safety.watchdog.watch("Problem: agreeing on the inputs' shapes"):
            self.comm.Allgather(self.mine, every)
        return every

    def settle(self):
        """Make the agreement, once. **Returns:** whether the ranks disagree."""
        if self.missed is None:
            self.every = self.gather()
            self.missed = bool((self.every[:, :2] != self.mine[:2]).any()
                               or _counts(self.every, self.sizes) != self.expect)
        return self.missed


class _Missed(Exception):
    """A program found that the ranks disagree (see `_Agreement`)."""


def _counts(every, sizes):
    """Per distributed input (`sizes` of them), every rank's block size, from the
    agreement's rows."""
    return tuple(map(tuple, every[:, 2:2 + sizes].T.tolist()))


def _device(array):
    """A JAX array of `array`, sharing its memory where XLA can (aligned, see
    `_aligned_copy`), else a copy. Uncommitted to a device, as a numpy argument is:
    JAX compiles a program once per mix of committed and uncommitted arguments (one
    from DLPack is committed)."""
    return jax.device_put(array)


def _group(name, dtype):
    """The packed array (see `_pack`) that output `name` goes to: one per dtype, and per
    kind of output where the names say (`("value", k)`, `("total", k)`): XLA leaves out
    a concatenation of a vector's own slices, not one of slices and other values."""
    return np.dtype(dtype), name[0] if isinstance(name, tuple) else None


def _pack(values):
    """Concatenate a dict of arrays into few flat arrays (`_group`): a program with few
    outputs dispatches faster than one with many."""
    groups = {}
    for k, v in values.items():
        groups.setdefault(_group(k, v.dtype), []).append(v.ravel())
    return tuple(jnp.concatenate(g) if len(g) > 1 else g[0] for g in groups.values())


def _unpack(arrays, plan):
    """The inverse of `_pack`, as read-only numpy views of the program's results.

    **Arguments:**
    - `arrays`: the packed results.
    - `plan`: from `_unpack_plan`.
    """
    groups = [np.asarray(a) for a in arrays]  # read-only views on CPU: no copy
    return {k: groups[g][index] if shape is None else groups[g][index].reshape(shape)
            for k, g, index, shape in plan}


def _unpack_plan(outputs):
    """**Returns:** (name, group, index, shape) for every output of `_pack`: its packed
    array is `group`, and it is that array's `[index]`, reshaped to `shape` unless None.
    A scalar is indexed `[i, ...]`, one numpy operation for its 0-d view (a slice then
    a reshape costs three times as long: a run of 64 scalar outputs took 8 us more)."""
    groups, plan = {}, []
    for k, (shape, dtype) in outputs.items():
        g, start = groups.get(_group(k, dtype), (len(groups), 0))
        stop = start + math.prod(shape)
        groups[_group(k, dtype)] = (g, stop)
        shape = tuple(shape)
        if not shape:
            plan.append((k, g, (start, Ellipsis), None))
        else:
            plan.append((k, g, slice(start, stop), None if len(shape) == 1 else shape))
    return tuple(plan)


def _stable_hash(obj):
    """A hash that is the same in every process (Python's own `hash` is salted)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1
