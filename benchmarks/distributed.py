"""Collectives per step with gradients averaged across 8 (fake CPU) devices.

Usage:
  python benchmarks/distributed.py [--rounds 10] [--json PATH]

A data-parallel step inside `jax.shard_map` over a mesh axis "batch":
gradients are averaged across the axis first, then the optimizer runs. The
table counts the all-reduces in the compiled step (the averaging itself
included) and how many of them are scalars, for the bare optimizer and for
`dynamic_loss_scale` with and without `axis_name`, through `tx.update` and
through `lossscale.apply_gradients`.

Expected: zero extra collectives without `axis_name` (an inf or NaN on any
device propagates through the average, so every device already agrees), and
exactly one extra scalar all-reduce with it.
"""

from __future__ import annotations

import os

# Before JAX initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench

import lossscale as ls

AXIS = "batch"


average_gradients = ls.cross_shard_mean  # TF's CrossShardOptimizer(reduction=MEAN)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=float, default=2e6)
  ap.add_argument("--rounds", type=int, default=10)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  n_dev = len(jax.devices())
  mesh = Mesh(np.array(jax.devices()), (AXIS,))

  shapes = _bench.transformer_shapes(args.params, n_layers=2)
  key = jax.random.key(0)
  params = {
    k: 0.02 * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
    for i, (k, s) in enumerate(shapes.items())
  }
  # One gradient per device, stacked on a leading axis sharded over "batch".
  grads = jax.tree.map(
    lambda p: jnp.broadcast_to(1e-3 * p, (n_dev, *p.shape)) * 2.0**15, params
  )

  adam = optax.adamw(1e-4)
  variants = {
    "adamw (plain)": (optax.chain(average_gradients(AXIS), adam), False),
    "dynamic_loss_scale, no axis_name": (
      optax.chain(average_gradients(AXIS), ls.dynamic_loss_scale(adam)),
      False,
    ),
    "dynamic_loss_scale, axis_name": (
      optax.chain(average_gradients(AXIS), ls.dynamic_loss_scale(adam, axis_name=AXIS)),
      False,
    ),
    "apply_gradients, no axis_name": (
      optax.chain(average_gradients(AXIS), ls.dynamic_loss_scale(adam)),
      True,
    ),
    "apply_gradients, axis_name": (
      optax.chain(average_gradients(AXIS), ls.dynamic_loss_scale(adam, axis_name=AXIS)),
      True,
    ),
  }

  def make_step(tx, fused):
    def step(p, s, g):
      g = jax.tree.map(lambda x: x[0], g)  # this device's gradient
      if fused:
        return ls.apply_gradients(tx, g, s, p)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    return jax.shard_map(
      step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P())
    )

  runners, stats = {}, {}
  for name, (tx, fused) in variants.items():
    box = [_bench.fresh_copy(params), tx.init(params)]
    with jax.numpy_dtype_promotion("standard"):
      jitted = jax.jit(make_step(tx, fused), donate_argnums=(0, 1))
      compiled = jitted.lower(box[0], box[1], grads).compile()
    stats[name] = _bench.compiled_stats(compiled)

    def run(box=box, compiled=compiled):
      box[0], box[1] = compiled(box[0], box[1], grads)
      jax.block_until_ready(box[0])

    run()
    runners[name] = run

  medians = _bench.interleaved_medians(runners, args.rounds)
  base = stats["adamw (plain)"]
  rows, records = [], []
  for name, t in medians.items():
    s = stats[name]
    extra = s.all_reduces - base.all_reduces
    extra_scalar = s.scalar_all_reduces - base.scalar_all_reduces
    records.append(
      dict(
        variant=name,
        all_reduces=s.all_reduces,
        scalar_all_reduces=s.scalar_all_reduces,
        extra_all_reduces=extra,
        extra_scalar_all_reduces=extra_scalar,
        median_ms=t * 1e3,
        time_vs_plain=t / medians["adamw (plain)"],
      )
    )
    rows.append(
      [
        name,
        s.all_reduces,
        s.scalar_all_reduces,
        extra,
        f"{t * 1e3:.1f}",
        f"{t / medians['adamw (plain)']:.2f}x",
      ]
    )
  table = _bench.markdown_table(
    [
      "variant",
      "all-reduces",
      "scalar all-reduces",
      "extra vs plain",
      "median ms",
      "time / plain",
    ],
    rows,
  )
  n = sum(v.size for v in jax.tree.leaves(params))
  print(f"{n_dev} devices, {len(shapes)} leaves, {n / 1e6:.1f}M parameters")
  print(table)
  payload = dict(
    benchmark="distributed",
    environment=_bench.environment(),
    parameters=n,
    leaves=len(shapes),
    rounds=args.rounds,
    results=records,
  )
  _bench.write_outputs("distributed", table, payload, args.json)


if __name__ == "__main__":
  main()
