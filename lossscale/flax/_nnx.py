"""Flax NNX: one training step that puts everything back on a skipped step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._applied import check_consulted
from lossscale._dtypes import is_array
from lossscale._restore import set_value
from lossscale._scaled_grad import _unwrap, find_state, value_and_grad


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
  inputs and are not put back. A variable holding a Python number comes
  back as the array `nnx.jit` makes of it, eagerly too. The select costs one
  elementwise pass over the model's and the optimizer's state.

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
      state, or one inside another transformation's control flow
      (`optax.MultiSteps(wrapper)`, `optax.apply_if_finite(wrapper)`), which
      does not run on every step, or (Flax 0.10, `nnx.ModelAndOptimizer`)
      holds another model.

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
    # `last_finite` decides what is put back: the wrapper must run every step.
    check_consulted(optimizer.opt_state)
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
      set_value(variable, value)
    return out

  return step


def _arrays_by_path(state: Any) -> dict[Any, Any]:
  # The arrays now, by path: newer Flax's `nnx.state` holds the live
  # variables, whose values the forward pass replaces.
  return dict(jax.tree_util.tree_flatten_with_path(state)[0])


def _keep_on_skip(applied: jax.Array, new: Any, old: Any) -> Any:
  """`new` on an applied step, `old` on a skipped one, where a select can."""
  # A Python number becomes the weakly typed array `nnx.jit` would pass, so
  # an eager step puts it back as a jitted one does.
  new, old = _as_array(new), _as_array(old)
  if not (is_array(new) and is_array(old)):
    return new
  new, old = jnp.asarray(new), jnp.asarray(old)
  if new.shape != old.shape or new.dtype != old.dtype:
    return new
  # `lax.select` takes typed PRNG keys (an RNG stream's key) as they are.
  return jax.lax.select(jnp.broadcast_to(applied, new.shape), new, old)


def _as_array(x: Any) -> Any:
  if isinstance(x, (bool, int, float, complex)):
    try:
      return jnp.asarray(x)
    except OverflowError:  # an int beyond int32: `nnx.jit` refuses it too
      return x
  return x


def _variables(tree: Any) -> list[Any]:
  """The `nnx.Variable`s holding the leaves of an optimizer-state subtree."""
  from flax import nnx

  is_variable = lambda x: isinstance(x, nnx.Variable)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_variable) if is_variable(x)]
