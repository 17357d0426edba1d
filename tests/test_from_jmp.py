"""Coming from jmp and Haiku (docs/from-jmp.md): jmp's `DynamicLossScale`
against the wrapper, step by step, and Haiku state kept on a skipped step."""

import functools
import itertools

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import assert_trees_close, assert_trees_equal, stack, standard_promotion

F32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------
# The scale rule, walked


def _jmp_walk(flags, loss_scale, *, jit):
  """jmp's scale after each step; `jit` makes each `adjust` a jitted call,
  as in a jitted train step that takes and returns the scale."""
  adjust = lambda s, f: s.adjust(f)
  adjust = jax.jit(adjust) if jit else adjust
  scales = []
  for finite in flags:
    loss_scale = adjust(loss_scale, jnp.asarray(finite))
    scales.append(float(loss_scale.loss_scale))
  return scales


def _our_walk(flags, **settings):
  """The wrapper's scale and `step_applied` after each jitted `tx.update`."""
  tx = ls.dynamic_loss_scale(optax.sgd(1.0), **settings)
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  scales, applied = [], []
  for finite in flags:
    grads = {"w": jnp.full(2, 1.0 if finite else jnp.inf)}
    _, state = update(grads, state, params)
    scales.append(float(ls.get_loss_scale(state)))
    applied.append(bool(ls.step_applied(state)))
  assert applied == list(flags)
  return scales


# Growth on the 3rd good step, an overflow resetting the count, then a run
# of overflows down to the floor and growth again.
FLAGS = [True] * 7 + [False] + [True] * 4 + [False] * 12 + [True] * 6


def test_growth_interval_period_reproduces_jmp_under_jit():
  start = jmp.DynamicLossScale(
    jnp.float32(2.0**8), period=3, factor=2, min_loss_scale=jnp.float32(8.0)
  )
  settings = dict(initial_scale=2.0**8, growth_interval=3, max_scale=F32_MAX)
  jitted = _jmp_walk(FLAGS, start, jit=True)
  eager = _jmp_walk(FLAGS, start, jit=False)
  # Under jit jmp's floor is its default 1.0, whatever min_loss_scale said.
  assert min(jitted) == 1.0 and min(eager) == 8.0
  assert _our_walk(FLAGS, **settings, min_scale=1.0) == jitted
  assert _our_walk(FLAGS, **settings, min_scale=8.0) == eager
  # jmp's defaults (period 2000, factor 2, floor 1) are the wrapper's, but
  # for the ceiling: jmp has none, the wrapper's default is 2**24.
  default = jmp.DynamicLossScale(jnp.float32(2.0**15))
  assert (default.period, default.factor, float(default.min_loss_scale)) == (
    2000,
    2,
    1.0,
  )


def test_growth_stops_short_of_float32_overflow_as_jmps():
  flags = [True] * 4
  start = jmp.DynamicLossScale(jnp.float32(2.0**125), period=1)
  theirs = _jmp_walk(flags, start, jit=True)
  assert theirs == [2.0**126, 2.0**127, 2.0**127, 2.0**127]
  ours = _our_walk(flags, initial_scale=2.0**125, growth_interval=1, max_scale=F32_MAX)
  assert ours == theirs


# ---------------------------------------------------------------------------
# Haiku's ImageNet step (examples/imagenet/train.py), on a small stand-in.

N_CLASSES = 3
MP_POLICY = jmp.get_policy("p=f32,c=f16,o=f32")
BN_POLICY = jmp.get_policy("p=f32,c=f32,o=f32").with_output_dtype(jnp.float16)


class Net(hk.Module):
  """A stand-in for `hk.nets.ResNet50`: float16 compute, float32 BatchNorm."""

  def __call__(self, x, is_training):
    x = hk.Linear(16, with_bias=False)(x)
    x = hk.BatchNorm(True, True, decay_rate=0.9, name="batchnorm")(x, is_training)
    return hk.Linear(N_CLASSES)(jax.nn.relu(x))


forward = hk.transform_with_state(
  lambda batch, is_training: Net()(batch["x"], is_training)
)


@pytest.fixture(autouse=True)
def policies():
  # Haiku's example sets these globally with `set_policy`.
  with (
    hk.mixed_precision.push_policy(Net, MP_POLICY),
    hk.mixed_precision.push_policy(hk.BatchNorm, BN_POLICY),
    standard_promotion(),  # jmp and Haiku are not written for strict promotion
  ):
    yield


def make_optimizer():
  return optax.chain(
    optax.trace(decay=0.9, nesterov=True), optax.scale(0.1), optax.scale(-1)
  )


def _loss(params, state, batch):
  logits, state = forward.apply(params, state, None, batch, is_training=True)
  labels = optax.smooth_labels(jax.nn.one_hot(batch["y"], N_CLASSES), 0.1)
  loss = optax.softmax_cross_entropy(logits=logits, labels=labels).mean()
  l2 = [
    jnp.sum(p**2)
    for m, mod in params.items()
    if "batchnorm" not in m
    for p in mod.values()
  ]
  return loss + 1e-4 * 0.5 * sum(l2), state


def jmp_step(params, state, opt_state, loss_scale, batch, *, axis_name=None, cast=True):
  """Haiku's train_step; `cast=False` leaves out its cast of the gradients
  to float16 (so that both average the same float32 gradients)."""

  def loss_fn(params, state, loss_scale, batch):
    loss, state = _loss(params, state, batch)
    return loss_scale.scale(loss), (loss, state)

  grads, (_, new_state) = jax.grad(loss_fn, has_aux=True)(
    params, state, loss_scale, batch
  )
  if cast:
    grads = MP_POLICY.cast_to_compute(grads)
  grads = loss_scale.unscale(grads)
  if axis_name:
    grads = jax.lax.pmean(grads, axis_name)
  grads = MP_POLICY.cast_to_param(grads)
  updates, new_opt_state = make_optimizer().update(grads, opt_state)
  new_params = optax.apply_updates(params, updates)
  grads_finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(grads_finite)
  new_params, new_state, new_opt_state = jmp.select_tree(
    grads_finite, (new_params, new_state, new_opt_state), (params, state, opt_state)
  )
  return new_params, new_state, new_opt_state, loss_scale, grads_finite


def our_step(tx, params, state, opt_state, batch):
  (_, new_state), grads = ls.value_and_grad(_loss, has_aux=True)(
    opt_state, params, state, batch
  )
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  state = ls.where_applied(opt_state, new_state, state)
  return params, state, opt_state


def _data(steps, replicas=None, seed=0):
  rng = np.random.default_rng(seed)
  lead = (steps,) if replicas is None else (steps, replicas)
  x = rng.standard_normal((*lead, 8, 4)).astype(np.float32) * 3
  y = rng.integers(0, N_CLASSES, (*lead, 8))
  return x, y


def test_jmp_haiku_step_and_the_wrapper_take_the_same_steps():
  # Same init and data; a start at 2**24 overflows float16 in the backward
  # pass until the scale has backed off; two batches hold an inf.
  x, y = _data(14)
  x[[6, 11], 0, 0] = np.inf
  params, state = forward.init(jax.random.PRNGKey(0), {"x": x[0]}, True)
  tx = ls.dynamic_loss_scale(
    make_optimizer(), initial_scale=2.0**24, growth_interval=2, max_scale=F32_MAX
  )
  theirs = (params, state, make_optimizer().init(params))
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**24), period=2)
  ours = (params, state, tx.init(params))
  j_step = jax.jit(functools.partial(jmp_step, cast=False))
  o_step = jax.jit(functools.partial(our_step, tx))
  j_scales, o_scales, j_skips, o_skips = [], [], [], []
  for i in range(len(x)):
    batch = {"x": x[i], "y": y[i]}
    *new, loss_scale, finite = j_step(*theirs, loss_scale, batch)
    theirs = tuple(new)
    ours = o_step(*ours, batch)
    j_scales.append(float(loss_scale.loss_scale))
    o_scales.append(float(ls.get_loss_scale(ours[2])))
    j_skips.append(not bool(finite))
    o_skips.append(not bool(ls.step_applied(ours[2])))
    # Both unscale and compute in float32: the same parameters and state.
    assert_trees_close(ours[:2], theirs[:2], rtol=1e-6, atol=1e-7)
  assert o_scales == j_scales and o_skips == j_skips
  assert j_skips[6] and j_skips[11]
  assert sum(j_skips) > 2  # float16 overflowed too
  assert any(b > a for a, b in itertools.pairwise(j_scales))  # and grew


def test_the_example_averages_in_float16_on_the_first_dynamic_step_only():
  # What docs/from-jmp.md says of Haiku's example: with a Python float
  # scale, the first step unscales (and averages) float16 gradients;
  # jmp's `adjust` returns a float32 array, and float16 * float32 is float32.
  dtypes = []

  def unscaled(loss_scale):
    g = loss_scale.unscale(jnp.ones(2, jnp.float16))
    dtypes.append(g.dtype)
    return loss_scale.adjust(jmp.all_finite(g))

  loss_scale = jax.pmap(lambda _: jmp.DynamicLossScale(2.0**15))(jnp.arange(1))
  step = jax.pmap(unscaled)
  for _ in range(3):
    loss_scale = step(loss_scale)
  assert dtypes == [jnp.float16, jnp.float32]  # traced twice: the scale's type changed
  static = jmp.StaticLossScale(2.0**15)  # a Python float, kept as pytree metadata
  assert jax.jit(static.unscale)(jnp.ones(2, jnp.float16)).dtype == jnp.float16


def _pmap(fn, n):
  return jax.pmap(fn, axis_name="i", devices=jax.devices()[:n])


def test_haiku_batchnorm_state_survives_a_skipped_step_under_pmap():
  n = 2
  x, y = _data(2, replicas=n)
  x[1, 0, 0, 0] = np.inf  # step 1: one replica's batch
  tx = optax.chain(
    ls.cross_shard_mean("i"), ls.dynamic_loss_scale(make_optimizer(), initial_scale=4.0)
  )
  params, state = forward.init(jax.random.PRNGKey(0), {"x": x[0, 0]}, True)
  ours = stack((params, state, tx.init(params)), n)
  step = _pmap(functools.partial(our_step, tx), n)
  ours = step(*ours, {"x": x[0], "y": y[0]})
  assert np.asarray(ls.step_applied(ours[2])).all()
  before = ours

  # The bad batch's forward pass makes replica 0's statistics non-finite.
  _, forward_state = _pmap(lambda p, s, b: _loss(p, s, b), n)(
    before[0], before[1], {"x": x[1], "y": y[1]}
  )
  mean = np.asarray(forward_state["net/batchnorm/~/mean_ema"]["average"])
  assert not np.isfinite(mean[0]).all() and np.isfinite(mean[1]).all()

  ours = step(*before, {"x": x[1], "y": y[1]})
  np.testing.assert_array_equal(np.asarray(ls.step_applied(ours[2])), [False] * n)
  np.testing.assert_array_equal(np.asarray(ls.get_loss_scale(ours[2])), [2.0] * n)
  # Every replica skipped: parameters, BatchNorm state and the inner
  # optimizer state as they were, bit for bit.
  assert_trees_equal(ours[:2], before[:2])
  inner = lambda s: s[1].inner_state
  assert_trees_equal(inner(ours[2]), inner(before[2]))

  # The jmp example's select_tree agrees (its finite check after the mean).
  loss_scale = jmp.DynamicLossScale(jnp.float32(4.0))
  jmp_pstep = _pmap(functools.partial(jmp_step, axis_name="i", cast=False), n)
  theirs = stack((params, state, make_optimizer().init(params), loss_scale), n)
  *theirs, loss_scale, finite = jmp_pstep(*theirs, {"x": x[0], "y": y[0]})
  *after, loss_scale, finite = jmp_pstep(*theirs, loss_scale, {"x": x[1], "y": y[1]})
  np.testing.assert_array_equal(np.asarray(finite), [False] * n)
  assert_trees_close(ours[:2], tuple(after[:2]), rtol=1e-6, atol=1e-7)


def test_a_float16_mean_before_the_wrapper_reproduces_the_static_example():
  # Haiku's example with `StaticLossScale(2.0**15)` casts the gradients to
  # float16 and averages them there; the same casts around
  # `cross_shard_mean`, before the wrapper, give its numbers.
  n = 2
  x, y = _data(5, replicas=n, seed=1)
  x[3, 1, 0, 0] = np.inf
  to_float16 = optax.stateless(lambda g, params=None: ls.cast_floating(g, jnp.float16))
  to_params_dtype = optax.stateless(
    lambda g, params: jax.tree.map(lambda u, p: u.astype(p.dtype), g, params)
  )
  tx = optax.chain(
    to_float16,
    ls.cross_shard_mean("i"),
    to_params_dtype,
    ls.static_loss_scale(make_optimizer(), 2.0**15),
  )
  params, state = forward.init(jax.random.PRNGKey(0), {"x": x[0, 0]}, True)
  ours = stack((params, state, tx.init(params)), n)
  theirs = stack((params, state, make_optimizer().init(params)), n)
  loss_scale = jmp.StaticLossScale(2.0**15)
  o_step = _pmap(functools.partial(our_step, tx), n)

  def static_example(params, state, opt_state, batch):
    *new, _, finite = jmp_step(
      params, state, opt_state, loss_scale, batch, axis_name="i"
    )
    return (*new, finite)

  j_step = _pmap(static_example, n)
  skips = []
  for i in range(len(x)):
    batch = {"x": x[i], "y": y[i]}
    ours = o_step(*ours, batch)
    *theirs, finite = j_step(*theirs, batch)
    np.testing.assert_array_equal(np.asarray(ls.step_applied(ours[2])), finite)
    assert_trees_close(ours[:2], tuple(theirs[:2]), rtol=1e-6, atol=1e-7)
    skips.append(not np.asarray(finite).any())
  assert skips == [False, False, False, True, False]
