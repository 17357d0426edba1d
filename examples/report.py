"""What the demo prints and writes: tables, a summary, `demo.png`, `results.json`."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from config import MODES, Config
from probe import SweepPoint
from train import ModeResult

F16_TINY = 2.0**-24  # smallest float16 subnormal
F16_NORMAL = 2.0**-14  # smallest float16 normal
F16_MAX = 65504.0


def table(results: Sequence[ModeResult]) -> str:
  head = (
    "| mode | train loss | val loss | tokens/s | skipped | final scale"
    " | grads zeroed | grad error | f16 underflow at scale |"
  )
  rows = [head, "|" + "---|" * 9]
  for r in results:
    skipped = "-" if r.skipped_steps is None else str(r.skipped_steps)
    scale = "-" if r.final_loss_scale is None else f"{r.final_loss_scale:g}"
    rows.append(
      f"| {r.mode} | {r.train_loss:.4f} | {r.val_loss:.4f}"
      f" | {r.tokens_per_s:,.0f} | {skipped} | {scale}"
      f" | {r.grad_zeroed_fraction:.3%} | {r.grad_relative_error:.1e}"
      f" | {r.f16_underflow_at_scale:.3%} |"
    )
  return "\n".join(rows)


def sweep_table(points: Sequence[SweepPoint], scale: float) -> str:
  s = f"2^{np.log2(scale):g}"
  rows = [
    "| tokens per backward pass | float16 grad error, no scaling"
    f" | float16 grad error, scale {s} | grads zeroed, no scaling"
    f" | grads zeroed, scale {s} |",
    "|" + "---|" * 5,
  ]
  for p in points:
    rows.append(
      f"| {p.tokens:,} | {p.error_unscaled:.1e} | {p.error_scaled:.1e}"
      f" | {p.zeroed_unscaled:.3%} | {p.zeroed_scaled:.3%} |"
    )
  return "\n".join(rows)


def summary(
  results: Sequence[ModeResult], points: Sequence[SweepPoint], cfg: Config
) -> str:
  r = {x.mode: x for x in results}
  f32, f16, f16s = r["float32"], r["float16"], r["float16+scaling"]
  lines = [
    f"Validation loss vs float32: float16+scaling {val_gap(f16s, f32):+.2%},"
    f" float16 without scaling {val_gap(f16, f32):+.2%}.",
    f"Gradient elements flushed to zero by the float16 backward pass:"
    f" {f16.grad_zeroed_fraction:.3%} without scaling,"
    f" {f16s.grad_zeroed_fraction:.3%} with it; gradient error vs float32:"
    f" {f16.grad_relative_error:.1e} without,"
    f" {f16s.grad_relative_error:.1e} with.",
    f"Of float32's gradients, float16 would flush"
    f" {f16.f16_underflow_at_scale:.3%} to zero and keep"
    f" {f16.f16_subnormal_at_scale:.1%} only as subnormals (without scaling);"
    f" at the loss scale 2^{np.log2(f16s.probe_loss_scale):g}:"
    f" {f16s.f16_underflow_at_scale:.3%} and"
    f" {f16s.f16_subnormal_at_scale:.1%}.",
  ]
  if points:
    a, b = points[0], points[-1]
    lines.append(
      f"float16 gradient error vs float32 from {a.tokens:,} to {b.tokens:,} tokens"
      f" per backward pass: {a.error_unscaled:.1e} -> {b.error_unscaled:.1e}"
      f" without scaling, {a.error_scaled:.1e} -> {b.error_scaled:.1e} at the"
      f" fixed loss scale 2^{np.log2(cfg.sweep_scale):g}."
    )
  return "\n".join(lines)


def val_gap(r: ModeResult, ref: ModeResult) -> float:
  return (r.val_loss - ref.val_loss) / ref.val_loss


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
  """Writes `payload`; dataclass and NamedTuple records become JSON objects."""

  def plain(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
      return plain(dataclasses.asdict(x))
    if isinstance(x, tuple) and hasattr(x, "_asdict"):
      return plain(x._asdict())
    if isinstance(x, dict):
      return {k: plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
      return [plain(v) for v in x]
    return x

  path.write_text(json.dumps(plain(payload), indent=1))


def _smooth(x: Sequence[float], window: int) -> np.ndarray:
  return np.convolve(np.asarray(x), np.ones(window) / window, mode="valid")


def figure(
  results: Sequence[ModeResult],
  points: Sequence[SweepPoint],
  grads32,
  cfg: Config,
  path: pathlib.Path,
) -> None:
  """Six panels; `grads32`: float32 gradients for the histogram."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = dict(zip(MODES, ["black", "tab:red", "tab:blue", "tab:green"], strict=True))
  fig, axes = plt.subplots(2, 3, figsize=(18, 8))
  window = max(1, cfg.steps // 50)
  by_mode = {r.mode: r for r in results}
  f32 = by_mode["float32"]

  ax = axes[0, 0]
  for r in results:
    smooth = _smooth(r.losses, window)
    x = np.arange(smooth.size) + window
    ax.plot(x, smooth, color=colors[r.mode], lw=1.2, label=r.mode)
    steps, val = zip(*r.evals, strict=True)
    ax.plot(steps, val, "o--", color=colors[r.mode], ms=3, lw=0.8)
  ax.set(
    xlabel="step", ylabel="loss (nats/char)", title="Loss (lines: train, dots: val)"
  )
  ax.legend(fontsize=8)

  ax = axes[0, 1]
  ref = _smooth(f32.losses, window)
  _, v32 = zip(*f32.evals, strict=True)
  for r in results:
    if r is f32:
      continue
    diff = _smooth(r.losses, window) - ref
    ax.plot(
      np.arange(diff.size) + window,
      diff,
      color=colors[r.mode],
      lw=1.0,
      label=f"{r.mode} (train)",
    )
    steps, val = zip(*r.evals, strict=True)
    ax.plot(
      steps,
      np.asarray(val) - np.asarray(v32),
      "o--",
      color=colors[r.mode],
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

  ax = axes[0, 2]
  r = by_mode["float16+scaling"]
  steps = np.arange(1, len(r.scales) + 1)
  ax.step(steps, r.scales, where="post", color=colors[r.mode], label="loss scale used")
  if r.skipped_at:
    at = np.asarray(r.skipped_at)
    ax.plot(
      at + 1,
      np.asarray(r.scales)[at],
      "x",
      color="tab:red",
      ms=8,
      label=f"skipped step (overflow), {len(at)} in all",
    )
  ax.set_yscale("log", base=2)
  ax.set(xlabel="step", ylabel="loss scale", title="float16 + dynamic_loss_scale")
  ax.legend(fontsize=8)

  ax = axes[1, 0]
  g = np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads32)])
  logg = np.log2(np.abs(g[g != 0]).astype(np.float64))
  shift = np.log2(r.probe_loss_scale)
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

  tokens = [p.tokens for p in points]
  s = f"2^{np.log2(cfg.sweep_scale):g}"
  for ax, field, title in [
    (axes[1, 1], "error", "float16 gradient error vs float32, one backward pass"),
    (axes[1, 2], "zeroed", "nonzero float32 gradient elements float16 made 0"),
  ]:
    for suffix, color, label in [
      ("unscaled", "tab:red", "float16, no loss scaling"),
      ("scaled", "tab:blue", f"float16, loss scale {s}"),
    ]:
      y = np.array([getattr(p, f"{field}_{suffix}") for p in points])
      ax.plot(
        tokens, y if field == "error" else 100 * y, "o-", color=color, label=label
      )
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [f"{t // 1024}k" if t >= 1024 else str(t) for t in tokens])
    ax.set_yscale("log" if field == "error" else "linear")
    ax.set(
      xlabel="tokens per backward pass (loss: their mean)",
      ylabel="||g16 - g32|| / ||g32||" if field == "error" else "% of elements",
      title=title,
    )
    ax.legend(fontsize=8)

  fig.tight_layout()
  fig.savefig(path, dpi=80)
  plt.close(fig)
