"""The few spellings that differ across the supported JAX range.

lossscale supports jax 0.4.35 up to the newest release. Everything else in
the package uses spellings that exist at both ends (`jax.tree_util.*`,
`optax.safe_increment`); what does not is here, once.
"""

from __future__ import annotations

from typing import Any

import jax


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
