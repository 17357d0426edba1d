"""Which leaves count, and the dtypes a step computes and stores them in.

The dtype policy of the wrappers: half-precision gradients are unscaled in
float32 and the inner optimizer runs in float32 on widened copies of its
state and the parameters (`widens`); its state is stored back in the dtypes
`inner.init(params)` gave it (`cast_like`), except that float16 parameters
get float32 state (`widen_float16`: float16 moments underflow).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_array(x: Any) -> bool:
  """True for JAX arrays (tracers included) and NumPy arrays and scalars."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


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


def compute_dtype(dtype: Any) -> Any:
  """The wider of float32 and `dtype` (by hand: strict promotion forbids
  `promote_types(float32, float16)`); complex dtypes are wide enough."""
  return dtype if jnp.finfo(dtype).bits >= 32 else jnp.dtype(jnp.float32)


def is_half(x: Any) -> bool:
  return is_inexact(x) and compute_dtype(x.dtype) != x.dtype


def widen(tree: Any) -> Any:
  """Casts the inexact leaves of `tree` to the wider of float32 and their dtype."""
  return jax.tree.map(
    lambda x: x.astype(compute_dtype(x.dtype)) if is_inexact(x) else x, tree
  )


def widen_float16(tree: Any) -> Any:
  """`tree` with its float16 leaves in float32 (bfloat16 and others kept)."""
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if is_inexact(x) and x.dtype == jnp.float16 else x,
    tree,
  )


def widens(enabled: bool, updates: Any, params: Any) -> bool:
  """Whether the inner optimizer runs in float32 on wider copies.

  Half-precision gradients are unscaled in float32; the inner optimizer
  then runs in float32 throughout (its state and the params widened too:
  some optax optimizers cannot mix dtypes), and its state is stored back in
  the dtypes it had. `enabled=False` hands `inner` the gradients' own
  dtypes, exactly `inner`, except for float16 parameters, whose state is
  float32 either way.
  """
  if enabled:
    return any(is_half(x) for x in jax.tree_util.tree_leaves((updates, params)))
  return any(
    is_inexact(x) and x.dtype == jnp.float16 for x in jax.tree_util.tree_leaves(params)
  )


def cast_like(new: Any, old: Any) -> Any:
  """Casts the inexact leaves of `new` to the dtypes of `old`'s leaves.

  The inner optimizer computes from float32 gradients; this keeps its state
  in the dtypes `inner.init(params)` chose (bfloat16 moments stay bfloat16).
  """
  # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
  new_def: Any = jax.tree.structure(new)
  if new_def != jax.tree.structure(old):
    return new

  def leaf(n, o):
    if is_inexact(n) and is_inexact(o) and n.dtype != o.dtype:
      return n.astype(o.dtype)
    return n

  return jax.tree.map(leaf, new, old)


def same_structure(a: Any, b: Any) -> bool:
  a_def: Any = jax.tree.structure(a)  # Any: see `cast_like`
  return a is not None and a_def == jax.tree.structure(b)
