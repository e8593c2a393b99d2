"""A program's results packed into one flat array per dtype, and unpacked as views."""

import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


def _group(name: Any, dtype: Any) -> tuple[np.dtype, str | None]:
    """The packed array (see `pack`) that output `name` goes to: one per dtype, and per
    kind of output where the names say (`("value", k)`, `("total", k)`): XLA leaves out
    a concatenation of a vector's own slices, not one of slices and other values."""
    return np.dtype(dtype), name[0] if isinstance(name, tuple) else None


def pack(values: dict) -> tuple:
    """Concatenate a dict of arrays into few flat arrays (`_group`): a program with few
    outputs dispatches faster than one with many."""
    groups: dict = {}
    for k, v in values.items():
        groups.setdefault(_group(k, v.dtype), []).append(v.ravel())
    return tuple(jnp.concatenate(g) if len(g) > 1 else g[0] for g in groups.values())


def unpack(arrays: Sequence[Any], plan: tuple) -> dict:
    """The inverse of `pack`, as read-only numpy views of the program's results.

    **Arguments:**
    - `arrays`: the packed results.
    - `plan`: from `unpack_plan`.
    """
    groups = [np.asarray(a) for a in arrays]  # read-only views on CPU: no copy
    return {k: groups[g][index] if shape is None else groups[g][index].reshape(shape)
            for k, g, index, shape in plan}


def unpack_plan(outputs: dict) -> tuple:
    """**Returns:** (name, group, index, shape) for every output of `pack`: its packed
    array is `group`, and it is that array's `[index]`, reshaped to `shape` unless None.
    A scalar is indexed `[i, ...]`, one numpy operation for its 0-d view (a slice then
    a reshape costs more; see docs/performance.md)."""
    groups: dict = {}
    plan: list[tuple] = []
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
