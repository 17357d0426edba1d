"""A small decoder-only transformer language model (Flax linen)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import optax
from config import VOCAB, Config


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
  """Mean next-character cross-entropy over every token of `batch`."""
  logits = apply_fn({"params": params}, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
