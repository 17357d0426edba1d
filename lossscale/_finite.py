"""Finiteness checks over pytrees."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_inexact(x: Any) -> bool:
  """True for floating and complex array leaves (those a finite check reads)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def numbers_as_arrays(tree: Any) -> Any:
  """`tree` with Python float and complex leaves as arrays, as `jax.jit`
  would pass them, so that they are unscaled and checked like arrays."""
  return jax.tree_util.tree_map(
    lambda x: jnp.asarray(x) if isinstance(x, (float, complex)) else x, tree
  )


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
  leaves = jax.tree_util.tree_leaves(numbers_as_arrays(tree))
  leaves = [x for x in leaves if is_inexact(x)]
  if not leaves:
    return jnp.array(True)
  if jax.debug_nans.value:
    # `jax.debug_nans` flags every NaN an operation produces, and the fast
    # check below makes one from each inf: check element by element instead.
    flags = [jnp.all(jnp.isfinite(x)) for x in leaves]
  else:
    # `sum(x * 0)` is 0 when every element is finite and NaN otherwise (inf * 0
    # is NaN, NaN propagates): a float reduction with no temporaries, where
    # `all(isfinite(x))` first writes a bool array per leaf (docs/performance.md).
    flags = [jnp.isfinite(jnp.sum(x * jnp.zeros([], x.dtype))) for x in leaves]
  return jnp.all(jnp.stack(flags))
