"""Tests for lossscale/_applied.py: `step_applied`, `where_applied`, and the
one check, shared by every entry point, that the wrapper runs every step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state as train_state_lib

import lossscale as ls
from _helpers import assert_trees_equal, stack, standard_promotion

# Gradients of three steps: finite, inf, finite; `FINITE` is the reference.
GRADS = [
  {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)},
  {"w": jnp.array([jnp.inf, -2.0]), "b": jnp.array(0.5)},
  {"w": jnp.array([3.0, 4.0]), "b": jnp.array(-0.0)},
]
FINITE = [
  all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g)) for g in GRADS
]
PARAMS = {"w": jnp.ones(2), "b": jnp.zeros([])}


def _get(variable):
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def _tx():
  return ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_step_applied_is_whether_the_last_steps_gradients_were_finite(jit):
  tx = optax.chain(optax.scale(1.0), _tx())
  update = jax.jit(tx.update) if jit else tx.update
  state = tx.init(PARAMS)
  flags = [bool(ls.step_applied(state))]  # True before the first step
  for grads in GRADS:
    _, state = update(grads, state, PARAMS)
    applied = ls.step_applied(state)
    assert applied.dtype == jnp.bool_ and applied.shape == ()
    flags.append(bool(applied))
  assert flags == [True, *FINITE]


def test_step_applied_reads_a_train_state_and_an_nnx_optimizer():
  bad = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), PARAMS)
  state = ls.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=_tx())
  assert bool(ls.step_applied(state))
  state = state.apply_gradients(grads=bad)
  assert not bool(ls.step_applied(state))

  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  step = ls.flax.nnx_step(lambda m, x: jnp.mean(m(x) ** 2))
  step(optimizer, model, jnp.array([[jnp.inf, 1.0]]))
  assert not bool(ls.step_applied(optimizer))
  step(optimizer, model, jnp.array([[1.0, 1.0]]))
  assert bool(ls.step_applied(optimizer))


def _forward_state(old, grads):
  """What a forward pass writes beside the optimizer: statistics of the
  batch (inf on a bad one), a counter, a -0.0 that a `where` of arithmetic
  would turn into +0.0."""
  return {
    "mean": old["mean"] + grads["w"],  # exact: no rounding to compare
    "count": old["count"] + 1,
    "neg": -old["neg"],
  }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_where_applied_keeps_the_old_tree_bitwise_on_a_skipped_step(jit):
  tx = _tx()

  def step(grads, opt_state, model_state):
    _, opt_state = tx.update(grads, opt_state, PARAMS)
    new = _forward_state(model_state, grads)
    return opt_state, ls.where_applied(opt_state, new, model_state)

  step = jax.jit(step) if jit else step
  opt_state = tx.init(PARAMS)
  model_state = {"mean": jnp.zeros(2), "count": jnp.zeros([], jnp.int32), "neg": -0.0}
  model_state["neg"] = jnp.asarray(model_state["neg"], jnp.float32)
  ref = jax.tree.map(np.asarray, model_state)
  for grads, finite in zip(GRADS, FINITE, strict=True):
    opt_state, model_state = step(grads, opt_state, model_state)
    if finite:  # independent reference: NumPy, applied steps only
      ref = {
        "mean": ref["mean"] + np.asarray(grads["w"]),
        "count": ref["count"] + np.int32(1),
        "neg": -ref["neg"],
      }
    assert_trees_equal(model_state, jax.tree.map(jnp.asarray, ref))
  assert int(model_state["count"]) == sum(FINITE)


def test_where_applied_in_a_vmapped_ensemble_selects_per_member():
  tx = _tx()
  n = 3
  grads = {  # member 1 overflows, members 0 and 2 do not
    "w": jnp.array([[1.0, 2.0], [jnp.inf, 2.0], [3.0, -1.0]]),
    "b": jnp.array([0.5, 0.5, 0.25]),
  }
  old = {"mean": jnp.arange(2 * n, dtype=jnp.float32).reshape(n, 2)}

  def step(g, opt_state, model_state):
    _, opt_state = tx.update(g, opt_state, PARAMS)
    new = {"mean": model_state["mean"] + g["w"]}
    return opt_state, ls.where_applied(opt_state, new, model_state)

  opt_state = jax.vmap(lambda _: tx.init(PARAMS))(jnp.arange(n))
  opt_state, new = jax.jit(jax.vmap(step))(grads, opt_state, old)
  finite = np.isfinite(np.asarray(grads["w"])).all(axis=1)
  np.testing.assert_array_equal(np.asarray(ls.step_applied(opt_state)), finite)
  stepped = np.asarray(old["mean"] + grads["w"])
  expected = np.where(finite[:, None], stepped, old["mean"])
  np.testing.assert_array_equal(np.asarray(new["mean"]), expected)
  # Outside the vmap, the stacked flags select along the leading axis.
  outside = ls.where_applied(opt_state, {"mean": old["mean"] + grads["w"]}, old)
  np.testing.assert_array_equal(np.asarray(outside["mean"]), expected)
  with pytest.raises(ValueError, match=r"stacked state.*\['mean'\].*float32\[2\]"):
    ls.where_applied(opt_state, {"mean": jnp.zeros(2)}, {"mean": jnp.ones(2)})


@pytest.mark.parametrize("mean_first", [True, False], ids=["mean_first", "own"])
def test_where_applied_under_pmap(mean_first):
  # With the gradients averaged first, an inf on replica 0 makes both skip;
  # without, each replica decides, and selects, on its own gradients.
  n = 2
  devices = jax.devices()[:n]
  tx = optax.chain(ls.cross_shard_mean("i"), _tx()) if mean_first else _tx()

  def step(g, opt_state, model_state):
    _, opt_state = tx.update(g, opt_state, PARAMS)
    new = {"mean": model_state["mean"] + g["w"], "n": model_state["n"] + 1}
    return opt_state, ls.where_applied(opt_state, new, model_state)

  grads = {
    "w": jnp.array([[jnp.inf, 1.0], [2.0, 3.0]]),
    "b": jnp.array([0.5, 0.5]),
  }
  old = stack({"mean": jnp.zeros(2), "n": jnp.zeros([], jnp.int32)}, n)
  opt_state = stack(tx.init(PARAMS), n)
  p_step = jax.pmap(step, axis_name="i", devices=devices)
  opt_state, new = p_step(grads, opt_state, old)
  applied = np.asarray(ls.step_applied(opt_state))
  expected = [False, False] if mean_first else [False, True]
  np.testing.assert_array_equal(applied, expected)
  np.testing.assert_array_equal(np.asarray(new["n"]), np.asarray(expected, np.int32))
  np.testing.assert_array_equal(np.asarray(new["mean"][0]), [0.0, 0.0])
  row = [2.0, 3.0] if not mean_first else [0.0, 0.0]
  np.testing.assert_array_equal(np.asarray(new["mean"][1]), row)


def test_where_applied_names_the_leaf_that_differs():
  state = _tx().init(PARAMS)
  old = {"bn": {"mean": jnp.zeros(2), "var": jnp.ones(2)}}
  with pytest.raises(ValueError, match=r"same tree structure"):
    ls.where_applied(state, {"bn": {"mean": jnp.zeros(2)}}, old)
  bad_shape = {"bn": {"mean": jnp.zeros(2), "var": jnp.ones(3)}}
  match = r"\['bn'\]\['var'\] got float32\[3\] and float32\[2\]"
  with pytest.raises(ValueError, match=match):
    ls.where_applied(state, bad_shape, old)
  bad_dtype = {"bn": {"mean": jnp.zeros(2, jnp.float16), "var": jnp.ones(2)}}
  match = r"\['bn'\]\['mean'\] got float16\[2\] and float32\[2\]"
  with pytest.raises(ValueError, match=match):
    ls.where_applied(state, bad_dtype, old)
  with pytest.raises(ValueError, match="LossScaleState"):
    ls.where_applied(optax.sgd(0.1).init(PARAMS), old, old)
  with pytest.raises(ValueError, match="LossScaleState"):
    ls.step_applied({"not": "a state"})


# The shared check: every entry point refuses a wrapper that does not run
# on every step, with one message.
_CONTAINERS = {
  "MultiSteps": lambda w: optax.MultiSteps(w, 2).gradient_transformation(),
  "apply_if_finite": lambda w: optax.apply_if_finite(w, 3),
  "conditionally_mask": lambda w: optax.conditionally_mask(w, lambda n: n > 0),
}


def _message(call):
  with pytest.raises(ValueError) as info:
    call()
  return str(info.value)


@pytest.mark.parametrize("name", list(_CONTAINERS))
def test_every_entry_point_refuses_a_wrapper_not_run_every_step_alike(name):
  tx = _CONTAINERS[name](_tx())
  bad = {"w": jnp.array([jnp.inf, 1.0]), "b": jnp.array(0.0)}
  with standard_promotion():  # MultiSteps divides by an int32 count
    opt_state = tx.init(PARAMS)
    create = lambda: ls.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=tx)
    if name == "MultiSteps":  # refused as soon as the TrainState is made
      refused = _message(create)
      train_state = train_state_lib.TrainState.create(
        apply_fn=None, params=PARAMS, tx=tx
      )
    else:
      train_state = create()
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  loss = lambda m, x: jnp.mean(m(x) ** 2)
  x = jnp.array([[jnp.inf, 1.0]])
  calls = {
    "apply_gradients": lambda: ls.apply_gradients(tx, bad, opt_state, PARAMS),
    "apply_gradients_jit": lambda: jax.jit(functools.partial(ls.apply_gradients, tx))(
      bad, opt_state, PARAMS
    ),
    "TrainState": lambda: ls.flax.TrainState.apply_gradients(train_state, grads=bad),
    "nnx_step": lambda: ls.flax.nnx_step(loss)(optimizer, model, x),
    "nnx_step_jit": lambda: nnx.jit(ls.flax.nnx_step(loss))(optimizer, model, x),
    "step_applied": lambda: ls.step_applied(opt_state),
    "where_applied": lambda: ls.where_applied(train_state, PARAMS, PARAMS),
    "step_applied_nnx": lambda: ls.step_applied(optimizer),
  }
  kernel = np.asarray(_get(model.kernel))
  messages = {where: _message(call) for where, call in calls.items()}
  first = messages["apply_gradients"]
  if name == "MultiSteps":  # refused everywhere: training would stop
    assert "inside optax.MultiSteps" in first and "inf * 0 = NaN" in first
    assert "tx.update" not in first  # no second way out
    assert refused == first
  else:
    assert f"inside optax's {type(opt_state).__name__[:-5]}" in first
    assert "not consulted on every step" in first
  assert messages == dict.fromkeys(calls, first)
  # Refused before anything ran: the model and the optimizer are untouched.
  np.testing.assert_array_equal(np.asarray(_get(model.kernel)), kernel)
  assert int(_get(optimizer.step)) == 0


def test_a_wrapper_inside_multisteps_is_refused_wherever_its_state_is_read():
  # One inf micro-batch makes MultiSteps' accumulator NaN for good (it resets
  # by multiplying by 0), and every later step is skipped: no lossscale
  # function that reads the state offers this order a way to train.
  tx = _CONTAINERS["MultiSteps"](_tx())
  with standard_promotion():
    opt_state = tx.init(PARAMS)
  loss = lambda p: jnp.sum(p["w"] ** 2)
  calls = {
    "get_loss_scale": lambda: ls.get_loss_scale(opt_state),
    "scale_loss": lambda: ls.scale_loss(jnp.float32(1.0), opt_state),
    "value_and_grad": lambda: ls.value_and_grad(loss)(opt_state, PARAMS),
    "unscale_gradients": lambda: ls.unscale_gradients(PARAMS, opt_state),
    "step_metrics": lambda: ls.step_metrics(opt_state),
    "check_not_stalled": lambda: ls.check_not_stalled(opt_state),
    "set_loss_scale": lambda: ls.set_loss_scale(opt_state, 8.0),
    "jit": lambda: jax.jit(ls.get_loss_scale)(opt_state),
  }
  messages = {where: _message(call) for where, call in calls.items()}
  first = messages["get_loss_scale"]
  assert "inside optax.MultiSteps" in first and "gradient_transformation()" in first
  assert messages == dict.fromkeys(calls, first)


def test_nnx_step_with_the_wrapper_outside_multisteps_still_works():
  # The order the message recommends is accepted, and skips a bad batch.
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  inner = optax.MultiSteps(optax.sgd(0.1), 2).gradient_transformation()
  optimizer = nnx.Optimizer(model, _tx_around(inner), wrt=nnx.Param)
  step = ls.flax.nnx_step(lambda m, x: jnp.mean(m(x) ** 2))
  with standard_promotion():
    step(optimizer, model, jnp.array([[jnp.inf, 1.0]]))
  assert not bool(ls.step_applied(optimizer))
  assert int(_get(optimizer.step)) == 0


def _tx_around(inner):
  return ls.dynamic_loss_scale(inner, initial_scale=4.0)


def test_stacked_train_states_of_a_pmap_select_outside_it():
  n = 2
  tx = _tx()
  state = stack(ls.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=tx), n)
  grads = stack(GRADS[0], n)
  grads["w"] = grads["w"].at[1, 0].set(jnp.nan)
  state = jax.pmap(lambda s, g: s.apply_gradients(grads=g), devices=jax.devices()[:n])(
    state, grads
  )
  new, old = stack({"s": jnp.ones(3)}, n), stack({"s": jnp.zeros(3)}, n)
  picked = ls.where_applied(state, new, old)
  np.testing.assert_array_equal(np.asarray(picked["s"]), [[1.0] * 3, [0.0] * 3])


def test_where_applied_selects_typed_prng_keys_as_they_are():
  state = _tx().init(PARAMS)
  _, state = _tx().update(GRADS[1], state, PARAMS)
  keys = {"k": jax.random.key(1)}
  picked = ls.where_applied(state, {"k": jax.random.key(2)}, keys)
  assert_trees_equal(picked, keys)
