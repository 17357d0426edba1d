"""Updates that rounding swallows: `swallowed_updates` and its result.

With bfloat16 or float16 parameters and no float32 master copy, an update
smaller than half a unit in the last place of its parameter leaves the
parameter unchanged. `swallowed_updates` measures how often that happens in
a step, per leaf and in total, as JAX arrays (no host sync).
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

# A leaf is counted in uint32, exactly, below 2**32 elements; a larger one in
# uint32 chunks of 2**20 elements, the chunks' counts added in float32.
_EXACT_BELOW = 2**32
_CHUNK = 2**20


class SwallowedUpdates(NamedTuple):
  """How many updates rounding swallowed ([`lossscale.swallowed_updates`][]).

  Attributes:
    fraction: float32 scalar: of the elements, over all leaves, whose update is
      non-zero and finite (on a finite parameter), the fraction that adding the
      update leaves unchanged. 0 when there are none.
    per_leaf: the same fraction for each leaf, in a tree with `params`'
      structure: a float32 scalar at every leaf (0 for a leaf with no such
      element: a non-floating parameter or update, a None update, all-zero
      updates), None where `params` has None.
  """

  fraction: jax.Array
  per_leaf: Any


def _is_none(x: Any) -> bool:
  return x is None


def _is_floating_array(x: Any) -> bool:
  """A JAX or NumPy array (or NumPy scalar) of a real floating dtype."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
    jnp.issubdtype(x.dtype, jnp.floating)
  )


def _check_trees(params: Any, updates: Any) -> list[tuple[Any, Any]]:
  """The `(parameter, update)` leaf pairs, None leaves included, or a
  `ValueError` naming both trees or the leaf whose shapes differ."""
  fn = "swallowed_updates"
  p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_none)
  u_leaves, u_def = jax.tree_util.tree_flatten(updates, is_leaf=_is_none)
  if cast(Any, u_def) != p_def:  # Any: no PyTreeDef stubs (see `cast_like`)
    raise ValueError(
      f"`{fn}(updates=...)` must have the tree structure of `params`, got"
      f" another instead:\n  params:  {p_def}\n  updates: {u_def}"
    )
  for (path, p), u in zip(p_leaves, u_leaves, strict=True):
    p_shape, u_shape = getattr(p, "shape", None), getattr(u, "shape", None)
    if p_shape is not None and u_shape is not None and p_shape != u_shape:
      where = jax.tree_util.keystr(path) or "the root"
      raise ValueError(
        f"`{fn}(updates=...)` must have the shapes of `params`, got shape"
        f" {u_shape} at {where} instead, where `params` has shape {p_shape}"
        " (one update per parameter element: a per-example leading axis is"
        " not accepted here)."
      )
  return [(p, u) for (_, p), u in zip(p_leaves, u_leaves, strict=True)]


def _count(mask: jax.Array) -> jax.Array:
  """The number of True elements of `mask`, as a float32 scalar."""
  if mask.size < _EXACT_BELOW:
    return jnp.sum(mask, dtype=jnp.uint32).astype(jnp.float32)
  flat = mask.reshape(-1)
  flat = jnp.pad(flat, (0, -flat.size % _CHUNK))
  chunks = jnp.sum(flat.reshape(-1, _CHUNK), axis=1, dtype=jnp.uint32)
  return jnp.sum(chunks.astype(jnp.float32))


def _leaf_counts(p: Any, u: Any) -> tuple[jax.Array, jax.Array]:
  """`(swallowed, moving)` counts of one leaf: the elements whose update is
  non-zero and finite on a finite parameter (`moving`), and those of them
  that adding the update leaves equal to the parameter (`swallowed`)."""
  p, u = jnp.asarray(p), jnp.asarray(u)
  # Exactly `optax.apply_updates`: add in the promoted dtype (the wider one),
  # round back to the parameter's dtype. "standard" is JAX's default, under
  # which optax adds mixed dtypes; it does not change same-dtype addition.
  with jax.numpy_dtype_promotion("standard"):
    new = jnp.asarray(p + u).astype(p.dtype)
  moving = (u != 0) & jnp.isfinite(u) & jnp.isfinite(p)
  # Compared as bits: XLA may keep a value in more precision than its dtype
  # (`xla_allow_excess_precision`), which could drop the rounding to
  # `p.dtype` from a float comparison; a bitcast needs the rounded bits.
  # Equal bits, or two zeros: -0.0 and 0.0 are the same value.
  uint = jnp.dtype(f"uint{8 * p.dtype.itemsize}")
  new_bits = jax.lax.bitcast_convert_type(new, uint)
  p_bits = jax.lax.bitcast_convert_type(p, uint)
  magnitude = np.array(2 ** (8 * p.dtype.itemsize - 1) - 1, uint)  # all but sign
  both_zero = ((new_bits & magnitude) == 0) & ((p_bits & magnitude) == 0)
  swallowed = moving & ((new_bits == p_bits) | both_zero)
  return _count(swallowed), _count(moving)


def _fraction(swallowed: jax.Array, moving: jax.Array) -> jax.Array:
  return jnp.where(moving > 0, swallowed / jnp.maximum(moving, 1.0), 0.0)


def swallowed_updates(params: Any, updates: Any) -> SwallowedUpdates:
  """The fraction of non-zero updates that the parameters' dtype rounds away.

  An element's update is *swallowed* when it is non-zero and finite, its
  parameter is finite, and `p + u`, computed as `optax.apply_updates`
  computes it (added in the wider of the two dtypes, under JAX's default
  dtype promotion, and rounded back to the parameter's dtype), equals `p`:
  the same bits, or both zeros (a zero parameter that the update would only
  turn into -0.0 has not moved). With bfloat16 parameters (8 significant
  bits) every update smaller than `2**-9 * |p|` is swallowed, and one up to
  `2**-8 * |p|` may be (where `p` lies between two powers of two decides);
  float16 (11 bits) swallows below `2**-12 * |p|`, float32 (24 bits) below
  `2**-25 * |p|` (for normal `p`). A parameter that stops training this way
  does so silently: the loss still falls through the others.

  The fraction counts only the elements that should move: its denominator is
  the elements whose update is non-zero and finite on a finite parameter
  (zero updates, inf/NaN updates and inf/NaN parameters are in neither
  count: rounding is not what went wrong there). With no such element, the
  fraction is 0, not NaN: a step that `lossscale` skipped (zero updates)
  gives 0. Leaves count when both parameter and update are floating arrays;
  the others (integer or boolean parameters, their None or float0 updates,
  Python numbers outside `jax.jit`, which makes them arrays) give 0 in
  `per_leaf`, and None parameters None. Only real floating dtypes count
  (complex leaves give 0). XLA on CPU flushes
  float32 and bfloat16 subnormals (below 2**-126) to zero, so there a
  subnormal update is a zero update.

  Works eagerly and under `jax.jit` and `jax.vmap` (no host sync); costs one
  pass over the parameters and updates. Log it every few hundred steps.

  Args:
    params: the parameters the updates are about to be added to.
    updates: the updates, as `tx.update` returns them: `params`' tree (None
      as the update of a non-floating parameter allowed), each leaf of its
      parameter's shape.

  Returns:
    A [`lossscale.SwallowedUpdates`][]: the `fraction` over all leaves, and
    `per_leaf`, the fraction of each leaf in `params`' structure (float32).

  Raises:
    ValueError: when `updates` does not have `params`' tree structure, or a
      leaf's shape differs from its parameter's (per-example updates with a
      leading batch axis included).

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> params = {"scale": jnp.ones(4), "w": jnp.full(4, 0.01)}
    >>> params = ls.cast_floating(params, jnp.bfloat16)  # no float32 copy
    >>> updates = {"scale": jnp.full(4, -1e-4), "w": jnp.full(4, -1e-4)}
    >>> report = ls.swallowed_updates(params, updates)
    >>> report.fraction  # 1e-4 is under half the bfloat16 gap below 1.0, 2**-9
    Array(0.5, dtype=float32)
    >>> report.per_leaf
    {'scale': Array(1., dtype=float32), 'w': Array(0., dtype=float32)}
    >>> master = ls.cast_floating(params, jnp.float32)  # float32 moves them all
    >>> ls.swallowed_updates(master, updates).fraction
    Array(0., dtype=float32)
  """
  pairs = _check_trees(params, updates)
  per_leaf: list[jax.Array | None] = []
  total_swallowed, total_moving = [], []
  for p, u in pairs:
    if p is None:
      per_leaf.append(None)
    elif _is_floating_array(p) and _is_floating_array(u):
      swallowed, moving = _leaf_counts(p, u)
      per_leaf.append(_fraction(swallowed, moving))
      total_swallowed.append(swallowed)
      total_moving.append(moving)
    else:
      per_leaf.append(jnp.zeros([], jnp.float32))
  zero = jnp.zeros([], jnp.float32)  # a float32 start keeps `sum` an Array
  fraction = _fraction(sum(total_swallowed, zero), sum(total_moving, zero))
  p_def = jax.tree.structure(params, is_leaf=_is_none)
  return SwallowedUpdates(fraction, jax.tree.unflatten(p_def, per_leaf))
