"""Named axes: what a step communicates over, agreeing over them, and a
conditional whose branches vary over different ones.

Under `jax.pmap` or `shard_map` every replica decides for itself whether to
apply a step unless the decision is reduced across replicas (the wrapper's
`axis_name`), or the gradients were all-reduced before it (then they are the
same everywhere). A collective that runs where only some replicas go (inside
the wrapper's conditional, or after it on updates some replicas skipped)
breaks that: the replicas that skip never join the all-reduce (a hang), or
they train on with other scales (a silent drift). So the wrapper agrees over
every axis the inner optimizer communicates over (`communicated_axes` of its
trace), `apply_gradients` over every axis the rest of the applied step
communicates over, and `cross_shard_mean` refuses, at trace time, updates a
wrapper decided on per replica (`mark_per_replica`). The loss a wrapper is
given (`value=`) is per replica even where the gradients were all-reduced
before it: the wrapper averages it over those axes (`loss_axes`, which
reads what `cross_shard_mean` recorded with `mark_reduced`, and, where JAX
types what varies, the loss's type). Both records are weak, keyed by the
traced updates, and live as long as the trace that made them.
docs/data-parallel.md has the table of placements.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from lossscale import _jax_internals

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


def as_tuple(axis_name: Any) -> tuple[Hashable, ...]:
  if axis_name is None:
    return ()
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def union(*groups: Iterable[Hashable]) -> tuple[Hashable, ...]:
  return tuple(dict.fromkeys(n for g in groups for n in g))


def agree(fn: str, axes: tuple, overflowed: Any, loss: Any, norm: Any) -> tuple:
  """The decision's inputs, the same on every replica of `axes`: whether
  any replica's gradients overflowed (one collective), and the replicas'
  mean loss and gradient norm, where given (one more)."""
  names = axes[0] if len(axes) == 1 else axes
  flag = jnp.asarray(overflowed).astype(jnp.int32)
  overflowed = bound_collective(fn, names, lambda: jax.lax.pmax(flag, names) > 0)
  values = [x for x in (loss, norm) if x is not None]
  if values:
    it = iter(mean(fn, axes, values))
    loss, norm = (None if x is None else next(it) for x in (loss, norm))
  return overflowed, loss, norm


def mean(fn: str, axes: tuple, values: list) -> list:
  """The replicas' mean of each scalar of `values`, in float32 (one collective)."""
  names = axes[0] if len(axes) == 1 else axes
  values = [jnp.asarray(v, jnp.float32) for v in values]
  return bound_collective(fn, names, lambda: jax.lax.pmean(values, names))


def conditional(operands: Any) -> Callable[..., Any]:
  """`jax.lax.cond`, or, where an operand varies over a manual axis (inside
  `shard_map`), a `lax.cond` whose outputs are cast to the union of both
  branches' varying axes: one branch computes from per-device values and
  the other returns constants or replicated state, and `lax.cond` rejects
  the mismatch (the cast is free: no communication)."""
  leaves = jax.tree_util.tree_leaves(operands)
  if any(_jax_internals.varying_axes(x) for x in leaves if hasattr(x, "dtype")):
    return varying_cond
  return jax.lax.cond


def varying_cond(pred: Any, true_fn: Callable[[], T], false_fn: Callable[[], T]) -> T:
  """`jax.lax.cond`, each output cast to both branches' varying axes."""
  want = jax.tree.map(
    lambda a, b: _jax_internals.varying_axes(a) | _jax_internals.varying_axes(b),
    jax.eval_shape(true_fn),
    jax.eval_shape(false_fn),
  )

  def cast(x, axes):
    missing = tuple(sorted(axes - _jax_internals.varying_axes(x), key=str))
    return _jax_internals.cast_to_varying(x, missing) if missing else x

  def matched(fn):
    return lambda: jax.tree.map(cast, fn(), want)

  return jax.lax.cond(pred, matched(true_fn), matched(false_fn))


# Updates `cross_shard_mean` returned, by the identity of their tracers,
# weakly, with the axes it reduced over: a wrapper chained after it reads
# them (`loss_axes`), since its gradients are the same on every replica but
# the loss it is given may not be.
_reduced: dict[int, tuple[weakref.ref, tuple[Hashable, ...]]] = {}


def mark_reduced(updates: Any, axes: tuple[Hashable, ...]) -> None:
  """Records that `updates` (traced) were all-reduced over `axes`."""
  _mark(_reduced, updates, axes)


def loss_axes(updates: Any, loss: Any, agreed: tuple[Hashable, ...]) -> tuple:
  """The axes, beyond `agreed`, the loss must be averaged over for every
  replica to decide alike: those the gradients were all-reduced over (by
  `cross_shard_mean`, or, where JAX types what varies, those the loss varies
  over and the gradients do not). A per-replica loss there would let each
  replica skip on its own, gradients the same everywhere."""
  leaves = [x for x in jax.tree_util.tree_leaves(updates) if hasattr(x, "dtype")]
  axes: list[Hashable] = []
  for x in leaves:
    entry = _reduced.get(id(x))
    if entry is not None and entry[0]() is x:
      axes += entry[1]
  grads_vary = frozenset().union(*map(_jax_internals.varying_axes, leaves))
  axes += sorted(_jax_internals.varying_axes(loss) - grads_vary, key=str)
  return tuple(n for n in dict.fromkeys(axes) if n not in agreed)


def _mark(registry: dict, updates: Any, axes: tuple[Hashable, ...]) -> None:
  for x in jax.tree_util.tree_leaves(updates):
    if isinstance(x, jax.core.Tracer):
      key = id(x)
      forget = lambda _, k=key: registry.pop(k, None)
      registry[key] = (weakref.ref(x, forget), axes)


# Updates a wrapper returned after deciding per replica (no axis reduced
# over), by the identity of their tracers, weakly: an entry lives as long as
# the trace that made it. Only `cross_shard_mean` reads it, to refuse them.
_per_replica: dict[int, tuple[weakref.ref, tuple[Hashable, ...]]] = {}


# `mark_per_replica(updates, agreed)`: records that `updates` (traced) were
# decided on with the decision reduced over `agreed` only.
mark_per_replica = functools.partial(_mark, _per_replica)


def check_not_per_replica(fn: str, axis_name: Any, updates: Any) -> None:
  """Raises when `updates` came from a wrapper whose decision was not
  reduced over every axis of `axis_name`: replicas that decided otherwise
  would be averaged together (or wait on each other)."""
  want = as_tuple(axis_name)
  for x in jax.tree_util.tree_leaves(updates):
    entry = _per_replica.get(id(x))
    if entry is None or entry[0]() is not x:
      continue
    missing = [n for n in want if n not in entry[1]]
    if missing:
      raise ValueError(
        f"`{fn}({axis_name!r})` is chained after a loss-scaling wrapper that"
        f" decides per replica: without `axis_name={missing[0]!r}` each replica"
        " skips or applies the step on its own gradients, and the replicas'"
        " scales and optimizer states drift apart. Chain"
        f" `{fn}({axis_name!r})` before the wrapper"
        f" (`optax.chain(lossscale.{fn}({axis_name!r}),"
        " lossscale.dynamic_loss_scale(...))`, which needs no further"
        f" collective), or pass `axis_name={axis_name!r}` to the wrapper."
      )
