"""Where a point's values live (`Layout`) and the unit seeds of its reverse and forward
sweeps."""

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np

from .._dtypes import inexact_dtype


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the values of one point live: local specs and, for distributed names, the
    axis-0 size on every rank (the same on every rank)."""

    inputs: dict
    outputs: dict
    counts: dict  # name -> tuple of axis-0 sizes, one per rank (distributed names only)
    # made from the above once (every compute_totals reads them):
    differentiable: dict = dataclasses.field(init=False, compare=False)  # floating names
    _sizes: dict = dataclasses.field(init=False, repr=False, compare=False)
    _offsets: dict = dataclasses.field(init=False, repr=False, compare=False)

    def spec(self, name: str) -> jax.ShapeDtypeStruct:
        """**Returns:** the local `jax.ShapeDtypeStruct` of input or output `name`."""
        return self.inputs[name] if name in self.inputs else self.outputs[name]

    def __post_init__(self) -> None:
        sizes = {}
        for name, spec in {**self.inputs, **self.outputs}.items():
            tail = math.prod(spec.shape[1:]) if spec.shape else 1
            sizes[name] = (sum(self.counts[name]) * tail if name in self.counts
                           else math.prod(spec.shape))
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_offsets", {})
        object.__setattr__(self, "differentiable", {
            which: tuple(k for k, s in specs.items() if inexact_dtype(s.dtype))
            for which, specs in (("inputs", self.inputs), ("outputs", self.outputs))})

    def global_size(self, name: str) -> int:
        """**Returns:** the flat size of `name` over all ranks (its own if replicated)."""
        return self._sizes[name]

    def offsets(self, names: tuple) -> tuple:
        """**Returns:** where each of `names` (a tuple) starts in their global flat
        vectors side by side, and their total size (cached: every compute_totals reads
        them)."""
        found = self._offsets.get(names)
        if found is None:
            found = self._offsets[names] = tuple(
                itertools.accumulate((self._sizes[n] for n in names), initial=0))
        return found

    def local_rows(self, name: str, rank: int) -> tuple[int, int]:
        """**Returns:** (start, stop) of this rank's flat entries within `name`'s global
        flat vector (all of it if replicated)."""
        if name not in self.counts:
            return 0, self.global_size(name)
        spec = self.spec(name)
        tail = math.prod(spec.shape[1:])
        start = sum(self.counts[name][:rank]) * tail
        return start, start + self.counts[name][rank] * tail


@dataclasses.dataclass(frozen=True)
class TracingInputs:
    """What tracing needs of a `Layout` before the layout exists: the inputs."""

    inputs: dict



def seeds(of: tuple, layout: Layout, rank: int, specs_only: bool = False) -> tuple:
    """One unit cotangent per global row of the requested outputs: a row of a
    distributed output only on the rank that owns it, a row of a replicated output on
    every rank; zeros for the other outputs, so every operator's VJP runs whatever
    `of` asks for. Packed as one (rows, columns) array per dtype, the outputs' columns
    side by side (`split_seeds` undoes it in the program). Program arguments, not
    constants: XLA would spend long constant-folding them in unrolled programs."""
    sizes = {o: layout.global_size(o) for o in of}
    offsets = dict(zip(of, np.cumsum([0] + [sizes[o] for o in of])))
    total = sum(sizes.values())
    groups = seed_groups(layout)
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


def tangent_seeds(wrt: tuple, layout: Layout, rank: int, specs_only: bool = False) -> tuple:
    """One unit tangent per global entry of the requested inputs, for forward sweeps:
    an entry of a distributed input only on the rank that owns it (zeros on the
    others, which run the sweep all the same), of a replicated input on every rank.
    One (entries, *local shape) array per input of `wrt`, in order."""
    sizes = [layout.global_size(w) for w in wrt]
    total = sum(sizes)
    shapes = [(total, *layout.inputs[w].shape) for w in wrt]
    if specs_only:
        return tuple(jax.ShapeDtypeStruct(s, layout.inputs[w].dtype)
                     for w, s in zip(wrt, shapes))
    packed, offset = [], 0
    for w, size, shape in zip(wrt, sizes, shapes):
        seed = np.zeros((total, math.prod(shape[1:])), layout.inputs[w].dtype)
        start, stop = layout.local_rows(w, rank)
        seed[offset + np.arange(start, stop), np.arange(stop - start)] = 1
        packed.append(seed.reshape(shape))
        offset += size
    return tuple(packed)


def unit_seeds(of: tuple, layout: Layout, distributed: frozenset, size: int) -> tuple:
    """**Returns:** the indices of the packed seeds of `seeds` that are identity
    matrices, the same on every rank: `of` is every output of that dtype, in
    order, and no output is distributed (a rank's seeds would then hold its own
    rows only, and the program rewrite, which can change how calls fuse, must be
    the same everywhere)."""
    if size > 1 and any(k in distributed for k in layout.outputs):
        return ()
    return tuple(i for i, names in enumerate(seed_groups(layout).values())
                 if list(of) == names)


def split_seeds(packed: tuple, layout: Layout) -> dict:
    """The per-output cotangent seeds of `seeds`, inside the program."""
    found, total = {}, None
    for seed, names in zip(packed, seed_groups(layout).values()):
        total, column = seed.shape[0], 0
        for name in names:
            spec = layout.outputs[name]
            n = math.prod(spec.shape)
            found[name] = seed[:, column:column + n].reshape((total,) + spec.shape)
            column += n
    for name, spec in layout.outputs.items():
        if name not in found:
            found[name] = np.zeros((total,) + spec.shape, jax.dtypes.float0)
    return {name: found[name] for name in layout.outputs}


def row(seeds: Any, i: int) -> Any:
    """Row `i` of a batch of seeds: an array even where the seeds are `float0` (the
    cotangent of an integer output), which numpy would index to a scalar JAX refuses."""
    if seeds.dtype == jax.dtypes.float0:
        return np.zeros(seeds.shape[1:], seeds.dtype)
    return seeds[i]


def seed_groups(layout: Layout) -> dict:
    """dtype -> the floating-point outputs of that dtype, in the layout's order: one
    packed seed array each (see `seeds`)."""
    groups: dict = {}
    for name, spec in layout.outputs.items():
        if inexact_dtype(spec.dtype):
            groups.setdefault(np.dtype(spec.dtype), []).append(name)
    return groups
