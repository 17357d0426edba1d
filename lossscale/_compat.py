"""The few public-API spellings that differ across the supported JAX range.

lossscale supports jax 0.4.35 up to the newest release. Everything else in
the package uses spellings that exist at both ends (`jax.tree_util.*`,
`optax.safe_increment`); what does not is here, once. Uses of JAX's private
surface (jaxprs, tracer classes) are in `lossscale/_jax_internals.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes `x` varies over inside `shard_map` (empty outside).

  `x` is an array, a tracer or a `jax.ShapeDtypeStruct`. JAX releases before
  varying-axis types (`jax.typeof(x).vma`) have no such notion: empty there.
  """
  aval = x
  if not isinstance(x, jax.ShapeDtypeStruct) and hasattr(jax, "typeof"):
    aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def cast_to_varying(x: Any, axes: tuple) -> Any:
  """Marks `x` as varying over `axes` too (free: no communication)."""
  return jax.lax.pcast(x, axes, to="varying")


@functools.cache
def _barrier_batches() -> bool:
  """Whether this JAX can `vmap` an optimization barrier (jax 0.4.35 cannot)."""
  try:
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    jax.eval_shape(jax.vmap(jax.lax.optimization_barrier), spec)
  except Exception:
    return False
  return True


def hide_from_constant_folding(x: Any) -> Any:
  """`x`, behind an optimization barrier where JAX can batch one.

  XLA folds and reassociates products of constants: with a loss scale known
  at compile time it would merge two exact factors into one subnormal that
  the CPU flushes to zero. The barrier keeps the factors apart. A JAX that
  cannot batch the barrier (jax 0.4.35, where `lax.cond` under `vmap`
  batches every operand of its branches) gets `x` as it is.
  """
  return jax.lax.optimization_barrier(x) if _barrier_batches() else x
