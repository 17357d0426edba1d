"""Equinox models with lossscale: value_and_grad, tx.update and the fused step."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import assert_trees_equal, standard_promotion

eqx = pytest.importorskip("equinox")

SCALE = 2.0**10


def _mlp(seed=0):
  return eqx.nn.MLP(2, 1, 8, 1, key=jax.random.key(seed))


def _data():
  x = jax.random.normal(jax.random.key(1), (16, 2))
  y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:]
  return x, y


def _loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _params(model):
  return eqx.filter(model, eqx.is_inexact_array)


def _poison(grads):
  """`grads` with an inf in its first leaf only."""
  leaves, treedef = jax.tree.flatten(grads)
  leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.inf)
  return jax.tree.unflatten(treedef, leaves)


def test_gradients_equal_filter_value_and_grad_of_the_scaled_loss():
  model, (x, y) = _mlp(), _data()
  loss, grads = ls.value_and_grad(_loss)(SCALE, model, x, y)
  scaled = lambda m, x, y: _loss(m, x, y) * jnp.float32(SCALE)
  ref_scaled, ref = eqx.filter_value_and_grad(scaled)(model, x, y)
  assert loss.dtype == jnp.float32
  np.testing.assert_array_equal(loss * np.float32(SCALE), ref_scaled)
  # Same tree as the model, None at the activation functions.
  assert_trees_equal(grads, ref)
  assert jax.tree.structure(grads) == jax.tree.structure(_params(model))
  assert grads.activation is None


class _Mixed(eqx.Module):
  w: jax.Array
  b16: jax.Array
  count: jax.Array  # integer array: not differentiated
  gain: float  # Python float: not an array, not differentiated
  act: object  # a function


def test_non_array_and_integer_leaves_get_none_as_in_equinox():
  m = _Mixed(
    w=jnp.array([1.0, -2.0]),
    b16=jnp.array([0.5], jnp.float16),
    count=jnp.array(3, jnp.int32),
    gain=3.0,
    act=jnp.tanh,
  )

  def loss_fn(m, x):
    h = m.act(m.w * x) * m.gain + m.b16.astype(jnp.float32)
    return jnp.sum(h**2) + m.count.astype(jnp.float32)

  x = jnp.array([0.3, 0.7])
  scaled = lambda m, x: loss_fn(m, x) * jnp.float32(SCALE)
  (loss, aux), grads = ls.value_and_grad(lambda m, x: (loss_fn(m, x), 1), has_aux=True)(
    SCALE, m, x
  )
  _, ref = eqx.filter_value_and_grad(scaled)(m, x)
  assert aux == 1
  assert_trees_equal(grads, ref)
  assert grads.count is None and grads.act is None and grads.gain is None
  assert grads.b16.dtype == jnp.float16
  np.testing.assert_array_equal(loss, loss_fn(m, x))


def _train(step, model, opt_state, x, y, n):
  losses = []
  for _ in range(n):
    model, opt_state, loss = step(model, opt_state, x, y)
    losses.append(float(loss))
  return model, opt_state, losses


def test_filter_jit_training_matches_plain_adam_and_decreases_the_loss():
  tx = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE)
  ref_tx = optax.adam(1e-2)

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    loss, grads = ls.value_and_grad(_loss)(opt_state, model, x, y)
    updates, opt_state = tx.update(grads, opt_state, _params(model))
    return eqx.apply_updates(model, updates), opt_state, loss

  @eqx.filter_jit
  def ref_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    updates, opt_state = ref_tx.update(grads, opt_state, _params(model))
    return eqx.apply_updates(model, updates), opt_state, loss

  model, (x, y) = _mlp(), _data()
  with standard_promotion():  # optax's adam is not strict-clean
    _, opt_state, losses = _train(step, model, tx.init(_params(model)), x, y, 30)
    _, _, ref_losses = _train(ref_step, model, ref_tx.init(_params(model)), x, y, 30)
  assert losses[-1] < 0.5 * losses[0]
  # The scale is a power of two: scaling and unscaling are exact.
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert float(ls.get_loss_scale(opt_state)) == SCALE
  assert int(opt_state.skipped_steps) == 0


def test_skipped_step_leaves_the_model_bit_for_bit_and_backs_off():
  tx = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE)

  @eqx.filter_jit
  def apply(model, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, _params(model))
    return eqx.apply_updates(model, updates), opt_state

  model, (x, y) = _mlp(), _data()
  opt_state = tx.init(_params(model))
  with standard_promotion():
    _, grads = ls.value_and_grad(_loss)(opt_state, model, x, y)
    model, opt_state = apply(model, opt_state, grads)  # one finite step
    _, grads = ls.value_and_grad(_loss)(opt_state, model, x, y)
    new_model, new_state = apply(model, opt_state, _poison(grads))
  assert_trees_equal(_params(new_model), _params(model))
  assert new_model.activation is model.activation
  assert_trees_equal(new_state.inner_state, opt_state.inner_state)
  assert float(ls.get_loss_scale(new_state)) == SCALE / 2
  assert int(new_state.skipped_steps) == 1


def test_fused_apply_gradients_trains_and_skips():
  tx = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE)

  @eqx.filter_jit
  def step(model, opt_state, x, y, poison):
    loss, grads = ls.value_and_grad(_loss)(opt_state, model, x, y)
    grads = jax.lax.cond(poison, _poison, lambda g: g, grads)
    params, opt_state = ls.apply_gradients(tx, grads, opt_state, _params(model))
    return eqx.combine(params, model), opt_state, loss

  model, (x, y) = _mlp(), _data()
  opt_state = tx.init(_params(model))
  losses = []
  with standard_promotion():
    for _ in range(30):
      model, opt_state, loss = step(model, opt_state, x, y, False)
      losses.append(float(loss))
    new_model, new_state, _ = step(model, opt_state, x, y, True)
  assert losses[-1] < 0.5 * losses[0]
  assert_trees_equal(_params(new_model), _params(model))
  assert float(ls.get_loss_scale(new_state)) == SCALE / 2
  assert int(new_state.skipped_steps) == 1


def test_lossscale_does_not_import_equinox():
  code = "import sys, lossscale; sys.exit('equinox' in sys.modules)"
  assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
