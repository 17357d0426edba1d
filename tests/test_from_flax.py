"""Coming from Flax's `DynamicScale` (docs/from-flax.md).

The reference is Flax's own training step, as its imagenet example writes it:
`DynamicScale.value_and_grad`, Flax's `TrainState.apply_gradients`, then a
hand-written `jnp.where(is_fin, new, old)` on the params and the optimizer
state. lossscale with `growth_interval=` Flax's `+ 1` (and Flax's bounds)
must follow it step for step, and a checkpoint it wrote must carry over.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from flax.training import checkpoints, train_state
from flax.training.dynamic_scale import DynamicScale

import lossscale as ls
from _helpers import assert_trees_equal, standard_promotion

G = 3  # Flax's growth_interval: it grows on every (G + 1)-th finite step.
S0 = 2.0**12
N_STEPS = 40
BAD_STEPS = (5, 6, 19, 30)  # an inf in the batch: a non-finite forward pass
F32 = np.finfo(np.float32)


class Net(nn.Module):
  """float16 compute (the scale overflows it as it grows), BatchNorm."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=jnp.float16)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=jnp.float16)(x)
    return nn.Dense(1, dtype=jnp.float16)(nn.relu(x)).astype(jnp.float32)


class FlaxState(train_state.TrainState):
  """Flax's imagenet example's state."""

  batch_stats: Any
  dynamic_scale: DynamicScale


class State(ls.flax.TrainState):
  batch_stats: Any


def _data():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(4, 1)).astype(np.float32)
  xs = rng.normal(size=(N_STEPS, 16, 4)).astype(np.float32)
  ys = (30.0 * xs @ w + 3.0).astype(np.float32)
  xs[list(BAD_STEPS), 0, 0] = np.inf
  return xs, ys


LR, MOMENTUM = 0.01, 0.9


def _sgd():
  return optax.sgd(LR, momentum=MOMENTUM)


def _lossscale_tx():
  return ls.dynamic_loss_scale(
    _sgd(),
    initial_scale=S0,
    growth_interval=G + 1,
    min_scale=float(F32.tiny),  # DynamicScale's minimum_scale
    max_scale=float(F32.max),  # DynamicScale has no maximum
  )


def _variables():
  return Net().init(jax.random.key(0), jnp.ones((2, 4)))


def _flax_state():
  v = _variables()
  return FlaxState.create(
    apply_fn=Net().apply,
    params=v["params"],
    batch_stats=v["batch_stats"],
    tx=_sgd(),
    dynamic_scale=DynamicScale(
      growth_interval=G, scale=jnp.float32(S0), fin_steps=jnp.int32(0)
    ),
  )


def _state():
  v = _variables()
  return State.create(
    apply_fn=Net().apply,
    params=v["params"],
    batch_stats=v["batch_stats"],
    tx=_lossscale_tx(),
  )


def _loss_fn(state, x, y):
  def loss_fn(params):
    out, updates = state.apply_fn(
      {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
    )
    return jnp.mean((out - y) ** 2), updates["batch_stats"]

  return loss_fn


@jax.jit
def _flax_step(state, x, y):
  """The imagenet example's train step (no pmap)."""
  grad_fn = state.dynamic_scale.value_and_grad(_loss_fn(state, x, y), has_aux=True)
  dynamic_scale, is_fin, (_, batch_stats), grads = grad_fn(state.params)
  new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  select = functools.partial(jnp.where, is_fin)
  new_state = new_state.replace(
    opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state),
    params=jax.tree.map(select, new_state.params, state.params),
    dynamic_scale=dynamic_scale,
  )
  return new_state, is_fin, grads


@jax.jit
def _step(state, x, y):
  grad_fn = ls.value_and_grad(_loss_fn(state, x, y), has_aux=True)
  (_, batch_stats), grads = grad_fn(state, state.params)
  state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  return state, state.opt_state.last_finite


def _run(step, scale_of, state, xs, ys, steps):
  scales, skipped = [], []
  for t in steps:
    state, finite = step(state, xs[t], ys[t])[:2]
    scales.append(float(scale_of(state)))
    skipped.append(not bool(finite))
  return state, scales, skipped


run_flax = functools.partial(_run, _flax_step, lambda s: s.dynamic_scale.scale)
run_lossscale = functools.partial(_run, _step, lambda s: s.loss_scale)


U32 = 2.0**-24  # float32's unit roundoff: a rounded operation's relative error


def _assert_sgd_step_within_rounding(before, grads, params, momentum):
  """`params` and `momentum` are the SGD step from Flax's state `before` with
  Flax's (unscaled) `grads`, each element within float32 rounding of the
  exact step.

  The exact step, from the same float32 values, in float64: optax's trace,
  `scale(-lr)` and `apply_updates` make m' = g + b*m and p' = p - lr*m', b
  and lr being the float32 values the step multiplies by. In float32 each
  operation rounds to within a relative u = 2**-24, and XLA may fuse a
  multiply and an add into one fused multiply-add (one rounding in place of
  two), so either way, to first order in u,
    |error of m'| <= u*|m'| + u*b*|m|,
    |error of p'| <= u*|p'| + 3*u*lr*(|g| + b*|m|)
  (b*m, the sum, lr*m' and the sum each round once). The bounds below take
  2 and 4 in place of 1 and 3: room for the terms of order u**2 and for
  the float64 reference's own rounding (2**-53 per operation).
  """
  b, lr = float(np.float32(MOMENTUM)), float(np.float32(LR))

  def check(got, want, tol, what):
    err = np.abs(np.asarray(got, np.float64) - want)
    i = np.unravel_index(np.argmax(err - tol), err.shape)
    at = [int(j) for j in i]
    assert err[i] <= tol[i], f"{what}{at}: off by {err[i]:.3g}, bound {tol[i]:.3g}"

  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    where = jax.tree_util.keystr(path)
    g = np.asarray(g, np.float64)
    m = np.asarray(_at(before.opt_state[0].trace, path), np.float64)
    p = np.asarray(_at(before.params, path), np.float64)
    m_new = g + b * m
    p_new = p - lr * m_new
    tol = U32 * (np.abs(m_new) + 2 * b * np.abs(m))
    check(_at(momentum, path), m_new, tol, f"momentum{where}")
    tol = U32 * (np.abs(p_new) + 4 * lr * (np.abs(g) + b * np.abs(m)))
    check(_at(params, path), p_new, tol, f"params{where}")


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


@pytest.fixture(scope="module")
def flax_run():
  """Flax's whole run, with the state after every step."""
  xs, ys = _data()
  with standard_promotion():  # BatchNorm in float16
    state = _flax_state()
    states, scales, skipped = [state], [], []
    for t in range(N_STEPS):
      state, s, k = run_flax(state, xs, ys, [t])
      states.append(state)
      scales += s
      skipped += k
  return xs, ys, states, scales, skipped


def test_same_scale_and_skip_trajectory_as_flax_dynamic_scale(flax_run):
  xs, ys, flax_states, flax_scales, flax_skipped = flax_run
  with standard_promotion():
    state, scales, skipped = run_lossscale(_state(), xs, ys, range(N_STEPS))
  # The run is worth comparing: growths, injected and natural overflows.
  assert [t for t in BAD_STEPS if not flax_skipped[t]] == []
  natural = [t for t, k in enumerate(flax_skipped) if k and t not in BAD_STEPS]
  assert natural, "the scale never overflowed float16 by itself"
  changes = np.diff([S0, *flax_scales])
  assert (changes > 0).sum() >= 3 and (changes < 0).sum() >= 3
  assert scales == flax_scales
  assert skipped == flax_skipped
  # The params are compared step by step (the next test): run by themselves,
  # the two runs drift apart by rounding.
  flax_final = flax_states[-1]
  # Flax's step counts every call; lossscale's only the applied updates.
  assert int(flax_final.step) == N_STEPS
  assert int(state.step) == N_STEPS - sum(flax_skipped) == N_STEPS - state.skipped_steps
  # Flax's example keeps the bad forward pass's BatchNorm statistics.
  assert not all(np.isfinite(x).all() for x in jax.tree.leaves(flax_final.batch_stats))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state.batch_stats))


def test_every_step_is_flax_step_within_float32_rounding(flax_run):
  """From Flax's state before each step, lossscale's step gives Flax's scale,
  good-step count and skip exactly, a skipped step's params and momentum bit
  for bit, and an applied step's within float32 rounding of the exact step,
  as Flax's own step does.

  Run by themselves, lossscale's run and Flax's drift apart: XLA may round
  the same optimizer step differently in the two programs. On jaxlib
  0.12.0.1's XLA:CPU, lossscale's program computes `g + 0.9 * m` and
  `p - lr * m'` for one parameter (Dense_0's kernel) as fused multiply-adds
  and Flax's does not: from the same state and bit-equal gradients, up to
  13 float32 units in the last place apart where the update nearly cancels
  the parameter (lossscale's 0.8 from the exact step there, Flax's 13.8).
  The float16 forward pass amplifies that, a parameter one rounding away
  rounding to the neighbouring float16 (2**-11 apart): after 40 steps the
  params differed by up to 1.5e-4 (relative), the scales and skips still
  equal. jax 0.4.35 rounds both programs alike.
  """
  xs, ys, flax_states, flax_scales, flax_skipped = flax_run
  with standard_promotion():
    fresh = _state()  # one `tx` and `apply_fn`: `_step` compiles once
  for t in range(N_STEPS):
    before, after = flax_states[t], flax_states[t + 1]
    raw = serialization.msgpack_restore(_checkpoint_bytes(before))
    with standard_promotion():
      again, _, grads = _flax_step(before, xs[t], ys[t])
      state, finite = _step(_convert(raw, fresh), xs[t], ys[t])
    assert_trees_equal(again, after)  # the grads are those of Flax's step
    assert bool(finite) != flax_skipped[t]
    assert float(state.loss_scale) == flax_scales[t]
    assert int(state.opt_state.good_steps) == int(after.dynamic_scale.fin_steps)
    momentum = state.opt_state.inner_state[0].trace
    if flax_skipped[t]:
      assert_trees_equal(state.params, before.params)
      assert_trees_equal(momentum, before.opt_state[0].trace)
      assert_trees_equal(after.params, before.params)
    else:
      _assert_sgd_step_within_rounding(before, grads, state.params, momentum)
      _assert_sgd_step_within_rounding(
        before, grads, after.params, after.opt_state[0].trace
      )


def _checkpoint_bytes(state):
  """A legacy Flax checkpoint (msgpack), as `flax.serialization` writes it."""
  return serialization.to_bytes(state)


def _strict_params(raw, like):
  """The restored `raw` tree, checked against `like` key for key."""
  assert jax.tree.structure(raw) == jax.tree.structure(like)
  return jax.tree.map(lambda r, p: jnp.asarray(r, p.dtype), raw, like)


def _convert(raw, fresh=None):
  """A lossscale state from a Flax-era checkpoint restored without a target
  (into `fresh`, a new `_state()` unless given: its `tx` and `apply_fn` are
  what a jitted step compiles for)."""
  assert set(raw) == {"step", "params", "batch_stats", "opt_state", "dynamic_scale"}
  fresh = _state() if fresh is None else fresh
  params = _strict_params(raw["params"], fresh.params)
  return fresh.replace(
    step=jnp.asarray(raw["step"], jnp.int32),
    params=params,
    batch_stats=_strict_params(raw["batch_stats"], fresh.batch_stats),
    opt_state=ls.flax.from_dynamic_scale(
      dynamic_scale=raw["dynamic_scale"],
      opt_state=raw["opt_state"],
      tx=fresh.tx,
      params=params,
    ),
  )


def _checkpoint_step(flax_run, kind):
  """A number of steps k after which to checkpoint the Flax run (the run's
  trajectory depends on the stack, so the positions are found, not fixed)."""
  flax_states, skipped = flax_run[2], flax_run[4]
  fin = [int(s.dynamic_scale.fin_steps) for s in flax_states]
  natural = [t for t, k in enumerate(skipped) if k and t not in BAD_STEPS]
  candidates = {
    # At every value of `fin_steps`, 0 .. G.
    **{
      f"fin_steps={v}": [k for k in range(1, N_STEPS) if fin[k] == v]
      for v in range(G + 1)
    },
    "after_skips": [k for k in range(1, N_STEPS) if skipped[k - 1]],
    # fin_steps == G: Flax grows on the next finite step.
    "before_growth": [k for k in range(N_STEPS) if fin[k] == G and not skipped[k]],
    "before_natural_overflow": [k for k in natural if k > 0],
    "before_injected_overflow": list(BAD_STEPS),
  }[kind]
  assert candidates, kind
  return candidates[len(candidates) // 2]


KINDS = (
  *(f"fin_steps={v}" for v in range(G + 1)),
  "after_skips",
  "before_growth",
  "before_natural_overflow",
  "before_injected_overflow",
)


@pytest.mark.parametrize("kind", KINDS)
def test_converted_checkpoint_continues_flax_run(flax_run, kind):
  xs, ys, flax_states, flax_scales, flax_skipped = flax_run
  k = _checkpoint_step(flax_run, kind)
  old = flax_states[k]
  raw = serialization.msgpack_restore(_checkpoint_bytes(old))
  with standard_promotion():
    state = _convert(raw)
    # Carried over bit for bit: momentum, scale, the good-step count, step.
    assert_trees_equal(state.opt_state.inner_state, old.opt_state)
    assert_trees_equal(state.params, old.params)
    assert state.loss_scale == old.dynamic_scale.scale
    assert state.loss_scale.dtype == jnp.float32
    assert state.opt_state.good_steps == old.dynamic_scale.fin_steps
    assert state.opt_state.good_steps.dtype == jnp.int32
    assert int(state.step) == k and state.step.dtype == jnp.int32
    assert int(state.skipped_steps) == 0
    # Continued with lossscale, it follows the uninterrupted Flax run.
    state, scales, skipped = run_lossscale(state, xs, ys, range(k, N_STEPS))
  assert scales == flax_scales[k:]
  assert skipped == flax_skipped[k:]
  # The params drift from Flax's by rounding: compared step by step in
  # test_every_step_is_flax_step_within_float32_rounding, from every state.
  # `step + skipped_steps` is still the number of batches consumed.
  assert int(state.step) + int(state.skipped_steps) == N_STEPS


def test_fin_steps_maps_to_good_steps_exactly(flax_run):
  """An off-by-one mapping would move the next growth by a step."""
  xs, ys, flax_states, flax_scales, _ = flax_run
  k = _checkpoint_step(flax_run, "fin_steps=1")
  old = flax_states[k]
  assert 0 < int(old.dynamic_scale.fin_steps) < G  # mid-interval
  raw = serialization.msgpack_restore(_checkpoint_bytes(old))
  for shift in (-1, 1):
    raw_shifted = dict(raw, dynamic_scale=dict(raw["dynamic_scale"]))
    raw_shifted["dynamic_scale"]["fin_steps"] = (
      raw["dynamic_scale"]["fin_steps"] + shift
    )
    with standard_promotion():
      state = _convert(raw_shifted)
      _, scales, _ = run_lossscale(state, xs, ys, range(k, N_STEPS))
    assert scales != flax_scales[k:]


def test_lossscale_run_state_equals_converted_flax_state(flax_run):
  """Uninterrupted lossscale from the start == Flax's checkpoint, converted."""
  xs, ys, flax_states, _, _ = flax_run
  k = _checkpoint_step(flax_run, "fin_steps=2")
  with standard_promotion():
    state, _, _ = run_lossscale(_state(), xs, ys, range(k))
    converted = _convert(
      serialization.msgpack_restore(_checkpoint_bytes(flax_states[k]))
    )
  for name in ("loss_scale", "good_steps"):
    assert getattr(converted.opt_state, name) == getattr(state.opt_state, name)
  # The same trees, shapes and dtypes; the values drift from Flax's by
  # rounding (test_every_step_is_flax_step_within_float32_rounding).
  for a, b in (
    (converted.opt_state, state.opt_state),
    (converted.params, state.params),
  ):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.map(jnp.shape, a) == jax.tree.map(jnp.shape, b)
    assert jax.tree.map(jnp.result_type, a) == jax.tree.map(jnp.result_type, b)


def _orbax_checkpoint(tmp_path, state):
  """What Flax's examples write: `flax.training.checkpoints` (orbax-backed)."""
  ckpt_dir = str(tmp_path.absolute())
  checkpoints.save_checkpoint(ckpt_dir, state, step=int(state.step), keep=3)
  return ckpt_dir


def test_restore_checkpoint_with_new_target_silently_fills_from_it(flax_run, tmp_path):
  """The trap: keys missing from the checkpoint come from the target."""
  old = flax_run[2][12]
  assert float(old.dynamic_scale.scale) != S0
  ckpt_dir = _orbax_checkpoint(tmp_path, old)
  with standard_promotion():
    target = _state()
    restored = checkpoints.restore_checkpoint(ckpt_dir, target)
  # No error: the params and step came over, the optimizer state did not.
  assert_trees_equal(restored.params, old.params)
  assert int(restored.step) == 12
  momentum = restored.opt_state.inner_state[0].trace
  assert all(not np.any(m) for m in jax.tree.leaves(momentum))  # reset to zero
  assert any(np.any(m) for m in jax.tree.leaves(old.opt_state[0].trace))
  assert float(restored.loss_scale) == S0  # reset to the initial scale


def test_strict_restore_fails_loudly_and_converts(flax_run, tmp_path):
  old = flax_run[2][12]
  ckpt_dir = _orbax_checkpoint(tmp_path, old)
  path = checkpoints.latest_checkpoint(ckpt_dir)
  # Flax's own state-dict restore into the new target raises, as does
  # `restore_checkpoint` on a legacy msgpack checkpoint.
  with standard_promotion():
    target = _state()
  raw_msgpack = serialization.msgpack_restore(_checkpoint_bytes(old))
  with pytest.raises(ValueError, match="field names of the state dict"):
    serialization.from_state_dict(target, raw_msgpack)
  # Restored without a target, converted explicitly: everything carries over.
  with ocp.StandardCheckpointer() as checkpointer:
    raw = checkpointer.restore(path)
  with standard_promotion():
    state = _convert(raw)
  assert_trees_equal(state.opt_state.inner_state, old.opt_state)
  assert state.loss_scale == old.dynamic_scale.scale
  assert state.opt_state.good_steps == old.dynamic_scale.fin_steps
  # A checkpoint of another optimizer fails, naming what differs.
  with standard_promotion():
    adam = optax.adam(1e-3).init(old.params)
  with pytest.raises(ValueError, match=r"opt_state=.*missing \['0/trace/"):
    ls.flax.from_dynamic_scale(
      dynamic_scale=raw["dynamic_scale"],
      opt_state=serialization.to_state_dict(adam),
      tx=target.tx,
      params=target.params,
    )


def _small():
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  old = jax.tree.map(lambda p: p + 0.5, _sgd().init(params))  # nonzero momentum
  return params, old


# The old state the Flax run had for each new tx: sgd's alone, or with
# clip's (an EmptyState) before it.
_TXS = {
  "alone": (_lossscale_tx, lambda old: old),
  # cross_shard_mean holds no state: the inner optimizer's state alone works.
  "chain_stateless": (
    lambda: optax.chain(ls.cross_shard_mean("batch"), _lossscale_tx()),
    lambda old: old,
  ),
  "chain_inside": (
    lambda: ls.dynamic_loss_scale(optax.chain(optax.clip(1.0), _sgd())),
    lambda old: (optax.EmptyState(), old),
  ),
}


@pytest.mark.parametrize("which", sorted(_TXS))
@pytest.mark.parametrize("form", ["optax", "msgpack"])
def test_converts_optax_states_and_state_dicts(which, form):
  params, old = _small()
  make_tx, old_state_of = _TXS[which]
  tx = make_tx()
  ds = DynamicScale(scale=jnp.float32(2.0**20), fin_steps=jnp.int32(5))
  flax_opt_state = old_state_of(old)
  if form == "msgpack":
    ds = serialization.msgpack_restore(serialization.to_bytes(ds))
    flax_opt_state = serialization.msgpack_restore(
      serialization.to_bytes(flax_opt_state)
    )
  new = ls.flax.from_dynamic_scale(
    dynamic_scale=ds, opt_state=flax_opt_state, tx=tx, params=params
  )
  assert jax.tree.structure(new) == jax.tree.structure(tx.init(params))
  state = ls.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
  state = state.replace(opt_state=new)
  assert state.loss_scale == 2.0**20 and state.loss_scale.dtype == jnp.float32
  good_steps = optax.tree_utils.tree_get(new, "good_steps")
  assert good_steps == 5 and good_steps.dtype == jnp.int32
  assert int(state.skipped_steps) == 0
  assert_trees_equal(optax.tree_utils.tree_get(new, "trace"), old[0].trace)


def test_none_keeps_the_initial_scale():
  params, old = _small()
  new = ls.flax.from_dynamic_scale(
    dynamic_scale=None, opt_state=old, tx=_lossscale_tx(), params=params
  )
  assert new.loss_scale == S0 and new.good_steps == 0
  assert_trees_equal(new.inner_state, old)


@pytest.mark.parametrize(
  ("change", "match"),
  [
    (dict(dynamic_scale=DynamicScale(scale=jnp.float32(0.0))), r"`scale`.* got"),
    (dict(dynamic_scale=DynamicScale(scale=jnp.float32(np.inf))), r"`scale`.*inf"),
    (dict(dynamic_scale=DynamicScale(scale=jnp.float32(1e-40))), r"`scale`.*normal"),
    (dict(dynamic_scale=DynamicScale(scale=jnp.ones(8))), r"`scale`.*scalar"),
    (dict(dynamic_scale=DynamicScale(fin_steps=-1)), r"`fin_steps`.*-1"),
    (dict(dynamic_scale=DynamicScale(fin_steps=1.5)), r"`fin_steps`.*1.5"),
    (dict(dynamic_scale={"scale": 1.0}), r"dynamic_scale=.*'scale'\]"),
    (dict(dynamic_scale=2.0), r"dynamic_scale=.*float"),
    (dict(opt_state="adam"), r"opt_state=.*missing \['0/trace"),
    (dict(opt_state="bfloat16"), r"opt_state=.*bfloat16\[2\]"),
    (
      dict(opt_state="stacked"),
      r"opt_state=.*expected float32\[2\], got float32\[8, 2\]",
    ),
    (dict(tx=optax.sgd(0.1)), r"tx=.*found 0"),
  ],
)
def test_rejects_what_would_not_continue_the_run(change, match):
  params, old = _small()
  with standard_promotion():
    bad_states = {
      "adam": optax.adam(1e-3).init(params),
      "bfloat16": jax.tree.map(lambda x: x.astype(jnp.bfloat16), old),
      # pmap-replicated, as a state dict
      "stacked": serialization.to_state_dict(
        jax.tree.map(lambda x: jnp.stack([x] * 8), old)
      ),
    }
  kwargs = dict(dynamic_scale=DynamicScale(), opt_state=old, tx=_lossscale_tx())
  kwargs.update(change)
  if isinstance(kwargs["opt_state"], str):
    kwargs["opt_state"] = bad_states[kwargs["opt_state"]]
  with pytest.raises(ValueError, match=match):
    ls.flax.from_dynamic_scale(params=params, **kwargs)


class _Float16Net(nn.Module):
  """float16 parameters: a Flax run's optax state is float16 too."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, dtype=jnp.float16, param_dtype=jnp.float16)(x)
    return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float16)(nn.relu(x))


@pytest.mark.parametrize("form", ["optax", "orbax"])
def test_widens_the_float16_state_of_a_float16_flax_run(form, tmp_path):
  # lossscale gives float16 parameters a float32 inner state (float16 moments
  # underflow); the Flax run's float16 moments are widened, exactly.
  model = _Float16Net()
  params = model.init(jax.random.key(0), jnp.ones((2, 3), jnp.float16))["params"]
  flax_tx = optax.adam(1e-3)
  flax_state = FlaxState.create(
    apply_fn=model.apply,
    params=params,
    tx=flax_tx,
    batch_stats={},
    dynamic_scale=DynamicScale(scale=jnp.float32(2.0**10), fin_steps=jnp.int32(3)),
  )
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float16)

  @jax.jit
  def flax_step(state):
    loss_fn = lambda p: jnp.mean(state.apply_fn({"params": p}, x).astype(jnp.float32))
    ds, _, _, grads = state.dynamic_scale.value_and_grad(loss_fn)(state.params)
    # DynamicScale's gradients are float32: in the parameters' dtype, the
    # optimizer state stays float16 (and the jitted step is not retraced).
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    return state.apply_gradients(grads=grads).replace(dynamic_scale=ds)

  with standard_promotion():
    flax_state = flax_step(flax_step(flax_state))
  old = flax_state.opt_state
  assert {x.dtype for x in jax.tree.leaves(old[0].mu)} == {jnp.dtype(jnp.float16)}
  assert any(np.any(np.asarray(m) != 0) for m in jax.tree.leaves(old[0].nu))
  dynamic_scale, opt_state = flax_state.dynamic_scale, old
  if form == "orbax":
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", flax_state)
    with ocp.StandardCheckpointer() as checkpointer:
      raw = checkpointer.restore(tmp_path / "ckpt")
    dynamic_scale, opt_state = raw["dynamic_scale"], raw["opt_state"]

  tx = ls.dynamic_loss_scale(flax_tx, growth_interval=G + 1)
  new = ls.flax.from_dynamic_scale(
    dynamic_scale=dynamic_scale, opt_state=opt_state, tx=tx, params=flax_state.params
  )
  # The new optimizer's own types (float32 moments), so a jitted step that
  # started from `tx.init` takes it without retracing.
  fresh = tx.init(flax_state.params)
  jax.lax.cond(True, lambda: fresh, lambda: new)
  assert {x.dtype for x in jax.tree.leaves(new.inner_state[0].mu)} == {
    jnp.dtype(jnp.float32)
  }
  # Nothing lost: float16 -> float32 is exact.
  widen = lambda a: a.astype(np.float32) if a.dtype == np.float16 else a
  want = jax.tree.map(lambda a: widen(np.asarray(a)), old)
  assert_trees_equal(new.inner_state, want)
  assert float(new.loss_scale) == float(flax_state.dynamic_scale.scale)
  assert int(new.good_steps) == int(flax_state.dynamic_scale.fin_steps)


def test_a_dtype_mismatch_says_dtype_not_replication():
  params, old = _small()
  narrow = jax.tree.map(lambda x: x.astype(jnp.bfloat16), old)
  with pytest.raises(ValueError) as info:
    ls.flax.from_dynamic_scale(
      dynamic_scale=None, opt_state=narrow, tx=_lossscale_tx(), params=params
    )
  message = str(info.value)
  assert "expected float32[2], got bfloat16[2]" in message
  assert "dtype" in message and "pmap" not in message
