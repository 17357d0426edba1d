"""Every row of docs/from-pytorch.md's settings tables, as a test.

Each PyTorch-world scaler is reimplemented below in a few lines of plain
Python, written from its published source (file and function cited in each
class; no upstream code is copied), and driven on fixed overflow sequences
(the ones the docs quote) and on seeded random ones. The scale after every
step must equal, exactly, the `loss_scale` our wrapper leaves with the
settings the table gives, under `jax.jit`; where the upstream scaler raises,
`lossscale.check_not_stalled` with the table's trigger must raise on the same
step.
"""

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import standard_promotion

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal, 2**-126
INF = float("inf")


class Raised(Exception):
  """The upstream scaler raised (stopped the run) on this step."""


# ---------------------------------------------------------------------------
# The upstream rules, from their sources. `step(overflow)` returns the scale
# after the step, or raises `Raised`.


class DeepSpeed:
  """deepspeed/runtime/fp16/loss_scaler.py, `DynamicLossScaler.update_scale`
  (the scaler ZeRO stages 1-3 use)."""

  def __init__(
    self, init_scale, scale_window, min_scale, delayed_shift, consecutive, raise_at_min
  ):
    self.scale, self.window, self.min_scale = init_scale, scale_window, min_scale
    self.delayed_shift = self.hysteresis = delayed_shift
    self.consecutive, self.raise_at_min = consecutive, raise_at_min
    self.iter, self.last_overflow = 0, -1

  def step(self, overflow):
    if overflow:
      if self.delayed_shift == 1 or self.hysteresis == 1:
        if self.scale == self.min_scale and self.raise_at_min:
          raise Raised
        self.scale = max(self.scale / 2.0, self.min_scale)
      else:
        self.hysteresis -= 1
      self.last_overflow = self.iter
    else:
      if self.consecutive:
        self.hysteresis = self.delayed_shift
      stable = self.iter - self.last_overflow - 1
      if stable > 0 and stable % self.window == 0:
        if not self.consecutive:
          self.hysteresis = self.delayed_shift
        self.scale *= 2.0
    self.iter += 1
    return self.scale


class DeepSpeedFP16Optimizer:
  """deepspeed/runtime/fp16/fused_optimizer.py, `FP16_Optimizer._update_scale`
  (without ZeRO): no hysteresis, no raise."""

  def __init__(self, init_scale, scale_window, min_scale):
    self.scale, self.window, self.min_scale = init_scale, scale_window, min_scale
    self.iter, self.last_overflow = 0, -1

  def step(self, overflow):
    if overflow:
      self.scale = max(self.scale / 2.0, self.min_scale)
      self.last_overflow = self.iter
    else:
      stable = self.iter - self.last_overflow - 1
      if stable > 0 and stable % self.window == 0:
        self.scale *= 2.0
    self.iter += 1
    return self.scale


class Fairseq:
  """fairseq/optim/dynamic_loss_scaler.py, `DynamicLossScaler.check_overflow`
  (an overflowing step) and `update` (a finite one, after the optimizer step,
  as fairseq/optim/fp16_optimizer.py calls them)."""

  def __init__(
    self, init_scale, scale_factor, scale_window, tolerance, threshold, min_loss_scale
  ):
    self.scale, self.factor, self.window = init_scale, scale_factor, scale_window
    self.tolerance, self.threshold, self.min_loss_scale = (
      tolerance,
      threshold,
      min_loss_scale,
    )
    self.iter, self.last_overflow, self.last_rescale, self.overflows = 0, -1, -1, 0

  def step(self, overflow):
    if not overflow:
      if (self.iter - self.last_overflow) % self.window == 0:
        self.scale *= self.factor
        self.last_rescale = self.iter
      self.iter += 1
      return self.scale
    since_rescale = self.iter - self.last_rescale
    self.last_overflow = self.iter
    self.overflows += 1
    if self.overflows / float(since_rescale) >= self.tolerance:
      self.scale /= self.factor
      if self.threshold is not None:
        self.scale = max(self.scale, self.threshold)
      self.last_rescale = self.iter
      self.overflows = 0
    if self.scale <= self.min_loss_scale:
      raise Raised  # fairseq restores the previous scale, then raises
    self.iter += 1
    return self.scale


class Megatron:
  """megatron/core/optimizer/grad_scaler.py, `DynamicGradScaler.update`
  (float32 tensors)."""

  def __init__(
    self, initial_scale, min_scale, growth_factor, backoff_factor, interval, hysteresis
  ):
    f32 = np.float32
    self.scale, self.min_scale = f32(initial_scale), f32(min_scale)
    self.growth, self.backoff = f32(growth_factor), f32(backoff_factor)
    self.interval, self.hysteresis = interval, hysteresis
    self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

  def step(self, overflow):
    if overflow:
      self.growth_tracker = 0
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker <= 0:
        self.scale = max(self.scale * self.backoff, self.min_scale)
    else:
      self.growth_tracker += 1
      if self.growth_tracker == self.interval:
        self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
        self.scale = self.scale * self.growth
    return float(self.scale)


class ApexAmp:
  """apex/amp/scaler.py, `LossScaler.__init__` and `update_scale` (dynamic;
  the file left apex's main branch after commit cb65b8ed)."""

  def __init__(self, init_scale, scale_window, min_loss_scale, max_loss_scale):
    self.scale = min(max_loss_scale, init_scale)  # clamped, where we raise
    self.window, self.min, self.max = scale_window, min_loss_scale, max_loss_scale
    self.unskipped = 0

  def step(self, overflow):
    if overflow:
      self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
      self.unskipped = 0
    else:
      self.unskipped += 1
    if self.unskipped == self.window:
      self.scale = min(self.max, self.scale * 2.0)
      self.unskipped = 0
    return self.scale


class ApexHysteresis:
  """apex csrc/update_scale_hysteresis.cu, `update_scale_hysteresis_cuda_kernel`."""

  def __init__(self, scale, growth_factor, backoff_factor, interval, hysteresis):
    self.scale = np.float32(scale)
    self.growth, self.backoff = growth_factor, backoff_factor
    self.interval, self.hysteresis = interval, hysteresis
    self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

  def step(self, overflow):
    if overflow:
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker > 0:
        self.growth_tracker = 0
        return float(self.scale)
      self.scale = np.float32(self.scale * self.backoff)
      self.growth_tracker = 0
    else:
      successful = self.growth_tracker + 1
      if successful == self.interval:
        new = np.float32(self.scale * self.growth)
        if np.isfinite(new):
          self.scale = new
        self.growth_tracker = 0
      else:
        self.growth_tracker = successful
      self.hysteresis_tracker = self.hysteresis
    return float(self.scale)


class Torch:
  """torch `GradScaler.update` -> `_amp_update_scale_`
  (aten/src/ATen/native/cuda/AmpKernels.cu, `amp_update_scale_cuda_kernel`):
  float32, no floor and no ceiling."""

  def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
    self.scale = np.float32(init_scale)
    self.growth, self.backoff = growth_factor, backoff_factor
    self.interval, self.tracker = growth_interval, 0

  def step(self, overflow):
    if overflow:
      self.scale = np.float32(self.scale * self.backoff)
      self.tracker = 0
    else:
      successful = self.tracker + 1
      if successful == self.interval:
        new = np.float32(self.scale * self.growth)
        if np.isfinite(new):
          self.scale = new
        self.tracker = 0
      else:
        self.tracker = successful
    return float(self.scale)


# ---------------------------------------------------------------------------
# The rows of the tables: an upstream configuration and ours.


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  upstream: object  # a callable making a fresh upstream scaler
  ours: dict  # dynamic_loss_scale's settings
  check: dict = dataclasses.field(default_factory=dict)  # check_not_stalled's


def _deepspeed_row(name, power, window, hysteresis, consecutive, min_scale=1.0):
  return Row(
    name,
    lambda: DeepSpeed(2.0**power, window, min_scale, hysteresis, consecutive, True),
    dict(
      initial_scale=2.0**power,
      growth_interval=window,
      growth_delay=1,
      hysteresis=hysteresis,
      consecutive_hysteresis=consecutive,
      min_scale=min_scale,
      max_scale=F32_MAX,
    ),
    dict(at_min_scale=True),
  )


def _fairseq_row(name, init, window, tolerance, threshold=None, min_loss_scale=1e-4):
  return Row(
    name,
    lambda: Fairseq(init, 2.0, window, tolerance, threshold, min_loss_scale),
    dict(
      initial_scale=init,
      growth_interval=window,
      growth_factor=2.0,
      backoff_factor=0.5,
      tolerance=tolerance,
      min_scale=F32_TINY if threshold is None else threshold,
      max_scale=F32_MAX,
    ),
    dict(scale_at_most=min_loss_scale),
  )


ROWS = [
  # DeepSpeed's config defaults: initial_scale_power 16, window 1000,
  # hysteresis 2, consecutive_hysteresis false, min_loss_scale 1; short
  # windows so that the sequences reach them.
  _deepspeed_row("deepspeed", 8, 2, 2, False),
  _deepspeed_row("deepspeed consecutive", 4, 3, 2, True),
  _deepspeed_row("deepspeed hysteresis 1", 6, 1, 1, False),
  _deepspeed_row("deepspeed hysteresis 3 consecutive", 5, 2, 3, True, min_scale=2.0),
  # DeepSpeed's class default initial scale, 2**32, needs max_scale raised.
  _deepspeed_row("deepspeed 2**32", 32, 3, 2, False),
  Row(
    "deepspeed FP16_Optimizer",
    lambda: DeepSpeedFP16Optimizer(2.0**8, 2, 1.0),
    dict(initial_scale=2.0**8, growth_interval=2, growth_delay=1, max_scale=F32_MAX),
  ),
  # fairseq's defaults: init 2**7 (fp16_init_scale), tolerance 0, no
  # threshold, min_loss_scale 1e-4.
  _fairseq_row("fairseq", 2.0**7, 3, 0.0),
  _fairseq_row("fairseq tolerance 0.25", 2.0**7, 3, 0.25),
  _fairseq_row("fairseq tolerance 0.5 threshold", 2.0**4, 2, 0.5, threshold=0.25),
  _fairseq_row("fairseq tolerance 0.05", 2.0**-10, 4, 0.05),
  _fairseq_row("fairseq tolerance 1", 2.0**5, 2, 1.0),  # every step since overflowed
  Row(
    "megatron",
    lambda: Megatron(2.0**12, 1.0, 2.0, 0.5, 3, 2),
    dict(initial_scale=2.0**12, growth_interval=3, hysteresis=2, max_scale=F32_MAX),
  ),
  Row(
    "megatron factors",
    lambda: Megatron(2.0**8, 2.0, 4.0, 0.25, 2, 1),
    dict(
      initial_scale=2.0**8,
      min_scale=2.0,
      growth_factor=4.0,
      backoff_factor=0.25,
      growth_interval=2,
      max_scale=F32_MAX,
    ),
  ),
  Row(
    "apex amp",
    lambda: ApexAmp(2.0**16, 2, None, 2.0**24),
    dict(initial_scale=2.0**16, growth_interval=2, min_scale=F32_TINY),
  ),
  Row(
    "apex amp clamped",  # init 2**30 > max 2**20: apex clamps, we take min()
    lambda: ApexAmp(2.0**30, 3, 4.0, 2.0**20),
    dict(initial_scale=2.0**20, growth_interval=3, min_scale=4.0, max_scale=2.0**20),
  ),
  Row(
    "apex update_scale_hysteresis",
    lambda: ApexHysteresis(2.0**10, 2.0, 0.5, 2, 2),
    dict(
      initial_scale=2.0**10,
      growth_interval=2,
      hysteresis=2,
      consecutive_hysteresis=True,
      min_scale=F32_TINY,
      max_scale=F32_MAX,
    ),
  ),
  Row(
    "torch",
    lambda: Torch(2.0**16, 2.0, 0.5, 3),
    dict(
      initial_scale=2.0**16, growth_interval=3, min_scale=F32_TINY, max_scale=F32_MAX
    ),
  ),
]


# ---------------------------------------------------------------------------
# Driving both.


def upstream_run(row, overflows):
  """The upstream scale after each step, up to the step that raised; and
  that step's index (None if none raised)."""
  scaler, scales = row.upstream(), []
  for i, overflow in enumerate(overflows):
    try:
      scales.append(float(scaler.step(overflow)))
    except Raised:
      return scales, i
  return scales, None


@pytest.fixture(scope="module")
def _updates():
  return {}


def our_run(row, overflows, updates):
  """Our scale after each step (jitted `tx.update`), up to the step where
  `check_not_stalled` with the row's trigger raised; and that step's index."""
  if row.name not in updates:
    tx = ls.dynamic_loss_scale(optax.sgd(1.0), **row.ours)
    updates[row.name] = (tx, jax.jit(tx.update))
  tx, update = updates[row.name]
  params = jnp.zeros(2)
  state, scales = tx.init(params), []
  for i, overflow in enumerate(overflows):
    grads = jnp.array([INF, 1.0]) if overflow else jnp.ones(2)
    _, state = update(grads, state, params)
    try:
      ls.check_not_stalled(state, max_consecutive_skips=10**6, **row.check)
    except ls.LossScaleStalledError:
      return scales, i
    scales.append(float(state.loss_scale))
  return scales, None


def _assert_same(row, overflows, updates):
  want = upstream_run(row, overflows)
  got = our_run(row, overflows, updates)
  assert got == want, (row.name, [int(o) for o in overflows])


def _random_sequences(seed, n=12, length=48):
  rng = np.random.default_rng(seed)
  return [rng.random(length) < rng.choice([0.05, 0.2, 0.4, 0.7]) for _ in range(n)]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_matches_upstream_on_random_sequences(row, _updates):
  for overflows in _random_sequences(zlib.crc32(row.name.encode())):
    _assert_same(row, list(overflows), _updates)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_matches_upstream_on_fixed_sequences(row, _updates):
  fixed = [
    [False] * 12,
    [True] * 40,  # down to the floor, where DeepSpeed and fairseq raise
    [True, False, True, False, True, True],
    ([False] * 4 + [True]) * 4,
    [False, False, True, False, False, False, True, True, True, False, False],
    [True, False] * 10,
  ]
  for overflows in fixed:
    _assert_same(row, overflows, _updates)


# ---------------------------------------------------------------------------
# The trajectories the docs quote.


def _ours(flags_ok, **settings):
  tx = ls.dynamic_loss_scale(optax.sgd(1.0), **settings)
  params, out = jnp.zeros(2), []
  state, update = tx.init(params), jax.jit(tx.update)
  for ok in flags_ok:
    _, state = update(jnp.ones(2) if ok else jnp.array([INF, 1.0]), state, params)
    out.append(float(state.loss_scale))
  return out


def test_deepspeed_consecutive_hysteresis_quoted():
  overflows = [True, False, True, False, True, True]
  ok = [not o for o in overflows]
  ds = DeepSpeed(16.0, 1000, 1.0, 2, True, True)
  assert [ds.step(o) for o in overflows] == [16, 16, 16, 16, 16, 8]
  assert _ours(ok, initial_scale=16.0, hysteresis=2, consecutive_hysteresis=True) == [
    16,
    16,
    16,
    16,
    16,
    8,
  ]
  # Without it: refilled on growth only.
  assert _ours(ok, initial_scale=16.0, hysteresis=2) == [16, 16, 8, 8, 4, 2]


def test_deepspeed_growth_timing_quoted():
  ds = DeepSpeed(256.0, 2, 1.0, 1, False, True)
  assert [ds.step(False) for _ in range(5)] == [256, 256, 512, 512, 1024]
  settings = dict(initial_scale=256.0, growth_interval=2)
  assert _ours([True] * 5, **settings, growth_delay=1) == [256, 256, 512, 512, 1024]
  assert _ours([True] * 4, **settings) == [256, 512, 512, 1024]
  # After an overflow too: the first growth on the (W + 1)-th good step.
  ds = DeepSpeed(256.0, 2, 1.0, 1, False, True)
  flags = [True] + [False] * 5
  assert [ds.step(o) for o in flags] == [128, 128, 128, 256, 256, 512]
  assert _ours([not o for o in flags], **settings, growth_delay=1) == [
    128,
    128,
    128,
    256,
    256,
    512,
  ]


def test_fairseq_tolerance_quoted():
  overflows = ([False] * 4 + [True]) * 4
  fs = Fairseq(128.0, 2.0, 2000, 0.25, None, 1e-4)
  assert [fs.step(o) for o in overflows] == [128.0] * 20
  ok = [not o for o in overflows]
  assert _ours(ok, initial_scale=128.0, tolerance=0.25) == [128.0] * 20
  # fairseq's default tolerance, 0: every overflow backs off.
  assert _ours(ok, initial_scale=128.0)[-1] == 128.0 / 16


def test_fairseq_overflow_count_survives_a_growth():
  # fairseq resets its overflow count on a back-off only: one overflow held
  # back by the tolerance (1 in 2 steps < 0.6), a growth, a good step, then
  # an overflow: 2 overflows in the 2 steps since the growth back off (1 in
  # 2 would not).
  overflows = [False, True, False, False, False, False, True]
  fs = Fairseq(8.0, 2.0, 3, 0.6, None, 1e-4)
  want = [fs.step(o) for o in overflows]
  assert want == [8.0, 8.0, 8.0, 8.0, 16.0, 16.0, 8.0]
  ok = [not o for o in overflows]
  assert _ours(ok, initial_scale=8.0, growth_interval=3, tolerance=0.6) == want


def test_deepspeed_and_fairseq_stop_where_check_not_stalled_does(_updates):
  ds_row = next(r for r in ROWS if r.name == "deepspeed hysteresis 1")
  scales, raised = our_run(ds_row, [True] * 10, _updates)
  assert raised == 6 and scales[-1] == 1.0  # 2**6 halved 6 times, then at 1
  fs_row = next(r for r in ROWS if r.name == "fairseq")
  scales, raised = our_run(fs_row, [True] * 30, _updates)
  assert raised == 20 and scales[-1] == 2.0**-13  # 2**-14 <= 1e-4


# ---------------------------------------------------------------------------
# Gradient accumulation: PyTorch steps its scaler once per optimizer step.


def _accumulating_run(k, bad, order, steps, growth_interval=3):
  """Scales after each optimizer step of `k` micro-batches, the micro-batch
  `(step, i)` in `bad` overflowing; `order` is "outside" (the wrapper called
  once per optimizer step on the summed gradients, PyTorch's pattern) or
  "multisteps" (the wrapper around `optax.MultiSteps`)."""
  inner = optax.sgd(0.1)
  if order == "multisteps":
    inner = optax.MultiSteps(inner, k).gradient_transformation()
  tx = ls.dynamic_loss_scale(inner, initial_scale=8.0, growth_interval=growth_interval)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales = []
  with standard_promotion():  # MultiSteps divides by an int32 count
    for step in range(steps):
      micro = []
      for i in range(k):
        g = jnp.full(2, np.inf if (step, i) in bad else 1.0) * ls.get_loss_scale(state)
        if order == "multisteps":
          _, state = update({"w": g}, state, params)
        micro.append(g)
      if order == "outside":
        _, state = update({"w": sum(micro) / k}, state, params)
      scales.append(float(ls.get_loss_scale(state)))
  return scales, state


def test_accumulation_outside_the_wrapper_follows_torch_per_optimizer_step():
  k, steps = 4, 24
  rng = np.random.default_rng(3)
  bad = {(s, i) for s in range(steps) for i in range(k) if rng.random() < 0.08}
  scales, state = _accumulating_run(k, bad, "outside", steps)
  torch = Torch(8.0, 2.0, 0.5, 3)
  want = [torch.step(any((s, i) in bad for i in range(k))) for s in range(steps)]
  assert scales == want
  assert int(state.skipped_steps) == len({s for s, _ in bad})


def test_accumulation_orders_counted_as_the_docs_say():
  # Six good optimizer steps of k=4, growth_interval=3 (docs/how-it-works.md).
  torch_like, _ = _accumulating_run(4, set(), "outside", 6)
  per_micro, _ = _accumulating_run(4, set(), "multisteps", 6)
  assert torch_like == [8, 8, 16, 16, 16, 32]
  assert per_micro == [16, 32, 128, 256, 512, 2048]
  # Around MultiSteps a bad micro-batch is dropped alone: the optimizer step
  # it belongs to waits for one more good micro-batch.
  _, state = _accumulating_run(4, {(0, 1)}, "multisteps", 2)
  assert int(state.skipped_steps) == 1
  assert int(state.inner_state.gradient_step) == 1  # 7 good micro-batches
  assert int(state.inner_state.mini_step) == 3
