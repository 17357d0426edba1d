"""Half-precision parameters: every optimizer keeps its dtypes, with no retrace.

With bfloat16 or float16 parameters the wrapper unscales in float32, runs the
inner optimizer there, and hands its state back in the dtypes it started
with, on finite and skipped steps alike, through `tx.update` and
`apply_gradients`: the dtypes `inner.init(params)` chose for bfloat16, and
float32 for float16 parameters (float16 moments underflow).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import lossscale as ls
from _helpers import assert_trees_equal, bytes_accessed, standard_promotion
from lossscale import _jax_internals

SCALE = 2.0**10  # a power of two: scaling and unscaling are exact


def _optimizers():
  labels = {"w": "a", "b": "b"}
  opts = {
    "adabelief": optax.adabelief(1e-2),
    "adadelta": optax.adadelta(1e-1),
    "adafactor": optax.adafactor(1e-2),
    "adagrad": optax.adagrad(1e-2),
    "adam": optax.adam(1e-2),
    "adamax": optax.adamax(1e-2),
    "adamaxw": optax.adamaxw(1e-2),
    "adamw": optax.adamw(1e-2),
    "adan": optax.adan(1e-2),
    "amsgrad": optax.amsgrad(1e-2),
    "fromage": optax.fromage(1e-2),
    "lamb": optax.lamb(1e-2),
    "lars": optax.lars(1e-2),
    "lion": optax.lion(1e-3),
    "nadam": optax.nadam(1e-2),
    "nadamw": optax.nadamw(1e-2),
    "novograd": optax.novograd(1e-2),
    "optimistic_gd": optax.optimistic_gradient_descent(1e-2),
    "radam": optax.radam(1e-2),
    "rmsprop": optax.rmsprop(1e-2, momentum=0.9),
    "rprop": optax.rprop(1e-2),
    "sgd_momentum": optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "sm3": optax.sm3(1e-2),
    "yogi": optax.yogi(1e-2),
    "chain_clip_adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "masked": optax.masked(optax.adam(1e-2), {"w": True, "b": False}),
    "multi_transform": optax.multi_transform(
      {"a": optax.adam(1e-2), "b": optax.sgd(1e-2, momentum=0.9)}, labels
    ),
    "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "contrib.dadapt_adamw": optax.contrib.dadapt_adamw(),
    "contrib.prodigy": optax.contrib.prodigy(),
    "contrib.mechanize": optax.contrib.mechanize(optax.adam(1e-2)),
    "contrib.schedule_free_adamw": optax.contrib.schedule_free_adamw(1e-2),
    "contrib.cocob": optax.contrib.cocob(),
  }
  if hasattr(optax.contrib, "muon"):
    opts["contrib.muon"] = optax.contrib.muon(1e-2)
  return opts


OPTIMIZERS = _optimizers()
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _params(dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w": jax.random.normal(k1, (3, 4)).astype(dtype),
    "b": jax.random.normal(k2, (4,)).astype(dtype),
  }


def _true_grads(dtype):
  k1, k2 = jax.random.split(jax.random.key(1))
  return {
    "w": jax.random.normal(k1, (3, 4)).astype(dtype),
    "b": jax.random.normal(k2, (4,)).astype(dtype),
  }


def _scaled(grads):
  return jax.tree.map(lambda g: (g.astype(jnp.float32) * SCALE).astype(g.dtype), grads)


def _dtypes(tree):
  return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


def _assert_close(actual, expected, dtype, ulps=1):
  """Within `ulps` units of `dtype`'s precision of the update's magnitude."""
  eps = ulps * float(jnp.finfo(dtype).eps)
  for x, y in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    np.testing.assert_allclose(x, y, rtol=eps, atol=eps * np.abs(y).max())


def _as(tree, like):
  """`tree` with the dtypes of `like`'s leaves (or one dtype for all)."""

  def cast(x, dtype):
    x = jnp.asarray(x)
    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  if not isinstance(like, type):
    return jax.tree.map(lambda x, y: cast(x, y.dtype), tree, like)
  return jax.tree.map(lambda x: cast(x, like), tree)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_keeps_dtypes_and_matches_bare_optimizer(name, dtype):
  inner = OPTIMIZERS[name]
  tx = ls.dynamic_loss_scale(inner, initial_scale=SCALE)
  params, grads = _params(dtype), _true_grads(dtype)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.inf), _scaled(grads))
  traces = []

  def update(g, s, p):
    traces.append(None)
    return tx.update(g, s, p)

  update = jax.jit(update)
  with standard_promotion():
    state = tx.init(params)
    init_dtypes = _dtypes(state.inner_state)
    updates, finite_state = update(_scaled(grads), state, params)
    skip_updates, skipped_state = update(bad, finite_state, params)
    # The reference: the bare optimizer fed the true gradients, in float32,
    # from float32 copies of the same parameters and the same initial state
    # (float16 parameters get a float32 state, initialised in float32).
    params32, grads32 = _as(params, jnp.float32), _as(grads, jnp.float32)
    state32 = _as(inner.init(params), jnp.float32)
    if dtype == jnp.float16:
      state32 = inner.init(params32)
      assert _dtypes(state.inner_state) == _dtypes(state32)
    bare_updates, bare_state = jax.jit(inner.update)(grads32, state32, params32)

  assert len(traces) == 1, "the second step retraced: the state's types drifted"
  assert bool(finite_state.last_finite) and not bool(skipped_state.last_finite)
  assert _dtypes(finite_state.inner_state) == init_dtypes
  assert _dtypes(skipped_state.inner_state) == init_dtypes
  # Same types on both paths: `lax.cond` accepts them as its two branches.
  jax.lax.cond(True, lambda: state, lambda: finite_state)
  # A skipped step: the inner state bit for bit, exact zeros of the same dtypes.
  assert_trees_equal(skipped_state.inner_state, finite_state.inner_state)
  assert _dtypes(skip_updates) == _dtypes(updates)
  for z in jax.tree.leaves(skip_updates):
    assert not np.asarray(z, np.float64).any()
  # A finite step: the bare optimizer fed the true gradients, its updates in
  # the parameters' dtype (as bare `inner` gives them for these parameters)
  # and its state stored in the dtypes `inner.init(params)` chose.
  # (float32 on both sides, then rounded; XLA may fuse the two programs
  # differently.)
  assert _dtypes(updates) == _dtypes(params)
  if dtype == jnp.float32:
    _assert_close(updates, bare_updates, jnp.float32, ulps=64)
  else:
    _assert_close(updates, _as(bare_updates, params), dtype)
  _assert_close(finite_state.inner_state, _as(bare_state, state.inner_state), dtype)
  # So any way of adding them keeps the parameters' dtypes: optax's (which
  # casts back), Equinox's and a plain `p + u` (which do not).
  for apply in (optax.apply_updates, eqx.apply_updates, _plain_add):
    assert _dtypes(apply(params, updates)) == _dtypes(params), apply
    assert _dtypes(apply(params, skip_updates)) == _dtypes(params), apply


def _plain_add(params, updates):
  return jax.tree.map(jnp.add, params, updates)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apply_gradients_keeps_dtypes(name, dtype):
  tx = ls.dynamic_loss_scale(OPTIMIZERS[name], initial_scale=SCALE)
  params, grads = _params(dtype), _scaled(_true_grads(dtype))
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
  traces = []

  def fused(g, s, p):
    traces.append(None)
    return ls.apply_gradients(tx, g, s, p)

  def composed(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  fused = jax.jit(fused)
  with standard_promotion():
    state = tx.init(params)
    new_params, new_state = fused(grads, state, params)
    kept_params, kept_state = fused(bad, new_state, new_params)
    ref_params, ref_state = jax.jit(composed)(grads, state, params)

  assert len(traces) == 1
  assert _dtypes(new_params) == _dtypes(params)
  assert _dtypes(new_state) == _dtypes(state)
  _assert_close(new_params, ref_params, dtype)
  _assert_close(new_state.inner_state, ref_state.inner_state, dtype)
  assert_trees_equal(kept_params, new_params)
  assert_trees_equal(kept_state.inner_state, new_state.inner_state)
  assert int(kept_state.skipped_steps) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_flax_train_state_with_half_precision_params(dtype):
  flax_ls = pytest.importorskip("lossscale.flax")
  nn = pytest.importorskip("flax.linen")
  model = nn.Dense(2, param_dtype=dtype, dtype=dtype)
  params = model.init(jax.random.key(0), jnp.ones((1, 3), dtype))["params"]
  state = flax_ls.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE),
  )
  grads = _scaled(jax.tree.map(jnp.ones_like, params))
  bad = jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), grads)
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  with standard_promotion():
    new = step(state, grads)
    kept = step(new, bad)
  assert int(new.step) == 1 and int(kept.step) == 1
  assert _dtypes(new.params) == _dtypes(params)
  assert _dtypes(new.opt_state) == _dtypes(state.opt_state)
  assert_trees_equal(kept.params, new.params)
  assert float(kept.loss_scale) == SCALE / 2


def test_apply_gradients_with_a_stateful_transform_after_the_wrapper():
  # optax.trace turns its bfloat16 state float32 when fed float32 updates; the
  # fused step keeps every state's dtype, so its two branches agree.
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = optax.chain(
    ls.dynamic_loss_scale(optax.scale_by_adam()), optax.trace(0.9), optax.scale(-0.1)
  )
  step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
  with standard_promotion():
    state = tx.init(params)
    new_params, new_state = step({"w": jnp.full(3, 2.0, jnp.bfloat16)}, state, params)
    kept_params, kept_state = step(
      {"w": jnp.full(3, jnp.inf, jnp.bfloat16)}, new_state, new_params
    )
  assert _dtypes(new_state) == _dtypes(state)
  assert bool(new_state[0].last_finite) and not bool(kept_state[0].last_finite)
  assert_trees_equal(kept_params, new_params)
  assert_trees_equal(kept_state[1:], new_state[1:])


SMALL_STEPS = 200


_WRAPPERS = {
  "dynamic": lambda inner: ls.dynamic_loss_scale(
    inner, initial_scale=SCALE, growth_interval=10**6
  ),
  "skip_nonfinite": ls.skip_nonfinite,
}
_SMALL_CASES = [("dynamic", name) for name in OPTIMIZERS] + [
  ("skip_nonfinite", name) for name in ("adam", "adamw", "adafactor", "lion")
]


def test_float16_adam_second_moment_is_zero_below_the_documented_threshold():
  # docs/how-it-works.md: with b2 = 0.999, optax computes the first
  # `nu = (1 - b2) * g**2` in float16, and it is 0 for |g| < 5.458e-3
  # (`0.0010004 * g**2` at or below 2**-25 rounds to 0); up to 9.46e-3 it is
  # the smallest subnormal, 2**-24.
  bits = np.arange(1, 0x7C00, dtype=np.uint16)  # every positive finite float16
  g = bits.view(np.float16)
  g = g[(g >= np.float16(1e-3)) & (g <= np.float16(2e-2))]
  g64 = g.astype(np.float64)  # compared with the bounds exactly
  adam = optax.scale_by_adam()  # b2 = 0.999
  params = jnp.zeros(g.shape, jnp.float16)
  with standard_promotion():
    _, state = jax.jit(adam.update)(jnp.asarray(g), adam.init(params), params)
  nu = np.asarray(state.nu)
  assert nu.dtype == np.float16
  # The reference: NumPy's float16 arithmetic, one rounding per operation.
  want = np.float16(1 - 0.999) * (g * g) + np.float16(0.999) * np.float16(0)
  np.testing.assert_array_equal(nu, want)
  assert g64[nu == 0].max() < 5.458e-3 < g64[nu > 0].min()
  one_step = (g64 > 5.458e-3) & (g64 < 9.46e-3)
  assert (nu[one_step] == np.float16(2.0**-24)).all()
  assert (nu[g64 >= 9.46e-3] > np.float16(2.0**-24)).all()
  # The real-number bound the docs derive it from.
  assert abs(np.sqrt(2.0**-25 / float(np.float16(0.001))) - 5.458e-3) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("wrapper, name", _SMALL_CASES)
def test_float16_params_with_small_gradients_follow_the_float32_run(wrapper, name):
  # Adam's second moment of a gradient below 5.458e-3 is 0 in float16 (the
  # test above): a float16 optimizer state took steps up to 13x too large.
  # The wrapper keeps float32 state for float16 parameters, so a few hundred
  # steps of small gradients update like the bare optimizer run in float32
  # on the same parameters (kept fixed, so both runs see the same ones).
  inner = OPTIMIZERS[name]
  tx = _WRAPPERS[wrapper](inner)
  scale = SCALE if wrapper == "dynamic" else 1.0
  params16 = _params(jnp.float16)
  params32 = _as(params16, jnp.float32)
  keys = jax.random.split(jax.random.key(2), SMALL_STEPS)
  true16 = jax.vmap(
    lambda k: jax.tree.map(
      lambda p: (1e-3 * jax.random.normal(k, p.shape)).astype(jnp.float16), params16
    )
  )(keys)

  @jax.jit
  def wrapped_run(state):
    def step(state, g):
      g = jax.tree.map(lambda x: (x.astype(jnp.float32) * scale).astype(x.dtype), g)
      updates, state = tx.update(g, state, params16)
      return state, updates

    return jax.lax.scan(step, state, true16)[1]

  @jax.jit
  def bare_run(state):
    def step(state, g):
      updates, state = inner.update(_as(g, jnp.float32), state, params32)
      return state, updates

    return jax.lax.scan(step, state, true16)[1]

  with standard_promotion():
    got = wrapped_run(tx.init(params16))
    want = bare_run(inner.init(params32))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert x.dtype == jnp.float16  # the parameters' dtype, as bare `inner` gives
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    # Over the whole run, each update within 1e-3 of the largest one, or
    # within its own rounding to float16: 2**-11 of it, or half the smallest
    # subnormal (2**-25) for the tiny updates of dadapt, prodigy, mechanize.
    atol = max(1e-3 * np.abs(y).max(), 2.0**-25)
    np.testing.assert_allclose(x, y, rtol=1e-3, atol=atol)


# What the compiled step moves and holds (XLA's cost and memory analyses; no
# timing). The bare reference for float16 parameters is the bare optimizer
# with float32 state, the state the wrapper gives them.


def _compiled_costs(dtype):
  params = {f"l{i}": jnp.zeros((128, 1024), dtype) for i in range(8)}  # 1M
  adam = optax.adamw(1e-3)
  tx = ls.dynamic_loss_scale(adam, initial_scale=SCALE)

  def bare(p, s, g):
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), s

  def composed(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def fused(p, s, g):
    return ls.apply_gradients(tx, g, s, p)

  bare_params = _as(params, jnp.float32) if dtype == jnp.float16 else params
  costs = {}
  with standard_promotion():
    for name, f, state in [
      ("bare", bare, adam.init(bare_params)),
      ("composed", composed, tx.init(params)),
      ("fused", fused, tx.init(params)),
    ]:
      c = jax.jit(f, donate_argnums=(0, 1)).lower(params, state, params).compile()
      costs[name] = (bytes_accessed(c), c.memory_analysis().temp_size_in_bytes)
  return costs, sum(x.nbytes for x in jax.tree.leaves(params))


@pytest.mark.speed_layer
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_half_precision_steps_move_and_hold_little_more_than_the_bare_step(dtype):
  costs, p_bytes = _compiled_costs(dtype)
  (bare, bare_temp), (composed, composed_temp), (fused, fused_temp) = (
    costs["bare"],
    costs["composed"],
    costs["fused"],
  )
  f32_grads = 2 * p_bytes  # the gradients (or updates) in float32
  # XLA's cost model charges both branches of the finite check's conditional
  # (the gradients as they are, and times the unscale factor when it is
  # above 1), one runs: at most 1.5x the bare step's bytes for the fused
  # step, 2x for `tx.update` + `apply_updates`.
  assert fused <= 1.5 * bare
  assert composed <= 2 * bare
  if dtype == jnp.float16:
    # XLA:CPU computes float16 arithmetic in float32, and its reductions take
    # that operand written out: the check holds the gradients in float32
    # (measured faster in wall time than the formulations that do not,
    # docs/performance.md), and nothing else is parameter-sized.
    # (And the unscale factor broadcast to each leaf shape, as below.)
    assert fused_temp <= f32_grads + p_bytes / 4 + 4096
    assert composed_temp <= f32_grads + p_bytes / 4 + 4096
    return
  # bfloat16: no parameter-sized temporary in the fused step (its moments
  # written in place after the new parameters; XLA before jaxlib 0.9.1
  # copies the moments of the bare step too, and the same for ours), only
  # the unscale factor broadcast to each leaf shape, in float32, by the
  # check's branch that multiplies it in.
  from lossscale._speed import ordering as _ordering

  if _ordering.ORDER_FUSED_WRITES:
    assert fused_temp <= p_bytes / 4 + 4096
  else:
    assert fused_temp <= bare_temp + 2 * p_bytes
  # `tx.update` + `apply_updates`: the updates array it hands out, in the
  # parameters' dtype, and nothing else parameter-sized.
  assert composed_temp < p_bytes + p_bytes / 8


@pytest.mark.speed_layer
def test_read_after_keeps_every_value_bit_for_bit():
  from lossscale._speed import ordering as _ordering

  bad = jnp.array([-0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 1e-40, 3e38, -1.5])
  state = (
    {"a": bad.astype(jnp.bfloat16), "b": bad},  # params-shaped: mu, say
    jnp.zeros(8, jnp.bfloat16),  # not in a params-shaped subtree
    jnp.array(3, jnp.int32),
  )
  new_params = {"a": jnp.full(8, jnp.nan, jnp.bfloat16), "b": jnp.ones(8)}
  ordered, any_ordered = jax.jit(_ordering.read_after)(state, new_params)
  assert any_ordered
  assert_trees_equal(ordered, state)
  # Only the bfloat16 leaf in the params-shaped subtree depends on them.
  jaxpr = _jax_internals.open_jaxpr(
    jax.make_jaxpr(lambda s, p: _ordering.read_after(s, p)[0])(state, new_params)
  )
  outs = jaxpr.outvars
  assert outs[0] not in jaxpr.invars  # ordered
  assert [o in jaxpr.invars for o in outs[1:]] == [True] * 3


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
def test_inner_effects_run_once_per_step_with_bfloat16_params(fused):
  # The bfloat16 state may be written by a second call of the inner
  # optimizer (`read_after`), but not when it has effects: they would run
  # twice.
  calls = []
  adam = optax.adam(1e-3)

  def update(updates, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return adam.update(updates, state, params)

  tx = ls.dynamic_loss_scale(
    optax.GradientTransformation(adam.init, update), initial_scale=SCALE
  )
  params = {"w": jnp.ones((8, 8), jnp.bfloat16)}

  def step(g, s, p):
    if fused:
      return ls.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  with standard_promotion():
    p, s = jax.jit(step)(params, tx.init(params), params)
    jax.block_until_ready(p)
  assert len(calls) == 1
  assert jax.tree.map(lambda x: x.dtype, s.inner_state[0].mu) == {"w": jnp.bfloat16}


def test_apply_gradients_with_an_already_jitted_update_and_bfloat16_params():
  # The wrapper's decision comes back through `jax.jit`, its flags as arrays.
  inner = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=SCALE)
  tx = optax.GradientTransformation(inner.init, jax.jit(inner.update))
  params = {"w": jnp.full((4, 4), 0.5, jnp.bfloat16)}
  grads = {"w": jnp.full((4, 4), SCALE * 1e-2, jnp.bfloat16)}
  with standard_promotion():
    state = tx.init(params)
    got = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(grads, state, params)
    want = ls.apply_gradients(inner, grads, state, params)
  assert_trees_equal(got, want)
