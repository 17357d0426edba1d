"""Training one mode: the optimizer, the train step, and the run's record.

The lossscale-specific part is `make_state` (which optimizer wraps adamw) and
`train_step` (`ls.value_and_grad` instead of `jax.value_and_grad`); the rest is
an ordinary Flax training loop.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import probe
from config import DTYPES, Config
from flax.training import train_state
from model import CharLM, loss_fn
from tqdm.auto import tqdm

import lossscale as ls
from lossscale.flax import TrainState

# ----------------------------------------------------- the lossscale part


def make_state(mode: str, cfg: Config, params) -> train_state.TrainState:
  """The train state of `mode`: float32 master `params`, the mode's optimizer."""
  model = CharLM(cfg, DTYPES[mode])
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, cfg.steps)
  inner = optax.adamw(schedule, weight_decay=0.01)
  if mode == "float16+scaling":
    tx = ls.dynamic_loss_scale(inner, growth_interval=cfg.growth_interval)
  elif mode == "bfloat16":
    tx = ls.skip_nonfinite(inner)  # no scaling; skips a step that is not finite
  else:  # float32 and unscaled float16: plain optax, plain Flax TrainState.
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=inner)
  return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


@jax.jit
def train_step(state, batch):
  """One step; loss-scaled when `state` is a `lossscale.flax.TrainState`."""
  f = lambda p: loss_fn(state.apply_fn, p, batch)
  if isinstance(state, TrainState):
    # Gradients of loss * scale; apply_gradients divides them back, skips
    # the step when they overflowed, and adjusts the scale.
    loss, grads = ls.value_and_grad(f)(state, state.params)
  else:
    loss, grads = jax.value_and_grad(f)(state.params)
  return state.apply_gradients(grads=grads), loss


# ------------------------------------------------------- the training loop


@jax.jit
def eval_loss(state, batches):
  return jnp.mean(
    jax.lax.map(lambda b: loss_fn(state.apply_fn, state.params, b), batches)
  )


@dataclasses.dataclass(frozen=True)
class ModeResult:
  """What one mode's run measured (the fields of `results.json`'s records)."""

  mode: str
  train_loss: float  # mean of the last 5% of steps
  val_loss: float  # after the last step
  tokens_per_s: float  # excluding the first (compiling) step
  compile_s: float
  skipped_steps: int | None  # None: the mode cannot skip (plain optax)
  final_loss_scale: float | None  # None: the mode has no loss scale
  probe_loss_scale: float  # the scale of the last applied step (1 without)
  # The end-of-run gradient probe (see `probe.compare`).
  grad_zeroed_fraction: float
  grad_relative_error: float
  f16_underflow_at_scale: float
  f16_overflow_at_scale: float
  f16_subnormal_at_scale: float
  losses: list[float]  # every step's training loss
  evals: list[tuple[int, float]]  # (step, validation loss)
  scales: list[float]  # the loss scale each step used (scaling modes only)
  skipped_at: list[int]  # the steps skipped (scaling modes only)


def run_mode(
  mode: str,
  cfg: Config,
  params,
  train_batches: np.ndarray,
  val_batches: jax.Array,
  probe_batch: jax.Array,
) -> tuple[ModeResult, train_state.TrainState]:
  """Trains `mode` from `params`; returns its record and its final state."""
  # Jitted: built eagerly, each small op of the initialisation compiles alone.
  state = jax.jit(lambda p: make_state(mode, cfg, p))(params)
  scaled = isinstance(state, TrainState)
  losses, scales, skipped_at, evals = [], [], [], []
  t_compile = t_train = 0.0
  bar = tqdm(range(cfg.steps), desc=f"{mode:>16}", unit="step", leave=True)
  for i in bar:
    if scaled:
      scales.append(float(state.loss_scale))  # the scale this step uses
      skipped_before = int(state.skipped_steps)
    t0 = time.perf_counter()
    state, loss = train_step(state, train_batches[i])
    loss = float(loss)
    dt = time.perf_counter() - t0
    if i == 0:
      t_compile = dt
    else:
      t_train += dt
    losses.append(loss)
    if scaled and int(state.skipped_steps) > skipped_before:
      skipped_at.append(i)
    if (i + 1) % cfg.eval_every == 0 and i + 1 < cfg.steps:
      evals.append((i + 1, float(eval_loss(state, val_batches))))
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{evals[-1][1]:.3f}")
  bar.close()
  evals.append((cfg.steps, float(eval_loss(state, val_batches))))

  # Probe the gradients at the scale of the last applied step (the final
  # scale may just have grown and not been tried yet).
  applied = [s for i, s in enumerate(scales) if i not in set(skipped_at)]
  scale = applied[-1] if applied else 1.0
  p = probe.compare(cfg, DTYPES[mode], state.params, probe_batch, scale)
  tokens = (cfg.steps - 1) * cfg.batch * cfg.seq
  result = ModeResult(
    mode=mode,
    train_loss=float(np.mean(losses[-max(1, cfg.steps // 20) :])),
    val_loss=evals[-1][1],
    tokens_per_s=tokens / t_train if t_train > 0 else float("nan"),
    compile_s=t_compile,
    skipped_steps=len(skipped_at) if scaled else None,
    final_loss_scale=float(state.loss_scale) if scaled else None,
    probe_loss_scale=scale,
    grad_zeroed_fraction=p.zeroed_fraction,
    grad_relative_error=p.relative_error,
    f16_underflow_at_scale=p.f16_underflow,
    f16_overflow_at_scale=p.f16_overflow,
    f16_subnormal_at_scale=p.f16_subnormal,
    losses=losses,
    evals=evals,
    scales=scales,
    skipped_at=skipped_at,
  )
  return result, state
