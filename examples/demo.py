"""Why loss scaling matters: a small character-level transformer, four ways.

Trains the same decoder-only transformer language model (Flax linen) on the
same text, with the same seed and the same batches, in four modes:

  float32            plain float32, the reference
  float16            float16 compute, float32 master weights, no loss scaling
  float16+scaling    float16 compute with `lossscale.dynamic_loss_scale`
  bfloat16           bfloat16 compute with `lossscale.skip_nonfinite`

then measures, at the float32 run's final parameters, how far float16's
gradients are from float32's, with and without loss scaling, as the tokens in
one backward pass grow from 2k to 128k.

Prints tables and writes `results.json`, `results.md` and `demo.png` into
`--out`. The pieces: `config.py` (settings), `data.py` (the corpus: the Python
standard library's source), `model.py`, `train.py` (the optimizer and the
train step: the lossscale part), `probe.py` (gradient measurements) and
`report.py` (tables and figure).

    python examples/demo.py              # default size (about 5 minutes on 2 cores)
    python examples/demo.py --quick      # tiny, for tests (seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import data
import jax
import jax.numpy as jnp
import probe
import report
import train
from config import MODES, QUICK, Config
from model import CharLM


def parse_config(argv: Sequence[str] | None) -> tuple[Config, argparse.Namespace]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=None, help="training steps per mode")
  parser.add_argument("--out", default="demo_out", help="output directory")
  parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  cfg = QUICK if args.quick else Config()
  if args.steps is not None:
    if args.steps < 2:
      parser.error(f"--steps must be at least 2, got {args.steps}")
    cfg = dataclasses.replace(
      cfg,
      steps=args.steps,
      eval_every=min(cfg.eval_every, args.steps),
      warmup=min(cfg.warmup, args.steps // 2),  # the schedule needs steps > warmup
    )
  return cfg, args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  cfg, args = parse_config(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t_start = time.perf_counter()

  train_ids, val_ids, files = data.load_corpus(cfg.corpus_chars)
  print(
    f"corpus: {len(files)} standard-library files, {train_ids.size:,} train and"
    f" {val_ids.size:,} validation characters; {jax.device_count()}"
    f" {jax.default_backend()} device(s)"
  )
  train_batches = data.batches(train_ids, cfg.steps, cfg.batch, cfg.seq, args.seed)
  val_batches = jnp.asarray(
    data.batches(val_ids, cfg.eval_batches, cfg.batch, cfg.seq, args.seed + 1)
  )
  probe_batch = jnp.asarray(
    data.batches(train_ids, 1, cfg.batch, cfg.seq, args.seed + 2)[0]
  )
  params = jax.jit(CharLM(cfg).init)(
    jax.random.key(args.seed), jnp.zeros((1, cfg.seq), jnp.int32)
  )["params"]
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f"model: {n_params:,} parameters, {cfg.steps} steps of {cfg.batch}x{cfg.seq} tokens"
  )

  t0 = time.perf_counter()
  results, states = [], {}
  for mode in MODES:
    result, states[mode] = train.run_mode(
      mode, cfg, params, train_batches, val_batches, probe_batch
    )
    results.append(result)
  wall = time.perf_counter() - t0

  # The mechanism: one model (float32's final parameters), real text, ever
  # more tokens in one backward pass of the mean loss.
  t0 = time.perf_counter()
  final32 = states["float32"].params
  windows = data.batches(
    train_ids, 1, cfg.sweep_max_tokens // cfg.seq, cfg.seq, args.seed + 3
  )[0]
  points = probe.sweep(cfg, final32, windows)
  sweep_wall = time.perf_counter() - t0

  md = "\n\n".join(
    [
      report.table(results),
      report.sweep_table(points, cfg.sweep_scale),
      report.summary(results, points, cfg),
    ]
  )
  print()
  print(md)
  grads32 = probe.grads(cfg, jnp.float32, final32, probe_batch, jnp.float32(1.0))
  report.figure(results, points, grads32, cfg, out / "demo.png")
  (out / "results.md").write_text(md + "\n")
  by_mode = {r.mode: r for r in results}
  payload = {
    "config": dataclasses.asdict(cfg),
    "seed": args.seed,
    "parameters": n_params,
    "corpus": {
      "files": files,
      "train_chars": int(train_ids.size),
      "val_chars": int(val_ids.size),
    },
    "wall_seconds": wall,
    "sweep_seconds": sweep_wall,
    "float16_scaling_val_gap": report.val_gap(
      by_mode["float16+scaling"], by_mode["float32"]
    ),
    "float16_unscaled_val_gap": report.val_gap(by_mode["float16"], by_mode["float32"]),
    "results": results,
    "gradient_error_vs_tokens": {"loss_scale": cfg.sweep_scale, "points": points},
  }
  report.write_json(out / "results.json", payload)
  total = time.perf_counter() - t_start
  print(
    f"wrote {out / 'demo.png'}, {out / 'results.json'}, {out / 'results.md'}"
    f" in {total / 60:.1f} minutes"
  )
  return payload


if __name__ == "__main__":
  main()
