"""Cross-replica gradient averaging: TensorFlow's `CrossShardOptimizer`, as optax."""

from __future__ import annotations

from typing import Any

import jax
import optax

from lossscale import _axes
from lossscale._unscale import is_inexact

_REDUCTIONS = ("mean", "sum")


def cross_shard_mean(
  axis_name: _axes.AxisName, *, reduction: str = "mean"
) -> optax.GradientTransformation:
  """All-reduces the updates over `axis_name`: the `CrossShardOptimizer` analogue.

  `update` returns the mean (`jax.lax.pmean`) or the sum (`jax.lax.psum`) over
  the replicas of every floating or complex leaf, in the leaf's own dtype;
  integer, boolean and `float0` leaves pass through. Chain it *before* a
  loss-scaling wrapper ([`lossscale.dynamic_loss_scale`][] and its
  siblings): every replica then feeds the same gradients to the
  wrapper, and an inf or NaN on any replica reaches all of them through the
  all-reduce, so all replicas skip together with no further collective. Call
  `update` where the axis is bound (`jax.pmap(..., axis_name=...)` or
  `shard_map`); under SPMD `jax.jit` gradients are already global. Why the
  mean is not divided first: [Data-parallel
  training][averaging-first-no-extra-collective].

  Args:
    axis_name: the mapped axis to reduce over, such as `"batch"`, or a tuple
      of names for a multi-axis mesh (such as `("data", "fsdp")`), which
      reduces over all of them at once.
    reduction: `"mean"` (`jax.lax.pmean`, TensorFlow's `Reduction.MEAN`) or
      `"sum"` (`jax.lax.psum`, `Reduction.SUM`).

  Returns:
    A stateless `optax.GradientTransformation` (its state is
    `optax.EmptyState`).

  Raises:
    ValueError: at construction, for an unsupported `reduction` or an invalid
      `axis_name`.
    NameError: from `update`, called where `axis_name` is not bound; the
      message says how to bind it.
    ValueError: from `update`, when chained directly after a loss-scaling
      wrapper whose decision is not reduced over `axis_name` (replicas
      would skip on their own and drift apart); the message says to chain
      it before the wrapper or pass the wrapper `axis_name`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = optax.chain(ls.cross_shard_mean("batch"), optax.sgd(1.0))
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> def step(grads, params):
    ...   updates, _ = tx.update(grads, state, params)
    ...   return optax.apply_updates(params, updates)
    >>> grads = {"w": jnp.array([[2.0, -4.0]])}  # one replica's gradients
    >>> params = jax.tree.map(lambda p: p[None], params)
    >>> p_step = jax.pmap(step, axis_name="batch", devices=jax.devices()[:1])
    >>> p_step(grads, params)["w"]
    Array([[-2.,  4.]], dtype=float32)
    >>> ls.cross_shard_mean("batch", reduction="max")
    Traceback (most recent call last):
    ...
    ValueError: Unsupported reduction: 'max'. ...

  References:
    TensorFlow `tf.compat.v1.tpu.CrossShardOptimizer` (`reduction=MEAN|SUM`).
  """
  fn = "cross_shard_mean"
  if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
    raise ValueError(
      f"Unsupported reduction: {reduction!r}. `{fn}(reduction=...)` must be"
      " 'mean' or 'sum'."
    )
  if axis_name is None:
    raise ValueError(
      f"`{fn}(axis_name=...)` must be an axis name (such as 'batch') or a"
      " non-empty tuple of names, got None. Under plain `jax.jit` on sharded"
      " arrays gradients are already global: drop `cross_shard_mean` there."
    )
  axis_name = _axes.validate_axis_name(fn, axis_name)

  collective = jax.lax.pmean if reduction == "mean" else jax.lax.psum

  def reduce(leaves):
    return collective(leaves, axis_name)

  def init_fn(params: Any) -> optax.EmptyState:
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    _axes.check_not_per_replica(fn, axis_name, updates)
    leaves, treedef = jax.tree.flatten(updates)
    picked = [x for x in leaves if is_inexact(x)]
    # One call for all leaves: XLA sees one all-reduce to combine or pipeline.
    reduced = iter(_axes.bound_collective(fn, axis_name, lambda: reduce(picked)))
    leaves = [next(reduced) if is_inexact(x) else x for x in leaves]
    _axes.mark_reduced(leaves, _axes.as_tuple(axis_name))
    return jax.tree.unflatten(treedef, leaves), state

  return optax.GradientTransformation(init_fn, update_fn)
