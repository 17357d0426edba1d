"""Loss-scaling optax wrappers: one state machine behind three factories.

The rule, in pseudo-code (the dynamic case; `static_loss_scale` and
`skip_nonfinite` keep the scale fixed and only skip)::

    u = grads * (1 / loss_scale)              # in float32 (or wider)
    finite = all(isfinite(u))                 # reduced over `axis_name`, if set
    if finite:
      updates, inner_state = inner.update(u, inner_state, params, **extra)
      good += 1
      if good == growth_interval:
        loss_scale = min(loss_scale * growth_factor, max_scale)
        good = 0
        hysteresis_left = hysteresis
    else:
      updates = zeros; inner_state unchanged  # bit for bit
      skipped_steps += 1
      good = 0
      hysteresis_left -= 1
      if hysteresis_left <= 0:
        loss_scale = max(loss_scale * backoff_factor, min_scale)
    consecutive_skips = 0 if finite else consecutive_skips + 1

With `hysteresis=1` this is `torch.amp.GradScaler`'s trajectory; with
`hysteresis=h` it is Megatron-LM's `DynamicGradScaler`. Growth happens on
exactly the `growth_interval`-th consecutive finite step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from lossscale import _axes, _fused, _validation
from lossscale._finite import all_finite, is_inexact


class LossScaleState(NamedTuple):
  """State of a loss-scaling wrapper: the scale, its counters, the inner state.

  Every field is an array with a fixed dtype, so the state is a plain pytree
  that can be jitted, vmapped, sharded and checkpointed.

  Attributes:
    loss_scale: the current loss scale, a float32 scalar in
      `[min_scale, max_scale]`; multiply the loss by it before
      differentiating (`lossscale.scale_loss`).
    good_steps: int32, consecutive finite steps since the scale last changed
      (or since the last skipped step).
    hysteresis_left: int32, how many more non-finite steps are tolerated
      before the scale backs off (Megatron-LM's hysteresis tracker).
    skipped_steps: int32, total number of skipped (non-finite) steps.
    consecutive_skips: int32, skipped steps since the last applied step; a
      large value means training has stalled (see
      `lossscale.check_not_stalled`).
    inner_state: the wrapped optimizer's state, untouched on skipped steps.
  """

  loss_scale: jax.Array
  good_steps: jax.Array
  hysteresis_left: jax.Array
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  inner_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class _Rule:
  """Fixed settings of the state machine (closure, never state)."""

  initial_scale: float
  scaled: bool  # False: `skip_nonfinite`, gradients are used as they are.
  dynamic: bool
  growth_interval: int = 1
  growth_factor: float = 1.0
  backoff_factor: float = 1.0
  hysteresis: int = 1
  min_scale: float = 1.0
  max_scale: float = 1.0


def _init_counters(rule: _Rule) -> dict[str, jax.Array]:
  # A separate buffer per field: a state whose leaves share one buffer
  # cannot be donated to a jitted step.
  return dict(
    loss_scale=jnp.asarray(rule.initial_scale, jnp.float32),
    good_steps=jnp.zeros([], jnp.int32),
    hysteresis_left=jnp.asarray(rule.hysteresis, jnp.int32),
    skipped_steps=jnp.zeros([], jnp.int32),
    consecutive_skips=jnp.zeros([], jnp.int32),
  )


def _next_counters(
  rule: _Rule, state: LossScaleState, finite: jax.Array
) -> dict[str, jax.Array]:
  """The scale-adjustment rule (the module docstring's pseudo-code)."""
  zero = jnp.zeros([], jnp.int32)
  skipped = jnp.where(
    finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
  )
  consecutive = jnp.where(finite, zero, optax.safe_increment(state.consecutive_skips))
  good = jnp.where(finite, optax.safe_increment(state.good_steps), zero)
  if not rule.dynamic:
    return dict(
      loss_scale=state.loss_scale,
      good_steps=good,
      hysteresis_left=state.hysteresis_left,
      skipped_steps=skipped,
      consecutive_skips=consecutive,
    )

  f32 = jnp.float32
  scale = state.loss_scale
  grow = jnp.logical_and(finite, good >= rule.growth_interval)
  # Saturates at 0: "h -= 1; if h <= 0" behaves the same and cannot wrap.
  h_after_overflow = jnp.maximum(state.hysteresis_left - 1, zero)
  back_off = jnp.logical_and(jnp.logical_not(finite), h_after_overflow <= 0)
  grown = jnp.minimum(scale * f32(rule.growth_factor), f32(rule.max_scale))
  shrunk = jnp.maximum(scale * f32(rule.backoff_factor), f32(rule.min_scale))
  new_scale = jnp.where(grow, grown, jnp.where(back_off, shrunk, scale))
  hysteresis_left = jnp.where(
    finite,
    jnp.where(grow, jnp.asarray(rule.hysteresis, jnp.int32), state.hysteresis_left),
    h_after_overflow,
  )
  return dict(
    loss_scale=new_scale,
    good_steps=jnp.where(grow, zero, good),
    hysteresis_left=hysteresis_left,
    skipped_steps=skipped,
    consecutive_skips=consecutive,
  )


def _unscale(grads: Any, loss_scale: jax.Array) -> Any:
  """`grads * (1 / loss_scale)` in the wider of float32 and each leaf's dtype."""
  inv = jnp.float32(1.0) / loss_scale

  def leaf(g):
    if not is_inexact(g):
      return g
    # The wider of float32 and the leaf's dtype (complex64/128 are already
    # at least as wide); computed by hand, as strict promotion forbids
    # `promote_types(float32, float16)`.
    dtype = g.dtype if jnp.finfo(g.dtype).bits >= 32 else jnp.dtype(jnp.float32)
    return g.astype(dtype) * inv.astype(dtype)

  return jax.tree.map(leaf, grads)


def _check_matches_params(fn: str, grads: Any, params: Any) -> None:
  """Raises a clear error when `grads` cannot be the gradient of `params`."""
  if params is None:
    return
  g_def, p_def = jax.tree.structure(grads), jax.tree.structure(params)
  if g_def != p_def:
    raise ValueError(
      f"`{fn}`: the gradient tree does not match the params tree the"
      f" optimizer state was built for.\n  gradients: {g_def}\n  params:   "
      f" {p_def}"
    )
  for (path, g), p in zip(
    jax.tree.leaves_with_path(grads), jax.tree.leaves(params), strict=True
  ):
    g_shape, p_shape = getattr(g, "shape", None), getattr(p, "shape", None)
    if g_shape is not None and p_shape is not None and g_shape != p_shape:
      where = jax.tree_util.keystr(path) or "the root"
      raise ValueError(
        f"`{fn}`: the gradient at {where} has shape {g_shape},"
        f" but the parameter there has shape {p_shape}."
      )


def _wrap(
  fn: str,
  inner: optax.GradientTransformation,
  rule: _Rule,
  axis_name: _axes.AxisName | None,
) -> optax.GradientTransformationExtraArgs:
  """Builds the wrapper; the one place the skip-and-adjust logic lives."""
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"`{fn}(inner=...)` must be an optax.GradientTransformation, got"
      f" {type(inner).__name__} instead."
    )
  inner = optax.with_extra_args_support(inner)
  rule_id = object()  # tells `apply_gradients` one wrapper traced twice apart

  def init_fn(params):
    return LossScaleState(**_init_counters(rule), inner_state=inner.init(params))

  def decide(updates, loss_scale):
    u = _unscale(updates, loss_scale) if rule.scaled else updates
    finite = all_finite(u)
    if axis_name is not None:
      # One scalar collective: every replica takes the same decision.
      finite = _axes.bound_collective(
        fn, axis_name, lambda: jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
      )
    return finite

  def update_fn(updates, state, params=None, **extra_args):
    _check_matches_params(fn, updates, params)
    fused = _fused.active()  # set only while `lossscale.apply_gradients` traces
    if fused is None or fused.mode == _fused.PROBE:
      finite = decide(updates, state.loss_scale)
      if fused is not None:
        fused.seen.append(rule_id)
        fused.finite, fused.incoming = finite, updates
    else:
      # Inside `apply_gradients`' cond: the decision was taken before it,
      # from exactly these updates; recomputing them here would be dead code.
      finite, updates = fused.finite, fused.incoming

    def apply():
      u = _unscale(updates, state.loss_scale) if rule.scaled else updates
      # A select, not a multiply: where `lax.cond` runs both branches (under
      # `jax.vmap` with a batched flag) the inner optimizer sees zeros, not
      # inf/NaN, so nothing non-finite is ever computed.
      u = jax.tree.map(
        lambda x: jnp.where(finite, x, jnp.zeros_like(x)) if is_inexact(x) else x, u
      )
      return inner.update(u, state.inner_state, params, **extra_args)

    def skip():
      # Exact zeros of the dtypes the finite path returns; state untouched.
      shapes = jax.eval_shape(apply)[0]
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      return zeros, state.inner_state

    if fused is None:
      # `lax.cond`, not a select: a skipped step runs nothing, and a finite
      # step runs the inner optimizer in place on its state (see the
      # `dynamic_loss_scale` docstring for the numbers).
      new_updates, inner_state = _axes.cond(finite, apply, skip)
    elif fused.mode == _fused.APPLY:
      new_updates, inner_state = apply()
    else:
      new_updates, inner_state = skip()
    return new_updates, LossScaleState(
      **_next_counters(rule, state, finite), inner_state=inner_state
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` with dynamic loss scaling and skip-on-overflow.

  Feed the returned transformation gradients of the *scaled* loss
  (`lossscale.scale_loss` or `lossscale.value_and_grad`). Each `update`
  divides them by the current scale in float32, checks that every element is
  finite and then either applies `inner` (finite step) or skips: the updates
  are exact zeros and `inner`'s state is left bit-for-bit unchanged, so
  schedules and step counts inside `inner` do not advance. The scale then
  grows by `growth_factor` on exactly the `growth_interval`-th consecutive
  finite step and backs off by `backoff_factor` once `hysteresis` non-finite
  steps have been seen since the last growth::

      finite:      good += 1
                   if good == growth_interval:
                     scale = min(scale * growth_factor, max_scale)
                     good = 0; h = hysteresis
      non-finite:  good = 0; h -= 1
                   if h <= 0: scale = max(scale * backoff_factor, min_scale)

  With `hysteresis=1` the scale follows `torch.amp.GradScaler`; with
  `hysteresis=2` Megatron-LM's `DynamicGradScaler`.

  Skipping uses `lax.cond`, not a select (`jnp.where`), chosen by
  measurement (`benchmarks/optimizer_step.py`, 25M float32 parameters,
  AdamW, XLA:CPU): with selects on the updates and the state XLA
  recomputes the new moments from the old ones inside the parameter update
  and copies the donated moment buffers to keep them alive, about 5x a bare
  step with 200 MB of temporaries, and a skipped step costs as much as a
  finite one. With `lax.cond` a skipped step never runs the inner
  optimizer, and a finite step runs it in place; what is left over is the
  updates array the wrapper must hand to `optax.apply_updates`, one
  parameter-sized temporary. Where the whole step can be compiled
  together, `lossscale.apply_gradients` puts `apply_updates` inside the
  same `lax.cond` and removes that too (see `docs/performance.md`). Under
  `jax.vmap` with a per-member flag the `lax.cond` becomes a select: the
  inner optimizer then runs on zeros for skipped members, so no inf or NaN
  is ever computed into the state.

  Distributed training: with `axis_name` (a name or tuple of names bound by
  `jax.pmap` or `jax.shard_map`) the finite flag is reduced across those axes
  with one scalar collective, so all replicas skip together. Without it the
  decision is still the same on every replica when gradients were averaged
  first (`optax.chain(lossscale.cross_shard_mean(axis), ...)`), because an inf
  or NaN on any replica propagates through the all-reduce. Under SPMD
  `jax.jit` on sharded arrays no axis name is needed.

  Gradient leaves: float16 and bfloat16 gradients are unscaled (and reach
  `inner`) in float32, float32 and float64 in their own dtype; complex
  gradients are unscaled in their own dtype and are non-finite when either
  part is. Integer, boolean and `float0` leaves (the latter from
  `jax.grad(..., allow_int=True)`) cannot hold inf or NaN: the finite check
  ignores them and they reach `inner` as they are, not divided by the scale,
  so mask them out of `inner` (`optax.masked`); like every update they are
  zeros on a skipped step. `None` and `optax.MaskedNode` entries are empty
  subtrees and pass through. When `params` is given to `update`, gradients
  whose tree or shapes differ from it raise a `ValueError` before anything
  is computed; without `params` the mismatch surfaces in `inner` or in
  `optax.apply_updates`. A step that never stops overflowing is skipped
  forever, never applied: see `lossscale.check_not_stalled`.

  Args:
    inner: the optimizer to wrap; any `optax.GradientTransformation`. Extra
      arguments of `update` (such as `value`, `grad`, `value_fn` for
      `optax.lbfgs`) are forwarded.
    initial_scale: the first loss scale, within `[min_scale, max_scale]`.
    growth_interval: consecutive finite steps after which the scale grows.
    growth_factor: multiplier on growth, `>= 1`.
    backoff_factor: multiplier on back-off, in `(0, 1]`.
    hysteresis: non-finite steps tolerated (since the last growth) before the
      scale backs off, `>= 1`.
    min_scale: the scale never goes below this (positive).
    max_scale: the scale never goes above this.
    axis_name: optional axis name(s) over which the finite flag is reduced.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScaleState`.

  Raises:
    ValueError: at construction, for an invalid setting (the message names
      the argument and the value).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0,
    ...                            growth_interval=2)
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
  """
  fn = "dynamic_loss_scale"
  v = _validation
  min_scale = v.float32_representable(
    fn, "min_scale", v.positive_finite(fn, "min_scale", min_scale)
  )
  max_scale = v.float32_representable(
    fn, "max_scale", v.positive_finite(fn, "max_scale", max_scale)
  )
  if min_scale > max_scale:
    raise ValueError(
      f"`{fn}(min_scale=..., max_scale=...)` need min_scale <= max_scale,"
      f" got min_scale={min_scale!r} > max_scale={max_scale!r}."
    )
  initial_scale = v.float32_representable(
    fn, "initial_scale", v.positive_finite(fn, "initial_scale", initial_scale)
  )
  if not min_scale <= initial_scale <= max_scale:
    raise ValueError(
      f"`{fn}(initial_scale=...)` must lie within [min_scale, max_scale] ="
      f" [{min_scale!r}, {max_scale!r}], got {initial_scale!r}."
    )
  rule = _Rule(
    initial_scale=initial_scale,
    scaled=True,
    dynamic=True,
    growth_interval=v.positive_int(fn, "growth_interval", growth_interval),
    growth_factor=v.at_least_one(fn, "growth_factor", growth_factor),
    backoff_factor=v.in_unit_interval(fn, "backoff_factor", backoff_factor),
    hysteresis=v.positive_int(fn, "hysteresis", hysteresis),
    min_scale=min_scale,
    max_scale=max_scale,
  )
  return _wrap(fn, inner, rule, _axes.validate_axis_name(fn, axis_name))


def static_loss_scale(
  inner: optax.GradientTransformation,
  loss_scale: float,
  *,
  axis_name: _axes.AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` with a fixed loss scale and skip-on-overflow.

  Like `dynamic_loss_scale`, but the scale never changes (TensorFlow's
  `FixedLossScaleManager`). Non-finite steps are still skipped: zero
  updates, `inner`'s state bit-for-bit unchanged, `skipped_steps` counted.

  Args:
    inner: the optimizer to wrap; any `optax.GradientTransformation`.
    loss_scale: the fixed scale, a positive finite number.
    axis_name: optional axis name(s) over which the finite flag is reduced
      (see `dynamic_loss_scale`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScaleState`.

  Raises:
    ValueError: at construction, when `loss_scale` is not positive and finite.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.static_loss_scale(optax.sgd(1.0), 128.0)
    >>> state = tx.init({"w": jnp.zeros(1)})
    >>> updates, state = tx.update({"w": jnp.array([64.0])}, state)
    >>> updates["w"], ls.get_loss_scale(state)
    (Array([-0.5], dtype=float32), Array(128., dtype=float32))
  """
  fn = "static_loss_scale"
  scale = _validation.float32_representable(
    fn, "loss_scale", _validation.positive_finite(fn, "loss_scale", loss_scale)
  )
  rule = _Rule(
    initial_scale=scale, scaled=True, dynamic=False, min_scale=scale, max_scale=scale
  )
  return _wrap(fn, inner, rule, _axes.validate_axis_name(fn, axis_name))


def skip_nonfinite(
  inner: optax.GradientTransformation,
  *,
  axis_name: _axes.AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` to skip steps whose gradients hold an inf or a NaN.

  For bfloat16 or float32 training, where no loss scaling is needed: the
  gradients reach `inner` as they are (no cast, no multiplication), and a
  non-finite step gives zero updates and leaves `inner`'s state bit-for-bit
  unchanged. Unlike `optax.apply_if_finite` it never gives up and applies a
  non-finite update; use `lossscale.check_not_stalled` to fail loudly when
  every step is being skipped. The state's `loss_scale` is 1.

  Args:
    inner: the optimizer to wrap; any `optax.GradientTransformation`.
    axis_name: optional axis name(s) over which the finite flag is reduced
      (see `dynamic_loss_scale`).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a
    `LossScaleState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.skip_nonfinite(optax.sgd(1.0))
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state)
    >>> updates["w"], state.skipped_steps
    (Array([0., 0.], dtype=float32), Array(1, dtype=int32))
  """
  fn = "skip_nonfinite"
  rule = _Rule(initial_scale=1.0, scaled=False, dynamic=False)
  return _wrap(fn, inner, rule, _axes.validate_axis_name(fn, axis_name))
