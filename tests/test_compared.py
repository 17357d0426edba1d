"""The claims of docs/compared.md about peer libraries, run against the peers.

Each test runs the installed peer and asserts what it actually does (a peer
that is not installed is skipped). torch and keras are not JAX libraries and
are not installed: the page cites their source lines instead.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import standard_promotion

INF = float("inf")
N = 3  # growth interval used throughout


@pytest.fixture(autouse=True)
def _standard_promotion():
  # The peers (jmp, flax, optax) are not written for strict promotion.
  with standard_promotion():
    yield


def _lossscale_scales(finite_flags, **kwargs):
  """The scale after each step of `dynamic_loss_scale` (jitted)."""
  tx = ls.dynamic_loss_scale(optax.sgd(1.0), **kwargs)
  params = jnp.zeros(2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales = []
  for ok in finite_flags:
    g = jnp.ones(2) if ok else jnp.array([INF, 1.0])
    _, state = update(g * ls.get_loss_scale(state), state, params)
    scales.append(float(ls.get_loss_scale(state)))
  return scales


# ---------------------------------------------------------------------------
# Growth timing


def test_lossscale_and_jmp_grow_on_the_nth_good_step_flax_one_step_late():
  jmp = pytest.importorskip("jmp")
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  steps = 2 * N + 2
  ours = _lossscale_scales([True] * steps, initial_scale=4.0, growth_interval=N)

  jmp_scale = jmp.DynamicLossScale(jnp.float32(4.0), period=N)
  jmp_scales = []
  for _ in range(steps):
    jmp_scale = jmp_scale.adjust(jnp.array(True))
    jmp_scales.append(float(jmp_scale.loss_scale))

  flax_scale = dynamic_scale.DynamicScale(growth_interval=N, scale=4.0)
  flax_scales = []
  for _ in range(steps):
    flax_scale, finite, _, _ = flax_scale.value_and_grad(lambda w: jnp.sum(w**2))(
      jnp.ones(2)
    )
    assert bool(finite)
    flax_scales.append(float(flax_scale.scale))

  first_growth = lambda scales: next(i for i, s in enumerate(scales) if s > 4.0) + 1
  assert first_growth(ours) == N  # the N-th good step, as torch and Keras
  assert first_growth(jmp_scales) == N
  assert first_growth(flax_scales) == N + 1  # one step late
  assert jmp_scales == ours
  # Flax's whole trajectory lags: it grows every N + 1 good steps.
  assert [i + 1 for i in range(1, steps) if flax_scales[i] > flax_scales[i - 1]] == [
    N + 1,
    2 * N + 2,
  ]


# ---------------------------------------------------------------------------
# Bounds


def test_jmp_loses_its_minimum_scale_under_jit():
  jmp = pytest.importorskip("jmp")
  start = jmp.DynamicLossScale(
    jnp.float32(16.0), period=N, min_loss_scale=jnp.float32(8.0)
  )
  eager, jitted = start, start
  adjust = jax.jit(lambda s: s.adjust(jnp.array(False)))
  for _ in range(4):
    eager = eager.adjust(jnp.array(False))
    jitted = adjust(jitted)
  assert float(eager.loss_scale) == 8.0  # the floor holds outside jit
  # Under jit the pytree round trip drops min_loss_scale (it is neither a
  # child nor aux data), so the default floor of 1.0 applies instead.
  assert float(jitted.loss_scale) < 8.0
  assert float(jitted.loss_scale) == 1.0
  assert float(jitted.min_loss_scale) == 1.0


def test_flax_and_lossscale_keep_their_minimum_scale_under_jit():
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  flax_scale = dynamic_scale.DynamicScale(scale=16.0, minimum_scale=8.0)

  @jax.jit
  def bad_step(s):
    return s.value_and_grad(lambda w: jnp.sum(w * INF))(jnp.ones(2))[0]

  for _ in range(4):
    flax_scale = bad_step(flax_scale)
  assert float(flax_scale.scale) == 8.0
  ours = _lossscale_scales([False] * 4, initial_scale=16.0, min_scale=8.0)
  assert ours == [8.0, 8.0, 8.0, 8.0]


# ---------------------------------------------------------------------------
# What happens on overflow


def test_apply_if_finite_applies_the_nan_after_max_consecutive_errors():
  tx = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=2)
  params = jnp.zeros(2)
  state = tx.init(params)
  bad = jnp.array([jnp.nan, 1.0])
  finite_updates = []
  for _ in range(3):
    updates, state = tx.update(bad, state, params)
    finite_updates.append(bool(jnp.all(jnp.isfinite(updates))))
  # Two skipped steps (zeros), then the third NaN reaches the update.
  assert finite_updates == [True, True, False]
  assert "axis_name" not in inspect.signature(optax.apply_if_finite).parameters


def test_multisteps_skip_not_finite_skips_every_bad_step_and_does_not_scale():
  inner = optax.adam(1.0)
  tx = optax.MultiSteps(
    inner, every_k_schedule=1, should_skip_update_fn=optax.skip_not_finite
  )
  params = jnp.zeros(2)
  state = tx.init(params)
  bad = jnp.array([jnp.nan, 1.0])
  inner_before = state.inner_opt_state
  for _ in range(5):
    updates, state = tx.update(bad, state, params)
    np.testing.assert_array_equal(updates, np.zeros(2))
  for a, b in zip(
    jax.tree.leaves(state.inner_opt_state),
    jax.tree.leaves(inner_before),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  assert int(state.gradient_step) == 0
  # A finite step still goes through; nothing in the state is a loss scale.
  updates, state = tx.update(jnp.ones(2), state, params)
  assert bool(jnp.all(updates != 0))
  paths = jax.tree_util.tree_flatten_with_path(state)[0]
  assert not [p for p, _ in paths if "loss_scale" in jax.tree_util.keystr(p)]
  assert "axis_name" not in inspect.signature(optax.MultiSteps).parameters


def test_flax_dynamic_scale_leaves_the_skip_to_the_caller():
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  flax_scale = dynamic_scale.DynamicScale(scale=4.0)
  new_scale, finite, _, grads = flax_scale.value_and_grad(lambda w: jnp.sum(w * INF))(
    jnp.ones(2)
  )
  assert not bool(finite)
  assert float(new_scale.scale) == 2.0  # backed off
  assert not bool(jnp.all(jnp.isfinite(grads)))  # the caller must not apply these
  assert not isinstance(flax_scale, optax.GradientTransformation)


def test_jmp_adjusts_the_scale_only_and_gives_a_select_for_the_skip():
  jmp = pytest.importorskip("jmp")
  scale = jmp.DynamicLossScale(jnp.float32(4.0))
  grads = scale.unscale({"w": jnp.array([INF, 1.0])})
  finite = jmp.all_finite(grads)
  assert not bool(finite)
  assert float(scale.adjust(finite).loss_scale) == 2.0
  old, new = {"w": jnp.zeros(2)}, {"w": jnp.full(2, jnp.nan)}
  np.testing.assert_array_equal(jmp.select_tree(finite, new, old)["w"], np.zeros(2))
  assert not isinstance(scale, optax.GradientTransformation)


def test_lossscale_never_applies_a_nan_update():
  tx = ls.dynamic_loss_scale(optax.sgd(1.0))
  params = jnp.zeros(2)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for _ in range(40):  # past the 1.0 floor: still skipped
    updates, state = update(jnp.array([jnp.nan, 1.0]), state, params)
    np.testing.assert_array_equal(updates, np.zeros(2))
  assert int(state.skipped_steps) == 40
  assert float(ls.get_loss_scale(state)) == 1.0


# ---------------------------------------------------------------------------
# Cross-replica agreement


def test_flax_axis_name_averages_before_the_check_so_replicas_agree():
  dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
  n = jax.device_count()
  x = jnp.ones((n, 2)).at[n - 1, 0].set(INF)  # an inf on the last replica only

  def step(x):
    fn = dynamic_scale.DynamicScale(scale=4.0).value_and_grad(
      lambda w: jnp.sum(w * x), axis_name="batch"
    )
    new_scale, finite, _, _ = fn(jnp.ones(2))
    return finite, new_scale.scale

  finite, scale = jax.pmap(step, axis_name="batch")(x)
  assert not np.asarray(finite).any()
  np.testing.assert_array_equal(scale, np.full(n, 2.0))


def test_apply_if_finite_replicas_disagree_without_averaging():
  n = jax.device_count()
  tx = optax.apply_if_finite(optax.sgd(1.0), max_consecutive_errors=5)
  grads = jnp.ones((n, 2)).at[n - 1, 0].set(INF)

  def step(g):
    params = jnp.zeros(2)
    return tx.update(g, tx.init(params), params)[1].notfinite_count

  counts = np.asarray(jax.pmap(step, axis_name="batch")(grads))
  assert counts.tolist() == [0] * (n - 1) + [1]  # only the last one skipped
  # lossscale's axis_name makes all of them skip.
  ours = ls.dynamic_loss_scale(optax.sgd(1.0), axis_name="batch")

  def our_step(g):
    params = jnp.zeros(2)
    return ours.update(g, ours.init(params), params)[1].skipped_steps

  skipped = np.asarray(jax.pmap(our_step, axis_name="batch")(grads))
  assert skipped.tolist() == [1] * n


# ---------------------------------------------------------------------------
# Composability


def test_lossscale_chains_with_optax_transforms():
  tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    ls.dynamic_loss_scale(optax.adamw(1e-2)),
  )
  assert isinstance(tx, optax.GradientTransformation)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.full(3, 2.0**15)}, state, params)
  assert bool(jnp.all(jnp.isfinite(updates["w"])))
  assert float(ls.get_loss_scale(state)) == 2.0**15
