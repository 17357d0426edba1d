"""Spike-skipping rules in plain Python and NumPy, one class each.

OLMo-core's, Levanter's and MaxText's rules are written here from their
published sources (file, function and commit in each docstring; no upstream
code is copied), in the precision each computes in; `Ours` is
`lossscale.SkipSpikes` written from its statement in docs/skipping.md,
without calling the library. Each has `step(loss, grad_norm) -> taken`, one
training step at a time; tests/test_skipping.py drives them next to the
library.

A comparison with NaN is false in all of them, as in torch and JAX; NumPy's
warnings about NaN and inf arithmetic are silenced where it happens.
"""

from __future__ import annotations

import collections
import math

import numpy as np

F32 = np.float32
REASONS = ("overflow", "nonfinite_loss", "loss_spike", "grad_norm_spike")


def _quiet():
  return np.errstate(all="ignore")


class OLMoCore:
  """allenai/OLMo-core, src/olmo_core/optim/skip_step_optimizer.py,
  `SkipStepOptimizer.get_step_factor` with the `latest_loss` and
  `latest_grad_norm` setters, commit 067267cab2aecb935b1dab1dbfcecc1a5754b1e0.

  `rolling_interval_length` W (default 128) and `sigma_factor` k (default
  6). The trainer sets the step's loss and grad norm before `step()`: each
  is appended to its list, NaN included, and the list is cut to its last
  W + 1 values. While the loss list holds fewer than max(20, W // 2) values
  the step is taken. Otherwise `torch.std_mean` of all values but the last
  (unbiased std), z = |x - mean| / std, and the step is taken iff z <= k for
  the loss and, when grad norms are set, for the grad norm: a NaN anywhere in
  the list, or 0 / 0 on a constant list, makes z NaN and skips.

  float32 tensors: the mean and std come back in float32 (torch's CPU
  kernel accumulates in float64, as here; CUDA's in float32, which differs
  only within float32 rounding of the threshold); z and the comparison in
  float32.
  """

  def __init__(self, window=128, sigmas=6, grad_norms=True):
    self.window, self.sigmas, self.grad_norms = window, sigmas, grad_norms
    self.losses, self.norms = [], []

  def _append(self, values, x):
    values.append(F32(x))
    del values[: max(0, len(values) - (self.window + 1))]

  def _z(self, values):
    previous = np.asarray(values[:-1], np.float64)
    with _quiet():
      mean, std = F32(previous.mean()), F32(previous.std(ddof=1))
      return np.abs(values[-1] - mean) / std

  def step(self, loss, grad_norm=None):
    self._append(self.losses, loss)
    if self.grad_norms:
      self._append(self.norms, grad_norm)
    if len(self.losses) < max(20, self.window // 2):
      return True
    taken = bool(self._z(self.losses) <= self.sigmas)
    if self.grad_norms:
      taken = taken and bool(self._z(self.norms) <= self.sigmas)
    return taken


class Levanter:
  """stanford-crfm/levanter, src/levanter/optim/skipstep.py,
  `SkipStepConfig.wrap` (`update_fn`), commit
  9af9cf88e78993e5030ecb91a4ca0e54d1cc9832 (the file as of September 2025;
  the earlier 2d3f61bd kept W + 1 values and ignored NaNs with `nanmean`).

  `rolling_interval_length` W (default 128), `sigma_factor` k (default 6.0).
  Buffers of the W previous losses and global norms of the updates it is
  given, with a mask of the slots written and a count of them (saturating at
  W). The step may be skipped once the count, before this step, is at least
  max(2, W // 2); then it is skipped unless loss <= mean + k * std and
  norm <= mean + k * std (one-sided; NaN compares false), with the mean and
  the population std (ddof 0) of the masked buffer, the std at least 1e-6.
  The current loss and norm are then written into the buffers, NaN too,
  taken or skipped. All float32. Without a loss it raises.
  """

  def __init__(self, window=128, sigmas=6.0):
    self.window, self.sigmas = window, sigmas
    self.losses = np.zeros(window, F32)
    self.norms = np.zeros(window, F32)
    self.valid = np.zeros(window, bool)
    self.index, self.count = 0, 0

  def _threshold(self, values):
    if not self.valid.any():  # JAX's masked mean of nothing: NaN
      return F32(np.nan)
    held = values[self.valid]
    with _quiet():
      mean, std = np.mean(held, dtype=F32), np.std(held, dtype=F32)
      return mean + F32(self.sigmas) * np.maximum(std, F32(1e-6))

  def step(self, loss, grad_norm):
    if loss is None:
      raise ValueError("Levanter's skip-step wrapper needs the loss")
    loss, grad_norm = F32(loss), F32(grad_norm)
    can_skip = self.count >= max(2, self.window // 2)
    with _quiet():
      ok = loss <= self._threshold(self.losses)
      ok = ok and grad_norm <= self._threshold(self.norms)
    self.losses[self.index], self.norms[self.index] = loss, grad_norm
    self.valid[self.index] = True
    self.index = (self.index + 1) % self.window
    self.count = min(self.count + 1, self.window)
    return not (can_skip and not ok)


class MaxText:
  """AI-Hypercomputer/maxtext, src/maxtext/optimizers/optimizers.py,
  `skip_step_on_spikes` and `_compute_rolling_stats`, commit
  02e796a74be53f6c604c658ac965b781a6e889ec.

  `interval` W, `scaling_factor` k. Buffers of W float32 values (loss and,
  when given as `grad_norm=`, grad norm) and a step count. Over the
  n = min(count, W) slots written: mean = sum / max(1, n), std =
  sqrt(sum of squared deviations / max(1, n - 1)) (Bessel's correction).
  Taken iff (loss - mean) <= k * std and, with a grad norm,
  (grad_norm - mean) <= k * std (one-sided; NaN compares false), or while
  (count + 1) < max(2, W // 2). The loss and grad norm are then written at
  count % W, NaN too, taken or skipped, and the count goes up. A step
  without a loss is taken and not recorded. All float32.
  """

  def __init__(self, window, sigmas, grad_norms=True):
    self.window, self.sigmas, self.grad_norms = window, sigmas, grad_norms
    self.losses = np.zeros(window, F32)
    self.norms = np.zeros(window, F32)
    self.count = 0

  def _stats(self, values):
    n = min(self.count, self.window)
    mask = np.arange(self.window) < n
    with _quiet():
      mean = np.sum(np.where(mask, values, F32(0)), dtype=F32) / F32(max(1, n))
      squares = np.where(mask, (values - mean) ** 2, F32(0))
      std = np.sqrt(np.sum(squares, dtype=F32) / F32(max(1, n - 1)))
    return mean, std

  def step(self, loss, grad_norm=None):
    if loss is None:
      return True
    loss = F32(loss)
    with _quiet():
      mean, std = self._stats(self.losses)
      ok = bool(loss - mean <= F32(self.sigmas) * std)
      if self.grad_norms:
        grad_norm = F32(grad_norm)
        mean, std = self._stats(self.norms)
        ok = ok and bool(grad_norm - mean <= F32(self.sigmas) * std)
    ok = ok or (self.count + 1) < max(2, self.window // 2)
    at = self.count % self.window
    self.losses[at] = loss
    if self.grad_norms:
      self.norms[at] = grad_norm
    self.count += 1
    return ok


class Ours:
  """`lossscale.SkipSpikes` as docs/skipping.md states it, with the skip
  reasons and their counts.

  Per quantity (the loss, the unscaled gradient norm), a window of the
  previous `window` finite values. While fewer than `warmup` (None:
  max(20, window // 2)) have been seen, this one included, it is no spike.
  Else, with the window's mean and its standard deviation (`ddof`; at
  least `min_std`; the divisor n - ddof at least 1, so one value has a
  deviation of 0 and an empty window a mean of 0), it is a spike when
  |x - mean| (x - mean with `one_sided`) > sigmas * std: never when x is NaN.
  A finite value then enters its window, a spike too; a non-finite one
  never does. Float32.

  `step(loss, grad_norm)`: `loss` None when none is given; a non-finite
  `grad_norm` stands for gradients holding an inf or a NaN (an overflow).
  The step's reasons, in `REASONS`' order: the overflow (unless the loss
  is not finite: it explains the gradients), a non-finite loss, a loss
  spike, a gradient-norm spike; it is skipped for the first that holds.
  `reason` is 0 for a taken step, else 1 + that reason's index;
  `skips_by_reason` counts the skipped steps by reason.
  """

  def __init__(
    self,
    window=128,
    sigmas=6.0,
    loss=True,
    grad_norm=True,
    one_sided=False,
    warmup=None,
    ddof=1,
    min_std=0.0,
  ):
    self.sigmas, self.one_sided = F32(sigmas), one_sided
    self.warmup = max(20, window // 2) if warmup is None else warmup
    self.ddof, self.min_std = ddof, F32(min_std)
    self.tested = {"loss": loss, "grad_norm": grad_norm}
    self.windows = {k: collections.deque(maxlen=window) for k in self.tested}
    self.seen = dict.fromkeys(self.tested, 0)
    self.reason, self.skips_by_reason = 0, [0] * len(REASONS)

  def _spike(self, kind, x):
    if x is None or not self.tested[kind]:
      return False
    x = F32(x)
    if not math.isfinite(x):
      return False
    spike = False
    if self.seen[kind] + 1 >= self.warmup:
      held = np.asarray(self.windows[kind], F32)
      n = len(held)
      mean = np.sum(held, dtype=F32) / F32(max(n, 1))
      variance = np.sum((held - mean) ** 2, dtype=F32) / F32(max(n - self.ddof, 1))
      std = max(np.sqrt(variance), self.min_std)
      off = x - mean if self.one_sided else abs(x - mean)
      spike = bool(off > self.sigmas * std)
    self._enter(kind, x, spike)
    return spike

  def _enter(self, kind, x, spike):
    """A finite value enters its window, spike or not."""
    del spike
    self.windows[kind].append(x)
    self.seen[kind] += 1

  def step(self, loss, grad_norm):
    bad_loss = loss is not None and not math.isfinite(loss)
    overflow = not math.isfinite(grad_norm) and not bad_loss
    reasons = [
      overflow,
      bad_loss,
      self._spike("loss", loss),
      self._spike("grad_norm", grad_norm),
    ]
    self.reason = next((i + 1 for i, r in enumerate(reasons) if r), 0)
    if self.reason:
      self.skips_by_reason[self.reason - 1] += 1
    return self.reason == 0
