"""Finiteness checks over pytrees."""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _speed

# Leaves larger than this are reduced one by one: XLA:CPU runs independent
# reductions side by side, and one kernel reading several large arrays is
# slower. Smaller leaves of one size and dtype are added up elementwise,
# `_GROUP` at a time, and reduced once: a reduction per leaf costs XLA a few
# milliseconds of compilation each, which dominated a thousand-leaf step.
# It costs no step time (in-process A/B, XLA:CPU, jaxlib 0.12.0.1, 25M
# float32 AdamW: apply_gradients 1.16x of bare grouped, 1.24x a reduction
# per leaf).
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
  float32 and its dtype, without writing the products (`factor` None: 1).

  Small leaves, checked in groups, are multiplied by the factor whatever it
  is. A large leaf is checked as it is when the factor is at most 1, which
  cannot turn a finite element into an infinite one (rounding is monotone),
  and multiplied only when it is above 1 (a loss scale below 1): a
  reduction with a scalar operand costs XLA:CPU a broadcast of it per leaf
  shape (docs/performance.md, "The finite check"). The choice is a
  `lax.cond` on the factor over the large leaves only: over a thousand
  small leaves it would compile the check twice, for a step time the
  product does not change.
  """
  leaves = jax.tree_util.tree_leaves(numbers_as_arrays(tree))
  leaves = [x for x in leaves if is_inexact(x)]
  if not leaves:
    return jnp.array(True)
  if jax.debug_nans.value or not _speed.on():
    # The plain check (`LOSSSCALE_PLAIN=1`). `jax.debug_nans` flags every
    # NaN an operation produces, and the fast check below makes one from
    # each inf: it gets this one too.
    return jnp.all(
      jnp.stack([jnp.all(jnp.isfinite(_times(x, factor))) for x in leaves])
    )
  large = [x for x in leaves if x.size > _OWN_REDUCTION]
  flags = _group_flags([x for x in leaves if x.size <= _OWN_REDUCTION], factor)
  if large and factor is None:
    flags += _large_flags(large, None)
  elif large and factor is not None:
    small = factor <= 1
    if isinstance(small, jax.core.Tracer):
      flags.append(
        jax.lax.cond(
          small,
          lambda: _and(_large_flags(large, None)),
          lambda: _and(_large_flags(large, factor)),
        )
      )
    else:  # outside any trace: decided here
      flags += _large_flags(large, None if small else factor)
  return _and(flags)


def _and(flags: list[jax.Array]) -> jax.Array:
  # A chain of scalar ands, cheaper to compile than stacking a thousand flags.
  return functools.reduce(operator.and_, flags)


def _large_flags(leaves: list[jax.Array], factor: Any) -> list[jax.Array]:
  # One reduction per leaf: XLA:CPU runs independent reductions side by
  # side, and one kernel reading several large arrays is slower.
  return [_finite_flag(factor, x) for x in leaves]


def _group_flags(leaves: list[jax.Array], factor: Any) -> list[jax.Array]:
  """`_finite_flag(factor, *group)` for small leaves of one shape and dtype,
  `_GROUP` at a time. Leaves are combined and reduced in their own shapes:
  flattening a leaf sharded on another than its first dimension makes XLA
  gather it whole."""
  groups: dict[tuple[Any, Any], list[jax.Array]] = {}
  for x in leaves:
    groups.setdefault((x.shape, x.dtype), []).append(x)
  return [
    _finite_flag(factor, *same[i : i + _GROUP])
    for same in groups.values()
    for i in range(0, len(same), _GROUP)
  ]


@functools.partial(jax.jit, inline=True)
def _finite_flag(factor: Any, *leaves: jax.Array) -> jax.Array:
  # A float sum of `x - x` (or, with a factor, of `t - t` for `t = x *
  # factor`) is 0 when every element is finite and NaN otherwise: a
  # reduction with no temporaries, where `all(isfinite(x))` first writes a
  # bool array per leaf. (The largest magnitude would say more, but a
  # vectorized max on XLA:CPU loses NaNs.) Jitted: traced once per group
  # signature, not once per leaf, and one call in the step's jaxpr per group.
  xs = list(leaves)
  if factor is not None:
    # In float32 or wider, where the unscaled gradients are computed.
    # `t - t`, not `t * 0`: with a constant factor XLA reassociates
    # `(x * factor) * 0` into `x * 0`, and an overflow is lost.
    dtype = compute_dtype(xs[0].dtype)
    xs = [x.astype(dtype) * factor.astype(dtype) for x in xs]
  # Without a factor, half-precision leaves are checked in their own dtype:
  # a conversion in both branches of the large leaves' conditional would be
  # hoisted out of it by XLA, and written out as a float32 copy.
  zeros = functools.reduce(operator.add, [x - x for x in xs])
  return jnp.isfinite(jnp.sum(_real(zeros)))


def _real(x: jax.Array) -> jax.Array:
  return jnp.real(x) + jnp.imag(x) if jnp.iscomplexobj(x) else x  # NaN in either


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
