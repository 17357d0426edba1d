"""Skipping bad steps: a synthetic float16 run with an injected loss spike
and a NaN batch, stepped by `lossscale` and judged by OLMo-core's rule.

`python examples/skipping.py` writes docs/img/skipping.json (the run, step
by step) and docs/img/skipping.png (its figure, docs/skipping.md);
tests/test_skipping_figure.py runs `simulate()` again and fails while the
JSON differs from it.
"""

from __future__ import annotations

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale as ls

STEPS = 140
SPIKE_AT = 70  # a batch whose labels are off by far: a loss and gradient spike
NAN_AT = 100  # a batch with a NaN input: the loss itself is NaN
WINDOW, SIGMAS = 32, 6.0
OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "img"


def _batches() -> tuple[np.ndarray, np.ndarray]:
  """The run's data: fixed by NumPy's legacy stream, the same everywhere."""
  rng = np.random.RandomState(0)
  x = rng.standard_normal((STEPS, 32, 8)).astype(np.float32)
  w = rng.standard_normal((8, 1)).astype(np.float32)
  y = x @ w + 0.1 * rng.standard_normal((STEPS, 32, 1)).astype(np.float32)
  y[SPIKE_AT] *= 1.7
  x[NAN_AT, 3, 2] = np.nan
  return x, y


def _loss(params, x, y):
  # float32 master weights, float16 compute, the loss reduced in float32.
  pred = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
  return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


class OlmoCore:
  """OLMo-core's `SkipStepOptimizer.get_step_factor`
  (src/olmo_core/optim/skip_step_optimizer.py, commit 067267ca), on the
  host: the last `window + 1` values kept, the current one appended before
  the decision (NaN too); taken while fewer than `max(20, window // 2)`
  values are kept; else taken iff `|x - mean| / std <= sigmas` for the loss
  and the gradient norm, over the previous values (unbiased deviation)."""

  def __init__(self, window: int, sigmas: float) -> None:
    self.window, self.sigmas = window, sigmas
    self.losses: list[float] = []
    self.norms: list[float] = []

  def taken(self, loss: float, norm: float) -> bool:
    for values, x in ((self.losses, loss), (self.norms, norm)):
      values.append(np.float32(x))
      del values[: -(self.window + 1)]
    if len(self.losses) < max(20, self.window // 2):
      return True
    with np.errstate(invalid="ignore", divide="ignore"):
      return all(
        bool(abs(v[-1] - np.mean(v[:-1])) / np.std(v[:-1], ddof=1) <= self.sigmas)
        for v in (np.asarray(self.losses), np.asarray(self.norms))
      )


def simulate() -> dict[str, list]:
  """The run: per step, the loss, the unscaled gradient norm, the scale
  after the step, why lossscale skipped it (0: applied) and whether
  OLMo-core's rule, given the same losses and norms, would take it."""
  spikes = ls.SkipSpikes(window=WINDOW, sigmas=SIGMAS)
  tx = ls.dynamic_loss_scale(
    optax.adam(3e-2), initial_scale=2.0**15, growth_interval=50, skip_spikes=spikes
  )
  params = {"w": jnp.zeros((8, 1))}
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y):
    loss, grads = ls.value_and_grad(_loss)(state, params, x, y)
    true = jax.tree.leaves(ls.unscale_gradients(grads, state))
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in true))
    params, state = ls.apply_gradients(tx, grads, state, params, value=loss)
    return params, state, loss, norm

  olmo = OlmoCore(WINDOW, SIGMAS)
  run: dict[str, list] = {k: [] for k in ("loss", "norm", "scale", "reason", "olmo")}
  x, y = _batches()
  for t in range(STEPS):
    params, state, loss, norm = step(params, state, x[t], y[t])
    run["loss"].append(float(loss))
    run["norm"].append(float(norm))
    run["scale"].append(float(state.loss_scale))
    run["reason"].append(int(state.last_skip_reason))
    run["olmo"].append(olmo.taken(float(loss), float(norm)))
  return run


def _plot(run: dict[str, list], path: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = np.arange(STEPS)
  reason = np.asarray(run["reason"])
  loss = np.asarray(run["loss"])
  fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
  axes[0].semilogy(steps, np.where(np.isfinite(loss), loss, np.nan), color="0.3")
  marks = {1: ("overflow", "tab:orange"), 2: ("nonfinite_loss", "tab:red")}
  marks |= {3: ("loss_spike", "tab:purple"), 4: ("grad_norm_spike", "tab:blue")}
  for code, (name, color) in marks.items():
    at = steps[reason == code]
    if at.size:
      axes[0].scatter(
        at,
        np.nan_to_num(loss[at], nan=np.nanmax(loss)),
        color=color,
        label=f"skipped: {name}",
        zorder=3,
      )
  axes[0].set_ylabel("loss")
  axes[0].legend(fontsize=8)
  axes[1].semilogy(steps, run["scale"], drawstyle="steps-post")
  axes[1].set_ylabel("loss scale")
  ours = np.cumsum(reason > 0)
  theirs = np.cumsum(~np.asarray(run["olmo"]))
  axes[2].plot(steps, ours, drawstyle="steps-post", label="lossscale: skipped")
  axes[2].plot(
    steps,
    theirs,
    drawstyle="steps-post",
    linestyle="--",
    label="OLMo-core's rule: would skip",
  )
  axes[2].set_ylabel("skipped steps")
  axes[2].set_xlabel("step")
  axes[2].legend(fontsize=8)
  fig.suptitle(
    "float16, Adam, SkipSpikes(window=32, sigmas=6): a spike at"
    f" step {SPIKE_AT}, a NaN batch at step {NAN_AT}",
    fontsize=10,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=90)


def main(argv: list[str]) -> int:
  run = simulate()
  OUT.mkdir(parents=True, exist_ok=True)
  (OUT / "skipping.json").write_text(json.dumps(run) + "\n")
  if "--no-plot" not in argv:
    _plot(run, OUT / "skipping.png")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
