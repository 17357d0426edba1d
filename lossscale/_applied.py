"""Whether the last step was applied, and keeping other state on a skip.

`step_applied` reads the wrapper's `last_applied`; `where_applied` selects
between a step's new state and the old one with it, for state the optimizer
does not hold (Haiku's BatchNorm statistics, say). Both, and every fused
step (`apply_gradients`, `lossscale.flax.TrainState`, `nnx_step`), first
check that the wrapper is consulted on every step (`check_consulted`): one
inside another transformation's control flow keeps the previous step's
decision on the steps where it does not run.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax

from lossscale._rule import LossScaleState, states_in
from lossscale._scaled_grad import _unwrap, find_state, multi_steps_error
from lossscale._wrapper import choose

T = TypeVar("T")


def control_flow_error(where: str) -> ValueError:
  """The one message for a wrapper that is not consulted on every step."""
  return ValueError(
    f"The loss-scaling wrapper runs inside {where}, under that"
    " transformation's own control flow: it is not consulted on every step,"
    " so whether a step is applied is neither known before the step"
    " (apply_gradients, lossscale.flax.TrainState, lossscale.flax.nnx_step)"
    " nor current after it (step_applied, where_applied). Put the wrapper"
    " outside (`dynamic_loss_scale(optax.apply_if_finite(inner, ...))`),"
    " or step with `tx.update` + `optax.apply_updates` (NNX:"
    " `optimizer.update`)."
  )


def check_consulted(opt_state: Any, *, exactly_one: str | None = None) -> None:
  """Raises where the loss-scaling state in `opt_state` is not consulted on
  every step: inside `optax.MultiSteps` (`multi_steps_error`), or inside
  `optax.apply_if_finite` or `optax.conditionally_*`, whose inner
  transformation runs under `lax.cond` (`control_flow_error`). With
  `exactly_one` (the caller's name), also where `opt_state` does not hold
  exactly one.

  A structural check, in one walk, so it holds for an optax state, for the
  `opt_state` of a Flax `TrainState` and for an `nnx.Optimizer`'s (whose
  leaves are `nnx.Variable`s), traced or not.
  """
  names = (
    "MultiStepsState",
    "ApplyIfFiniteState",
    "ConditionallyMaskState",
    "ConditionallyTransformState",
  )
  containers = tuple(getattr(optax, n) for n in names if hasattr(optax, n))
  node = lambda x: isinstance(x, (*containers, LossScaleState))
  nodes = [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=node) if node(x)]
  held = [n for n in nodes if not isinstance(n, LossScaleState) and states_in(n)]
  if any(isinstance(n, optax.MultiStepsState) for n in held):
    raise multi_steps_error()
  if held:
    raise control_flow_error(f"optax's {type(held[0]).__name__[:-5]}")
  count = sum(isinstance(n, LossScaleState) for n in nodes)
  if exactly_one is not None and count != 1:
    raise ValueError(
      f"`{exactly_one}(tx=...)` must contain exactly one loss-scaling wrapper"
      " (dynamic_loss_scale, static_loss_scale or skip_nonfinite), found"
      f" {count or 'none'}."
    )


def step_applied(x: Any) -> jax.Array:
  """Returns whether the last step was applied (its gradients were finite).

  The wrapper's [`LossScaleState.last_applied`][lossscale.LossScaleState]: True
  when the last `update` (or [`lossscale.apply_gradients`][]) applied its
  update, False when it skipped it, True before the first step. jmp's
  `grads_finite` and Flax `DynamicScale`'s `is_fin`, read after the step.

  Args:
    x: an optimizer state with a [`lossscale.LossScaleState`][] nested
      anywhere inside, a [`lossscale.flax.TrainState`][] (or any object with
      an `opt_state`), or an `nnx.Optimizer`, as
      [`lossscale.get_loss_scale`][] takes it.

  Returns:
    A bool array: a scalar (one per member under `jax.vmap` and `jax.pmap`).

  Raises:
    ValueError: when `x` does not hold exactly one `LossScaleState`, or holds
      it inside another transformation's control flow
      (`optax.MultiSteps(wrapper)`, `optax.apply_if_finite(wrapper)`,
      `optax.conditionally_mask(wrapper)`), where it does not run on every
      step and would report an earlier step's decision.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)
    >>> ls.step_applied(state)
    Array(False, dtype=bool)
  """
  check_consulted(getattr(x, "opt_state", x))
  return jnp.asarray(_unwrap(find_state(x).last_applied), jnp.bool_)


def _check_leaf(name: str, applied: jax.Array, path: Any, new: Any, old: Any) -> None:
  new, old = jnp.asarray(new), jnp.asarray(old)
  if new.shape != old.shape or new.dtype != old.dtype:
    raise ValueError(
      f"`{name}(new=..., old=...)` must have the same shape and dtype at every"
      f" leaf: at {jax.tree_util.keystr(path)} got {new.dtype}{list(new.shape)}"
      f" and {old.dtype}{list(old.shape)}."
    )
  if applied.ndim and new.shape[: applied.ndim] != applied.shape:
    raise ValueError(
      f"`{name}(x=...)` holds a stacked state (a flag of shape"
      f" {list(applied.shape)}), so every leaf must start with that shape:"
      f" at {jax.tree_util.keystr(path)} got {new.dtype}{list(new.shape)}."
      " Call it inside the jax.vmap or jax.pmap that steps the state."
    )


def where_applied(x: Any, new: T, old: T) -> T:
  """Returns `new` if the last step was applied, `old` if it was skipped.

  For state that a step computes beside the optimizer and that a skipped
  step must not keep, such as Haiku's `hk.State` (BatchNorm statistics)
  or a step counter:

  ```python
  state = ls.where_applied(opt_state, new_state, state)
  ```

  The flag is [`lossscale.step_applied`][]`(x)`; the choice is the one
  every step makes (a conditional, or a select per leaf under `jax.vmap`;
  never arithmetic), bit for bit, so an inf or NaN in a skipped step's
  `new` does not reach the result. Under `jax.vmap` and
  `jax.pmap` each member selects with its own flag; outside them, a stacked
  state's flags select along the leading axes of the leaves.

  Args:
    x: where to read the flag: an optimizer state with a
      [`lossscale.LossScaleState`][] nested anywhere inside, a
      [`lossscale.flax.TrainState`][], or an `nnx.Optimizer`, after the step.
    new: the tree the step computed.
    old: the tree before the step, with the structure, shapes and dtypes of
      `new`.

  Returns:
    A tree with the structure of `new`: `new`'s leaves where the last step
    was applied, `old`'s where it was skipped.

  Raises:
    ValueError: when `new` and `old` differ in tree structure, or in the
      shape or dtype of a leaf (named by its path), or for an `x` that
      [`lossscale.step_applied`][] refuses.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> @jax.jit
    ... def step(grads, opt_state, bn_state):
    ...   new_bn_state = {"mean": bn_state["mean"] + grads["w"]}  # the forward pass's
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return opt_state, ls.where_applied(opt_state, new_bn_state, bn_state)
    >>> opt_state, bn = step({"w": jnp.array([jnp.nan, 2.0])}, tx.init(params),
    ...                      {"mean": jnp.zeros(2)})
    >>> bn["mean"]
    Array([0., 0.], dtype=float32)
  """
  name = "where_applied"
  applied = step_applied(x)
  # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
  new_def: Any = jax.tree.structure(new)
  old_def = jax.tree.structure(old)
  if new_def != old_def:
    raise ValueError(
      f"`{name}(new=..., old=...)` must have the same tree structure, got"
      f" {new_def} and {old_def}."
    )
  jax.tree_util.tree_map_with_path(
    lambda path, n, o: _check_leaf(name, applied, path, n, o), new, old
  )
  new, old = jax.tree.map(jnp.asarray, (new, old))
  pick = lambda a, n, o: choose(a, lambda: n, lambda: o, operands=(n, o))
  for _ in range(applied.ndim):  # a stacked state, outside its vmap or pmap
    pick = jax.vmap(pick)
  return pick(applied, new, old)
