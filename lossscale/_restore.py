"""Editing a state between steps: restarting the scale, upgrading old layouts.

`set_loss_scale` restarts the scale of a restored (or stalled) state;
`upgrade_state` converts a state saved with an earlier layout of
`LossScaleState`. Both build each new leaf where the state already lives
(its shape, sharding and, for a replaced leaf, its dtype and weak type), so
a state spread over the devices of several processes stays one global
array that orbax can save.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _checks
from lossscale._rule import (
  SKIP_REASONS,
  LossScaleState,
  SkipSpikes,
  SpikeWindow,
  is_state,
)
from lossscale._scaled_grad import _unwrap, find_state

T = TypeVar("T")

# What a restart leaves in the counters: the rule starts over from the new
# scale (a full hysteresis, no run of good steps, no overflow counted at
# the floor), while the totals (`skipped_steps`) and the last step's flags
# are history and stay.
_RESTARTED = dict(
  good_steps=0,
  # Full: the rule reads at most the wrapper's own `hysteresis` from it.
  hysteresis_left=_checks.INT32_MAX,
  consecutive_skips=0,
  steps_since_rescale=0,
  overflows_since_backoff=0,
  overflows_at_min_scale=0,
)


def set_value(variable: Any, value: Any) -> None:
  """Sets an `nnx.Variable`'s value (`_unwrap`'s other half)."""
  if hasattr(variable, "set_value"):  # newer Flax: `.value =` is deprecated
    variable.set_value(value)
  else:
    variable.value = value


def _is_pmap_sharding(sharding: Any) -> bool:
  # Outputs of `jax.pmap` before JAX implemented it with `shard_map`.
  pmap_sharding = getattr(jax.sharding, "PmapSharding", None)
  return pmap_sharding is not None and isinstance(sharding, pmap_sharding)


def filled_like(leaf: Any, value: float, dtype: Any = None, more: tuple = ()) -> Any:
  """`value` where `leaf` is: its shape (and the trailing dimensions `more`)
  and placement, and its dtype and weak type (`dtype` None) or the strongly
  typed `dtype`.

  A concrete `jax.Array` keeps its sharding: each process builds only its
  own devices' shards, with no communication. A traced leaf (inside
  `jax.jit`) is filled by `lax.full`; a NumPy leaf gives a NumPy array; a
  Python number a `dtype` array (float32 without one).
  """
  if isinstance(leaf, jax.core.Tracer):
    if not more:
      return jax.lax.full_like(leaf, value, dtype)
    return jax.lax.full((*leaf.shape, *more), value, dtype)
  if not hasattr(leaf, "dtype"):
    return jnp.full((*np.shape(leaf), *more), value, dtype or jnp.float32)
  keep = dtype is None
  dtype = np.dtype(leaf.dtype if keep else dtype)
  if more and isinstance(leaf, jax.Array) and _is_pmap_sharding(leaf.sharding):
    # A pmap sharding is made for one shape: the new leaf is made by pmap.
    # Its devices in the sharding's order (a set would lose it).
    sharding: Any = leaf.sharding  # a PmapSharding: `devices` is an array
    devices = list(sharding.devices.flat)
    fill = jax.pmap(lambda x: jnp.full(more, value, dtype), devices=devices)
    return (
      fill(leaf) if leaf.ndim == 1 else jnp.full((*leaf.shape, *more), value, dtype)
    )
  host = np.full((*leaf.shape, *more), value, dtype)
  if host.size and host.flat[0] != value:  # a hand-built state of another dtype
    raise ValueError(
      f"`set_loss_scale(loss_scale=...)`: {value!r} is not exactly"
      f" representable in the state's {dtype.name} leaf (a loss scale is float32)."
    )
  if not isinstance(leaf, jax.Array):
    return host
  if keep and leaf.weak_type and not _is_pmap_sharding(leaf.sharding):
    # `make_array_from_callback` builds strongly typed arrays.
    fill = jax.jit(
      lambda old: jax.lax.full_like(old, value), out_shardings=leaf.sharding
    )
    return fill(leaf)
  return jax.make_array_from_callback(host.shape, leaf.sharding, lambda i: host[i])


def set_loss_scale(x: T, loss_scale: float) -> T:
  """Returns `x` with its loss scale restarted at `loss_scale`.

  The one-liner to restart the scale of a restored state, for example when a
  run that trained with `enabled=False` (scale 1) is resumed with loss
  scaling switched on, or a run stopped at its minimum scale
  ([`lossscale.check_not_stalled`][]`(at_min_scale=True)`, DeepSpeed's stop)
  is resumed:

  ```python
  opt_state = lossscale.set_loss_scale(opt_state, 2.0**15)
  ```

  A restart means the rule starts over from the new scale, as from a fresh
  state: `good_steps`, `consecutive_skips`, `steps_since_rescale`,
  `overflows_since_backoff` and `overflows_at_min_scale` become 0 (so
  `check_not_stalled` no longer sees the stop), and `hysteresis_left` is
  full (set to the int32 maximum, which the next step reads as the
  wrapper's own `hysteresis`). The total `skipped_steps`, the last step's
  flags and the inner optimizer's state are kept. The wrapper unscales by
  the scale in the state it is given, so the next step is right whatever
  the scale was ([Resuming with another
  configuration][resuming-with-another-configuration]).

  Each replaced array keeps its shape, dtype, weak type and sharding: a
  state replicated by `jax.pmap` (a leading device axis) or batched by
  `jax.vmap` (one scale per member) keeps its shape, and a state sharded
  over a mesh, across the devices of several processes included, stays one
  global array that orbax can save. Each process builds only its own
  devices' part; call it on every process, as the step is.

  Args:
    x: an optimizer state with a [`lossscale.LossScaleState`][] nested
      anywhere inside, a [`lossscale.flax.TrainState`][] (or any Flax struct
      with an `opt_state`), or an `nnx.Optimizer` (changed in place).
    loss_scale: the new scale, a normal float32 (`>= 2**-126`).

  Returns:
    A copy of `x` with the new scale (the `nnx.Optimizer` itself, changed in
    place). Under `jax.vmap` every member gets the same scale.

  Raises:
    ValueError: for an invalid `loss_scale`, or when `x` does not hold
      exactly one `LossScaleState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> off = ls.dynamic_loss_scale(optax.sgd(0.1), enabled=False)
    >>> state = off.init({"w": jnp.zeros(2)})  # a float32 run's state
    >>> state = ls.set_loss_scale(state, 2.0**15)  # resumed in float16
    >>> ls.get_loss_scale(state)
    Array(32768., dtype=float32)
  """
  if isinstance(loss_scale, jax.core.Tracer):
    raise ValueError(
      "`set_loss_scale(loss_scale=...)` must be a concrete number (it is"
      " checked to be a normal float32 on the host), got a traced value. Pass"
      " a Python float; inside `jax.jit`, close over it."
    )
  scale = _checks.float32_scale("set_loss_scale", "loss_scale", loss_scale)
  state = find_state(x)
  values = dict(_RESTARTED, loss_scale=scale)
  new = {k: filled_like(_unwrap(getattr(state, k)), v) for k, v in values.items()}
  if _unwrap(state.loss_scale) is not state.loss_scale:  # NNX Variables: in place
    for name, value in new.items():
      set_value(getattr(state, name), value)
    return x

  replace = lambda node: node._replace(**new) if is_state(node) else node
  tree = getattr(x, "opt_state", x)
  tree = jax.tree.map(replace, tree, is_leaf=is_state)
  if tree is not x and hasattr(x, "opt_state"):
    return x.replace(opt_state=tree)  # type: ignore[attr-defined]
  return tree


# The values a field takes in a state saved before it existed: a fresh
# state's.
_FRESH = dict(
  good_steps=(jnp.int32, 0, ()),
  hysteresis_left=(jnp.int32, 1, ()),
  skipped_steps=(jnp.int32, 0, ()),
  consecutive_skips=(jnp.int32, 0, ()),
  last_finite=(jnp.bool_, True, ()),
  last_applied=(jnp.bool_, True, ()),
  steps_since_rescale=(jnp.int32, 0, ()),
  overflows_since_backoff=(jnp.int32, 0, ()),
  overflows_at_min_scale=(jnp.int32, 0, ()),
  last_skip_reason=(jnp.int32, 0, ()),
  skips_by_reason=(jnp.int32, 0, (len(SKIP_REASONS),)),
)


def _is_earlier_layout(x: Any) -> bool:
  """A NamedTuple with a subset of `LossScaleState`'s fields, `loss_scale`
  and `inner_state` among them, that is not a `LossScaleState`."""
  fields = getattr(x, "_fields", None)
  return (
    isinstance(x, tuple)
    and not is_state(x)
    and fields is not None
    and {"loss_scale", "inner_state"} <= set(fields) < set(LossScaleState._fields)
  )


def _resized(window: SpikeWindow, width: int) -> SpikeWindow:
  """`window` holding `width` values: its newest ones, oldest first, counted
  as all it has seen (a window that shrinks or grows warms up again where
  it holds fewer values than the warm-up asks)."""
  seen = window.seen[..., None]
  kept = jnp.minimum(jnp.minimum(seen, window.values.shape[-1]), width)
  k = jnp.arange(width)
  slot = jnp.where(k < kept, (seen - kept + k) % window.values.shape[-1], 0)
  values = jnp.take_along_axis(window.values, slot, axis=-1)
  return SpikeWindow(jnp.where(k < kept, values, 0.0), kept[..., 0])


def _upgraded(old: Any, spikes: SkipSpikes | None) -> Any:
  window: Any = getattr(old, "spike_window", ())
  width = window.values.shape[-1] if isinstance(window, SpikeWindow) else None
  if is_state(old) and spikes is not None and width not in (None, spikes.window):
    return old._replace(spike_window=_resized(window, spikes.window))
  if is_state(old) and (spikes is None or isinstance(window, SpikeWindow)):
    return old  # current, and nothing to add
  values = old._asdict()
  if "last_finite" in values and "last_applied" not in values:
    # Before `last_applied` existed, `last_finite` said whether the step was
    # applied (the gradients' finiteness was the only reason to skip).
    values["last_applied"] = values["last_finite"]
  like = values.get("good_steps", values["loss_scale"])
  fresh = {
    name: filled_like(like, fill, dtype, more)
    for name, (dtype, fill, more) in _FRESH.items()
    if name not in values
  }
  if spikes is not None and not isinstance(values.get("spike_window"), SpikeWindow):
    width = spikes.window
    values["spike_window"] = SpikeWindow(
      filled_like(like, 0.0, jnp.float32, (2, width)),
      filled_like(like, 0, jnp.int32, (2,)),
    )
  return LossScaleState(**(fresh | dict(spike_window=()) | values))


def upgrade_state(tree: Any, *, skip_spikes: SkipSpikes | None = None) -> Any:
  """Converts the loss-scaling states of an earlier layout in `tree`.

  [`lossscale.LossScaleState`][] gained fields over time: `last_finite` after
  lossscale 0.1.0, then `steps_since_rescale`, `overflows_since_backoff` and
  `overflows_at_min_scale`, then `last_applied` (whether the step was
  applied, which `last_finite` used to say: it is copied from there), then
  `last_skip_reason`, `skips_by_reason` and `spike_window`. A checkpoint
  written before does not restore into the new structure: restore it into a
  NamedTuple with the fields it was written with (in their order) and pass
  the result here. Every such NamedTuple in `tree` (nested in a chain or a
  `TrainState` too) becomes a `LossScaleState` with its values, and with
  the fields it lacks as a fresh state holds them (`last_finite` True, the
  new counters 0: the skips of an earlier version are counted in
  `skipped_steps` only), placed like its `good_steps`: the same shape (a
  batched state stays batched) and sharding (a state replicated over a
  mesh, or over the devices of several processes, stays so, and orbax can
  save it). A `tree` that already holds current states only is returned
  as it is, unless `skip_spikes` is given.
  [Checkpointing][checkpoints-written-by-earlier-versions] has the orbax
  recipe.

  Args:
    tree: a pytree holding states of an earlier layout: NamedTuples whose
      fields are some of `LossScaleState`'s, `loss_scale` and `inner_state`
      among them.
    skip_spikes: the [`lossscale.SkipSpikes`][] of the wrapper the state is
      to step with: every state in `tree` without a spike window (an earlier
      layout, or one from a wrapper without the option) gets an empty one,
      so the option can be switched on for a restored run; a window of
      another width is resized to `skip_spikes.window`, keeping its newest
      values (and counting only those as seen, for the warm-up).

  Returns:
    `tree` with each of those replaced by a `LossScaleState`.

  Raises:
    ValueError: when `tree` holds no loss-scaling state, of an earlier layout
      or the current one (a dict restored without a target, say: restore it
      into the NamedTuple it was saved from).

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
  found = lambda x: _is_earlier_layout(x) or is_state(x)
  if not any(found(x) for x in jax.tree.leaves(tree, is_leaf=found)):
    raise ValueError(
      "`upgrade_state(tree=...)` must hold a loss-scaling state: a"
      " lossscale.LossScaleState, or a NamedTuple with some of its fields"
      " (`loss_scale` and `inner_state` among them) as an earlier version"
      f" saved it; got a {type(tree).__name__} holding neither. Restore the"
      " checkpoint into a NamedTuple with the fields it was written with,"
      " then pass that here (see the Checkpointing page)."
    )
  if skip_spikes is not None and not isinstance(skip_spikes, SkipSpikes):
    raise ValueError(
      "`upgrade_state(skip_spikes=...)` must be a lossscale.SkipSpikes or None,"
      f" got {skip_spikes!r} instead."
    )
  convert = lambda x: _upgraded(x, skip_spikes) if found(x) else x
  return jax.tree.map(convert, tree, is_leaf=found)
