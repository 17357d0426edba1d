"""Collectives over named axes, with errors that say how to bind the axis."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import jax

from lossscale import _compat, _jax_internals, _speed
from lossscale._speed import split as _split

AxisName = Hashable | tuple[Hashable, ...]
T = TypeVar("T")


def validate_axis_name(fn: str, axis_name: Any) -> AxisName | None:
  """Checks an `axis_name=` argument at construction time."""
  if axis_name is None:
    return None
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

  def bad(n: Any) -> bool:  # None, "", or a mutable or boolean "name"
    if n is None or isinstance(n, str):
      return not n
    return isinstance(n, (list, dict, set, bool))

  if not names or any(bad(n) for n in names):
    raise ValueError(
      f"`{fn}(axis_name=...)` must be an axis name (such as 'batch') or a"
      f" non-empty tuple of names, got {axis_name!r}."
    )
  for n in names:
    try:
      hash(n)
    except TypeError:
      raise ValueError(
        f"`{fn}(axis_name=...)` must be hashable (a string such as 'batch', or"
        f" a tuple of strings), got {axis_name!r}."
      ) from None
  if len(set(names)) != len(names):
    raise ValueError(
      f"`{fn}(axis_name=...)` names an axis twice, got {axis_name!r}: a"
      " reduction over the same axis twice is not defined."
    )
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


def cond(
  pred: Any,
  true_fn: Callable[[], T],
  false_fn: Callable[[], T],
  *,
  operands: Any,
  if_handed_out: Callable[[], Callable[[], T]] | None = None,
  vet: Callable[[Any], None] | None = None,
) -> T:
  """`jax.lax.cond`, split for many outputs (`lossscale/_speed/split.py`), whose
  branches may differ in which axes they vary over.

  Inside `shard_map` a branch that computes from per-device values returns
  "varying" arrays while one that returns constants or replicated state does
  not, and `lax.cond` rejects the mismatch. Each output is then cast to the
  union of both branches' varying axes (free: no communication).

  Args:
    pred: the scalar predicate.
    true_fn: the branch taken when `pred` is true.
    false_fn: the branch taken otherwise.
    operands: every array the branches compute from. When none of them varies
      over a manual axis (always so outside `shard_map`), no output can.
    if_handed_out: gives the true branch to use instead where `true_fn`
      hands values out of the computation (`lossscale/_speed/split.py`).
    vet: called with the true branch's trace (a `ClosedJaxpr`) before any
      conditional is built; it may raise.

  Returns:
    The output of the branch taken.
  """
  leaves = jax.tree_util.tree_leaves((pred, operands))
  varying = any(_compat.varying_axes(x) for x in leaves if hasattr(x, "dtype"))
  if not _speed.on("split"):
    return _plain_cond(pred, true_fn, false_fn, varying, if_handed_out, vet)
  if not varying:
    return _split.cond(pred, true_fn, false_fn, None, if_handed_out, vet)
  return _split.cond(pred, true_fn, false_fn, _varying_cond, if_handed_out, vet)


def _plain_cond(pred, true_fn, false_fn, varying, if_handed_out, vet):
  """One `jax.lax.cond` (`LOSSSCALE_PLAIN=1`); the true branch is traced
  first only where it must be looked at."""
  if if_handed_out is not None or vet is not None:
    closed = jax.make_jaxpr(true_fn)()
    if if_handed_out is not None and _jax_internals.hands_out(closed):
      true_fn = if_handed_out()
      closed = jax.make_jaxpr(true_fn)()
    if vet is not None:
      vet(closed)
  if varying:
    return _varying_cond(pred, true_fn, false_fn)
  return jax.lax.cond(pred, true_fn, false_fn)


def _varying_cond(pred: Any, true_fn: Callable[[], T], false_fn: Callable[[], T]) -> T:
  """`jax.lax.cond`, each output cast to both branches' varying axes."""
  want = jax.tree.map(
    lambda a, b: _compat.varying_axes(a) | _compat.varying_axes(b),
    jax.eval_shape(true_fn),
    jax.eval_shape(false_fn),
  )

  def cast(x, axes):
    missing = tuple(sorted(axes - _compat.varying_axes(x), key=str))
    return _compat.cast_to_varying(x, missing) if missing else x

  def matched(fn):
    return lambda: jax.tree.map(cast, fn(), want)

  return jax.lax.cond(pred, matched(true_fn), matched(false_fn))
