"""What skipping bad steps costs: `apply_gradients` with the loss given and
`SkipSpikes` on, against the same step without them, in one process.

Usage:
  python benchmarks/spikes.py [--params 25e6] [--rounds 30] [--repeats 3]
      [--json benchmarks/results/spikes_cpu.json]

The transformer-shaped float32 tree of `compare.py` (`_bench.gpt_tree`),
donated parameters and state, AdamW: the bare step, `apply_gradients`
(nothing more), `apply_gradients(..., value=loss)` (the loss tested for
being finite), and `apply_gradients(..., value=loss)` with
`SkipSpikes()` (the loss and the unscaled gradient norm tested against
their windows; the norm is one more reduction over the gradients the
finite check reads), timed round after round, interleaved. Each
repetition is a process of its own; the ratios to the bare step are its
medians, and the table gives the median over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCALE = 2.0**15
STEPS = ("apply_gradients", "value=", "value= + SkipSpikes")


def child(n_params: float, rounds: int) -> None:
  sys.path.insert(0, HERE)
  import _bench
  import jax
  import jax.numpy as jnp
  import optax

  import lossscale as ls

  params, grads = _bench.gpt_tree(n_params, jnp.float32)
  scaled = jax.tree.map(lambda g: g * SCALE, grads)
  loss = jnp.float32(2.5)
  adam = optax.adamw(1e-4)
  plain = ls.dynamic_loss_scale(adam, initial_scale=SCALE)
  spiky = ls.dynamic_loss_scale(adam, initial_scale=SCALE, skip_spikes=ls.SkipSpikes())

  def bare(p, s, g, v):
    updates, s = adam.update(g, s, p)
    return optax.apply_updates(p, updates), s

  variants = {
    "bare adamw": (bare, adam.init, grads),
    "apply_gradients": (
      lambda p, s, g, v: ls.apply_gradients(plain, g, s, p),
      plain.init,
      scaled,
    ),
    "value=": (
      lambda p, s, g, v: ls.apply_gradients(plain, g, s, p, value=v),
      plain.init,
      scaled,
    ),
    "value= + SkipSpikes": (
      lambda p, s, g, v: ls.apply_gradients(spiky, g, s, p, value=v),
      spiky.init,
      scaled,
    ),
  }
  runners = {}
  for name, (step, init, g) in variants.items():
    box = [_bench.fresh_copy(params), init(params)]
    with jax.numpy_dtype_promotion("standard"):
      compiled = (
        jax.jit(step, donate_argnums=(0, 1)).lower(box[0], box[1], g, loss).compile()
      )

    def run(box=box, compiled=compiled, g=g):
      box[0], box[1] = compiled(box[0], box[1], g, loss)
      jax.block_until_ready(box[0])

    run()
    run()
    runners[name] = run
  medians = _bench.interleaved_medians(runners, rounds)
  base = medians["bare adamw"]
  env = _bench.environment()
  print(
    json.dumps(
      {
        "environment": env,
        "bare_ms": base * 1e3,
        "ratios": {k: v / base for k, v in medians.items() if k != "bare adamw"},
      }
    )
  )


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=float, default=25e6)
  ap.add_argument("--rounds", type=int, default=30)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--json", default=None)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    child(args.params, args.rounds)
    return 0
  runs = []
  for r in range(args.repeats):
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    cmd += ["--params", str(args.params), "--rounds", str(args.rounds)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    runs.append(json.loads(out.strip().splitlines()[-1]))
    print(
      f"#{r + 1}: " + ", ".join(f"{k} {v:.3f}x" for k, v in runs[-1]["ratios"].items())
    )
  rows = []
  for name in STEPS:
    ratios = [run["ratios"][name] for run in runs]
    rows.append(
      {
        "step": name,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
      }
    )
  base = rows[0]["median"]
  print(
    f"\nfloat32, {args.params / 1e6:g}M params: time / bare AdamW,"
    f" median of {args.repeats}"
  )
  print("| step | time / bare | / apply_gradients |\n|---|---:|---:|")
  for row in rows:
    print(
      f"| {row['step']} | {row['median']:.3f}x ({row['min']:.3f}-{row['max']:.3f}) |"
      f" {row['median'] / base:.3f} |"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(
        {
          "environment": runs[0]["environment"],
          "params": args.params,
          "rounds": args.rounds,
          "rows": rows,
          "runs": runs,
        },
        f,
        indent=1,
      )
  return 0


if __name__ == "__main__":
  sys.exit(main())
