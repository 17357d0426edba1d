"""Spike skipping: docs/skipping.md's settings table and its "differs on
purpose" list, as tests.

tests/_spike_rules.py reimplements OLMo-core's, Levanter's and MaxText's
rules from their sources, and ours from its statement. Here the library,
under `jax.jit` (one `lax.scan` of `tx.update` over a sequence), fed the
loss as `value=` and a one-leaf gradient whose unscaled norm is the
sequence's gradient norm, must take the upstream rule's decisions step for
step with the settings the table gives, on fixed sequences and on seeded
random ones (lognormal noise, injected spikes up and down, level shifts);
where a NaN, a constant window, a lasting shift, the loss scale or several
replicas are involved, the differences the page states are shown; the
independent `Ours` equals the library on random settings and sequences,
reasons, counts and the loss scale included; bad settings raise.
"""

import dataclasses
import zlib
from collections.abc import Callable

import _spike_rules as rules
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import lossscale as ls
from _helpers import ScaleRule, reference_rule

F32 = np.float32
NAN, INF = float("nan"), float("inf")
LOSS_SPIKE = 1 + ls.SKIP_REASONS.index("loss_spike")
NORM_SPIKE = 1 + ls.SKIP_REASONS.index("grad_norm_spike")
BAD_LOSS = 1 + ls.SKIP_REASONS.index("nonfinite_loss")
OVERFLOW = 1 + ls.SKIP_REASONS.index("overflow")


# ---------------------------------------------------------------------------
# The table: an upstream configuration and the `SkipSpikes` that reproduces
# it (docs/skipping.md, "Settings: OLMo-core, Levanter, MaxText").


def olmo_core(window=128, sigmas=6, grad_norms=True):
  """OLMo-core's `SkipStepOptimizer(rolling_interval_length=window,
  sigma_factor=sigmas)`; below 19 it never skips: no `SkipSpikes`."""
  if window + 1 < 20:
    return None
  return ls.SkipSpikes(window=window, sigmas=float(sigmas), grad_norm=grad_norms)


def levanter(window=128, sigmas=6.0):
  """Levanter's `SkipStepConfig(rolling_interval_length=window,
  sigma_factor=sigmas)` (9af9cf88); at window 1 it never skips."""
  if window < 2:
    return None
  return ls.SkipSpikes(
    window=window,
    sigmas=sigmas,
    one_sided=True,
    ddof=0,
    min_std=1e-6,
    warmup=max(2, window // 2) + 1,  # it counts the previous values only
  )


def maxtext(window, sigmas, grad_norms=True):
  """MaxText's `skip_step_on_spikes(inner, interval=window,
  scaling_factor=sigmas)`, given `grad_norm=` or not."""
  return ls.SkipSpikes(
    window=window,
    sigmas=sigmas,
    one_sided=True,
    warmup=max(2, window // 2),
    grad_norm=grad_norms,
  )


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  upstream: Callable[[], object]  # a fresh upstream rule
  ours: ls.SkipSpikes | None  # None: no spike skipping at all
  length: int  # of the sequences it is tested on
  constant_ok: bool = True  # reproduced on constant windows too


ROWS = [
  # OLMo-core's 0 / 0 on a constant window is the one difference (below).
  Row("olmo-core defaults", lambda: rules.OLMoCore(), olmo_core(), 320, False),
  Row("olmo-core W=24 k=3", lambda: rules.OLMoCore(24, 3), olmo_core(24, 3), 96, False),
  Row(
    "olmo-core W=19 k=6 loss only",
    lambda: rules.OLMoCore(19, 6, grad_norms=False),
    olmo_core(19, 6, grad_norms=False),
    80,
    False,
  ),
  Row("olmo-core W=18 never skips", lambda: rules.OLMoCore(18, 2), olmo_core(18), 80),
  Row("levanter W=8 k=6", lambda: rules.Levanter(8, 6.0), levanter(8, 6.0), 64),
  Row("levanter W=16 k=3", lambda: rules.Levanter(16, 3.0), levanter(16, 3.0), 64),
  Row("levanter W=3 k=2", lambda: rules.Levanter(3, 2.0), levanter(3, 2.0), 48),
  Row("levanter W=1 never skips", lambda: rules.Levanter(1, 1.0), levanter(1), 48),
  Row("maxtext W=8 k=6", lambda: rules.MaxText(8, 6.0), maxtext(8, 6.0), 64),
  Row("maxtext W=16 k=3", lambda: rules.MaxText(16, 3.0), maxtext(16, 3.0), 64),
  Row(
    "maxtext W=3 k=2 loss only",
    lambda: rules.MaxText(3, 2.0, grad_norms=False),
    maxtext(3, 2.0, grad_norms=False),
    48,
  ),
  Row("maxtext W=1 k=1", lambda: rules.MaxText(1, 1.0), maxtext(1, 1.0), 48),
]


def _start(spikes):
  """The first step (0-based) the test applies to, with these settings."""
  warmup = spikes.warmup or max(20, spikes.window // 2)
  return warmup - 1


# ---------------------------------------------------------------------------
# Sequences: float32 losses and gradient norms.


def _calm(length):
  """Smooth, varying, never a spike at 2 sigmas (over 8 values or more)."""
  i = np.arange(length)
  loss = 2.0 + 0.05 * np.sin(0.7 * i) + 0.03 * np.cos(1.9 * i)
  norm = 1.0 + 0.1 * np.sin(1.1 * i + 0.5)
  return loss, norm


def fixed_sequences(length, start):
  """Named (losses, norms): spikes up and down after the warm-up, a lasting
  shift in level, a spike inside the warm-up, a constant run."""
  out = {}
  out["calm"] = _calm(length)
  loss, norm = _calm(length)
  s = start + 2
  loss[s] *= 4.0  # up, the loss
  norm[s + 3] *= 6.0  # up, the norm
  loss[s + 6] *= 3.0
  norm[s + 6] *= 3.0  # both
  loss[s + 9] *= 0.2  # down, the loss
  norm[s + 12] *= 0.1  # down, the norm
  loss[s + 15] *= 1.5
  norm[s + 15] *= 0.5
  out["spikes"] = loss, norm
  loss, norm = _calm(length)
  loss[start + 3 :] *= 2.0  # a lasting shift
  norm[start + 3 :] *= 3.0
  out["shift"] = loss, norm
  loss, norm = _calm(length)
  loss[max(1, start - 2)] *= 10.0  # in the warm-up: taken, then in the window
  norm[max(1, start - 2)] *= 10.0
  out["spike in warm-up"] = loss, norm
  loss, norm = _calm(length)
  wobble = np.where(np.arange(length) % 6 < 3, 1.5, 0.6)
  loss[start:] *= wobble[start:]
  norm[start:] /= wobble[start:]
  out["wobble"] = loss, norm
  loss, norm = np.full(length, 0.5), np.full(length, 2.0)
  loss[start + 4] = 0.625  # a rise after a constant run
  norm[start + 8] = 1.0  # a fall
  out["constant"] = loss, norm
  return {k: (F32(v[0]), F32(v[1])) for k, v in out.items()}


def random_sequence(seed, length):
  """Lognormal noise around a level, with spikes up and down injected into
  each quantity, now and then into both, and maybe a lasting shift."""
  rng = np.random.default_rng(seed)
  joint = rng.random(length) < 0.03
  out = []
  for _ in range(2):
    level = rng.uniform(0.5, 5.0)
    noise = rng.choice([0.01, 0.05, 0.2])
    x = level * np.exp(noise * rng.standard_normal(length))
    hit = (rng.random(length) < 0.06) | joint
    up = rng.random(length) < 0.7
    factor = np.where(up, np.exp(rng.uniform(0.3, 3.0, length)), 1.0)
    factor = np.where(up, factor, np.exp(-rng.uniform(0.3, 2.0, length)))
    x = np.where(hit, x * factor, x)
    if rng.random() < 0.3:
      x[rng.integers(length) :] *= np.exp(rng.uniform(-1.0, 1.0))
    out.append(F32(x))
  return tuple(out)


# ---------------------------------------------------------------------------
# Driving the library and the rules.

_RUNNERS = {}


def library_tx(spikes, dynamic, growth_interval=4, axis_name=None):
  inner = optax.sgd(0.1)
  if not dynamic:
    return ls.skip_nonfinite(inner, skip_spikes=spikes, axis_name=axis_name)
  rule = ScaleRule(initial_scale=2.0**10, growth_interval=growth_interval)
  return rule.tx(inner, skip_spikes=spikes, axis_name=axis_name)


def library_run(spikes, losses, norms, dynamic=False, growth_interval=4):
  """The library's step after step under `jax.jit`: a dict of per-step
  arrays (`applied`, `reason`, `by_reason`, `skipped`, `scale` after the
  step, `scale_before` it), and `window`, the spike window at the end."""
  key = (spikes, dynamic, growth_interval)
  if key not in _RUNNERS:
    tx = library_tx(spikes, dynamic, growth_interval)
    params = {"w": jnp.zeros(1, jnp.float32)}

    def body(state, x):
      loss, norm = x
      scale = state.loss_scale
      grads = {"w": (norm * scale)[None]}  # its unscaled norm: `norm`
      _, state = tx.update(grads, state, params, value=loss)
      out = dict(
        applied=state.last_applied,
        reason=state.last_skip_reason,
        by_reason=state.skips_by_reason,
        skipped=state.skipped_steps,
        scale=state.loss_scale,
        scale_before=scale,
      )
      return state, out

    def run(losses, norms):
      state, out = jax.lax.scan(body, tx.init(params), (losses, norms))
      return out, state.spike_window

    _RUNNERS[key] = jax.jit(run)
  out, window = _RUNNERS[key](jnp.asarray(losses, F32), jnp.asarray(norms, F32))
  out = {k: np.asarray(v) for k, v in out.items()}
  out["window"] = window
  return out


def decisions(rule, losses, norms):
  """An upstream (or reference) rule's decision at each step."""
  return [rule.step(F32(x), F32(g)) for x, g in zip(losses, norms, strict=True)]


def skipped(taken):
  return {i for i, t in enumerate(taken) if not t}


def _first_difference(want, got):
  return next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)


def _assert_same(row, losses, norms, what):
  want = decisions(row.upstream(), losses, norms)
  got = library_run(row.ours, losses, norms)["applied"].tolist()
  if got != want:
    i = _first_difference(want, got)
    raise AssertionError(
      f"{row.name}, {what}: step {i} upstream {'took' if want[i] else 'skipped'}"
      f" it, the library {'took' if got[i] else 'skipped'} it"
      f" (loss {losses[i]}, norm {norms[i]})"
    )
  return want


# ---------------------------------------------------------------------------
# (a) Each row of the table reproduces its upstream rule.


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_matches_upstream_on_fixed_sequences(row):
  start = _start(row.ours) if row.ours is not None else 20
  skips = 0
  for name, (losses, norms) in fixed_sequences(row.length, start).items():
    if name == "constant" and not row.constant_ok:
      continue
    skips += len(skipped(_assert_same(row, losses, norms, name)))
  if row.ours is None:
    assert skips == 0  # these configurations never skip
  else:
    assert skips >= 3  # the sequences exercise the rule


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_matches_upstream_on_random_sequences(row):
  seed = zlib.crc32(row.name.encode())
  skips = 0
  for k in range(5):
    losses, norms = random_sequence(seed + k, row.length)
    skips += len(skipped(_assert_same(row, losses, norms, f"seed {seed + k}")))
  assert skips > 0 or row.ours is None


def test_two_sided_and_one_sided_rows_differ_on_a_fall():
  # A fall: OLMo-core (two-sided) skips it, Levanter and MaxText do not, and
  # so do their rows.
  olmo, lev, mt = olmo_core(24, 6), levanter(24, 6.0), maxtext(24, 6.0)
  losses, norms = _calm(60)
  t = 30
  losses[t] *= 0.2
  losses, norms = F32(losses), F32(norms)
  assert skipped(decisions(rules.OLMoCore(24, 6), losses, norms)) == {t}
  assert skipped(decisions(rules.Levanter(24, 6.0), losses, norms)) == set()
  assert skipped(decisions(rules.MaxText(24, 6.0), losses, norms)) == set()
  assert library_run(olmo, losses, norms)["reason"][t] == LOSS_SPIKE
  assert library_run(lev, losses, norms)["applied"].all()
  assert library_run(mt, losses, norms)["applied"].all()


# ---------------------------------------------------------------------------
# (b) Where ours differs on purpose: non-finite values.

UPSTREAM = [
  ("olmo-core", lambda: rules.OLMoCore(24, 6), olmo_core(24, 6), 24),
  ("levanter", lambda: rules.Levanter(8, 6.0), levanter(8, 6.0), 8),
  ("maxtext", lambda: rules.MaxText(8, 6.0), maxtext(8, 6.0), 8),
]


def _calm_run(upstream, length):
  """A calm sequence and the steps the rule skips on it: with a short
  window, a rise over the first few values may be a spike (MaxText's
  warm-up, at W=8, tests the 4th step against 3 values)."""
  losses, norms = (F32(x) for x in _calm(length))
  return losses, norms, skipped(decisions(upstream(), losses, norms))


@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize(
  "upstream, spikes, window", [u[1:] for u in UPSTREAM], ids=[u[0] for u in UPSTREAM]
)
def test_a_bad_loss_skips_w_more_steps_upstream_and_one_here(
  upstream, spikes, window, bad
):
  start = _start(spikes)
  losses, norms, calm = _calm_run(upstream, start + 2 * window + 10)
  t = start + 4
  losses[t], norms[t] = bad, NAN  # a bad batch: its gradients NaN too
  # Upstream: the bad value enters the window; every comparison with it
  # fails until it leaves, W steps later.
  taken = decisions(upstream(), losses, norms)
  assert skipped(taken) == calm | set(range(t, t + window + 1))
  got = library_run(spikes, losses, norms, dynamic=True, growth_interval=1000)
  assert skipped(got["applied"]) == calm | {t}
  assert got["reason"][t] == BAD_LOSS
  assert (got["scale"] == 2.0**10).all()  # no back-off
  assert got["by_reason"][-1][:2].tolist() == [0, 1]  # no overflow, one bad loss


@pytest.mark.parametrize(
  "upstream, spikes, window", [u[1:] for u in UPSTREAM], ids=[u[0] for u in UPSTREAM]
)
def test_a_nan_in_the_warmup_is_taken_upstream_then_skips(upstream, spikes, window):
  start = _start(spikes)
  losses, norms = (F32(x) for x in _calm(start + 2 * window + 10))
  t = 1
  assert t + window >= start  # still in the window when the test begins
  losses[t] = NAN
  # Upstream takes it (its NaN update applied), then skips from the end of
  # the warm-up until it leaves the window.
  taken = decisions(upstream(), losses, norms)
  assert taken[t]
  assert skipped(taken) == set(range(start, t + window + 1))
  got = library_run(spikes, losses, norms)
  assert skipped(got["applied"]) == {t} and got["reason"][t] == BAD_LOSS


@pytest.mark.parametrize(
  "upstream, spikes, window", [u[1:] for u in UPSTREAM], ids=[u[0] for u in UPSTREAM]
)
def test_an_overflow_backs_off_and_never_enters_the_window(upstream, spikes, window):
  # A finite loss, NaN gradients: upstream the NaN norm poisons the norm
  # window; here it is an overflow, which backs the scale off, alone.
  start = _start(spikes)
  losses, norms, calm = _calm_run(upstream, start + 2 * window + 10)
  t = start + 4
  norms[t] = NAN
  taken = decisions(upstream(), losses, norms)
  assert skipped(taken) == calm | set(range(t, t + window + 1))
  got = library_run(spikes, losses, norms, dynamic=True, growth_interval=1000)
  assert skipped(got["applied"]) == calm | {t} and got["reason"][t] == OVERFLOW
  assert got["scale"][t - 1] == 2.0**10 and (got["scale"][t:] == 2.0**9).all()


# ---------------------------------------------------------------------------
# Where ours differs on purpose: a constant window; a lasting shift; the
# norm, unscaled; the replicas; a missing loss.


@pytest.mark.parametrize("value", [0.5, 0.0], ids=["constant", "zero"])
def test_a_constant_window_is_no_spike_but_olmo_core_skips_it(value):
  spikes = olmo_core(24, 6)
  start = _start(spikes)
  losses = np.full(start + 20, F32(value), F32)
  norms = np.full(start + 20, F32(value), F32)
  # OLMo-core: 0 / 0 is NaN, and NaN <= k fails: every step skipped.
  taken = decisions(rules.OLMoCore(24, 6), losses, norms)
  assert skipped(taken) == set(range(start, len(losses)))
  assert library_run(spikes, losses, norms)["applied"].all()
  assert all(decisions(rules.Levanter(24, 6.0), losses, norms))
  assert all(decisions(rules.MaxText(24, 6.0), losses, norms))
  # Any change from a constant run is a spike, for both.
  losses[start + 5] = F32(value + 0.125)
  taken = decisions(rules.OLMoCore(24, 6), losses, norms)
  got = library_run(spikes, losses, norms)
  assert not taken[start + 5] and got["reason"][start + 5] == LOSS_SPIKE
  assert skipped(got["applied"]) == {start + 5}


class SkippedStayOut(rules.Ours):
  """`Ours`, but a skipped spike never enters its window."""

  def _enter(self, kind, x, spike):
    if not spike:
      super()._enter(kind, x, spike)


def test_after_a_spike_a_second_one_is_judged_more_leniently():
  # The price of taking spikes in: for W steps the deviation is wider.
  spikes = olmo_core(24, 6)
  start = _start(spikes)
  losses, norms = (F32(x) for x in _calm(start + 40))
  t = start + 5
  second = losses.copy()
  second[t + 2] *= 4.0
  assert library_run(spikes, second, norms)["reason"][t + 2] == LOSS_SPIKE
  both = second.copy()
  both[t] *= 4.0
  got = library_run(spikes, both, norms)
  assert skipped(got["applied"]) == {t}
  assert skipped(decisions(rules.OLMoCore(24, 6), both, norms)) == {t}


SHIFTED = [ROWS[1], ROWS[5], ROWS[9]]


@pytest.mark.parametrize("row", SHIFTED, ids=[r.name for r in SHIFTED])
def test_a_lasting_shift_is_accepted_after_a_while(row):
  # Skipped spikes enter the window (upstream too): a new level is skipped
  # for a few steps, then taken; kept out, it would be skipped forever.
  start = _start(row.ours)
  losses, norms = (F32(x) for x in _calm(start + 3 * row.ours.window + 20))
  t = start + 5
  losses[t:] *= 3.0
  got = library_run(row.ours, losses, norms)["applied"]
  first_taken = t + int(np.argmax(got[t:]))
  assert first_taken > t and got[first_taken:].all()
  upstream = decisions(row.upstream(), losses, norms)
  assert upstream == got.tolist()
  settings = dataclasses.asdict(row.ours)
  stay_out = decisions(SkippedStayOut(**settings), losses, norms)
  assert skipped(stay_out) == set(range(t, len(losses)))


@pytest.mark.parametrize("name", ["olmo-core", "levanter"])
def test_the_scaled_norm_jumps_at_each_growth_the_unscaled_does_not(name):
  # Upstream placed around a loss-scaled optimizer sees the norm times the
  # scale: it doubles at each growth, and the first step after each is
  # skipped. Ours reads the unscaled norm.
  if name == "olmo-core":
    upstream, spikes, window = (lambda: rules.OLMoCore(24, 6)), olmo_core(24, 6), 24
  else:
    upstream, spikes, window = (lambda: rules.Levanter(8, 6.0)), levanter(8, 6.0), 8
  start = _start(spikes)
  interval = window + 4
  losses, norms = (F32(x) for x in _calm(start + 4 * interval))
  got = library_run(spikes, losses, norms, dynamic=True, growth_interval=interval)
  assert got["applied"].all()  # the unscaled norm: no spike
  scales = got["scale_before"]
  grown = {i for i in range(1, len(scales)) if scales[i] > scales[i - 1]}
  assert len(grown) >= 3
  taken = decisions(upstream(), losses, norms * scales)
  assert skipped(taken) == {i for i in grown if i >= start}
  assert all(decisions(upstream(), losses, norms))
  # A back-off halves it: a fall, which OLMo-core's two-sided rule skips.
  if name == "olmo-core":
    halved = np.where(np.arange(len(norms)) < start + 5, 1024.0, 512.0)
    taken = decisions(upstream(), losses, F32(norms * halved))
    assert start + 5 in skipped(taken)


def test_replicas_decide_on_their_mean_loss_and_norm():
  n, steps = 4, 12
  spikes = ls.SkipSpikes(window=4, sigmas=3.0, warmup=3)
  tx = library_tx(spikes, dynamic=True, growth_interval=1000, axis_name="i")
  rng = np.random.default_rng(0)
  losses = F32(2.0 + 0.2 * rng.random((steps, n)))
  norms = F32(1.0 + 0.1 * np.arange(n) + 0.1 * rng.random((steps, n)))
  norms[6, 2] *= 30.0  # one replica's norm: the mean a spike
  losses[9, 0] *= 8.0  # one replica's loss: the mean a spike

  def step(state, loss, norm):
    grads = {"w": (norm * state.loss_scale)[None]}
    _, state = tx.update(grads, state, {"w": jnp.zeros(1)}, value=loss)
    return state

  mapped = jax.pmap(step, axis_name="i", devices=jax.devices()[:n])
  state = jax.tree.map(lambda a: jnp.stack([a] * n), tx.init({"w": jnp.zeros(1)}))
  reasons = []
  for i in range(steps):
    state = mapped(state, losses[i], norms[i])
    reasons.append(np.asarray(state.last_skip_reason).tolist())
  assert all(r == [r[0]] * n for r in reasons)  # every replica the same
  ours = rules.Ours(**dataclasses.asdict(spikes))
  for i in range(steps):
    ours.step(np.mean(losses[i], dtype=F32), np.mean(norms[i], dtype=F32))
    assert reasons[i][0] == ours.reason, i
  assert reasons[6][0] == NORM_SPIKE and reasons[9][0] == LOSS_SPIKE
  # Each replica deciding on its own values (MaxText's rule, say), they
  # would not agree: replica 2 alone skips step 6.
  alone = [
    decisions(rules.MaxText(4, 3.0), losses[:, r], norms[:, r]) for r in range(n)
  ]
  assert [taken[6] for taken in alone] == [True, True, False, True]
  window = np.asarray(state.spike_window.values)
  np.testing.assert_array_equal(window, np.broadcast_to(window[:1], window.shape))


def test_a_missing_loss_raises_where_maxtext_turns_the_test_off():
  maxtext_rule = rules.MaxText(8, 6.0)
  assert maxtext_rule.step(None, 100.0) and maxtext_rule.count == 0
  with pytest.raises(ValueError):
    rules.Levanter(8, 6.0).step(None, 100.0)
  tx = ls.skip_nonfinite(optax.sgd(0.1), skip_spikes=maxtext(8, 6.0))
  params = {"w": jnp.zeros(1)}
  with pytest.raises(ValueError, match=r"tests the loss.*pass the unscaled loss as"):
    tx.update({"w": jnp.ones(1)}, tx.init(params), params)


# ---------------------------------------------------------------------------
# (c) The independent statement of our rule equals the library.


@st.composite
def _settings(draw):
  loss, grad_norm = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
  return ls.SkipSpikes(
    window=draw(st.sampled_from([1, 2, 3, 5, 8, 13])),
    sigmas=draw(st.sampled_from([1.0, 2.0, 3.0, 6.0])),
    loss=loss,
    grad_norm=grad_norm,
    one_sided=draw(st.booleans()),
    warmup=draw(st.one_of(st.none(), st.integers(2, 12))),
    ddof=draw(st.sampled_from([0, 1])),
    min_std=draw(st.sampled_from([0.0, 1e-6, 0.05])),
  )


def _messy_sequence(seed, length=48):
  """A random sequence with bad losses, overflows and a constant run."""
  losses, norms = random_sequence(seed, length)
  rng = np.random.default_rng(seed + 1)
  bad = rng.random(length)
  losses[bad < 0.04] = NAN
  losses[(bad >= 0.04) & (bad < 0.06)] = INF
  over = rng.random(length)
  norms[over < 0.05] = INF  # gradients holding an inf
  norms[(over >= 0.05) & (over < 0.08)] = NAN
  if rng.random() < 0.5:
    at = rng.integers(length - 10)
    losses[at : at + 10], norms[at : at + 10] = 0.75, 1.5
  return losses, norms


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(spikes=_settings(), seed=st.integers(0, 2**16))
def test_ours_equals_the_library(spikes, seed):
  losses, norms = _messy_sequence(seed)
  got = library_run(spikes, losses, norms, dynamic=True)
  ours = rules.Ours(**dataclasses.asdict(spikes))
  for i, (loss, norm) in enumerate(zip(losses, norms, strict=True)):
    taken = ours.step(loss, norm)
    assert bool(got["applied"][i]) == taken, i
    assert got["reason"][i] == ours.reason, i
    assert got["by_reason"][i].tolist() == ours.skips_by_reason, i
    assert got["skipped"][i] == sum(ours.skips_by_reason), i
  # The scale: backed off by an overflow, never moved by a spike or a bad
  # loss; those steps are not in the scale rule's sequence at all.
  reason, before, after = got["reason"], got["scale_before"], got["scale"]
  other = np.isin(reason, [BAD_LOSS, LOSS_SPIKE, NORM_SPIKE])
  np.testing.assert_array_equal(after[other], before[other])
  overflow = reason == OVERFLOW
  np.testing.assert_array_equal(after[overflow], np.maximum(before[overflow] / 2, 1))
  rule = ScaleRule(initial_scale=2.0**10, growth_interval=4)
  want = iter(reference_rule(rule, [r == 0 for r in reason if r in (0, OVERFLOW)]))
  scale = rule.initial_scale
  for i, r in enumerate(reason):
    if r in (0, OVERFLOW):
      scale = float(next(want)[0])
    assert after[i] == scale, i


def test_the_windows_hold_the_finite_values_skipped_spikes_included():
  spikes = ls.SkipSpikes(window=4, sigmas=2.0, warmup=3)
  losses = F32([1.0, 1.2, NAN, 1.1, 50.0, 1.05])
  norms = F32([2.0, INF, 2.2, 2.1, 2.0, NAN])
  got = library_run(spikes, losses, norms, dynamic=True)
  assert got["reason"].tolist() == [0, OVERFLOW, BAD_LOSS, 0, LOSS_SPIKE, OVERFLOW]
  window = got["window"]
  assert np.asarray(window.seen).tolist() == [5, 4]
  # Ring buffers: the 5th loss overwrote the first slot.
  np.testing.assert_array_equal(window.values[0], F32([1.05, 1.2, 1.1, 50.0]))
  np.testing.assert_array_equal(window.values[1], F32([2.0, 2.2, 2.1, 2.0]))


# ---------------------------------------------------------------------------
# (d) Errors.


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(window=0), r"`SkipSpikes\(window=...\)` must be a positive int.*got 0"),
    (dict(sigmas=-1), r"`SkipSpikes\(sigmas=...\)` must be a positive finite .*-1"),
    (dict(ddof=2), r"`SkipSpikes\(ddof=...\)` must be 0 or 1, got 2"),
    (
      dict(loss=False, grad_norm=False),
      r"must test at least one of them, got loss=False, grad_norm=False",
    ),
    (dict(min_std=NAN), r"`SkipSpikes\(min_std=...\)` must be a finite .*nan"),
    (dict(warmup=1), r"`SkipSpikes\(warmup=...\)` must be an int >= 2.*got 1"),
    (dict(ddof=1.0), r"`SkipSpikes\(ddof=...\)` must be 0 or 1, got 1.0"),
    (dict(min_std=True), r"`SkipSpikes\(min_std=...\)` must be a finite .*got True"),
    (dict(one_sided=1), r"`SkipSpikes\(one_sided=...\)` must be True or False"),
  ],
)
def test_settings_are_checked_at_construction(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ls.SkipSpikes(**kwargs)


@pytest.mark.parametrize(
  "wrapper",
  [
    lambda s: ls.dynamic_loss_scale(optax.sgd(0.1), skip_spikes=s),
    lambda s: ls.static_loss_scale(optax.sgd(0.1), 8.0, skip_spikes=s),
    lambda s: ls.skip_nonfinite(optax.sgd(0.1), skip_spikes=s),
  ],
  ids=["dynamic_loss_scale", "static_loss_scale", "skip_nonfinite"],
)
def test_skip_spikes_must_be_a_skip_spikes(wrapper):
  with pytest.raises(ValueError, match=r"\(skip_spikes=...\)` must be a lossscale."):
    wrapper({"window": 8})
  params = {"w": jnp.zeros(1)}
  tx = wrapper(ls.SkipSpikes(window=8))
  with pytest.raises(ValueError, match=r"`update` was not given it: pass .* `value=`"):
    tx.update({"w": jnp.ones(1)}, tx.init(params), params)
  # Testing the norm alone needs no loss.
  tx = wrapper(ls.SkipSpikes(window=8, loss=False))
  _, state = jax.jit(tx.update)({"w": jnp.ones(1)}, tx.init(params), params)
  assert bool(state.last_applied)
