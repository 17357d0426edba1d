"""Checkpointing the whole optimizer state with orbax, and resuming exactly
(with the same configuration, or another one)."""

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.tree_utils import tree_get

import lossscale as ls
from _helpers import INF, assert_trees_equal, make_mesh, stack, standard_promotion

_N_STEPS = 30
_RESUME_AT = 16
# Non-finite batches: steps 3, 7-8 and 15 are skipped before the checkpoint
# (15 right before it), 22-24 after it.
_BAD_STEPS = (3, 7, 8, 15, 22, 23, 24)


def _assert_train_states_equal(a, b):
  # Each TrainState.create holds a new `tx` closure (a static field), and
  # plain Flax starts `step` as a weakly typed 0: compare the rest exactly.
  assert jax.tree.structure(a.opt_state) == jax.tree.structure(b.opt_state)
  assert_trees_equal((a.params, a.opt_state), (b.params, b.opt_state), weak_type=True)
  assert int(a.step) == int(b.step)


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((_N_STEPS, 8, 3)).astype(np.float32)
  y = (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)
  x[list(_BAD_STEPS), 0, 1] = np.nan
  return x, y


def _make_tx():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 5, _N_STEPS)
  return ls.dynamic_loss_scale(
    optax.adamw(schedule, weight_decay=1e-2),
    initial_scale=2.0**12,
    growth_interval=4,
    hysteresis=2,
  )


def _loss(params, x, y):
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _make_step(tx, traces=None):
  @jax.jit
  def step(params, opt_state, x, y):
    if traces is not None:
      traces.append(1)  # runs only while tracing
    _, grads = ls.value_and_grad(_loss)(opt_state, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def _init(tx):
  params = {"w": jnp.zeros((3, 1)), "b": jnp.zeros(1)}
  return {"params": params, "opt_state": tx.init(params)}


def _run(step, tree, x, y, steps):
  params, opt_state = tree["params"], tree["opt_state"]
  scales = []
  for t in steps:
    params, opt_state = step(params, opt_state, x[t], y[t])
    scales.append(float(opt_state.loss_scale))
  return {"params": params, "opt_state": opt_state}, scales


def test_round_trip_keeps_types_and_does_not_retrace(tmp_path):
  x, y = _data()
  tx = _make_tx()
  traces = []
  step = _make_step(tx, traces)
  with standard_promotion():
    tree, _ = _run(step, _init(tx), x, y, range(_RESUME_AT))
    assert len(traces) == 1
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "ckpt", tree)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(lambda: tree))
    assert_trees_equal(restored, tree, weak_type=True)
    assert isinstance(restored["opt_state"], ls.LossScaleState)
    assert isinstance(restored["opt_state"].inner_state[0], optax.ScaleByAdamState)
    # Identical avals (no weak types, same dtypes): no new trace of the step.
    step(restored["params"], restored["opt_state"], x[0], y[0])
    assert len(traces) == 1
    # And the restored state passes through lax.cond against a fresh one.
    fresh = _init(tx)["opt_state"]
    jax.lax.cond(True, lambda: fresh, lambda: restored["opt_state"])


def test_resume_mid_run_is_bitwise_identical(tmp_path):
  x, y = _data()
  with standard_promotion():
    tx = _make_tx()
    step = _make_step(tx)
    full, full_scales = _run(step, _init(tx), x, y, range(_N_STEPS))

    tx = _make_tx()
    step = _make_step(tx)
    first, first_scales = _run(step, _init(tx), x, y, range(_RESUME_AT))
    state = first["opt_state"]
    # The checkpoint is taken in the middle of things: right after a skip,
    # with hysteresis used up, the scale moved and the schedule advanced.
    assert int(state.consecutive_skips) == 1
    assert int(state.skipped_steps) == 4
    assert int(state.hysteresis_left) < 2
    assert float(state.loss_scale) != 2.0**12
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "mid", first)

    # A "new process": new optimizer object, new jit, restored state.
    tx = _make_tx()
    step = _make_step(tx)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(
        tmp_path / "mid", jax.eval_shape(lambda: _init(tx))
      )
    resumed, rest_scales = _run(step, restored, x, y, range(_RESUME_AT, _N_STEPS))

  assert_trees_equal(resumed, full, weak_type=True)
  assert first_scales + rest_scales == full_scales
  assert int(resumed["opt_state"].skipped_steps) == len(_BAD_STEPS)
  # The schedule inside adamw counted applied steps only.
  adam, _, schedule = resumed["opt_state"].inner_state
  assert isinstance(schedule, optax.ScaleByScheduleState)
  assert int(schedule.count) == int(adam.count) == _N_STEPS - len(_BAD_STEPS)


def test_flax_train_state_with_checkpoint_manager(tmp_path):
  x, y = _data()
  model = nn.Dense(1)

  def create():
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    return train_state.TrainState.create(
      apply_fn=model.apply, params=variables["params"], tx=_make_tx()
    )

  @jax.jit
  def flax_step(state, x, y):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    _, grads = ls.value_and_grad(loss_fn)(state, state.params)
    return state.apply_gradients(grads=grads)

  with standard_promotion():
    full = create()
    for t in range(_N_STEPS):
      full = flax_step(full, x[t], y[t])

    state = create()
    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=4)
    with ocp.CheckpointManager(tmp_path / "flax", options=options) as manager:
      for t in range(_RESUME_AT):
        state = flax_step(state, x[t], y[t])
        manager.save(t + 1, args=ocp.args.StandardSave(state))
      manager.wait_until_finished()
      assert manager.all_steps() == [12, 16]
    with ocp.CheckpointManager(tmp_path / "flax") as manager:
      abstract = jax.eval_shape(create)
      restored = manager.restore(
        manager.latest_step(), args=ocp.args.StandardRestore(abstract)
      )
    assert isinstance(restored, train_state.TrainState)
    _assert_train_states_equal(restored, state)
    for t in range(_RESUME_AT, _N_STEPS):
      restored = flax_step(restored, x[t], y[t])

  _assert_train_states_equal(restored, full)
  # Plain Flax counts skipped steps too.
  assert int(restored.step) == _N_STEPS
  assert int(tree_get(restored.opt_state, "skipped_steps")) == len(_BAD_STEPS)


# ---------------------------------------------------------------------------
# Resuming with another configuration: every wrapper divides by the scale in
# the state it is given (the one the loss was multiplied by), and leaves a
# scale its own configuration allows.

_F16_SCALE = 2.0**15
_INNER = optax.sgd(0.1, momentum=0.9)


@functools.cache
def _restored_float16_run():
  """A mid-run state of a float16 run: scale 2**15, momentum built up."""
  tx = ls.dynamic_loss_scale(_INNER, initial_scale=_F16_SCALE, growth_interval=100)
  tree = _init(tx)
  x, y = _data()
  step = _make_step(tx)
  for t in (0, 1, 2):
    tree["params"], tree["opt_state"] = step(
      tree["params"], tree["opt_state"], x[t], y[t]
    )
  assert float(ls.get_loss_scale(tree["opt_state"])) == _F16_SCALE
  return tree


_RESUMED_WITH = {
  "enabled=False": (lambda: ls.dynamic_loss_scale(_INNER, enabled=False), 1.0),
  "static enabled=False": (
    lambda: ls.static_loss_scale(_INNER, 2.0**10, enabled=False),
    1.0,
  ),
  "skip_nonfinite": (lambda: ls.skip_nonfinite(_INNER), 1.0),
  "static 128": (lambda: ls.static_loss_scale(_INNER, 128.0), 128.0),
  "lower max_scale": (
    lambda: ls.dynamic_loss_scale(_INNER, initial_scale=8.0, max_scale=2.0**10),
    2.0**10,
  ),
  "higher min_scale": (
    lambda: ls.dynamic_loss_scale(_INNER, initial_scale=2.0**17, min_scale=2.0**16),
    2.0**16,
  ),
  "same": (lambda: ls.dynamic_loss_scale(_INNER, growth_interval=100), _F16_SCALE),
}


def _resumed_step(tx, path):
  def composed(params, opt_state, x, y):
    _, grads = ls.value_and_grad(_loss)(opt_state, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def fused(params, opt_state, x, y):
    _, grads = ls.value_and_grad(_loss)(opt_state, params, x, y)
    return ls.apply_gradients(tx, grads, opt_state, params)

  step = fused if path.startswith("apply_gradients") else composed
  return jax.jit(step) if path.endswith("jit") else step


_PATHS = ["update eager", "update jit", "apply_gradients eager", "apply_gradients jit"]


@pytest.mark.parametrize("path", _PATHS)
@pytest.mark.parametrize("config", list(_RESUMED_WITH))
def test_resuming_with_another_configuration_gives_the_right_first_step(config, path):
  make, allowed_scale = _RESUMED_WITH[config]
  tree = _restored_float16_run()
  params, opt_state = tree["params"], tree["opt_state"]
  x, y = _data()
  t = 4  # a finite batch
  new_params, new_state = _resumed_step(make(), path)(params, opt_state, x[t], y[t])
  # The reference: the bare optimizer fed the true gradients, from the
  # restored inner state.
  true_grads = jax.grad(_loss)(params, x[t], y[t])
  updates, inner_state = _INNER.update(true_grads, opt_state.inner_state, params)
  want = optax.apply_updates(params, updates)
  for got, ref in zip(jax.tree.leaves(new_params), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
  for got, ref in zip(
    jax.tree.leaves(new_state.inner_state), jax.tree.leaves(inner_state), strict=True
  ):
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
  # The scale left is one the new configuration allows.
  assert new_state.loss_scale.dtype == jnp.float32
  assert float(new_state.loss_scale) == allowed_scale
  # And the next step's loss is scaled by it.
  _, g = ls.value_and_grad(lambda w: jnp.sum(w))(new_state, jnp.ones(2))
  np.testing.assert_array_equal(g, np.full(2, allowed_scale, np.float32))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_resumed_scale_outside_new_bounds_moves_by_the_new_rule(jit):
  # From 2**15 with max_scale=2**10: never above 2**10, and a growth step
  # does not shrink it below. With min_scale=2**16: never below 2**16.
  params = {"w": jnp.zeros(2)}
  old = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=_F16_SCALE)
  restored = old.init(params)._replace(good_steps=jnp.int32(1))
  ok, bad = {"w": jnp.ones(2)}, {"w": jnp.full(2, jnp.inf)}
  cases = [
    (dict(max_scale=2.0**10, growth_interval=2), [ok, ok, ok, bad, bad, ok, ok]),
    (dict(min_scale=2.0**16, growth_interval=2), [bad, ok, ok, bad, ok, ok, bad]),
  ]
  for settings, grads in cases:
    tx = ls.dynamic_loss_scale(
      optax.sgd(0.1), initial_scale=settings.get("min_scale", 1.0), **settings
    )
    update = jax.jit(tx.update) if jit else tx.update
    state, scales = restored, []
    for g in grads:
      _, state = update(g, state, params)
      scales.append(float(state.loss_scale))
    if "max_scale" in settings:
      assert scales == [2.0**10, 2.0**10, 2.0**10, 2.0**9, 2.0**8, 2.0**8, 2.0**9]
    else:
      assert scales == [2.0**16, 2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**17, 2.0**16]


def test_restarting_the_scale_when_switching_loss_scaling_on():
  # A float32 run (enabled=False, scale 1) resumed in float16: without a
  # restart the scale would need 15 growths to reach 2**15.
  params = {"w": jnp.array([0.5, -1.0])}
  off = ls.dynamic_loss_scale(_INNER, enabled=False)
  on = ls.dynamic_loss_scale(_INNER)
  state = off.init(params)
  with standard_promotion():
    _, state = off.update({"w": jnp.ones(2)}, state, params)
  restarted = ls.set_loss_scale(state, 2.0**15)
  assert float(ls.get_loss_scale(restarted)) == 2.0**15
  assert restarted.loss_scale.dtype == jnp.float32
  assert int(restarted.good_steps) == 0
  assert_trees_equal(restarted.inner_state, state.inner_state)
  assert int(restarted.skipped_steps) == int(state.skipped_steps)
  # Same types: no retrace in a jitted step.
  jax.lax.cond(True, lambda: state, lambda: restarted)
  true = {"w": jnp.array([1e-3, -2e-3])}
  _, scaled = ls.value_and_grad(lambda p: jnp.sum(p["w"] * true["w"]))(
    restarted, params
  )
  updates, after = jax.jit(on.update)(scaled, restarted, params)
  want, _ = _INNER.update(true, state.inner_state, params)
  np.testing.assert_allclose(updates["w"], want["w"], rtol=1e-6)
  assert float(after.loss_scale) == 2.0**15


def test_set_loss_scale_on_train_states_and_ensembles():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), enabled=False)
  model = nn.Dense(1)
  params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
  ts = ls.flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  ts2 = ls.set_loss_scale(ts, 1024.0)
  assert isinstance(ts2, ls.flax.TrainState)
  assert float(ts2.loss_scale) == 1024.0 and float(ts.loss_scale) == 1.0
  # Nested in a chain, and batched over an ensemble.
  chained = optax.chain(optax.clip(1.0), ls.dynamic_loss_scale(optax.sgd(0.1)))
  states = jax.vmap(chained.init)(jnp.zeros((3, 2)))
  states = ls.set_loss_scale(states, 8.0)
  np.testing.assert_array_equal(ls.get_loss_scale(states), [8.0, 8.0, 8.0])
  # Inside jit too.
  jitted = jax.jit(lambda s: ls.set_loss_scale(s, 4.0))(states)
  np.testing.assert_array_equal(ls.get_loss_scale(jitted), [4.0, 4.0, 4.0])
  for bad in (0.0, -1.0, float("inf"), float("nan"), 1e-40):
    with pytest.raises(ValueError, match=r"set_loss_scale\(loss_scale=\.\.\.\)"):
      ls.set_loss_scale(states, bad)
  with pytest.raises(ValueError, match="exactly one"):
    ls.set_loss_scale(optax.sgd(0.1).init(jnp.zeros(2)), 2.0)
  with pytest.raises(ValueError, match=r"concrete number.*traced"):
    jax.jit(ls.set_loss_scale)(states, 2.0**10)


def test_float16_checkpoints_move_between_enabled_and_disabled_with_nothing_lost(
  tmp_path,
):
  # float16 parameters get a float32 optimizer state, with `enabled=False`
  # too: a second moment of 1e-12 (0 in float16) survives a checkpoint saved
  # by one configuration and restored into the other's state structure.
  params = {"w": jnp.full((2, 3), 0.5, jnp.float16)}
  adam = optax.adam(1e-3)
  on = ls.dynamic_loss_scale(adam, initial_scale=2.0**10)
  off = ls.dynamic_loss_scale(adam, enabled=False)
  dtypes = lambda t: jax.tree.map(lambda x: jnp.asarray(x).dtype, t)
  assert dtypes(on.init(params)) == dtypes(off.init(params))
  assert jnp.float32 in jax.tree.leaves(dtypes(off.init(params).inner_state))
  with standard_promotion():
    small = {"w": jnp.full((2, 3), 1e-6 * 2.0**10, jnp.float16)}  # g = 1e-6
    _, state = jax.jit(on.update)(small, on.init(params), params)
    nu = tree_get(state, "nu")["w"]
    assert nu.dtype == jnp.float32 and float(nu[0, 0]) > 0
    for source, target in ((on, off), (off, on)):
      path = tmp_path / f"{id(source)}"
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
      with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, jax.eval_shape(target.init, params))
      assert_trees_equal(tree_get(restored, "nu"), tree_get(state, "nu"))
      # And the restored state steps as the bare optimizer with float32
      # state does, its updates in the parameters' dtype.
      g = {"w": jnp.full((2, 3), 3e-3, jnp.float16)}
      scale = ls.get_loss_scale(restored)
      scaled = jax.tree.map(
        lambda x, s=scale: (x.astype(jnp.float32) * s).astype(x.dtype), g
      )
      u, _ = jax.jit(target.update)(scaled, restored, params)
      p32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
      g32 = jax.tree.map(lambda x: x.astype(jnp.float32), g)
      want, _ = adam.update(g32, restored.inner_state, p32)
      assert u["w"].dtype == jnp.float16
      np.testing.assert_allclose(u["w"], want["w"].astype(jnp.float16), rtol=2.0**-10)


def _leaf_kind(x):
  """What `set_loss_scale` must keep of a leaf it replaces."""
  return (x.shape, x.dtype, x.weak_type, x.sharding)


# What a restart sets (the rest of the state is kept).
_RESTARTED = dict(
  good_steps=0,
  hysteresis_left=2**31 - 1,  # full: read as the wrapper's hysteresis
  consecutive_skips=0,
  steps_since_rescale=0,
  overflows_since_backoff=0,
  overflows_at_min_scale=0,
)


def _assert_scale_reset_in_place(old_state, new_state, scale):
  """`new_state` is `old_state` (a `LossScaleState`) restarted at `scale`,
  each replaced leaf of the same shape, dtype, weak type and sharding."""
  for name, value in dict(_RESTARTED, loss_scale=scale).items():
    was, now = getattr(old_state, name), getattr(new_state, name)
    assert _leaf_kind(now) == _leaf_kind(was), name
    np.testing.assert_array_equal(now, np.full(was.shape, value, was.dtype))
  keep = lambda s: s._replace(loss_scale=(), **dict.fromkeys(_RESTARTED, ()))
  assert_trees_equal(keep(new_state), keep(old_state), weak_type=True)


def test_a_restart_clears_the_stop_and_refills_hysteresis():
  # Four overflows take the scale to the floor and DeepSpeed's stop fires;
  # the restart the docs describe must train again, the stop cleared, and
  # the next overflow tolerated as a fresh state tolerates it.
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=2.0, min_scale=1.0, hysteresis=2, growth_interval=3
  )
  params = {"w": jnp.zeros(2)}
  update = jax.jit(tx.update)
  bad, good = {"w": jnp.array([INF, 1.0])}, {"w": jnp.ones(2)}
  state = tx.init(params)
  for _ in range(4):
    _, state = update(bad, state, params)
  assert float(state.loss_scale) == 1.0 and int(state.overflows_at_min_scale) > 0
  with pytest.raises(ls.LossScaleStalledError, match="cannot decrease"):
    ls.check_not_stalled(state, at_min_scale=True)
  state = ls.set_loss_scale(state, 1024.0)
  ls.check_not_stalled(state, at_min_scale=True)  # cleared at once
  scales = []
  for g in [good] * 5 + [bad, bad]:
    _, state = update(g, state, params)
    ls.check_not_stalled(state, at_min_scale=True)
    scales.append(float(state.loss_scale))
  # Growth after 3 good steps; the first overflow after it is tolerated
  # (hysteresis=2, refilled), the second backs off.
  assert scales == [1024.0] * 2 + [2048.0] * 4 + [1024.0]
  assert int(state.skipped_steps) == 6  # the total is history, kept
  # A fresh state, started at 1024, takes the same steps.
  fresh = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=1024.0, min_scale=1.0, hysteresis=2, growth_interval=3
  )
  s = fresh.init(params)
  want = []
  for g in [good] * 5 + [bad, bad]:
    _, s = jax.jit(fresh.update)(g, s, params)
    want.append(float(s.loss_scale))
  assert scales == want


def test_set_loss_scale_keeps_a_sharded_state_sharded(tmp_path):
  # After a jitted SPMD step the state lives on every device of the mesh;
  # a host-local scale beside it would no longer be one global array.
  mesh = make_mesh()
  tx = ls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
  params = {"w": jnp.zeros((8, 2))}
  params = jax.device_put(params, NamedSharding(mesh, P("batch")))
  state = jax.jit(tx.init)(params)
  state = jax.device_put(state, NamedSharding(mesh, P()))
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = jax.jit(tx.update)(grads, state, params)
  assert isinstance(state.loss_scale.sharding, NamedSharding)

  reset = ls.set_loss_scale(state, 2.0**10)
  _assert_scale_reset_in_place(state, reset, 2.0**10)
  assert reset.loss_scale.sharding.mesh == mesh
  # Checkpointed and restored as it came.
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "reset", reset)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "reset", reset)
  assert_trees_equal(restored, reset, weak_type=True)


def test_set_loss_scale_keeps_a_pmap_replicated_state_replicated():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  n = jax.local_device_count()
  state = jax.pmap(tx.init)(stack({"w": jnp.zeros(2)}, n))
  assert state.loss_scale.shape == (n,)
  reset = ls.set_loss_scale(state, 8.0)
  _assert_scale_reset_in_place(state, reset, 8.0)
  # It still feeds pmap, one scale per device.
  scales = jax.pmap(ls.get_loss_scale)(reset)
  np.testing.assert_array_equal(scales, np.full(n, 8.0, np.float32))


def test_set_loss_scale_keeps_plain_and_ensemble_states():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  state = tx.init({"w": jnp.zeros(2)})
  _assert_scale_reset_in_place(state, ls.set_loss_scale(state, 4.0), 4.0)
  ensemble = jax.vmap(tx.init)({"w": jnp.zeros((3, 2))})
  _assert_scale_reset_in_place(ensemble, ls.set_loss_scale(ensemble, 4.0), 4.0)
  # A weakly typed scale (a hand-built state) stays weakly typed, so a jitted
  # step that saw it does not retrace.
  weak = state._replace(loss_scale=jnp.asarray(2.0), good_steps=jnp.asarray(3))
  assert weak.loss_scale.weak_type and weak.good_steps.weak_type
  _assert_scale_reset_in_place(weak, ls.set_loss_scale(weak, 4.0), 4.0)
  # NumPy leaves (a state restored without a target) stay NumPy arrays.
  host = jax.tree.map(np.asarray, state)
  reset = ls.set_loss_scale(host, 4.0)
  assert isinstance(reset.loss_scale, np.ndarray)
  assert reset.loss_scale.dtype == np.float32 and reset.good_steps.dtype == np.int32
  assert float(reset.loss_scale) == 4.0 and int(reset.good_steps) == 0


# ---------------------------------------------------------------------------
# One state structure for every wrapper and policy; earlier layouts convert.


def _every_wrapper():
  inner = optax.adam(1e-3)
  return {
    "dynamic": ls.dynamic_loss_scale(inner),
    "deepspeed": ls.dynamic_loss_scale(
      inner, hysteresis=2, consecutive_hysteresis=True, growth_delay=1
    ),
    "fairseq": ls.dynamic_loss_scale(inner, tolerance=0.25),
    "fairseq enabled=False": ls.dynamic_loss_scale(
      inner, tolerance=0.25, enabled=False
    ),
    "enabled=False": ls.dynamic_loss_scale(inner, enabled=False),
    "static": ls.static_loss_scale(inner, 128.0),
    "static enabled=False": ls.static_loss_scale(inner, 128.0, enabled=False),
    "skip_nonfinite": ls.skip_nonfinite(inner),
  }


@pytest.mark.parametrize("params_dtype", [jnp.float32, jnp.float16])
def test_every_wrapper_and_policy_has_one_state_structure(params_dtype):
  params = {"w": jnp.zeros((2, 3), params_dtype)}
  kinds = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  states = {name: tx.init(params) for name, tx in _every_wrapper().items()}
  want = states["dynamic"]
  for name, state in states.items():
    assert jax.tree.structure(state) == jax.tree.structure(want), name
    assert kinds(state) == kinds(want), name
    # Exactly one field is called loss_scale.
    assert float(tree_get(state, "loss_scale")) > 0, name
  # And a step of each leaves that structure: a checkpoint of any restores
  # into any other.
  with standard_promotion():
    grads = {"w": jnp.ones((2, 3), params_dtype)}
    for name, tx in _every_wrapper().items():
      _, after = jax.jit(tx.update)(grads, states[name], params)
      assert jax.tree.structure(after) == jax.tree.structure(want), name
      assert kinds(after) == kinds(want), name


class _LossScaleStateDev(NamedTuple):
  """The layout before steps_since_rescale & co. (last_finite, unreleased)."""

  loss_scale: Any
  good_steps: Any
  hysteresis_left: Any
  skipped_steps: Any
  consecutive_skips: Any
  last_finite: Any
  inner_state: Any


def _earlier(state):
  return _LossScaleStateDev(*state[:6], state.inner_state)


class _LossScaleState01(NamedTuple):
  """lossscale 0.1.0's layout."""

  loss_scale: Any
  good_steps: Any
  hysteresis_left: Any
  skipped_steps: Any
  consecutive_skips: Any
  inner_state: Any


def _earlier_01(state):
  return _LossScaleState01(*state[:5], state.inner_state)


def test_checkpoint_of_the_earlier_layout_restores_with_upgrade_state(tmp_path):
  x, y = _data()
  with standard_promotion():
    tx = _make_tx()
    step = _make_step(tx)
    full, full_scales = _run(step, _init(tx), x, y, range(_N_STEPS))
    first, first_scales = _run(step, _init(tx), x, y, range(_RESUME_AT))
    old = {"params": first["params"], "opt_state": _earlier(first["opt_state"])}
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(tmp_path / "old", old)
    # The new structure does not restore from it...
    abstract = jax.eval_shape(lambda: _init(tx))
    checker = ocp.StandardCheckpointer()
    with checker as checkpointer, pytest.raises(Exception):  # noqa: B017 (orbax's error varies)
      checkpointer.restore(tmp_path / "old", abstract)
    # ...the earlier one does, and upgrade_state converts it.
    abstract_old = {
      "params": abstract["params"],
      "opt_state": _earlier(abstract["opt_state"]),
    }
    with ocp.StandardCheckpointer() as checkpointer:
      restored = ls.upgrade_state(checkpointer.restore(tmp_path / "old", abstract_old))
    state = restored["opt_state"]
    assert isinstance(state, ls.LossScaleState)
    assert_trees_equal(_earlier(state), old["opt_state"])
    for name in (
      "steps_since_rescale",
      "overflows_since_backoff",
      "overflows_at_min_scale",
    ):
      assert getattr(state, name).dtype == jnp.int32 and int(getattr(state, name)) == 0
    resumed, rest_scales = _run(step, restored, x, y, range(_RESUME_AT, _N_STEPS))
  # The default rule reads none of the new counters: the run continues as
  # if it had never stopped.
  assert first_scales + rest_scales == full_scales
  assert_trees_equal(resumed["params"], full["params"])
  assert_trees_equal(_earlier(resumed["opt_state"]), _earlier(full["opt_state"]))


def test_upgrade_state_keeps_batches_nesting_and_everything_else():
  tx = optax.chain(optax.clip(1.0), ls.dynamic_loss_scale(optax.sgd(0.1)))
  states = jax.vmap(tx.init)(jnp.zeros((3, 2)))
  old = (states[0], _earlier(states[1]))
  new = ls.upgrade_state(old)
  assert jax.tree.structure(new) == jax.tree.structure(states)
  assert new[1].steps_since_rescale.shape == (3,)
  np.testing.assert_array_equal(new[1].last_finite, [True] * 3)
  assert_trees_equal(new, states)  # a fresh state's values
  assert ls.upgrade_state(states) is not None
  assert_trees_equal(ls.upgrade_state(states), states)  # nothing to convert
  # What it cannot upgrade, it refuses: a dict (a checkpoint restored with
  # no target), a tree with no loss-scaling state.
  for bad in ({"loss_scale": 1.0, "inner_state": ()}, (), optax.sgd(0.1).init({})):
    with pytest.raises(ValueError, match=r"upgrade_state\(tree=\.\.\.\)"):
      ls.upgrade_state(bad)


def _assert_placed_like(state, like):
  for name in ("last_finite", *_RESTARTED):
    leaf = getattr(state, name)
    assert isinstance(leaf, jax.Array), name
    assert leaf.shape == like.shape and leaf.sharding == like.sharding, name
    assert not leaf.weak_type, name


def test_upgrade_state_places_new_fields_like_the_state_they_join():
  # A state replicated over the mesh: the fields upgrade_state adds are too
  # (single-device arrays beside it are what orbax refuses in a
  # multi-process save).
  mesh = make_mesh()
  tx = ls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
  params = jax.device_put({"w": jnp.zeros((8, 2))}, NamedSharding(mesh, P()))
  state = jax.device_put(jax.jit(tx.init)(params), NamedSharding(mesh, P()))
  new = ls.upgrade_state(_earlier_01(state))
  _assert_placed_like(new, state.good_steps)
  assert_trees_equal(new, state)
  # A pmap-replicated one (a leading device axis).
  n = jax.local_device_count()
  state = jax.pmap(tx.init)(stack({"w": jnp.zeros(2)}, n))
  new = ls.upgrade_state(_earlier_01(state))
  _assert_placed_like(new, state.good_steps)
  assert new.overflows_at_min_scale.shape == (n,)
  np.testing.assert_array_equal(new.last_finite, [True] * n)
  # Inside jit too.
  jitted = jax.jit(lambda s: ls.upgrade_state(_earlier_01(s)))(tx.init(params))
  assert jitted.steps_since_rescale.dtype == jnp.int32
