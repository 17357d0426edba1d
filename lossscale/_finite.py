"""The finite check: whether every element of a pytree is finite.

`all_finite` is public; `all_finite_times(tree, factor)` is the wrapper's
check of the unscaled gradients without writing them. The plain check
reduces each leaf; the speed layer's (`lossscale/_speed/finite.py`) gives
the same flag with fewer reductions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lossscale import _speed
from lossscale._dtypes import is_inexact, numbers_as_arrays
from lossscale._speed import finite as _fast
from lossscale._unscale import scale_leaf


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: whether every element of `tree` is finite.

  Floating and complex leaves (arrays and Python numbers) are checked;
  integer, boolean and `float0` leaves are always finite and are ignored.
  An empty tree (or one with no floating leaves) is finite. It creates no
  NaN of its own: under `jax.debug_nans`, gradients that hold an inf do not
  trip it.

  Args:
    tree: a pytree of arrays.

  Returns:
    A `bool` scalar array, `True` iff no leaf holds an inf or a NaN.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> ls.all_finite({"w": jnp.ones(3), "b": jnp.zeros(2)})
    Array(True, dtype=bool)
    >>> ls.all_finite({"w": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
    >>> ls.all_finite({})
    Array(True, dtype=bool)
  """
  return all_finite_times(tree, None)


def all_finite_times(tree: Any, factor: jax.Array | None) -> jax.Array:
  """`all_finite(tree * factor)`, each leaf multiplied in the wider of
  float32 and its dtype, without writing the products (`factor` None: 1)."""
  leaves = jax.tree_util.tree_leaves(numbers_as_arrays(tree))
  leaves = [x for x in leaves if is_inexact(x)]
  if not leaves:
    return jnp.array(True)
  # `jax.debug_nans` flags every NaN an operation produces, and the speed
  # layer's check makes one from each inf: it gets the plain one.
  if _speed.on("finite") and not jax.debug_nans.value:
    return _fast.all_finite_times(leaves, factor)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(_times(x, factor))) for x in leaves]))


def _times(x: jax.Array, factor: Any) -> jax.Array:
  return x if factor is None else scale_leaf(x, factor)
