"""Collectives over named axes, with errors that say how to bind the axis."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax

AxisName = Hashable | tuple[Hashable, ...]
T = TypeVar("T")


def validate_axis_name(fn: str, axis_name: Any) -> AxisName | None:
  """Checks an `axis_name=` argument at construction time."""
  if axis_name is None:
    return None
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or any(
    n is None or isinstance(n, (list, dict, set, bool)) for n in names
  ):
    raise ValueError(
      f"`{fn}(axis_name=...)` must be an axis name (such as 'batch') or a"
      f" non-empty tuple of names, got {axis_name!r}."
    )
  for n in names:
    hash(n)
  return axis_name


def bound_collective(fn: str, axis_name: AxisName, collective: Callable[[], T]) -> T:
  """Runs `collective()`, turning an unbound-axis error into a helpful one."""
  try:
    return collective()
  except NameError as e:
    raise NameError(
      f"`{fn}(axis_name={axis_name!r})` was called where the axis"
      f" {axis_name!r} is not bound. Bind it with `pmap(axis_name=...)`, that"
      f" is `jax.pmap(step, axis_name={axis_name!r})`, or with `shard_map`"
      f" (`jax.shard_map`) over a Mesh with an axis named {axis_name!r};"
      " under plain `jax.jit`"
      " with sharded arrays no axis name is needed (leave it None)."
      f" Original error: {e}"
    ) from e


def _varying_axes(aval: Any) -> frozenset:
  """The manual axes a value varies over inside `shard_map` (empty outside)."""
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def cond(pred: Any, true_fn: Callable[[], T], false_fn: Callable[[], T]) -> T:
  """`jax.lax.cond` whose branches may differ in which axes they vary over.

  Inside `jax.shard_map` a branch that computes from per-device values
  returns "varying" arrays while one that returns constants or replicated
  state does not, and `lax.cond` rejects the mismatch. Each output is cast
  (`jax.lax.pcast`, free: no communication) to the union of both branches'
  varying axes. Outside `shard_map` nothing is cast.
  """
  want = jax.tree.map(
    lambda a, b: _varying_axes(a) | _varying_axes(b),
    jax.eval_shape(true_fn),
    jax.eval_shape(false_fn),
  )
  if not any(jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, frozenset))):
    return jax.lax.cond(pred, true_fn, false_fn)

  def cast(x, axes):
    missing = tuple(sorted(axes - _varying_axes(jax.typeof(x)), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  def matched(fn):
    return lambda: jax.tree.map(cast, fn(), want)

  return jax.lax.cond(pred, matched(true_fn), matched(false_fn))
