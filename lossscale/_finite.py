"""Finiteness checks over pytrees."""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Leaves larger than this are reduced one by one: XLA:CPU runs independent
# reductions side by side, and one kernel reading several large arrays is
# slower. Smaller leaves of one size and dtype are added up elementwise,
# `_GROUP` at a time, and reduced once: a reduction per leaf costs XLA a few
# milliseconds of compilation each, which dominated a thousand-leaf step.
_OWN_REDUCTION = 1 << 16
_GROUP = 32


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
  if jax.debug_nans.value:
    # `jax.debug_nans` flags every NaN an operation produces, and the fast
    # check below makes one from each inf: check element by element instead.
    return jnp.all(
      jnp.stack([jnp.all(jnp.isfinite(_times(x, factor))) for x in leaves])
    )
  # A float sum of `x - x` (or, with a factor, of `x * factor * 0`) is 0
  # when every element is finite and NaN otherwise: a reduction with no
  # temporaries, where `all(isfinite(x))` first writes a bool array per
  # leaf (docs/performance.md; on XLA:CPU see `cpu_reductions`). One flag
  # per group, joined in a chain of scalar ands, cheaper to compile than
  # stacking a thousand flags.
  return functools.reduce(operator.and_, _flags(leaves, factor))


def _flags(leaves: list[jax.Array], factor: Any) -> list[jax.Array]:
  """`_finite_flag(factor, *group)` for each group of leaves: small leaves
  of one shape and dtype `_GROUP` at a time, large ones alone. Leaves are
  combined and reduced in their own shapes: flattening a leaf sharded on
  another than its first dimension makes XLA gather it whole."""
  flags: list[jax.Array] = []
  groups: dict[tuple[Any, Any], list[jax.Array]] = {}
  for x in leaves:
    if x.size > _OWN_REDUCTION:
      flags.append(_finite_flag(factor, x))
    else:
      groups.setdefault((x.shape, x.dtype), []).append(x)
  for same in groups.values():
    for i in range(0, len(same), _GROUP):
      flags.append(_finite_flag(factor, *same[i : i + _GROUP]))
  return flags


def _finite_flag(factor: Any, *leaves: jax.Array) -> jax.Array:
  return _finite_flag_for(cpu_reductions(), factor, *leaves)


@functools.partial(jax.jit, static_argnums=0, inline=True)
def _finite_flag_for(cpu: bool, factor: Any, *leaves: jax.Array) -> jax.Array:
  # Jitted: traced once per group signature, not once per leaf, and one
  # call in the step's jaxpr per group.
  dtype = compute_dtype(leaves[0].dtype)
  xs = [x.astype(dtype) for x in leaves]
  if factor is not None and not cpu:
    # One sum, with the factor: one scalar all-reduce under SPMD sharding.
    # `t - t`, not `t * 0`: with a constant factor XLA reassociates
    # `(x * factor) * 0` into `x * 0`, and an overflow is lost.
    ts = [x * factor.astype(dtype) for x in xs]
    return _is_zero([t - t for t in ts])
  if factor is None:
    return _is_zero([x - x for x in xs])
  # XLA:CPU: one pass that takes no scalar operand (see `cpu_reductions`).
  # `max` alone is no check: XLA:CPU's vectorized `max` drops NaN.
  zeros = _real(functools.reduce(operator.add, [x - x for x in xs]))
  largest = functools.reduce(jnp.maximum, [_magnitude(x) for x in xs])
  zero, largest = jax.lax.reduce(
    (zeros, largest),
    (jnp.zeros([], zeros.dtype), jnp.zeros([], largest.dtype)),
    lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
    tuple(range(zeros.ndim)),
  )
  return jnp.isfinite(zero) & jnp.isfinite(largest * factor.astype(largest.dtype))


def cpu_reductions() -> bool:
  """Whether the finite check is formulated for XLA:CPU's reductions.

  XLA:CPU hands a large reduction to a YNNPACK kernel, which takes every
  operand full size: the scalars of `sum(x * factor * 0)` were written out
  as leaf-sized arrays and read again by every leaf's reduction (a third
  of the bytes of a bfloat16 step). On CPU the check therefore reduces
  `x - x` and `abs(x)` in one variadic reduction, which has no scalar
  operand; under SPMD sharding XLA gathers its two partial results instead
  of one all-reduce. Elsewhere (GPU, TPU) the scalars fuse into the
  reduction, and the check is the one sum.
  """
  return jax.default_backend() == "cpu"


def _is_zero(zeros: list[jax.Array]) -> jax.Array:
  # Elementwise 0 or NaN: added up, reduced once, checked.
  return jnp.isfinite(jnp.sum(_real(functools.reduce(operator.add, zeros))))


def _real(x: jax.Array) -> jax.Array:
  return jnp.real(x) + jnp.imag(x) if jnp.iscomplexobj(x) else x  # NaN in either


def _magnitude(x: jax.Array) -> jax.Array:
  if jnp.iscomplexobj(x):  # |x| itself can overflow for finite parts
    return jnp.maximum(jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x)))
  return jnp.abs(x)


def _times(x: jax.Array, factor: Any) -> jax.Array:
  return x if factor is None else scale_leaf(x, factor)


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


def compute_dtype(dtype: Any) -> Any:
  """The wider of float32 and `dtype` (by hand: strict promotion forbids
  `promote_types(float32, float16)`); complex dtypes are wide enough."""
  return dtype if jnp.finfo(dtype).bits >= 32 else jnp.dtype(jnp.float32)
