"""Unscaling: the gradients times `1 / loss_scale`, in float32 or wider.

`unscale_factors` gives the factors for a scale (two, so that a scale above
2**126, whose float32 reciprocal is subnormal, still unscales exactly),
`unscale` applies them, and `check_factor` is what the finite check
multiplies by. `lossscale.unscale_gradients` and the wrappers share them, so
what a user logs is bit for bit what the inner optimizer is fed.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lossscale import _compat
from lossscale._dtypes import compute_dtype, is_inexact

# The largest scale whose float32 reciprocal is normal (2**-126).
_LARGEST_NORMAL_RECIPROCAL = 2.0**126


def unscale_factors(loss_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two factors `unscale` multiplies by, in turn, for `loss_scale`.

  Above 2**126 the float32 reciprocal is subnormal, which XLA flushes to
  zero: there the gradients are first multiplied by 2**-64 (exact) and then
  by `2**64 / loss_scale`, the same rounding as `1 / loss_scale`. Below it
  the first factor is 1 and the result is `grads * (1 / loss_scale)` bit for
  bit.
  """
  f32 = jnp.float32
  big = loss_scale > f32(_LARGEST_NORMAL_RECIPROCAL)
  pre = jnp.where(big, f32(2.0**-64), f32(1.0))
  inv = jnp.where(big, f32(2.0**64), f32(1.0)) / loss_scale
  # A constant scale (state closed over by `jit`) must not let XLA merge the
  # two factors back into a subnormal one. Computed where the scale is:
  # from a constant scale, factors computed inside a call of their own were
  # merged on XLA:CPU, which drops the barrier before fusion.
  return _compat.hide_from_constant_folding((pre, inv))


def unscale(
  grads: Any,
  factors: tuple[jax.Array, jax.Array],
  *,
  keep_dtype: bool = False,
  zero_unless: jax.Array | None = None,
) -> Any:
  """`grads * (1 / loss_scale)` in the wider of float32 and each leaf's dtype,
  `factors` being `unscale_factors(loss_scale)`.

  With `keep_dtype` each leaf is cast back to its own dtype: with a scale of
  1 that is every leaf bit for bit. With `zero_unless`, a flag, every leaf
  is zeros where the flag is false.
  """
  pre, inv = factors
  if zero_unless is not None:
    return jax.tree.map(
      lambda g: _unscale_leaf_or_zero(g, pre, inv, zero_unless) if is_inexact(g) else g,
      grads,
    )
  unscaled = _scale_leaves(grads, pre, inv)
  if not keep_dtype:
    return unscaled
  return jax.tree.map(
    lambda u, g: u.astype(g.dtype) if is_inexact(g) else u, unscaled, grads
  )


def check_factor(loss_scale: jax.Array) -> jax.Array:
  """The factor the finite check multiplies the gradients by: what
  `unscale` gives, as far as finiteness goes, in one multiply.

  Above 2**126 dividing by the scale cannot overflow, so the gradients are
  finite exactly when they are: they are checked as they are. One multiply
  per element keeps the check's fusion as lean as the bare finite check.
  """
  f32 = jnp.float32
  big = loss_scale > f32(_LARGEST_NORMAL_RECIPROCAL)
  return jnp.where(big, f32(1.0), f32(1.0) / loss_scale)


def _scale_leaves(grads: Any, *factors: jax.Array) -> Any:
  """Multiplies each inexact leaf by `factors` in turn, in the wider of
  float32 and its dtype; other leaves pass through."""
  return jax.tree.map(lambda g: scale_leaf(g, *factors) if is_inexact(g) else g, grads)


@functools.partial(jax.jit, inline=True)
def _unscale_leaf_or_zero(
  g: jax.Array, pre: jax.Array, inv: jax.Array, finite: jax.Array
) -> jax.Array:
  u = scale_leaf(g, pre, inv)
  return jnp.where(finite, u, jnp.zeros_like(u))


@functools.partial(jax.jit, inline=True)
def scale_leaf(x: jax.Array, *factors: jax.Array) -> jax.Array:
  """`x` times `factors` in turn, in the wider of float32 and its dtype.

  Jitted: traced once per leaf shape and dtype, however many leaves, and
  one call per leaf in the step's jaxpr (inlined).
  """
  dtype = compute_dtype(x.dtype)
  x = x.astype(dtype)
  for factor in factors:
    x = x * factor.astype(dtype)
  return x
