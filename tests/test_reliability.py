"""Reliability of the loss-scaling wrappers: long runs, saturation, bad input.

Persistent overflow, counters at the int32 limit, hostile gradient trees and
dtypes, fault injection on 8 replicas, and property tests of long overflow
sequences against an independent NumPy model of the scale.
"""

import dataclasses
import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

import _compat
import lossscale as ls

INF, NAN = float("inf"), float("nan")
I32_MAX = 2**31 - 1


def _standard():
  # optax's own adam/adamw do `int32 ** float` and need standard promotion.
  return jax.numpy_dtype_promotion("standard")


def _assert_trees_equal(a, b):
  """Bitwise equality of two pytrees, with identical dtypes."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb, strict=True):
    assert x.dtype == y.dtype
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


# ---------------------------------------------------------------------------
# An independent model of the scale: plain Python counters, NumPy float32.


@dataclasses.dataclass(frozen=True)
class Config:
  initial_scale: float
  growth_interval: int
  growth_factor: float
  backoff_factor: float
  hysteresis: int
  min_scale: float
  max_scale: float

  def tx(self):
    return ls.dynamic_loss_scale(optax.sgd(1.0), **dataclasses.asdict(self))


def reference(cfg, flags, start):
  """The scale rule of DESIGN.md, one step at a time, in NumPy float32.

  `start` is `(scale, good, hysteresis_left, skipped, consecutive)`; returns
  the same tuple after every step.
  """
  f32 = np.float32
  scale, good, h, skipped, consecutive = start
  scale = f32(scale)
  out = []
  with np.errstate(over="ignore"):  # scale * growth may overflow to inf
    for finite in flags:
      if finite:
        good = min(good + 1, I32_MAX)
        consecutive = 0
        if good >= cfg.growth_interval:
          scale = min(f32(scale * f32(cfg.growth_factor)), f32(cfg.max_scale))
          good = 0
          h = cfg.hysteresis
      else:
        skipped = min(skipped + 1, I32_MAX)
        consecutive = min(consecutive + 1, I32_MAX)
        good = 0
        h = max(h - 1, 0)
        if h <= 0:
          scale = max(f32(scale * f32(cfg.backoff_factor)), f32(cfg.min_scale))
      out.append((scale, good, h, skipped, consecutive))
  return out


# A few configurations (each compiles once), chosen for their edges.
CONFIGS = [
  # torch.amp.GradScaler's rule with a short interval.
  Config(2.0**15, 3, 2.0, 0.5, 1, 1.0, 2.0**24),
  # Megatron-LM's hysteresis, with bounds reached quickly from both sides.
  Config(2.0**10, 5, 2.0, 0.5, 3, 32.0, 2.0**12),
  # Inexact factors and bounds that products land beside, not on.
  Config(10.0, 1, 3.0, 0.3, 2, 0.75, 1000.0),
  # A constant scale: min_scale == max_scale.
  Config(8.0, 2, 2.0, 0.5, 1, 8.0, 8.0),
  # Never grows, never backs off within a run: int32-limit settings.
  Config(2.0**24, I32_MAX, 2.0, 0.5, I32_MAX, 1.0, 2.0**24),
  # Growth overflows float32 to inf before the clamp; backoff reaches tiny
  # scales: the scale must stay finite and in bounds anyway.
  Config(1.0, 1, 2.0**100, 2.0**-100, 1, 2.0**-120, float(np.finfo(np.float32).max)),
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
  expected = reference(cfg, kinds == 0, start)
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


def test_extreme_factors_clamp_instead_of_overflowing():
  # The last config, by hand: growth by 2**100 overflows float32 on the
  # second step and is clamped to max_scale; three back-offs by 2**-100 reach
  # 2**-172 * (2 - 2**-23), which underflows to 0 and is clamped to min_scale.
  _, run = _compiled_run(len(CONFIGS) - 1)
  tx = CONFIGS[-1].tx()
  values = _KIND_VALUES[np.array([0, 0, 0, 1, 2, 3])]
  got = np.asarray(run(tx.init(jnp.zeros([])), values)[0])
  f32max = np.finfo(np.float32).max
  mantissa = 2.0 - 2.0**-23  # f32max == mantissa * 2**127
  expected = [2.0**100, f32max, f32max, mantissa * 2.0**27, mantissa * 2.0**-73]
  expected.append(2.0**-120)
  np.testing.assert_array_equal(got, np.array(expected, np.float32))


# ---------------------------------------------------------------------------
# Persistent overflow: skip forever, never give up, never apply a NaN.


def test_hundred_nonfinite_steps_never_change_params():
  # adamw's weight decay would move the params even for zero gradients, so
  # unchanged params mean the inner optimizer's result was never applied.
  tx = ls.dynamic_loss_scale(optax.adamw(1e-2, weight_decay=0.1), initial_scale=2.0**15)
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.ones(3)}
  rng = np.random.default_rng(0)
  bad_values = rng.choice(np.array([INF, -INF, NAN], np.float32), size=(100, 2, 3))
  with _standard():
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
  _assert_trees_equal(new_params, params)
  _assert_trees_equal(state.inner_state, state0.inner_state)
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
# Hostile gradient trees.

_SGD_LR = 0.5


def _sgd_tx(initial_scale=4.0):
  return ls.dynamic_loss_scale(optax.sgd(_SGD_LR), initial_scale=initial_scale)


@pytest.mark.parametrize(
  "grads, match",
  [
    ({"a": jnp.ones(2)}, "does not match the params tree"),
    ({"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)}, "does not match"),
    ([jnp.ones(2), jnp.ones(3)], "does not match"),
    ({"a": jnp.ones(3), "b": jnp.ones(3)}, r"at \['a'\] has shape \(3,\)"),
    ({"a": jnp.ones(2), "b": jnp.ones((3, 1))}, r"at \['b'\] has shape \(3, 1\)"),
  ],
)
def test_mismatched_gradients_with_params_raise_early(grads, match):
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  tx = ls.dynamic_loss_scale(optax.adam(0.1))
  state = tx.init(params)
  with pytest.raises(ValueError, match=match):
    jax.jit(tx.update)(grads, state, params)


def test_mismatched_gradients_without_params():
  # Without params nothing says what the tree should be: a stateful inner
  # optimizer fails on its own state's tree, a stateless one returns updates
  # of the gradients' shape, which `optax.apply_updates` then rejects.
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  wrong = {"a": jnp.ones(2)}
  with _standard():
    tx = ls.dynamic_loss_scale(optax.adam(0.1))
    with pytest.raises(ValueError, match=r"pytree structure|Dict key mismatch"):
      jax.jit(tx.update)(wrong, tx.init(params))
  tx = _sgd_tx()
  updates, _ = jax.jit(tx.update)(wrong, tx.init(params))
  with pytest.raises(ValueError):
    optax.apply_updates(params, updates)


def test_integer_bool_and_float0_leaves_pass_through_unscaled():
  params = {"w": jnp.array([1.0, -2.0]), "n": jnp.int32(7), "on": jnp.array(True)}
  mask = {"w": True, "n": False, "on": False}
  tx = ls.dynamic_loss_scale(optax.masked(optax.sgd(_SGD_LR), mask), initial_scale=4.0)
  state = tx.init(params)
  update = jax.jit(tx.update)

  # float0 gradients, as `jax.grad(..., allow_int=True)` gives them.
  def loss(p):
    return ls.scale_loss(jnp.sum(p["w"] ** 2), state)

  grads = jax.grad(loss, allow_int=True)(params)
  assert grads["n"].dtype == jax.dtypes.float0
  updates, new_state = update(grads, state, params)
  np.testing.assert_array_equal(updates["w"], -_SGD_LR * 2.0 * np.array([1.0, -2.0]))
  assert updates["n"].dtype == jax.dtypes.float0
  assert updates["on"].dtype == jax.dtypes.float0
  assert int(new_state.skipped_steps) == 0

  # Integer gradient leaves: never checked, never divided by the scale.
  int_grads = {"w": jnp.array([4.0, 8.0]), "n": jnp.int32(-3), "on": jnp.array(True)}
  updates, new_state = update(int_grads, state, params)
  np.testing.assert_array_equal(updates["w"], [-0.5, -1.0])
  assert updates["n"].dtype == jnp.int32 and int(updates["n"]) == -3
  assert bool(updates["on"])
  # ... and zeroed, like every update, on a skipped step.
  bad = dict(int_grads, w=jnp.array([NAN, 8.0]))
  updates, new_state = update(bad, state, params)
  assert int(new_state.skipped_steps) == 1
  assert int(updates["n"]) == 0 and not bool(updates["on"])
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])


def test_none_leaves():
  params = {"a": jnp.array([1.0, 2.0]), "frozen": None}
  tx = _sgd_tx()
  update = jax.jit(tx.update)
  state = tx.init(params)
  updates, state = update({"a": jnp.array([4.0, -4.0]), "frozen": None}, state, params)
  assert updates["frozen"] is None
  np.testing.assert_array_equal(updates["a"], [-0.5, 0.5])
  updates, state = update({"a": jnp.array([INF, 1.0]), "frozen": None}, state, params)
  assert updates["frozen"] is None and int(state.skipped_steps) == 1


def test_wrapper_inside_optax_masked_sees_masked_nodes():
  params = {"w": jnp.array([1.0, 2.0]), "frozen": jnp.array([3.0])}
  mask = {"w": True, "frozen": False}
  with _standard():
    tx = optax.masked(ls.dynamic_loss_scale(optax.adam(0.1), initial_scale=8.0), mask)
    state = tx.init(params)
    inner = ls._scaled_grad.find_state(state)
    assert isinstance(inner.inner_state[0].mu["frozen"], optax.MaskedNode)
    update = jax.jit(tx.update)
    updates, state = update(
      {"w": jnp.array([8.0, -8.0]), "frozen": jnp.ones(1)}, state, params
    )
    bare = optax.adam(0.1)
    expected, _ = bare.update(
      {"w": jnp.array([1.0, -1.0])}, bare.init({"w": params["w"]})
    )
  np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-6)
  np.testing.assert_array_equal(updates["frozen"], [1.0])  # masked: passed through
  with _standard():
    updates, state = update(
      {"w": jnp.array([NAN, 1.0]), "frozen": jnp.ones(1)}, state, params
    )
  assert int(ls._scaled_grad.find_state(state).skipped_steps) == 1
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  assert ls.nonfinite_leaves(state) == {}


def test_zero_size_and_scalar_leaves():
  params = {"empty": jnp.zeros((0, 3)), "s": jnp.float32(2.0), "v": jnp.ones(2)}
  with _standard():
    tx = ls.dynamic_loss_scale(optax.adamw(0.1), initial_scale=4.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    grads = {"empty": jnp.zeros((0, 3)), "s": jnp.float32(4.0), "v": jnp.full(2, 8.0)}
    updates, state = update(grads, state, params)
    bare = optax.adamw(0.1)
    unscaled = {
      "empty": jnp.zeros((0, 3)),
      "s": jnp.float32(1.0),
      "v": jnp.full(2, 2.0),
    }
    expected, _ = bare.update(unscaled, bare.init(params), params)
    assert updates["empty"].shape == (0, 3) and updates["s"].shape == ()
    for k in ["s", "v"]:
      np.testing.assert_allclose(updates[k], expected[k], rtol=1e-6)
    # A non-finite scalar leaf skips the step.
    updates, state = update(dict(grads, s=jnp.float32(NAN)), state, params)
    assert int(state.skipped_steps) == 1
    # A tree of only zero-size leaves is finite: the step is applied.
    only_empty = {"e": jnp.zeros((0,))}
    tx2 = ls.dynamic_loss_scale(optax.adamw(0.1))
    _, state2 = jax.jit(tx2.update)(only_empty, tx2.init(only_empty), only_empty)
  assert int(state2.skipped_steps) == 0 and int(state2.good_steps) == 1


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_low_precision_gradients_unscale_in_float32(dtype):
  params = {"w": jnp.ones(3, dtype)}
  tx = _sgd_tx(initial_scale=2.0**10)
  state = tx.init(params)
  # 3 * 2**10 is exact in every dtype; the updates come out in float32.
  grads = {"w": jnp.array([3.0, -1.0, 0.5], dtype) * 2.0**10}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == jnp.float32
  np.testing.assert_array_equal(updates["w"], -_SGD_LR * np.array([3.0, -1.0, 0.5]))
  # 2**17 overflows float16 (max 65504) to inf, not bfloat16 or float32.
  big = {"w": jnp.array([2.0**17, 1.0, 1.0], jnp.float32).astype(dtype)}
  overflowed = dtype == jnp.float16
  assert np.isinf(np.asarray(big["w"], np.float32)[0]) == overflowed
  _, state = jax.jit(tx.update)(big, state, params)
  assert int(state.skipped_steps) == int(overflowed)


def test_float64_gradients_with_x64():
  with _compat.enable_x64(True):
    params = {"w": jnp.ones(2, jnp.float64)}
    tx = _sgd_tx(initial_scale=2.0**10)
    state = tx.init(params)
    # 1 + 2**-40 needs float64: an unscale in float32 would round it away.
    g = np.array([1.0 + 2.0**-40, -3.0]) * 2.0**10
    updates, state = jax.jit(tx.update)(
      {"w": jnp.asarray(g, jnp.float64)}, state, params
    )
    assert updates["w"].dtype == jnp.float64
    np.testing.assert_array_equal(updates["w"], -_SGD_LR * (g / 2.0**10))
    assert state.loss_scale.dtype == jnp.float32
    assert state.skipped_steps.dtype == jnp.int32


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.complex128])
def test_complex_gradients(dtype):
  with _compat.enable_x64(dtype == jnp.complex128):
    params = {"z": jnp.ones(2, dtype)}
    tx = _sgd_tx(initial_scale=4.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = np.array([4.0 + 8.0j, -2.0j])
    updates, state = update({"z": jnp.asarray(g, dtype)}, state, params)
    assert updates["z"].dtype == dtype
    np.testing.assert_array_equal(updates["z"], -_SGD_LR * g / 4.0)
    for bad in [complex(1.0, INF), complex(NAN, 0.0), complex(-INF, 1.0)]:
      updates, state = update({"z": jnp.asarray([bad, 1.0], dtype)}, state, params)
      np.testing.assert_array_equal(updates["z"], [0.0, 0.0])
    assert int(state.skipped_steps) == 3


@pytest.mark.parametrize("value", [INF, -INF, NAN])
def test_every_element_non_finite(value):
  # PyTorch's "perfect storm": every gradient element overflowed. Each step
  # is skipped, adam's moments untouched, the scale backs off once per step.
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, value), params)
  with _standard():
    tx = ls.dynamic_loss_scale(optax.adam(0.1), initial_scale=2.0**15)
    state0 = tx.init(params)
    update = jax.jit(tx.update)
    state = state0
    for step in range(1, 4):
      updates, state = update(grads, state, params)
      _assert_trees_equal(updates, jax.tree.map(jnp.zeros_like, params))
      assert float(state.loss_scale) == 2.0 ** (15 - step)
  _assert_trees_equal(state.inner_state, state0.inner_state)
  assert int(state.skipped_steps) == 3


# ---------------------------------------------------------------------------
# Fault injection on 8 replicas, 500 steps.

_N_STEPS = 500
_BATCH = 4


def _linear_loss(params, x, y):
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - y) ** 2)


def _fault_plan(n_dev, seed=0):
  """Per step and replica: 0 clean, 1/2 inf/NaN in the local gradient before
  the all-reduce, 3/4 inf/NaN after it (this replica only; only `axis_name`
  keeps the replicas together then)."""
  rng = np.random.default_rng(seed)
  kinds = np.zeros((_N_STEPS, n_dev), np.int32)
  for t in rng.choice(_N_STEPS, size=60, replace=False):
    replicas = rng.choice(n_dev, size=rng.integers(1, 4), replace=False)
    kinds[t, replicas] = rng.integers(1, 5, size=len(replicas))
  positions = rng.integers(0, 4 * 3, size=(_N_STEPS, n_dev))
  x = rng.standard_normal((_N_STEPS, n_dev, _BATCH, 4)).astype(np.float32)
  w_true = rng.standard_normal((4, 3)).astype(np.float32)
  y = x @ w_true + np.float32(0.1) * rng.standard_normal((_N_STEPS, n_dev, _BATCH, 3))
  return kinds, positions, x, y.astype(np.float32)


def test_fault_injection_on_eight_replicas():
  n_dev = jax.local_device_count()
  assert n_dev == 8
  kinds, positions, x, y = _fault_plan(n_dev)
  injected = (kinds != 0).any(axis=1)
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  make_inner = lambda: optax.adamw(optax.cosine_decay_schedule(0.05, _N_STEPS), 1e-3)
  tx = ls.dynamic_loss_scale(make_inner(), growth_interval=20, axis_name="batch")
  grad_fn = ls.value_and_grad(_linear_loss)

  def poison(g, kind, pos, when):
    bad = jnp.where(kind == when[0], INF, NAN)
    hit = jnp.logical_or(kind == when[0], kind == when[1])
    flat = g.reshape(-1)
    return flat.at[pos].set(jnp.where(hit, bad, flat[pos])).reshape(g.shape)

  def replica(params, state, xs, ys, ks, ps):
    def step(carry, inputs):
      params, state = carry
      x, y, kind, pos = inputs
      _, grads = grad_fn(state, params, x, y)
      grads["w"] = poison(grads["w"], kind, pos, (1, 2))
      grads = jax.lax.pmean(grads, "batch")
      grads["w"] = poison(grads["w"], kind, pos, (3, 4))
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      state_finite = jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(state)])
      )
      trace = (params, state.loss_scale, state.skipped_steps, state_finite)
      return (params, state), trace

    return jax.lax.scan(step, (params, state), (xs, ys, ks, ps))

  replicate = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n_dev), t)
  swap = lambda a: jnp.asarray(np.swapaxes(a, 0, 1))  # (replica, step, ...)
  with _standard():
    (final_params, final_state), trace = jax.pmap(replica, axis_name="batch")(
      replicate(params),
      replicate(tx.init(params)),
      swap(x),
      swap(y),
      swap(kinds),
      swap(positions),
    )
  trace_params, scales, skipped, state_finite = jax.tree.map(np.asarray, trace)

  # Replicas never diverge: every step, every replica holds the same bits.
  for leaf in jax.tree.leaves((trace_params, scales, skipped)):
    assert (leaf == leaf[:1]).all()
  # Every injected step, and only those, is skipped.
  steps_skipped = np.diff(skipped[0], prepend=0) == 1
  np.testing.assert_array_equal(steps_skipped, injected)
  assert skipped[0, -1] == injected.sum() == int(final_state.skipped_steps[0])
  # No NaN or inf ever reaches the params or the optimizer state.
  assert all(np.isfinite(v).all() for v in jax.tree.leaves(trace_params))
  assert state_finite.all()
  assert ls.nonfinite_leaves((final_params, final_state)) == {}
  # The scale follows the independent model fed the injection pattern.
  expected_scales = [s[0] for s in reference(_fault_cfg(), ~injected, _start())]
  np.testing.assert_array_equal(scales[0], np.array(expected_scales, np.float32))
  # And the params follow bare adamw fed the clean mean gradients only.
  reference_params = _bare_adamw_on_clean_steps(make_inner(), params, x, y, injected)
  for got, want in zip(
    jax.tree.leaves(final_params), jax.tree.leaves(reference_params), strict=True
  ):
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=1e-6)
  assert np.abs(final_params["w"][0]).max() > 0.5  # it did train


def _fault_cfg():
  return Config(2.0**15, 20, 2.0, 0.5, 1, 1.0, 2.0**24)


def _start():
  return (2.0**15, 0, 1, 0, 0)


def _bare_adamw_on_clean_steps(opt, params, x, y, injected):
  """optax alone, on the mean gradient of all replicas' data, skipping by
  Python control flow: independent of lossscale."""
  n_dev = x.shape[1]

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(
      lambda p: jnp.mean(jnp.stack([_linear_loss(p, x[d], y[d]) for d in range(n_dev)]))
    )(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with _standard():
    state = opt.init(params)
    for t in np.flatnonzero(~injected):
      params, state = step(params, state, x[t], y[t])
  return params
