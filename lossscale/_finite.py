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


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: whether every element of `tree` is finite.

  Floating and complex leaves are checked; integer, boolean and `float0`
  leaves are always finite and are ignored. An empty tree (or one with no
  floating leaves) is finite.

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
  # `sum(x * 0)` is 0 when every element is finite and NaN otherwise
  # (inf * 0 = NaN, NaN propagates). XLA:CPU runs this float reduction
  # without temporaries, where `all(isfinite(x))` materialises a bool array
  # per leaf first (25 MB for 25M parameters); see docs/performance.md.
  flags = [
    jnp.isfinite(jnp.sum(x * jnp.zeros([], x.dtype)))
    for x in jax.tree.leaves(tree)
    if is_inexact(x)
  ]
  if not flags:
    return jnp.array(True)
  return jnp.all(jnp.stack(flags))
