"""Tests for lossscale.flax.nnx_step: a skipped NNX step leaves the model and
the optimizer as they were, and a finite one is the plain NNX step."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import _compat
import lossscale as ls
from _helpers import assert_trees_close, assert_trees_equal, standard_promotion
from lossscale._scaled_grad import find_state


def _get(variable):
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _set(variable, value):
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:  # Flax 0.10
    variable.value = value


class Seen(nnx.Variable):
  """A custom variable, neither a parameter nor a BatchNorm statistic."""


class Net(nnx.Module):
  """BatchNorm statistics, Dropout's RNG count and two custom variables all
  change in the forward pass."""

  def __init__(self, rngs):
    # No bias before BatchNorm: its gradient is rounding noise, which adam
    # would scale up to full steps.
    self.linear = nnx.Linear(4, 8, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)
    self.calls = Seen(jnp.zeros((), jnp.int32))
    self.feature_mean = Seen(jnp.zeros(8, jnp.float32))

  def __call__(self, x):
    h = self.bn(self.linear(x))
    _set(self.calls, _get(self.calls) + 1)
    _set(self.feature_mean, jnp.mean(h, axis=0))  # inf/NaN from an inf batch
    return self.out(self.drop(nnx.relu(h)))


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def _data(n_steps):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(4, 1)).astype(np.float32)
  xs = rng.normal(size=(n_steps, 16, 4)).astype(np.float32)
  return jnp.asarray(xs), jnp.asarray(2.0 * xs @ w + 1.0)


def _arrays(tree):
  """The arrays of a tree of `nnx.Variable`s (or of an `nnx.State`)."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return [
    _get(x) if is_variable(x) else x for x in jax.tree.leaves(tree, is_leaf=is_variable)
  ]


def _model_arrays(model):
  return jax.tree.leaves(nnx.state(model))


def _plain_step(model, optimizer, x, y):
  """The reference: NNX's own step on the unscaled loss, bare optax."""
  loss, grads = nnx.value_and_grad(_loss)(model, x, y)
  _compat.nnx_optimizer_update(optimizer, model, grads)
  return loss


def _recipe_step(model, optimizer, x, y):
  """What docs/flax.md showed before `nnx_step`."""
  loss, grads = ls.value_and_grad(_loss)(optimizer, model, x, y)
  _compat.nnx_optimizer_update(optimizer, model, grads)
  return loss


def _ours_step(model, optimizer, x, y):
  return ls.flax.nnx_step(_loss)(optimizer, model, x, y)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_skipped_step_leaves_model_and_optimizer_bitwise_then_trains_as_plain(jit):
  xs, ys = _data(6)
  bad_step = 2
  xs = xs.at[bad_step, 0, 0].set(jnp.inf)  # inf in the forward pass
  step, plain = _ours_step, _plain_step
  if jit:
    step, plain = nnx.jit(step), nnx.jit(plain)
  with standard_promotion():  # optax.adam
    model = Net(nnx.Rngs(0))
    tx = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=2.0**10)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref_model = Net(nnx.Rngs(0))
    ref_optimizer = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
    for i in range(len(xs)):
      model_before = _model_arrays(model)
      inner_before = _arrays(find_state(optimizer).inner_state)
      step_before = _get(optimizer.step)
      loss = step(model, optimizer, xs[i], ys[i])
      if i == bad_step:
        assert not np.isfinite(float(loss))
        # Every variable of the model, parameters, BatchNorm statistics, RNG
        # count and custom variables alike, bit for bit.
        assert_trees_equal(_model_arrays(model), model_before)
        assert_trees_equal(_get(optimizer.step), step_before)
        wrapper = find_state(optimizer)
        assert float(_get(wrapper.loss_scale)) == 2.0**9
        assert int(_get(wrapper.skipped_steps)) == 1
        assert not bool(_get(wrapper.last_finite))
        assert_trees_equal(_arrays(wrapper.inner_state), inner_before)
        continue
      ref_loss = plain(ref_model, ref_optimizer, xs[i], ys[i])
      # The plain step never saw the bad batch; after the skip the two runs
      # agree again, RNG counts (so Dropout masks) and step counts included.
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
      assert_trees_close(
        _model_arrays(model), _model_arrays(ref_model), rtol=1e-5, atol=1e-6
      )
      assert_trees_close(
        _arrays(find_state(optimizer).inner_state),
        _arrays(ref_optimizer.opt_state),
        rtol=1e-5,
        atol=1e-7,
      )
      assert_trees_equal(_get(optimizer.step), _get(ref_optimizer.step))
  assert int(_get(optimizer.step)) == len(xs) - 1
  assert int(_get(model.calls)) == len(xs) - 1
  model.eval()
  out = model(xs[0])
  assert np.isfinite(np.asarray(out)).all()
  assert np.isfinite(np.asarray(_get(model.bn.mean))).all()


def test_without_nnx_step_the_bad_batch_poisons_the_model():
  # What the test above guards against: with `ls.value_and_grad` and
  # `optimizer.update` alone, the parameters stay but the inf batch's
  # statistics, RNG count and custom variables are kept.
  xs, ys = _data(1)
  x = xs[0].at[0, 0].set(jnp.inf)
  model = Net(nnx.Rngs(0))
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**10)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  kernel = _get(model.linear.kernel)
  count = _model_arrays(model.drop)
  _recipe_step(model, optimizer, x, ys[0])
  assert_trees_equal(_get(model.linear.kernel), kernel)
  assert not np.isfinite(np.asarray(_get(model.bn.mean))).all()
  assert not np.isfinite(np.asarray(_get(model.feature_mean))).all()
  assert int(_get(model.calls)) == 1
  assert int(_get(optimizer.step)) == 1
  with pytest.raises(AssertionError, match="bits differ"):
    assert_trees_equal(_model_arrays(model.drop), count)  # the RNG count moved
  model.eval()
  assert not np.isfinite(np.asarray(model(xs[0]))).all()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_skipped_step_keeps_chained_state_negative_zeros_and_returns_aux(jit):
  # A schedule chained after the wrapper does not count a skipped step, and
  # a -0.0 parameter stays -0.0 (`p + 0` would give +0.0).
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  _set(model.bias, jnp.array([-0.0], jnp.float32))
  schedule = optax.linear_schedule(0.1, 0.0, 100)
  tx = optax.chain(
    ls.dynamic_loss_scale(optax.adam(1.0), initial_scale=8.0),
    optax.scale_by_schedule(schedule),  # a skipped step's zeros stay +0.0
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(m, x):
    out = m(x)
    return jnp.mean(out**2), out

  step = ls.flax.nnx_step(loss_fn, has_aux=True)
  if jit:
    step = nnx.jit(step)
  before_model = _model_arrays(model)
  before_opt = _outside_the_wrapper(optimizer.opt_state)
  with standard_promotion():
    loss, out = step(optimizer, model, jnp.array([[jnp.nan, 1.0]]))
  assert out.shape == (1, 1) and not np.isfinite(float(loss))
  assert np.signbit(np.asarray(_get(model.bias)))[0]
  assert_trees_equal(_model_arrays(model), before_model)
  wrapper = find_state(optimizer)
  assert float(_get(wrapper.loss_scale)) == 4.0
  assert int(_get(wrapper.skipped_steps)) == 1
  # Everything but the wrapper's scale and counters, the schedule's count too.
  assert_trees_equal(_outside_the_wrapper(optimizer.opt_state), before_opt)
  assert int(_get(optimizer.step)) == 0
  # A finite step then counts in the chained schedule.
  with standard_promotion():
    loss, _ = step(optimizer, model, jnp.array([[1.0, 1.0]]))
  assert np.isfinite(float(loss)) and int(_get(optimizer.step)) == 1
  counts = optax.tree_utils.tree_get_all_with_path(
    _arrays_tree(optimizer.opt_state), "count"
  )
  assert sorted(int(c) for _, c in counts) == [1, 1]


def _outside_the_wrapper(opt_state):
  """The optimizer state's arrays, the wrapper's state replaced by its inner state."""
  is_state = lambda x: isinstance(x, ls.LossScaleState)
  tree = jax.tree.map(
    lambda x: x.inner_state if is_state(x) else x, opt_state, is_leaf=is_state
  )
  return _arrays_tree(tree)


def _arrays_tree(tree):
  is_variable = lambda x: isinstance(x, nnx.Variable)
  return jax.tree.map(
    lambda x: _get(x) if is_variable(x) else x, tree, is_leaf=is_variable
  )


def test_optimizer_without_loss_scaling_or_not_nnx_fails_clearly():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  step = ls.flax.nnx_step(lambda m: jnp.sum(m(jnp.ones((1, 2)))))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  with pytest.raises(ValueError, match="LossScaleState"):
    step(optimizer, model)
  tx = ls.skip_nonfinite(optax.sgd(0.1))
  state = ls.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=tx)
  with pytest.raises(TypeError, match=r"needs an `nnx\.Optimizer`"):
    step(state, model)


@pytest.mark.skipif(
  "model" in inspect.signature(nnx.Optimizer.update).parameters,
  reason="Flax >= 0.11: nnx.Optimizer does not hold the model",
)
def test_flax_0_10_optimizer_of_another_model_fails_clearly():
  model, other = (nnx.Linear(2, 1, rngs=nnx.Rngs(i)) for i in range(2))
  optimizer = nnx.Optimizer(other, ls.skip_nonfinite(optax.sgd(0.1)), wrt=nnx.Param)
  with pytest.raises(ValueError, match=r"optimizer\.model"):
    ls.flax.nnx_step(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(optimizer, model)


def test_set_loss_scale_restarts_an_nnx_optimizers_scale_in_place():
  # A float32 run (enabled=False) switched to float16: restart the scale.
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), enabled=False)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  assert float(ls.get_loss_scale(optimizer)) == 1.0
  assert ls.set_loss_scale(optimizer, 256.0) is optimizer
  assert float(ls.get_loss_scale(optimizer)) == 256.0
  assert find_state(optimizer).loss_scale.dtype == jnp.float32

  @nnx.jit
  def restart(optimizer):
    ls.set_loss_scale(optimizer, 8.0)

  restart(optimizer)
  assert float(ls.get_loss_scale(optimizer)) == 8.0
  assert int(_get(find_state(optimizer).good_steps)) == 0


class Counted(nnx.Module):
  """Variables holding Python numbers, which the forward pass writes."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(2, 1, rngs=rngs)
    self.calls = Seen(0)
    self.last = Seen(0.5)

  def __call__(self, x):
    _set(self.calls, _get(self.calls) + 1)
    _set(self.last, _get(self.last) * 2)
    return self.linear(x)


def test_eager_and_jitted_steps_put_back_python_numbers_alike():
  # Under nnx.jit a Python number is a (weakly typed) array, which the
  # skipped step selects; an eager step must put it back too.
  xs = [jnp.array([[1.0, 2.0]]), jnp.array([[jnp.inf, 1.0]]), jnp.array([[3.0, 1.0]])]
  loss = lambda m, x: jnp.mean(m(x) ** 2)
  runs = {}
  for jit in (False, True):
    model = Counted(nnx.Rngs(0))
    tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    step = ls.flax.nnx_step(loss)
    step = nnx.jit(step) if jit else step
    history = []
    for x in xs:
      step(optimizer, model, x)
      history.append((_get(model.calls), _get(model.last)))
    runs[jit] = history
  # Counted on applied steps only: 1, 1 (skipped), 2; 1.0, 1.0, 2.0.
  assert [(int(c), float(v)) for c, v in runs[False]] == [(1, 1.0), (1, 1.0), (2, 2.0)]
  assert_trees_equal(runs[False], runs[True], weak_type=True)


# ---------------------------------------------------------------------------
# `with_metrics=True`: the step's metrics and the true gradients' norm.


def _norm_of_plain_grads(model, loss_fn, *args):
  """The global norm of the unscaled loss's gradients, in float64 NumPy: NNX's
  own `nnx.grad`, no loss scale, no lossscale code."""
  grads = nnx.grad(loss_fn)(model, *args)
  leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
  return float(np.sqrt(sum(np.sum(g**2) for g in leaves)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
def test_with_metrics_returns_step_metrics_and_the_unscaled_grad_norm(jit):
  # float16 compute; the scale doubles after every applied step, so a norm
  # taken with the scale after the update would be half the true one.
  model = nnx.Linear(3, 2, dtype=jnp.float16, rngs=nnx.Rngs(0))
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**10, growth_interval=1)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(m, x):
    return jnp.mean(m(x).astype(jnp.float32) ** 2)

  step = ls.flax.nnx_step(loss_fn, with_metrics=True)
  step = nnx.jit(step) if jit else step
  x = jnp.array([[1.0, -2.0, 0.5], [0.25, 1.0, 3.0]])
  reference = nnx.Linear(3, 2, rngs=nnx.Rngs(0))  # the same parameters, float32
  expected = _norm_of_plain_grads(reference, loss_fn, x)
  loss, metrics = step(optimizer, model, x)
  assert np.isfinite(float(loss))
  assert set(metrics) == {*ls.step_metrics(optimizer), "grad_norm"}
  assert metrics["grad_norm"].dtype == jnp.float32 and metrics["grad_norm"].shape == ()
  np.testing.assert_allclose(float(metrics["grad_norm"]), expected, rtol=1e-2)
  assert_trees_equal(
    {**metrics, "grad_norm": None}, {**ls.step_metrics(optimizer), "grad_norm": None}
  )
  assert float(metrics["loss_scale"]) == 2.0**11 and bool(metrics["applied"])
  # A skipped step: its metrics say so, and the norm is not finite.
  kernel = _get(model.kernel)
  loss, metrics = step(optimizer, model, x.at[0, 0].set(jnp.inf))
  assert_trees_equal(_get(model.kernel), kernel)
  assert not bool(metrics["applied"]) and not np.isfinite(float(metrics["grad_norm"]))
  assert [int(metrics[k]) for k in ("skipped_steps", "consecutive_skips")] == [1, 1]
  assert float(metrics["loss_scale"]) == 2.0**10


def test_with_metrics_and_aux_and_the_default_return():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, ls.skip_nonfinite(optax.sgd(0.1)), wrt=nnx.Param)

  def loss_fn(m, x):
    out = m(x)
    return jnp.mean(out**2), out

  x = jnp.ones((1, 2))
  (loss, out), metrics = ls.flax.nnx_step(loss_fn, has_aux=True, with_metrics=True)(
    optimizer, model, x
  )
  assert out.shape == (1, 1) and loss.shape == () and "grad_norm" in metrics
  loss, out = ls.flax.nnx_step(loss_fn, has_aux=True)(optimizer, model, x)
  assert out.shape == (1, 1) and loss.shape == ()
  assert (
    ls.flax.nnx_step(lambda m, x: jnp.mean(m(x) ** 2))(optimizer, model, x).shape == ()
  )
  with pytest.raises(TypeError):  # keyword-only
    ls.flax.nnx_step(loss_fn, True, True)


# ---------------------------------------------------------------------------
# NNX objects passed to the loss function are put back too.


class DropNet(nnx.Module):
  """Dropout that holds its `nnx.Rngs` (`held`) or is given one per call,
  as Flax's MNIST tutorial does."""

  def __init__(self, rngs, *, held):
    self.linear = nnx.Linear(2, 4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs if held else None)

  def __call__(self, x, rngs=None):
    return self.drop(self.linear(x), rngs=rngs)


def _draws(*nodes):
  """How many keys the RNG streams of `nodes` have drawn (each counted
  once): a Dropout that holds its `nnx.Rngs` draws from a stream forked
  from it on newer Flax, from the `nnx.Rngs` itself on Flax 0.10."""
  return sum(int(c) for c in jax.tree.leaves(nnx.state(nodes, nnx.RngCount)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx_jit"])
@pytest.mark.parametrize("layout", ["held", "argument"])
def test_a_skipped_step_puts_back_the_rng_count_in_either_layout(layout, jit):
  held = layout == "held"
  rngs = nnx.Rngs(params=0, dropout=1)
  model = DropNet(rngs, held=held)
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  if held:
    step = ls.flax.nnx_step(lambda m, x: jnp.mean(m(x) ** 2))
  else:  # Flax's MNIST tutorial: `train_step(model, optimizer, metrics, rngs, batch)`
    step = ls.flax.nnx_step(lambda m, r, x: jnp.mean(m(x, rngs=r) ** 2))
  step = nnx.jit(step) if jit else step
  args = () if held else (rngs,)
  bad, good = jnp.array([[jnp.inf, 1.0]]), jnp.array([[1.0, 2.0]])
  start = _draws(model, rngs)
  step(optimizer, model, *args, bad)
  assert _draws(model, rngs) == start and int(_get(optimizer.step)) == 0
  step(optimizer, model, *args, good)
  assert _draws(model, rngs) == start + 1 and int(_get(optimizer.step)) == 1
  step(optimizer, model, *args, bad)
  assert _draws(model, rngs) == start + 1
  assert int(_get(find_state(optimizer).skipped_steps)) == 2


class Tally(nnx.Module):
  def __init__(self):
    self.calls = Seen(jnp.zeros((), jnp.int32))


# Flax 0.10's `nnx.jit` does not take a bare `nnx.Variable` argument.
_JIT_TAKES_VARIABLES = "model" in inspect.signature(nnx.Optimizer.update).parameters


@pytest.mark.parametrize(
  "jit",
  [
    False,
    pytest.param(
      True,
      marks=pytest.mark.skipif(
        not _JIT_TAKES_VARIABLES, reason="Flax 0.10's nnx.jit: no bare Variables"
      ),
    ),
  ],
  ids=["eager", "nnx_jit"],
)
def test_a_skipped_step_puts_back_every_nnx_object_among_args_and_kwargs(jit):
  # An nnx.Rngs by keyword (and again inside a dict), a module inside the
  # dict, a bare Variable inside a list: selected as the model's own state is.
  model = DropNet(nnx.Rngs(0), held=False)
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  rngs, tally, seen = nnx.Rngs(dropout=1), Tally(), Seen(jnp.zeros(2))

  def loss_fn(m, x, extras, *, rngs):
    assert extras["rngs"] is rngs
    _set(extras["tally"].calls, _get(extras["tally"].calls) + 1)
    _set(extras["seen"][0], x[0])  # inf from the bad batch
    return jnp.mean(m(x, rngs=rngs) ** 2)

  step = ls.flax.nnx_step(loss_fn)
  step = nnx.jit(step) if jit else step
  extras = {"tally": tally, "seen": [seen], "rngs": rngs}
  for x, applied in [([[jnp.inf, 1.0]], 0), ([[1.0, 2.0]], 1), ([[2.0, jnp.nan]], 1)]:
    step(optimizer, model, jnp.array(x), extras, rngs=rngs)
    assert _draws(rngs) == applied and int(_get(tally.calls)) == applied
    assert np.isfinite(np.asarray(_get(seen))).all()
  assert_trees_equal(_get(seen), jnp.array([1.0, 2.0]))
  assert int(_get(optimizer.step)) == 1
