"""Tests of get_loss_scale, scale_loss and value_and_grad (_scaled_grad.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls


def test_get_loss_scale_finds_the_state_anywhere():
  inner = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=64.0)
  tx = optax.chain(optax.clip(1.0), optax.masked(inner, {"w": True}))
  state = tx.init({"w": jnp.ones(2)})
  scale = ls.get_loss_scale(state)
  assert scale.dtype == jnp.float32 and scale.shape == ()
  assert float(scale) == 64.0


def test_get_loss_scale_under_jit():
  tx = ls.static_loss_scale(optax.sgd(0.1), 5.0)
  state = tx.init(jnp.ones(2))
  assert float(jax.jit(ls.get_loss_scale)(state)) == 5.0


def test_get_loss_scale_errors():
  with pytest.raises(ValueError, match="found no"):
    ls.get_loss_scale(optax.adam(1e-3).init(jnp.ones(2)))
  both = optax.chain(
    ls.skip_nonfinite(optax.sgd(1.0)), ls.skip_nonfinite(optax.sgd(1.0))
  )
  with pytest.raises(ValueError, match="found 2"):
    ls.get_loss_scale(both.init(jnp.ones(2)))


def test_scale_loss_is_float32_and_does_not_overflow_float16():
  loss = jnp.float16(60000.0)
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  scaled = ls.scale_loss(loss, tx.init(jnp.ones(1)))
  assert scaled.dtype == jnp.float32
  assert float(scaled) == 60000.0 * 2.0**15
  assert float(ls.scale_loss(jnp.float32(3.0), 4.0)) == 12.0


def test_value_and_grad_scales_gradients_and_returns_unscaled_loss():
  def loss_fn(w, x):
    return jnp.sum((w * x) ** 2), {"n": x.shape[0]}

  w, x = jnp.array([1.0, -2.0]), jnp.array([3.0, 0.5])
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0)
  state = tx.init(w)
  grad_fn = jax.jit(ls.value_and_grad(loss_fn, has_aux=True))
  (loss, aux), grads = grad_fn(state, w, x)
  (ref_loss, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(w, x)
  assert float(loss) == float(ref_loss)
  assert aux == {"n": 2}
  np.testing.assert_allclose(grads, ref_grads * 1024.0)
  # The wrapper divides the scale back out.
  updates, _ = tx.update(grads, state, w)
  np.testing.assert_allclose(updates, -0.1 * ref_grads, rtol=1e-6)


def test_value_and_grad_argnums_tuple():
  f = lambda a, b: jnp.sum(a * b)
  loss, (ga, gb) = ls.value_and_grad(f, argnums=(0, 1))(
    2.0, jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
  )
  assert float(loss) == 11.0
  np.testing.assert_allclose(ga, [6.0, 8.0])
  np.testing.assert_allclose(gb, [2.0, 4.0])


def test_scaling_rescues_float16_gradients_from_underflow():
  w32 = jnp.array([0.5, 0.25], jnp.float32)

  def loss_fn(w, x):  # float16 compute; d loss / d w = 2**-10 * x
    return jnp.float16(2.0**-10) * jnp.sum(w.astype(jnp.float16) * x)

  x = jnp.array([2.0**-20, 3 * 2.0**-21], jnp.float16)
  exact = np.float32(2.0**-10) * np.asarray(x, np.float32)  # ~2**-30
  _, g_plain = jax.value_and_grad(loss_fn)(w32, x)
  np.testing.assert_array_equal(g_plain, [0.0, 0.0])  # flushed to zero
  _, g_scaled = ls.value_and_grad(loss_fn)(2.0**15, w32, x)
  assert g_scaled.dtype == jnp.float32
  np.testing.assert_array_equal(g_scaled / np.float32(2.0**15), exact)
