"""Why loss scaling matters: a small character-level transformer, four ways.

Trains the same decoder-only transformer language model (Flax linen) on the
same text, with the same seed and the same batches, in four modes:

  float32            plain float32, the reference
  float16            float16 compute, float32 master weights, no loss scaling
  float16+scaling    float16 compute with `lossscale.dynamic_loss_scale`
  bfloat16           bfloat16 compute with `lossscale.skip_nonfinite`

The text is the Python standard library's own source (a fixed, sorted
selection of the `.py` files next to `os.py`), so it is on every machine and
nothing is downloaded; every tenth file is held out for validation.

Prints a table (train and validation loss, tokens/s, skipped steps, final loss
scale, gradient elements lost to float16 underflow) and writes `results.json`,
`results.md` and `demo.png` (loss curves, the loss-scale trajectory with the
skipped steps, a histogram of log2|gradient| against float16's range) into
`--out`.

    python examples/demo.py              # default size (a few minutes on 2 cores)
    python examples/demo.py --quick      # tiny, for tests (seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from tqdm.auto import tqdm

import lossscale as ls
from lossscale.flax import TrainState

F16_TINY = 2.0**-24  # smallest float16 subnormal
F16_NORMAL = 2.0**-14  # smallest float16 normal
F16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class Config:
  steps: int = 600
  batch: int = 32
  seq: int = 64
  d_model: int = 64
  layers: int = 2
  heads: int = 4
  lr: float = 3e-3
  warmup: int = 30
  eval_every: int = 50
  eval_batches: int = 8
  corpus_chars: int = 2_000_000
  growth_interval: int = 50  # dynamic_loss_scale's (default 2000: too slow here)


QUICK = Config(
  steps=12,
  batch=4,
  seq=16,
  d_model=16,
  layers=1,
  heads=2,
  warmup=2,
  eval_every=12,  # evaluate at the end only: fewer compilations
  eval_batches=1,
  corpus_chars=100_000,
  growth_interval=4,
)

VOCAB = 128  # ASCII; anything else becomes "?"

MODES = ("float32", "float16", "float16+scaling", "bfloat16")
DTYPES = {
  "float32": jnp.float32,
  "float16": jnp.float16,
  "float16+scaling": jnp.float16,
  "bfloat16": jnp.bfloat16,
}


# --------------------------------------------------------------------- data


def load_corpus(max_chars: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """Character ids of the standard library's source: (train, validation, files)."""
  stdlib = os.path.dirname(os.__file__)
  files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
  train, val, used = [], [], []
  n_train = n_val = 0
  for i, path in enumerate(files):
    with open(path, "rb") as f:
      data = np.frombuffer(f.read(), np.uint8)
    ids = np.where(data < VOCAB, data, ord("?")).astype(np.int32)
    if i % 10 == 9:
      if n_val < max_chars // 10:
        val.append(ids)
        n_val += ids.size
    elif n_train < max_chars:
      train.append(ids)
      n_train += ids.size
    else:
      continue
    used.append(os.path.basename(path))
    if n_train >= max_chars and n_val >= max_chars // 10:
      break
  return np.concatenate(train), np.concatenate(val), used


def batches(data: np.ndarray, n: int, cfg: Config, seed: int) -> np.ndarray:
  """`n` batches of windows of `seq + 1` characters, [n, batch, seq + 1]."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, data.size - cfg.seq - 1, size=(n, cfg.batch))
  return data[starts[..., None] + np.arange(cfg.seq + 1)]


# -------------------------------------------------------------------- model


class Block(nn.Module):
  heads: int
  dtype: Any

  @nn.compact
  def __call__(self, x, mask):
    d = x.shape[-1]
    h = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(
      num_heads=self.heads, dtype=self.dtype, deterministic=True
    )(h, mask=mask)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * d, dtype=self.dtype)(h)
    return x + nn.Dense(d, dtype=self.dtype)(nn.gelu(h))


class CharLM(nn.Module):
  """A decoder-only transformer; float32 parameters, `dtype` compute."""

  cfg: Config
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, ids):
    cfg = self.cfg
    x = nn.Embed(VOCAB, cfg.d_model, dtype=self.dtype)(ids)
    pos = self.param(
      "pos", nn.initializers.normal(0.02), (cfg.seq, cfg.d_model), jnp.float32
    )
    x = x + pos[: ids.shape[-1]].astype(self.dtype)
    mask = nn.make_causal_mask(ids)
    for _ in range(cfg.layers):
      x = Block(cfg.heads, self.dtype)(x, mask)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    logits = nn.Dense(VOCAB, dtype=self.dtype)(x)
    return logits.astype(jnp.float32)  # the loss is reduced in float32


def loss_fn(apply_fn, params, batch):
  logits = apply_fn({"params": params}, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


# ----------------------------------------------------------------- training


def make_state(mode: str, cfg: Config, params) -> train_state.TrainState:
  model = CharLM(cfg, DTYPES[mode])
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps)
  inner = optax.adamw(schedule, weight_decay=0.01)
  if mode == "float16+scaling":
    tx = ls.dynamic_loss_scale(inner, growth_interval=cfg.growth_interval)
  elif mode == "bfloat16":
    tx = ls.skip_nonfinite(inner)
  else:  # float32 and unscaled float16: plain optax, plain Flax TrainState.
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=inner)
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def make_train_step(scaled: bool):
  @jax.jit
  def train_step(state, batch):
    f = lambda p: loss_fn(state.apply_fn, p, batch)
    if scaled:
      # Gradients of loss * scale; apply_gradients divides them back, skips
      # the step when they overflowed, and adjusts the scale.
      loss, grads = ls.value_and_grad(f)(state, state.params)
    else:
      loss, grads = jax.value_and_grad(f)(state.params)
    return state.apply_gradients(grads=grads), loss

  return train_step


@jax.jit
def eval_loss(state, batches):
  return jnp.mean(
    jax.lax.map(lambda b: loss_fn(state.apply_fn, state.params, b), batches)
  )


# The end-of-run gradient probe is split in jitted pieces so that what is
# the same for every mode (the float32 gradient, the comparison) compiles once.


@jax.jit
def scaled_grads(state, batch, scale):
  """Gradients of `loss * scale` in the state's own compute dtype."""
  return jax.grad(lambda p: loss_fn(state.apply_fn, p, batch) * scale)(state.params)


@jax.jit
def compare_grads(own, ref, scale):
  """How the mode's gradients (of loss * scale) differ from float32's.

  Returns the fraction of the nonzero float32 gradient elements that the
  mode's backward pass made exactly zero (lost to underflow), the relative
  error of the unscaled gradients, and `lossscale.float16_range_report` of
  the float32 gradients times the scale (what float16 would lose).
  """
  ref_leaves, own_leaves = jax.tree.leaves(ref), jax.tree.leaves(own)
  nonzero = sum(jnp.sum(r != 0) for r in ref_leaves)
  zeroed = sum(
    jnp.sum(jnp.logical_and(r != 0, o == 0))
    for r, o in zip(ref_leaves, own_leaves, strict=True)
  )
  err = optax.tree.norm(
    jax.tree.map(lambda o, r: o.astype(jnp.float32) / scale - r, own, ref)
  ) / optax.tree.norm(ref)
  report = ls.float16_range_report(jax.tree.map(lambda g: g * scale, ref))
  return zeroed / jnp.maximum(nonzero, 1), err, report


def run_mode(mode, cfg, params, train_batches, val_batches, probe_batch, ref_apply):
  """Trains one mode; `ref_apply` is a float32 state (for its `apply_fn`)."""
  # Jitted: built eagerly, each small op of the initialisation compiles alone.
  state = jax.jit(lambda p: make_state(mode, cfg, p))(params)
  scaled = isinstance(state, TrainState)
  step_fn = make_train_step(scaled=mode == "float16+scaling")
  losses, scales, skipped_at, evals = [], [], [], []
  t_compile = t_train = 0.0
  skipped_before = 0
  bar = tqdm(range(cfg.steps), desc=f"{mode:>16}", unit="step", leave=True)
  for i in bar:
    if scaled:
      scales.append(float(state.loss_scale))  # the scale this step uses
    t0 = time.perf_counter()
    state, loss = step_fn(state, train_batches[i])
    loss = float(loss)
    dt = time.perf_counter() - t0
    if i == 0:
      t_compile = dt
    else:
      t_train += dt
    losses.append(loss)
    if scaled:
      skipped = int(state.skipped_steps)
      if skipped > skipped_before:
        skipped_at.append(i)
      skipped_before = skipped
    if (i + 1) % cfg.eval_every == 0 and i + 1 < cfg.steps:
      evals.append((i + 1, float(eval_loss(state, val_batches))))
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{evals[-1][1]:.3f}")
  bar.close()
  final_scale = float(state.loss_scale) if scaled else None
  # Probe the gradients at the scale of the last applied step (the final
  # scale may just have grown and not been tried yet).
  applied = [s for i, s in enumerate(scales) if i not in set(skipped_at)]
  scale = applied[-1] if applied else 1.0
  evals.append((cfg.steps, float(eval_loss(state, val_batches))))
  ref_state = ref_apply.replace(params=state.params)
  ref_grads = scaled_grads(ref_state, probe_batch, jnp.float32(1.0))
  if mode == "float32":
    own = ref_grads
  else:
    own = scaled_grads(state, probe_batch, jnp.float32(scale))
  zeroed, grad_err, report = compare_grads(own, ref_grads, jnp.float32(scale))
  tokens = (cfg.steps - 1) * cfg.batch * cfg.seq
  return {
    "mode": mode,
    "train_loss": float(np.mean(losses[-max(1, cfg.steps // 20) :])),
    "val_loss": evals[-1][1],
    "tokens_per_s": tokens / t_train if t_train > 0 else float("nan"),
    "compile_s": t_compile,
    "skipped_steps": len(skipped_at) if scaled else None,
    "final_loss_scale": final_scale,
    "probe_loss_scale": scale,
    "grad_zeroed_fraction": float(zeroed),
    "grad_relative_error": float(grad_err),
    "f16_underflow_at_scale": float(report.underflow),
    "f16_overflow_at_scale": float(report.overflow),
    "f16_subnormal_at_scale": float(report.subnormal),
    "losses": losses,
    "evals": evals,
    "scales": scales,
    "skipped_at": skipped_at,
    "_grads": ref_grads,
  }


# ---------------------------------------------------------------- reporting


def table(results: Sequence[dict]) -> str:
  head = (
    "| mode | train loss | val loss | tokens/s | skipped | final scale"
    " | grads zeroed | grad error | f16 underflow at scale |"
  )
  rows = [head, "|" + "---|" * 9]
  for r in results:
    skipped = "-" if r["skipped_steps"] is None else str(r["skipped_steps"])
    scale = "-" if r["final_loss_scale"] is None else f"{r['final_loss_scale']:g}"
    rows.append(
      f"| {r['mode']} | {r['train_loss']:.4f} | {r['val_loss']:.4f}"
      f" | {r['tokens_per_s']:,.0f} | {skipped} | {scale}"
      f" | {r['grad_zeroed_fraction']:.3%} | {r['grad_relative_error']:.1e}"
      f" | {r['f16_underflow_at_scale']:.3%} |"
    )
  return "\n".join(rows)


def _smooth(x: Sequence[float], window: int) -> np.ndarray:
  return np.convolve(np.asarray(x), np.ones(window) / window, mode="valid")


def figure(results: Sequence[dict], cfg: Config, path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = dict(zip(MODES, ["black", "tab:red", "tab:blue", "tab:green"], strict=True))
  fig, axes = plt.subplots(2, 2, figsize=(12, 8))
  window = max(1, cfg.steps // 50)
  f32 = results[0]

  ax = axes[0, 0]
  for r in results:
    smooth = _smooth(r["losses"], window)
    x = np.arange(smooth.size) + window
    ax.plot(x, smooth, color=colors[r["mode"]], lw=1.2, label=r["mode"])
    steps, val = zip(*r["evals"], strict=True)
    ax.plot(steps, val, "o--", color=colors[r["mode"]], ms=3, lw=0.8)
  ax.set(
    xlabel="step", ylabel="loss (nats/char)", title="Loss (lines: train, dots: val)"
  )
  ax.legend(fontsize=8)

  ax = axes[0, 1]
  ref = _smooth(f32["losses"], window)
  for r in results[1:]:
    diff = _smooth(r["losses"], window) - ref
    ax.plot(
      np.arange(diff.size) + window,
      diff,
      color=colors[r["mode"]],
      lw=1.0,
      label=f"{r['mode']} (train)",
    )
    (_, v32), (steps, val) = (
      zip(*f32["evals"], strict=True),
      zip(*r["evals"], strict=True),
    )
    ax.plot(
      steps,
      np.asarray(val) - np.asarray(v32),
      "o--",
      color=colors[r["mode"]],
      ms=3,
      lw=0.8,
    )
  ax.axhline(0.0, color="black", lw=0.8)
  ax.set(
    xlabel="step",
    ylabel="loss - float32 loss",
    title="Difference from float32 (lines: train, dots: val)",
  )
  ax.legend(fontsize=8)

  ax = axes[1, 0]
  r = next(r for r in results if r["mode"] == "float16+scaling")
  steps = np.arange(1, len(r["scales"]) + 1)
  ax.step(
    steps, r["scales"], where="post", color=colors[r["mode"]], label="loss scale used"
  )
  if r["skipped_at"]:
    at = np.asarray(r["skipped_at"])
    ax.plot(
      at + 1,
      np.asarray(r["scales"])[at],
      "x",
      color="tab:red",
      ms=8,
      label=f"skipped step (overflow), {len(at)} in all",
    )
  ax.set_yscale("log", base=2)
  ax.set(xlabel="step", ylabel="loss scale", title="float16 + dynamic_loss_scale")
  ax.legend(fontsize=8)

  ax = axes[1, 1]
  g = np.concatenate([np.ravel(x) for x in jax.tree.leaves(f32["_grads"])])
  logg = np.log2(np.abs(g[g != 0]).astype(np.float64))
  shift = np.log2(r["probe_loss_scale"])
  bins = np.linspace(min(logg.min(), -30), max(logg.max() + shift, 17), 90)
  ax.axvspan(
    np.log2(F16_TINY),
    np.log2(F16_NORMAL),
    color="gold",
    alpha=0.3,
    label="float16 subnormal",
  )
  ax.axvspan(
    np.log2(F16_NORMAL),
    np.log2(F16_MAX),
    color="tab:green",
    alpha=0.12,
    label="float16 normal",
  )
  ax.axvline(
    np.log2(F16_TINY) - 1, color="tab:red", lw=0.8, ls=":", label="below: rounds to 0"
  )
  ax.hist(logg, bins=bins, color="gray", alpha=0.8, label="float32 gradients")
  ax.hist(
    logg + shift,
    bins=bins,
    histtype="step",
    color="tab:blue",
    label=f"x loss scale 2^{shift:g}",
  )
  ax.set_yscale("log")
  ax.set(
    xlabel="log2 |gradient|",
    ylabel="elements",
    title="float32 parameter gradients (end of training) vs float16's range",
  )
  ax.legend(fontsize=8, loc="upper left")

  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)


# --------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> dict:
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
      cfg, steps=args.steps, eval_every=min(cfg.eval_every, args.steps)
    )
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)

  train, val, files = load_corpus(cfg.corpus_chars)
  print(
    f"corpus: {len(files)} standard-library files, {train.size:,} train and"
    f" {val.size:,} validation characters; {jax.device_count()} {jax.default_backend()}"
    f" device(s)"
  )
  train_batches = batches(train, cfg.steps, cfg, args.seed)
  val_batches = jnp.asarray(batches(val, cfg.eval_batches, cfg, args.seed + 1))
  probe_batch = jnp.asarray(batches(train, 1, cfg, args.seed + 2)[0])
  ref = CharLM(cfg, jnp.float32)
  params = jax.jit(ref.init)(
    jax.random.key(args.seed), jnp.zeros((1, cfg.seq), jnp.int32)
  )["params"]
  n_params = sum(x.size for x in jax.tree.leaves(params))
  print(
    f"model: {n_params:,} parameters, {cfg.steps} steps of {cfg.batch}x{cfg.seq} tokens"
  )

  t0 = time.perf_counter()
  ref_state = jax.jit(lambda p: make_state("float32", cfg, p))(params)
  results = [
    run_mode(m, cfg, params, train_batches, val_batches, probe_batch, ref_state)
    for m in MODES
  ]
  wall = time.perf_counter() - t0

  md = table(results)
  f32, f16, f16s = results[0], results[1], results[2]
  gap = (f16s["val_loss"] - f32["val_loss"]) / f32["val_loss"]
  gap_unscaled = (f16["val_loss"] - f32["val_loss"]) / f32["val_loss"]
  summary = "\n".join(
    [
      f"Validation loss vs float32: float16+scaling {gap:+.2%},"
      f" float16 without scaling {gap_unscaled:+.2%}.",
      f"Gradient elements flushed to zero by the float16 backward pass:"
      f" {f16['grad_zeroed_fraction']:.3%} without scaling,"
      f" {f16s['grad_zeroed_fraction']:.3%} with it; gradient error vs float32:"
      f" {f16['grad_relative_error']:.1e} without,"
      f" {f16s['grad_relative_error']:.1e} with.",
      f"Of float32's gradients, float16 would flush"
      f" {f16['f16_underflow_at_scale']:.3%} to zero and keep"
      f" {f16['f16_subnormal_at_scale']:.1%} only as subnormals (without scaling);"
      f" at the loss scale 2^{np.log2(f16s['probe_loss_scale']):g}:"
      f" {f16s['f16_underflow_at_scale']:.3%} and"
      f" {f16s['f16_subnormal_at_scale']:.1%}.",
    ]
  )
  print()
  print(md)
  print()
  print(summary)
  figure(results, cfg, out / "demo.png")
  (out / "results.md").write_text(md + "\n\n" + summary + "\n")
  payload = {
    "config": dataclasses.asdict(cfg),
    "seed": args.seed,
    "parameters": n_params,
    "corpus": {
      "files": files,
      "train_chars": int(train.size),
      "val_chars": int(val.size),
    },
    "wall_seconds": wall,
    "float16_scaling_val_gap": gap,
    "float16_unscaled_val_gap": gap_unscaled,
    "results": [{k: v for k, v in r.items() if not k.startswith("_")} for r in results],
  }
  (out / "results.json").write_text(json.dumps(payload, indent=1))
  print(f"wrote {out / 'demo.png'}, {out / 'results.json'}, {out / 'results.md'}")
  return payload


if __name__ == "__main__":
  main()
