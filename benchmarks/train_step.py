"""A float16 train step (forward, backward, update), with and without loss scaling.

Usage:
  python benchmarks/train_step.py [--width 512] [--depth 4] [--batch 128]
      [--rounds 15] [--json benchmarks/results/train_step_cpu.json]

An MLP with float32 master parameters computes in float16 (parameters and
inputs cast at the start of the forward pass). Variants, interleaved in one
process: no loss scaling (float16 gradients may underflow), and
`lossscale.dynamic_loss_scale(adamw)` driven by `lossscale.value_and_grad`
with `tx.update` + `optax.apply_updates` or with `lossscale.apply_gradients`.
Steps are jitted with `params` and `opt_state` donated.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench

import lossscale as ls


def init_mlp(key, width, depth, d_in, d_out):
  sizes = [d_in] + [width] * depth + [d_out]
  params = {}
  for i, (a, b) in enumerate(itertools.pairwise(sizes)):
    k = jax.random.fold_in(key, i)
    params[f"layer{i}"] = {
      "w": jax.random.normal(k, (a, b), jnp.float32) / jnp.sqrt(a),
      "b": jnp.zeros((b,), jnp.float32),
    }
  return params


def loss_fn(params, x, y):
  h = x.astype(jnp.float16)
  layers = [params[k] for k in sorted(params)]
  for i, layer in enumerate(layers):
    h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)
    if i < len(layers) - 1:
      h = jax.nn.gelu(h)
  # Mean squared error, reduced in float32 (the loss itself stays finite).
  return jnp.mean((h.astype(jnp.float32) - y) ** 2)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--width", type=int, default=512)
  ap.add_argument("--depth", type=int, default=4)
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)

  key = jax.random.key(0)
  d_in, d_out = args.width, 16
  params = init_mlp(key, args.width, args.depth, d_in, d_out)
  x = jax.random.normal(jax.random.fold_in(key, 100), (args.batch, d_in))
  y = jax.random.normal(jax.random.fold_in(key, 101), (args.batch, d_out))
  adam = optax.adamw(1e-4)
  tx = ls.dynamic_loss_scale(adam)
  grad_fn = ls.value_and_grad(loss_fn)

  def no_scaling(p, s):
    _, g = jax.value_and_grad(loss_fn)(p, x, y)
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), s

  def scaled_update(p, s):
    _, g = grad_fn(s, p, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def scaled_apply_gradients(p, s):
    _, g = grad_fn(s, p, x, y)
    return ls.apply_gradients(tx, g, s, p)

  variants = {
    "float16, no loss scaling (adamw)": (no_scaling, adam.init),
    "float16, dynamic_loss_scale: update + apply_updates": (scaled_update, tx.init),
    "float16, dynamic_loss_scale: apply_gradients": (scaled_apply_gradients, tx.init),
  }
  runners, stats = {}, {}
  for name, (step, init) in variants.items():
    box = [_bench.fresh_copy(params), init(params)]
    with jax.numpy_dtype_promotion("standard"):
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(*box).compile()
    stats[name] = _bench.compiled_stats(compiled)

    def run(box=box, compiled=compiled):
      box[0], box[1] = compiled(box[0], box[1])
      jax.block_until_ready(box[0])

    run()
    runners[name] = run

  medians = _bench.interleaved_medians(runners, args.rounds)
  base = medians["float16, no loss scaling (adamw)"]
  n = sum(v.size for v in jax.tree.leaves(params))
  rows, records = [], []
  for name, t in medians.items():
    s = stats[name]
    records.append(
      dict(
        variant=name,
        median_ms=t * 1e3,
        time_vs_no_scaling=t / base,
        temp_mb=s.temp_bytes / 1e6,
        flops=s.flops,
      )
    )
    temp = f"{s.temp_bytes / 1e6:.1f}"
    rows.append([name, f"{t * 1e3:.1f}", f"{t / base:.2f}x", temp])
  table = _bench.markdown_table(
    ["variant", "median ms", "time / no scaling", "temp MB"], rows
  )
  print(f"MLP {args.depth}x{args.width}, {n / 1e6:.2f}M parameters, batch {args.batch}")
  print(table)
  payload = dict(
    benchmark="train_step",
    environment=_bench.environment(),
    parameters=n,
    width=args.width,
    depth=args.depth,
    batch=args.batch,
    rounds=args.rounds,
    results=records,
  )
  _bench.write_outputs("train_step", table, payload, args.json)


if __name__ == "__main__":
  main()
