"""Quickstart: float16 compute, float32 master weights, dynamic loss scaling.

The README's Quickstart is this program, below this docstring.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale as ls


def loss_fn(params, x, y):
  # float32 master parameters, float16 compute, the loss reduced in float32
  pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


tx = ls.dynamic_loss_scale(optax.adamw(3e-2))  # wraps any optax optimizer
params = {"w": jnp.zeros((3, 1))}
opt_state = tx.init(params)


@jax.jit
def train_step(params, opt_state, x, y):
  # The loss, and the gradients of loss * scale (float16 inside the model).
  loss, grads = ls.value_and_grad(loss_fn)(opt_state, params, x, y)
  # Unscale in float32, skip the step if anything overflowed, adjust the scale.
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


# Fixed inputs, computed by NumPy: the same data on every JAX version.
i, j = np.arange(64)[:, None], np.arange(3)
x = jnp.asarray(np.sin(0.9 * (j + 1) * i + j), jnp.float32)
y = x @ jnp.array([[1.0], [-2.0], [0.5]])
for _ in range(300):
  params, opt_state, loss = train_step(params, opt_state, x, y)
print(f"loss {float(loss):.1e}, loss scale {float(ls.get_loss_scale(opt_state)):g},")
print(f"skipped steps {int(opt_state.skipped_steps)}, w {params['w'].ravel()}")
