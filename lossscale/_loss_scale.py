"""Loss-scaling optax wrappers: one state machine behind three factories.

`dynamic_loss_scale`, `static_loss_scale` and `skip_nonfinite` all build
`_wrap`; they differ only in the fixed settings of `_Rule`. The rule itself is
the pure function `_next_counters`; `dynamic_loss_scale`'s docstring states it
and docs/how-it-works.md explains it.

The decision protocol (used by `lossscale.apply_gradients` only)
-----------------------------------------------------------------
A wrapper's `update` takes one optional keyword argument, `DECISION`, which
`optax.chain` and every other optax combinator pass along like any extra
argument, and which `jax.jit` sees like any other argument:

- absent: the ordinary step. The wrapper unscales, decides, and applies or
  skips the inner optimizer inside its own `lax.cond`.
- `None`: decide only. The wrapper unscales and decides, runs no inner
  optimizer, and returns zero updates (so transformations chained after it can
  be traced) and, in place of its state, a `Decision`: the finite flag and the
  state a skipped step would leave. `DecideOnly(axes)` is the same, with the
  flag reduced over `axes` too (the axes a collective chained after the
  wrapper communicates over: `apply_gradients` asks again with them).
- a `Decision`, returned by a call with `None` on exactly these arguments:
  apply it. The wrapper takes the flag and the gradients it decided on from
  the `Decision` (so whatever computed them before it, a cross-replica mean
  for one, is dead code in this call), runs the inner optimizer without a
  `lax.cond` of its own and advances its counters with that flag.

`Decision` is a different pytree from `LossScaleState` on purpose: a wrapper
traced inside another transformation's control flow (`optax.MultiSteps`,
`optax.apply_if_finite`, ...) cannot return it without breaking that control
flow's type check, so a decision that was not taken on every step cannot go
unnoticed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale import _axes, _collectives, _compat, _once, _validation
from lossscale._finite import (
  all_finite_times,
  compute_dtype,
  is_array,
  is_inexact,
  numbers_as_arrays,
  scale_leaf,
)

DECISION = "lossscale_finite"
"""The keyword argument of a wrapper's `update` that carries a decision."""

_ORDINARY = object()  # no `DECISION` argument: the ordinary step


class DecideOnly(NamedTuple):
  """`DECISION=DecideOnly(axes)`: decide only, the flag reduced over `axes`
  as well as the wrapper's own (`DECISION=None` is `DecideOnly(())`)."""

  axes: tuple = ()


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
class AxisSet:
  """Axis names, as a pytree with no leaves (a `Decision` may be returned
  from a jitted `tx.update`)."""

  names: tuple = ()


jax.tree_util.register_pytree_node(
  AxisSet, lambda a: ((), a.names), lambda names, _: AxisSet(names)
)


class Decision(NamedTuple):
  """What a wrapper returns in place of its state when asked to decide only.

  Attributes:
    finite: bool, whether the step's gradients are finite (reduced over the
      wrapper's `axis_name`, the axes its inner optimizer communicates over
      and those of a `DecideOnly` request).
    skipped: the wrapper's `LossScaleState` after skipping this step.
    incoming: the gradients the wrapper received (after the transformations
      chained before it), still scaled.
    in_order: whether the state the inner optimizer computes wider than it
      stores (float32 for half-precision parameters) may be written in a
      second call, after the new parameters (`read_after`): the inner
      optimizer has no effects and hands no values out.
    zero: whether the inner optimizer is fed zeros in place of non-finite
      gradients (where both branches of the step may run and be seen).
    axes: the axes `finite` was reduced over (an `AxisSet`).
    step: the step's `_once.Step`: the calls that apply the decision reuse
      the inner step's trace it made (speed layer, lossscale/_once.py).
  """

  finite: jax.Array
  skipped: LossScaleState
  incoming: Any
  in_order: bool = False
  zero: bool = False
  axes: AxisSet = AxisSet()
  step: _once.Step = _once.Step()


@dataclasses.dataclass(frozen=True)
class _Rule:
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


def _init_counters(rule: _Rule) -> dict[str, jax.Array]:
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


def _next_counters(
  rule: _Rule, state: LossScaleState, finite: jax.Array
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
  rule: _Rule, state: LossScaleState, finite: jax.Array, good: jax.Array
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


def _widen(tree: Any) -> Any:
  """Casts the inexact leaves of `tree` to the wider of float32 and their dtype."""
  return jax.tree.map(
    lambda x: x.astype(compute_dtype(x.dtype)) if is_inexact(x) else x, tree
  )


# The largest scale whose float32 reciprocal is normal (2**-126).
_LARGEST_NORMAL_RECIPROCAL = 2.0**126


def _unscale_factors(loss_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two factors `_unscale` multiplies by, in turn, for `loss_scale`.

  Above 2**126 the float32 reciprocal is subnormal, which XLA flushes to
  zero: there the gradients are first multiplied by 2**-64 (exact) and then
  by `2**64 / loss_scale`, the same rounding as `1 / loss_scale`. Below it
  the first factor is 1 and the result is `grads * (1 / loss_scale)` bit for
  bit.
  """
  f32 = jnp.float32
  big = loss_scale > f32(_LARGEST_NORMAL_RECIPROCAL)
  pre = jnp.where(big, f32(2.0**-64), f32(1.0))
  inv = jnp.where(big, f32(2.0**64), f32(1.0)) / loss_scale
  # A constant scale (state closed over by `jit`) must not let XLA merge the
  # two factors back into a subnormal one. Computed where the scale is:
  # from a constant scale, factors computed inside a call of their own were
  # merged on XLA:CPU, which drops the barrier before fusion.
  return _compat.hide_from_constant_folding((pre, inv))


def _unscale(
  grads: Any,
  factors: tuple[jax.Array, jax.Array],
  *,
  keep_dtype: bool = False,
  zero_unless: jax.Array | None = None,
) -> Any:
  """`grads * (1 / loss_scale)` in the wider of float32 and each leaf's dtype,
  `factors` being `_unscale_factors(loss_scale)`.

  With `keep_dtype` each leaf is cast back to its own dtype: with a scale of
  1 that is every leaf bit for bit. With `zero_unless`, a flag, every leaf
  is zeros where the flag is false.
  """
  pre, inv = factors
  if zero_unless is not None:
    return jax.tree.map(
      lambda g: _unscale_leaf_or_zero(g, pre, inv, zero_unless) if is_inexact(g) else g,
      grads,
    )
  unscaled = _scale_leaves(grads, pre, inv)
  if not keep_dtype:
    return unscaled
  return jax.tree.map(
    lambda u, g: u.astype(g.dtype) if is_inexact(g) else u, unscaled, grads
  )


def _check_factor(loss_scale: jax.Array) -> jax.Array:
  """The factor the finite check multiplies the gradients by: what
  `_unscale` gives, as far as finiteness goes, in one multiply.

  Above 2**126 dividing by the scale cannot overflow, so the gradients are
  finite exactly when they are: they are checked as they are. One multiply
  per element keeps the check's fusion as lean as the bare finite check.
  """
  f32 = jnp.float32
  big = loss_scale > f32(_LARGEST_NORMAL_RECIPROCAL)
  return jnp.where(big, f32(1.0), f32(1.0) / loss_scale)


def _scale_leaves(grads: Any, *factors: jax.Array) -> Any:
  """Multiplies each inexact leaf by `factors` in turn, in the wider of
  float32 and its dtype; other leaves pass through."""
  return jax.tree.map(lambda g: scale_leaf(g, *factors) if is_inexact(g) else g, grads)


@functools.partial(jax.jit, inline=True)
def _unscale_leaf_or_zero(
  g: jax.Array, pre: jax.Array, inv: jax.Array, finite: jax.Array
) -> jax.Array:
  u = scale_leaf(g, pre, inv)
  return jnp.where(finite, u, jnp.zeros_like(u))


def _like(new: Any, old: Any) -> Any:
  """Casts the inexact leaves of `new` to the dtypes of `old`'s leaves.

  The inner optimizer computes from float32 gradients; this keeps its state
  in the dtypes `inner.init(params)` chose (bfloat16 moments stay bfloat16).
  """
  # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
  new_def: Any = jax.tree.structure(new)
  if new_def != jax.tree.structure(old):
    return new

  def leaf(n, o):
    if is_inexact(n) and is_inexact(o) and n.dtype != o.dtype:
      return n.astype(o.dtype)
    return n

  return jax.tree.map(leaf, new, old)


def _same_structure(a: Any, b: Any) -> bool:
  a_def: Any = jax.tree.structure(a)  # Any: see `_like`
  return a is not None and a_def == jax.tree.structure(b)


def read_after(old: Any, after: Any) -> tuple[Any, bool]:
  """`old`, its half-precision leaves read only after `after` is computed.

  The inner optimizer computes in float32 and its bfloat16 state is stored
  rounded, while its updates come from the unrounded values: the old state
  is read twice, once for the updates (the new parameters) and once for the
  new state. To write the new state over the old in place, XLA must run
  the second read last, and nothing tells it so: it copies the old state
  first (a parameter-sized temporary per moment). Here each such leaf of
  `old`, in a subtree with `after`'s structure (Adam's `mu` and `nu` have
  the parameters'), is selected by a flag that is always true but computed
  from one element of the leaf of `after` at its place: the value is
  unchanged, bit for bit, and the new state now depends on the new
  parameters, so XLA writes it after them, in place. Returns the tree and
  whether any leaf was so ordered.
  """
  after_def: Any = jax.tree.structure(after)
  matches = lambda x: jax.tree.structure(x) == after_def
  ordered = []

  def leaf(x: Any, a: Any) -> Any:
    # Half-precision leaves are floating (`compute_dtype` keeps complex).
    if not (
      _is_half(x)
      and is_inexact(a)
      and jnp.issubdtype(a.dtype, jnp.floating)
      and jnp.size(a) > 0
    ):
      return x
    ordered.append(True)
    return _after(x, a)

  tree = jax.tree.map(
    lambda o: jax.tree.map(leaf, o, after) if matches(o) else o, old, is_leaf=matches
  )
  return tree, bool(ordered)


@functools.partial(jax.jit, inline=True)
def _after(x: jax.Array, a: jax.Array) -> jax.Array:
  # One element of `a` times 0 is 0 or NaN, so `keep` is always true; XLA
  # does not fold `a * 0` (inf times 0 is NaN), so it cannot see that. A
  # select copies bits: subnormals and NaN payloads are kept.
  # `a[0, ..., 0]`, not `a.reshape(-1)[0]`: flattening a leaf sharded on
  # another than its first dimension makes XLA gather it whole.
  zero = a[(0,) * a.ndim].astype(jnp.float32) * jnp.float32(0)
  keep = (zero == 0) | jnp.isnan(zero)
  return jnp.where(keep, x, -x)


def _check_inner(fn: str, inner: Any) -> None:
  if isinstance(inner, optax.MultiSteps):
    raise TypeError(
      f"`{fn}(inner=...)` must be an optax.GradientTransformation, got an"
      " optax.MultiSteps object: pass `multi_steps.gradient_transformation()`."
    )
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"`{fn}(inner=...)` must be an optax.GradientTransformation, got"
      f" {type(inner).__name__} instead."
    )


def _check_state(fn: str, state: Any) -> None:
  if not isinstance(state, LossScaleState):
    raise TypeError(
      f"`{fn}(...).update` expects the lossscale.LossScaleState that the"
      f" wrapper's `init` builds, got {type(state).__name__} instead. Build"
      " the state with `tx.init(params)` of the same wrapper (an optimizer"
      " state saved without the wrapper cannot be resumed as one)."
    )


def _gradients_tree_in(params: Any, grads: Any) -> Any:
  """`params`, or the first subtree of it with the gradients' structure
  (`optax.lookahead`'s `LookaheadParams(fast, slow)` holds two), or None."""
  g_def: Any = jax.tree.structure(grads)  # Any: see `_like`
  if g_def == jax.tree.structure(params) or _none_for_integers(grads, params):
    return params
  like = lambda x: x is not params and jax.tree.structure(x) == g_def
  subtrees = [x for x in jax.tree.leaves(params, is_leaf=like) if like(x)]
  return subtrees[0] if subtrees else None


def _is_none(x: Any) -> bool:
  return x is None


def _params_without_gradient(grads: Any, params: Any) -> list[tuple[str, Any]] | None:
  """`(where, parameter)` for each leaf of `params` whose gradient is None,
  when `grads` is `params`' tree with None at some leaves (what
  `value_and_grad` gives non-array and integer parameters), else None."""
  g_leaves, g_def = jax.tree_util.tree_flatten(grads, is_leaf=_is_none)
  p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params)
  g_def = cast(Any, g_def)  # see `_like`
  if g_def != p_def or len(g_leaves) != len(p_leaves):
    return None
  return [
    (jax.tree_util.keystr(path) or "the root", p)
    for g, (path, p) in zip(g_leaves, p_leaves, strict=True)
    if g is None
  ]


def _none_for_integers(grads: Any, params: Any) -> bool:
  """Whether `grads` is `params`' tree with None at some integer or boolean
  leaves (what `value_and_grad` gives them), and nowhere else."""
  nones = _params_without_gradient(grads, params)
  return bool(nones) and all(is_array(p) and not is_inexact(p) for _, p in nones or ())


def _structure_mismatch(fn: str, grads: Any, params: Any) -> str:
  number = _python_number_without_gradient(grads, params)
  if number is not None:
    where, value = number
    return (
      f"`{fn}`: the parameter at {where} is a Python {type(value).__name__}"
      f" ({value!r}) and its gradient is None: `lossscale.value_and_grad`"
      " differentiates array leaves only (as `equinox.filter_value_and_grad`"
      " does), while under `jax.jit` a Python number arrives as an array and"
      f" is differentiated. Hold it as an array (`jnp.asarray({value!r})`) to"
      " train it, or leave it out of the params given to the optimizer"
      " (`eqx.filter(params, eqx.is_inexact_array)`) to keep it fixed."
    )
  return (
    f"`{fn}`: the gradient tree does not match the params tree the"
    f" optimizer state was built for.\n  gradients: {jax.tree.structure(grads)}"
    f"\n  params:    {jax.tree.structure(params)}"
  )


def _python_number_without_gradient(grads: Any, params: Any) -> tuple[str, Any] | None:
  """`(where, value)` of the first Python-number parameter whose gradient is
  None (what `value_and_grad` gives it outside `jax.jit`), or None."""
  for where, p in _params_without_gradient(grads, params) or ():
    if isinstance(p, (int, float, complex)) and not isinstance(p, bool):
      return where, p
  return None


def _shape_pairs(grads: Any, params: Any) -> Iterator[tuple[str, Any, Any]]:
  """`(where, gradient shape, parameter shape)` for each pair of leaves that
  both have a shape."""
  # None leaves count as leaves (a None gradient of an integer parameter).
  for (path, g), p in zip(
    jax.tree_util.tree_leaves_with_path(grads, is_leaf=_is_none),
    jax.tree_util.tree_leaves(params, is_leaf=_is_none),
    strict=True,
  ):
    g_shape, p_shape = getattr(g, "shape", None), getattr(p, "shape", None)
    if g_shape is not None and p_shape is not None:
      yield jax.tree_util.keystr(path) or "the root", g_shape, p_shape


def _shape_mismatch(fn: str, grads: Any, params: Any) -> str | None:
  """Why a leaf of `grads` cannot be the gradient of `params`' leaf, or None.

  A gradient may carry leading dimensions the parameter lacks: per-example
  gradients, shaped `(batch, *param.shape)`, as `optax.contrib.dpsgd` takes.
  """
  for where, g_shape, p_shape in _shape_pairs(grads, params):
    if len(g_shape) < len(p_shape) or g_shape[len(g_shape) - len(p_shape) :] != p_shape:
      return (
        f"`{fn}`: the gradient at {where} has shape {g_shape}, but the"
        f" parameter there has shape {p_shape} (a gradient has the"
        " parameter's shape, or per-example gradients a leading batch"
        " dimension before it)."
      )
  return None


def _leading_dims_at(grads: Any, params: Any) -> str | None:
  """The path of the first gradient with leading (per-example) dimensions."""
  for where, g_shape, p_shape in _shape_pairs(grads, params):
    if g_shape != p_shape:
      return f"{where} has shape {g_shape}"
  return None


def _check_gradients(
  fn: str, grads: Any, params: Any, inner_state: Any, apply: Any
) -> None:
  """Raises a clear `ValueError` when `grads` cannot be the gradient of
  `params` for the inner optimizer (`apply` runs it, under `eval_shape`)."""
  target = _gradients_tree_in(params, grads)
  if target is not None:
    mismatch = _shape_mismatch(fn, grads, target)
    if mismatch is not None:
      raise ValueError(mismatch)
    at = _leading_dims_at(grads, target)
    if at is None:
      return
    mismatch = (
      f"`{fn}`: the gradient at {at}, with leading dimensions before its"
      " parameter's shape: per-example gradients, which the inner optimizer"
      " does not take (it would broadcast them into its state or updates)."
      " Use an optimizer that takes them (optax.contrib.dpsgd), or reduce"
      " them first."
    )
  else:
    mismatch = _structure_mismatch(fn, grads, params)
  # Some optimizers take other params (`optax.lookahead`), or per-example
  # gradients (`optax.contrib.dpsgd`): refuse only what `inner` itself cannot
  # take, or takes by changing its state's shapes or returning updates that
  # do not fit `params`.
  try:
    new_updates, new_state = jax.eval_shape(apply)
  except Exception as e:
    first_line = (str(e).splitlines() or [""])[0]
    raise ValueError(
      f"{mismatch}\n  (the inner optimizer raised {type(e).__name__}: {first_line})"
    ) from e
  if not (_keeps_types(new_updates, params) and _keeps_types(new_state, inner_state)):
    raise ValueError(mismatch)


def _keeps_types(new: Any, old: Any) -> bool:
  """Whether `new` has `old`'s tree structure and leaf shapes (a None in
  `new` standing for an integer leaf of `old`, as `optax.masked` passes a
  None gradient through)."""
  if _none_for_integers(new, old):
    pairs = zip(
      jax.tree.leaves(new, is_leaf=_is_none), jax.tree.leaves(old), strict=True
    )
    kept = [(n, o) for n, o in pairs if n is not None]
    new, old = [n for n, _ in kept], [o for _, o in kept]
  new_def: Any = jax.tree.structure(new)  # Any: see `_like`
  if new_def != jax.tree.structure(old):
    return False
  shapes = lambda t: [getattr(x, "shape", None) for x in jax.tree.leaves(t)]
  return shapes(new) == shapes(old)


def _is_state(x: Any) -> bool:
  return isinstance(x, LossScaleState)


def states_in(tree: Any) -> list[LossScaleState]:
  """Every `LossScaleState` in `tree`, nested anywhere, in leaf order."""
  return [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]


def _zeros(shapes: Any) -> Any:
  return jax.tree.map(lambda s: jax.lax.full(s.shape, 0, s.dtype), shapes)


def _host_zeros(s: Any) -> Any:
  zeros = np.zeros(s.shape, s.dtype)
  return zeros if s.dtype == jax.dtypes.float0 else jax.device_put(zeros)


def _is_half(x: Any) -> bool:
  return is_inexact(x) and compute_dtype(x.dtype) != x.dtype


def _widen_float16(tree: Any) -> Any:
  """`tree` with its float16 leaves in float32 (bfloat16 and others kept)."""
  return jax.tree.map(
    lambda x: x.astype(jnp.float32) if is_inexact(x) and x.dtype == jnp.float16 else x,
    tree,
  )


# Extra arguments of `update` that hold gradients (of the scaled loss, like
# the updates): optax's line searches take the gradient as `grad=`.
GRADIENT_EXTRA_ARGS = ("grad",)


def _run_inner(
  inner, rule, updates, scaling, finite, inner_state, params, extra_args, widened, zero
):
  """The inner optimizer's step on the unscaled gradients (`finite` false
  and `zero`: on zeros), its state kept in the dtypes it had. `scaling` is
  the loss scale (`enabled=False`) or `_unscale_factors` of it."""

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
          return _widen(tree) if widened else tree
        tree = _unscale(tree, _unscale_factors(scaling), keep_dtype=True)
        return _widen(tree) if widened else tree
      tree = jax.lax.cond(
        is_one,
        lambda: tree,
        lambda: _unscale(tree, _unscale_factors(scaling), keep_dtype=True),
      )
      # float16 parameters: `inner` runs in float32 on its float32 state.
      return _widen(tree) if widened else tree
    # The step runs only on finite gradients, except under `jax.vmap` with
    # a flag per member, where both branches run: there, where it can be
    # seen (`zero`, below), the inner optimizer is fed zeros in place of a
    # bad member's gradients, never inf or NaN (a select, not a multiply).
    # Only there: a select per leaf cost an AdamW step of 2000 leaves a
    # tenth of its compile time.
    return _unscale(tree, scaling, zero_unless=finite if zero else None)

  extra = {
    k: unscaled(v) if k in GRADIENT_EXTRA_ARGS else v for k, v in extra_args.items()
  }
  # Widened where they are used: taken from outside `lax.cond`, the float32
  # params would be written out as one of its operands (in-process A/B,
  # XLA:CPU, jaxlib 0.12.0.1, 10M bfloat16 AdamW: tx.update + apply_updates
  # 1.14x of bare widened here, 1.34x widened outside; apply_gradients
  # 0.73x and 0.76x).
  inner_params = _widen(params) if widened else params
  widened_state = _widen(inner_state) if widened else inner_state
  new_updates, new_state = inner.update(
    unscaled(updates), widened_state, inner_params, **extra
  )
  if widened:
    # The updates in the dtypes bare `inner` gives for these parameters
    # (theirs; without params, the gradients'), so that any
    # `apply_updates`, `p + u` included, keeps the parameters' dtypes.
    like = params if _same_structure(params, new_updates) else updates
    new_updates = _like(new_updates, like)
  return new_updates, _like(new_state, inner_state)


def _agree(fn: str, finite: jax.Array, axes: tuple) -> jax.Array:
  """The flag, the same on every replica of `axes` (one scalar collective)."""
  if not axes:
    return finite
  names = axes[0] if len(axes) == 1 else axes
  return _axes.bound_collective(
    fn, names, lambda: jax.lax.pmin(finite.astype(jnp.int32), names) > 0
  )


def _widens(rule: _Rule, updates: Any, params: Any) -> bool:
  """Whether the inner optimizer runs in float32 on wider copies.

  Half-precision gradients are unscaled in float32; the inner optimizer
  then runs in float32 throughout (its state and the params widened too:
  some optax optimizers cannot mix dtypes), and its state is stored back in
  the dtypes it had. `enabled=False` hands `inner` the gradients' own
  dtypes, exactly `inner`, except for float16 parameters, whose state is
  float32 either way.
  """
  if rule.enabled:
    return any(_is_half(x) for x in jax.tree_util.tree_leaves((updates, params)))
  return any(
    is_inexact(x) and x.dtype == jnp.float16 for x in jax.tree_util.tree_leaves(params)
  )


def _shapes(traced: Any, widened: bool, zero: list[bool]) -> tuple[Any, bool, tuple]:
  """The inner step's output shapes, whether it may write its state after
  the updates in a second call (`read_after`: not when it has effects or
  hands values out, `jax.debug.print`, callbacks, which would run twice),
  and the axes it communicates over. Sets `zero[0]` where it hands values
  out: the step is then traced again, with the zeros."""
  closed, out = jax.make_jaxpr(traced, return_shape=True)()
  handing_out = _compat.hands_out(closed)
  if handing_out:
    zero[0] = True
  in_order = widened and not (closed.effects or handing_out)
  in_order = in_order and _compat.order_narrow_writes()
  return out, in_order, _collectives.communicated_axes(closed)


def _staged(finite, apply, zeros, state, operands, in_order):
  """The staged step: `lax.cond` on `finite`. A skipped step runs no
  optimizer, a finite one updates the inner state in place
  (docs/performance.md has the measurements)."""
  skip = lambda: (zeros(), state.inner_state)
  if not (in_order and any(_is_half(x) for x in jax.tree.leaves(state.inner_state))):
    return _axes.cond(finite, apply, skip, operands=operands)
  # State stored narrower than it is computed (bfloat16 moments) is
  # written in a second conditional, after the updates are out
  # (`read_after`), in place: in the first, XLA would copy it (in-process
  # A/B, XLA:CPU, jaxlib 0.12.0.1, 10M bfloat16 AdamW: tx.update +
  # apply_updates 1.14x of bare, 1.51x in one conditional). The inner
  # optimizer's second call reuses its trace, and XLA keeps of each call
  # only what its conditional returns.
  new_updates = _axes.cond(
    finite, lambda: apply()[0], lambda: skip()[0], operands=operands
  )
  inner_state = _axes.cond(
    finite,
    lambda: apply(read_after(state.inner_state, new_updates)[0])[1],
    lambda: state.inner_state,
    operands=(*operands, new_updates),
  )
  return new_updates, inner_state


def _local_flag(rule: _Rule, given: Any, updates: Any, scale: jax.Array) -> jax.Array:
  """This replica's finite flag (a `Decision`'s when one is given)."""
  if not rule.enabled:
    return jnp.ones([], jnp.bool_)
  if isinstance(given, Decision):
    return given.finite
  return all_finite_times(updates, _check_factor(scale))


def _scaling(rule: _Rule, scale: jax.Array, eager: bool) -> Any:
  """What `_run_inner` unscales by: the reciprocal's factors, or (for
  `enabled=False`) the scale itself, decided in Python when eager, even
  where `inner` is traced."""
  if rule.enabled:
    return _unscale_factors(scale)
  return float(scale) if eager else scale


def _init_state(fn: str, inner: Any, rule: _Rule, params: Any) -> LossScaleState:
  # float16 optimizer state underflows (docs/how-it-works.md): float16
  # parameters get float32 state, with `enabled=False` too, so that a
  # checkpoint moves between the two with nothing lost.
  inner_state = inner.init(_widen_float16(params))
  if states_in(inner_state):
    raise ValueError(
      f"`{fn}(inner=...)` already holds a loss-scaling wrapper: two"
      " `LossScaleState`s would check (and scale) the same gradients, and"
      " `scale_loss` could not tell which scale to use. Wrap the optimizer"
      " once."
    )
  return LossScaleState(**_init_counters(rule), inner_state=inner_state)


def _wrap(
  fn: str,
  inner: optax.GradientTransformation,
  rule: _Rule,
  axis_name: _axes.AxisName | None,
) -> optax.GradientTransformationExtraArgs:
  """Builds the wrapper; the one place the skip-and-adjust logic lives."""
  _check_inner(fn, inner)
  inner = optax.with_extra_args_support(inner)

  run_apply = functools.partial(_run_inner, inner, rule)

  # The inner step traced once per step (the speed layer's trace sharing,
  # lossscale/_once.py); `enabled=False` calls `inner` as it is, to be
  # exactly it. Output shapes alone, for eager steps, come from one trace
  # per argument types.
  per_step = _once.PerStep(run_apply) if rule.enabled else None
  shapes_traced = _once.once(run_apply) if rule.enabled else run_apply
  init_fn = functools.partial(_init_state, fn, inner, rule)

  def update_fn(updates, state, params=None, **extra_args):
    given = extra_args.pop(DECISION, _ORDINARY)
    decide_only = given is None or isinstance(given, DecideOnly)
    # The axes the decision is reduced over: the wrapper's `axis_name`, those
    # `apply_gradients` found after it, and (below) those the inner optimizer
    # communicates over (lossscale/_collectives.py).
    asked = given.axes if isinstance(given, DecideOnly) else ()
    axes = _collectives.union(_collectives.as_tuple(axis_name), asked)
    _check_state(fn, state)
    if isinstance(given, Decision):
      updates = given.incoming
    # Python float leaves: arrays, as `jax.jit` would make them, so that a
    # step is unscaled and checked the same eagerly and under `jit`.
    updates = numbers_as_arrays(updates)
    scale = state.loss_scale  # the one the loss was multiplied by

    finite = _local_flag(rule, given, updates, scale)

    # Called outside any trace (the flag is concrete: no enclosing
    # transformation stages its computation), the step is decided in Python
    # and `inner` runs op by op, exactly as the bare optimizer runs eagerly
    # (Python state it reads, such as a learning rate changed between
    # steps, is read on every step; nothing is compiled after the first
    # step).
    eager = not isinstance(finite, jax.core.Tracer)
    # Staged (`jax.jit`, a conditional, `make_jaxpr`): one trace per step.
    # Not staged but batched (an eager `jax.vmap` with a flag per member):
    # op by op too, the conditional's branches traced anew on each call.
    staged = per_step is not None and _compat.staging()
    step = given.step if isinstance(given, Decision) else _once.Step()
    run = per_step.traced_for(step) if staged else run_apply

    widened = _widens(rule, updates, params)

    scaling = _scaling(rule, scale, eager)

    # Zeros for a bad member's gradients where both branches of the step's
    # conditional run and something could see them: under a `jax.vmap`
    # being traced (the flag batched), and wherever the inner optimizer
    # hands values out of the computation (effects, callbacks, foreign
    # calls), since a `jax.vmap` around a traced step (`jax.jit`,
    # `lax.scan`) batches the conditional without the flag being batched
    # here. Elsewhere what a discarded branch computes is never seen.
    # (`is not False`: a `tx.update` under its own `jax.jit` hands the
    # decision's flags back as arrays; then the zeros are kept.)
    zero = [
      _compat.batched(finite)
      or (isinstance(given, Decision) and given.zero is not False)
    ]

    def apply(inner_state=state.inner_state, run=run):
      return run(
        updates, scaling, finite, inner_state, params, extra_args, widened, zero[0]
      )

    # Output shapes from the step's trace when staged; otherwise from one
    # trace per argument types, so that an eager step calls `inner` once,
    # to run it.
    traced = functools.partial(apply, run=shapes_traced if run is run_apply else run)

    if rule.enabled and params is not None:
      _check_gradients(fn, updates, params, state.inner_state, apply)

    shapes = functools.partial(_shapes, traced, widened, zero)

    traced_step = rule.enabled and isinstance(finite, jax.core.Tracer)
    out = in_order = None
    if traced_step and not isinstance(given, Decision):
      # A collective inside the inner optimizer (`cross_shard_mean` chained
      # inside the wrapper) must run on every replica or none: the decision
      # is reduced over its axes too. The trace is the step's own (`_once`).
      out, in_order, inner_axes = shapes()
      axes = _collectives.union(axes, inner_axes)
      finite = _agree(fn, finite, axes)
    elif rule.enabled and not isinstance(given, Decision):
      finite = _agree(fn, finite, axes)

    if decide_only:
      if out is None:
        out, in_order, _ = shapes()
      skipped = LossScaleState(
        **_next_counters(rule, state, finite), inner_state=state.inner_state
      )
      decision = Decision(
        finite, skipped, updates, in_order, zero[0], AxisSet(axes), step
      )
      return _zeros(out[0]), decision
    if given is _ORDINARY and rule.enabled and eager:
      if bool(finite):
        new_updates, inner_state = apply()
      else:
        # Zeros made on the host: nothing to compile on the first skip.
        zeros = jax.tree.map(_host_zeros, jax.eval_shape(traced)[0])
        new_updates, inner_state = zeros, state.inner_state
    elif given is _ORDINARY and rule.enabled:
      operands = (updates, state, params)
      zeros = lambda: _zeros(out[0])
      new_updates, inner_state = _staged(
        finite, apply, zeros, state, operands, in_order
      )
      # A `cross_shard_mean` chained after the wrapper refuses these unless
      # the decision was reduced over its axis.
      _collectives.mark_per_replica(new_updates, axes)
    else:
      new_updates, inner_state = apply()
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
  reset_hysteresis_on_backoff: bool = False,
  consecutive_hysteresis: bool = False,
  growth_delay: int = 0,
  tolerance: float = 0.0,
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
    max_scale: the highest scale, a finite float32.
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
  v = _validation
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
  )
  return _build(fn, inner, rule, axis_name, enabled)


def _policy_rule(fn: str, **settings: Any) -> _Rule:
  """The dynamic `_Rule`, after the checks that involve two settings."""
  rule = _Rule(dynamic=True, **settings)
  if rule.growth_interval + rule.growth_delay > _validation.INT32_MAX:
    raise ValueError(
      f"`{fn}(growth_interval=..., growth_delay=...)` need growth_interval +"
      f" growth_delay <= {_validation.INT32_MAX} (the good-step counter"
      f" saturates there), got {rule.growth_interval} + {rule.growth_delay}."
    )
  if rule.tolerance > 0.0 and rule.hysteresis > 1:
    raise ValueError(
      f"`{fn}(tolerance=..., hysteresis=...)` are two back-off policies"
      " (fairseq's and Megatron-LM's or DeepSpeed's): set one, got"
      f" tolerance={rule.tolerance!r} with hysteresis={rule.hysteresis!r}."
    )
  return rule


def _build(fn, inner, rule, axis_name, enabled):
  axis_name = _axes.validate_axis_name(fn, axis_name)
  if not _validation.boolean(fn, "enabled", enabled):
    rule = _Rule(initial_scale=1.0, dynamic=False, enabled=False)
  return _wrap(fn, inner, rule, axis_name)


def static_loss_scale(
  inner: optax.GradientTransformation,
  loss_scale: float,
  *,
  axis_name: _axes.AxisName | None = None,
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
  scale = _validation.float32_scale(fn, "loss_scale", loss_scale)
  rule = _Rule(initial_scale=scale, dynamic=False, min_scale=scale, max_scale=scale)
  return _build(fn, inner, rule, axis_name, enabled)


def skip_nonfinite(
  inner: optax.GradientTransformation,
  *,
  axis_name: _axes.AxisName | None = None,
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
  rule = _Rule(initial_scale=1.0, dynamic=False)
  return _build(fn, inner, rule, axis_name, True)


def _is_earlier_layout(x: Any) -> bool:
  """A NamedTuple with a subset of `LossScaleState`'s fields, `loss_scale`
  and `inner_state` among them, that is not a `LossScaleState`."""
  fields = getattr(x, "_fields", None)
  return (
    isinstance(x, tuple)
    and not isinstance(x, LossScaleState)
    and fields is not None
    and {"loss_scale", "inner_state"} <= set(fields) < set(LossScaleState._fields)
  )


def upgrade_state(tree: Any) -> Any:
  """Converts the loss-scaling states of an earlier layout in `tree`.

  [`lossscale.LossScaleState`][] gained fields over time: `last_finite` after
  lossscale 0.1.0, then `steps_since_rescale`, `overflows_since_backoff` and
  `overflows_at_min_scale`. A checkpoint written before does not restore
  into the new structure: restore it into a NamedTuple with the fields it
  was written with (in their order) and pass the result here. Every such
  NamedTuple in `tree` (nested in a chain or a `TrainState` too) becomes a
  `LossScaleState` with its values, and with the fields it lacks as a fresh
  state holds them (`last_finite` True, the new counters 0), shaped like its
  `good_steps` (a batched state stays batched). Everything else in `tree` is
  returned as it is. [Checkpointing][checkpoints-written-by-earlier-versions]
  has the orbax recipe.

  Args:
    tree: a pytree holding states of an earlier layout: NamedTuples whose
      fields are some of `LossScaleState`'s, `loss_scale` and `inner_state`
      among them.

  Returns:
    `tree` with each of those replaced by a `LossScaleState`.

  Examples:
    >>> from typing import Any, NamedTuple
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> class LossScaleState01(NamedTuple):  # lossscale 0.1.0's fields
    ...   loss_scale: Any
    ...   good_steps: Any
    ...   hysteresis_left: Any
    ...   skipped_steps: Any
    ...   consecutive_skips: Any
    ...   inner_state: Any
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1))
    >>> s = tx.init({"w": jnp.zeros(2)})
    >>> old = LossScaleState01(*s[:5], s.inner_state)  # as restored
    >>> new = ls.upgrade_state(old)
    >>> type(new).__name__, new.last_finite, new.steps_since_rescale
    ('LossScaleState', Array(True, dtype=bool), Array(0, dtype=int32))
  """

  def convert(x: Any) -> Any:
    if not _is_earlier_layout(x):
      return x
    values = x._asdict()
    like = jnp.asarray(values["good_steps"]) if "good_steps" in values else None
    fresh = lambda dtype, fill: jnp.full(
      [] if like is None else like.shape, fill, dtype
    )
    defaults = dict(
      good_steps=fresh(jnp.int32, 0),
      hysteresis_left=fresh(jnp.int32, 1),
      skipped_steps=fresh(jnp.int32, 0),
      consecutive_skips=fresh(jnp.int32, 0),
      last_finite=fresh(jnp.bool_, True),
      steps_since_rescale=fresh(jnp.int32, 0),
      overflows_since_backoff=fresh(jnp.int32, 0),
      overflows_at_min_scale=fresh(jnp.int32, 0),
    )
    return LossScaleState(**(defaults | values))

  return jax.tree.map(convert, tree, is_leaf=_is_earlier_layout)
