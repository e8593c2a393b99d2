"""`Problem`: trace a model of jax.numpy and operators into checked, jitted entry points."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _comm, _schedule
from ._callback import take_error
from ._compat import JaxRuntimeError, x64_enabled
from ._errors import DistopError, MissingMethodError

MODES = ("batched", "loop", "unrolled")


class Problem:
    """A model compiled into jitted programs whose collectives run in one order everywhere.

    **Arguments:**
    - `model`: called as `model(**inputs)`; returns a dict of named outputs, computed
      with jax.numpy and `DistributedOperator` calls.
    - `inputs`: dict of name -> array, the starting point.
    - `comm`: the MPI communicator the model runs on (default `MPI.COMM_WORLD`); distop
      uses a private duplicate for its own agreement and checks.

    Attributes: `schedule` (the operator calls of the `compute_totals` program, in
    program order: forward, then vjp; only forward if an operator has no `vjp`),
    `input_names`, `output_names`.
    """

    def __init__(self, model, inputs, *, comm=None):
        if not callable(model):
            raise TypeError(f"Problem(model=...): got a {type(model).__name__}; expected "
                            "a function called as model(**inputs) returning a dict.")
        if not isinstance(inputs, dict) or not inputs:
            raise TypeError("Problem(inputs=...): expected a non-empty dict of name -> "
                            f"array; got {type(inputs).__name__}.")
        self.model = model
        self.comm = _comm.private(comm)
        self._point = {name: _as_input(f"Problem(inputs={{'{name}': ...}})", value)
                       for name, value in inputs.items()}
        self.input_names = tuple(self._point)
        self._programs = {}
        self._output_specs_by_shapes = {}
        self.output_names = tuple(self._output_specs())
        try:
            self._schedule = self._compiled(
                "compute_totals", ("batched", self._differentiable_outputs()))[1]
        except MissingMethodError:  # an operator without vjp: the model can still run
            self._schedule = self._compiled("run", ())[1]

    # -- public entry points --------------------------------------------------------
    @property
    def schedule(self):
        """The operator calls of the default `compute_totals` program, in program order.

        Local: reading it never communicates, so any subset of ranks may do so.
        """
        return self._schedule

    def run(self, **inputs):
        """Evaluate the model at `inputs` (others keep their current values).

        **Arguments:**
        - `inputs`: name=array for the inputs to change.

        **Returns:** dict of output name -> numpy array. The evaluated point becomes the
        current point.
        """
        point = dict(self._point)
        for name, value in inputs.items():
            if name not in point:
                raise ValueError(f"run({name}=...): no input named '{name}'; inputs are "
                                 f"{list(self.input_names)}.")
            point[name] = _as_input(f"run({name}=...)", value)
        program, _, _ = self._compiled("run", (), point)
        outs = self._execute(program, point)
        self._point = point
        return outs

    def compute_totals(self, of=None, wrt=None, *, mode="batched"):
        """Total derivatives of outputs with respect to inputs, at the current point.

        **Arguments:**
        - `of`: output name(s); None means every floating-point output.
        - `wrt`: input name(s); None means every floating-point input.
        - `mode`: `"batched"` (every seed in one vmapped reverse sweep: one callback per
          operator), `"loop"` (one sweep per seed inside a `lax.scan`) or `"unrolled"`
          (one independent sweep per seed, unrolled in the program).

        **Returns:** dict of `(of, wrt)` -> numpy array of shape (of size, wrt size),
        identical on every rank for replicated values.
        """
        of = self._names("of", of, self.output_names, self._differentiable_outputs())
        wrt = self._names("wrt", wrt, self.input_names, self._differentiable_inputs())
        if mode not in MODES:
            raise ValueError(f"compute_totals(mode={mode!r}): expected one of {list(MODES)}.")
        if not of or not wrt:
            return {}
        program, _, seeds = self._compiled("compute_totals", (mode, of))
        cts = self._execute(program, self._point, *seeds)
        totals = {}
        row = 0
        for o in of:
            n = int(np.prod(self._output_specs()[o].shape))
            for w in wrt:
                totals[o, w] = np.asarray(cts[w][row:row + n]).reshape(n, self._point[w].size)
            row += n
        return totals

    # -- programs -------------------------------------------------------------------
    def _output_specs(self, point=None):
        """The output shapes and dtypes at `point`'s input shapes (traced once per shapes)."""
        point = self._point if point is None else point
        key = tuple((k, v.shape, str(v.dtype)) for k, v in point.items())
        specs = self._output_specs_by_shapes.get(key)
        if specs is None:
            inputs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in point.items()}
            specs = self._output_specs_by_shapes[key] = dict(self._agree(
                "tracing the model", lambda: jax.eval_shape(self._call_model, inputs)))
        return specs

    def _call_model(self, point):
        out = self.model(**point)
        if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
            raise TypeError(f"Problem: the model returned a {type(out).__name__}; expected "
                            "a dict of output name -> array.")
        return {k: jnp.asarray(v) for k, v in out.items()}

    def _build(self, name, options):
        if name == "run":
            return self._call_model
        mode, of = options
        return lambda point, seeds: self._totals(point, seeds, mode)

    def _totals(self, point, seeds, mode):
        diff_names = self._differentiable_inputs()
        diff = {k: point[k] for k in diff_names}
        rest = {k: v for k, v in point.items() if k not in diff}
        _, pullback = jax.vjp(lambda d: self._call_model({**rest, **d}), diff)
        if mode == "batched":
            (cts,) = jax.vmap(pullback)(seeds)
        elif mode == "loop":
            _, (cts,) = lax.scan(lambda carry, seed: (carry, pullback(seed)), None, seeds)
        else:
            n = next(iter(seeds.values())).shape[0]
            rows = [pullback({k: v[i] for k, v in seeds.items()})[0] for i in range(n)]
            cts = {k: jnp.stack([r[k] for r in rows]) for k in diff_names}
        return cts

    def _seeds(self, of):
        """One unit cotangent per row of the requested outputs; zeros for the others, so
        every operator's VJP runs whatever `of` asks for. They are program arguments, not
        constants: XLA would spend long constant-folding them in unrolled programs."""
        sizes = {o: int(np.prod(self._output_specs()[o].shape)) for o in of}
        offsets = dict(zip(of, np.cumsum([0] + [sizes[o] for o in of])))
        total = sum(sizes.values())
        seeds = {}
        for name, spec in self._output_specs().items():
            if not np.issubdtype(spec.dtype, np.inexact):
                seeds[name] = np.zeros((total,) + spec.shape, jax.dtypes.float0)
                continue
            seed = np.zeros((total, int(np.prod(spec.shape))), spec.dtype)
            if name in sizes:
                seed[offsets[name]:offsets[name] + sizes[name]] = np.eye(sizes[name])
            seeds[name] = seed.reshape((total,) + spec.shape)
        return seeds

    def _compiled(self, name, options, point=None):
        """The jitted program of an entry point for the current shapes, traced, checked
        and agreed by every rank the first time it is needed."""
        point = self._point if point is None else point
        signature = (name, options,
                     tuple((k, v.shape, str(v.dtype)) for k, v in point.items()))
        if not _comm.all_equal(self.comm, _stable_hash(signature)):
            every = self.comm.allgather(signature)
            raise DistopError(f"{name}: the ranks called it with different input shapes or "
                              "dtypes, so they would compile different programs:\n"
                              + "\n".join(f"  rank {r}: {s[2]}" for r, s in enumerate(every))
                              + "\nPass the same shapes on every rank.")
        found = self._programs.get(signature)
        if found is None:
            fn = jax.jit(self._build(name, options))
            extra = (self._seeds(options[1]),) if name == "compute_totals" else ()
            specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in point.items()}
            traced = self._agree(f"{name}: tracing the program",
                                 lambda: fn.trace(specs, *extra))
            entries = _schedule.extract(traced.jaxpr)
            _schedule.verify(self.comm, name, entries)
            found = self._programs[signature] = (fn, entries, extra)
        return found

    def _execute(self, program, point, *extra):
        try:
            out = program(point, *extra)
            return {k: np.asarray(v) for k, v in out.items()}
        except JaxRuntimeError as err:
            cause = take_error()
            if cause is not None:
                raise cause from None
            raise err

    def _agree(self, what, thunk):
        """Run `thunk` on every rank; if it raises on any rank, raise on every rank."""
        try:
            result, error = thunk(), None
        except Exception as err:  # noqa: BLE001 - reported collectively below
            result, error = None, err
        if self.comm.Get_size() > 1:
            failed = self.comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
            if any(failed) and error is None:
                raise DistopError(f"{what} failed on other ranks:\n" + "\n".join(
                    f"  rank {r}: {m}" for r, m in enumerate(failed) if m))
        if error is not None:
            raise error
        return result

    # -- names ----------------------------------------------------------------------
    def _differentiable_inputs(self):
        return tuple(k for k, v in self._point.items() if np.issubdtype(v.dtype, np.inexact))

    def _differentiable_outputs(self):
        return tuple(k for k, s in self._output_specs().items()
                     if jnp.issubdtype(s.dtype, jnp.inexact))

    def _names(self, arg, names, known, differentiable):
        if names is None:
            return differentiable
        names = [names] if isinstance(names, str) else list(names)
        kind = "output" if arg == "of" else "input"
        for n in names:
            if n not in known:
                raise ValueError(f"compute_totals({arg}={names!r}): no {kind} named {n!r}; "
                                 f"{kind}s are {list(known)}.")
            if n not in differentiable:
                raise ValueError(f"compute_totals({arg}={names!r}): {kind} {n!r} is not "
                                 "floating point, so it has no derivative.")
        return tuple(names)


def _as_input(where, value):
    try:
        array = np.array(value)
    except Exception as err:  # noqa: BLE001
        raise TypeError(f"{where}: could not make an array of a {type(value).__name__}.") from err
    if array.dtype == object or array.dtype.kind not in "biufc":
        raise TypeError(f"{where}: got a {type(value).__name__} ({array.dtype}); expected a "
                        "numeric array or number.")
    if array.dtype.itemsize == 8 and array.dtype.kind in "fic" and not x64_enabled():
        raise TypeError(f"{where}: a {array.dtype} input, but JAX is in 32-bit mode and would "
                        "silently round it. Call jax.config.update('jax_enable_x64', True) "
                        "first, or pass float32.")
    return array


def _stable_hash(obj):
    """A hash that is the same in every process (Python's own `hash` is salted)."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1
