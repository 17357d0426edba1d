"""The finite check alone, in the formulations tried, against a bare step.

Usage:
  python benchmarks/finite_check.py [--rounds 20]
      [--json benchmarks/results/finite_check_cpu.json]

For float32 gradients of the GPT-shaped tree of `optimizer_step.py` (25M
parameters, 148 leaves) and bfloat16 ones (10M), each formulation of "is
every element finite?" is jitted over the whole tree, one reduction per
leaf, and timed interleaved with the bare `optax.adamw` step on the same
tree (donated). Reported: the median time of the check alone, as a ratio
to the bare step (what a check before the first write adds to it), and
its temporaries. `lossscale.all_finite` is the library's own check (the
formulation its wrappers use when the unscale factor is at most 1).
"""

from __future__ import annotations

import argparse
import functools
import operator
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench

import lossscale as ls


def _each_leaf(check):
  def tree_check(tree, factor):
    flags = [check(x, factor) for x in jax.tree.leaves(tree)]
    return functools.reduce(operator.and_, flags)

  return tree_check


def _wide(x):
  return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x


def _variadic(x, factor):
  # `x - x` and `|x|` in one variadic reduction (no scalar operand), the
  # unscale factor applied to the largest magnitude: lossscale's XLA:CPU
  # check from 27adafb until this formulation's A/B.
  x = _wide(x)
  zero, largest = jax.lax.reduce(
    (x - x, jnp.abs(x)),
    (jnp.zeros([], x.dtype), jnp.zeros([], x.dtype)),
    lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])),
    tuple(range(x.ndim)),
  )
  return jnp.isfinite(zero) & jnp.isfinite(largest * factor)


FORMULATIONS = {
  "lossscale.all_finite: sum(x - x)": lambda tree, factor: ls.all_finite(tree),
  "sum(t - t), t = x * factor (float32)": _each_leaf(
    lambda x, f: jnp.isfinite(jnp.sum(_wide(x) * f - _wide(x) * f))
  ),
  "variadic sum(x - x) and max|x| (float32)": _each_leaf(_variadic),
  "all(isfinite(x)) (optax, jmp, Flax)": _each_leaf(
    lambda x, f: jnp.all(jnp.isfinite(x))
  ),
}


def _case(dtype, n_params, rounds):
  params, grads32 = _bench.gpt_tree(n_params, dtype)
  grads = jax.tree.map(lambda g: g.astype(dtype), grads32)
  factor = jnp.float32(2.0**-15)
  adam = optax.adamw(1e-4)

  def bare(p, s, g):
    updates, s = adam.update(g, s, p)
    return optax.apply_updates(p, updates), s

  runners, temps = {}, {}
  box = [_bench.fresh_copy(params), adam.init(params)]
  with jax.numpy_dtype_promotion("standard"):
    compiled = jax.jit(bare, donate_argnums=(0, 1)).lower(*box, grads).compile()

  def run_bare(box=box, compiled=compiled):
    box[0], box[1] = compiled(box[0], box[1], grads)
    jax.block_until_ready(box[0])

  runners["bare adamw step"] = run_bare
  for name, check in FORMULATIONS.items():
    compiled = jax.jit(check).lower(grads, factor).compile()
    temps[name] = compiled.memory_analysis().temp_size_in_bytes
    assert bool(compiled(grads, factor)), name

    def run(compiled=compiled):
      jax.block_until_ready(compiled(grads, factor))

    runners[name] = run
  for run in runners.values():
    run()
  medians = _bench.interleaved_medians(runners, rounds)
  base = medians["bare adamw step"]
  return [
    dict(
      dtype=jnp.dtype(dtype).name,
      parameters=sum(x.size for x in jax.tree.leaves(params)),
      leaves=len(params),
      variant=name,
      median_ms=t * 1e3,
      vs_bare_step=t / base,
      temp_mb=temps.get(name, 0) / 1e6,
    )
    for name, t in medians.items()
  ]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=20)
  ap.add_argument("--json", default=None, help="where to write the JSON")
  args = ap.parse_args(argv)
  records = []
  for dtype, n in ((jnp.float32, 25e6), (jnp.bfloat16, 10e6)):
    records += _case(dtype, n, args.rounds)
  rows = [
    [
      r["dtype"],
      r["variant"],
      f"{r['median_ms']:.2f}",
      f"{r['vs_bare_step']:.2f}x",
      f"{r['temp_mb']:.1f}",
    ]
    for r in records
  ]
  table = _bench.markdown_table(
    ["gradients", "check", "median ms", "time / bare step", "temp MB"], rows
  )
  print(table)
  payload = dict(
    benchmark="finite_check",
    environment=_bench.environment(),
    rounds=args.rounds,
    results=records,
  )
  _bench.write_outputs("finite_check", table, payload, args.json)


if __name__ == "__main__":
  main()
