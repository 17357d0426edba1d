"""Where `cross_shard_mean` (or any collective) stands relative to a wrapper.

Not a test module: `test_placements.py` runs `python _placements.py MAPPER
STYLE` in a subprocess with a timeout (a placement that hangs must fail the
suite, not stall it), and `_multiprocess_worker.py` calls `run` on a mesh
that spans two processes. Each placement trains two steps on replicas whose
gradients differ: at the first, replica 1's hold an inf; the second is
finite everywhere. It prints one JSON line per placement.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # before JAX initialises
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import _compat
import lossscale as ls

csm = ls.cross_shard_mean


def _pmean(axis):  # a collective written by hand
  return optax.stateless(lambda u, p=None: jax.lax.pmean(u, axis))


def _inner():
  return optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.1))


# name -> (the transformation, the scale a skipped first step leaves)
PLACEMENTS = {
  "before": lambda: optax.chain(csm("i"), ls.dynamic_loss_scale(_inner())),
  "inside": lambda: ls.dynamic_loss_scale(optax.chain(csm("i"), _inner())),
  "inside, axis_name": lambda: ls.dynamic_loss_scale(
    optax.chain(csm("i"), _inner()), axis_name="i"
  ),
  "after": lambda: optax.chain(ls.dynamic_loss_scale(_inner()), csm("i")),
  "after, axis_name": lambda: optax.chain(
    ls.dynamic_loss_scale(_inner(), axis_name="i"), csm("i")
  ),
  "static, inside": lambda: ls.static_loss_scale(
    optax.chain(csm("i"), _inner()), 128.0
  ),
  "skip_nonfinite, inside": lambda: ls.skip_nonfinite(optax.chain(csm("i"), _inner())),
  "hand-written pmean, inside": lambda: ls.dynamic_loss_scale(
    optax.chain(_pmean("i"), _inner())
  ),
  "hand-written pmean, after": lambda: optax.chain(
    ls.dynamic_loss_scale(_inner()), _pmean("i")
  ),
}

GRADS = [  # per step: every replica's gradients but the last's, the last's
  np.array([[1.0, 2.0, 3.0], [1.0, np.inf, 3.0]], np.float32),
  np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], np.float32),
]


def _rows(g, n):
  return np.concatenate([np.repeat(g[:1], n - 1, 0), g[1:]])


def _step_fn(tx, style):
  def step(g, s, p):
    if style == "apply_gradients":
      return ls.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step


def _local(a):
  return np.concatenate([np.asarray(s.data) for s in a.addressable_shards]).tolist()


def run(name, style, mapper, mesh=None, put=None):
  """Two steps of placement `name`; per replica: scales, skipped, params.

  `mapper` is "pmap" or "shard_map"; `put(array, sharding)` makes a global
  array (multi-process); by default `jax.device_put`.
  """
  tx = PLACEMENTS[name]()
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  step = _step_fn(tx, style)
  n = 2 if mesh is None else mesh.devices.size
  stacked = jax.tree.map(lambda a: jnp.stack([a] * n), (params, state))
  if mapper == "pmap":
    mapped = jax.pmap(step, axis_name="i")
    put = lambda a, _: a
  else:
    mesh = mesh or Mesh(np.array(jax.devices()[:2]), ("i",))
    put = put or jax.device_put

    def body(g, s, p):  # each replica's own state (P("i")): drift shows
      first = lambda t: jax.tree.map(lambda a: a[0], t)
      return jax.tree.map(lambda a: a[None], step(first(g), first(s), first(p)))

    spec = P("i")
    mapped = jax.jit(_compat.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  sharding = None if mesh is None else NamedSharding(mesh, P("i"))
  stacked = jax.tree.map(lambda a: put(np.asarray(a), sharding), stacked)
  p, s = stacked
  out = {"scales": [], "skipped": [], "params": []}
  for g in GRADS:
    p, s = mapped({"w": put(_rows(g, n), sharding)}, s, p)
    out["scales"].append(_local(ls.get_loss_scale(s)))
    out["skipped"].append(_local(optax.tree_utils.tree_get(s, "skipped_steps")))
    out["params"].append(np.asarray(_local(p["w"])).tolist())
  return out


def outcome(name, style, mapper, **kwargs):
  try:
    result = run(name, style, mapper, **kwargs)
  except ValueError as e:
    return {"placement": name, "error": str(e)}
  return {"placement": name, **result}


if __name__ == "__main__":
  mapper, style = sys.argv[1:3]
  # Users' default (the suite's strict promotion may reach here through the
  # environment): optax's Adam mixes its int32 count with Python floats.
  jax.config.update("jax_numpy_dtype_promotion", "standard")
  for name in sys.argv[3:] or PLACEMENTS:
    print(json.dumps(outcome(name, style, mapper)), flush=True)
