"""Tests for lossscale.flax.TrainState and the nnx.Optimizer integration."""

import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct
from flax.training import train_state
from optax.tree_utils import tree_get, tree_get_all_with_path

import _compat
import lossscale as ls
from _helpers import assert_trees_equal, standard_promotion
from lossscale.flax import TrainState


class Net(nn.Module):
  """float16 compute, float32 parameters, BatchNorm so batch_stats exist."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(8, dtype=jnp.float16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=jnp.float16)(x)
    return nn.Dense(1, dtype=jnp.float16)(nn.relu(x)).astype(jnp.float32)


class BNState(TrainState):
  batch_stats: dict


class PlainBNState(train_state.TrainState):
  batch_stats: dict


def _data(n_steps):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(4, 1)).astype(np.float32)
  xs = rng.normal(size=(n_steps, 16, 4)).astype(np.float32)
  return jnp.asarray(xs), jnp.asarray(2.0 * xs @ w + 3.0)


def _loss(state, params, x, y):
  out, updates = state.apply_fn(
    {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
  )
  return jnp.mean((out - y) ** 2), updates["batch_stats"]


@jax.jit
def _scaled_grads(state, x, y):
  f = lambda p: _loss(state, p, x, y)
  return ls.value_and_grad(f, has_aux=True)(state, state.params)


@jax.jit
def _apply(state, grads, stats):
  return state.apply_gradients(grads=grads, batch_stats=stats)


def _init(cls, tx):
  variables = Net().init(jax.random.key(0), jnp.ones((2, 4)))
  return cls.create(
    apply_fn=Net().apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=tx,
  )


def test_linen_skipped_step_leaves_state_unchanged_and_training_works():
  xs, ys = _data(30)
  bad_step = 10
  xs = xs.at[bad_step, 0, 0].set(jnp.inf)  # inf in the forward pass
  with standard_promotion():  # BatchNorm, optax.adam
    state = _init(
      BNState, ls.dynamic_loss_scale(optax.adam(5e-2), initial_scale=2.0**10)
    )
    # The reference: Flax's own TrainState and the bare optimizer, fed the
    # unscaled gradients of the finite steps only.
    ref = _init(PlainBNState, optax.adam(5e-2))
    losses = []
    for i in range(30):
      before = state
      (loss, stats), grads = _scaled_grads(state, xs[i], ys[i])
      scale = state.loss_scale
      state = _apply(state, grads, stats)
      if i == bad_step:
        assert not np.isfinite(float(loss))
        assert int(state.step) == int(before.step)
        assert_trees_equal(state.params, before.params)
        assert_trees_equal(state.batch_stats, before.batch_stats)
        assert float(state.loss_scale) == 2.0**9
        assert int(state.skipped_steps) == 1
        continue
      unscaled = jax.tree.map(lambda g, s=scale: g * (1.0 / s), grads)
      ref = _apply(ref, unscaled, stats)
      losses.append(float(loss))
      jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        (state.params, state.batch_stats, state.step),
        (ref.params, ref.batch_stats, ref.step),
      )
  assert state.step.dtype == jnp.int32
  assert int(state.step) == 29 == int(ref.step)
  assert int(state.skipped_steps) == 1
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_train_state_is_a_flax_train_state_and_reports_its_scale():
  with standard_promotion():  # BatchNorm in float16
    state = _init(BNState, ls.static_loss_scale(optax.sgd(0.1), 64.0))
  assert isinstance(state, train_state.TrainState)
  assert int(state.step) == 0 and state.step.dtype == jnp.int32
  # `loss_scale` is a property, not a field: exactly one value in the tree.
  found = tree_get_all_with_path(state, "loss_scale")
  assert len(found) == 1 and float(found[0][1]) == 64.0
  assert float(tree_get(state, "loss_scale")) == 64.0
  assert float(ls.get_loss_scale(state)) == 64.0
  assert float(ls.scale_loss(jnp.float16(0.5), state)) == 32.0
  assert int(state.skipped_steps) == 0


def test_train_state_inside_chain_and_with_extra_args():
  params = {"w": jnp.ones(3)}
  # Clipping inside the wrapper sees unscaled gradients.
  inner = optax.chain(optax.clip(0.3), optax.sgd(1.0))
  tx = optax.chain(optax.scale(1.0), ls.dynamic_loss_scale(inner, initial_scale=4.0))
  state = TrainState.create(apply_fn=None, params=params, tx=tx)
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
  state = step(state, {"w": jnp.array([0.4, -0.8, 2.0])})  # 4 x (0.1, -0.2, 0.5)
  np.testing.assert_allclose(state.params["w"], [0.9, 1.2, 0.7], rtol=1e-6)
  assert int(state.step) == 1
  state = step(state, {"w": jnp.array([jnp.nan, 0.0, 0.0])})
  np.testing.assert_allclose(state.params["w"], [0.9, 1.2, 0.7], rtol=1e-6)
  assert int(state.step) == 1 and float(state.loss_scale) == 2.0


def test_train_state_through_cond_keeps_types():
  # The skipped and the applied state have identical types (no weak types).
  state = TrainState.create(
    apply_fn=None, params={"w": jnp.ones(2)}, tx=ls.dynamic_loss_scale(optax.sgd(0.1))
  )

  @jax.jit
  def f(s, pred):
    new = s.apply_gradients(grads={"w": jnp.ones(2)})
    return jax.lax.cond(pred, lambda: new, lambda: s)

  out = f(state, True)
  assert int(out.step) == 1


def test_create_without_loss_scaling_fails_clearly():
  with pytest.raises(ValueError, match="LossScaleState"):
    TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))


class ExtraState(TrainState):
  extra: dict = struct.field(default_factory=dict)


def _extra_state(extra, tx=None):
  tx = ls.skip_nonfinite(optax.sgd(0.1)) if tx is None else tx
  return ExtraState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx, extra=extra)


def test_kwargs_that_change_structure_fail_clearly():
  state = _extra_state({"a": jnp.zeros(1)})
  with pytest.raises(ValueError, match=r"apply_gradients\(extra=...\)"):
    state.apply_gradients(grads={"w": jnp.ones(2)}, extra={"b": jnp.zeros(1)})


@pytest.mark.parametrize(
  "new, match",
  [
    (jnp.zeros(3), r"at \['a'\] got float32\[3\] instead of float32\[1\]"),
    (jnp.zeros(1, jnp.float16), r"got float16\[1\] instead of float32\[1\]"),
    (jnp.zeros((), jnp.float32), r"got float32\[\] instead of float32\[1\]"),
  ],
)
def test_kwargs_that_change_shape_or_dtype_fail_clearly(new, match):
  # A skipped step must keep the old value: a select cannot, and must not
  # silently broadcast or promote the new one to the old's shape or dtype.
  state = _extra_state({"a": jnp.zeros(1)})
  for apply in (ExtraState.apply_gradients, jax.jit(ExtraState.apply_gradients)):
    with pytest.raises(ValueError, match=r"apply_gradients\(extra=...\).*" + match):
      apply(state, grads={"w": jnp.ones(2)}, extra={"a": new})


def test_kwargs_take_the_new_value_bitwise_on_an_applied_step():
  old = {"h": jnp.array([1.0, -2.0], jnp.bfloat16), "n": jnp.int32(3)}
  new = {"h": jnp.array([-0.0, 65504.0], jnp.bfloat16), "n": jnp.int32(-7)}
  state = _extra_state(old, ls.dynamic_loss_scale(optax.sgd(0.1)))
  step = jax.jit(lambda s, g: s.apply_gradients(grads=g, extra=new))
  applied = step(state, {"w": jnp.ones(2)})
  assert_trees_equal(applied.extra, new)
  skipped = step(state, {"w": jnp.array([1.0, jnp.nan])})
  assert_trees_equal(skipped.extra, old)


def test_train_state_under_pmap():
  n = 2
  devices = jax.devices()[:n]
  tx = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=8.0, axis_name="batch")
  state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
  state = jax.tree.map(lambda x: jnp.stack([x] * n), state)

  def step(state, x):
    loss_fn = lambda p: jnp.sum(p["w"] * x)
    _, grads = ls.value_and_grad(loss_fn)(state, state.params)
    grads = jax.lax.pmean(grads, "batch")
    return state.apply_gradients(grads=grads)

  pstep = jax.pmap(step, axis_name="batch", devices=devices)
  x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
  state = pstep(state, x)
  # Mean gradient (2, 3), learning rate 0.5: w = 1 - (1, 1.5).
  np.testing.assert_allclose(state.params["w"], [[0.0, -0.5]] * n, rtol=1e-6)
  np.testing.assert_array_equal(state.step, [1, 1])
  # An inf on one replica only: both skip, neither advances.
  state = pstep(state, x.at[1, 0].set(jnp.inf))
  np.testing.assert_allclose(state.params["w"], [[0.0, -0.5]] * n, rtol=1e-6)
  np.testing.assert_array_equal(state.step, [1, 1])
  np.testing.assert_array_equal(state.loss_scale, [4.0, 4.0])
  np.testing.assert_array_equal(state.skipped_steps, [1, 1])


class NnxNet(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 1, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


def test_nnx_optimizer_skips_and_exposes_the_scale():
  model = NnxNet(nnx.Rngs(0))
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=16.0)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert float(ls.get_loss_scale(optimizer)) == 16.0
  w0 = np.asarray(model.linear.kernel[...])
  b0 = np.asarray(model.linear.bias[...])

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
    loss, grads = ls.value_and_grad(loss_fn)(optimizer, model)
    _compat.nnx_optimizer_update(optimizer, model, grads)
    return loss

  x = jnp.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]])
  y = jnp.array([[1.0], [0.0]])
  # Reference: plain SGD on the unscaled float32 gradient, by hand.
  pred = x @ w0 + b0
  g_w = 2 * x.T @ (pred - y) / 2
  g_b = jnp.sum(2 * (pred - y) / 2, axis=0)
  loss = train_step(model, optimizer, x, y)
  np.testing.assert_allclose(loss, jnp.mean((pred - y) ** 2), rtol=1e-6)
  np.testing.assert_allclose(model.linear.kernel[...], w0 - 0.1 * g_w, rtol=1e-5)
  np.testing.assert_allclose(model.linear.bias[...], b0 - 0.1 * g_b, rtol=1e-5)
  assert float(ls.get_loss_scale(optimizer)) == 16.0

  w1 = np.asarray(model.linear.kernel[...])
  b1 = np.asarray(model.linear.bias[...])
  train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
  np.testing.assert_array_equal(model.linear.kernel[...], w1)
  np.testing.assert_array_equal(model.linear.bias[...], b1)
  assert float(ls.get_loss_scale(optimizer)) == 8.0
  assert int(optimizer.opt_state.skipped_steps[...]) == 1
  assert float(ls.scale_loss(jnp.float32(2.0), optimizer)) == 16.0


class NnxStatefulNet(nnx.Module):
  """BatchNorm statistics and Dropout RNG counts change in the forward pass."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 3, rngs=rngs)
    self.bn = nnx.BatchNorm(3, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.bn(self.linear(x)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_value_and_grad_of_an_nnx_module_is_nnx_value_and_grad(jit):
  # Reference: NNX's own transformation on the loss scaled by hand, from an
  # identical model. The loss's updates to the model's other state (BatchNorm
  # statistics, Dropout's RNG count) must be carried out the same way.
  x = jax.random.normal(jax.random.key(1), (8, 4))
  loss_fn = lambda m: jnp.mean(m(x) ** 2)
  scale = 8.0

  def ours(model):
    return ls.value_and_grad(loss_fn)(scale, model)

  def reference(model):
    def scaled(m):
      loss = loss_fn(m)
      return ls.scale_loss(loss, scale), loss

    (_, loss), grads = nnx.value_and_grad(scaled, has_aux=True)(model)
    return loss, grads

  got_model, ref_model = NnxStatefulNet(nnx.Rngs(0)), NnxStatefulNet(nnx.Rngs(0))
  if jit:
    ours, reference = nnx.jit(ours), nnx.jit(reference)
  for _ in range(2):
    loss, grads = ours(got_model)
    ref_loss, ref_grads = reference(ref_model)
    assert_trees_equal(loss, ref_loss)
    assert_trees_equal(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
  assert_trees_equal(
    jax.tree.leaves(nnx.state(got_model)), jax.tree.leaves(nnx.state(ref_model))
  )
  assert np.abs(np.asarray(got_model.bn.mean[...])).max() > 0  # it was updated


def test_value_and_grad_with_nnx_modules_anywhere_and_other_arguments():
  x = jax.random.normal(jax.random.key(1), (8, 4))

  def loss_fn(models, extra, *, gain):
    first, second = models
    out = jnp.mean(first(x) ** 2) + jnp.mean(second(x) ** 2)
    return out * extra["a"] * gain + extra["n"].astype(jnp.float32)

  def fresh():
    return (NnxStatefulNet(nnx.Rngs(0)), NnxStatefulNet(nnx.Rngs(1)))

  extra = {"a": jnp.float32(1.5), "n": jnp.int32(3), "f": 2.0}
  models = fresh()
  loss, (g_models, g_extra) = ls.value_and_grad(loss_fn, argnums=(0, 1))(
    4.0, models, extra, gain=2.0
  )
  # Modules inside a tuple go to NNX too: their BatchNorm statistics move.
  assert all(np.abs(np.asarray(m.bn.mean[...])).max() > 0 for m in models)
  # The plain argument keeps the documented rule: non-arrays get None.
  assert g_extra["n"] is None and g_extra["f"] is None
  # Reference: NNX's transformation on the loss scaled by hand, the extra
  # argument's array leaf alone differentiated.
  ref_models = fresh()

  def scaled(ms, a):
    loss = loss_fn(ms, {**extra, "a": a}, gain=2.0)
    return ls.scale_loss(loss, 4.0), loss

  (_, ref_loss), (ref_g_models, ref_g_a) = nnx.value_and_grad(
    scaled, argnums=(0, 1), has_aux=True
  )(ref_models, extra["a"])
  assert_trees_equal(loss, ref_loss)
  assert_trees_equal(jax.tree.leaves(g_models), jax.tree.leaves(ref_g_models))
  assert_trees_equal(g_extra["a"], ref_g_a)
  assert_trees_equal(
    jax.tree.leaves(nnx.state(models)), jax.tree.leaves(nnx.state(ref_models))
  )


def test_import_without_flax_says_what_to_install():
  code = (
    "import sys\n"
    "sys.modules['flax'] = None  # as if Flax were not installed\n"
    "try:\n"
    "  import lossscale.flax\n"
    "except ImportError as e:\n"
    "  print(e)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  ).stdout
  assert "pip install 'lossscale[flax]'" in out
  # The core library does not need Flax.
  code = "import sys\nsys.modules['flax'] = None\nimport lossscale\nprint('ok')"
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  ).stdout
  assert out.strip() == "ok"


def test_float8_state_is_overwritten_as_flax_does_and_refused_by_a_bare_wrapper():
  # Flax's fp8 layers keep scales and amax histories in the
  # `_overwrite_with_gradient` collection, whose "gradients" are their new
  # values. TrainState hands them over as Flax does (and keeps them on a
  # skipped step); a bare wrapper given them would divide them by the loss
  # scale, so it refuses them, naming where they are.
  model = nn.Dense(4, dot_general_cls=nn.Fp8DirectDotGeneralOp)
  x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  variables = model.init(jax.random.key(0), x)
  loss = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  with standard_promotion():  # optax's adam
    tx = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=16.0)
    state = ls.flax.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    grads = jax.grad(lambda v: ls.scale_loss(loss(v, x), state))(state.params)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    new = step(state, grads)
    fp8 = "_overwrite_with_gradient"
    # Overwritten with their new values, exactly, not divided by 16.
    assert_trees_equal(new.params[fp8], grads[fp8])
    assert int(new.step) == 1
    bad = jax.tree.map(lambda g: g, grads)
    bad["params"]["kernel"] = bad["params"]["kernel"].at[0, 0].set(jnp.inf)
    kept = step(new, bad)
    assert_trees_equal(kept.params, new.params)
    assert int(kept.step) == 1 and int(kept.skipped_steps) == 1
    # The plain optax setup a user would write is refused.
    overwrite = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda g, s, p: (jax.tree.map(jnp.subtract, g, p), s),
    )
    labels = {k: k for k in variables}
    bare = ls.dynamic_loss_scale(
      optax.multi_transform({"params": optax.adam(1e-2), fp8: overwrite}, labels)
    )
    opt_state = bare.init(variables)
    for update in (bare.update, jax.jit(bare.update)):
      with pytest.raises(ValueError, match=r"float8 state at \['_overwrite_with_grad"):
        update(grads, opt_state, variables)
    with pytest.raises(ValueError, match=r"lossscale\.flax\.TrainState"):
      ls.apply_gradients(bare, grads, opt_state, variables)
