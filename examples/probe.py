"""Gradient measurements: float16's gradients against float32's, same parameters.

`compare` is the end-of-run probe of each mode; `sweep` is the panel that
shows the mechanism: the relative error of float16 gradients, with and without
loss scaling, as the number of tokens in one backward pass grows (the loss is
a mean over the tokens, so every token's gradient shrinks as 1 / tokens).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from config import Config
from model import CharLM, loss_fn

import lossscale as ls


@functools.partial(jax.jit, static_argnums=(0, 1))
def grads(cfg: Config, dtype: Any, params, batch, scale):
  """Gradients of `loss * scale`, computed by the model in `dtype`.

  The parameters stay float32: the backward pass runs in `dtype` and its
  result is cast back, so what float16 flushed to zero stays zero.
  """
  apply_fn = CharLM(cfg, dtype).apply
  return jax.grad(lambda p: loss_fn(apply_fn, p, batch) * scale)(params)


def _norm(tree) -> jax.Array:
  # optax.tree.norm, which the oldest supported optax (0.2.4) does not have.
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


@jax.jit
def _compare(own, ref, scale):
  ref_leaves, own_leaves = jax.tree.leaves(ref), jax.tree.leaves(own)
  nonzero = sum(jnp.sum(r != 0) for r in ref_leaves)
  zeroed = sum(
    jnp.sum(jnp.logical_and(r != 0, o == 0))
    for r, o in zip(ref_leaves, own_leaves, strict=True)
  )
  diff = jax.tree.map(lambda o, r: o.astype(jnp.float32) / scale - r, own, ref)
  err = _norm(diff) / _norm(ref)
  report = ls.float16_range_report(jax.tree.map(lambda g: g * scale, ref))
  return zeroed / jnp.maximum(nonzero, 1), err, report


class Comparison(NamedTuple):
  """How a dtype's gradients (of loss * scale, divided back) differ from float32's."""

  zeroed_fraction: float  # of the nonzero float32 elements, made exactly 0
  relative_error: float  # ||g / scale - g32|| / ||g32||
  f16_underflow: float  # float16_range_report(g32 * scale).underflow
  f16_overflow: float
  f16_subnormal: float


def compare(
  cfg: Config, dtype: Any, params, batch, scale: float, ref=None
) -> Comparison:
  """Compares the gradients of `dtype` at loss scale `scale` with float32's.

  `ref`: the float32 gradients at `params` and `batch`, when already computed.
  """
  if ref is None:
    ref = grads(cfg, jnp.float32, params, batch, jnp.float32(1.0))
  if dtype == jnp.float32 and scale == 1.0:
    own = ref
  else:
    own = grads(cfg, dtype, params, batch, jnp.float32(scale))
  zeroed, err, report = _compare(own, ref, jnp.float32(scale))
  return Comparison(
    float(zeroed),
    float(err),
    float(report.underflow),
    float(report.overflow),
    float(report.subnormal),
  )


class SweepPoint(NamedTuple):
  """float16's gradient error at one number of tokens per backward pass."""

  tokens: int  # in the one backward pass: sequences * sequence length
  sequences: int
  error_unscaled: float  # relative error of float16's gradients, loss scale 1
  error_scaled: float  # the same at loss scale `Config.sweep_scale`
  zeroed_unscaled: float  # nonzero float32 elements made exactly 0, scale 1
  zeroed_scaled: float


def sweep(cfg: Config, params, windows: np.ndarray) -> list[SweepPoint]:
  """float16 against float32 gradients on ever larger prefixes of `windows`.

  `windows` is [n, seq + 1] real text; the batch starts at `cfg.batch`
  sequences and grows by `cfg.sweep_factor` while it holds at most
  `cfg.sweep_max_tokens` tokens. Every
  point is one plain backward pass of the mean loss over the whole batch.
  """
  if cfg.sweep_factor < 2:
    raise ValueError(f"Config.sweep_factor must be at least 2, got {cfg.sweep_factor}")
  points = []
  n = cfg.batch
  while n * cfg.seq <= cfg.sweep_max_tokens and n <= len(windows):
    batch = jnp.asarray(windows[:n])
    ref = grads(cfg, jnp.float32, params, batch, jnp.float32(1.0))
    plain = compare(cfg, jnp.float16, params, batch, 1.0, ref)
    scaled = compare(cfg, jnp.float16, params, batch, cfg.sweep_scale, ref)
    points.append(
      SweepPoint(
        tokens=n * cfg.seq,
        sequences=n,
        error_unscaled=plain.relative_error,
        error_scaled=scaled.relative_error,
        zeroed_unscaled=plain.zeroed_fraction,
        zeroed_scaled=scaled.zeroed_fraction,
      )
    )
    n *= cfg.sweep_factor
  return points
