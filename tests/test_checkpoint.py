"""Checkpointing the whole optimizer state with orbax, and resuming exactly."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from optax.tree_utils import tree_get

import lossscale as ls
from _helpers import assert_trees_equal, standard_promotion

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
