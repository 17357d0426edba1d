"""The wrapper's step: unscale, decide, run or skip the inner optimizer.

`wrap(fn, inner, rule, axis_name)` builds the optax transformation behind
`dynamic_loss_scale`, `static_loss_scale` and `skip_nonfinite`. Its
`update` unscales the gradients in float32 (`lossscale/_unscale.py`), checks
them (`lossscale/_finite.py`), reduces the flag over the axes the step must
agree on (`lossscale/_collectives.py`), and takes the step behind one
`lax.cond` (`lossscale/_axes.py`): the inner optimizer on the unscaled
gradients, or zero updates and its state as it was. The counters move by
the rule (`lossscale/_rule.py`). Called outside any trace, the step is
decided in Python instead (`_eager_step`). `apply_gradients` asks for the
decision alone, and hands it back, through the keyword argument
`lossscale/_decision.py` describes.

What exists only for speed is in `lossscale/_speed/`, and off with
`LOSSSCALE_PLAIN=1`: the per-step trace sharing (`_speed.once`), the
ordered second conditional for bfloat16 state (`_speed.ordering`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale import _axes, _checks, _collectives, _jax_internals
from lossscale._decision import DECISION, ORDINARY, AxisSet, DecideOnly, Decision
from lossscale._dtypes import (
  cast_like,
  is_half,
  numbers_as_arrays,
  same_structure,
  widen,
  widen_float16,
  widens,
)
from lossscale._finite import all_finite_times
from lossscale._rule import (
  LossScaleState,
  Rule,
  init_counters,
  next_counters,
  states_in,
)
from lossscale._speed import once as _once
from lossscale._speed import ordering as _ordering
from lossscale._unscale import check_factor, unscale, unscale_factors


def _zeros(shapes: Any) -> Any:
  return jax.tree.map(lambda s: jax.lax.full(s.shape, 0, s.dtype), shapes)


def _host_zeros(s: Any) -> Any:
  zeros = np.zeros(s.shape, s.dtype)
  return zeros if s.dtype == jax.dtypes.float0 else jax.device_put(zeros)


# Extra arguments of `update` that hold gradients (of the scaled loss, like
# the updates): optax's line searches take the gradient as `grad=`.
GRADIENT_EXTRA_ARGS = ("grad",)


def _run_inner(
  inner, rule, updates, scaling, finite, inner_state, params, extra_args, widened, zero
):
  """The inner optimizer's step on the unscaled gradients (`finite` false
  and `zero`: on zeros), its state kept in the dtypes it had. `scaling` is
  the loss scale (`enabled=False`) or `unscale_factors` of it."""

  def unscaled(tree):
    # Computed where it is used, not shared with the decision: XLA fuses
    # it into the inner optimizer, and the check into its reduction, so no
    # param-sized unscaled copy is ever written (sharing one made
    # `lax.cond` take it as a materialized operand).
    tree = numbers_as_arrays(tree)
    if not rule.enabled:
      # A `lax.cond`, not a multiply by 1: the gradients themselves on a
      # fresh state, so the inner optimizer compiles as it does bare (a
      # multiply by a traced 1 changed XLA's fusion, and the last bits).
      is_one = scaling == 1  # traced where `scaling` is, or under a trace
      if not isinstance(is_one, jax.core.Tracer):  # eager: decided here
        if is_one:
          return widen(tree) if widened else tree
        tree = unscale(tree, unscale_factors(scaling), keep_dtype=True)
        return widen(tree) if widened else tree
      tree = jax.lax.cond(
        is_one,
        lambda: tree,
        lambda: unscale(tree, unscale_factors(scaling), keep_dtype=True),
      )
      # float16 parameters: `inner` runs in float32 on its float32 state.
      return widen(tree) if widened else tree
    # The step runs only on finite gradients, except under `jax.vmap` with
    # a flag per member, where both branches run: there, where it can be
    # seen (`zero`, below), the inner optimizer is fed zeros in place of a
    # bad member's gradients, never inf or NaN (a select, not a multiply).
    # Only there: a select per leaf cost an AdamW step of 2000 leaves a
    # tenth of its compile time.
    return unscale(tree, scaling, zero_unless=finite if zero else None)

  extra = {
    k: unscaled(v) if k in GRADIENT_EXTRA_ARGS else v for k, v in extra_args.items()
  }
  # Widened where they are used: taken from outside `lax.cond`, the float32
  # params would be written out as one of its operands (in-process A/B,
  # XLA:CPU, jaxlib 0.12.0.1, 10M bfloat16 AdamW: tx.update + apply_updates
  # 1.14x of bare widened here, 1.34x widened outside; apply_gradients
  # 0.73x and 0.76x).
  inner_params = widen(params) if widened else params
  widened_state = widen(inner_state) if widened else inner_state
  new_updates, new_state = inner.update(
    unscaled(updates), widened_state, inner_params, **extra
  )
  if widened:
    # The updates in the dtypes bare `inner` gives for these parameters
    # (theirs; without params, the gradients'), so that any
    # `apply_updates`, `p + u` included, keeps the parameters' dtypes.
    like = params if same_structure(params, new_updates) else updates
    new_updates = cast_like(new_updates, like)
  return new_updates, cast_like(new_state, inner_state)


def _agree(fn: str, finite: jax.Array, axes: tuple) -> jax.Array:
  """The flag, the same on every replica of `axes` (one scalar collective)."""
  if not axes:
    return finite
  names = axes[0] if len(axes) == 1 else axes
  return _axes.bound_collective(
    fn, names, lambda: jax.lax.pmin(finite.astype(jnp.int32), names) > 0
  )


def _shapes(traced: Any, widened: bool) -> tuple[Any, bool, tuple, bool]:
  """From one trace of the inner step: its output shapes, whether it may
  write its state after the updates in a second call (`_speed.ordering`:
  not when it has effects or hands values out, `jax.debug.print`,
  callbacks, which would run twice), the axes it communicates over, and
  whether it hands values out (then it is fed zeros for a bad member)."""
  closed, out = jax.make_jaxpr(traced, return_shape=True)()
  hands_out = _jax_internals.hands_out(closed)
  in_order = widened and not (closed.effects or hands_out)
  in_order = in_order and _ordering.order_narrow_writes()
  return out, in_order, _collectives.communicated_axes(closed), hands_out


def _staged_step(finite, apply, out, state, operands, in_order):
  """The step under a trace: one `lax.cond` on `finite`. A skipped step
  runs no optimizer and returns zero updates; a finite one updates the
  inner state in place (docs/performance.md has the measurements)."""
  skip = lambda: (_zeros(out[0]), state.inner_state)
  if in_order and any(is_half(x) for x in jax.tree.leaves(state.inner_state)):
    return _ordering.staged_in_order(finite, apply, skip, state.inner_state, operands)
  return _axes.cond(finite, apply, skip, operands=operands)


def _eager_step(finite, apply, traced, state):
  """The step outside any trace, decided in Python: `inner` runs op by op,
  as it does bare, or nothing runs."""
  if bool(finite):
    return apply()
  # Zeros made on the host: nothing to compile on the first skip.
  zeros = jax.tree.map(_host_zeros, jax.eval_shape(traced)[0])
  return zeros, state.inner_state


def _decided(rule, state, finite, updates, out, in_order, zero, axes, step):
  """What a decide-only call returns: zero updates, and a `Decision` in
  place of the state."""
  skipped = LossScaleState(
    **next_counters(rule, state, finite), inner_state=state.inner_state
  )
  decision = Decision(finite, skipped, updates, in_order, zero, AxisSet(axes), step)
  return _zeros(out[0]), decision


def _local_flag(rule: Rule, given: Any, updates: Any, scale: jax.Array) -> jax.Array:
  """This replica's finite flag (a `Decision`'s when one is given)."""
  if not rule.enabled:
    return jnp.ones([], jnp.bool_)
  if isinstance(given, Decision):
    return given.finite
  return all_finite_times(updates, check_factor(scale))


def _scaling(rule: Rule, scale: jax.Array, eager: bool) -> Any:
  """What `_run_inner` unscales by: the reciprocal's factors, or (for
  `enabled=False`) the scale itself, decided in Python when eager, even
  where `inner` is traced."""
  if rule.enabled:
    return unscale_factors(scale)
  return float(scale) if eager else scale


def _init_state(fn: str, inner: Any, rule: Rule, params: Any) -> LossScaleState:
  # float16 optimizer state underflows (docs/how-it-works.md): float16
  # parameters get float32 state, with `enabled=False` too, so that a
  # checkpoint moves between the two with nothing lost.
  inner_state = inner.init(widen_float16(params))
  if states_in(inner_state):
    raise ValueError(
      f"`{fn}(inner=...)` already holds a loss-scaling wrapper: two"
      " `LossScaleState`s would check (and scale) the same gradients, and"
      " `scale_loss` could not tell which scale to use. Wrap the optimizer"
      " once."
    )
  return LossScaleState(**init_counters(rule), inner_state=inner_state)


def wrap(
  fn: str,
  inner: optax.GradientTransformation,
  rule: Rule,
  axis_name: _axes.AxisName | None,
) -> optax.GradientTransformationExtraArgs:
  """Builds the wrapper; the one place the skip-and-adjust logic lives."""
  _checks.check_inner(fn, inner)
  inner = optax.with_extra_args_support(inner)
  run_apply = functools.partial(_run_inner, inner, rule)
  # The inner step traced once per step (the speed layer's trace sharing,
  # lossscale/_speed/once.py); `enabled=False` calls `inner` as it is, to be
  # exactly it. Output shapes alone, for eager steps, come from one trace
  # per argument types.
  per_step = _once.PerStep(run_apply) if rule.enabled else None
  shapes_traced = _once.once(run_apply) if rule.enabled else run_apply

  def update_fn(updates, state, params=None, **extra_args):
    given = extra_args.pop(DECISION, ORDINARY)
    _checks.check_state(fn, state)
    _checks.check_no_overwrite(fn, updates)
    if isinstance(given, Decision):
      updates = given.incoming
    # Python float leaves: arrays, as `jax.jit` would make them, so that a
    # step is unscaled and checked the same eagerly and under `jit`.
    updates = numbers_as_arrays(updates)
    scale = state.loss_scale  # the one the loss was multiplied by
    finite = _local_flag(rule, given, updates, scale)
    # Called outside any trace (the flag is concrete: no enclosing
    # transformation stages its computation), the step is decided in Python
    # (`_eager_step`). Staged (`jax.jit`, a conditional, `make_jaxpr`): one
    # trace of the inner step per step. Not staged but batched (an eager
    # `jax.vmap` with a flag per member): op by op, like eager.
    eager = not isinstance(finite, jax.core.Tracer)
    staged = per_step is not None and _jax_internals.staging()
    step = given.step if isinstance(given, Decision) else _once.Step()
    run = per_step.traced_for(step) if staged else run_apply
    widened = widens(rule.enabled, updates, params)
    scaling = _scaling(rule, scale, eager)
    # Zeros for a bad member's gradients where both branches of the step's
    # conditional run and something could see them: under a `jax.vmap`
    # being traced (the flag batched), and where the inner optimizer hands
    # values out (`_shapes`, below: a `jax.vmap` around a traced step
    # batches the conditional without the flag being batched here).
    # (`is not False`: a `tx.update` under its own `jax.jit` hands the
    # decision's flags back as arrays; then the zeros are kept.)
    zero = _jax_internals.batched(finite) or (
      isinstance(given, Decision) and given.zero is not False
    )

    def apply(inner_state=state.inner_state, run=run):
      return run(
        updates, scaling, finite, inner_state, params, extra_args, widened, zero
      )

    traced = functools.partial(apply, run=shapes_traced if run is run_apply else run)
    if rule.enabled and params is not None:
      _checks.check_gradients(fn, updates, params, state.inner_state, apply)
    # The axes the decision is reduced over: the wrapper's `axis_name`, those
    # `apply_gradients` found after it, and those the inner optimizer
    # communicates over, so that every replica runs it or none does.
    asked = given.axes if isinstance(given, DecideOnly) else ()
    axes = _collectives.union(_collectives.as_tuple(axis_name), asked)
    out = in_order = None
    if rule.enabled and not isinstance(given, Decision):
      if not eager:
        out, in_order, inner_axes, hands_out = _shapes(traced, widened)
        zero = zero or hands_out  # read by `apply` from here on
        axes = _collectives.union(axes, inner_axes)
      finite = _agree(fn, finite, axes)
    if given is None or isinstance(given, DecideOnly):
      if out is None:
        out, in_order, _, hands_out = _shapes(traced, widened)
        zero = zero or hands_out
      return _decided(rule, state, finite, updates, out, in_order, zero, axes, step)
    if given is ORDINARY and rule.enabled and eager:
      new_updates, inner_state = _eager_step(finite, apply, traced, state)
    elif given is ORDINARY and rule.enabled:
      operands = (updates, state, params)
      new_updates, inner_state = _staged_step(
        finite, apply, out, state, operands, in_order
      )
      # A `cross_shard_mean` chained after the wrapper refuses these unless
      # the decision was reduced over its axis.
      _collectives.mark_per_replica(new_updates, axes)
    else:  # `enabled=False`, or applying a `Decision`: no conditional here
      new_updates, inner_state = apply()
    counters = next_counters(rule, state, finite)
    return new_updates, LossScaleState(**counters, inner_state=inner_state)

  init_fn = functools.partial(_init_state, fn, inner, rule)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
