"""Coming from Flax `DynamicScale`: converting a checkpoint of that era."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization, traverse_util

from lossscale._rule import is_state, states_in

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
    lambda x: x.inner_state if is_state(x) else x,
    abstract,
    is_leaf=is_state,
  )
  alone = len(jax.tree.leaves(abstract, is_leaf=is_state)) == 1
  unwrapped_def: Any = jax.tree.structure(unwrapped)  # Any: see `_from_tree`
  if alone and unwrapped_def != jax.tree.structure(states[0].inner_state):
    # Stateless transformations beside the wrapper: the inner state alone is
    # accepted too, unless it matches the whole chain's.
    try:
      unwrapped = _match("opt_state", unwrapped, opt_state)
    except ValueError:
      inner = _match("opt_state", states[0].inner_state, opt_state)
      unwrapped = jax.tree.map(
        lambda x: inner if is_state(x) else x,
        abstract,
        is_leaf=is_state,
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
    lambda new, old: counters._replace(inner_state=old) if is_state(new) else old,
    abstract,
    unwrapped,
    is_leaf=is_state,
  )
