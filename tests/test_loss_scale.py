"""The loss-scaling wrappers (`lossscale/_loss_scale.py`, `_wrapper.py`,
`_rule.py`): the scale rule, skipped steps, and equivalence with the bare
optimizer fed unscaled gradients.

Every trajectory of scales is checked against the one reference model in
`tests/_helpers.py`, itself checked here against the published trajectories
of PyTorch, TensorFlow (1.x and 2.x) and Megatron-LM.
"""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st
from optax.tree_utils import tree_get

import _compat
import lossscale as ls
from _helpers import (
  I32_MAX,
  INF,
  NAN,
  ScaleRule,
  assert_trees_close,
  assert_trees_equal,
  recording_wrapper,
  reference_rule,
  reference_scales,
  scale_history,
  standard_promotion,
)


def _grads_with(value, n=2):
  return {"w": jnp.full((n,), value, jnp.float32)}


# ---------------------------------------------------------------------------
# Published trajectories, step by step.


def _check_trajectory(rule, flags, expected):
  """The wrapper and the reference model both follow a published trajectory."""
  expected = [float(e) for e in expected]
  assert reference_scales(rule, flags) == expected
  assert scale_history(rule.tx(), flags) == expected


def test_pytorch_update_scale_kernel():
  # torch test_grad_scaling_update_scale: scale 4, growth 2, backoff 0.25,
  # interval 2; steps ok, ok, inf -> 4, 8, 2.
  rule = ScaleRule(initial_scale=4.0, backoff_factor=0.25, growth_interval=2)
  _check_trajectory(rule, [True, True, False], [4.0, 8.0, 2.0])


def test_tensorflow_dynamic_loss_scale_growth():
  # tf.mixed_precision DynamicLossScale: init 1, period 2, six finite steps.
  rule = ScaleRule(initial_scale=1.0, growth_interval=2)
  _check_trajectory(rule, [True] * 6, [1.0, 2.0, 2.0, 4.0, 4.0, 8.0])


def test_tensorflow_dynamic_loss_scale_mixed():
  rule = ScaleRule(initial_scale=4.0, growth_interval=2, min_scale=1.0)
  flags = [False, True, True, True, False, True, False, True, True, True, False]
  expected = [2.0, 2.0, 4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0]
  _check_trajectory(rule, flags, expected)


def test_megatron_hysteresis():
  rule = ScaleRule(initial_scale=4.0, growth_interval=2, hysteresis=2)
  overflow = [0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
  expected = [4, 8, 8, 8, 16, 16, 16, 8, 4, 4, 8, 8, 16]
  _check_trajectory(rule, [not o for o in overflow], expected)


def test_bounds_are_respected():
  rule = ScaleRule(initial_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
  expected = [8, 16, 16, 16, 8, 4, 2, 2, 2]
  _check_trajectory(rule, [True] * 4 + [False] * 5, expected)


def test_static_scale_never_changes_but_skips():
  tx = ls.static_loss_scale(optax.sgd(0.1), 2.0**10)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for ok in [True, False, False, True]:
    _, state = update(_grads_with(1.0 if ok else NAN), state, params)
    assert float(state.loss_scale) == 2.0**10
  assert int(state.skipped_steps) == 2
  assert int(state.consecutive_skips) == 0


def test_counters():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=3)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  seen = []
  for ok in [True, True, False, False, False, True]:
    _, state = update(_grads_with(1.0 if ok else INF), state, params)
    seen.append(
      (int(state.good_steps), int(state.skipped_steps), int(state.consecutive_skips))
    )
  assert seen == [(1, 0, 0), (2, 0, 0), (0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 3, 0)]


# TF 1.x `ExponentialUpdateLossScaleManager`: every vector of TensorFlow's
# contrib/mixed_precision/python/loss_scale_manager_test.py (incr_ratio 2,
# decr_ratio 1/2, incr_every_n_steps 2 and decr_every_n_nan_or_inf 2 unless
# given). TF records the scale after each update.

F32_MAX = float(np.finfo(np.float32).max)


def _tf1_manager(init, incr_every=2, decr_every=2):
  return ScaleRule(
    initial_scale=init,
    growth_interval=incr_every,
    hysteresis=decr_every,
    growth_factor=2.0,
    backoff_factor=0.5,
    reset_hysteresis_on_backoff=True,
    max_scale=F32_MAX,
  )


TF1_VECTORS = [
  ("increase_every_n_steps", 1, 2, 2, [True] * 6, [1, 2, 2, 4, 4, 8]),
  ("decrease_every_n_steps", 1024, 2, 2, [False] * 6, [1024, 512, 512, 256, 256, 128]),
  (
    "keep_decreasing_until_one",
    16,
    2,
    2,
    [False] * 10,
    [16, 8, 8, 4, 4, 2, 2, 1, 1, 1],
  ),
  ("incr_bad_step_clear_good_step", 1, 2, 2, [1, 1, 1, 0, 1], [1, 2, 2, 2, 2]),
  (
    "incr_good_step_does_not_clear_bad_step",
    *(1, 2, 2),
    [1, 1, 1, 0, 1, 0],
    [1, 2, 2, 2, 2, 1],
  ),
  ("trigger_each_step", 1, 1, 1, [1, 1, 1, 0, 1, 1], [2, 4, 8, 4, 8, 16]),
  ("alternating_each_step", 1, 1, 1, [1, 0] * 4 + [1], [2, 1] * 4 + [2]),
  ("alternating_incr_every_2", 32, 2, 1, [1, 0] * 3 + [1], [32, 16, 16, 8, 8, 4, 4]),
  (
    "random_mix",
    *(4, 2, 2),
    [0, 0, 1, 1, 1, 0, 1, 0, 1, 1, 1, 0],
    [4, 2, 2, 4, 4, 4, 4, 2, 2, 4, 4, 4],
  ),
]


@pytest.mark.parametrize(
  "init,incr,decr,flags,expected",
  [v[1:] for v in TF1_VECTORS],
  ids=[v[0] for v in TF1_VECTORS],
)
def test_tensorflow1_exponential_update_manager(init, incr, decr, flags, expected):
  _check_trajectory(_tf1_manager(init, incr, decr), [bool(f) for f in flags], expected)


def test_tensorflow1_keep_increasing_until_capped():
  init = float(np.float32(F32_MAX / 4 + 10))
  expected = [init, init * 2, init * 2, F32_MAX, F32_MAX, F32_MAX]
  _check_trajectory(_tf1_manager(init), [True] * 6, expected)


def test_reset_hysteresis_differs_from_megatron_only_after_a_backoff():
  flags = [False] * 6
  megatron = ScaleRule(initial_scale=1024.0, hysteresis=2)
  _check_trajectory(megatron, flags, [1024, 512, 256, 128, 64, 32])
  _check_trajectory(_tf1_manager(1024.0), flags, [1024, 512, 512, 256, 256, 128])


# ---------------------------------------------------------------------------
# Property tests against the reference model.


@st.composite
def _rules(draw):
  min_scale = draw(st.sampled_from([2.0**-4, 0.5, 1.0, 3.0]))
  initial = min_scale * draw(st.sampled_from([1.0, 2.0, 7.0, 2.0**10]))
  max_scale = initial * draw(st.sampled_from([1.0, 4.0, 2.0**20]))
  return ScaleRule(
    initial_scale=initial,
    min_scale=min_scale,
    max_scale=max_scale,
    growth_interval=draw(st.integers(1, 4)),
    growth_factor=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
    backoff_factor=draw(st.sampled_from([0.1, 0.5, 0.75, 1.0])),
    hysteresis=draw(st.integers(1, 3)),
    reset_hysteresis_on_backoff=draw(st.booleans()),
  )


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(rule=_rules(), flags=st.lists(st.booleans(), max_size=40))
def test_matches_reference_model(rule, flags):
  tx = rule.tx(optax.identity())
  params = jnp.zeros(3)

  @jax.jit
  def run(seq):
    def body(state, ok):
      g = jnp.where(ok, jnp.ones(3), jnp.full(3, jnp.nan))
      _, state = tx.update(g, state, params)
      return state, state.loss_scale

    return jax.lax.scan(body, tx.init(params), seq)[1]

  got = [float(s) for s in run(jnp.asarray(flags, bool))] if flags else []
  assert got == reference_scales(rule, flags)
  assert all(np.isfinite(s) and rule.min_scale <= s <= rule.max_scale for s in got)


# A few configurations (each compiles once), chosen for their edges.
CONFIGS = [
  # torch.amp.GradScaler's rule with a short interval.
  ScaleRule(2.0**15, 3, 2.0, 0.5, 1, 1.0, 2.0**24),
  # Megatron-LM's hysteresis, with bounds reached quickly from both sides.
  ScaleRule(2.0**10, 5, 2.0, 0.5, 3, 32.0, 2.0**12),
  # Inexact factors and bounds that products land beside, not on.
  ScaleRule(10.0, 1, 3.0, 0.3, 2, 0.75, 1000.0),
  # A constant scale: min_scale == max_scale.
  ScaleRule(8.0, 2, 2.0, 0.5, 1, 8.0, 8.0),
  # Never grows, never backs off within a run: int32-limit settings.
  ScaleRule(2.0**24, I32_MAX, 2.0, 0.5, I32_MAX, 1.0, 2.0**24),
  # Growth overflows float32 to inf before the clamp; backoff reaches tiny
  # scales: the scale must stay finite and in bounds anyway.
  ScaleRule(1.0, 1, 2.0**100, 2.0**-100, 1, 2.0**-120, float(np.finfo(np.float32).max)),
]

LENGTH = 256


@functools.cache
def _compiled_run(cfg_index):
  """One compiled scan per config: feeds one gradient value per step."""
  tx = CONFIGS[cfg_index].tx()
  params = jnp.zeros([], jnp.float32)

  @jax.jit
  def run(state, values):
    def step(state, value):
      _, state = tx.update(value, state, params)
      counters = (
        state.loss_scale,
        state.good_steps,
        state.hysteresis_left,
        state.skipped_steps,
        state.consecutive_skips,
      )
      return state, counters

    return jax.lax.scan(step, state, values)[1]

  return tx, run


_KIND_VALUES = np.array([1.0, INF, -INF, NAN], np.float32)


@st.composite
def _runs(draw):
  """A config index, a start state and a long flag sequence of runs."""
  index = draw(st.sampled_from(range(len(CONFIGS))))
  cfg = CONFIGS[index]
  runs = draw(
    st.lists(
      st.tuples(st.sampled_from([0, 0, 1, 2, 3]), st.integers(1, 80)),
      min_size=1,
      max_size=12,
    )
  )
  kinds = np.concatenate([np.full(n, k) for k, n in runs])
  kinds = np.resize(kinds, LENGTH)  # repeats the pattern up to LENGTH
  start = (
    cfg.initial_scale,
    draw(st.integers(0, cfg.growth_interval - 1)),
    draw(st.integers(0, cfg.hysteresis)),
    draw(st.one_of(st.integers(0, 10), st.integers(I32_MAX - 300, I32_MAX))),
    draw(st.one_of(st.integers(0, 10), st.integers(I32_MAX - 300, I32_MAX))),
  )
  return index, kinds, start


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(_runs())
def test_long_sequences_match_the_reference_and_stay_in_bounds(case):
  index, kinds, start = case
  cfg = CONFIGS[index]
  tx, run = _compiled_run(index)
  state = tx.init(jnp.zeros([], jnp.float32))
  state = state._replace(
    good_steps=jnp.int32(start[1]),
    hysteresis_left=jnp.int32(start[2]),
    skipped_steps=jnp.int32(start[3]),
    consecutive_skips=jnp.int32(start[4]),
  )
  got = run(state, jnp.asarray(_KIND_VALUES[kinds]))
  expected = reference_rule(cfg, kinds == 0, start)
  names = ["loss_scale", "good", "hysteresis_left", "skipped", "consecutive"]
  for i, name in enumerate(names):
    want = np.array([e[i] for e in expected])
    np.testing.assert_array_equal(np.asarray(got[i]), want, err_msg=name)
  scales = np.asarray(got[0])
  assert scales.dtype == np.float32
  assert np.all(np.isfinite(scales))
  assert np.all(scales >= np.float32(cfg.min_scale))
  assert np.all(scales <= np.float32(cfg.max_scale))
  for counter in got[1:]:
    assert np.asarray(counter).dtype == np.int32
    assert np.all(np.asarray(counter) >= 0)


def test_extreme_factors_keep_the_scale_finite_and_in_range():
  # The last config, by hand: growth by 2**100 overflows float32 on the
  # second step, so the scale stays at 2**100 (TF 1.x, TF 2.x and torch skip
  # a growth past float32's range); three back-offs by 2**-100 reach 2**-200,
  # which underflows to 0 and is clamped to min_scale.
  _, run = _compiled_run(len(CONFIGS) - 1)
  tx = CONFIGS[-1].tx()
  values = _KIND_VALUES[np.array([0, 0, 0, 1, 2, 3])]
  got = np.asarray(run(tx.init(jnp.zeros([])), values)[0])
  expected = [2.0**100, 2.0**100, 2.0**100, 1.0, 2.0**-100, 2.0**-120]
  np.testing.assert_array_equal(got, np.array(expected, np.float32))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_growth_past_float32_keeps_the_scale(jit):
  # TF 1.x `incr_loss_scale`, TF 2.x `_assign_if_finite`, torch ("do not grow
  # the scale past fp32 bounds to inf"): a product that overflows float32
  # keeps the old scale instead of clamping to the float32 maximum.
  f32max = float(np.finfo(np.float32).max)
  tx = ls.dynamic_loss_scale(
    optax.sgd(1.0), initial_scale=2.0**126, growth_interval=1, max_scale=f32max
  )
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  scales = []
  for _ in range(3):
    _, state = update({"w": jnp.ones(2)}, state, params)
    scales.append(float(state.loss_scale))
  assert scales == [2.0**127, 2.0**127, 2.0**127]
  assert state.skipped_steps == 0


# ---------------------------------------------------------------------------
# Counters saturate at the int32 maximum.


def _near_limit(state, **counters):
  return state._replace(**{k: jnp.int32(v) for k, v in counters.items()})


def test_skip_counters_saturate():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  params = {"w": jnp.ones(2)}
  state = _near_limit(
    tx.init(params), skipped_steps=I32_MAX - 1, consecutive_skips=I32_MAX - 1
  )
  update = jax.jit(tx.update)
  bad = {"w": jnp.array([INF, 0.0])}
  seen = []
  for _ in range(3):
    _, state = update(bad, state, params)
    seen.append((int(state.skipped_steps), int(state.consecutive_skips)))
  assert seen == [(I32_MAX, I32_MAX)] * 3
  assert state.skipped_steps.dtype == jnp.int32
  with pytest.raises(ls.LossScaleStalledError, match=f"last {I32_MAX} optimizer"):
    ls.check_not_stalled(state)
  # A finite step resets the consecutive count; the total stays saturated.
  _, state = update({"w": jnp.ones(2)}, state, params)
  assert (int(state.skipped_steps), int(state.consecutive_skips)) == (I32_MAX, 0)


def test_good_steps_reach_the_largest_growth_interval():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0, growth_interval=I32_MAX)
  params = {"w": jnp.ones(2)}
  state = _near_limit(tx.init(params), good_steps=I32_MAX - 2)
  update = jax.jit(tx.update)
  seen = []
  for _ in range(3):
    _, state = update({"w": jnp.ones(2)}, state, params)
    seen.append((int(state.good_steps), float(state.loss_scale)))
  # Grows on exactly the 2**31-1-th step, with no wrap to a negative count.
  assert seen == [(I32_MAX - 1, 4.0), (0, 8.0), (1, 8.0)]


def test_good_steps_saturate_with_a_static_scale():
  # A static scale never resets good_steps on growth: it must saturate.
  tx = ls.static_loss_scale(optax.sgd(0.1), 2.0)
  params = {"w": jnp.ones(2)}
  state = _near_limit(tx.init(params), good_steps=I32_MAX - 1)
  update = jax.jit(tx.update)
  for _ in range(3):
    _, state = update({"w": jnp.ones(2)}, state, params)
    assert int(state.good_steps) == I32_MAX
  _, state = update({"w": jnp.array([NAN, 1.0])}, state, params)
  assert int(state.good_steps) == 0


# ---------------------------------------------------------------------------
# Skipped steps: nothing moves, the inner optimizer never sees a non-finite value.


@pytest.mark.parametrize("bad_value", [INF, -INF, NAN])
@pytest.mark.parametrize("leaf", ["a", "b", "c"])
def test_skipped_step_is_exact(bad_value, leaf):
  params = {"a": jnp.ones((2, 3)), "b": jnp.ones(4), "c": jnp.ones(())}
  with standard_promotion():
    tx = ls.dynamic_loss_scale(optax.adamw(1e-2), initial_scale=8.0)
    update = jax.jit(tx.update)
    state = tx.init(params)
    # Warm up so that the inner state is not all zeros.
    ok = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    u, state = update(ok, state, params)
    params = optax.apply_updates(params, u)
    bad = dict(ok)
    bad[leaf] = bad[leaf].at[(0,) * bad[leaf].ndim].set(bad_value)
    u, new_state = update(bad, state, params)
    new_params = optax.apply_updates(params, u)
  for x in jax.tree.leaves(u):
    assert x.dtype == jnp.float32
    np.testing.assert_array_equal(x, np.zeros(x.shape, np.float32))
    assert not np.any(np.signbit(x)), "skipped updates must be +0.0"
  assert_trees_equal((state.inner_state, params), (new_state.inner_state, new_params))
  assert float(new_state.loss_scale) == 4.0
  assert int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("value", [INF, -INF, NAN])
def test_every_element_non_finite(value):
  # PyTorch's "perfect storm": every gradient element overflowed. Each step
  # is skipped, adam's moments untouched, the scale backs off once per step.
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, value), params)
  with standard_promotion():
    tx = ls.dynamic_loss_scale(optax.adam(0.1), initial_scale=2.0**15)
    state0 = tx.init(params)
    update = jax.jit(tx.update)
    state = state0
    for step in range(1, 4):
      updates, state = update(grads, state, params)
      assert_trees_equal(updates, jax.tree.map(jnp.zeros_like, params))
      assert float(state.loss_scale) == 2.0 ** (15 - step)
  assert_trees_equal(state.inner_state, state0.inner_state)
  assert int(state.skipped_steps) == 3


def test_hundred_nonfinite_steps_never_change_params():
  # adamw's weight decay would move the params even for zero gradients, so
  # unchanged params mean the inner optimizer's result was never applied.
  tx = ls.dynamic_loss_scale(optax.adamw(1e-2, weight_decay=0.1), initial_scale=2.0**15)
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(3)}
  rng = np.random.default_rng(0)
  bad_values = rng.choice(np.array([INF, -INF, NAN], np.float32), size=(100, 2, 3))
  with standard_promotion():
    state0 = tx.init(params)

    @jax.jit
    def run(params, state, bad):
      def step(carry, bad_w):
        params, state = carry
        grads = {"w": bad_w, "b": jnp.ones(3)}
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), None

      return jax.lax.scan(step, (params, state), bad)[0]

    new_params, state = run(params, state0, jnp.asarray(bad_values))
  assert_trees_equal(new_params, params)
  assert_trees_equal(state.inner_state, state0.inner_state)
  assert int(state.skipped_steps) == 100
  assert int(state.consecutive_skips) == 100
  assert float(state.loss_scale) == 1.0  # 2**15 backed off to min_scale
  assert ls.nonfinite_leaves((new_params, state)) == {}
  with pytest.raises(ls.LossScaleStalledError, match="last 100 optimizer steps"):
    ls.check_not_stalled(state)

  # optax.apply_if_finite, for contrast, gives up and applies NaN after
  # max_consecutive_errors: lossscale never does.
  bare = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)
  bare_state = bare.init(params)
  bad_grads = {"w": jnp.full((2, 3), NAN), "b": jnp.ones(3)}
  bare_params = params
  for _ in range(5):
    updates, bare_state = bare.update(bad_grads, bare_state, bare_params)
    bare_params = optax.apply_updates(bare_params, updates)
  assert ls.nonfinite_leaves(bare_params) == {"['w']": 6}


def test_inner_optimizer_never_sees_nonfinite_values():
  tx, seen = recording_wrapper()
  state = tx.init(jnp.zeros(3))
  update = jax.jit(tx.update)
  update(jnp.array([1.0, INF, 2.0]), state)
  update(jnp.array([NAN, 1.0, 2.0]), state)
  update(jnp.array([3.0, 1.0, 2.0]), state)
  jax.effects_barrier()
  # A skipped step does not run the inner optimizer at all (`lax.cond`).
  assert len(seen) == 1
  assert all(np.all(np.isfinite(s)) for s in seen)
  # Under vmap with per-member decisions both branches run: the inner
  # optimizer sees zeros in place of a bad member's gradients.
  seen.clear()
  states = jax.vmap(tx.init)(jnp.zeros((2, 3)))
  grads = jnp.array([[1.0, INF, 2.0], [3.0, 1.0, 2.0]])
  # The vmap traced inside the jit (the flag batched), or a jitted step
  # batched afterwards (the inner optimizer's callback could see its inputs).
  for update in (jax.jit(jax.vmap(tx.update)), jax.vmap(jax.jit(tx.update))):
    seen.clear()
    new_states = update(grads, states)[1]
    jax.effects_barrier()
    assert len(seen) == 2  # one call per member
    assert any(np.array_equal(s, np.zeros(3, np.float32)) for s in seen)
    assert all(np.all(np.isfinite(s)) for s in seen)
    np.testing.assert_array_equal(new_states.skipped_steps, [1, 0])


def test_skip_nonfinite_passes_gradients_unchanged():
  # Unscaled (by 1) in float32, as every wrapper unscales, the inner optimizer
  # computing in float32; the updates in the gradients' dtype (no params
  # given), as bare identity returns them: the values exact.
  g = {"w": jnp.array([1.5, -2.0], jnp.bfloat16)}
  tx = ls.skip_nonfinite(optax.identity())
  state = tx.init(g)
  u, state = jax.jit(tx.update)(g, state)
  assert u["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(u["w"], g["w"])
  assert float(state.loss_scale) == 1.0
  u, state = jax.jit(tx.update)({"w": jnp.array([1.0, NAN], jnp.bfloat16)}, state)
  assert u["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(u["w"], np.zeros(2))
  assert int(state.skipped_steps) == 1


# ---------------------------------------------------------------------------
# Equivalence with the bare optimizer fed unscaled gradients.


_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)

OPTIMIZERS = {
  "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "lion": lambda: optax.lion(1e-3),
  "adafactor": lambda: optax.adafactor(1e-2),
  "rmsprop": lambda: optax.rmsprop(1e-2),
  "adagrad": lambda: optax.adagrad(1e-1),
  "lamb": lambda: optax.lamb(1e-2),
  "clip_then_adam": lambda: optax.chain(
    optax.clip_by_global_norm(0.05), optax.adam(1e-2)
  ),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=1e-2
  ),
  "schedule": lambda: optax.adam(_SCHEDULE),
  "noisy_sgd": lambda: _compat.noisy_sgd(1e-2, key=0),
}


def _problem(seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  params = {
    "dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jnp.zeros(3)},
    "scale": jax.random.normal(k2, ()),
  }
  keys = jax.random.split(k3, 8)
  grads = [
    jax.tree.map(lambda p, k=k: jax.random.normal(k, p.shape), params) for k in keys
  ]
  return params, grads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_finite_steps_match_bare_optimizer_and_skips_do_not_advance(name):
  scale = 2.0**12  # a power of two: scaling and unscaling are exact.
  params, grads = _problem()
  with standard_promotion():
    bare = OPTIMIZERS[name]()
    wrapped = ls.dynamic_loss_scale(
      OPTIMIZERS[name](), initial_scale=scale, growth_interval=100
    )
    bare_update, wrapped_update = jax.jit(bare.update), jax.jit(wrapped.update)
    p_bare, s_bare = params, bare.init(params)
    p_wr, s_wr = params, wrapped.init(params)
    bad = jax.tree.map(lambda g: g.at[..., 0].set(INF) if g.ndim else g * INF, grads[0])
    for i, g in enumerate(grads):
      if i in (2, 5):  # a skipped step between finite ones
        before = (p_wr, s_wr.inner_state)
        u, s_wr = wrapped_update(bad, s_wr, p_wr)
        p_wr = optax.apply_updates(p_wr, u)
        assert_trees_equal(before, (p_wr, s_wr.inner_state))
      u, s_bare = bare_update(g, s_bare, p_bare)
      p_bare = optax.apply_updates(p_bare, u)
      # The scale backs off after each skip: read it from the state.
      current = ls.get_loss_scale(s_wr)
      scaled = jax.tree.map(lambda x, c=current: x * c, g)
      u, s_wr = wrapped_update(scaled, s_wr, p_wr)
      p_wr = optax.apply_updates(p_wr, u)
      assert_trees_close(p_wr, p_bare)
    # The inner state (counts, schedule positions) equals the bare one's:
    # the two skipped steps did not advance it.
    assert_trees_close(s_wr.inner_state, s_bare)
  assert int(s_wr.skipped_steps) == 2
  assert float(s_wr.loss_scale) == scale / 4


def test_clipping_inside_inner_sees_unscaled_gradients():
  g = {"w": jnp.array([0.3, -0.4])}  # norm 0.5 < 1: no clipping
  tx = ls.dynamic_loss_scale(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  )
  state = tx.init(g)
  scaled = jax.tree.map(lambda x: x * float(ls.get_loss_scale(state)), g)
  u, _ = jax.jit(tx.update)(scaled, state, g)
  np.testing.assert_allclose(u["w"], -g["w"], rtol=1e-7)


def _rosenbrock(w):
  return jnp.sum(100.0 * (w[1:] - w[:-1] ** 2) ** 2 + (1.0 - w[:-1]) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_lbfgs_follows_bare_lbfgs_with_grad_unscaled(fused, jit):
  # The natural step hands the (scaled) gradients to `grad=` too: the zoom
  # line search must see the true slope, so the wrapped run follows bare
  # L-BFGS (a slope `scale` times too steep ended at 0.376 against 0.204).
  scale = 2.0**10
  wrapped = ls.static_loss_scale(optax.lbfgs(), scale)
  bare = optax.lbfgs()

  def bare_step(w, s):
    v, g = jax.value_and_grad(_rosenbrock)(w)
    u, s = bare.update(g, s, w, value=v, grad=g, value_fn=_rosenbrock)
    return optax.apply_updates(w, u), s, v

  def wrapped_step(w, s):
    v, g = ls.value_and_grad(_rosenbrock)(s, w)  # g: of the scaled loss
    extra = dict(value=v, grad=g, value_fn=_rosenbrock)
    if fused:
      w, s = ls.apply_gradients(wrapped, g, s, w, **extra)
      return w, s, v
    u, s = wrapped.update(g, s, w, **extra)
    return optax.apply_updates(w, u), s, v

  if jit:
    bare_step, wrapped_step = jax.jit(bare_step), jax.jit(wrapped_step)
  w0 = jnp.array([-1.2, 1.0, -0.5, 0.8])
  with standard_promotion():
    w_b, s_b = w0, bare.init(w0)
    w_w, s_w = w0, wrapped.init(w0)
    for _ in range(12):
      w_b, s_b, v_b = bare_step(w_b, s_b)
      w_w, s_w, v_w = wrapped_step(w_w, s_w)
      np.testing.assert_allclose(v_w, v_b, rtol=1e-4)
  np.testing.assert_allclose(w_w, w_b, rtol=1e-4, atol=1e-6)
  assert float(_rosenbrock(w_w)) < 0.5 * float(_rosenbrock(w0))


def test_lbfgs_grad_extra_argument_is_unscaled_in_half_precision():
  # float16 parameters: `grad=` is unscaled and widened like the updates, so
  # the first step is bare L-BFGS's on the float32 copy of the parameters.
  tx = ls.static_loss_scale(optax.lbfgs(), 8.0)
  bare = optax.lbfgs()
  w = jnp.array([0.5, -0.25, 1.5], jnp.float16)
  w32 = w.astype(jnp.float32)
  f = lambda p: _rosenbrock(p.astype(jnp.float32))
  with standard_promotion():
    s = tx.init(w)
    v, g = ls.value_and_grad(f)(s, w)
    u, s = tx.update(g, s, w, value=v, grad=g, value_fn=f)
    v32, g32 = jax.value_and_grad(f)(w32)
    want, _ = bare.update(g32, bare.init(w32), w32, value=v32, grad=g32, value_fn=f)
  assert bool(s.last_finite)
  assert u.dtype == jnp.float16  # the parameters' dtype, as bare L-BFGS gives
  np.testing.assert_allclose(u, want.astype(jnp.float16), rtol=2.0**-10)


def _lookahead_problem():
  fast = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}
  params = optax.LookaheadParams.init_synced(fast)
  grads = [
    jax.tree.map(lambda x, k=k: (k + 1.0) * 0.1 * x + 0.05, fast) for k in range(7)
  ]
  return params, grads


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lookahead_inner_matches_bare_lookahead(jit):
  # optax.lookahead's params are `LookaheadParams(fast, slow)` while its
  # gradients are those of `params.fast`: optax's documented contract.
  inner = optax.lookahead(optax.adam(0.1), sync_period=3, slow_step_size=0.5)
  tx = ls.dynamic_loss_scale(inner, initial_scale=2.0**8)
  params, grads = _lookahead_problem()
  update = jax.jit(tx.update) if jit else tx.update
  bare_update = jax.jit(inner.update) if jit else inner.update
  with standard_promotion():
    p_w, s_w = params, tx.init(params)
    p_b, s_b = params, inner.init(params)
    for k, g in enumerate(grads):  # 7 steps: two syncs
      scaled = jax.tree.map(lambda x: x * 2.0**8, g)
      if k == 4:  # an overflow in between: skipped, nothing moves
        bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.inf), g)
        u, skipped = update(bad, s_w, p_w)
        assert not bool(skipped.last_finite)
        assert_trees_equal(skipped.inner_state, s_w.inner_state)
        assert not any(np.asarray(x).any() for x in jax.tree.leaves(u))
        s_w = skipped._replace(loss_scale=s_w.loss_scale)
      u, s_w = update(scaled, s_w, p_w)
      p_w = optax.apply_updates(p_w, u)
      bu, s_b = bare_update(g, s_b, p_b)
      p_b = optax.apply_updates(p_b, bu)
  assert_trees_close(p_w, p_b, rtol=1e-6)
  assert_trees_close(s_w.inner_state, s_b, rtol=1e-6)


def test_lookahead_with_apply_gradients_matches_the_composed_step():
  inner = optax.lookahead(
    optax.sgd(0.1, momentum=0.9), sync_period=2, slow_step_size=0.5
  )
  tx = ls.dynamic_loss_scale(inner, initial_scale=4.0)
  params, grads = _lookahead_problem()

  def composed(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  fused = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
  composed = jax.jit(composed)
  p_f = p_c = params
  s_f = s_c = tx.init(params)
  with standard_promotion():  # optax 0.2.4's lookahead mixes float and bool
    for g in grads[:4]:
      g = jax.tree.map(lambda x: x * 4.0, g)
      p_f, s_f = fused(g, s_f, p_f)
      p_c, s_c = composed(g, s_c, p_c)
    bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), grads[0])
    kept, s_k = fused(bad, s_f, p_f)
  assert_trees_close(p_f, p_c, rtol=1e-6)
  assert_trees_equal(kept, p_f)
  assert_trees_equal(s_k.inner_state, s_f.inner_state)


@pytest.mark.parametrize(
  "grads",
  [{"w": jnp.ones(3)}, {"w": jnp.ones(2), "b": jnp.ones(1), "c": jnp.ones(1)}],
)
def test_lookahead_with_wrong_gradients_still_gets_a_clear_error(grads):
  inner = optax.lookahead(optax.adam(0.1), sync_period=3, slow_step_size=0.5)
  tx = ls.dynamic_loss_scale(inner)
  params, _ = _lookahead_problem()
  with standard_promotion(), pytest.raises(ValueError, match=r"does not match|shape"):
    jax.jit(tx.update)(grads, tx.init(params), params)


# ---------------------------------------------------------------------------
# `enabled=False`: exactly the inner optimizer, same state structure.


@pytest.mark.parametrize(
  "make",
  [
    lambda inner: ls.dynamic_loss_scale(inner, enabled=False),
    lambda inner: ls.static_loss_scale(inner, 2.0**10, enabled=False),
  ],
  ids=["dynamic", "static"],
)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["adamw", "rmsprop", "nesterov"])
def test_disabled_is_bitwise_the_bare_optimizer(make, jit, dtype, name):
  inner = {
    "adamw": optax.adamw(1e-2),
    "rmsprop": optax.rmsprop(1e-2),
    "nesterov": optax.sgd(0.1, momentum=0.9, nesterov=True),
  }[name]
  tx, enabled = make(inner), ls.dynamic_loss_scale(inner)
  params, (g0, g1, g2, g3, *_) = _problem()
  params, g0, g1, g2, g3 = jax.tree.map(
    lambda x: x.astype(dtype), (params, g0, g1, g2, g3)
  )
  # Several finite steps (Adam's moments differ in the last bits from the
  # second step when the compiled step is not the bare one), and an inf.
  inf = jax.tree.map(lambda g: jnp.full_like(g, INF), g1)
  grad_seq = [g0, g1, g2, inf, g3]
  with standard_promotion():
    state, bare = tx.init(params), inner.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(enabled.init(params))
    update, bare_update = tx.update, inner.update
    if jit:
      update, bare_update = jax.jit(update), jax.jit(bare_update)
    for g in grad_seq:  # the inf is not skipped: enabled=False checks nothing
      u, state = update(g, state, params)
      bu, bare = bare_update(g, bare, params)
      assert_trees_equal(u, bu)
      assert_trees_equal(state.inner_state, bare)
  assert float(ls.get_loss_scale(state)) == 1.0
  assert int(state.skipped_steps) == 0 and bool(state.last_finite)
  # The loss is scaled by 1: the gradients are the plain ones.
  _, g = ls.value_and_grad(lambda w: jnp.sum(w**2))(state, jnp.arange(3.0))
  np.testing.assert_array_equal(g, 2 * jnp.arange(3.0))


# ---------------------------------------------------------------------------
# vmap, MultiSteps, compilation and types.


def test_vmap_ensemble_members_scale_and_skip_independently():
  tx = ls.dynamic_loss_scale(optax.sgd(1.0), initial_scale=8.0)
  params = jnp.zeros((3, 2))  # three members
  states = jax.vmap(tx.init)(params)
  grads = jnp.array([[8.0, 16.0], [INF, 1.0], [-8.0, 0.0]])
  u, states = jax.jit(jax.vmap(tx.update))(grads, states, params)
  np.testing.assert_array_equal(u, [[-1.0, -2.0], [0.0, 0.0], [1.0, 0.0]])
  np.testing.assert_array_equal(states.loss_scale, [8.0, 4.0, 8.0])
  np.testing.assert_array_equal(states.skipped_steps, [0, 1, 0])
  np.testing.assert_array_equal(ls.get_loss_scale(states), [8.0, 4.0, 8.0])


def test_multisteps_outside_drops_only_the_bad_microbatch():
  """`dynamic_loss_scale(MultiSteps(inner, k))` drops only a bad micro-batch.

  The wrapper checks (and unscales) every micro-batch before it reaches the
  accumulator, so a bad one is skipped alone and the accumulation goes on.
  The other order, `MultiSteps(dynamic_loss_scale(inner), k)`, checks only
  the accumulated gradient, and the inf poisons MultiSteps' accumulator.
  """
  scale = 4.0
  micro = [
    jnp.array([1.0, 2.0]),
    jnp.array([INF, 0.0]),
    jnp.array([3.0, 0.0]),
    jnp.array([5.0, 4.0]),
    jnp.array([1.0, 1.0]),
  ]
  good = [m for m in micro if bool(jnp.all(jnp.isfinite(m)))]
  p0 = jnp.zeros(2)

  def run(tx, grads):
    with standard_promotion():  # MultiSteps divides by an int32 count
      state, p = tx.init(p0), p0
      update = jax.jit(tx.update)
      for g in grads:
        u, state = update(g, state, p)
        p = optax.apply_updates(p, u)
    return p, state

  # Reference: MultiSteps fed only the good micro-batches, unscaled.
  ref, _ = run(optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation(), good)
  outside = ls.dynamic_loss_scale(
    optax.MultiSteps(optax.sgd(1.0), 2).gradient_transformation(),
    initial_scale=scale,
    backoff_factor=1.0,
  )
  p_out, s_out = run(outside, [m * scale for m in micro])
  np.testing.assert_allclose(p_out, ref)
  # Accumulated pairs (m0, m2) and (m3, m4), by hand.
  np.testing.assert_allclose(
    p_out,
    -jnp.array([(1.0 + 3.0) / 2 + (5.0 + 1.0) / 2, (2.0 + 0.0) / 2 + (4.0 + 1.0) / 2]),
  )
  assert int(s_out.skipped_steps) == 1

  inside = optax.MultiSteps(
    ls.dynamic_loss_scale(optax.sgd(1.0), initial_scale=scale, backoff_factor=1.0), 2
  ).gradient_transformation()
  p_in, s_in = run(inside, [m * scale for m in micro])
  # Worse than losing one accumulated step: optax.MultiSteps resets its
  # accumulator by multiplying it with 0, and inf * 0 = NaN, so every later
  # accumulated gradient is NaN and every later step is skipped too.
  np.testing.assert_array_equal(p_in, np.zeros(2))
  assert int(s_in.inner_opt_state.skipped_steps) == 2
  assert np.isnan(s_in.acc_grads[0])


def test_no_recompilation_between_finite_and_skipped_steps():
  with standard_promotion():
    tx = ls.dynamic_loss_scale(optax.adamw(1e-3), growth_interval=1)
    params = {"w": jnp.ones((3, 2))}
    update = jax.jit(tx.update)
    state = tx.init(params)
    _, state = update({"w": jnp.ones((3, 2))}, state, params)
    assert update._cache_size() == 1
    for v in [INF, 1.0, NAN, 2.0]:
      g = jnp.full((3, 2), v, jnp.float32)
      _, state = update({"w": g}, state, params)
    assert update._cache_size() == 1


@pytest.mark.parametrize(
  "make",
  [
    lambda i: ls.dynamic_loss_scale(i),
    lambda i: ls.static_loss_scale(i, 3.0),
    lambda i: ls.skip_nonfinite(i),
  ],
)
def test_init_and_updated_state_have_identical_types(make):
  with standard_promotion():
    tx = make(optax.adam(1e-3))
    params = {"w": jnp.ones(3)}
    init = tx.init(params)
    _, new = jax.jit(tx.update)({"w": jnp.ones(3)}, init, params)
    # lax.cond demands identical types (no weak types, no dtype drift).
    out = jax.lax.cond(jnp.array(True), lambda: init, lambda: new)
  assert jax.tree.structure(out) == jax.tree.structure(init)
  assert init.loss_scale.dtype == jnp.float32
  assert not init.loss_scale.weak_type
  for c in (
    init.good_steps,
    init.hysteresis_left,
    init.skipped_steps,
    init.consecutive_skips,
  ):
    assert c.dtype == jnp.int32 and not c.weak_type


def test_state_leaves_are_distinct_buffers_so_it_can_be_donated():
  with standard_promotion():
    tx = ls.dynamic_loss_scale(optax.adam(1e-3))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    step = jax.jit(tx.update, donate_argnums=1)
    _, state = step({"w": jnp.ones(3)}, state, params)
  assert float(state.loss_scale) == 2.0**15


def test_loss_scale_field_is_unique_in_the_state():
  tx = optax.chain(optax.clip(1.0), ls.dynamic_loss_scale(optax.sgd(1.0)))
  state = tx.init({"w": jnp.ones(2)})
  assert float(tree_get(state, "loss_scale")) == 2.0**15
