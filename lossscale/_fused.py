"""`apply_gradients`: the whole optimizer step behind one decision.

1. The wrapper's decision (`tx.update(..., lossscale_decision=Decide())`):
   the transformations chained before the wrapper and its check run, no
   optimizer does, and the wrapper hands back a `Decision` in place of its
   state. That call is traced on its own (`jax.make_jaxpr`) and only the
   decision is kept, so nothing else in it runs.
2. `choose(decision.applied, applied, skipped)`, `lossscale/_wrapper.py`'s
   one conditional: `applied` is `tx.update(..., lossscale_decision=decision)`
   followed by `optax.apply_updates`, the wrapper working on the gradients
   it decided on (what was chained before it, a cross-replica mean, is dead
   code there); `skipped` returns the parameters and the whole optimizer
   state as they were, except the wrapper's state, `decision.skipped`.

A chain with effects (a `jax.debug.callback`) and an eager call take the
step in one pass instead (`_one_pass`): `tx.update`, then the result kept
or dropped by the wrapper's `last_applied`, so each effect happens once.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from lossscale import _axes, _jax_internals, _wrapper
from lossscale._applied import check_consulted, control_flow_error
from lossscale._rule import LossScaleState, is_state, states_in
from lossscale._unscale import cast_like
from lossscale._wrapper import DECISION_ARG, Decide, Decision


def _no_decision_error() -> ValueError:
  return ValueError(
    "`apply_gradients(tx=...)`: the loss-scaling wrapper did not receive the"
    f" decision request (the `{DECISION_ARG}` keyword argument of `update`): a"
    " transformation between `tx` and the wrapper does not pass extra keyword"
    " arguments on (a plain optax.GradientTransformation, not"
    " GradientTransformationExtraArgs). Build `tx` with optax.chain, or use"
    " `tx.update` + `optax.apply_updates`."
  )


def _decide(tx, grads, opt_state, params, extra_args, request) -> Decision | None:
  """The wrapper's decision, from `tx.update(..., lossscale_decision=request)`
  traced on its own, or None where that call has effects (a
  `jax.debug.callback` in the chain), which would happen twice."""
  is_decision = lambda x: isinstance(x, Decision)
  found: list[Any] = []

  def arrays() -> Any:
    _, decided = tx.update(
      grads, opt_state, params, **extra_args, **{DECISION_ARG: request}
    )
    found.extend(
      x
      for x in jax.tree_util.tree_leaves(decided, is_leaf=is_decision)
      if is_decision(x)
    )
    # Its arrays (flags handed back by a jitted `tx.update` included); its
    # Python values stay as they are.
    leaves = jax.tree_util.tree_leaves(found) if len(found) == 1 else []
    return [x for x in leaves if isinstance(x, jax.Array)]

  try:
    closed = jax.make_jaxpr(arrays)()
  except (TypeError, ValueError) as e:
    try:  # Does the ordinary step trace? Then the decision request broke it.
      jax.eval_shape(lambda: tx.update(grads, opt_state, params, **extra_args))
    except Exception:
      raise e from None
    if DECISION_ARG in str(e):
      raise _no_decision_error() from e
    raise control_flow_error("another transformation") from e
  if len(found) != 1:
    if not found:
      raise _no_decision_error()
    raise ValueError(
      "`apply_gradients(tx=...)` must contain exactly one loss-scaling wrapper"
      f" (dynamic_loss_scale, static_loss_scale or skip_nonfinite), found {len(found)}."
    )
  if any(type(e).__name__ != "NamedAxisEffect" for e in closed.effects):
    return None
  out = iter(_jax_internals.jaxpr_as_fun(closed)())
  leaves, tree = jax.tree_util.tree_flatten(found[0])
  leaves = [next(out) if isinstance(x, jax.Array) else x for x in leaves]
  return jax.tree_util.tree_unflatten(tree, leaves)


def _apply_updates(params: Any, updates: Any) -> Any:
  """`optax.apply_updates`, except that a parameter whose update is `float0`
  (what `jax.grad(..., allow_int=True)` gives an integer parameter, passed
  through by `optax.masked`) or None (what `value_and_grad` gives it) is
  kept as it is."""

  kept = lambda u: u is None or getattr(u, "dtype", None) == jax.dtypes.float0
  return jax.tree.map(
    lambda p, u: p if kept(u) else optax.apply_updates(p, u),
    params,
    updates,
    is_leaf=lambda x: x is None,
  )


def apply_gradients(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: optax.OptState,
  params: Any,
  **extra_args: Any,
) -> tuple[Any, optax.OptState]:
  """Applies one loss-scaled optimizer step, or skips all of it.

  On a finite step the result equals

  ```python
  updates, opt_state = tx.update(grads, opt_state, params, **extra_args)
  params = optax.apply_updates(params, updates)
  ```

  to rounding (XLA may contract the update and the addition differently). On
  a non-finite step the whole step is skipped, as TensorFlow's
  `LossScaleOptimizer.apply_gradients` did: `params` and every state in
  `opt_state` come back bit for bit, including transformations chained after
  the wrapper, and only the wrapper's scale and counters move. The decision
  is the wrapper's own (its finite check after the transformations chained
  before it, its `axis_name`), taken once, and the step sits behind one
  `lax.cond`: a skipped step runs no optimizer, and a finite one writes no
  separate updates array. Call it inside `jax.jit`, donating `params` and
  `opt_state` ([Performance: what to do][what-to-do]).

  Args:
    tx: a transformation holding exactly one loss-scaling wrapper, anywhere
      in a chain, but not inside another transformation's control flow
      (`optax.MultiSteps`, `optax.apply_if_finite`, `optax.conditionally_*`).
    grads: gradients of the scaled loss.
    opt_state: `tx`'s state.
    params: the parameters.
    **extra_args: forwarded to `tx.update` (such as `value` for `optax.lbfgs`).

  Returns:
    `(new_params, new_opt_state)`. Whether the step was applied is the
    wrapper's [`LossScaleState.last_applied`][lossscale.LossScaleState].

  Raises:
    TypeError: when `tx` is not an `optax.GradientTransformation`.
    ValueError: when `tx` holds no loss-scaling wrapper, more than one, or one
      that cannot be consulted before the step.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
    >>> params, state = step({"w": jnp.array([4.0, -8.0])}, state, params)
    >>> params["w"]
    Array([0.5, 2. ], dtype=float32)
    >>> params, state = step({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    >>> params["w"], ls.get_loss_scale(state), state.skipped_steps
    (Array([0.5, 2. ], dtype=float32), Array(2., dtype=float32), Array(1, dtype=int32))

  References:
    TensorFlow `LossScaleOptimizer.apply_gradients`.
  """
  if isinstance(tx, optax.MultiSteps):
    raise TypeError(
      "`apply_gradients(tx=...)` must be an optax.GradientTransformation, got"
      " an optax.MultiSteps object: pass `multi_steps.gradient_transformation()`."
    )
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
      "`apply_gradients(tx=...)` must be an optax.GradientTransformation,"
      f" got {type(tx).__name__} instead."
    )
  check_consulted(opt_state, exactly_one="apply_gradients")
  # Called outside any trace, the step runs op by op, as the bare optimizer
  # runs eagerly, after one abstract trace of the decision, which checks
  # that `tx` can take one.
  if not _jax_internals.staging():
    _decide(tx, grads, opt_state, params, extra_args, Decide())
    return _one_pass(tx, grads, opt_state, params, extra_args)
  decision, closed = _decided_step(tx, grads, opt_state, params, extra_args)
  if decision is None:  # effects in the chain
    return _one_pass(tx, grads, opt_state, params, extra_args)

  # A skipped step: the parameters and every state as they were, but the
  # wrapper's, which is its decision's.
  ours = lambda x: isinstance(x, LossScaleState)
  keep = lambda x: decision.skipped if ours(x) else x
  tree = jax.tree.structure((params, opt_state))
  return _wrapper.choose(
    decision.applied,
    lambda: jax.tree.unflatten(tree, _jax_internals.jaxpr_as_fun(closed)()),
    lambda: (params, jax.tree.map(keep, opt_state, is_leaf=ours)),
    operands=(grads, opt_state, params),
  )


def _decided_step(tx, grads, opt_state, params, extra_args) -> tuple[Any, Any]:
  """The decision, and the applied step traced (`_applied`), or
  `(None, None)` where the chain has effects.

  A collective after the wrapper (`cross_shard_mean` chained after it) runs
  only where the step is applied, so every replica must take the same
  branch: then the decision is taken again, agreed over its axes too. Where
  the applied step hands values out (a callback after the wrapper), it
  writes its state in one call (a second would run the callback twice), and
  the inner optimizer is fed zeros for a skipped member (a `jax.vmap`
  around the traced step runs both branches): then the decision is taken
  again, asking for that."""
  request, order = Decide(), True
  while True:
    decision = _decide(tx, grads, opt_state, params, extra_args, request)
    if decision is None:
      return None, None
    closed = jax.make_jaxpr(
      lambda d=decision, o=order: _applied(
        tx, grads, opt_state, params, extra_args, d, o
      )
    )()
    axes, hands_out = _jax_internals.inspect(closed)
    more = tuple(a for a in axes if a not in decision.axes)
    zero = hands_out and not decision.traced.zero
    if more or zero:
      request = Decide(_axes.union(decision.axes, more), request.zero or zero)
      order = order and not hands_out
    elif hands_out and order:
      order = False
    else:
      return decision, closed


def _applied(tx, grads, opt_state, params, extra_args, decision, order) -> Any:
  """The applied step: the chain with the wrapper applying `decision`,
  then `optax.apply_updates`, the state in `opt_state`'s dtypes (and, with
  `order`, written as the speed layer's `order` writes it)."""
  update = lambda state: tx.update(
    grads, state, params, **extra_args, **{DECISION_ARG: decision}
  )
  updates, new_state = update(opt_state)
  # The wrapper's updates come in the parameters' dtype; a transformation
  # chained after it may widen them: `apply_updates` adds and casts back,
  # mixing dtypes on purpose.
  with jax.numpy_dtype_promotion("standard"):
    new_params = _apply_updates(params, updates)
  if order and "order" in _wrapper.TRICKS:  # bfloat16 state written last
    new_state = _wrapper.applied_state(
      decision, update, opt_state, new_params, new_state
    )
  # Transformations chained after the wrapper may change their state's
  # dtype (optax.trace on bfloat16 params): both branches keep `opt_state`'s.
  return jax.tree.leaves((new_params, cast_like(new_state, opt_state)))


def _one_pass(tx, grads, opt_state, params, extra_args):
  """The step as `tx.update` + `optax.apply_updates`, each part run once,
  then kept or dropped: for an eager step, and for a chain with effects
  (its callbacks run once per step, those after the wrapper on the zero
  updates of a skipped step)."""
  updates, new_state = tx.update(grads, opt_state, params, **extra_args)
  (wrapper,) = states_in(new_state)

  def applied() -> tuple[Any, Any]:
    with jax.numpy_dtype_promotion("standard"):
      new_params = _apply_updates(params, updates)
    return new_params, cast_like(new_state, opt_state)

  def skipped() -> tuple[Any, Any]:
    keep = lambda x: wrapper if is_state(x) else x
    return params, jax.tree.map(keep, opt_state, is_leaf=is_state)

  operands = (updates, new_state, opt_state, params)
  return _wrapper.choose(wrapper.last_applied, applied, skipped, operands)
