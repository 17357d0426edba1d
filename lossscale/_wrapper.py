"""The wrapper's step: one decision, then the inner optimizer or nothing.

`wrap(fn, inner, rule, axis_name)` builds the optax transformation behind
`dynamic_loss_scale`, `static_loss_scale` and `skip_nonfinite`. Its `update`
serves three requests, one function each, named by the keyword argument
`lossscale_decision` (which optax combinators pass along like any extra
argument):

- absent: the ordinary step (`_step`). Unscale in float32 and check; agree
  over the axes; then `choose`: the inner optimizer, or zero updates and its
  state as it was; the rule moves the counters.
- `Decide(...)`: the same decision, and no optimizer run: zero updates (so
  transformations chained after the wrapper can be traced) and, in place of
  the state, a `Decision`. `apply_gradients` asks for this first.
- a `Decision`: apply it (`_apply`). The inner optimizer runs on the
  gradients the decision was taken on, with no conditional of its own:
  `apply_gradients` puts its one conditional around the whole step.

The inner optimizer is traced once per step (`_trace`): its jaxpr gives the
shapes of a skipped step's zeros, the axes it communicates over, whether it
hands values out, and is what runs. `choose` is the one place a step is
applied or skipped, for the wrapper, `apply_gradients`, `TrainState`, the
NNX step and `where_applied`. What exists only for speed is in
`lossscale/_speed/`, reached from this module only, through `TRICKS`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale import _axes, _checks, _jax_internals, _unscale
from lossscale._rule import (
  LossScaleState,
  Rule,
  init_counters,
  next_counters,
  states_in,
)
from lossscale._unscale import (
  cast_like,
  is_inexact,
  unscale,
  unscale_factors,
  widen,
  widen_float16,
)

try:  # the speed layer: absent, or switched off, the plain core runs alone
  from lossscale import _speed
except ImportError:  # pragma: no cover - exercised by a test in a subprocess
  _speed = None  # type: ignore[assignment]
TRICKS: frozenset[str] = _speed.TRICKS_ON if _speed is not None else frozenset()

DECISION_ARG = "lossscale_decision"
"""The keyword argument of a wrapper's `update` that carries a request."""

# Extra arguments of `update` that hold gradients (of the scaled loss, like
# the updates): optax's line searches take the gradient as `grad=`.
GRADIENT_EXTRA_ARGS = ("grad",)


class Decide(NamedTuple):
  """`lossscale_decision=Decide(axes, zero)`: decide only. The decision is
  agreed over `axes` too, and with `zero` the inner optimizer is fed zeros
  in place of a skipped member's gradients (where both branches of the
  step run and something hands values out)."""

  axes: tuple = ()
  zero: bool = False


class Traced(NamedTuple):
  """The inner step, traced once: its closed jaxpr (one call of `call`)
  and how to call it again."""

  closed: Any
  call: Callable[..., Any]  # a `jax.jit` of the step: called, its trace reused
  dynamic: tuple[bool, ...]  # which input leaves are traced arrays
  out_shapes: Any
  zero: bool  # whether it takes the decision and feeds zeros on a skip


class Decision(NamedTuple):
  """What a wrapper returns in place of its state when asked to `Decide`.

  Attributes:
    applied: bool, whether the step is applied (agreed over `axes`).
    skipped: the wrapper's `LossScaleState` after this step, with the inner
      state as it was (what a skipped step leaves; applied, the inner state
      is the inner optimizer's).
    incoming: the gradients the wrapper received, still scaled: applying
      the decision works on these, so what was chained before the wrapper
      (a cross-replica mean) is dead code there.
    traced: the inner step, traced (a `Traced`), which applying runs.
    axes: the axes the decision was agreed over.
  """

  applied: jax.Array
  skipped: LossScaleState
  incoming: Any
  traced: Traced
  axes: tuple


# Requests and decisions cross `jax.jit` around `tx.update` (and optax's
# combinators) as pytrees: a decision's arrays are its leaves, the rest is
# static; a request has no leaves.
jax.tree_util.register_pytree_node(Decide, lambda d: ((), d), lambda d, _: d)
jax.tree_util.register_pytree_node(
  Decision,
  lambda d: (d[:3], d[3:]),
  lambda static, arrays: Decision(*arrays, *static),
)


def _trace(step: Callable[..., Any], operands: tuple, zero: bool) -> Traced:
  """Traces `step(*operands)` once: array leaves are its inputs, the other
  leaves (Python numbers, callables such as `value_fn`) constants. A
  `jax.jit` holds the trace, so each place that runs the step (a branch, and
  on the CPU a second one that writes the state) binds one call of it, not
  its every equation again."""
  leaves, in_tree = jax.tree.flatten(operands)
  dynamic = tuple(
    isinstance(x, (jax.Array, np.ndarray)) and x.dtype != jax.dtypes.float0
    for x in leaves
  )

  def flat(*arrays: Any) -> Any:
    it = iter(arrays)
    full = [next(it) if d else x for x, d in zip(leaves, dynamic, strict=True)]
    return step(*jax.tree.unflatten(in_tree, full))

  arrays = [x for x, d in zip(leaves, dynamic, strict=True) if d]
  call = jax.jit(flat)
  closed, shapes = jax.make_jaxpr(call, return_shape=True)(*arrays)
  return Traced(closed, call, dynamic, shapes, zero)


def run(traced: Traced, operands: tuple) -> Any:
  """The traced step on `operands` (the same structure, other values)."""
  leaves = jax.tree.leaves(operands)
  arrays = [x for x, d in zip(leaves, traced.dynamic, strict=True) if d]
  return traced.call(*arrays)


def _inner_step(inner, rule, zero, grads, factors, applied, state, params, extra):
  """The inner optimizer on the unscaled gradients (`factors`, or, for
  `enabled=False`, the scale); with `zero`, fed zeros unless `applied`.

  The dtype policy: half-precision gradients are unscaled in float32, and
  the inner optimizer then runs in float32 throughout (its state and the
  parameters widened too: some optax optimizers cannot mix dtypes), its
  state stored back in the dtypes it had. `enabled=False` hands `inner` the
  gradients' own dtypes, exactly `inner`, except for float16 parameters,
  whose state is float32 either way.
  """
  narrow = lambda x: is_inexact(x) and jnp.finfo(x.dtype).bits < 32
  float16 = lambda x: is_inexact(x) and x.dtype == jnp.float16
  if rule.enabled:
    widened = any(narrow(x) for x in jax.tree.leaves((grads, params)))
  else:
    widened = any(float16(x) for x in jax.tree.leaves(params))
  if rule.enabled:
    unscaled = lambda t: unscale(t, factors, zero_unless=applied if zero else None)
  else:  # exactly `inner`: the gradients as they are, unless a restored
    # state's scale is not 1 (decided in Python where it is concrete)
    unscaled = functools.partial(_divided_out, scale=factors, widened=widened)
  extra = {k: unscaled(v) if k in GRADIENT_EXTRA_ARGS else v for k, v in extra.items()}
  # Widened where they are used: taken from outside the conditional, the
  # float32 copies would be written out as its operands.
  inner_params = widen(params) if widened else params
  inner_state = widen(state) if widened else state
  updates, new_state = inner.update(unscaled(grads), inner_state, inner_params, **extra)
  if widened:
    # The updates in the dtypes bare `inner` gives for these parameters
    # (theirs; without params, the gradients'), so that any
    # `apply_updates`, `p + u` included, keeps the parameters' dtypes.
    fits = params is not None and jax.tree.structure(params) == jax.tree.structure(
      updates
    )
    updates = cast_like(updates, params if fits else grads)
  return updates, cast_like(new_state, state)


def _divided_out(tree: Any, scale: Any, widened: bool) -> Any:
  """`enabled=False`: the gradients themselves on a scale of 1 (a
  conditional, not a multiply by 1, so the inner optimizer compiles as it
  does bare), else divided by a restored scale in their own dtypes."""
  divide = lambda: unscale(tree, unscale_factors(scale), keep_dtype=True)
  is_one = scale == 1
  if isinstance(is_one, jax.core.Tracer):
    tree = jax.lax.cond(is_one, lambda: tree, divide)
  elif not is_one:
    tree = divide()
  return widen(tree) if widened else tree


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: whether every element of `tree` is finite.

  Floating and complex leaves (arrays and Python numbers) are checked;
  integer, boolean and `float0` leaves are always finite and are ignored.
  An empty tree (or one with no floating leaves) is finite. It creates no
  NaN of its own: under `jax.debug_nans`, gradients that hold an inf do not
  trip it. It is the check a loss-scaling wrapper runs on every step.

  Args:
    tree: a pytree of arrays.

  Returns:
    A `bool` scalar array, `True` iff no leaf holds an inf or a NaN.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> ls.all_finite({"w": jnp.ones(3), "b": jnp.zeros(2)})
    Array(True, dtype=bool)
    >>> ls.all_finite({"w": jnp.array([1.0, jnp.inf])})
    Array(False, dtype=bool)
    >>> ls.all_finite({})
    Array(True, dtype=bool)
  """
  # The speed layer's `finite` checks small leaves in groups: the same flag.
  finite = _speed.finite.all_finite if "finite" in TRICKS else _unscale.all_finite
  return finite(tree, None)


def choose(
  applied: Any,
  if_applied: Callable[[], Any],
  if_skipped: Callable[[], Any],
  operands: Any = (),
) -> Any:
  """The one place a step is applied or skipped: `if_applied()` or
  `if_skipped()` by `applied`, in Python where it is concrete, else behind
  one conditional (split in several by the speed layer, `split`), whose
  branches may vary over different manual axes of `operands` (`shard_map`)."""
  if not isinstance(applied, jax.core.Tracer):
    return if_applied() if bool(applied) else if_skipped()
  leaves = jax.tree.leaves(operands)
  varying = any(_jax_internals.varying_axes(x) for x in leaves if hasattr(x, "dtype"))
  cond = _axes.varying_cond if varying else None
  if "split" in TRICKS:
    return _speed.split.cond(applied, if_applied, if_skipped, cond)
  return (cond or jax.lax.cond)(applied, if_applied, if_skipped)


def wrap(
  fn: str,
  inner: optax.GradientTransformation,
  rule: Rule,
  axis_name: _axes.AxisName | None,
) -> optax.GradientTransformationExtraArgs:
  """Builds the wrapper (see the module docstring)."""
  _checks.check_inner(fn, inner)
  inner = optax.with_extra_args_support(inner)
  step = functools.partial(_inner_step, inner, rule)
  own_axes = _axes.as_tuple(axis_name)

  def init_fn(params: Any) -> LossScaleState:
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

  def update_fn(updates, state, params=None, **extra_args):
    request = extra_args.pop(DECISION_ARG, None)
    # Python float leaves: arrays, as `jax.jit` would make them, so that a
    # step is unscaled and checked the same eagerly and under `jit`.
    updates = jax.tree.map(
      lambda x: jnp.asarray(x) if isinstance(x, (float, complex)) else x, updates
    )
    # What the step is taken on: the gradients, the unscale factors (the
    # scale, for `enabled=False`), the decision where the inner optimizer
    # is fed zeros on a skip, its state, the parameters, the extra arguments.
    operands = lambda: (
      updates,
      unscale_factors(state.loss_scale) if rule.enabled else state.loss_scale,
      None,
      state.inner_state,
      params,
      extra_args,
    )
    checked = params if rule.enabled else None
    _checks.check_update(fn, updates, state, checked, lambda: step(False, *operands()))
    operands = operands()
    if isinstance(request, Decision):
      return _apply(request, operands)
    if not rule.enabled:  # exactly `inner`: nothing to decide
      return _disabled(rule, step, request, state, operands)
    return _step(fn, rule, own_axes, step, request, state, operands)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _step(fn, rule, own_axes, step, request, state, operands):
  """The ordinary step, or (`request` a `Decide`) its decision alone."""
  updates, (pre, inv), _, _, _, extra = operands
  # What the check multiplies by, as far as finiteness goes `unscale`'s two
  # factors in one: above 2**126 dividing cannot overflow, so the gradients
  # are checked as they are.
  f32, scale = jnp.float32, state.loss_scale
  factor = jnp.where(scale > f32(2.0**126), f32(1.0), f32(1.0) / scale)
  finite = _speed.finite.all_finite if "finite" in TRICKS else _unscale.all_finite
  overflow = lambda: jnp.logical_not(finite(updates, factor))
  # The other inputs of the decision: the unscaled loss, as optax's
  # `value=`, and, for the spike test, the unscaled gradient norm.
  loss, norm = extra.get("value"), None
  if loss is not None or rule.spikes is not None:
    loss = _checks.loss_value(fn, rule.spikes, loss)
  if rule.spikes is not None and rule.spikes.grad_norm:
    overflowed, norm = _checked(updates, (pre, inv), overflow)
  else:
    overflowed = overflow()
  if not isinstance(overflowed, jax.core.Tracer):  # eager: decided in Python
    return _eager(rule, step, state, operands, overflowed, loss, norm)
  # Zeros for a skipped member's gradients where both branches run and
  # something could see them: under a `jax.vmap` being traced (the flag
  # batched), and where the inner optimizer hands values out (then a
  # `jax.vmap` around a traced step batches the conditional).
  zero = _jax_internals.batched(overflowed) or (request is not None and request.zero)
  with_flag = lambda flag: (*operands[:2], flag, *operands[3:])
  # The decision, while the step is traced, is this replica's flag.
  local = jnp.logical_not(overflowed)
  traced = _trace(
    functools.partial(step, zero), with_flag(local if zero else None), zero
  )
  axes_inside, hands_out = _jax_internals.inspect(traced.closed)
  if hands_out and not zero:
    zero = True
    traced = _trace(functools.partial(step, True), with_flag(local), True)
  # Every replica runs `inner` or none does: the decision is agreed over
  # the wrapper's axes, those the inner optimizer communicates over, and
  # those `apply_gradients` asks for (its inputs: any replica's overflow,
  # the replicas' mean loss and norm).
  asked = () if request is None else request.axes
  axes = tuple(dict.fromkeys((*own_axes, *axes_inside, *asked)))
  if axes:
    overflowed, loss, norm = _axes.agree(fn, axes, overflowed, loss, norm)
  if loss is not None and (more := _axes.loss_axes(updates, loss, axes)):
    # Gradients the same on every replica, the loss not: its mean decides.
    (loss,) = _axes.mean(fn, more, [loss])
    axes += more
  counters = next_counters(rule, state, overflowed, loss, norm)
  applied = counters["last_applied"]
  zeros = lambda: jax.tree.map(
    lambda s: jax.lax.full(s.shape, 0, s.dtype), traced.out_shapes[0]
  )
  if request is not None:
    skipped = LossScaleState(**counters, inner_state=state.inner_state)
    return zeros(), Decision(applied, skipped, updates, traced, axes)
  operands = with_flag(applied if zero else None)
  skip = lambda: (zeros(), state.inner_state)
  if "order" in TRICKS:  # bfloat16 state written after the updates
    new_updates, inner_state = _speed.ordering.staged(
      applied, traced, operands, skip, run, choose
    )
  else:
    apply = lambda: run(traced, operands)
    new_updates, inner_state = choose(applied, apply, skip, operands)
  # A `cross_shard_mean` chained after the wrapper refuses these unless the
  # decision was agreed over its axis.
  _axes.mark_per_replica(new_updates, axes)
  return new_updates, LossScaleState(**counters, inner_state=inner_state)


def _checked(updates, factors, overflow):
  """Whether the gradients overflowed (`overflow()`, the finite check), and
  their unscaled norm.

  With the norm, one pass over the gradients gives both: the sum of their
  squares, as they come (a reduction with no scalar operand), is finite
  only if they are, and the norm is its root, unscaled. Where the sum is
  not finite, the finite check tells an overflow from squares beyond
  float32, and the norm is computed from the unscaled gradients.
  """
  fast = "finite" in TRICKS
  sum_of_squares = _speed.finite.sum_of_squares if fast else _unscale.sum_of_squares
  total = sum_of_squares(updates)
  fine = jnp.isfinite(total)
  pre, inv = factors
  return choose(
    fine,
    lambda: (jnp.logical_not(fine), jnp.sqrt(total) * pre * inv),
    lambda: (overflow(), _unscale.global_norm(updates, factors)),
    updates,
  )


def _eager(rule, step, state, operands, overflowed, loss, norm):
  """The step outside any trace (the flags concrete), decided in Python:
  the inner optimizer runs op by op, as it does bare, or nothing runs."""
  counters = next_counters(rule, state, overflowed, loss, norm)
  shapes = lambda: jax.eval_shape(lambda: step(False, *operands))[0]
  new_updates, inner_state = choose(
    counters["last_applied"],
    lambda: step(False, *operands),
    # Zeros made on the host: nothing to compile on the first skip.
    lambda: (_host_zeros(shapes()), state.inner_state),
  )
  return new_updates, LossScaleState(**counters, inner_state=inner_state)


def _host_zeros(shapes: Any) -> Any:
  def zeros(s: Any) -> Any:
    host = np.zeros(s.shape, s.dtype)
    return host if s.dtype == jax.dtypes.float0 else jax.device_put(host)

  return jax.tree.map(zeros, shapes)


def _disabled(rule, step, request, state, operands):
  """`enabled=False`: exactly `inner`, no conditional, the scale set to 1.
  Asked to decide, it traces the step once, for `apply_gradients`."""
  counters = next_counters(rule, state, False)
  if request is not None:
    traced = _trace(functools.partial(step, False), operands, False)
    skipped = LossScaleState(**counters, inner_state=state.inner_state)
    zeros = jax.tree.map(
      lambda s: jax.lax.full(s.shape, 0, s.dtype), traced.out_shapes[0]
    )
    applied = jnp.ones([], jnp.bool_)
    return zeros, Decision(applied, skipped, operands[0], traced, ())
  # A concrete scale is divided out in Python, even where `inner` is traced.
  scale = operands[1]
  if not isinstance(scale, jax.core.Tracer):
    operands = (operands[0], float(scale), *operands[2:])
  new_updates, inner_state = step(False, *operands)
  return new_updates, LossScaleState(**counters, inner_state=inner_state)


def _apply(decision, operands):
  """Applies a `Decision` (`apply_gradients`, inside its conditional): the
  traced inner step on the gradients decided on, the rule on its flags."""
  flag = decision.applied if decision.traced.zero else None
  operands = (decision.incoming, operands[1], flag, *operands[3:])
  new_updates, inner_state = run(decision.traced, operands)
  # The state after it is the one the decision computed.
  return new_updates, decision.skipped._replace(inner_state=inner_state)


def applied_state(decision, update, opt_state, new_params, new_state):
  """`apply_gradients`' new optimizer state as the speed layer's `order`
  writes it (after the new parameters, on the CPU)."""
  return _speed.ordering.fused_state(
    decision.traced, update, opt_state, new_params, new_state
  )
