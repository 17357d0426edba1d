"""One spelling, in the tests, for JAX and optax APIs that moved since JAX 0.4.35.

The suite runs on the newest releases and on the oldest supported ones
(`make test-oldest`). Each shim takes the new API where it exists and the
long-standing one otherwise; none of them warns on either end.
"""

import functools
import inspect
import os

import jax
import optax
import pytest

# `jax.shard_map`; older JAX has only `jax.experimental.shard_map`.
HAS_SHARD_MAP = hasattr(jax, "shard_map")


def shard_map(f=None, /, *, mesh, in_specs, out_specs):
  """`jax.shard_map(f, mesh=..., in_specs=..., out_specs=...)`, also as a decorator."""
  if f is None:
    return functools.partial(
      shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs
    )
  if HAS_SHARD_MAP:
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  from jax.experimental.shard_map import shard_map as experimental_shard_map

  # Its replication checker has no rule for `lax.cond` ("No replication rule
  # for cond"), which the loss-scaling wrappers use: switched off, as that
  # error message advises.
  return experimental_shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def pcast_varying(x, axis_name):
  """`jax.lax.pcast(x, axis_name, to="varying")`: this shard's own copy of `x`.

  Before JAX tracked which values vary across shard_map axes (JAX 0.4.35
  does not), a value inside `shard_map` is already this shard's: the identity.
  """
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, axis_name, to="varying")
  if hasattr(jax.lax, "pvary"):
    return jax.lax.pvary(x, axis_name)
  return x


def enable_x64(enabled=True):
  """The `jax.enable_x64` context manager (`jax.experimental` before it)."""
  if hasattr(jax, "enable_x64"):
    return jax.enable_x64(enabled)
  from jax.experimental import enable_x64 as experimental_enable_x64

  return experimental_enable_x64(enabled)


def set_cpu_device_count(n):
  """Call before JAX starts its backend: `n` CPU devices in this process."""
  if "jax_num_cpu_devices" in jax.config.values:
    jax.config.update("jax_num_cpu_devices", n)
  else:  # older JAX reads the XLA flag when the CPU backend starts
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"


def noisy_sgd(learning_rate, key=0):
  """`optax.noisy_sgd` seeded: `key=` in new optax, `seed=` in old."""
  if "key" in inspect.signature(optax.noisy_sgd).parameters:
    return optax.noisy_sgd(learning_rate, key=key)
  return optax.noisy_sgd(learning_rate, seed=key)


def nnx_optimizer_update(optimizer, model, grads):
  """`optimizer.update(model, grads)`; Flax 0.10's `nnx.Optimizer` holds the model
  itself and takes `update(grads)`."""
  if "model" in inspect.signature(type(optimizer).update).parameters:
    return optimizer.update(model, grads)
  return optimizer.update(grads)


needs_jax_shard_map = pytest.mark.skipif(
  not HAS_SHARD_MAP, reason="shows `jax.shard_map`, which this JAX does not have"
)
