"""One process of the two-process test in test_multiprocess.py (not a test module).

Run as `python _multiprocess_worker.py COORDINATOR PROCESS_ID OUT_JSON CKPT_DIR`:
joins a 2-process JAX job on loopback (2 CPU devices per process, gloo
collectives), trains on a global 4-device mesh with `jax.shard_map`, with an
inf injected into the data of process `BAD_PROCESS` only, then restarts the
scale of a global state with `set_loss_scale` and checkpoints it with orbax
under CKPT_DIR (shared by both processes), and writes what it saw to
OUT_JSON. The parent also imports `train` to compute a single-process
reference on 4 of its own devices.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _compat
import _placements
import lossscale as ls

STEPS = 8
BAD_STEPS = (2, 5)  # steps at which process BAD_PROCESS's data holds an inf
BAD_PROCESS = 1
ROWS, FEATURES, OUTPUTS = 2, 4, 3  # per device


def _loss(params, x, y):
  return jnp.mean(jnp.square(x @ params["w"] + params["b"] - y))


def _global_batch(step: int, n: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(1000 + step)
  x = rng.standard_normal((n * ROWS, FEATURES)).astype(np.float32)
  y = rng.standard_normal((n * ROWS, OUTPUTS)).astype(np.float32)
  return x, y


def train(mesh: jax.sharding.Mesh, bad_positions: list[int]) -> dict:
  """Two loops on `mesh` (axis "batch"); returns per-step scales and params.

  `bad_positions` are the mesh positions whose rows get an inf at BAD_STEPS;
  in the child processes these are the positions of BAD_PROCESS's devices
  (only that process ever builds those rows).
  """
  n = mesh.devices.size
  data_sharding = NamedSharding(mesh, P("batch"))

  def batch(step):
    x, y = _global_batch(step, n)
    if step in BAD_STEPS:
      for i in bad_positions:
        x[i * ROWS, 0] = np.inf
    # Each process materialises only its own devices' rows.
    make = lambda a: jax.make_array_from_callback(
      a.shape, data_sharding, lambda i: a[i]
    )
    return make(x), make(y)

  def local(a):  # this process's copy of a replicated array
    return np.asarray(a.addressable_data(0))

  # Loop A: the data-parallel recipe; no axis name on the wrapper.
  tx = optax.chain(
    ls.cross_shard_mean("batch"),
    ls.dynamic_loss_scale(optax.adamw(1e-2), initial_scale=2.0**8, growth_interval=2),
  )

  @jax.jit
  @_compat.shard_map(
    mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")), out_specs=P()
  )
  def step_a(params, opt_state, x, y):
    def scaled_loss(p):
      return ls.scale_loss(_loss(p, x, y), opt_state)

    grads = jax.grad(scaled_loss)(_compat.pcast_varying(params, "batch"))
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {
    "w": jnp.full((FEATURES, OUTPUTS), 0.1, jnp.float32),
    "b": jnp.zeros((OUTPUTS,), jnp.float32),
  }
  replicated = NamedSharding(mesh, P())
  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  scales_a, skipped_a = [], []
  for t in range(STEPS):
    params, opt_state = step_a(params, opt_state, *batch(t))
    scales_a.append(float(local(ls.get_loss_scale(opt_state))))
    skipped_a.append(int(local(opt_state[1].skipped_steps)))

  # Loop B: each device trains its own copy (no averaging); only the
  # wrapper's `axis_name` keeps the skip decision in step.
  tx_b = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=2.0**8, growth_interval=2, axis_name="batch"
  )

  @jax.jit
  @_compat.shard_map(
    mesh=mesh,
    in_specs=(P("batch"), P(), P("batch"), P("batch")),
    out_specs=(P("batch"), P()),
  )
  def step_b(params, opt_state, x, y):
    params = jax.tree.map(lambda a: a[0], params)
    grads = jax.grad(lambda p: ls.scale_loss(_loss(p, x, y), opt_state))(params)
    updates, opt_state = tx_b.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return jax.tree.map(lambda a: a[None], params), opt_state

  stacked = jax.tree.map(
    lambda a: jnp.broadcast_to(a, (n, *a.shape)), jax.tree.map(local, params)
  )
  params_b = jax.device_put(stacked, data_sharding)
  state_b = jax.device_put(tx_b.init(jax.tree.map(lambda a: a[0], stacked)), replicated)
  scales_b, skipped_b = [], []
  for t in range(STEPS):
    params_b, state_b = step_b(params_b, state_b, *batch(t))
    scales_b.append(float(local(state_b.loss_scale)))
    skipped_b.append(int(local(state_b.skipped_steps)))

  # Mesh position -> that device's copy of loop B's params (local ones only).
  position = {d: i for i, d in enumerate(mesh.devices.flat)}
  params_b_local = {}
  for name, a in params_b.items():
    for shard in a.addressable_shards:
      params_b_local.setdefault(str(position[shard.device]), {})[name] = np.asarray(
        shard.data
      )[0].tolist()
  return {
    "scales_a": scales_a,
    "skipped_a": skipped_a,
    "params_a": {k: local(v).tolist() for k, v in params.items()},
    "params_a_hex": {k: local(v).tobytes().hex() for k, v in params.items()},
    "scales_b": scales_b,
    "skipped_b": skipped_b,
    "params_b": params_b_local,
  }


class _LossScaleState01(NamedTuple):
  """lossscale 0.1.0's layout of the state."""

  loss_scale: Any
  good_steps: Any
  hysteresis_left: Any
  skipped_steps: Any
  consecutive_skips: Any
  inner_state: Any


_ADDED_SINCE_01 = (
  "last_finite",
  "steps_since_rescale",
  "overflows_since_backoff",
  "overflows_at_min_scale",
)


def set_scale_and_save(mesh: jax.sharding.Mesh, directory: str) -> dict:
  """`set_loss_scale` on a state spread over every process's devices, saved
  and restored with orbax; returns what the restored state holds."""
  import orbax.checkpoint as ocp

  tx = ls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9), initial_scale=2.0**8)
  replicated = NamedSharding(mesh, P())
  params = jax.device_put({"w": jnp.ones((FEATURES,), jnp.float32)}, replicated)
  state = jax.jit(tx.init, out_shardings=replicated)(params)
  # A jitted step leaves the scale a global array on the whole mesh.
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  state = ls.set_loss_scale(state, 2.0**10)
  leaves = {"loss_scale": state.loss_scale, "good_steps": state.good_steps}
  result = {
    "reset_global": [not x.is_fully_addressable for x in leaves.values()],
    "reset_sharding_kept": [
      x.sharding == replicated and x.ndim == 0 for x in leaves.values()
    ],
  }
  # A state of lossscale 0.1.0's layout (five counters), upgraded: the
  # fields it gains are global arrays like the ones it had.
  old = _LossScaleState01(*state[:5], state.inner_state)
  upgraded = ls.upgrade_state(old)
  added = [getattr(upgraded, n) for n in _ADDED_SINCE_01]
  result["upgraded_global"] = [not x.is_fully_addressable for x in added]
  result["upgraded_sharding_kept"] = [x.sharding == replicated for x in added]
  # orbax 0.11.5 (the oldest test stack) synchronises processes through a
  # call the distributed client of JAX 0.4.35 lacks: no multi-process save.
  client = ocp.multihost.get_jax_distributed_client()
  if not hasattr(client, "key_value_try_get"):
    return result
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(f"{directory}/reset", state)
    checkpointer.save(f"{directory}/upgraded", upgraded)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(f"{directory}/reset", state)
    back = checkpointer.restore(f"{directory}/upgraded", upgraded)
  result["upgraded_restored"] = [
    int(np.asarray(getattr(back, n).addressable_data(0))) for n in _ADDED_SINCE_01
  ]
  return result | {
    "restored_scale": float(restored.loss_scale.addressable_data(0)),
    "restored_good_steps": int(restored.good_steps.addressable_data(0)),
    "restored_momentum": np.asarray(
      restored.inner_state[0].trace["w"].addressable_data(0)
    ).tolist(),
  }


SPIKE_STEP, NAN_STEP = 6, 3  # process BAD_PROCESS's loss: a spike, then a NaN


def skip_reasons(mesh: jax.sharding.Mesh, bad_positions: list[int]) -> dict:
  """The recommended chain given each device's own loss (`value=`), with
  spike skipping: one process's rows turn the loss NaN at NAN_STEP and make
  it spike at SPIKE_STEP. Returns per-step reasons, scales and windows."""
  n = mesh.devices.size
  spikes = ls.SkipSpikes(window=4, warmup=3, sigmas=3.0, grad_norm=False)
  tx = optax.chain(
    ls.cross_shard_mean("batch"),
    ls.dynamic_loss_scale(optax.sgd(0.01), initial_scale=2.0**8, skip_spikes=spikes),
  )

  @jax.jit
  @_compat.shard_map(
    mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")), out_specs=P()
  )
  def step(params, opt_state, x, y):
    params_v = _compat.pcast_varying(params, "batch")
    loss, grads = ls.value_and_grad(_loss)(opt_state, params_v, x, y)
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, opt_state, params, value=loss)
    return optax.apply_updates(params, updates), opt_state

  sharding = NamedSharding(mesh, P("batch"))
  replicated = NamedSharding(mesh, P())
  params = jax.device_put(
    {"w": jnp.zeros((FEATURES, OUTPUTS)), "b": jnp.zeros(3)}, replicated
  )
  opt_state = jax.device_put(tx.init(params), replicated)
  reasons, scales, windows = [], [], []
  for t in range(8):
    x, y = _global_batch(100 + t, n)
    for pos in bad_positions:
      rows = slice(pos * ROWS, (pos + 1) * ROWS)
      y[rows] *= 30.0 if t == SPIKE_STEP else 1.0
      y[rows] = np.nan if t == NAN_STEP else y[rows]
    make = lambda a: jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])
    params, opt_state = step(params, opt_state, make(x), make(y))
    state = opt_state[1]
    local = lambda a: np.asarray(a.addressable_data(0))
    reasons.append(int(local(state.last_skip_reason)))
    scales.append(float(local(state.loss_scale)))
    windows.append(local(state.spike_window.values).tobytes().hex())
  return {"reasons": reasons, "reason_scales": scales, "windows": windows}


# Placements of `cross_shard_mean` (tests/_placements.py) across the two
# processes: the inf is in the last device's gradients, process 1's.
PLACEMENTS = ("inside", "after", "hand-written pmean, after")


def placements() -> dict:
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
  put = lambda a, sharding: jax.make_array_from_callback(
    a.shape, sharding, lambda i: a[i]
  )
  with jax.numpy_dtype_promotion("standard"):  # optax's Adam
    return {
      f"{style}: {name}": _placements.outcome(
        name, style, "shard_map", mesh=mesh, put=put
      )
      for style in ("update", "apply_gradients")
      for name in PLACEMENTS
    }


def main(coordinator: str, process_id: int, out_path: str, ckpt_dir: str) -> None:
  jax.config.update("jax_platforms", "cpu")
  _compat.set_cpu_device_count(2)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.distributed.initialize(
    coordinator_address=coordinator,
    num_processes=2,
    process_id=process_id,
    initialization_timeout=120,
  )
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
    bad = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == BAD_PROCESS]
    result = train(mesh, bad)
    result.update(set_scale_and_save(mesh, ckpt_dir))
    result.update(skip_reasons(mesh, bad))
    result["placements"] = placements()
    result.update(
      process_index=jax.process_index(),
      process_count=jax.process_count(),
      device_count=jax.device_count(),
      local_device_count=jax.local_device_count(),
      bad_positions=bad,
    )
    with open(out_path, "w") as f:
      json.dump(result, f)
  finally:
    jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
