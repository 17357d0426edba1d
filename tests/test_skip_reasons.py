"""Why a step is skipped: the loss given as `value=`, the reasons recorded
and logged, and the decision's inputs agreed across replicas.

A non-finite loss skips the whole step and leaves the scale as it was; an
overflow backs it off; without `value=` (and without `SkipSpikes`) nothing
changes, bit for bit; `step_metrics` and `check_not_stalled` name the
reason; every path (`tx.update`, `apply_gradients`, `TrainState`, the NNX
step; eager, jitted, vmapped, data parallel) takes the same decision.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import _compat
import lossscale as ls
from _helpers import INF, NAN, assert_trees_equal, make_mesh, stack, standard_promotion

PARAMS = {"w": jnp.array([1.0, -2.0, 0.5])}
GOOD = {"w": jnp.array([0.5, 1.0, -1.0])}  # unscaled


def _tx(**kw):
  return ls.dynamic_loss_scale(
    optax.adam(0.1), initial_scale=8.0, growth_interval=3, hysteresis=2, **kw
  )


def _scaled(grads, state):
  return jax.tree.map(lambda g: g * ls.get_loss_scale(state), grads)


def _steps(kind, tx):
  """`step(grads, state, params, value) -> (params, state)` by `kind`."""
  if kind == "update":

    def step(g, s, p, v):
      u, s = tx.update(g, s, p, **({} if v is None else {"value": v}))
      return optax.apply_updates(p, u), s

  else:

    def step(g, s, p, v):
      return ls.apply_gradients(tx, g, s, p, **({} if v is None else {"value": v}))

  return step


# (unscaled gradients, loss): a bad loss, an overflow, a good step.
SEQUENCE = [
  (GOOD, 1.0),
  ({"w": jnp.array([NAN, 1.0, 1.0])}, NAN),  # the loss is NaN: no back-off
  (GOOD, INF),  # the loss alone is inf: skipped all the same
  ({"w": jnp.array([INF, 1.0, 1.0])}, 2.0),  # overflow: hysteresis spent
  ({"w": jnp.array([INF, 1.0, 1.0])}, 2.0),  # second overflow: backs off
  (GOOD, 0.5),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", ["update", "apply_gradients"])
def test_a_bad_loss_skips_the_step_and_leaves_the_scale(kind, jit):
  tx = _tx()
  step = _steps(kind, tx)
  step = jax.jit(step) if jit else step
  params, state = PARAMS, tx.init(PARAMS)
  seen = []
  with standard_promotion():
    for grads, loss in SEQUENCE:
      before_params, before_inner = params, state.inner_state
      params, state = step(_scaled(grads, state), state, params, jnp.float32(loss))
      if not bool(state.last_applied):
        assert_trees_equal(params, before_params)
        assert_trees_equal(state.inner_state, before_inner)
      seen.append(
        (
          float(state.loss_scale),
          int(state.last_skip_reason),
          int(state.hysteresis_left),
          bool(state.last_finite),
        )
      )
  assert seen == [
    (8.0, 0, 2, True),
    (8.0, 2, 2, False),  # NaN gradients, but the loss explains them
    (8.0, 2, 2, True),
    (8.0, 1, 1, False),  # the overflow spends the hysteresis
    (4.0, 1, 0, False),  # and the second backs off
    (4.0, 0, 0, True),
  ]
  np.testing.assert_array_equal(state.skips_by_reason, [2, 2, 0, 0])
  assert int(state.skipped_steps) == 4 and int(state.good_steps) == 1


def test_without_value_nothing_changes_bit_for_bit():
  # The same gradients, a bad loss among them, with no `value=`: the
  # overflow rule alone (the bad loss's NaN gradients back off), exactly as
  # a wrapper that never heard of losses.
  tx = _tx()
  step = jax.jit(_steps("apply_gradients", tx))
  params, state = PARAMS, tx.init(PARAMS)
  scales = []
  with standard_promotion():
    for grads, _ in SEQUENCE:
      params, state = step(_scaled(grads, state), state, params, None)
      scales.append(float(state.loss_scale))
  # The NaN gradients spend the hysteresis (2), the good step with an inf
  # loss is applied, and each of the two overflows then backs off.
  assert scales == [8.0, 8.0, 8.0, 4.0, 2.0, 2.0]
  np.testing.assert_array_equal(state.skips_by_reason, [3, 0, 0, 0])


def test_the_loss_is_forwarded_to_the_inner_optimizer():
  # optax's `value=` is the loss: `optax.lbfgs` and reduce_on_plateau read it.
  seen = []

  def record(u, s, p=None, *, value=None, **kw):
    seen.append(value)
    return u, s

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), record)
  tx = ls.skip_nonfinite(inner)
  tx.update(GOOD, tx.init(PARAMS), PARAMS, value=jnp.float32(0.25))
  assert float(seen[0]) == 0.25


@pytest.mark.parametrize("bad", [jnp.ones(2), jnp.int32(1), "loss"])
def test_value_must_be_a_real_scalar(bad):
  tx = _tx()
  with pytest.raises(ValueError, match=r"update\(value=\.\.\.\)` must be the loss"):
    tx.update(GOOD, tx.init(PARAMS), PARAMS, value=bad)


def test_a_python_number_is_a_loss():
  # `float(loss)` from an eager loop, as optax.lbfgs users pass it: taken as
  # float32, a NaN one skips as a bad loss; the inner optimizer gets it as given.
  tx = _tx()
  state = tx.init(PARAMS)
  with standard_promotion():  # optax's adam
    _, state = tx.update(_scaled(GOOD, state), state, PARAMS, value=1.5)
    assert bool(state.last_applied)
    _, state = tx.update(_scaled(GOOD, state), state, PARAMS, value=float("nan"))
  assert ls.SKIP_REASONS[int(state.last_skip_reason) - 1] == "nonfinite_loss"
  assert float(state.loss_scale) == 8.0
  # A Python int is refused eagerly as `jax.jit` refuses it (an int32 there).
  grads = _scaled(GOOD, state)
  for call in (tx.update, jax.jit(tx.update)):
    with pytest.raises(ValueError, match=r"value=.*real floating scalar.*int"):
      call(grads, state, PARAMS, value=2)


@pytest.mark.parametrize("jit", [False, True])
def test_a_norm_beyond_float32_is_a_spike_and_an_overflow_is_not(jit):
  # The norm is computed in the same pass as the finite check: its sum of
  # squares is finite only if the gradients are. Finite gradients whose norm
  # is beyond float32 (1e20 squared) are a gradient-norm spike, even in the
  # warm-up; gradients holding an inf are an overflow, which backs off.
  tx = ls.dynamic_loss_scale(
    optax.sgd(0.1), initial_scale=1.0, skip_spikes=ls.SkipSpikes(loss=False)
  )
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(PARAMS)
  huge = {"w": jnp.array([1e20, 1.0, 1.0])}
  u, state = update(huge, state, PARAMS)
  assert ls.SKIP_REASONS[int(state.last_skip_reason) - 1] == "grad_norm_spike"
  assert float(state.loss_scale) == 1.0 and int(state.spike_window.seen[1]) == 0
  assert_trees_equal(u, jax.tree.map(jnp.zeros_like, PARAMS))
  _, state = update({"w": jnp.array([INF, 1.0, 1.0])}, state, PARAMS)
  assert ls.SKIP_REASONS[int(state.last_skip_reason) - 1] == "overflow"
  assert float(state.loss_scale) == 1.0  # at its minimum: counted, no lower
  _, state = update(GOOD, state, PARAMS)
  assert bool(state.last_applied) and int(state.spike_window.seen[1]) == 1
  np.testing.assert_allclose(
    float(state.spike_window.values[1, 0]), float(np.linalg.norm(GOOD["w"])), rtol=1e-6
  )


def test_step_metrics_name_the_reason():
  tx = _tx()
  params, state = PARAMS, tx.init(PARAMS)
  with standard_promotion():
    step = jax.jit(_steps("apply_gradients", tx))
    reasons = []
    for grads, loss in SEQUENCE:
      params, state = step(_scaled(grads, state), state, params, jnp.float32(loss))
      m = jax.jit(ls.step_metrics)(state)
      code = int(m["skip_reason"])
      reasons.append("applied" if code == 0 else ls.SKIP_REASONS[code - 1])
  assert reasons == [
    "applied",
    "nonfinite_loss",
    "nonfinite_loss",
    "overflow",
    "overflow",
    "applied",
  ]
  counts = [int(m[f"skipped_{name}"]) for name in ls.SKIP_REASONS]
  assert counts == [2, 2, 0, 0] and sum(counts) == int(m["skipped_steps"])


def test_check_not_stalled_names_a_bad_loss():
  tx = _tx()
  state = tx.init(PARAMS)
  nan_grads = {"w": jnp.array([NAN, 1.0, 1.0])}
  with standard_promotion():
    for _ in range(3):
      _, state = tx.update(nan_grads, state, PARAMS, value=jnp.float32(NAN))
  with pytest.raises(ls.LossScaleStalledError, match="the loss itself is inf or NaN"):
    ls.check_not_stalled(state, max_consecutive_skips=3)
  assert float(state.loss_scale) == 8.0  # never backed off
  # The same run without the loss: a scale story.
  state = tx.init(PARAMS)
  with standard_promotion():
    for _ in range(3):
      _, state = tx.update(nan_grads, state, PARAMS)
  with pytest.raises(ls.LossScaleStalledError, match="gradients held inf or NaN"):
    ls.check_not_stalled(state, max_consecutive_skips=3)


def test_a_vmapped_ensemble_decides_per_member():
  tx = _tx()
  states = jax.vmap(tx.init)(stack(PARAMS, 3))
  grads = stack(_scaled(GOOD, tx.init(PARAMS)), 3)
  losses = jnp.array([1.0, NAN, 2.0])
  with standard_promotion():
    params, states = jax.jit(jax.vmap(_steps("apply_gradients", tx)))(
      grads, states, stack(PARAMS, 3), losses
    )
  np.testing.assert_array_equal(states.last_skip_reason, [0, 2, 0])
  np.testing.assert_array_equal(params["w"][1], PARAMS["w"])
  assert not np.array_equal(params["w"][0], PARAMS["w"])


@pytest.mark.parametrize("placement", ["axis_name", "cross_shard_mean before"])
@pytest.mark.parametrize("kind", ["update", "apply_gradients"])
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_replicas_decide_on_their_mean_loss(mapper, kind, placement):
  # One replica's loss is NaN (its gradients are fine): every replica skips,
  # the scale unmoved, and with spike skipping the windows hold the same
  # mean loss everywhere. Gradients averaged before the wrapper are the same
  # everywhere, the losses it is given are not: the wrapper averages them.
  n = 4
  spikes = ls.SkipSpikes(window=4, sigmas=3.0, grad_norm=False, warmup=3)
  if placement == "axis_name":
    tx = ls.dynamic_loss_scale(
      optax.sgd(0.1), initial_scale=8.0, axis_name="i", skip_spikes=spikes
    )
  else:
    tx = optax.chain(
      ls.cross_shard_mean("i"),
      ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0, skip_spikes=spikes),
    )
  step = _steps(kind, tx)
  losses = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, NAN, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]])
  grads = stack(_scaled(GOOD, tx.init(PARAMS)), n)
  params, state = stack(PARAMS, n), stack(tx.init(PARAMS), n)
  if mapper == "pmap":
    mapped = jax.pmap(step, axis_name="i", devices=jax.devices()[:n])
  else:
    mesh = make_mesh((n,), ("i",))
    first = lambda t: jax.tree.map(lambda a: a[0], t)
    body = lambda g, s, p, v: jax.tree.map(
      lambda a: a[None], step(first(g), first(s), first(p), v[0])
    )
    mapped = jax.jit(
      _compat.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    )
  reasons = []
  with standard_promotion():
    for row in losses:
      params, state = mapped(grads, state, params, jnp.asarray(row, jnp.float32))
      reasons.append(np.asarray(ls.step_metrics(state)["skip_reason"]).tolist())
  assert reasons == [[0] * n, [2] * n, [0] * n]
  if placement != "axis_name":
    state = state[1]
  window = np.asarray(state.spike_window.values)
  np.testing.assert_array_equal(window, np.broadcast_to(window[:1], window.shape))
  np.testing.assert_allclose(window[0, 0, :2], [2.5, 3.0])  # the means, NaN left out
  np.testing.assert_array_equal(np.asarray(state.loss_scale), [8.0] * n)
  for leaf in jax.tree.leaves(params):
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))


def test_train_state_and_the_nnx_step_take_the_loss():
  import flax.linen as nn

  tx = _tx()
  model = nn.Dense(1)
  variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
  ts = ls.flax.TrainState.create(
    apply_fn=model.apply, params=variables["params"], tx=tx
  )
  grads = jax.tree.map(jnp.ones_like, ts.params)
  with standard_promotion():
    new = jax.jit(lambda s, g, v: s.apply_gradients(grads=g, value=v))(
      ts, grads, jnp.float32(NAN)
    )
  assert int(new.step) == 0 and int(new.opt_state.last_skip_reason) == 2
  assert float(new.loss_scale) == 8.0
  assert_trees_equal(new.params, ts.params)

  layer = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(layer, _tx(), wrt=nnx.Param)
  x = jnp.array([[1.0, NAN, 0.5]])  # a NaN input: the loss and the gradients
  loss_fn = lambda m, x: jnp.mean(m(x) ** 2)
  with standard_promotion():
    nnx.jit(ls.flax.nnx_step(loss_fn, pass_loss=True))(optimizer, layer, x)
  assert float(ls.get_loss_scale(optimizer)) == 8.0  # a bad loss: no back-off
  assert int(optimizer.opt_state.last_skip_reason[...]) == 2
  optimizer = nnx.Optimizer(layer, _tx(), wrt=nnx.Param)
  with standard_promotion():
    nnx.jit(ls.flax.nnx_step(loss_fn))(optimizer, layer, x)
  assert float(ls.get_loss_scale(optimizer)) == 8.0  # hysteresis 2: spent only
  assert int(optimizer.opt_state.last_skip_reason[...]) == 1


def test_spike_skipping_off_costs_nothing():
  # Without `skip_spikes` the state holds no window and the step computes
  # no gradient norm (SGD takes no square root of its own): the program is
  # the one without the option.
  _tx = lambda **kw: ls.dynamic_loss_scale(optax.sgd(0.1), **kw)
  tx = _tx()
  assert tx.init(PARAMS).spike_window == ()
  with standard_promotion():
    jaxpr = jax.make_jaxpr(functools.partial(ls.apply_gradients, tx))(
      GOOD, tx.init(PARAMS), PARAMS
    )
    with_loss = jax.make_jaxpr(
      lambda g, s, p: ls.apply_gradients(tx, g, s, p, value=jnp.float32(1.0))
    )(GOOD, tx.init(PARAMS), PARAMS)
  assert "sqrt" not in str(jaxpr) and "sqrt" not in str(with_loss)
  spiky = _tx(skip_spikes=ls.SkipSpikes(loss=False))
  with standard_promotion():
    jaxpr = jax.make_jaxpr(functools.partial(ls.apply_gradients, spiky))(
      GOOD, spiky.init(PARAMS), PARAMS
    )
  assert "sqrt" in str(jaxpr)


def test_upgrade_state_adds_the_new_fields_and_a_window():
  from typing import Any, NamedTuple

  class Before42(NamedTuple):  # the layout before skip reasons
    loss_scale: Any
    good_steps: Any
    hysteresis_left: Any
    skipped_steps: Any
    consecutive_skips: Any
    last_finite: Any
    last_applied: Any
    steps_since_rescale: Any
    overflows_since_backoff: Any
    overflows_at_min_scale: Any
    inner_state: Any

  tx = _tx()
  state = tx.init(PARAMS)
  old = Before42(*state[:10], state.inner_state)
  new = ls.upgrade_state(old)
  assert_trees_equal(new, state)
  spikes = ls.SkipSpikes(window=5)
  spiky = _tx(skip_spikes=spikes)
  windowed = ls.upgrade_state(old, skip_spikes=spikes)
  assert_trees_equal(windowed, spiky.init(PARAMS))
  # A current state without a window gets one, so the option can be turned
  # on for a restored run; one with a window is kept.
  assert_trees_equal(ls.upgrade_state(state, skip_spikes=spikes), spiky.init(PARAMS))
  with standard_promotion():
    _, stepped = spiky.update(GOOD, windowed, PARAMS, value=jnp.float32(1.0))
  assert ls.upgrade_state(stepped, skip_spikes=spikes) is stepped


def _filled(width, losses):
  """A state of a `SkipSpikes(window=width)` wrapper that took `losses`."""
  tx = ls.skip_nonfinite(
    optax.sgd(0.1), skip_spikes=ls.SkipSpikes(window=width, sigmas=1e9, warmup=2)
  )
  state = tx.init(PARAMS)
  for loss in losses:
    _, state = tx.update(GOOD, state, PARAMS, value=jnp.float32(loss))
  return tx, state


@pytest.mark.parametrize("width", [4, 16])
def test_a_resized_window_keeps_its_newest_values(width):
  # A window of 8 that took 1..10 resized to `width`: the same window as one
  # of `width` that took only the values kept (the newest, oldest first),
  # so the next step decides and records alike.
  _, state = _filled(8, range(1, 11))
  assert ls.upgrade_state(state, skip_spikes=ls.SkipSpikes(window=8)) is state
  resized = ls.upgrade_state(state, skip_spikes=ls.SkipSpikes(window=width))
  kept = list(range(max(3, 11 - width), 11))
  tx, want = _filled(width, kept)
  assert_trees_equal(resized.spike_window, want.spike_window)
  assert resized.spike_window.values.shape == (2, width)
  _, after = tx.update(GOOD, resized, PARAMS, value=jnp.float32(11.0))
  _, want = tx.update(GOOD, want, PARAMS, value=jnp.float32(11.0))
  assert_trees_equal(after.spike_window, want.spike_window)
  assert int(after.last_skip_reason) == int(want.last_skip_reason)


def test_a_state_without_the_window_it_needs_is_named():
  spikes = ls.SkipSpikes(window=4)
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), skip_spikes=spikes)
  plain = ls.dynamic_loss_scale(optax.sgd(0.1)).init(PARAMS)
  grads = _scaled(GOOD, plain)
  with pytest.raises(ValueError, match=r"no spike window.*upgrade_state"):
    tx.update(grads, plain, PARAMS, value=1.0)
  _, other = _filled(8, [1.0])
  with pytest.raises(ValueError, match=r"window of 4 values.*holds 8.*upgrade_state"):
    jax.jit(lambda s: tx.update(grads, s, PARAMS, value=1.0))(other)
  upgraded = ls.upgrade_state(plain, skip_spikes=spikes)
  _, state = tx.update(grads, upgraded, PARAMS, value=1.0)
  assert int(state.spike_window.seen[0]) == 1
