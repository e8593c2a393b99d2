"""Pytree inputs of a Problem: each input that is a tree of arrays (a dict of them, an
equinox model's parameters) is flattened to one input per leaf, named after the input
and the leaf's `jax.tree_util.keystr` path (`params['w']`), and put back together for
the model."""

import numbers
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np


def is_tree(value: Any) -> bool:
    """**Returns:** whether an input value is a tree of arrays rather than one array: a
    dict, a list or tuple holding anything but numbers, or another JAX pytree node (an
    equinox Module, say). A list of numbers stays an array, as numpy reads it."""
    if isinstance(value, (np.ndarray, jax.Array, numbers.Number, str, bytes)):
        return False
    if isinstance(value, dict):
        return True
    if isinstance(value, (list, tuple)):
        return not all(isinstance(v, numbers.Number) for v in value)
    leaves = jax.tree_util.tree_leaves(value)
    return len(leaves) != 1 or leaves[0] is not value


class Trees:
    """The tree inputs of one Problem: their structures and their leaves' names.

    **Arguments:**
    - `inputs`: the Problem's inputs, name -> array or tree of arrays.
    """

    def __init__(self, inputs: dict[str, Any]) -> None:
        self.structures: dict[str, Any] = {}  # tree input -> its treedef
        self.leaves: dict[str, tuple[str, ...]] = {}  # tree input -> its leaves' names
        for name, value in inputs.items():
            if is_tree(value):
                paths, treedef = jax.tree_util.tree_flatten_with_path(value)
                if not paths:
                    raise ValueError(f"Problem(inputs={{'{name}': ...}}): a tree with no "
                                     "arrays in it; pass at least one array.")
                self.structures[name] = treedef
                self.leaves[name] = tuple(name + jax.tree_util.keystr(p) for p, _ in paths)

    def flat(self, where: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """**Returns:** `inputs` with each tree input replaced by its leaves (by their
        names).

        **Arguments:**
        - `where`: the call, for messages.
        - `inputs`: name -> array or tree (a tree input's own structure).

        **Raises:** `ValueError` naming the input where a tree's structure differs from
        the Problem's.
        """
        found: dict[str, Any] = {}
        for name, value in inputs.items():
            treedef = self.structures.get(name)
            if treedef is None:
                found[name] = value
                continue
            leaves, given = jax.tree_util.tree_flatten(value)
            if given != treedef:
                raise ValueError(f"{where}: input {name!r} is a tree of another structure "
                                 f"than at the Problem's point ({given} against {treedef}); "
                                 "pass a tree of the same structure, or its leaves by "
                                 f"their names ({', '.join(self.leaves[name][:3])}, ...).")
            found.update(zip(self.leaves[name], leaves))
        return found

    def names(self, names: Iterable[str]) -> list[str]:
        """**Returns:** `names` with each tree input's name replaced by its leaves'."""
        return [leaf for n in names for leaf in self.leaves.get(n, (n,))]

    def expand(self, names: Any) -> Any:
        """**Returns:** a `wrt` argument (None, a name or several) with each tree input's
        name replaced by its leaves' names; as it is where it names no tree input."""
        if names is None or not self.leaves:
            return names
        many = ([names] if isinstance(names, str) else sorted(names)
                if isinstance(names, (set, frozenset)) else list(names))
        if not any(isinstance(n, str) and n in self.leaves for n in many):
            return names
        return self.names(many)

    def model(self, model: Callable[..., Any]) -> Callable[..., Any]:
        """**Returns:** `model` called with each tree input put back together from its
        leaves (`model` itself where there are no tree inputs)."""
        if not self.structures:
            return model
        structures, leaves = self.structures, self.leaves

        def called_with_trees(**flat: Any) -> Any:
            kwargs = {k: v for k, v in flat.items()
                      if not any(k in names for names in leaves.values())}
            for name, treedef in structures.items():
                kwargs[name] = jax.tree_util.tree_unflatten(
                    treedef, [flat[leaf] for leaf in leaves[name]])
            return model(**kwargs)

        return called_with_trees
