"""Flax integration: TensorFlow's skipped-step contract for linen and NNX.

Linen: `TrainState`, whose `apply_gradients` skips the whole step. NNX:
`nnx_step`, one training step with an `nnx.Optimizer`, which on a skipped
step puts the model (parameters, BatchNorm statistics, RNG counts, every
other `nnx.Variable` the forward pass wrote) and the optimizer back as they
were, except the wrapper's scale and counters. `nnx.Optimizer.update` alone
does not: its parameters stay (the updates are zeros), but what the forward
pass wrote to the model's other state, inf or NaN BatchNorm statistics
included, stays too. `lossscale.get_loss_scale`, `scale_loss` and
`value_and_grad` accept the `nnx.Optimizer` itself (docs/flax.md).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
  from flax.training import train_state
  from flax.training.train_state import OVERWRITE_WITH_GRADIENT
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
    "lossscale.flax needs Flax, an optional dependency: install it with"
    " `pip install 'lossscale[flax]'` (or `pip install flax`)."
  ) from e

from lossscale._fused import apply_gradients
from lossscale._scaled_grad import _unwrap, find_state, get_loss_scale, value_and_grad

__all__ = ["TrainState", "nnx_step"]


class TrainState(train_state.TrainState):
  """A Flax `TrainState` whose skipped steps leave it unchanged.

  Build it like Flax's (`TrainState.create(apply_fn=..., params=..., tx=...)`)
  with `tx` holding one loss-scaling wrapper. `apply_gradients(grads=...)`
  takes gradients of the *scaled* loss and runs
  [`lossscale.apply_gradients`][]:
  on a finite step the result is Flax's; on a skipped step only the
  optimizer state changes (the scale backs off, `skipped_steps` grows), and
  `step`, `params` and the fields passed as keyword arguments (such as
  `batch_stats`) keep their old values. `step` is an int32 that counts
  applied updates only, like TensorFlow's `global_step`; whether a step was
  applied is the wrapper's
  [`LossScaleState.last_finite`][lossscale.LossScaleState]. Flax's float8
  `OVERWRITE_WITH_GRADIENT` gradients go through Flax's own step. It works
  under `jax.jit`, `jax.pmap` and `jax.vmap`. `loss_scale` and
  `skipped_steps` are properties, not fields, so the state holds exactly one
  leaf named `loss_scale`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import flax.linen as nn
    >>> import lossscale as ls
    >>> model = nn.Dense(1)
    >>> params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    >>> state = ls.flax.TrainState.create(
    ...     apply_fn=model.apply, params=params,
    ...     tx=ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0))
    >>> bad = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), params)
    >>> state = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, bad)
    >>> state.step, state.loss_scale, state.skipped_steps
    (Array(0, dtype=int32), Array(4., dtype=float32), Array(1, dtype=int32))
  """

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Applies `grads` (of the scaled loss), or skips the step entirely.

    Args:
      grads: gradients with the structure of `params`, of the loss multiplied
        by `self.loss_scale` (see [`lossscale.value_and_grad`][]).
      **kwargs: other fields to replace, such as `batch_stats`; on a skipped
        step they keep their old values.

    Returns:
      The new state: `step` incremented, `params`, `opt_state` and `kwargs`
      updated on an applied step; only `opt_state` updated on a skipped one.

    Raises:
      ValueError: when a field given in `kwargs` changes its tree structure
        (a skipped step could not keep the old value), or when `tx` holds
        no (or more than one) loss-scaling state.
    """
    find_state(self.opt_state)  # Fails early with a clear message.
    fp8 = isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads
    if fp8:  # Flax's float8 path: Flax's own step, params selected below
      new = super().apply_gradients(grads=grads, **kwargs)
    else:
      # The fused step: the whole update behind one `lax.cond`, so a skipped
      # step runs no optimizer and the params come back untouched.
      params, opt_state = apply_gradients(self.tx, grads, self.opt_state, self.params)
      new = self.replace(params=params, opt_state=opt_state, **kwargs)
    applied = find_state(new.opt_state).last_finite

    def keep_old_on_skip(name: str, old: Any, value: Any) -> Any:
      # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
      old_def: Any = jax.tree.structure(old)
      new_def = jax.tree.structure(value)
      if old_def != new_def:
        raise ValueError(
          f"`TrainState.apply_gradients({name}=...)` must keep the tree"
          f" structure of the current `{name}` (a skipped step keeps the"
          f" old value), got {new_def} instead of {old_def}."
        )

      def select(path: Any, v: Any, o: Any) -> Any:
        v, o = jnp.asarray(v), jnp.asarray(o)
        if v.shape != o.shape or v.dtype != o.dtype:
          raise ValueError(
            f"`TrainState.apply_gradients({name}=...)` must keep the shape and"
            f" dtype of every leaf of the current `{name}` (a skipped step"
            f" keeps the old value): at {jax.tree_util.keystr(path)} got"
            f" {v.dtype}{list(v.shape)} instead of {o.dtype}{list(o.shape)}."
          )
        return jax.lax.select(jnp.broadcast_to(applied, v.shape), v, o)

      return jax.tree_util.tree_map_with_path(select, value, old)

    fields = {f.name: f for f in dataclasses.fields(self)}
    kept = {}
    for name, value in kwargs.items():
      if fields.get(name) is not None and fields[name].metadata.get(
        "pytree_node", True
      ):
        kept[name] = keep_old_on_skip(name, getattr(self, name), value)
    old_step = jnp.asarray(self.step, jnp.int32)
    return new.replace(
      step=jnp.where(applied, optax.safe_increment(old_step), old_step),
      # The fused step already returned the old params on a skipped step.
      params=keep_old_on_skip("params", self.params, new.params) if fp8 else new.params,
      **kept,
    )

  @classmethod
  def create(
    cls,
    *,
    apply_fn: Callable[..., Any] | None,
    params: Any,
    tx: optax.GradientTransformation,
    **kwargs: Any,
  ) -> TrainState:
    """Creates a state with `step=0` (int32) and `opt_state = tx.init(params)`.

    Args:
      apply_fn: usually `model.apply`.
      params: the (float32 master) parameters.
      tx: a loss-scaling optimizer, alone or inside an `optax.chain`.
      **kwargs: other fields of a subclass, such as `batch_stats`.

    Returns:
      The new `TrainState`.

    Raises:
      ValueError: when `tx`'s state holds no (or more than one)
        [`lossscale.LossScaleState`][].
    """
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    find_state(state.opt_state)
    return state.replace(step=jnp.zeros([], jnp.int32))

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale, a float32 scalar (one per replica under pmap)."""
    return get_loss_scale(self.opt_state)

  @property
  def skipped_steps(self) -> jax.Array:
    """How many steps were skipped so far (int32)."""
    return find_state(self.opt_state).skipped_steps


def nnx_step(fun: Callable[..., Any], *, has_aux: bool = False) -> Callable[..., Any]:
  """One NNX training step that, on a skipped step, leaves everything as it was.

  `nnx_step(fun)(optimizer, model, *args, **kwargs)` differentiates
  `fun(model, *args, **kwargs)` as [`lossscale.value_and_grad`][] does (the
  loss scaled by the optimizer's scale, the gradients of the model's
  `nnx.Param` variables), applies them with `optimizer.update`, and returns
  the unscaled loss (`(loss, aux)` with `has_aux`). It replaces

  ```python
  loss, grads = ls.value_and_grad(fun)(optimizer, model, *args)
  optimizer.update(model, grads)  # optimizer.update(grads) on Flax 0.10
  ```

  and differs from it only on a skipped step (non-finite gradients): then
  every variable of `model` (parameters, BatchNorm statistics, RNG counts,
  any other `nnx.Variable` that `fun` wrote) and of `optimizer` (its `step`,
  the state of transformations chained before or after the wrapper) comes
  back bit for bit, and only the wrapper's
  [`LossScaleState`][lossscale.LossScaleState] changes (the scale backs off,
  `skipped_steps` grows). So `optimizer.step` counts applied updates only,
  like [`lossscale.flax.TrainState`][]'s `step` and TensorFlow's
  `global_step`. On a finite step the result is that of the two lines above,
  which, with the wrapper's scale divided back out, is the plain NNX step
  (`nnx.value_and_grad` of the loss, then `update` of an optimizer built with
  the bare optax transformation) to rounding.

  Whether the step was applied is the wrapper's `last_finite`, a traced
  value under `nnx.jit`: the old values come back through a select per
  array, with no Python branching, so it works eagerly and under `nnx.jit`.
  Variables that `fun` created, or whose shape, dtype or structure it
  changed (an `nnx.Intermediate` tuple that `sow` appended to; pop those in
  `fun` with `nnx.pop(model, nnx.Intermediate)`), cannot be selected and
  stay as `fun` left them; NNX objects passed in `args` (an `nnx.Rngs`) are
  inputs and are not put back. The select costs one elementwise pass over
  the model's and the optimizer's state.

  Args:
    fun: the loss function, `fun(model, *args, **kwargs)`; returns a real
      floating scalar loss, or `(loss, aux)` when `has_aux`.
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    `step(optimizer, model, *args, **kwargs) -> loss` (or `(loss, aux)`),
    which updates `model` and `optimizer` in place. `optimizer` is an
    `nnx.Optimizer` built with `wrt=nnx.Param` and a `tx` holding exactly
    one loss-scaling wrapper (alone or anywhere in an `optax.chain`); on
    Flax 0.10, whose `nnx.Optimizer` holds its model, `model` must be
    `optimizer.model`.

  Raises:
    TypeError: when `optimizer` is not an `nnx.Optimizer` (a Flax
      `TrainState`, an optax state).
    ValueError: when `optimizer` holds no (or more than one) loss-scaling
      state, or (Flax 0.10, `nnx.ModelAndOptimizer`) holds another model.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import lossscale as ls
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0),
    ...     wrt=nnx.Param)
    >>> step = nnx.jit(ls.flax.nnx_step(lambda m, x: jnp.mean(m(x) ** 2)))
    >>> kernel = model.kernel[...]
    >>> loss = step(optimizer, model, jnp.array([[jnp.inf, 1.0]]))
    >>> bool((model.kernel[...] == kernel).all()), int(optimizer.step[...])
    (True, 0)
    >>> ls.get_loss_scale(optimizer), optimizer.opt_state.skipped_steps[...]
    (Array(4., dtype=float32), Array(1, dtype=int32))
  """
  grad_fn = value_and_grad(fun, has_aux=has_aux)

  def step(optimizer: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    from flax import nnx

    # Fails early with a clear message.
    if not isinstance(find_state(optimizer).loss_scale, nnx.Variable):
      raise TypeError(
        "`nnx_step` needs an `nnx.Optimizer` (its state held in"
        f" `nnx.Variable`s), got {type(optimizer).__name__} instead."
      )
    takes_model = "model" in inspect.signature(type(optimizer).update).parameters
    if not takes_model and getattr(optimizer, "model", model) is not model:
      raise ValueError(
        f"`nnx_step`: this {type(optimizer).__name__} updates the model it"
        " holds (`optimizer.update(grads)`), which is not the `model` given;"
        " pass `optimizer.model`."
      )
    before = [_arrays_by_path(nnx.state(model)), _arrays_by_path(nnx.state(optimizer))]
    out, grads = grad_fn(optimizer, model, *args, **kwargs)
    if takes_model:
      optimizer.update(model, grads)
    else:  # Flax 0.10's nnx.Optimizer, nnx.ModelAndOptimizer
      optimizer.update(grads)
    decided = [_unwrap(v) for v in _variables(find_state(optimizer))]
    applied = jnp.asarray(_unwrap(find_state(optimizer).last_finite), jnp.bool_)
    for node, old in zip((model, optimizer), before, strict=True):
      new, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(node))
      leaves = [_keep_on_skip(applied, x, old.get(path)) for path, x in new]
      nnx.update(node, jax.tree_util.tree_unflatten(treedef, leaves))
    # The wrapper's own state is its decision: the scale and counters move.
    for variable, value in zip(_variables(find_state(optimizer)), decided, strict=True):
      _set_value(variable, value)
    return out

  return step


def _arrays_by_path(state: Any) -> dict[Any, Any]:
  # The arrays now, by path: newer Flax's `nnx.state` holds the live
  # variables, whose values the forward pass replaces.
  return dict(jax.tree_util.tree_flatten_with_path(state)[0])


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _keep_on_skip(applied: jax.Array, new: Any, old: Any) -> Any:
  """`new` on an applied step, `old` on a skipped one, where a select can."""
  if not (_is_array(new) and _is_array(old)):
    return new
  new, old = jnp.asarray(new), jnp.asarray(old)
  if new.shape != old.shape or new.dtype != old.dtype:
    return new
  # `lax.select` takes typed PRNG keys (an RNG stream's key) as they are.
  return jax.lax.select(jnp.broadcast_to(applied, new.shape), new, old)


def _variables(tree: Any) -> list[Any]:
  """The `nnx.Variable`s holding the leaves of an optimizer-state subtree."""
  from flax import nnx

  is_variable = lambda x: isinstance(x, nnx.Variable)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_variable) if is_variable(x)]


def _set_value(variable: Any, value: Any) -> None:
  if hasattr(variable, "set_value"):  # newer Flax: `.value =` is deprecated
    variable.set_value(value)
  else:
    variable.value = value
