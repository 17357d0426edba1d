"""What an AdamW step moves with half-precision parameters, side by side.

Usage:
  python benchmarks/half_precision.py [--params 10e6] [--leaves 40]
      [--json benchmarks/results/half_precision_cpu.json]

For float32, bfloat16 and float16 parameters (and gradients of that dtype),
every variant is a jitted `step(params, opt_state, grads) -> (params,
opt_state)` compiled with `donate_argnums=(0, 1)`. Reported per variant:
XLA's `cost_analysis()` bytes accessed and its ratio to the bare step, and
`memory_analysis()` temporary bytes. No timing: these are properties of the
compiled program. The bare reference for float16 parameters is the bare
optimizer with float32 state, the state lossscale gives them.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench

import lossscale as ls

SCALE = 2.0**10
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _variants(adam):
  tx = ls.dynamic_loss_scale(adam, initial_scale=SCALE)
  guarded = optax.apply_if_finite(adam, max_consecutive_errors=10**6)

  def stepper(opt):
    def step(params, state, grads):
      updates, state = opt.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    return step

  def fused(params, state, grads):
    return ls.apply_gradients(tx, grads, state, params)

  return {
    "bare optax.adamw": (adam.init, stepper(adam)),
    "optax.apply_if_finite(adamw)": (guarded.init, stepper(guarded)),
    "lossscale tx.update + apply_updates": (tx.init, stepper(tx)),
    "lossscale apply_gradients": (tx.init, fused),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=float, default=10e6, help="about this many")
  ap.add_argument("--leaves", type=int, default=40)
  ap.add_argument("--json", default=None, help="where to write the JSON")
  args = ap.parse_args(argv)
  per_leaf = int(args.params) // args.leaves
  adam = optax.adamw(1e-3)
  rows, results = [], {}
  for dname, dtype in DTYPES.items():
    params = {f"p{i}": jnp.zeros((per_leaf,), dtype) for i in range(args.leaves)}
    stats = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: int32 ** float
      for name, (init, step) in _variants(adam).items():
        init_params = params
        if name == "bare optax.adamw" and dtype == jnp.float16:
          # float16 parameters get float32 optimizer state in lossscale.
          init_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
        state = init(init_params)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params)
        stats[name] = _bench.compiled_stats(compiled.compile())
    bare = stats["bare optax.adamw"].bytes_accessed
    for name, s in stats.items():
      ratio = s.bytes_accessed / bare
      rows.append(
        [
          dname,
          name,
          f"{s.temp_bytes / 1e6:.1f}",
          f"{s.bytes_accessed / 1e6:.0f}",
          f"{ratio:.2f}x",
        ]
      )
      results[f"{dname}/{name}"] = dict(
        bytes_accessed=s.bytes_accessed, temp_bytes=s.temp_bytes, ratio=ratio
      )
  table = _bench.markdown_table(
    ["params", "step", "temp MB", "bytes accessed MB", "bytes / bare"], rows
  )
  print(table)
  payload = dict(
    benchmark="half_precision",
    environment=_bench.environment(),
    params=per_leaf * args.leaves,
    leaves=args.leaves,
    results=results,
  )
  _bench.write_outputs("half_precision", table, payload, args.json)


if __name__ == "__main__":
  main()
