"""The three public wrappers: settings checked, a `Rule` built, `wrap` called.

`dynamic_loss_scale`, `static_loss_scale` and `skip_nonfinite` differ only
in the fixed settings of their `Rule` (`lossscale/_rule.py`); the step they
build is `lossscale/_wrapper.py`'s.
"""

from __future__ import annotations

from typing import Any

import optax

from lossscale import _axes, _checks
from lossscale._rule import Rule, SkipSpikes
from lossscale._wrapper import wrap


def dynamic_loss_scale(
  inner: optax.GradientTransformation,
  *,
  initial_scale: float = 2.0**15,
  growth_interval: int = 2000,
  growth_factor: float = 2.0,
  backoff_factor: float = 0.5,
  hysteresis: int = 1,
  min_scale: float = 1.0,
  max_scale: float = 2.0**24,
  axis_name: _axes.AxisName | None = None,
  reset_hysteresis_on_backoff: bool = False,
  consecutive_hysteresis: bool = False,
  growth_delay: int = 0,
  tolerance: float = 0.0,
  skip_spikes: SkipSpikes | None = None,
  enabled: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` with dynamic loss scaling and skip-on-overflow.

  `update` takes gradients of the *scaled* loss ([`lossscale.scale_loss`][],
  [`lossscale.value_and_grad`][]), divides them by the scale in float32 and
  checks them. A finite step runs `inner` on the unscaled gradients; a
  non-finite step returns zero updates and leaves `inner`'s state bit for bit
  (transformations chained *after* the wrapper still run, on those zeros;
  [`lossscale.apply_gradients`][] skips them too). Then the scale moves: it is
  multiplied by `growth_factor` (up to `max_scale`) on exactly the
  `growth_interval`-th consecutive finite step (a product past the float32
  range keeps the scale), and by `backoff_factor` (down to `min_scale`) on
  the `hysteresis`-th non-finite step since it last grew, then on every one
  (or, with `reset_hysteresis_on_backoff`, on every `hysteresis`-th). The
  rule in full: [How dynamic loss scaling works][the-rule].

  `update` divides by the scale in the state it is given, the one the loss
  was multiplied by, and leaves a scale within `[min_scale, max_scale]`, so a
  state restored from a run with another configuration gives the right step
  at once ([Resuming with another
  configuration][resuming-with-another-configuration]).

  Half-precision gradients are unscaled in float32 and `inner` runs in
  float32 (on widened copies of its state and the parameters); its state
  keeps the dtypes it started with, with no retrace: bfloat16 parameters
  keep the bfloat16 state `inner.init(params)` gives, float16 parameters get
  a float32 state (float16 moments underflow: Adam's second moment is 0 for
  any |g| < 5.458e-3), with `enabled=False` too. The updates come out in the
  parameters' dtype, as bare `inner` gives them (computed in float32, then
  rounded), so any `apply_updates` keeps the parameters' dtype.
  Gradient-valued extra arguments (`grad=`, as `optax.lbfgs`'s line search
  takes) are unscaled like the gradients. Called outside `jax.jit`, the step
  is decided in Python and `inner` runs op by op, as it does bare: Python
  state it reads (a learning rate changed between steps) is read on every
  step. With `axis_name`
  the finite flag is reduced over that mapped axis, so all replicas skip
  together; without it they still agree when the gradients were averaged
  first ([`lossscale.cross_shard_mean`][]; see [Data-parallel
  training][averaging-first-no-extra-collective]).

  Args:
    inner: the optimizer to wrap, any `optax.GradientTransformation`; extra
      arguments of `update` (such as `value` for `optax.lbfgs`) are forwarded.
    initial_scale: the first scale, within `[min_scale, max_scale]`.
    growth_interval: consecutive finite steps after which the scale grows.
    growth_factor: multiplier on growth, `>= 1`.
    backoff_factor: multiplier on back-off, in `(0, 1]`.
    hysteresis: the scale backs off on the `hysteresis`-th overflow since it
      last grew (`hysteresis - 1` are tolerated; none with the default 1).
    min_scale: the lowest scale, a normal float32 (`>= 2**-126`).
    max_scale: the highest scale, a finite float32. The scale multiplies
      the loss in float32, so it may pass float16's largest value (65504)
      when the loss is reduced in float32: what enters the float16 backward
      pass is the scale times the loss's derivative, and the finite check
      bounds it. Use `max_scale=65504.0` when the loss itself is a float16
      value (the backward pass then starts from the scale rounded to
      float16, inf above 65504) or to reproduce MPX ([Coming from
      MPX][scales-above-65504]).
    axis_name: axis name(s) over which the finite flag is reduced. The
      axes a collective inside `inner` communicates over (a
      `cross_shard_mean` chained inside) are added to them, so that every
      replica runs `inner` or none does ([Data-parallel
      training][wherever-the-collective-stands]).
    reset_hysteresis_on_backoff: refill `h` after each back-off too, so the
      scale backs off on every `hysteresis`-th overflow since it last changed.
    consecutive_hysteresis: `True`: DeepSpeed's rule (refill on every finite
      step), so only `hysteresis` overflows *in a row* back the scale off (as
      Apex's `update_scale_hysteresis`); `False`: refill on growth only.
    growth_delay: extra finite steps before the first growth after the start
      or a skipped step, a non-negative int; later growths come every
      `growth_interval` finite steps. DeepSpeed's rule is `growth_delay=1`
      (its first growth comes on the `(scale_window + 1)`-th finite step).
    tolerance: fairseq's `tolerance`, in `[0, 1]`: an overflow backs the
      scale off only when the skipped steps since the last back-off, over the
      steps since the last growth or back-off, are `>= tolerance` (computed
      in float32). 0 backs off on every overflow; needs `hysteresis=1`.
    skip_spikes: a [`lossscale.SkipSpikes`][] to also skip a step whose
      loss (given as `value=`) or unscaled gradient norm is a spike, leaving
      the scale alone; None (the default) does not test them and costs
      nothing. [Skipping bad steps][skipping-bad-steps]. With
      `enabled=False` nothing is tested (the wrapper is exactly `inner`);
      to skip spikes without a loss scale, use
      [`lossscale.skip_nonfinite`][] with it.
    enabled: `False` gives exactly `inner` (no scaling, no skipping) with the
      same state structure and dtypes and a loss scale of 1 (a restored
      state's scale is divided out of its first step, then set to 1); float16
      parameters keep their float32 state, on which `inner` runs.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    [`lossscale.LossScaleState`][].

  Raises:
    ValueError: at construction, for an invalid setting (naming it).
    TypeError: when `inner` is not an `optax.GradientTransformation`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([4.0, -8.0])}  # gradients of loss * 4
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> updates["w"]
    Array([-0.1,  0.2], dtype=float32)
    >>> bad = {"w": jnp.array([jnp.inf, 1.0])}
    >>> updates, state = jax.jit(tx.update)(bad, state, params)
    >>> updates["w"], ls.get_loss_scale(state), state.skipped_steps
    (Array([0., 0.], dtype=float32), Array(2., dtype=float32), Array(1, dtype=int32))

  References:
    PyTorch `torch.amp.GradScaler` (`hysteresis=1`); Megatron-LM
    `DynamicGradScaler` (`hysteresis=2`); DeepSpeed `DynamicLossScaler`
    (`growth_delay=1`, `consecutive_hysteresis`); fairseq
    `DynamicLossScaler` (`tolerance`); TensorFlow
    `ExponentialUpdateLossScaleManager` (`reset_hysteresis_on_backoff=True`);
    Micikevicius et al., "Mixed Precision Training", ICLR 2018. The settings
    that reproduce each: [Coming from PyTorch][settings-scaler-by-scaler].
  """
  fn = "dynamic_loss_scale"
  v = _checks
  min_scale = v.float32_scale(fn, "min_scale", min_scale)
  max_scale = v.float32_scale(fn, "max_scale", max_scale)
  if min_scale > max_scale:
    raise ValueError(
      f"`{fn}(min_scale=..., max_scale=...)` need min_scale <= max_scale,"
      f" got min_scale={min_scale!r} > max_scale={max_scale!r}."
    )
  initial_scale = v.float32_scale(fn, "initial_scale", initial_scale)
  if not min_scale <= initial_scale <= max_scale:
    hint = (
      f" Raise max_scale too (max_scale={initial_scale!r} or more): the"
      " default max_scale is 2**24, below DeepSpeed's and Megatron-LM's class"
      " default initial scale of 2**32."
      if initial_scale > max_scale
      else " Lower min_scale too."
    )
    raise ValueError(
      f"`{fn}(initial_scale=...)` must lie within [min_scale, max_scale] ="
      f" [{min_scale!r}, {max_scale!r}], got {initial_scale!r}.{hint}"
    )
  rule = _policy_rule(
    fn,
    initial_scale=initial_scale,
    growth_interval=v.positive_int(fn, "growth_interval", growth_interval),
    growth_factor=v.at_least_one(fn, "growth_factor", growth_factor),
    backoff_factor=v.in_unit_interval(fn, "backoff_factor", backoff_factor),
    hysteresis=v.positive_int(fn, "hysteresis", hysteresis),
    reset_hysteresis_on_backoff=v.boolean(
      fn, "reset_hysteresis_on_backoff", reset_hysteresis_on_backoff
    ),
    consecutive_hysteresis=v.boolean(
      fn, "consecutive_hysteresis", consecutive_hysteresis
    ),
    growth_delay=v.non_negative_int(fn, "growth_delay", growth_delay),
    tolerance=v.fraction(fn, "tolerance", tolerance),
    min_scale=min_scale,
    max_scale=max_scale,
    spikes=_spikes(fn, skip_spikes),
  )
  return _build(fn, inner, rule, axis_name, enabled)


def _policy_rule(fn: str, **settings: Any) -> Rule:
  """The dynamic `Rule`, after the checks that involve two settings."""
  rule = Rule(dynamic=True, **settings)
  if rule.growth_interval + rule.growth_delay > _checks.INT32_MAX:
    raise ValueError(
      f"`{fn}(growth_interval=..., growth_delay=...)` need growth_interval +"
      f" growth_delay <= {_checks.INT32_MAX} (the good-step counter"
      f" saturates there), got {rule.growth_interval} + {rule.growth_delay}."
    )
  if rule.tolerance > 0.0 and rule.hysteresis > 1:
    raise ValueError(
      f"`{fn}(tolerance=..., hysteresis=...)` are two back-off policies"
      " (fairseq's and Megatron-LM's or DeepSpeed's): set one, got"
      f" tolerance={rule.tolerance!r} with hysteresis={rule.hysteresis!r}."
    )
  return rule


def _spikes(fn: str, skip_spikes: Any) -> SkipSpikes | None:
  if skip_spikes is not None and not isinstance(skip_spikes, SkipSpikes):
    raise ValueError(
      f"`{fn}(skip_spikes=...)` must be a lossscale.SkipSpikes or None, got"
      f" {skip_spikes!r} instead."
    )
  return skip_spikes


def _build(fn, inner, rule, axis_name, enabled):
  axis_name = _axes.validate_axis_name(fn, axis_name)
  if not _checks.boolean(fn, "enabled", enabled):
    # Exactly `inner`; the same state structure (a spike window included).
    rule = Rule(initial_scale=1.0, dynamic=False, enabled=False, spikes=rule.spikes)
  return wrap(fn, inner, rule, axis_name)


def static_loss_scale(
  inner: optax.GradientTransformation,
  loss_scale: float,
  *,
  axis_name: _axes.AxisName | None = None,
  skip_spikes: SkipSpikes | None = None,
  enabled: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` with a fixed loss scale and skip-on-overflow.

  Like [`lossscale.dynamic_loss_scale`][] with a scale that never changes:
  non-finite steps are still skipped (zero updates, `inner`'s state bit for
  bit, `skipped_steps` counted). A restored state holding another scale is
  unscaled by that scale on its first step, after which the scale is
  `loss_scale`.

  Args:
    inner: the optimizer to wrap, any `optax.GradientTransformation`.
    loss_scale: the fixed scale, a normal float32 (`>= 2**-126`).
    axis_name: axis name(s) over which the finite flag is reduced.
    skip_spikes: as for [`lossscale.dynamic_loss_scale`][].
    enabled: `False` gives exactly `inner` (no scaling, no skipping) with the
      same state structure and dtypes and a loss scale of 1.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    [`lossscale.LossScaleState`][].

  Raises:
    ValueError: at construction, for an invalid setting (naming it).
    TypeError: when `inner` is not an `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.static_loss_scale(optax.sgd(1.0), 128.0)
    >>> state = tx.init({"w": jnp.zeros(1)})
    >>> updates, state = tx.update({"w": jnp.array([64.0])}, state)
    >>> updates["w"], ls.get_loss_scale(state)
    (Array([-0.5], dtype=float32), Array(128., dtype=float32))

  References:
    TensorFlow `FixedLossScaleManager`.
  """
  fn = "static_loss_scale"
  scale = _checks.float32_scale(fn, "loss_scale", loss_scale)
  rule = Rule(
    initial_scale=scale,
    dynamic=False,
    min_scale=scale,
    max_scale=scale,
    spikes=_spikes(fn, skip_spikes),
  )
  return _build(fn, inner, rule, axis_name, enabled)


def skip_nonfinite(
  inner: optax.GradientTransformation,
  *,
  axis_name: _axes.AxisName | None = None,
  skip_spikes: SkipSpikes | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` to skip steps whose gradients hold an inf or a NaN.

  For bfloat16 or float32 training, which needs no loss scaling: gradients
  reach `inner` unscaled (half-precision ones in float32, and float16
  parameters get a float32 optimizer state, as with
  [`lossscale.dynamic_loss_scale`][]), and a non-finite step gives zero updates and
  leaves `inner`'s state bit for bit. Unlike `optax.apply_if_finite` it never
  applies a non-finite update ([`lossscale.check_not_stalled`][] fails
  loudly when every step is skipped). The loss scale is 1: a state restored
  from a loss-scaled run (switching a float16 run to bfloat16) has its scale
  divided out of the first step's gradients, then set to 1.

  Args:
    inner: the optimizer to wrap, any `optax.GradientTransformation`.
    axis_name: axis name(s) over which the finite flag is reduced.
    skip_spikes: as for [`lossscale.dynamic_loss_scale`][].

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    [`lossscale.LossScaleState`][].

  Raises:
    ValueError: at construction, for an invalid `axis_name`.
    TypeError: when `inner` is not an `optax.GradientTransformation`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.skip_nonfinite(optax.sgd(1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    >>> updates["w"], state.skipped_steps
    (Array([0., 0.], dtype=float32), Array(1, dtype=int32))

  References:
    TensorFlow `LossScaleOptimizer` (skipping non-finite steps).
  """
  fn = "skip_nonfinite"
  rule = Rule(initial_scale=1.0, dynamic=False, spikes=_spikes(fn, skip_spikes))
  return _build(fn, inner, rule, axis_name, True)
