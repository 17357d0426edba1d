"""`apply_gradients`: the whole optimizer step behind one decision.

The decision is passed in plain sight, through the wrapper's `update`
(the protocol is described in `lossscale/_decision.py`):

1. `tx.update(..., lossscale_finite=None)` runs the transformations chained
   before the wrapper and the wrapper's finite check, and returns the
   wrapper's `Decision` in place of its state. No optimizer runs.
2. `lax.cond(decision.finite, applied, skipped)`: `applied` is
   `tx.update(..., lossscale_finite=decision)` followed by
   `optax.apply_updates`; the wrapper works on the gradients it decided on,
   so what was chained before it (a cross-replica mean) is dead code there
   and is computed once. `skipped` returns the parameters and the whole
   optimizer state as they were, except the wrapper's state, which is
   `decision.skipped`.

Step 1 is traced on its own (`jax.make_jaxpr`) and only its flag is kept,
so nothing in it runs. A chain with effects (a `jax.debug.callback`) and an
eager call take the step in one pass instead (`_one_pass`): `tx.update`,
then the result kept or dropped on the flag the wrapper wrote, so that each
effect happens once per step.

For a step with many leaves the `lax.cond` is compiled as several small
ones on the same flag (lossscale/_speed/split.py), which XLA compiles in about
the bare step's time.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax

from lossscale import _axes, _collectives, _jax_internals
from lossscale._applied import check_consulted, control_flow_error
from lossscale._decision import DECISION, DecideOnly, Decision
from lossscale._dtypes import cast_like
from lossscale._rule import is_state, states_in
from lossscale._speed import ordering as _ordering

_is_decision = lambda x: isinstance(x, Decision)


def _count_error(found: str) -> ValueError:
  return ValueError(
    "`apply_gradients(tx=...)` must contain exactly one loss-scaling wrapper"
    " (dynamic_loss_scale, static_loss_scale or skip_nonfinite), found"
    f" {found}."
  )


def _no_decision_error() -> ValueError:
  return ValueError(
    "`apply_gradients(tx=...)`: the loss-scaling wrapper did not receive the"
    f" decision request (the `{DECISION}` keyword argument of `update`): a"
    " transformation between `tx` and the wrapper does not pass extra keyword"
    " arguments on (a plain optax.GradientTransformation, not"
    " GradientTransformationExtraArgs). Build `tx` with optax.chain, or use"
    " `tx.update` + `optax.apply_updates`."
  )


def _check_holds_one(opt_state: Any) -> None:
  n_states = len(states_in(opt_state))
  if n_states != 1:
    raise _count_error("none" if not n_states else str(n_states))
  check_consulted(opt_state)


def _decisions_in(decided: Any) -> list[Decision]:
  leaves = jax.tree_util.tree_leaves(decided, is_leaf=_is_decision)
  return [d for d in leaves if _is_decision(d)]


def _decision_in(decided: Any) -> Decision:
  decisions = _decisions_in(decided)
  if len(decisions) != 1:
    if not decisions:
      raise _no_decision_error()
    raise _count_error(str(len(decisions)))
  return decisions[0]


def _decide(tx, grads, opt_state, params, extra_args, request=None) -> Decision | None:
  """The wrapper's decision, from `tx.update(..., lossscale_finite=request)`,
  or None where that call has effects (a `jax.debug.callback` in the chain)
  or is called outside any trace.

  The call is traced on its own (`jax.make_jaxpr`), which checks `tx`, and
  then evaluated in the step, so that what it computes and does not need is
  dropped, and nothing it does happens: a chain with effects, and an eager
  call, are stepped in one pass instead (`_one_pass`), so each effect
  happens once per step and nothing is computed twice."""
  found: list[Any] = []

  def arrays() -> Any:
    _, decided = tx.update(
      grads, opt_state, params, **extra_args, **{DECISION: request}
    )
    found.append(decided)
    decisions = _decisions_in(decided)
    # Its arrays (flags handed back by a jitted `tx.update` included); its
    # Python values stay as they are.
    leaves = jax.tree_util.tree_leaves(decisions) if len(decisions) == 1 else []
    return [x for x in leaves if isinstance(x, jax.Array)]

  try:
    closed = jax.make_jaxpr(arrays)()
  except (TypeError, ValueError) as e:
    try:  # Does the ordinary step trace? Then the decision request broke it.
      jax.eval_shape(lambda: tx.update(grads, opt_state, params, **extra_args))
    except Exception:
      raise e from None
    if DECISION in str(e):
      raise _no_decision_error() from e
    raise control_flow_error("another transformation") from e
  decision = _decision_in(found[0])
  if _jax_internals.has_effects(closed) or not _jax_internals.staging():
    return None
  out = iter(_jax_internals.jaxpr_as_fun(closed)())
  leaves, tree = jax.tree_util.tree_flatten(decision)
  leaves = [next(out) if isinstance(x, jax.Array) else x for x in leaves]
  return jax.tree_util.tree_unflatten(tree, leaves)


def _apply_updates(params: Any, updates: Any) -> Any:
  """`optax.apply_updates`, except that a parameter whose update is `float0`
  (what `jax.grad(..., allow_int=True)` gives an integer parameter, passed
  through by `optax.masked`) or None (what `value_and_grad` gives it) is
  kept as it is."""

  def leaf(p: Any, u: Any) -> Any:
    if u is None or getattr(u, "dtype", None) == jax.dtypes.float0:
      return p
    return optax.apply_updates(p, u)

  return jax.tree.map(leaf, params, updates, is_leaf=lambda x: x is None)


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
    wrapper's [`LossScaleState.last_finite`][lossscale.LossScaleState].

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
  return _apply_gradients(tx, grads, opt_state, params, **extra_args)


class _MoreAxes(Exception):
  """The applied step communicates over axes its decision was not reduced
  over (a collective chained after the wrapper)."""

  def __init__(self, axes: tuple) -> None:
    super().__init__(axes)
    self.axes = axes


def _apply_gradients(tx, grads, opt_state, params, **extra_args):
  _check_holds_one(opt_state)
  decision = _decide(tx, grads, opt_state, params, extra_args)
  # Called outside any trace, the step runs op by op, as the bare optimizer
  # runs eagerly.
  if decision is None:
    return _one_pass(tx, grads, opt_state, params, extra_args)

  def vet(closed: Any) -> None:
    found = _collectives.communicated_axes(closed)
    more = tuple(a for a in found if a not in decision.axes.names)
    if more:
      raise _MoreAxes(_collectives.union(decision.axes.names, more))

  try:
    return _step(tx, grads, opt_state, params, extra_args, decision, vet)
  except _MoreAxes as e:
    # A collective after the wrapper (`cross_shard_mean` chained after it)
    # runs only where the step is applied: every replica must take the same
    # branch, so the decision is taken again, reduced over its axes too.
    request = DecideOnly(e.axes)
    decision = _decide(tx, grads, opt_state, params, extra_args, request)
    if decision is None:
      return _one_pass(tx, grads, opt_state, params, extra_args)
    return _step(tx, grads, opt_state, params, extra_args, decision, None)


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

  if not isinstance(wrapper.last_finite, jax.core.Tracer):
    return applied() if bool(wrapper.last_finite) else skipped()
  operands = (updates, new_state, opt_state, params)
  return _axes.cond(wrapper.last_finite, applied, skipped, operands=operands)


def _step(tx, grads, opt_state, params, extra_args, decision, vet):
  def applied(decision: Decision = decision) -> tuple[Any, Any]:
    update = lambda state: tx.update(
      grads, state, params, **extra_args, **{DECISION: decision}
    )
    updates, new_state = update(opt_state)
    # The wrapper's updates come in the parameters' dtype; a transformation
    # chained after it may widen them: `apply_updates` adds and casts back,
    # mixing dtypes on purpose.
    with jax.numpy_dtype_promotion("standard"):
      new_params = _apply_updates(params, updates)
    # State computed wider than it is stored (bfloat16 moments) is written
    # after the new parameters, in place (`read_after`; in-process A/B,
    # XLA:CPU, jaxlib 0.12.0.1, 10M bfloat16 AdamW: 0.78x of bare ordered,
    # 0.82x not, and a skipped step 0.27x and 0.52x).
    # `is True`: a `tx.update` under its own `jax.jit` hands the flag back
    # as an array; then the state is written as it is (copied).
    ordered = _ordering.orders_fused_writes()
    if decision.in_order is True and ordered:
      old, ordered = _ordering.read_after(opt_state, new_params)
      if ordered:
        _, new_state = update(old)
    # Transformations chained after the wrapper may change their state's
    # dtype (optax.trace on bfloat16 params): both branches keep `opt_state`'s.
    return new_params, cast_like(new_state, opt_state)

  def skipped():
    new_state = jax.tree.map(
      lambda x: decision.skipped if is_state(x) else x, opt_state, is_leaf=is_state
    )
    return params, new_state

  # A transformation chained after the wrapper that hands values out of the
  # computation (a callback logging the updates) would see what the inner
  # optimizer made of a bad member's gradients where both branches run (a
  # `jax.vmap` around this step once traced): then the inner optimizer is
  # fed zeros there too, and the state is written in one call (a second
  # would run the callback twice).
  handed_out = None
  if decision.zero is False or decision.in_order is True:
    handed_out = lambda: functools.partial(
      applied, decision._replace(zero=True, in_order=False)
    )
  return _axes.cond(
    decision.finite,
    applied,
    skipped,
    operands=(grads, opt_state, params),
    if_handed_out=handed_out,
    vet=vet,
  )
