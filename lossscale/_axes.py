"""Collectives over named axes, with errors that say how to bind the axis."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

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
      f" {axis_name!r} is not bound. Call the update inside"
      f" `jax.pmap(..., axis_name={axis_name!r})` or inside `jax.shard_map`"
      f" over a Mesh with an axis named {axis_name!r}; under plain `jax.jit`"
      " with sharded arrays no axis name is needed (leave it None)."
      f" Original error: {e}"
    ) from e
