"""Flax NNX: one training step that puts everything back on a skipped step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._applied import check_consulted
from lossscale._metrics import step_metrics, unscale_gradients
from lossscale._restore import set_value
from lossscale._scaled_grad import _unwrap, find_state, value_and_grad
from lossscale._unscale import is_array, is_inexact
from lossscale._wrapper import choose


def nnx_step(
  fun: Callable[..., Any],
  *,
  has_aux: bool = False,
  with_metrics: bool = False,
  pass_loss: bool = False,
) -> Callable[..., Any]:
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
  any other `nnx.Variable` that `fun` wrote), of `optimizer` (its `step`,
  the state of transformations chained before or after the wrapper) and of
  every NNX object among `args` and `kwargs` (an `nnx.Rngs` passed to `fun`,
  another module, an `nnx.Variable`, also inside a list, tuple or dict)
  comes back bit for bit, and only the wrapper's
  [`LossScaleState`][lossscale.LossScaleState] changes (the scale backs off,
  `skipped_steps` grows). So `optimizer.step` counts applied updates only,
  like [`lossscale.flax.TrainState`][]'s `step` and TensorFlow's
  `global_step`, and an `nnx.Rngs` counts the same draws whether the layers
  hold it or `fun` is given it. On a finite step the result is that of the
  two lines above, which, with the wrapper's scale divided back out, is the
  plain NNX step (`nnx.value_and_grad` of the loss, then `update` of an
  optimizer built with the bare optax transformation) to rounding.

  Whether the step was applied is the wrapper's `last_applied`, a traced
  value under `nnx.jit`: the old values come back through the one choice
  every skipped step makes (a conditional over every array, decided in
  Python where the flag is concrete), so it works eagerly and under
  `nnx.jit`.
  Variables that `fun` created, or whose shape, dtype or structure it
  changed (an `nnx.Intermediate` tuple that `sow` appended to; pop those in
  `fun` with `nnx.pop(model, nnx.Intermediate)`), cannot be selected and
  stay as `fun` left them. A variable holding a Python number comes back as
  the array `nnx.jit` makes of it, eagerly too. The choice costs at most
  one elementwise pass over the state of the model, the optimizer and the
  NNX objects passed.

  With `with_metrics=True` the step also returns what to log (what a linen
  step computes by hand, docs: Flax): the dict of
  [`lossscale.step_metrics`][] (read after the update: the next step's
  scale, whether this step was applied, the skipped steps) and
  `"grad_norm"`, the global L2 norm of the unscaled gradients, in float32.
  It is computed from the gradients of the scaled loss and the scale the
  loss was multiplied by (the scale before the update, which may change
  it), unscaled as the wrapper unscales them for its inner optimizer
  ([`lossscale.unscale_gradients`][]); on a skipped step it is inf or NaN.

  Args:
    fun: the loss function, `fun(model, *args, **kwargs)`; returns a real
      floating scalar loss, or `(loss, aux)` when `has_aux`.
    has_aux: whether `fun` returns `(loss, aux)`.
    with_metrics: whether the step also returns its metrics.
    pass_loss: hand the unscaled loss to the optimizer as optax's `value=`
      (`optimizer.update(model, grads, value=loss)`): a non-finite loss then
      skips the step without backing the scale off, and
      [`lossscale.SkipSpikes`][] can test it ([Skipping bad
      steps][skipping-bad-steps]).

  Returns:
    `step(optimizer, model, *args, **kwargs) -> loss` (or `(loss, aux)`),
    which updates `model` and `optimizer` in place; with `with_metrics`,
    `-> (loss, metrics)` (or `((loss, aux), metrics)`), `metrics` a dict of
    scalar arrays: those of [`lossscale.step_metrics`][] (the scale,
    whether the step was applied, the skips so far, in a row and by
    reason, and why this one was skipped) and `"grad_norm"`. `optimizer` is an
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

    With the metrics: the gradients of `(x @ w + b - 1) ** 2` at zero
    weights are `-2 * x` and `-2`, of norm 6 for `x = [2, 2]`.

    >>> model = nnx.Linear(2, 1, kernel_init=nnx.initializers.zeros_init(),
    ...                    rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, ls.dynamic_loss_scale(optax.sgd(0.1)),
    ...                           wrt=nnx.Param)
    >>> step = ls.flax.nnx_step(lambda m, x: jnp.mean((m(x) - 1.0) ** 2),
    ...                         with_metrics=True)
    >>> loss, metrics = step(optimizer, model, jnp.array([[2.0, 2.0]]))
    >>> print(metrics["grad_norm"], metrics["applied"], metrics["skipped_steps"])
    6.0 True 0
  """
  # `args` and `kwargs` travel as two positional arguments: NNX's
  # `nnx.value_and_grad` then carries what `fun` writes to an NNX object among
  # them (an `nnx.Rngs` passed by keyword too) out of its trace.
  grad_fn = value_and_grad(
    lambda model, args, kwargs: fun(model, *args, **kwargs), has_aux=has_aux
  )

  def step(optimizer: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    from flax import nnx

    takes_model = _check_optimizer(optimizer, model)
    nodes, variables = _objects_to_restore(model, optimizer, args, kwargs)
    before = [_arrays_by_path(nnx.state(node)) for node in nodes]
    before_values = [_unwrap(variable) for variable in variables]
    out, grads = grad_fn(optimizer, model, args, kwargs)
    if with_metrics:  # the scale the loss was multiplied by: before the update
      grad_norm = _global_norm(unscale_gradients(grads, optimizer))
    extra = {"value": out[0] if has_aux else out} if pass_loss else {}
    if takes_model:
      optimizer.update(model, grads, **extra)
    else:  # Flax 0.10's nnx.Optimizer, nnx.ModelAndOptimizer
      optimizer.update(grads, **extra)
    decided = [_unwrap(v) for v in _variables(find_state(optimizer))]
    applied = jnp.asarray(_unwrap(find_state(optimizer).last_applied), jnp.bool_)
    _put_back_on_skip(applied, nodes, before, variables, before_values)
    # The wrapper's own state is its decision: the scale and counters move.
    for variable, value in zip(_variables(find_state(optimizer)), decided, strict=True):
      set_value(variable, value)
    if not with_metrics:
      return out
    return out, {**step_metrics(optimizer), "grad_norm": grad_norm}

  return step


def _check_optimizer(optimizer: Any, model: Any) -> bool:
  """Fails early with a clear message; returns whether `optimizer.update`
  takes the model (Flax 0.11 and newer)."""
  from flax import nnx

  if not isinstance(find_state(optimizer).loss_scale, nnx.Variable):
    raise TypeError(
      "`nnx_step` needs an `nnx.Optimizer` (its state held in"
      f" `nnx.Variable`s), got {type(optimizer).__name__} instead."
    )
  # `last_applied` decides what is put back: the wrapper must run every step.
  check_consulted(optimizer.opt_state)
  takes_model = "model" in inspect.signature(type(optimizer).update).parameters
  if not takes_model and getattr(optimizer, "model", model) is not model:
    raise ValueError(
      f"`nnx_step`: this {type(optimizer).__name__} updates the model it"
      " holds (`optimizer.update(grads)`), which is not the `model` given;"
      " pass `optimizer.model`."
    )
  return takes_model


def _objects_to_restore(
  model: Any, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[Any], list[Any]]:
  """The graph nodes whose state a skipped step puts back (the model, the
  optimizer, then every NNX object among `args` and `kwargs`, each once),
  and the `nnx.Variable`s passed there on their own (which `nnx.state`
  does not take)."""
  from flax import nnx

  is_variable = lambda x: isinstance(x, nnx.Variable)
  is_object = lambda x: is_variable(x) or nnx.graph.is_graph_node(x)
  nodes: list[Any] = [model, optimizer]
  variables: list[Any] = []
  seen = {id(model), id(optimizer)}
  for x in jax.tree.leaves((args, kwargs), is_leaf=is_object):
    if is_object(x) and id(x) not in seen:
      seen.add(id(x))
      (variables if is_variable(x) else nodes).append(x)
  return nodes, variables


def _global_norm(tree: Any) -> jax.Array:
  """The global L2 norm of the floating leaves of `tree`, in float32."""
  total = jnp.zeros((), jnp.float32)
  for x in jax.tree.leaves(tree):
    if is_inexact(x):
      x = jnp.abs(x).astype(jnp.float32)
      total = total + jnp.sum(x * x)
  return jnp.sqrt(total)


def _arrays_by_path(state: Any) -> dict[Any, Any]:
  # The arrays now, by path: newer Flax's `nnx.state` holds the live
  # variables, whose values the forward pass replaces.
  return dict(jax.tree_util.tree_flatten_with_path(state)[0])


def _put_back_on_skip(applied, nodes, before, variables, before_values) -> None:
  """Writes the values the step started from back into `nodes` (graph
  nodes, their arrays `before` by path) and `variables` (`before_values`)
  where the step was skipped, by the one choice every step makes
  (`lossscale/_wrapper.py`'s `choose`), for every array at once. What a
  choice cannot take (a new variable, another shape or dtype) stays as
  the step left it."""
  from flax import nnx

  news = [jax.tree_util.tree_flatten_with_path(nnx.state(n)) for n in nodes]
  pairs = [
    (x, old.get(path))
    for (leaves, _), old in zip(news, before, strict=True)
    for path, x in leaves
  ]
  pairs += [(_unwrap(v), old) for v, old in zip(variables, before_values, strict=True)]
  # A Python number becomes the weakly typed array `nnx.jit` would pass, so
  # an eager step puts it back as a jitted one does.
  pairs = [(_as_array(n), _as_array(o)) for n, o in pairs]
  fits = [
    is_array(n)
    and is_array(o)
    and jnp.shape(n) == jnp.shape(o)
    and jnp.result_type(n) == jnp.result_type(o)
    for n, o in pairs
  ]
  chosen = [
    (jnp.asarray(n), jnp.asarray(o)) for (n, o), f in zip(pairs, fits, strict=True) if f
  ]
  kept = iter(
    choose(
      applied,
      lambda: [n for n, _ in chosen],
      lambda: [o for _, o in chosen],
      operands=chosen,
    )
  )
  values = iter([next(kept) if f else n for (n, _), f in zip(pairs, fits, strict=True)])
  for node, (leaves, treedef) in zip(nodes, news, strict=True):
    new = [next(values) for _ in leaves]
    nnx.update(node, jax.tree_util.tree_unflatten(treedef, new))
  for variable in variables:
    set_value(variable, next(values))


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
