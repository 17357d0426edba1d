"""Settings of the demo: the model, the training run and the gradient sweep."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

VOCAB = 128  # ASCII; anything else becomes "?"

# The four ways the demo trains the same model, and the compute dtype of each.
MODES = ("float32", "float16", "float16+scaling", "bfloat16")
DTYPES = {
  "float32": jnp.float32,
  "float16": jnp.float16,
  "float16+scaling": jnp.float16,
  "bfloat16": jnp.bfloat16,
}


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
  # The gradient-error sweep: tokens in one backward pass, from batch * seq
  # times sweep_factor up to sweep_max_tokens, at the float32 run's final
  # parameters (2k, 8k, 32k, 128k tokens by default).
  sweep_max_tokens: int = 131_072
  sweep_factor: int = 4
  sweep_scale: float = 2.0**15  # dynamic_loss_scale's default initial_scale


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
  sweep_max_tokens=256,
)
