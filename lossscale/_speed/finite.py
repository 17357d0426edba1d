"""Speed layer: the finite check with small leaves in groups.

The plain check (`_unscale.all_finite`) reduces every leaf on its own, each
multiplied by the factor. This one adds small leaves of one shape and dtype
up elementwise, `_GROUP` at a time, and reduces once (a reduction per leaf
costs XLA a few milliseconds of compilation each, which dominated a
thousand-leaf step), and checks a large leaf without the product where the
factor cannot overflow it. Same flag, bit for bit. Off with
`LOSSSCALE_PLAIN=1` (or `LOSSSCALE_PLAIN=finite`).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp

from lossscale import _unscale

# Leaves larger than this are reduced one by one: XLA:CPU runs independent
# reductions side by side, and one kernel reading several large arrays is
# slower. Smaller leaves of one size and dtype are added up elementwise,
# `_GROUP` at a time, and reduced once (docs/performance.md, the
# speed-layer table, rows `finite`).
_OWN_REDUCTION = 1 << 16
_GROUP = 32


def all_finite(tree: Any, factor: jax.Array | None) -> jax.Array:
  """`_unscale.all_finite(tree, factor)`, the same flag with fewer
  reductions (`jax.debug_nans` flags every NaN an operation produces, and
  this check makes one from each inf: there it is the plain check)."""
  leaves = jax.tree.leaves(_unscale.numbers_as_arrays(tree))
  leaves = [x for x in leaves if _unscale.is_inexact(x)]
  if not leaves or jax.debug_nans.value:
    return _unscale.all_finite(tree, factor)
  return _all_finite_times(leaves, factor)


def _all_finite_times(leaves: list[jax.Array], factor: jax.Array | None) -> jax.Array:
  """`all(isfinite(x * factor))` over the inexact `leaves` (not empty).

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


def sum_of_squares(tree: Any) -> jax.Array:
  """`_unscale.sum_of_squares(tree)`, small leaves of one shape and dtype
  squared and added up elementwise, `_GROUP` at a time, and reduced once.
  Rounds otherwise than the plain sum (the order of the additions), within
  float32's rounding of a sum."""
  leaves = _unscale.inexact_leaves(tree)
  large = [x for x in leaves if x.size > _OWN_REDUCTION]
  sums = [jnp.sum(_unscale.squares(x)).astype(jnp.float32) for x in large]
  for group in _groups([x for x in leaves if x.size <= _OWN_REDUCTION]):
    added = functools.reduce(operator.add, [_unscale.squares(x) for x in group])
    sums.append(jnp.sum(added).astype(jnp.float32))
  return sum(sums, jnp.zeros([], jnp.float32))


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
  return [_finite_flag(factor, *group) for group in _groups(leaves)]


def _groups(leaves: list[jax.Array]) -> list[list[jax.Array]]:
  """`leaves` by shape and dtype, `_GROUP` at a time."""
  by_kind: dict[tuple[Any, Any], list[jax.Array]] = {}
  for x in leaves:
    by_kind.setdefault((x.shape, x.dtype), []).append(x)
  return [
    same[i : i + _GROUP]
    for same in by_kind.values()
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
    dtype = jnp.float32 if jnp.finfo(xs[0].dtype).bits < 32 else xs[0].dtype
    xs = [x.astype(dtype) * factor.astype(dtype) for x in xs]
  # Without a factor, half-precision leaves are checked in their own dtype:
  # a conversion in both branches of the large leaves' conditional would be
  # hoisted out of it by XLA, and written out as a float32 copy.
  zeros = functools.reduce(operator.add, [x - x for x in xs])
  if jnp.iscomplexobj(zeros):  # NaN in either part
    zeros = jnp.real(zeros) + jnp.imag(zeros)
  return jnp.isfinite(jnp.sum(zeros))
