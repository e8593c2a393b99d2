"""Products with identity (or permutation) matrices replaced by the other factor.

A reverse sweep over K unit seeds starts with products like `seeds @ W`: with `seeds`
the identity, that is W itself, but XLA would compute it (docs/architecture.md,
"Products with unit seeds").
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Var, new_jaxpr_eqn

from ..jaxprs import shaped
from .base import Context, LocalPass


class DropIdentityProducts(LocalPass[tuple[int, ...]]):
    """Products with the program's identity inputs (the unit seeds) dropped.

    Proposal and decision: the positions of the inputs that hold identity matrices.
    """

    def analyse(self, program: ClosedJaxpr, context: Context) -> tuple[int, ...]:
        """**Returns:** the positions of `program`'s inputs that hold identities."""
        return context.identities

    def apply(self, program: ClosedJaxpr, decision: tuple[int, ...]) -> ClosedJaxpr:
        """**Returns:** `program` without its products with those inputs."""
        identities = {program.jaxpr.invars[i] for i in decision}
        return drop_identity_products(program, identities) or program


def drop_identity_products(closed_jaxpr: ClosedJaxpr, identities: set[Var],
                           permutations: dict[Var, np.ndarray] | None = None,
                           ) -> ClosedJaxpr | None:
    """The program with every product of an identity matrix and another array replaced
    by that array (transposed where the product's dimension order asks for it), and
    every product of a permutation matrix known ahead and another array by that array's
    entries in the permuted order.

    With the seeds in another order (the matvec's objectives `f0`, `f1`, ..., `f10` are
    seeded in the order of their names), the product is W's rows in that order. The
    result is the exact product (where W holds infinities or NaNs, it is the derivative
    where the product would spread NaN; a negative zero of W stays one).

    **Arguments:**
    - `closed_jaxpr`: the traced program.
    - `identities`: its variables (inputs or constants) that hold identity matrices.
    - `permutations`: its constants that hold permutation matrices: variable -> value.

    **Returns:** the rewritten `ClosedJaxpr`, or None if it has no such product.
    """
    permutations = permutations or {}
    if not identities and not permutations:
        return None
    jaxpr, eqns, dropped = closed_jaxpr.jaxpr, [], False
    rename: dict[Var, Var] = {}
    constvars, consts = list(jaxpr.constvars), list(closed_jaxpr.consts)
    for eqn in jaxpr.eqns:
        if rename:
            eqn = eqn.replace(invars=[rename.get(v, v) if isinstance(v, Var) else v
                                      for v in eqn.invars])
        found = _identity_product(eqn, identities, permutations)
        if found is None:
            eqns.append(eqn)
            continue
        other, permutation = found
        dropped = True
        if permutation is None:
            rename[eqn.outvars[0]] = other
        elif isinstance(permutation, tuple):
            eqns.append(new_jaxpr_eqn([other], eqn.outvars, lax.transpose_p,
                                      {"permutation": permutation}, set(), eqn.source_info,
                                      eqn.ctx))
        else:  # a function of `other`: its equations, inlined
            inner = jax.make_jaxpr(permutation)(
                jax.ShapeDtypeStruct(shaped(other).shape, shaped(other).dtype))
            constvars += inner.jaxpr.constvars
            consts += inner.consts
            inside = {inner.jaxpr.invars[0]: other}
            for e in inner.jaxpr.eqns:
                eqns.append(e.replace(invars=[inside.get(v, v) if isinstance(v, Var) else v
                                              for v in e.invars]))
            rename[eqn.outvars[0]] = inside.get(inner.jaxpr.outvars[0],
                                                inner.jaxpr.outvars[0])
    if not dropped:
        return None
    outvars = [rename.get(v, v) if isinstance(v, Var) else v for v in jaxpr.outvars]
    new = Jaxpr(constvars, jaxpr.invars, outvars, eqns, jaxpr.effects, jaxpr.debug_info)
    return ClosedJaxpr(new, consts)


# how a product follows from its other factor: see `_identity_product`
Product = tuple[int, ...] | Callable[[jax.Array], jax.Array] | None


def _identity_product(eqn: JaxprEqn, identities: set[Var],
                      permutations: dict[Var, np.ndarray],
                      ) -> tuple[Var, Product] | None:
    """**Returns:** (the other factor, how the product follows from it) if `eqn`
    multiplies an identity or permutation matrix with another array (a `dot_general`
    contracting one axis, no batch axes, same dtype); else None. How: None (the other
    factor itself), the permutation of its axes (a tuple), or a function of it."""
    if eqn.primitive is not lax.dot_general_p:
        return None
    (contract_l, contract_r), batch = eqn.params["dimension_numbers"]
    if any(batch) or len(contract_l) != 1:
        return None
    out = shaped(eqn.outvars[0])
    lhs, rhs = eqn.invars
    for unit, other, axis, first, own in ((lhs, rhs, contract_r[0], True, contract_l[0]),
                                          (rhs, lhs, contract_l[0], False, contract_r[0])):
        if not (isinstance(unit, Var) and isinstance(other, Var)
                and other not in identities and other not in permutations
                and shaped(other).dtype == out.dtype):
            continue
        rest = [a for a in range(shaped(other).ndim) if a != axis]
        permutation = [axis] + rest if first else rest + [axis]
        if unit in identities:
            if permutation == sorted(permutation):
                return other, None
            return other, tuple(permutation)
        if unit in permutations:
            # the product's free axis of the matrix, entry i: the other factor's entry
            # order[i] along the contracted axis (first or last, as dot_general puts it)
            order = np.argmax(permutations[unit], axis=own)
            return other, functools.partial(_permuted, order=order, axis=axis,
                                            to=0 if first else -1)
    return None


def _permuted(x: jax.Array, order: np.ndarray, axis: int, to: int) -> jax.Array:
    return jnp.moveaxis(jnp.take(x, order, axis=axis, mode="clip"), axis, to)
