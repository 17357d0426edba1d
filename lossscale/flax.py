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
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
  from flax import serialization, traverse_util
  from flax.training import train_state
  from flax.training.train_state import OVERWRITE_WITH_GRADIENT
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
    "lossscale.flax needs Flax, an optional dependency: install it with"
    " `pip install 'lossscale[flax]'` (or `pip install flax`)."
  ) from e

from lossscale._applied import check_consulted
from lossscale._finite import is_array
from lossscale._fused import apply_gradients
from lossscale._loss_scale import _is_state, states_in
from lossscale._scaled_grad import (
  _set_value,
  _unwrap,
  find_state,
  get_loss_scale,
  value_and_grad,
)

__all__ = ["TrainState", "from_dynamic_scale", "nnx_step"]


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
        no (or more than one) loss-scaling state, or one inside another
        transformation's control flow (`optax.MultiSteps(wrapper)`), which
        does not run on every step.
    """
    find_state(self.opt_state)  # Fails early with a clear message.
    check_consulted(self.opt_state)  # `last_finite`, read below, is current.
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
      _set_value(variable, value)
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


_FROM = "lossscale.flax.from_dynamic_scale"


def _spec(x: Any) -> str:
  return f"{np.dtype(x.dtype).name}{list(x.shape)}"


def _leaf(name: str, where: str, value: Any, like: Any) -> jax.Array:
  """`value` as an array, if it has the shape and dtype of `like` (a spec).

  A float16 `value` where `like` is float32 is widened: the wrapper gives
  float16 parameters a float32 inner state, where the Flax run's optax state
  was float16 (float16 -> float32 is exact).
  """
  if isinstance(value, (bool, int, float)) and like.shape == ():
    # A Python number, as a checkpoint may hold a scalar: exact only.
    as_array = np.asarray(value, like.dtype)
    if as_array.item() == value:
      value = as_array
  if not hasattr(value, "dtype"):
    value = np.asarray(value)
  if tuple(np.shape(value)) != tuple(like.shape):
    stacked = tuple(np.shape(value))[1:] == tuple(like.shape)
    raise ValueError(
      f"`{_FROM}({name}=...)`: at {where} expected {_spec(like)}, got"
      f" {_spec(value)}. The old state must have the shapes of the new"
      " optimizer's"
      + (
        ": pass one replica's state (`jax.tree.map(lambda x: x[0], state)`),"
        " not a pmap-stacked one."
        if stacked
        else ", built for the same parameters."
      )
    )
  dtype, want = np.dtype(value.dtype), np.dtype(like.dtype)
  if dtype == np.float16 and want == np.float32:
    return jnp.asarray(value, jnp.float32)
  if dtype != want:
    raise ValueError(
      f"`{_FROM}({name}=...)`: at {where} expected {_spec(like)}, got"
      f" {_spec(value)}. The old state must have the dtypes of the new"
      " optimizer's; only float16 is converted (widened to float32, where the"
      " wrapper keeps float16 parameters' state)."
    )
  return jnp.asarray(value)


def _from_state_dict(name: str, template: Any, state: Mapping[str, Any]) -> Any:
  """`template` filled from a restored state dict; every key must match."""
  sep = "/"
  # Empty nodes (`optax.EmptyState`) hold nothing; a checkpoint may store
  # them as `{}` or as None.
  expected = traverse_util.flatten_dict(serialization.to_state_dict(template))
  expected = {k: v for k, v in expected.items() if v is not None}
  given = traverse_util.flatten_dict(state)
  given = {k: v for k, v in given.items() if v is not None}
  missing = sorted(sep.join(k) for k in expected.keys() - given.keys())
  unexpected = sorted(sep.join(k) for k in given.keys() - expected.keys())
  if missing or unexpected:
    raise ValueError(
      f"`{_FROM}({name}=...)` does not have the keys of the new optimizer's"
      f" state: missing {missing[:8]}, unexpected {unexpected[:8]}. Pass the"
      " state of the optimizer the loss-scaling wrapper wraps (the Flax run's"
      " `tx`), built for the same parameters."
    )
  values = {k: _leaf(name, sep.join(k), given[k], like) for k, like in expected.items()}

  def fill(node: Any, path: tuple[str, ...]) -> Any:
    if isinstance(node, Mapping):
      return {k: fill(v, (*path, k)) for k, v in node.items()}
    return values.get(path, node)

  return serialization.from_state_dict(
    template, fill(serialization.to_state_dict(template), ())
  )


def _from_tree(name: str, template: Any, tree: Any) -> Any:
  """`tree`, an optax state, checked against `template` (specs)."""
  # `Any`: jaxlib 0.10 ships no stubs for PyTreeDef, which mypy cannot compare.
  old_def: Any = jax.tree.structure(tree)
  new_def = jax.tree.structure(template)
  if old_def != new_def:
    raise ValueError(
      f"`{_FROM}({name}=...)` does not have the tree structure of the new"
      f" optimizer's state: got {old_def}, expected {new_def}. Pass the state"
      " of the optimizer the loss-scaling wrapper wraps (the Flax run's `tx`)."
    )
  return jax.tree_util.tree_map_with_path(
    lambda path, v, like: _leaf(name, jax.tree_util.keystr(path), v, like),
    tree,
    template,
  )


def _match(name: str, template: Any, old: Any) -> Any:
  old_def: Any = jax.tree.structure(old)  # Any: see `_from_tree`
  if old_def == jax.tree.structure(template):
    return _from_tree(name, template, old)
  # A restored state dict: namedtuples as dicts of fields, tuples and lists
  # (orbax restores a chain's state as a list) as dicts keyed "0", "1", ...
  as_dict = serialization.to_state_dict(old)
  if isinstance(as_dict, Mapping):
    return _from_state_dict(name, template, as_dict)
  return _from_tree(name, template, old)


def _dynamic_scale_fields(dynamic_scale: Any) -> tuple[Any, Any]:
  """`(scale, fin_steps)` of a `DynamicScale` or of its state dict."""
  name = "dynamic_scale"
  if isinstance(dynamic_scale, Mapping):
    keys = set(dynamic_scale)
    if keys != {"scale", "fin_steps"}:
      raise ValueError(
        f"`{_FROM}({name}=...)` as a state dict must have exactly the keys"
        f" 'scale' and 'fin_steps' (Flax's DynamicScale), got {sorted(keys)}."
      )
    return dynamic_scale["scale"], dynamic_scale["fin_steps"]
  if hasattr(dynamic_scale, "scale") and hasattr(dynamic_scale, "fin_steps"):
    return dynamic_scale.scale, dynamic_scale.fin_steps
  raise ValueError(
    f"`{_FROM}({name}=...)` must be a flax.training.dynamic_scale.DynamicScale,"
    f" its state dict {{'scale': ..., 'fin_steps': ...}} or None, got"
    f" {type(dynamic_scale).__name__}."
  )


def _scale(value: Any) -> float:
  name = "dynamic_scale"
  array = np.asarray(value)
  ok = array.shape == () and (
    np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
  )
  if ok:
    with np.errstate(over="ignore", under="ignore"):
      scale = float(np.float32(array))
    ok = math.isfinite(scale) and scale >= float(np.finfo(np.float32).tiny)
  if not ok:
    raise ValueError(
      f"`{_FROM}({name}=...)`: `scale` must be a positive normal finite"
      f" float32 scalar (2**-126 to the float32 maximum), got {value!r}."
    )
  return scale


def _fin_steps(value: Any) -> int:
  name = "dynamic_scale"
  array = np.asarray(value)
  if (
    array.shape != ()
    or not np.issubdtype(array.dtype, np.integer)
    or not 0 <= int(array) <= 2**31 - 1
  ):
    raise ValueError(
      f"`{_FROM}({name}=...)`: `fin_steps` must be an integer scalar in"
      f" [0, 2**31 - 1], got {value!r}."
    )
  return int(array)


def from_dynamic_scale(
  *,
  dynamic_scale: Any,
  opt_state: Any,
  tx: optax.GradientTransformation,
  params: Any,
) -> optax.OptState:
  """The state of `tx` that continues a run of Flax's `DynamicScale`.

  Flax's `DynamicScale` keeps the scale beside the optimizer, in a
  `dynamic_scale` field of the `TrainState`; a loss-scaling wrapper keeps it
  in its [`LossScaleState`][lossscale.LossScaleState]. This returns the state
  `tx.init(params)` would, with the old run's values in it: the wrapper's
  `inner_state` is `opt_state` (momentum, Adam's moments and count, bit for
  bit), `loss_scale` is the `DynamicScale`'s `scale` (float32) and
  `good_steps` its `fin_steps` (int32). `DynamicScale` grows its scale one
  step late, on the `(growth_interval + 1)`-th finite step; a wrapper built
  with `growth_interval=` Flax's `+ 1` (and Flax's bounds, `min_scale`
  float32 tiny and `max_scale` float32 max) then continues the old run's
  scale and skip trajectory exactly. The other counters start afresh
  (`hysteresis_left` full, no skipped steps, `last_finite` True): Flax did
  not count them. A `scale` outside the wrapper's `[min_scale, max_scale]`
  is kept as it is; the wrapper's steps then bring it into its range.

  float16 parameters: the wrapper keeps their optimizer state in float32
  (float16 moments underflow), where the Flax run's optax state was float16;
  each float16 leaf of `opt_state` is widened to the float32 that
  `tx.init(params)` has there (exactly: nothing is lost). No other dtype is
  converted.

  Run it outside `jax.jit`, on an unreplicated state (one replica's, as
  Flax's examples save it); replicate the result as before.

  Args:
    dynamic_scale: the Flax `DynamicScale`, or its state dict as a checkpoint
      restored without a target (`{"scale": ..., "fin_steps": ...}`), or
      None for a run without one (the wrapper's initial scale is kept).
    opt_state: the old optimizer state, of the optimizer the wrapper wraps:
      an optax state, or its state dict as restored without a target
      (`flax.training.checkpoints.restore_checkpoint(dir, None)`,
      `flax.serialization.msgpack_restore`). When `tx` chains other
      transformations with the wrapper, the old state of the whole chain
      with the wrapper's inner optimizer in the wrapper's place, or, if the
      others hold no arrays (`cross_shard_mean`, `optax.clip`), the inner
      optimizer's state alone.
    tx: the new optimizer: one `dynamic_loss_scale` wrapper, alone or
      inside an `optax.chain`. A wrapper with another configuration
      (`enabled=False`, `skip_nonfinite`, other bounds) takes the carried-over
      scale too: its first step divides by it, then the scale is one its own
      configuration allows.
    params: the parameters `tx` is initialized with (only their shapes and
      dtypes are read).

  Returns:
    The optimizer state for `tx`, with the structure of `tx.init(params)`.

  Raises:
    ValueError: when `opt_state` does not have the structure, shapes and
      dtypes of the wrapped optimizer's state (with the paths that differ;
      float16 where it has float32 is widened, not an error),
      when `scale` is not a positive normal finite float32 scalar or
      `fin_steps` not a non-negative integer scalar, or when `tx` holds no
      (or more than one) loss-scaling wrapper.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from flax.training.dynamic_scale import DynamicScale
    >>> import lossscale as ls
    >>> params = {"w": jnp.ones(2)}
    >>> old_tx = optax.sgd(0.1, momentum=0.9)  # the Flax run's optimizer
    >>> old = old_tx.init(params)
    >>> ds = DynamicScale(growth_interval=100, fin_steps=7, scale=1024.0)
    >>> tx = ls.dynamic_loss_scale(old_tx, growth_interval=101)
    >>> state = ls.flax.from_dynamic_scale(
    ...     dynamic_scale=ds, opt_state=old, tx=tx, params=params)
    >>> state.loss_scale, state.good_steps
    (Array(1024., dtype=float32), Array(7, dtype=int32))
  """
  abstract = jax.eval_shape(tx.init, params)
  states = states_in(abstract)
  if len(states) != 1:
    raise ValueError(
      f"`{_FROM}(tx=...)` must hold exactly one loss-scaling wrapper"
      f" (dynamic_loss_scale), found {len(states)}."
    )
  # The state the Flax run had: each LossScaleState replaced by its inner one.
  unwrapped = jax.tree.map(
    lambda x: x.inner_state if _is_state(x) else x,
    abstract,
    is_leaf=_is_state,
  )
  alone = len(jax.tree.leaves(abstract, is_leaf=_is_state)) == 1
  unwrapped_def: Any = jax.tree.structure(unwrapped)  # Any: see `_from_tree`
  if alone and unwrapped_def != jax.tree.structure(states[0].inner_state):
    # Stateless transformations beside the wrapper: the inner state alone is
    # accepted too, unless it matches the whole chain's.
    try:
      unwrapped = _match("opt_state", unwrapped, opt_state)
    except ValueError:
      inner = _match("opt_state", states[0].inner_state, opt_state)
      unwrapped = jax.tree.map(
        lambda x: inner if _is_state(x) else x,
        abstract,
        is_leaf=_is_state,
      )
  else:
    unwrapped = _match("opt_state", unwrapped, opt_state)

  # The wrapper's initial counters, without building its inner state.
  counters = jax.jit(lambda p: states_in(tx.init(p))[0]._replace(inner_state=()))(
    params
  )
  if dynamic_scale is not None:
    scale, fin_steps = _dynamic_scale_fields(dynamic_scale)
    counters = counters._replace(
      loss_scale=jnp.asarray(_scale(scale), jnp.float32),
      good_steps=jnp.asarray(_fin_steps(fin_steps), jnp.int32),
    )
  return jax.tree.map(
    lambda new, old: counters._replace(inner_state=old) if _is_state(new) else old,
    abstract,
    unwrapped,
    is_leaf=_is_state,
  )
