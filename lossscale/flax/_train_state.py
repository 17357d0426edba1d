"""Flax linen: a `TrainState` whose skipped steps leave it unchanged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from flax.training.train_state import OVERWRITE_WITH_GRADIENT

from lossscale._applied import check_consulted
from lossscale._fused import apply_gradients
from lossscale._scaled_grad import (
  find_state,
  get_loss_scale,
)
from lossscale._wrapper import choose


class TrainState(train_state.TrainState):
  """A Flax `TrainState` whose skipped steps leave it unchanged.

  Build it like Flax's (`TrainState.create(apply_fn=..., params=..., tx=...)`)
  with `tx` holding one loss-scaling wrapper. `apply_gradients(grads=...)`
  takes gradients of the *scaled* loss and runs
  [`lossscale.apply_gradients`][]:
  on a finite step the result is Flax's; on a skipped step only the
  optimizer state changes (the scale backs off, `skipped_steps` grows), and
  `step`, `params` and the fields passed as keyword arguments (such as
  `batch_stats`) keep their old values. `step` is an int32 that counts
  applied updates only, like TensorFlow's `global_step`; whether a step was
  applied is the wrapper's
  [`LossScaleState.last_applied`][lossscale.LossScaleState]. Flax's float8
  `OVERWRITE_WITH_GRADIENT` gradients go through Flax's own step. It works
  under `jax.jit`, `jax.pmap` and `jax.vmap`. `loss_scale` and
  `skipped_steps` are properties, not fields, so the state holds exactly one
  leaf named `loss_scale`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import flax.linen as nn
    >>> import lossscale as ls
    >>> model = nn.Dense(1)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    >>> state = ls.flax.TrainState.create(
    ...     apply_fn=model.apply, params=params,
    ...     tx=ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0))
    >>> bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
    >>> state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, bad)
    >>> state.step, state.loss_scale, state.skipped_steps
    (Array(0, dtype=int32), Array(4., dtype=float32), Array(1, dtype=int32))
  """

  def apply_gradients(
    self, *, grads: Any, value: Any = None, **kwargs: Any
  ) -> TrainState:
    """Applies `grads` (of the scaled loss), or skips the step entirely.

    Args:
      grads: gradients with the structure of `params`, of the loss multiplied
        by `self.loss_scale` (see [`lossscale.value_and_grad`][]).
      value: the unscaled loss, optional, handed to the optimizer as optax's
        `value=`: a non-finite loss skips the step without backing the scale
        off, and [`lossscale.SkipSpikes`][] tests it ([Skipping bad
        steps][skipping-bad-steps]).
      **kwargs: other fields to replace, such as `batch_stats`; on a skipped
        step they keep their old values.

    Returns:
      The new state: `step` incremented, `params`, `opt_state` and `kwargs`
      updated on an applied step; only `opt_state` updated on a skipped one.

    Raises:
      ValueError: when a field given in `kwargs` changes its tree structure
        (a skipped step could not keep the old value), or when `tx` holds
        no (or more than one) loss-scaling state, or one inside another
        transformation's control flow (`optax.MultiSteps(wrapper)`), which
        does not run on every step.
    """
    find_state(self.opt_state)  # Fails early with a clear message.
    check_consulted(self.opt_state)  # `last_applied`, read below, is current.
    fp8 = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
    extra = {} if value is None else {"value": value}
    if fp8 and extra:
      raise ValueError(
        "`TrainState.apply_gradients(value=...)` with Flax's float8 gradients"
        " (`_overwrite_with_gradient`): Flax's float8 step hands the optimizer"
        " no extra arguments. Drop `value=`, or keep the float8 state out of"
        " the gradients."
      )
    if fp8:  # Flax's float8 path: Flax's own step, params selected below
      new = super().apply_gradients(grads=grads, **kwargs)
    else:
      # The fused step: the whole update behind one `lax.cond`, so a skipped
      # step runs no optimizer and the params come back untouched.
      params, opt_state = apply_gradients(
        self.tx, grads, self.opt_state, self.params, **extra
      )
      new = self.replace(params=params, opt_state=opt_state, **kwargs)
    applied = find_state(new.opt_state).last_applied

    def keep_old_on_skip(name: str, old: Any, value: Any) -> Any:
      # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
      old_def: Any = jax.tree.structure(old)
      new_def = jax.tree.structure(value)
      if old_def != new_def:
        raise ValueError(
          f"`TrainState.apply_gradients({name}=...)` must keep the tree"
          f" structure of the current `{name}` (a skipped step keeps the"
          f" old value), got {new_def} instead of {old_def}."
        )

      def check(path: Any, v: Any, o: Any) -> None:
        v, o = jnp.asarray(v), jnp.asarray(o)
        if v.shape != o.shape or v.dtype != o.dtype:
          raise ValueError(
            f"`TrainState.apply_gradients({name}=...)` must keep the shape and"
            f" dtype of every leaf of the current `{name}` (a skipped step"
            f" keeps the old value): at {jax.tree_util.keystr(path)} got"
            f" {v.dtype}{list(v.shape)} instead of {o.dtype}{list(o.shape)}."
          )

      jax.tree_util.tree_map_with_path(check, value, old)
      value, old = jax.tree.map(jnp.asarray, (value, old))
      return choose(applied, lambda: value, lambda: old, operands=(value, old))

    fields = {f.name: f for f in dataclasses.fields(self)}
    kept = {}
    for name, value in kwargs.items():
      if fields.get(name) is not None and fields[name].metadata.get(
        "pytree_node", True
      ):
        kept[name] = keep_old_on_skip(name, getattr(self, name), value)
    old_step = jnp.asarray(self.step, jnp.int32)
    return new.replace(
      step=jnp.where(applied, optax.safe_increment(old_step), old_step),
      # The fused step already returned the old params on a skipped step.
      params=keep_old_on_skip("params", self.params, new.params) if fp8 else new.params,
      **kept,
    )

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any] | None,
    params: Any,
    tx: optax.GradientTransformation,
    **kwargs: Any,
  ) -> TrainState:
    """Creates a state with `step=0` (int32) and `opt_state = tx.init(params)`.

    Args:
      apply_fn: usually `model.apply`.
      params: the (float32 master) parameters.
      tx: a loss-scaling optimizer, alone or inside an `optax.chain`.
      **kwargs: other fields of a subclass, such as `batch_stats`.

    Returns:
      The new `TrainState`.

    Raises:
      ValueError: when `tx`'s state holds no (or more than one)
        [`lossscale.LossScaleState`][].
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    find_state(state.opt_state)
    return state.replace(step=jnp.zeros([], jnp.int32))

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale, a float32 scalar (one per replica under pmap)."""
    return get_loss_scale(self.opt_state)

  @property
  def skipped_steps(self) -> jax.Array:
    """How many steps were skipped so far (int32)."""
    return find_state(self.opt_state).skipped_steps
