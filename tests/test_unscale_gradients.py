"""`unscale_gradients` and `step_metrics`: the true gradients, and what to log.

`unscale_gradients` must give what the wrapper hands its inner optimizer,
bit for bit, for every dtype and state it is given; `step_metrics` must
follow the scale rule's trajectory (tests/_helpers.reference_rule).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import ScaleRule, reference_rule, standard_promotion


def _recording_inner():
  seen = []

  def update(updates, state, params=None):
    jax.debug.callback(lambda g: seen.append(jax.tree.map(np.asarray, g)), updates)
    return updates, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update), seen


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scale", [2.0**15, 3.0, 2.0**-3, 2.0**127])
def test_equals_what_the_inner_optimizer_is_fed(dtype, scale):
  inner, seen = _recording_inner()
  tx = ls.dynamic_loss_scale(
    inner, initial_scale=scale, max_scale=2.0**127, min_scale=2.0**-3
  )
  rng = np.random.default_rng(0)
  grads = {
    "a": jnp.asarray(rng.standard_normal((3, 4)), dtype),
    "b": jnp.asarray(7.0, dtype),
  }
  params = jax.tree.map(jnp.zeros_like, grads)
  state = tx.init(params)

  @jax.jit
  def both(grads, state, params):
    updates, _ = tx.update(grads, state, params)
    return updates, ls.unscale_gradients(grads, state)

  _, ours = both(grads, state, params)
  jax.effects_barrier()
  fed = seen[-1]
  for f, o in zip(jax.tree.leaves(fed), jax.tree.leaves(ours), strict=True):
    assert o.dtype == jnp.float32  # half-precision leaves are widened
    np.testing.assert_array_equal(np.asarray(o), np.asarray(f))
  # And against float64: one float32 rounding of g / scale (at 2**127 the
  # quotients are subnormal, which XLA:CPU flushes to zero, as the wrapper
  # then does too).
  if scale > 2.0**100:
    return
  for g, o in zip(jax.tree.leaves(grads), jax.tree.leaves(ours), strict=True):
    want = np.asarray(g, np.float64) / scale
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=2**-23)


def test_non_floating_leaves_pass_through():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  state = tx.init({"w": jnp.zeros(2)})
  grads = {"w": jnp.array([8.0, -4.0]), "n": None, "i": jnp.arange(3), "f": 2.0}
  out = ls.unscale_gradients(grads, state)
  assert out["n"] is None
  np.testing.assert_array_equal(out["i"], jnp.arange(3))
  assert out["i"].dtype == jnp.arange(3).dtype
  np.testing.assert_array_equal(out["w"], [2.0, -1.0])
  np.testing.assert_array_equal(out["f"], 0.5)  # a Python float, as jit sees it


@pytest.mark.parametrize(
  "make",
  [
    lambda: ls.dynamic_loss_scale(optax.sgd(0.1), enabled=False),
    lambda: ls.skip_nonfinite(optax.sgd(0.1)),
    lambda: ls.static_loss_scale(optax.sgd(0.1), 1.0),
  ],
  ids=["enabled=False", "skip_nonfinite", "static 1"],
)
def test_a_scale_of_one_gives_the_values_back_unchanged(make):
  tx = make()
  grads = {"w": jnp.array([1e-30, -3.0, 7.5, jnp.inf])}
  out = ls.unscale_gradients(grads, tx.init(grads))
  np.testing.assert_array_equal(out["w"], grads["w"])


def test_static_scale_and_nested_states():
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  tx = optax.chain(
    optax.clip(1.0), ls.static_loss_scale(optax.chain(optax.trace(0.9), inner), 64.0)
  )
  grads = {"w": jnp.array([64.0, -128.0])}
  np.testing.assert_array_equal(
    ls.unscale_gradients(grads, tx.init(grads))["w"], [1.0, -2.0]
  )
  multi = optax.MultiSteps(ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0), 2)
  with pytest.raises(ValueError, match=r"inside optax\.MultiSteps"):
    ls.unscale_gradients(grads, multi.init(grads))


def test_vmap_ensemble_divides_each_member_by_its_own_scale():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**10)
  params = {"w": jnp.ones(2)}
  states = jax.vmap(lambda _: tx.init(params))(jnp.arange(3))
  states = ls.set_loss_scale(states, 2.0**10)
  states = states._replace(loss_scale=jnp.array([1.0, 2.0, 4.0]))
  grads = {"w": jnp.full((3, 2), 8.0)}
  out = jax.vmap(ls.unscale_gradients)(grads, states)
  np.testing.assert_array_equal(out["w"][:, 0], [8.0, 4.0, 2.0])
  metrics = jax.vmap(ls.step_metrics)(states)
  np.testing.assert_array_equal(metrics["loss_scale"], [1.0, 2.0, 4.0])


def test_hand_written_weight_decay_is_off_by_the_scale_and_inside_it_is_not():
  wd, lr = 0.1, 0.5
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  true = {"w": jnp.array([0.25, 0.5, -1.0])}
  scale = 2.0**15
  scaled = jax.tree.map(lambda g: g * scale, true)
  bare = optax.chain(optax.add_decayed_weights(wd), optax.sgd(lr))
  want, _ = bare.update(true, bare.init(params), params)

  inside = ls.dynamic_loss_scale(bare, initial_scale=scale)
  got, _ = inside.update(scaled, inside.init(params), params)
  np.testing.assert_allclose(got["w"], want["w"], rtol=1e-6)

  plain = ls.dynamic_loss_scale(optax.sgd(lr), initial_scale=scale)
  state = plain.init(params)
  by_hand = jax.tree.map(lambda g, p: g + wd * p, scaled, params)
  off, _ = plain.update(by_hand, state, params)
  assert not np.allclose(off["w"], want["w"], rtol=1e-3)  # the trap
  # Unscaled first, the same decay is right (for reading: added by hand).
  fixed = jax.tree.map(
    lambda g, p: g + wd * p, ls.unscale_gradients(scaled, state), params
  )
  bare_sgd = optax.sgd(lr)
  right, _ = bare_sgd.update(fixed, bare_sgd.init(params), params)
  np.testing.assert_allclose(right["w"], want["w"], rtol=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["tx.update", "apply_gradients"])
def test_step_metrics_follow_the_rule(fused):
  rule = ScaleRule(initial_scale=2.0**4, growth_interval=2, hysteresis=2)
  tx = rule.tx(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)

  @jax.jit
  def step(grads, state, params):
    if fused:
      params, state = ls.apply_gradients(tx, grads, state, params)
    else:
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params, state, ls.step_metrics(state)

  flags = [True, False, False, True, True, True, False, True]
  want = reference_rule(rule, flags)
  for finite, (scale, _, _, skipped, consecutive) in zip(flags, want, strict=True):
    grads = {"w": jnp.array([1.0, 1.0 if finite else jnp.inf])}
    params, state, m = step(grads, state, params)
    assert set(m) == {
      "loss_scale",
      "applied",
      "skipped_steps",
      "consecutive_skips",
      "skip_reason",
      *(f"skipped_{r}" for r in ls.SKIP_REASONS),
    }
    # Only overflows here: every skip is one, and no other reason counts.
    assert int(m["skip_reason"]) == (0 if finite else 1)
    assert int(m["skipped_overflow"]) == skipped
    assert sum(int(m[f"skipped_{r}"]) for r in ls.SKIP_REASONS[1:]) == 0
    assert m["loss_scale"].dtype == jnp.float32 and float(m["loss_scale"]) == scale
    assert bool(m["applied"]) is finite
    assert (int(m["skipped_steps"]), int(m["consecutive_skips"])) == (
      skipped,
      consecutive,
    )


def test_train_state_and_errors():
  flax = pytest.importorskip("flax")
  del flax
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
  params = {"w": jnp.ones(2)}
  state = ls.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
  out = ls.unscale_gradients({"w": jnp.array([8.0, 16.0])}, state)
  np.testing.assert_array_equal(out["w"], [1.0, 2.0])
  assert float(ls.step_metrics(state)["loss_scale"]) == 8.0
  with pytest.raises(ValueError, match="LossScaleState"):
    ls.unscale_gradients(params, optax.sgd(0.1).init(params))
  with pytest.raises(ValueError, match="LossScaleState"):
    ls.step_metrics(optax.sgd(0.1).init(params))
  with pytest.raises(ValueError):  # consulted only on some steps
    ls.step_metrics(optax.MultiSteps(tx, 2).init(params))


def test_nnx_optimizer():
  nnx = pytest.importorskip("flax.nnx")

  class Lin(nnx.Module):
    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))

  with standard_promotion():
    tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
    optimizer = nnx.Optimizer(Lin(), tx, wrt=nnx.Param)
  out = ls.unscale_gradients({"w": jnp.array([4.0, -8.0])}, optimizer)
  np.testing.assert_array_equal(out["w"], [1.0, -2.0])
  assert int(ls.step_metrics(optimizer)["skipped_steps"]) == 0
