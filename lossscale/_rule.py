"""The rule: the settings, `LossScaleState`, and one step's decision.

Pure `jax.numpy` on scalars, no optimizer and no tracing tricks: `Rule`
holds a wrapper's fixed settings (closure, never state), `init_counters`
the first state, and `next_counters(rule, state, overflowed, observed)` is
the whole state machine, one step of it: from whether the gradients
overflowed and the step's loss and gradient norm, whether the step is
applied, why not, and the scale and counters after it. docs/how-it-works.md
and docs/skipping.md state the rules in prose; tests/_helpers.py
(`reference_rule`) and tests/_spike_rules.py write them again,
independently, and the tests hold them together.
"""

from __future__ import annotations

import dataclasses
import numbers
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
    last_finite: bool, whether the last step's gradients were finite (jmp's
      `grads_finite`, Flax `DynamicScale`'s `is_fin`; `True` before the
      first step).
    last_applied: bool, whether the last step's update was applied
      ([`lossscale.step_applied`][] and [`lossscale.flax.TrainState`][] read
      it; `True` before the first step).
    steps_since_rescale: int32, steps (applied or skipped) since the scale
      last grew or backed off, this one included (fairseq's
      `iter - last_rescale_iter`; the `tolerance` rule reads it).
    overflows_since_backoff: int32, skipped steps since the scale last backed
      off (a growth does not reset it, as in fairseq).
    overflows_at_min_scale: int32, total number of overflows that would have
      backed off a scale already at `min_scale` (DeepSpeed raises on the
      first; see [`lossscale.check_not_stalled`][]'s `at_min_scale`).
    last_skip_reason: int32, why the last step was skipped: 0 when it was
      applied, else 1 + its index in `lossscale.SKIP_REASONS` (the
      gradients overflowed, the loss was not finite, a loss spike, a
      gradient-norm spike; [`lossscale.step_metrics`][] names it).
    skips_by_reason: int32 of shape `(4,)`, skipped steps so far by reason,
      in the order of `lossscale.SKIP_REASONS` (they add up to
      `skipped_steps`).
    spike_window: with [`lossscale.SkipSpikes`][], a `SpikeWindow`: the
      previous finite losses and gradient norms the spike test compares a
      step with; `()` without it.
    inner_state: the wrapped optimizer's state, untouched on skipped steps.

  Every wrapper's state has all these fields, whatever its configuration, so
  one checkpoint restores into any of them, but for the spike window: a
  state without one (or with another width) steps with `SkipSpikes` once
  [`lossscale.upgrade_state`][] has given it one, and a wrapper without the
  option carries a state's window along untouched (to restore into its
  `init`'s structure, drop it: `state._replace(spike_window=())`). A state
  saved with fewer fields (an earlier version) converts with
  [`lossscale.upgrade_state`][].
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  last_finite: jax.Array
  last_applied: jax.Array
  steps_since_rescale: jax.Array
  overflows_since_backoff: jax.Array
  overflows_at_min_scale: jax.Array
  last_skip_reason: jax.Array
  skips_by_reason: jax.Array
  spike_window: Any
  inner_state: optax.OptState


SKIP_REASONS = ("overflow", "nonfinite_loss", "loss_spike", "grad_norm_spike")
"""Why a step is skipped, in the order `LossScaleState.skips_by_reason`
counts them (`last_skip_reason` is 1 + the index, 0 for an applied step):
the gradients overflowed (the scale backs off), the loss itself is inf or
NaN, the loss is a spike, the unscaled gradient norm is a spike (no scale
change for the last three)."""


class SpikeWindow(NamedTuple):
  """The previous finite values the spike test compares a step with.

  Attributes:
    values: float32 of shape `(2, window)`: losses (row 0) and unscaled
      gradient norms (row 1), a ring buffer.
    seen: int32 of shape `(2,)`: how many of each were taken in
      (saturating); the next one goes at `seen % window`.
  """

  values: jax.Array
  seen: jax.Array


@dataclasses.dataclass(frozen=True)
class SkipSpikes:
  """Skip a step whose loss or unscaled gradient norm is a spike.

  A value is a spike when it lies more than `sigmas` standard deviations
  from the mean of the previous `window` finite values of its kind
  (OLMo-core's `SkipStepOptimizer` rule with the defaults): with `z = |x -
  mean| / std` (`(x - mean) / std` with `one_sided`), the standard
  deviation with `ddof` (1: unbiased) and at least `min_std`, a step is
  skipped when `z > sigmas` for the loss or for the gradient norm. While
  fewer than `warmup` values (default `max(20, window // 2)`), this one
  included, have been seen, the step is taken. A spike skips the whole
  step and leaves the loss scale alone; a skipped spike enters the window
  (so a lasting shift in level is accepted after a while), a non-finite
  value never does. [Skipping bad steps][skipping-bad-steps] has the rule,
  the settings that reproduce OLMo-core's, Levanter's and MaxText's, and
  where ours differs on purpose.

  Attributes:
    window: how many previous values the mean and deviation are taken
      over, a positive int.
    sigmas: the threshold, in standard deviations, a positive number.
    loss: test the loss (`tx.update(..., value=loss)` must give it).
    grad_norm: test the global norm of the unscaled gradients.
    one_sided: only a rise is a spike (Levanter, MaxText); False: a fall
      too (OLMo-core).
    warmup: the number of values seen (this one included) before the test
      applies, at least 2; None for `max(20, window // 2)`.
    ddof: delta degrees of freedom of the deviation, 1 (unbiased, torch's
      default) or 0.
    min_std: the smallest deviation the test divides by (Levanter: 1e-6).
  """

  window: int = 128
  sigmas: float = 6.0
  loss: bool = True
  grad_norm: bool = True
  one_sided: bool = False
  warmup: int | None = None
  ddof: int = 1
  min_std: float = 0.0

  def __post_init__(self) -> None:
    from lossscale import _checks

    fn = "SkipSpikes"
    _checks.positive_finite(fn, "sigmas", self.sigmas)
    for name in ("loss", "grad_norm", "one_sided"):
      _checks.boolean(fn, name, getattr(self, name))
    if not (self.loss or self.grad_norm):
      raise ValueError(
        "`SkipSpikes(loss=..., grad_norm=...)` must test at least one of them,"
        " got loss=False, grad_norm=False."
      )
    # Stored as Python numbers: the rule is hashed, and traced with them.
    set_ = lambda name, v: object.__setattr__(self, name, v)
    set_("window", _checks.positive_int(fn, "window", self.window))
    set_("sigmas", float(self.sigmas))
    if self.warmup is not None:
      # A z-score needs one previous value at least: this one and another.
      set_("warmup", _checks.int_at_least(fn, "warmup", self.warmup, 2, "an int >= 2"))
    whole = isinstance(self.ddof, numbers.Integral) and not isinstance(self.ddof, bool)
    if not (whole and self.ddof in (0, 1)):
      raise ValueError(f"`SkipSpikes(ddof=...)` must be 0 or 1, got {self.ddof!r}.")
    set_("ddof", int(self.ddof))
    real = isinstance(self.min_std, numbers.Real) and not isinstance(self.min_std, bool)
    if not (real and 0.0 <= float(self.min_std) < 1e38):
      raise ValueError(
        f"`SkipSpikes(min_std=...)` must be a finite number >= 0, got {self.min_std!r}."
      )
    set_("min_std", float(self.min_std))


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
  spikes: SkipSpikes | None = None  # skip loss and gradient-norm spikes


def init_counters(rule: Rule) -> dict[str, Any]:
  # A separate buffer per field: a state whose leaves share one buffer
  # cannot be donated to a jitted step.
  return dict(
    loss_scale=jnp.asarray(rule.initial_scale, jnp.float32),
    good_steps=jnp.zeros([], jnp.int32),
    hysteresis_left=jnp.asarray(rule.hysteresis, jnp.int32),
    skipped_steps=jnp.zeros([], jnp.int32),
    consecutive_skips=jnp.zeros([], jnp.int32),
    last_finite=jnp.ones([], jnp.bool_),
    last_applied=jnp.ones([], jnp.bool_),
    steps_since_rescale=jnp.zeros([], jnp.int32),
    overflows_since_backoff=jnp.zeros([], jnp.int32),
    overflows_at_min_scale=jnp.zeros([], jnp.int32),
    last_skip_reason=jnp.zeros([], jnp.int32),
    skips_by_reason=jnp.zeros([len(SKIP_REASONS)], jnp.int32),
    spike_window=()
    if rule.spikes is None
    else SpikeWindow(
      jnp.zeros([2, rule.spikes.window], jnp.float32), jnp.zeros([2], jnp.int32)
    ),
  )


def next_counters(
  rule: Rule,
  state: LossScaleState,
  overflowed: jax.Array,
  loss: jax.Array | None = None,
  norm: jax.Array | None = None,
) -> dict[str, Any]:
  """One step of the rule, written out in docs/how-it-works.md: the state's
  fields after the step, `last_applied` (whether it is applied) among them.

  Its inputs are the reasons to skip: `overflowed`, whether the gradients
  hold an inf or a NaN; `loss`, the unscaled loss, when given (a
  non-finite one skips the step, and explains non-finite gradients: no
  back-off); with `rule.spikes`, `loss` and `norm` (the unscaled gradient
  norm) tested against their windows. A step skipped for another reason
  than an overflow leaves the scale and its counters as they were. Whatever
  scale the state arrived with (one restored from a run with another
  configuration, say), the scale it leaves is one this wrapper's
  configuration allows: its fixed scale, or one within `[min_scale,
  max_scale]`.
  """
  f32, i32, inc = jnp.float32, jnp.int32, optax.safe_increment
  counters = state._asdict()
  del counters["inner_state"]
  if not rule.enabled:  # exactly `inner`: only the scale is set, to 1
    return counters | dict(loss_scale=jnp.ones([], f32))
  no = jnp.zeros([], jnp.bool_)
  bad_loss = no if loss is None else jnp.logical_not(jnp.isfinite(loss))
  overflow = jnp.logical_and(overflowed, jnp.logical_not(bad_loss))
  spikes = (no, no)
  if rule.spikes is not None:
    spikes, counters["spike_window"] = _spikes(
      rule.spikes, state.spike_window, loss, norm
    )
  reasons = jnp.stack([overflow, bad_loss, *spikes])  # in SKIP_REASONS' order
  applied = jnp.logical_not(jnp.any(reasons))
  first = jnp.argmax(reasons).astype(i32)  # the reason a skipped step counts as
  zero = jnp.zeros([], i32)
  good = jnp.where(overflow, zero, state.good_steps)
  good = jnp.where(applied, inc(state.good_steps), good)  # with this step
  counters.update(
    loss_scale=jnp.asarray(rule.initial_scale, f32),  # fixed: the one allowed
    good_steps=good,
    skipped_steps=jnp.where(applied, state.skipped_steps, inc(state.skipped_steps)),
    consecutive_skips=jnp.where(applied, zero, inc(state.consecutive_skips)),
    last_finite=jnp.logical_not(overflowed),
    last_applied=applied,
    last_skip_reason=jnp.where(applied, zero, first + 1),
    # One more at `first` where skipped, saturating as `safe_increment`
    # does; arithmetic, not a select of arrays.
    skips_by_reason=state.skips_by_reason
    + (
      (jnp.arange(len(SKIP_REASONS), dtype=i32) == first)
      & (state.skips_by_reason < jnp.iinfo(i32).max)
      & jnp.logical_not(applied)
    ).astype(i32),
  )
  if rule.dynamic:
    counters.update(_dynamic(rule, state, overflow, applied, good))
  return counters


def _dynamic(rule, state, overflow, applied, good) -> dict[str, jax.Array]:
  """The scale and the counters a dynamic rule moves (`good`: the good
  steps counted with this one)."""
  f32, i32, inc = jnp.float32, jnp.int32, optax.safe_increment
  zero = jnp.zeros([], i32)
  scale, refill = state.loss_scale, jnp.asarray(rule.hysteresis, i32)
  # A restored state may have more overflows left than this rule tolerates
  # (`set_loss_scale` leaves it full).
  h_left = jnp.minimum(state.hysteresis_left, refill)
  grow = jnp.logical_and(applied, good >= rule.growth_interval + rule.growth_delay)
  # Saturates at 0 instead of wrapping; the back-off test `<= 0` is unchanged.
  h_after_overflow = jnp.maximum(h_left - 1, zero)
  back_off = jnp.logical_and(overflow, h_after_overflow <= 0)
  counted = jnp.logical_or(applied, overflow)  # a step the rule takes in
  steps = state.steps_since_rescale
  steps = jnp.where(counted, inc(steps), steps)
  overflows = state.overflows_since_backoff
  overflows = jnp.where(overflow, inc(overflows), overflows)
  if rule.tolerance > 0.0:  # 0: every overflow backs off (the ratio is >= 0)
    ratio = jnp.asarray(overflows, f32) / jnp.asarray(steps, f32)
    back_off = jnp.logical_and(back_off, ratio >= f32(rule.tolerance))
  if rule.reset_hysteresis_on_backoff:
    h_after_overflow = jnp.where(back_off, refill, h_after_overflow)
  h_finite = refill if rule.consecutive_hysteresis else jnp.where(grow, refill, h_left)
  h_skipped = jnp.where(overflow, h_after_overflow, state.hysteresis_left)
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
    hysteresis_left=jnp.where(applied, h_finite, h_skipped),
    steps_since_rescale=jnp.where(jnp.logical_or(grow, back_off), zero, steps),
    overflows_since_backoff=jnp.where(back_off, zero, overflows),
    overflows_at_min_scale=jnp.where(
      at_min, inc(state.overflows_at_min_scale), state.overflows_at_min_scale
    ),
  )


def _spikes(
  spikes: SkipSpikes, window: SpikeWindow, loss: Any, norm: Any
) -> tuple[tuple[jax.Array, jax.Array], SpikeWindow]:
  """Whether the loss and the gradient norm are spikes against `window`
  (the previous finite values of each), and the window with them taken in
  (the finite ones: a skipped spike too)."""
  f32, i32 = jnp.float32, jnp.int32
  _check_window(spikes, window)
  nan = jnp.full([], jnp.nan, f32)
  x = jnp.stack(
    [
      nan if loss is None or not spikes.loss else jnp.asarray(loss, f32),
      nan if norm is None or not spikes.grad_norm else jnp.asarray(norm, f32),
    ]
  )
  width = spikes.window
  n = jnp.minimum(window.seen, width)  # values in each row
  held = jnp.arange(width)[None, :] < n[:, None]
  count = jnp.maximum(n, 1).astype(f32)
  mean = jnp.sum(jnp.where(held, window.values, 0.0), axis=1) / count
  squares = jnp.where(held, (window.values - mean[:, None]) ** 2, 0.0)
  std = jnp.sqrt(jnp.sum(squares, axis=1) / jnp.maximum(n - spikes.ddof, 1).astype(f32))
  std = jnp.maximum(std, f32(spikes.min_std))
  off = x - mean if spikes.one_sided else jnp.abs(x - mean)
  warmup = spikes.warmup or max(20, width // 2)
  finite = jnp.isfinite(x)
  warm = window.seen + 1 >= warmup  # this value included
  spike = jnp.logical_and(jnp.logical_and(finite, warm), off > f32(spikes.sigmas) * std)
  # A norm beyond float32's range is a spike however early: where the
  # gradients are finite it is theirs, else they overflowed, the reason
  # that comes first.
  norm_spike = jnp.logical_or(spike[1], jnp.isposinf(x[1]))
  at = window.seen % width
  slot = jnp.arange(width)[None, :] == at[:, None]
  values = jnp.where(jnp.logical_and(slot, finite[:, None]), x[:, None], window.values)
  seen = jnp.where(finite, optax.safe_increment(window.seen), window.seen).astype(i32)
  return (spike[0], norm_spike), SpikeWindow(values, seen)


def _check_window(spikes: SkipSpikes, window: Any) -> None:
  """Refuses a state whose spike window `spikes` cannot step with."""
  if not isinstance(window, SpikeWindow):
    raise ValueError(
      f"`skip_spikes={spikes!r}` is on, but the state has no spike window (it"
      " was built by a wrapper without `skip_spikes`, or by an earlier"
      " version): convert it with `lossscale.upgrade_state(state,"
      " skip_spikes=...)`, which adds an empty one."
    )
  width = window.values.shape[-1]
  if width != spikes.window:
    raise ValueError(
      f"`skip_spikes={spikes!r}` wants a window of {spikes.window} values, but"
      f" the state's spike window holds {width}: convert it with"
      " `lossscale.upgrade_state(state, skip_spikes=...)`, which keeps its"
      " newest values."
    )


def is_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def states_in(tree: Any) -> list[LossScaleState]:
  """Every `LossScaleState` in `tree`, nested anywhere, in leaf order."""
  return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
