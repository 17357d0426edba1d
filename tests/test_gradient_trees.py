"""The gradient trees and dtypes the wrappers take, and what they do with them.

Mismatched trees fail early and clearly; integer, bool, float0 and None
leaves pass through unscaled; masked, empty and scalar leaves work; half
precision is unscaled in float32, float64 and complex in their own dtype;
per-example gradients (a leading batch axis) are allowed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _compat
import lossscale as ls
from _helpers import (
  INF,
  NAN,
  assert_trees_close,
  assert_trees_equal,
  standard_promotion,
)

_SGD_LR = 0.5


def _sgd_tx(initial_scale=4.0):
  return ls.dynamic_loss_scale(optax.sgd(_SGD_LR), initial_scale=initial_scale)


# ---------------------------------------------------------------------------
# Trees.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "grads, match",
  [
    ({"a": jnp.ones(2)}, "gradient tree does not match the params tree"),
    ({"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(1)}, "does not match"),
    ([jnp.ones(2), jnp.ones(3)], "does not match"),
    ({"a": jnp.ones(3), "b": jnp.ones(3)}, r"at \['a'\] has shape \(3,\)"),
    ({"a": jnp.ones(2), "b": jnp.ones((3, 1))}, r"at \['b'\] has shape \(3, 1\)"),
    ({"a": jnp.ones(2), "b": jnp.ones(4)}, r"\['b'\] has shape \(4,\)"),
  ],
)
@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_mismatched_gradients_with_params_raise_early(grads, match, jit, inner):
  # Even where the inner optimizer would broadcast them (sgd takes any shape).
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  tx = ls.dynamic_loss_scale(getattr(optax, inner)(0.1))
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  with pytest.raises(ValueError, match=match):
    update(grads, state, params)
  with pytest.raises(ValueError, match=match):
    ls.apply_gradients(tx, grads, state, params)


@pytest.mark.parametrize(
  "grads, match",
  [
    ({"a": jnp.ones(1), "b": jnp.ones(3)}, r"at \['a'\] has shape \(1,\)"),
    ({"a": jnp.ones(2), "b": jnp.ones(())}, r"at \['b'\] has shape \(\)"),
    ({"a": jnp.ones(2)}, "gradient tree does not match"),
  ],
)
def test_lookahead_checks_gradients_against_the_fast_params(grads, match):
  # LookaheadParams(fast, slow): the gradients are those of `fast`, and a
  # shape that would broadcast into it is still refused.
  params = optax.LookaheadParams.init_synced({"a": jnp.ones(2), "b": jnp.ones(3)})
  inner = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
  tx = ls.dynamic_loss_scale(inner)
  with standard_promotion(), pytest.raises(ValueError, match=match):
    jax.jit(tx.update)(grads, tx.init(params), params)


def test_disabled_takes_what_the_bare_optimizer_takes():
  # `enabled=False` is exactly `inner`: `None` gradients of integer leaves
  # (what `ls.value_and_grad` gives them) pass as they do bare.
  params = {"w": jnp.ones(3), "n": jnp.arange(3)}
  inner = optax.rmsprop(0.1)
  tx = ls.dynamic_loss_scale(inner, enabled=False)
  state = tx.init(params)
  _, grads = ls.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
  assert grads["n"] is None
  updates, new_state = tx.update(grads, state, params)
  bare_updates, bare_state = inner.update(grads, inner.init(params), params)
  assert_trees_equal(updates, bare_updates)
  assert_trees_equal(new_state.inner_state, bare_state)


def test_mismatched_gradients_without_params():
  # Without params nothing says what the tree should be: a stateful inner
  # optimizer fails on its own state's tree, a stateless one returns updates
  # of the gradients' shape, which `optax.apply_updates` then rejects.
  params = {"a": jnp.ones(2), "b": jnp.ones(3)}
  wrong = {"a": jnp.ones(2)}
  with standard_promotion():
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
  with standard_promotion():
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
  with standard_promotion():
    updates, state = update(
      {"w": jnp.array([NAN, 1.0]), "frozen": jnp.ones(1)}, state, params
    )
  assert int(ls._scaled_grad.find_state(state).skipped_steps) == 1
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  assert ls.nonfinite_leaves(state) == {}


def test_zero_size_and_scalar_leaves():
  params = {"empty": jnp.zeros((0, 3)), "s": jnp.float32(2.0), "v": jnp.ones(2)}
  with standard_promotion():
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
  with standard_promotion():
    updates, state = jax.jit(tx.update)(scaled, tx.init(params), params)
    expected, _ = inner.update(per_example, inner.init(params), params)
  assert_trees_close(updates, expected)
  assert bool(state.last_finite)
  bad = jax.tree.map(lambda g: g.at[2].set(NAN), scaled)
  with standard_promotion():
    zeros, state = jax.jit(tx.update)(bad, state, params)
  assert int(state.skipped_steps) == 1
  assert not any(np.asarray(z).any() for z in jax.tree.leaves(zeros))


# ---------------------------------------------------------------------------
# Dtypes.


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_low_precision_gradients_unscale_in_float32(dtype):
  params = {"w": jnp.ones(3, dtype)}
  tx = _sgd_tx(initial_scale=2.0**10)
  state = tx.init(params)
  # 3 * 2**10 is exact in every dtype; the updates are computed in float32
  # and come out in the parameters' dtype, as bare sgd gives them.
  grads = {"w": jnp.array([3.0, -1.0, 0.5], dtype) * 2.0**10}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert updates["w"].dtype == dtype
  in_float32 = np.float32(-_SGD_LR) * np.array([3.0, -1.0, 0.5], np.float32)
  np.testing.assert_array_equal(updates["w"], jnp.asarray(in_float32).astype(dtype))
  # 2**17 overflows float16 (max 65504) to inf, not bfloat16 or float32.
  big = {"w": jnp.array([2.0**17, 1.0, 1.0], jnp.float32).astype(dtype)}
  overflowed = dtype == jnp.float16
  assert np.isinf(np.asarray(big["w"], np.float32)[0]) == overflowed
  _, state = jax.jit(tx.update)(big, state, params)
  assert int(state.skipped_steps) == int(overflowed)


def test_float16_gradients_are_unscaled_in_float32():
  # 60000 * 2**-15 needs float32: in float16 the product of the gradient and
  # 1/scale would round; the update must equal the float32 computation.
  # The updates come out in the parameters' dtype: float32 parameters get
  # the float32 computation exactly ...
  tx = ls.static_loss_scale(optax.identity(), 2.0**15)
  g = jnp.array([60000.0, 3.0, 2.0**-10], jnp.float16)
  in_float32 = g.astype(jnp.float32) / np.float32(2**15)
  params = jnp.zeros(3, jnp.float32)
  u, _ = jax.jit(tx.update)(g, tx.init(params), params)
  assert u.dtype == jnp.float32
  np.testing.assert_array_equal(u, in_float32)
  # ... and without parameters, the gradients' dtype: that computation,
  # rounded once.
  u, _ = jax.jit(tx.update)(g, tx.init(g))
  assert u.dtype == jnp.float16
  np.testing.assert_array_equal(u, in_float32.astype(jnp.float16))


def test_unscaled_overflow_is_detected_for_scales_below_one():
  # 3e38 is finite, but 3e38 / 0.5 is not: the check is on unscaled values.
  tx = ls.static_loss_scale(optax.identity(), 0.5)
  g = jnp.array([3e38, 1.0], jnp.float32)
  u, state = jax.jit(tx.update)(g, tx.init(g))
  assert int(state.skipped_steps) == 1
  np.testing.assert_array_equal(u, np.zeros(2))


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


@pytest.mark.parametrize(
  "scale", [2.0**126, 2.0**127, 3e38, float(np.finfo(np.float32).max)]
)
def test_scales_above_2_126_unscale_exactly(scale):
  # 1 / scale is subnormal above 2**126, and XLA flushes it to zero: the
  # updates must still be the unscaled gradients, not zeros.
  tx = ls.static_loss_scale(optax.sgd(1.0), scale)
  params = {"w": jnp.zeros(3)}
  true = np.array([1.0, -0.5, 0.25], np.float32)
  grads = {"w": jnp.asarray(true * np.float32(scale))}
  for update in (tx.update, jax.jit(tx.update)):
    updates, state = update(grads, tx.init(params), params)
    assert bool(state.last_finite)
    np.testing.assert_array_equal(updates["w"], -true)
  # A scale known at compile time (the state made inside `jit`): XLA must not
  # fold the two factors of the unscale back into one subnormal.
  if not ls._jax_internals._barrier_batches():
    pytest.skip("jax 0.4.35 cannot batch the optimization barrier this needs")
  state = tx.init(params)
  for step in (
    jax.jit(lambda g: tx.update(g, state, params)[0]),
    jax.jit(lambda g: tx.update(g, tx.init(params), params)[0]),
  ):
    np.testing.assert_array_equal(step(grads)["w"], -true)


def test_python_float_leaves_are_unscaled_eagerly_as_under_jit():
  # `jax.jit` turns a Python float leaf into an array; eagerly it must be
  # unscaled and checked just the same.
  tx = ls.dynamic_loss_scale(optax.sgd(1.0), initial_scale=8.0)
  params = {"w": jnp.ones(2), "b": jnp.float32(1.0)}
  state = tx.init(params)
  grads = {"w": jnp.full(2, 8.0), "b": 8.0}
  for update in (tx.update, jax.jit(tx.update)):
    updates, new_state = update(grads, state, params)
    np.testing.assert_array_equal(updates["b"], -1.0)
    assert bool(new_state.last_finite)
    updates, new_state = update(dict(grads, b=NAN), state, params)
    assert int(new_state.skipped_steps) == 1
  for step in (ls.apply_gradients, jax.jit(ls.apply_gradients, static_argnums=0)):
    new_params, _ = step(tx, grads, state, params)
    np.testing.assert_array_equal(new_params["b"], 0.0)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_integer_parameter_with_a_none_gradient_is_kept(jit):
  # `value_and_grad` gives an integer parameter None; `optax.masked` passes it
  # through, as bare: the wrapper takes those gradients, and `apply_gradients`
  # keeps the parameter as it is.
  params = {"w": jnp.ones(2), "step": jnp.int32(3)}
  inner = optax.masked(optax.sgd(0.5), {"w": True, "step": False})
  tx = ls.dynamic_loss_scale(inner, initial_scale=4.0)
  state = tx.init(params)
  _, grads = ls.value_and_grad(lambda p: jnp.sum(p["w"] ** 2))(state, params)
  assert grads["step"] is None
  update = jax.jit(tx.update) if jit else tx.update
  fused = jax.jit(ls.apply_gradients, static_argnums=0) if jit else ls.apply_gradients
  updates, _ = update(grads, state, params)
  want, _ = inner.update({"w": jnp.full(2, 2.0), "step": None}, inner.init(params))
  assert updates["step"] is None
  np.testing.assert_array_equal(updates["w"], want["w"])
  new_params, _ = fused(tx, grads, state, params)
  assert int(new_params["step"]) == 3 and new_params["step"].dtype == jnp.int32
  np.testing.assert_array_equal(new_params["w"], params["w"] + want["w"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_integer_parameter_beside_a_none_parameter(jit):
  # Each alone worked; together the None parameter made the integer one's
  # None gradient look like a tree mismatch.
  params = {"c": jnp.ones(3), "n": jnp.int32(3), "z": None}
  inner = optax.masked(optax.adam(1e-2), {"c": True, "n": False, "z": None})
  tx = ls.dynamic_loss_scale(inner, initial_scale=4.0)
  state = tx.init(params)
  _, grads = ls.value_and_grad(lambda p: jnp.sum(p["c"] ** 2))(state, params)
  assert grads["n"] is None and grads["z"] is None
  update = jax.jit(tx.update) if jit else tx.update
  fused = jax.jit(ls.apply_gradients, static_argnums=0) if jit else ls.apply_gradients
  with standard_promotion():
    want, _ = inner.update(
      {"c": jnp.full(3, 2.0), "n": None, "z": None}, inner.init(params), params
    )
    updates, _ = update(grads, state, params)
    new_params, _ = fused(tx, grads, state, params)
  assert updates["n"] is None and updates["z"] is None
  # Adam jitted and eager round its last bit differently.
  np.testing.assert_allclose(updates["c"], want["c"], rtol=1e-6)
  assert int(new_params["n"]) == 3 and new_params["z"] is None
  np.testing.assert_allclose(new_params["c"], params["c"] + want["c"], rtol=1e-6)
  # A skipped step keeps everything.
  bad = {"c": jnp.array([1.0, INF, 1.0]), "n": None, "z": None}
  with standard_promotion():
    kept, skipped = fused(tx, bad, state, params)
  assert_trees_equal(kept, params)
  assert int(skipped.skipped_steps) == 1


def test_a_python_float_parameter_outside_jit_gets_an_error_that_names_it():
  # Under `jax.jit` a Python float parameter arrives as an array and is
  # differentiated; eagerly `value_and_grad` gives it None (array leaves only,
  # as equinox.filter_value_and_grad does): the step says so, naming it.
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  params = {"w": jnp.ones(2), "s": 2.0}
  state = tx.init(params)

  def step(params, state):
    _, g = ls.value_and_grad(lambda p: jnp.sum(p["w"] * p["s"]))(state, params)
    return tx.update(g, state, params)

  updates, _ = jax.jit(step)(params, state)
  np.testing.assert_allclose(updates["s"], -0.2)
  with pytest.raises(ValueError, match=r"at \['s'\] is a Python float \(2.0\).*jnp"):
    step(params, state)
  with pytest.raises(ValueError, match=r"at \['s'\] is a Python float"):
    ls.apply_gradients(tx, {"w": jnp.ones(2), "s": None}, state, params)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lookahead_with_one_leaf_refuses_a_broadcasting_gradient(jit):
  params = optax.LookaheadParams({"w": jnp.arange(3.0)}, {"w": jnp.arange(3.0)})
  inner = optax.lookahead(optax.adam(0.1), sync_period=2, slow_step_size=0.5)
  tx = ls.dynamic_loss_scale(inner, initial_scale=2.0)
  update = jax.jit(tx.update) if jit else tx.update
  with standard_promotion():
    with pytest.raises(ValueError, match=r"at \['w'\] has shape \(1,\)"):
      update({"w": jnp.array([2.0])}, tx.init(params), params)
    with pytest.raises(ValueError, match=r"at \['w'\] has shape \(1,\)"):
      ls.apply_gradients(tx, {"w": jnp.array([2.0])}, tx.init(params), params)


@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_leading_dimensions_for_an_optimizer_that_does_not_take_them(inner):
  # A leading dimension is taken for per-example gradients only where the
  # inner optimizer takes them (optax.contrib.dpsgd); adam would broadcast
  # it into its moments, sgd into the updates.
  params = {"w": jnp.ones(3)}
  tx = ls.dynamic_loss_scale(getattr(optax, inner)(0.1))
  state = tx.init(params)
  with standard_promotion():
    for grads in ({"w": jnp.ones((1, 3))}, {"w": jnp.ones((2, 3))}):
      with pytest.raises(ValueError, match=r"per-example gradients"):
        tx.update(grads, state, params)
      with pytest.raises(ValueError, match=r"per-example gradients"):
        jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(grads, state, params)
