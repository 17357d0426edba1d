"""The scale rule: the settings, `LossScaleState` and the counters.

Pure `jax.numpy` on scalars, no optimizer and no tracing tricks: `Rule`
holds a wrapper's fixed settings (closure, never state), `init_counters`
the first state, and `next_counters(rule, state, finite)` is the whole
state machine, one step of it. docs/how-it-works.md states the rule in
prose; tests/_helpers.py (`reference_rule`) writes it again, independently,
and the tests hold the two together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LossScaleState(NamedTuple):
  """State of a loss-scaling wrapper: the scale, its counters, the inner state.

  Every field is an array with a fixed dtype, so the state is a plain pytree
  that can be jitted, vmapped, sharded and checkpointed.

  Attributes:
    loss_scale: float32 scalar, the current loss scale, in
      `[min_scale, max_scale]`. Multiply the loss by it before differentiating
      ([`lossscale.scale_loss`][]).
    good_steps: int32, consecutive finite steps since the scale last changed
      or the last skipped step (a growth sets it to `growth_delay`, 0 by
      default).
    hysteresis_left: int32, overflows left until the scale backs off: the
      next non-finite step backs it off when this is 1 (or 0).
    skipped_steps: int32, total number of skipped steps.
    consecutive_skips: int32, skipped steps since the last applied one (see
      [`lossscale.check_not_stalled`][]).
    last_finite: bool, whether the last step's gradients were finite, that is
      whether its update was applied (`True` before the first step;
      [`lossscale.flax.TrainState`][] reads it).
    steps_since_rescale: int32, steps (applied or skipped) since the scale
      last grew or backed off, this one included (fairseq's
      `iter - last_rescale_iter`; the `tolerance` rule reads it).
    overflows_since_backoff: int32, skipped steps since the scale last backed
      off (a growth does not reset it, as in fairseq).
    overflows_at_min_scale: int32, total number of overflows that would have
      backed off a scale already at `min_scale` (DeepSpeed raises on the
      first; see [`lossscale.check_not_stalled`][]'s `at_min_scale`).
    inner_state: the wrapped optimizer's state, untouched on skipped steps.

  Every wrapper's state has all these fields, whatever its configuration, so
  one checkpoint restores into any of them. A state saved before the last
  three fields existed converts with [`lossscale.upgrade_state`][].
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  last_finite: jax.Array
  steps_since_rescale: jax.Array
  overflows_since_backoff: jax.Array
  overflows_at_min_scale: jax.Array
  inner_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class Rule:
  """Fixed settings of the state machine (closure, never state)."""

  initial_scale: float
  dynamic: bool
  enabled: bool = True  # False: exactly `inner`, no scaling, no skipping.
  growth_interval: int = 1
  growth_factor: float = 1.0
  backoff_factor: float = 1.0
  hysteresis: int = 1
  reset_hysteresis_on_backoff: bool = False
  consecutive_hysteresis: bool = False  # refill `h` on every finite step
  growth_delay: int = 0  # extra good steps before the first growth
  tolerance: float = 0.0  # fairseq: back off once overflows/steps >= this
  min_scale: float = 1.0
  max_scale: float = 1.0


def init_counters(rule: Rule) -> dict[str, jax.Array]:
  # A separate buffer per field: a state whose leaves share one buffer
  # cannot be donated to a jitted step.
  return dict(
    loss_scale=jnp.asarray(rule.initial_scale, jnp.float32),
    good_steps=jnp.zeros([], jnp.int32),
    hysteresis_left=jnp.asarray(rule.hysteresis, jnp.int32),
    skipped_steps=jnp.zeros([], jnp.int32),
    consecutive_skips=jnp.zeros([], jnp.int32),
    last_finite=jnp.ones([], jnp.bool_),
    steps_since_rescale=jnp.zeros([], jnp.int32),
    overflows_since_backoff=jnp.zeros([], jnp.int32),
    overflows_at_min_scale=jnp.zeros([], jnp.int32),
  )


def next_counters(
  rule: Rule, state: LossScaleState, finite: jax.Array
) -> dict[str, jax.Array]:
  """The scale-adjustment rule, written out once in docs/how-it-works.md.

  Whatever scale the state arrived with (one restored from a run with
  another configuration, say), the scale it leaves is one this wrapper's
  configuration allows: its fixed scale, or one within `[min_scale,
  max_scale]`.
  """
  f32 = jnp.float32
  if not rule.enabled:  # exactly `inner`: only the scale is set, to 1
    counters = state._asdict()
    del counters["inner_state"]
    return counters | dict(loss_scale=jnp.ones([], f32))
  zero = jnp.zeros([], jnp.int32)
  skipped = jnp.where(
    finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
  )
  consecutive = jnp.where(finite, zero, optax.safe_increment(state.consecutive_skips))
  good = jnp.where(finite, optax.safe_increment(state.good_steps), zero)
  counters = dict(
    loss_scale=jnp.asarray(rule.initial_scale, f32),  # fixed: the one allowed
    good_steps=good,
    hysteresis_left=state.hysteresis_left,
    skipped_steps=skipped,
    consecutive_skips=consecutive,
    last_finite=jnp.asarray(finite, jnp.bool_),
    steps_since_rescale=state.steps_since_rescale,
    overflows_since_backoff=state.overflows_since_backoff,
    overflows_at_min_scale=state.overflows_at_min_scale,
  )
  if rule.dynamic:
    counters.update(_dynamic_counters(rule, state, finite, good))
  return counters


def _dynamic_counters(
  rule: Rule, state: LossScaleState, finite: jax.Array, good: jax.Array
) -> dict[str, jax.Array]:
  """The counters a dynamic rule moves, `good` being the good steps counted
  with this step."""
  f32, i32 = jnp.float32, jnp.int32
  zero = jnp.zeros([], i32)
  scale = state.loss_scale
  refill = jnp.asarray(rule.hysteresis, i32)
  # A restored state may have more overflows left than this rule tolerates.
  h_left = jnp.minimum(state.hysteresis_left, refill)
  grow = jnp.logical_and(finite, good >= rule.growth_interval + rule.growth_delay)
  # Saturates at 0 instead of wrapping; the back-off test `<= 0` is unchanged.
  h_after_overflow = jnp.maximum(h_left - 1, zero)
  back_off = jnp.logical_and(jnp.logical_not(finite), h_after_overflow <= 0)
  steps = optax.safe_increment(state.steps_since_rescale)  # this step counts
  overflows = jnp.where(
    finite,
    state.overflows_since_backoff,
    optax.safe_increment(state.overflows_since_backoff),
  )
  if rule.tolerance > 0.0:  # 0: every overflow backs off (the ratio is >= 0)
    ratio = jnp.asarray(overflows, f32) / jnp.asarray(steps, f32)
    back_off = jnp.logical_and(back_off, ratio >= f32(rule.tolerance))
  if rule.reset_hysteresis_on_backoff:
    h_after_overflow = jnp.where(back_off, refill, h_after_overflow)
  h_finite = refill if rule.consecutive_hysteresis else jnp.where(grow, refill, h_left)
  product = scale * f32(rule.growth_factor)
  # A product past the float32 range keeps the scale (TF 1.x, TF 2.x, torch).
  grown = jnp.where(
    jnp.isfinite(product), jnp.minimum(product, f32(rule.max_scale)), scale
  )
  shrunk = jnp.maximum(scale * f32(rule.backoff_factor), f32(rule.min_scale))
  new_scale = jnp.where(grow, grown, jnp.where(back_off, shrunk, scale))
  at_min = jnp.logical_and(back_off, scale <= f32(rule.min_scale))
  return dict(
    loss_scale=jnp.clip(new_scale, f32(rule.min_scale), f32(rule.max_scale)),
    good_steps=jnp.where(grow, jnp.asarray(rule.growth_delay, i32), good),
    hysteresis_left=jnp.where(finite, h_finite, h_after_overflow),
    steps_since_rescale=jnp.where(jnp.logical_or(grow, back_off), zero, steps),
    overflows_since_backoff=jnp.where(back_off, zero, overflows),
    overflows_at_min_scale=jnp.where(
      at_min,
      optax.safe_increment(state.overflows_at_min_scale),
      state.overflows_at_min_scale,
    ),
  )


def is_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def states_in(tree: Any) -> list[LossScaleState]:
  """Every `LossScaleState` in `tree`, nested anywhere, in leaf order."""
  return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
