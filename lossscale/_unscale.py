"""The gradients' numerics: unscaling, the finite check, the dtype policy.

`unscale_factors(scale)` and `unscale(grads, factors)` give the gradients
times `1 / loss_scale` in float32 or wider (two factors above 2**126, whose
float32 reciprocal is subnormal, so the result is still exact);
`all_finite(tree, factor)` checks `tree * factor` without writing it; and
the dtypes a step computes and stores in: `widen` (float32 or wider),
`cast_like` (back to the dtypes `inner.init(params)` gave the state), and
`widen_float16` (float16 parameters get float32 state: float16 moments
underflow). `lossscale.unscale_gradients` and the wrappers share these, so
what a user logs is bit for bit what the inner optimizer is fed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _jax_internals

# The largest scale whose float32 reciprocal is normal (2**-126).
_LARGEST_NORMAL_RECIPROCAL = 2.0**126


def is_array(x: Any) -> bool:
  """True for JAX arrays (tracers included) and NumPy arrays and scalars."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_inexact(x: Any) -> bool:
  """True for floating and complex array leaves (those a finite check reads)."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def numbers_as_arrays(tree: Any) -> Any:
  """`tree` with Python float and complex leaves as arrays, as `jax.jit`
  would pass them, so that they are unscaled and checked like arrays."""
  return jax.tree.map(
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


def cast_like(new: Any, old: Any) -> Any:
  """Casts the inexact leaves of `new` to the dtypes of `old`'s leaves
  (bfloat16 moments stay bfloat16); `new` as it is where the trees differ."""
  # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
  new_def: Any = jax.tree.structure(new)
  if new_def != jax.tree.structure(old):
    return new
  return jax.tree.map(
    lambda n, o: (
      n.astype(o.dtype) if is_inexact(n) and is_inexact(o) and n.dtype != o.dtype else n
    ),
    new,
    old,
  )


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
  # two factors back into one subnormal that the CPU flushes to zero: an
  # optimization barrier keeps them apart, where JAX can batch one (not
  # jax 0.4.35, where `lax.cond` under `vmap` batches every operand).
  # Computed where the scale is: from a constant scale, factors computed
  # inside a call of their own were merged on XLA:CPU, which drops the
  # barrier before fusion.
  if _jax_internals.BARRIER_BATCHES:
    return jax.lax.optimization_barrier((pre, inv))
  return pre, inv


def unscale(
  grads: Any,
  factors: tuple[jax.Array, ...],
  *,
  keep_dtype: bool = False,
  zero_unless: jax.Array | None = None,
) -> Any:
  """`grads * (1 / loss_scale)` in the wider of float32 and each leaf's dtype,
  `factors` being `unscale_factors(loss_scale)`; other leaves pass through.

  With `keep_dtype` each leaf is cast back to its own dtype (with a scale of
  1, every leaf bit for bit). With `zero_unless`, a flag, every leaf is
  zeros where the flag is false (a select: an inf or NaN never gets through).
  """
  zero = lambda u: (
    u if zero_unless is None else jnp.where(zero_unless, u, jnp.zeros_like(u))
  )
  cast = lambda u, g: u.astype(g.dtype) if keep_dtype else u
  return jax.tree.map(
    lambda g: cast(zero(scale_leaf(g, *factors)), g) if is_inexact(g) else g, grads
  )


def scale_leaf(x: jax.Array, *factors: jax.Array) -> jax.Array:
  """`x` times `factors` in turn, in the wider of float32 and its dtype."""
  dtype = jnp.float32 if jnp.finfo(x.dtype).bits < 32 else x.dtype
  x = x.astype(dtype)
  for factor in factors:
    x = x * factor.astype(dtype)
  return x


def squares(x: jax.Array) -> jax.Array:
  """`|x|**2` elementwise, in the wider of float32 and `x`'s dtype."""
  x = x.astype(jnp.float32) if jnp.finfo(x.dtype).bits < 32 else x
  return jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x


def sum_of_squares(tree: Any) -> jax.Array:
  """The sum of `|x|**2` over the inexact leaves of `tree`, float32: one
  reduction per leaf (the speed layer's `finite` groups small leaves)."""
  sums = [jnp.sum(squares(x)).astype(jnp.float32) for x in inexact_leaves(tree)]
  return sum(sums, jnp.zeros([], jnp.float32))


def global_norm(grads: Any, factors: tuple[jax.Array, ...]) -> jax.Array:
  """The global norm of `unscale(grads, factors)` in float32, the unscaled
  gradients never written."""
  sums = [
    jnp.sum(squares(scale_leaf(x, *factors))).astype(jnp.float32)
    for x in inexact_leaves(grads)
  ]
  return jnp.sqrt(sum(sums, jnp.zeros([], jnp.float32)))


def inexact_leaves(tree: Any) -> list[jax.Array]:
  """The floating and complex leaves of `tree`, Python numbers as arrays."""
  return [x for x in jax.tree.leaves(numbers_as_arrays(tree)) if is_inexact(x)]


def all_finite(tree: Any, factor: jax.Array | None = None) -> jax.Array:
  """Whether every element of `tree` (times `factor`, each leaf multiplied
  in the wider of float32 and its dtype, never written) is finite: one
  reduction per leaf (`lossscale.all_finite` is this, or the speed layer's
  grouped check, which gives the same flag)."""
  number = lambda x: jnp.asarray(x) if isinstance(x, (float, complex)) else x
  leaves = [number(x) for x in jax.tree.leaves(tree)]
  leaves = [x for x in leaves if is_inexact(x)]
  if not leaves:
    return jnp.array(True)
  times = (lambda x: x) if factor is None else (lambda x: scale_leaf(x, factor))
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(times(x))) for x in leaves]))
