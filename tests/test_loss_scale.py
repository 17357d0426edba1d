"""Tests of the loss-scaling wrappers (lossscale/_loss_scale.py)."""

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

INF, NAN = float("inf"), float("nan")


def _standard():
  # optax's own optimizers do `int32 ** float` and need standard promotion.
  return jax.numpy_dtype_promotion("standard")


def _np(x):
  """A NumPy view of any state leaf (typed PRNG keys included)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype
    assert _np(x).tobytes() == _np(y).tobytes()


def _assert_trees_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(_np(x), _np(y), rtol=2e-6, atol=1e-7)


def _grads_with(value, n=2):
  return {"w": jnp.full((n,), value, jnp.float32)}


def _scale_history(tx, flags):
  """Runs one jitted update per flag (True = finite); returns the scales."""
  params = {"w": jnp.zeros(2, jnp.float32)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  history = []
  for ok in flags:
    _, state = update(_grads_with(1.0 if ok else INF), state, params)
    history.append(float(state.loss_scale))
  return history


# ---------------------------------------------------------------------------
# Published trajectories, step by step.


def test_pytorch_update_scale_kernel():
  # torch test_grad_scaling_update_scale: scale 4, growth 2, backoff 0.25,
  # interval 2; steps ok, ok, inf -> 4, 8, 2.
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1),
    initial_scale=4.0,
    growth_factor=2.0,
    backoff_factor=0.25,
    growth_interval=2,
  )
  assert _scale_history(tx, [True, True, False]) == [4.0, 8.0, 2.0]


def test_tensorflow_dynamic_loss_scale_growth():
  # tf.mixed_precision DynamicLossScale: init 1, period 2, six finite steps.
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1.0, growth_interval=2)
  assert _scale_history(tx, [True] * 6) == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]


def test_tensorflow_dynamic_loss_scale_mixed():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=4.0, growth_interval=2, min_scale=1.0
  )
  flags = [False, True, True, True, False, True, False, True, True, True, False]
  expected = [2.0, 2.0, 4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 2.0, 2.0, 1.0]
  assert _scale_history(tx, flags) == expected


def test_megatron_hysteresis():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=4.0, growth_interval=2, hysteresis=2
  )
  overflow = [0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]
  expected = [4, 8, 8, 8, 16, 16, 16, 8, 4, 4, 8, 8, 16]
  assert _scale_history(tx, [not o for o in overflow]) == expected


def test_bounds_are_respected():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0
  )
  assert _scale_history(tx, [True] * 4 + [False] * 5) == [
    8.0,
    16.0,
    16.0,
    16.0,
    8.0,
    4.0,
    2.0,
    2.0,
    2.0,
  ]


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


# ---------------------------------------------------------------------------
# Property test against an independent reference model.


def _reference(cfg, flags):
  """Plain-Python DynamicGradScaler (Megatron / torch), float32 arithmetic."""
  f32 = np.float32
  scale, good, h = f32(cfg["initial_scale"]), 0, cfg["hysteresis"]
  out = []
  for ok in flags:
    if ok:
      good += 1
      if good == cfg["growth_interval"]:
        scale = min(f32(scale * f32(cfg["growth_factor"])), f32(cfg["max_scale"]))
        good, h = 0, cfg["hysteresis"]
    else:
      good, h = 0, h - 1
      if h <= 0:
        scale = max(f32(scale * f32(cfg["backoff_factor"])), f32(cfg["min_scale"]))
    out.append(float(scale))
  return out


@st.composite
def _configs(draw):
  min_scale = draw(st.sampled_from([2.0**-4, 0.5, 1.0, 3.0]))
  initial = min_scale * draw(st.sampled_from([1.0, 2.0, 7.0, 2.0**10]))
  max_scale = initial * draw(st.sampled_from([1.0, 4.0, 2.0**20]))
  return dict(
    initial_scale=initial,
    min_scale=min_scale,
    max_scale=max_scale,
    growth_interval=draw(st.integers(1, 4)),
    growth_factor=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0])),
    backoff_factor=draw(st.sampled_from([0.1, 0.5, 0.75, 1.0])),
    hysteresis=draw(st.integers(1, 3)),
  )


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(cfg=_configs(), flags=st.lists(st.booleans(), max_size=40))
def test_matches_reference_model(cfg, flags):
  tx = ls.dynamic_loss_scale(optax.identity(), **cfg)
  params = jnp.zeros(3)

  @jax.jit
  def run(seq):
    def body(state, ok):
      g = jnp.where(ok, jnp.ones(3), jnp.full(3, jnp.nan))
      _, state = tx.update(g, state, params)
      return state, state.loss_scale

    return jax.lax.scan(body, tx.init(params), seq)[1]

  got = [float(s) for s in run(jnp.asarray(flags, bool))] if flags else []
  assert got == _reference(cfg, flags)
  assert all(np.isfinite(s) and cfg["min_scale"] <= s <= cfg["max_scale"] for s in got)


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
  with _standard():
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
        _assert_trees_equal(before, (p_wr, s_wr.inner_state))
      u, s_bare = bare_update(g, s_bare, p_bare)
      p_bare = optax.apply_updates(p_bare, u)
      # The scale backs off after each skip: read it from the state.
      current = ls.get_loss_scale(s_wr)
      scaled = jax.tree.map(lambda x, c=current: x * c, g)
      u, s_wr = wrapped_update(scaled, s_wr, p_wr)
      p_wr = optax.apply_updates(p_wr, u)
      _assert_trees_close(p_wr, p_bare)
    # The inner state (counts, schedule positions) equals the bare one's:
    # the two skipped steps did not advance it.
    _assert_trees_close(s_wr.inner_state, s_bare)
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


def test_lbfgs_extra_args_are_forwarded():
  def f(w):
    return jnp.sum((w - jnp.arange(3.0)) ** 2)

  scale = 2.0**8
  with _standard():
    bare, wrapped = optax.lbfgs(), ls.static_loss_scale(optax.lbfgs(), scale)
    w_b = w_w = jnp.zeros(3)
    s_b, s_w = bare.init(w_b), wrapped.init(w_w)

    @jax.jit
    def step_bare(w, s):
      v, g = jax.value_and_grad(f)(w)
      u, s = bare.update(g, s, w, value=v, grad=g, value_fn=f)
      return optax.apply_updates(w, u), s

    @jax.jit
    def step_wrapped(w, s):
      v, g = jax.value_and_grad(f)(w)
      u, s = wrapped.update(g * scale, s, w, value=v, grad=g, value_fn=f)
      return optax.apply_updates(w, u), s

    for _ in range(3):
      w_b, s_b = step_bare(w_b, s_b)
      w_w, s_w = step_wrapped(w_w, s_w)
  np.testing.assert_allclose(w_w, w_b, rtol=1e-6)
  np.testing.assert_allclose(w_w, jnp.arange(3.0), atol=1e-4)


# ---------------------------------------------------------------------------
# Skipped steps.


@pytest.mark.parametrize("bad_value", [INF, -INF, NAN])
@pytest.mark.parametrize("leaf", ["a", "b", "c"])
def test_skipped_step_is_exact(bad_value, leaf):
  params = {"a": jnp.ones((2, 3)), "b": jnp.ones(4), "c": jnp.ones(())}
  with _standard():
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
  _assert_trees_equal((state.inner_state, params), (new_state.inner_state, new_params))
  assert float(new_state.loss_scale) == 4.0
  assert int(new_state.skipped_steps) == 1


def test_inner_optimizer_never_sees_nonfinite_values():
  seen = []

  def record(updates, state, params=None):
    del params
    jax.debug.callback(lambda g: seen.append(np.asarray(g)), updates)
    return updates, state

  tx = ls.dynamic_loss_scale(
    optax.GradientTransformation(lambda p: optax.EmptyState(), record)
  )
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
  jax.jit(jax.vmap(tx.update))(jnp.array([[1.0, INF, 2.0], [3.0, 1.0, 2.0]]), states)
  jax.effects_barrier()
  assert len(seen) == 2  # one call per member
  assert any(np.array_equal(s, np.zeros(3, np.float32)) for s in seen)
  assert all(np.all(np.isfinite(s)) for s in seen)


def test_skip_nonfinite_passes_gradients_unchanged():
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


def test_float16_gradients_are_unscaled_in_float32():
  # 60000 * 2**-15 needs float32: in float16 the product of the gradient and
  # 1/scale would round; the update must equal the float32 computation.
  tx = ls.static_loss_scale(optax.identity(), 2.0**15)
  g = jnp.array([60000.0, 3.0, 2.0**-10], jnp.float16)
  u, _ = jax.jit(tx.update)(g, tx.init(g))
  assert u.dtype == jnp.float32
  np.testing.assert_array_equal(u, g.astype(jnp.float32) / np.float32(2**15))


def test_unscaled_overflow_is_detected_for_scales_below_one():
  # 3e38 is finite, but 3e38 / 0.5 is not: the check is on unscaled values.
  tx = ls.static_loss_scale(optax.identity(), 0.5)
  g = jnp.array([3e38, 1.0], jnp.float32)
  u, state = jax.jit(tx.update)(g, tx.init(g))
  assert int(state.skipped_steps) == 1
  np.testing.assert_array_equal(u, np.zeros(2))


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
    with _standard():  # MultiSteps divides by an int32 count
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
  with _standard():
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
  with _standard():
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
  with _standard():
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


# ---------------------------------------------------------------------------
# Validation.

BAD_DYNAMIC = [
  (dict(initial_scale=0.0), "initial_scale"),
  (dict(initial_scale=-2.0), "initial_scale"),
  (dict(initial_scale=INF), "initial_scale"),
  (dict(initial_scale=NAN), "initial_scale"),
  (dict(initial_scale=2.0**30), "initial_scale"),  # above max_scale
  (dict(initial_scale=0.5), "initial_scale"),  # below min_scale
  (dict(min_scale=0.0), "min_scale"),
  (dict(min_scale=-1.0), "min_scale"),
  (dict(min_scale=NAN), "min_scale"),
  (dict(max_scale=INF), "max_scale"),
  (dict(max_scale=1e39), "max_scale"),  # not a finite float32
  (dict(min_scale=8.0, max_scale=4.0, initial_scale=4.0), "min_scale"),
  (dict(growth_interval=0), "growth_interval"),
  (dict(growth_interval=-3), "growth_interval"),
  (dict(growth_interval=2.5), "growth_interval"),
  (dict(growth_interval=True), "growth_interval"),
  (dict(growth_interval=2**31), "growth_interval"),
  (dict(growth_factor=0.5), "growth_factor"),
  (dict(growth_factor=INF), "growth_factor"),
  (dict(backoff_factor=0.0), "backoff_factor"),
  (dict(backoff_factor=1.5), "backoff_factor"),
  (dict(backoff_factor=-0.5), "backoff_factor"),
  (dict(backoff_factor=NAN), "backoff_factor"),
  (dict(hysteresis=0), "hysteresis"),
  (dict(hysteresis=1.0), "hysteresis"),
  (dict(axis_name=[]), "axis_name"),
  (dict(axis_name=()), "axis_name"),
]


@pytest.mark.parametrize("kwargs,name", BAD_DYNAMIC)
def test_invalid_dynamic_configuration(kwargs, name):
  with pytest.raises(ValueError, match=rf"dynamic_loss_scale\({name}="):
    ls.dynamic_loss_scale(optax.sgd(0.1), **kwargs)


def test_invalid_value_is_named_in_the_message():
  with pytest.raises(ValueError, match="got 0"):
    ls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=0)
  with pytest.raises(ValueError, match=r"got 1\.5"):
    ls.dynamic_loss_scale(optax.sgd(0.1), backoff_factor=1.5)


@pytest.mark.parametrize("scale", [0.0, -1.0, INF, NAN, 1e39])
def test_invalid_static_scale(scale):
  with pytest.raises(ValueError, match=r"static_loss_scale\(loss_scale="):
    ls.static_loss_scale(optax.sgd(0.1), scale)


@pytest.mark.parametrize("value", ["2.0", True, None, [1.0]])
def test_non_numeric_setting_is_rejected(value):
  with pytest.raises(ValueError, match=r"initial_scale=\.\.\.\)` must be a real"):
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=value)


def test_numpy_and_jax_scalars_are_accepted():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1),
    initial_scale=np.float32(4.0),
    growth_interval=np.int64(3),
    max_scale=jnp.float32(8.0),
  )
  assert float(tx.init(jnp.ones(1)).loss_scale) == 4.0


def test_inner_must_be_a_gradient_transformation():
  with pytest.raises(TypeError, match="inner"):
    ls.dynamic_loss_scale(lambda g: g)


def test_gradient_tree_must_match_params():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  state = tx.init(params)
  with pytest.raises(ValueError, match="gradient tree does not match"):
    tx.update({"a": jnp.ones(2)}, state, params)
  with pytest.raises(ValueError, match=r"\['b'\] has shape \(4,\)"):
    tx.update({"a": jnp.ones(2), "b": jnp.ones(4)}, state, params)


# ---------------------------------------------------------------------------
# TF 1.x `ExponentialUpdateLossScaleManager`: every vector of TensorFlow's
# contrib/mixed_precision/python/loss_scale_manager_test.py (incr_ratio 2,
# decr_ratio 1/2, incr_every_n_steps 2 and decr_every_n_nan_or_inf 2 unless
# given). TF records the scale after each update.

F32_MAX = float(np.finfo(np.float32).max)


def _tf1_manager(init, incr_every=2, decr_every=2):
  return ls.dynamic_loss_scale(
    optax.sgd(0.1),
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
  tx = _tf1_manager(init, incr, decr)
  assert _scale_history(tx, [bool(f) for f in flags]) == [float(e) for e in expected]


def test_tensorflow1_keep_increasing_until_capped():
  init = float(np.float32(F32_MAX / 4 + 10))
  expected = [init, init * 2, init * 2, F32_MAX, F32_MAX, F32_MAX]
  assert _scale_history(_tf1_manager(init), [True] * 6) == expected


def test_reset_hysteresis_differs_from_megatron_only_after_a_backoff():
  flags = [False] * 6
  megatron = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0, hysteresis=2)
  assert _scale_history(megatron, flags) == [1024, 512, 256, 128, 64, 32]
  assert _scale_history(_tf1_manager(1024.0), flags) == [1024, 512, 512, 256, 256, 128]


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.float32(1.0)])
def test_reset_hysteresis_on_backoff_must_be_a_bool(value):
  with pytest.raises(ValueError, match=r"reset_hysteresis_on_backoff=\.\.\.\)"):
    ls.dynamic_loss_scale(optax.sgd(0.1), reset_hysteresis_on_backoff=value)


# ---------------------------------------------------------------------------
# Scales must be normal float32 numbers: 1 / scale is then finite.


@pytest.mark.parametrize("scale", [1e-39, 2.0**-127, 1e-45])
def test_subnormal_scales_are_rejected(scale):
  with pytest.raises(ValueError, match=r"static_loss_scale\(loss_scale=.*normal"):
    ls.static_loss_scale(optax.sgd(0.1), scale)
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(min_scale="):
    ls.dynamic_loss_scale(optax.sgd(0.1), min_scale=scale, initial_scale=1.0)
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(initial_scale="):
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=scale)


def test_smallest_normal_scale_is_accepted_and_never_left():
  tiny = 2.0**-126
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=tiny * 4, min_scale=tiny, growth_interval=10
  )
  assert _scale_history(tx, [False] * 4) == [tiny * 2, tiny, tiny, tiny]
  static = ls.static_loss_scale(optax.sgd(1.0), tiny)
  updates, state = static.update(_grads_with(tiny), static.init(_grads_with(0.0)))
  assert bool(state.last_finite)
  np.testing.assert_array_equal(updates["w"], [-1.0, -1.0])


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
def test_disabled_is_bitwise_the_bare_optimizer(make):
  inner = optax.adamw(1e-2)
  tx, enabled = make(inner), ls.dynamic_loss_scale(inner)
  params, (g0, g1, *_) = _problem()
  grad_seq = [g0, jax.tree.map(lambda g: jnp.full_like(g, INF), g1), g0]
  with _standard():
    state, bare = tx.init(params), inner.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(enabled.init(params))
    update, bare_update = jax.jit(tx.update), jax.jit(inner.update)
    for g in grad_seq:  # the inf is not skipped: enabled=False checks nothing
      u, state = update(g, state, params)
      bu, bare = bare_update(g, bare, params)
      _assert_trees_equal(u, bu)
      _assert_trees_equal(state.inner_state, bare)
  assert float(ls.get_loss_scale(state)) == 1.0
  assert int(state.skipped_steps) == 0 and bool(state.last_finite)
  # The loss is scaled by 1: the gradients are the plain ones.
  _, g = ls.value_and_grad(lambda w: jnp.sum(w**2))(state, jnp.arange(3.0))
  np.testing.assert_array_equal(g, 2 * jnp.arange(3.0))


@pytest.mark.parametrize("value", [0, 1, "no", None])
def test_enabled_must_be_a_bool(value):
  with pytest.raises(ValueError, match=r"dynamic_loss_scale\(enabled=\.\.\.\)"):
    ls.dynamic_loss_scale(optax.sgd(0.1), enabled=value)
  with pytest.raises(ValueError, match=r"static_loss_scale\(enabled=\.\.\.\)"):
    ls.static_loss_scale(optax.sgd(0.1), 2.0, enabled=value)


# ---------------------------------------------------------------------------
# Valid uses that must not be refused, and mistakes that get clear errors.


# optax.contrib.dpsgd passes `seed` on, which newer optax deprecates.
@pytest.mark.filterwarnings("ignore:.*seed.*:DeprecationWarning")
def test_per_example_gradients_with_dpsgd():
  clip, batch = 1.0, 5
  inner = optax.contrib.dpsgd(0.1, l2_norm_clip=clip, noise_multiplier=0.0, seed=0)
  tx = ls.static_loss_scale(inner, 8.0)
  params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
  k1, k2 = jax.random.split(jax.random.key(3))
  per_example = {
    "w": jax.random.normal(k1, (batch, 3)),
    "b": jax.random.normal(k2, (batch,)),
  }
  scaled = jax.tree.map(lambda g: g * 8.0, per_example)
  with _standard():
    updates, state = jax.jit(tx.update)(scaled, tx.init(params), params)
    expected, _ = inner.update(per_example, inner.init(params), params)
  _assert_trees_close(updates, expected)
  assert bool(state.last_finite)
  bad = jax.tree.map(lambda g: g.at[2].set(NAN), scaled)
  with _standard():
    zeros, state = jax.jit(tx.update)(bad, state, params)
  assert int(state.skipped_steps) == 1
  assert not any(np.asarray(z).any() for z in jax.tree.leaves(zeros))


def test_a_plain_optimizer_state_names_loss_scale_state():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  params = {"w": jnp.zeros(2)}
  plain = optax.sgd(0.1).init(params)
  for update in (tx.update, jax.jit(tx.update)):
    with pytest.raises(TypeError, match=r"LossScaleState.*tx\.init\(params\)"):
      update(_grads_with(1.0), plain, params)


def test_multisteps_object_as_inner_says_what_to_pass():
  with pytest.raises(TypeError, match=r"gradient_transformation\(\)"):
    ls.dynamic_loss_scale(optax.MultiSteps(optax.sgd(0.1), 2))
  with pytest.raises(TypeError, match=r"static_loss_scale\(inner="):
    ls.static_loss_scale(object(), 2.0)


def test_unhashable_axis_name_is_named():
  class Unhashable:
    __hash__ = None

  with pytest.raises(ValueError, match=r"skip_nonfinite\(axis_name=\.\.\.\)"):
    ls.skip_nonfinite(optax.sgd(0.1), axis_name=Unhashable())
  with pytest.raises(ValueError, match=r"axis_name"):
    ls.dynamic_loss_scale(optax.sgd(0.1), axis_name=("batch", Unhashable()))


def test_jax_integer_scalars_are_accepted_for_integer_settings():
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), growth_interval=jnp.int32(2), hysteresis=np.int16(1)
  )
  assert _scale_history(tx, [True, True]) == [2.0**15, 2.0**16]
  with pytest.raises(ValueError, match=r"growth_interval=\.\.\.\)` must be a positive"):
    ls.dynamic_loss_scale(optax.sgd(0.1), growth_interval=jnp.float32(2.0))
