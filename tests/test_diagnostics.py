"""Tests of the host-side diagnostics (lossscale/_diagnostics.py)."""

import re

import flax.training.train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls

INF, NAN = float("inf"), float("nan")
_BAD = {"w": jnp.array([NAN, 1.0], jnp.float32)}
_GOOD = {"w": jnp.array([1.0, 2.0], jnp.float32)}
_PARAMS = {"w": jnp.zeros(2, jnp.float32)}


def _run(tx, grads_sequence, params=_PARAMS):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads_sequence:
    _, state = update(g, state, params)
  return state


# ---------------------------------------------------------------------------
# check_not_stalled


def test_stalled_error_is_a_floating_point_error():
  assert issubclass(ls.LossScaleStalledError, FloatingPointError)


@pytest.mark.parametrize("limit", [1, 3, 7])
def test_raises_exactly_at_the_threshold(limit):
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**10)
  update = jax.jit(tx.update)
  state = tx.init(_PARAMS)
  for n in range(1, limit + 2):
    _, state = update(_BAD, state, _PARAMS)
    assert int(state.consecutive_skips) == n
    if n < limit:
      ls.check_not_stalled(state, max_consecutive_skips=limit)
    else:
      with pytest.raises(ls.LossScaleStalledError, match=f"last {n} optimizer steps"):
        ls.check_not_stalled(state, max_consecutive_skips=limit)


def test_a_finite_step_clears_the_stall():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
  state = _run(tx, [_BAD] * 5)
  with pytest.raises(ls.LossScaleStalledError):
    ls.check_not_stalled(state, max_consecutive_skips=5)
  state = _run(tx, [_BAD] * 5 + [_GOOD])
  ls.check_not_stalled(state, max_consecutive_skips=5)
  assert int(state.consecutive_skips) == 0
  assert int(state.skipped_steps) == 5


def test_default_threshold_is_100():
  tx = ls.skip_nonfinite(optax.sgd(0.1))
  state = tx.init(_PARAMS)
  ls.check_not_stalled(state._replace(consecutive_skips=jnp.int32(99)))
  with pytest.raises(ls.LossScaleStalledError, match="last 100 optimizer steps"):
    ls.check_not_stalled(state._replace(consecutive_skips=jnp.int32(100)))


def test_message_names_numbers_and_causes_at_the_floor():
  # 2**3 backs off to the floor 1.0 after three skips; two more stay there.
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=8.0)
  state = _run(tx, [_BAD, _GOOD, _BAD, _BAD, _BAD, _BAD])
  assert float(state.loss_scale) == 1.0
  with pytest.raises(ls.LossScaleStalledError) as info:
    ls.check_not_stalled(state, max_consecutive_skips=4)
  msg = str(info.value)
  assert "last 4 optimizer steps were all skipped" in msg
  assert "5 skipped steps in total" in msg
  assert "max_consecutive_skips=4" in msg
  assert "The loss scale is now 1;" in msg
  for cause in ["NaN or inf already in the parameters", "input data", "learning rate"]:
    assert cause in msg
  assert "lossscale.nonfinite_leaves" in msg


def test_message_uses_the_given_min_scale():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=64.0, min_scale=16.0)
  state = _run(tx, [_BAD] * 3)
  assert float(state.loss_scale) == 16.0
  with pytest.raises(ls.LossScaleStalledError) as info:
    ls.check_not_stalled(state, max_consecutive_skips=3)
  # The state does not record the floor: no floor is named unless given.
  assert "The loss scale is now 16;" in str(info.value)
  assert "min_scale=" not in str(info.value).split("Likely causes")[0]
  with pytest.raises(ls.LossScaleStalledError, match="16, at the min_scale=16"):
    ls.check_not_stalled(state, max_consecutive_skips=3, min_scale=16.0)


@pytest.mark.parametrize(
  "tx",
  [
    ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1.0, min_scale=0.5),
    ls.static_loss_scale(optax.sgd(0.1), 0.5),
    ls.skip_nonfinite(optax.sgd(0.1)),
  ],
  ids=["dynamic_floor_0.5", "static", "skip_nonfinite"],
)
def test_message_is_true_for_every_wrapper(tx):
  state = _run(tx, [_BAD] * 4)
  with pytest.raises(ls.LossScaleStalledError) as info:
    ls.check_not_stalled(state, max_consecutive_skips=4)
  facts = str(info.value).split("Likely causes")[0]
  scale = float(state.loss_scale)
  assert f"The loss scale is now {scale:g};" in facts
  # No made-up floor (such as the default 1.0) and no claim about its place.
  assert "min_scale=" not in facts and "above" not in facts and "pinned" not in facts


def test_scale_above_the_floor_is_reported():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0**20, hysteresis=4)
  state = _run(tx, [_BAD] * 5)  # backs off on the 4th and 5th skip only
  with pytest.raises(
    ls.LossScaleStalledError, match=re.escape("The loss scale is 262144, above")
  ):
    ls.check_not_stalled(state, max_consecutive_skips=5, min_scale=1.0)


def test_finds_the_state_in_chains_and_train_states():
  tx = optax.chain(
    optax.clip_by_global_norm(1.0), ls.static_loss_scale(optax.sgd(0.1), 4.0)
  )
  opt_state = tx.init(_PARAMS)
  update = jax.jit(tx.update)
  for _ in range(3):
    _, opt_state = update(_BAD, opt_state, _PARAMS)
  with pytest.raises(ls.LossScaleStalledError, match="last 3"):
    ls.check_not_stalled(opt_state, max_consecutive_skips=3)
  ts = flax.training.train_state.TrainState(
    step=0, apply_fn=None, params=_PARAMS, tx=tx, opt_state=opt_state
  )
  with pytest.raises(ls.LossScaleStalledError, match="last 3"):
    ls.check_not_stalled(ts, max_consecutive_skips=3)
  ls.check_not_stalled(ts, max_consecutive_skips=4)


def test_vmapped_ensemble_names_the_stalled_members():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  params = {"w": jnp.zeros((3, 2), jnp.float32)}
  state = jax.vmap(tx.init)(params)
  # Member 1 always overflows, members 0 and 2 never.
  grads = {"w": jnp.array([[1.0, 1.0], [INF, 1.0], [2.0, 2.0]], jnp.float32)}
  update = jax.jit(jax.vmap(tx.update))
  for _ in range(4):
    _, state = update(grads, state, params)
  np.testing.assert_array_equal(state.consecutive_skips, [0, 4, 0])
  with pytest.raises(ls.LossScaleStalledError, match=r"members \[\(1,\)\]"):
    ls.check_not_stalled(state, max_consecutive_skips=4)
  ls.check_not_stalled(state, max_consecutive_skips=5)


def test_pmap_replicated_state():
  n = jax.local_device_count()
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0, axis_name="batch")
  params = {"w": jnp.zeros((n, 2), jnp.float32)}
  state = jax.pmap(tx.init)(params)
  # Only replica 0 overflows; with axis_name every replica skips.
  grads = {"w": jnp.ones((n, 2), jnp.float32).at[0, 0].set(INF)}
  update = jax.pmap(tx.update, axis_name="batch")
  for _ in range(2):
    _, state = update(grads, state, params)
  np.testing.assert_array_equal(state.consecutive_skips, [2] * n)
  ls.check_not_stalled(state, max_consecutive_skips=3)
  pattern = r"last 2 .*members \[\(0,\), \(1,\)"
  with pytest.raises(ls.LossScaleStalledError, match=pattern):
    ls.check_not_stalled(state, max_consecutive_skips=2)


def test_inside_jit_is_a_clear_type_error():
  tx = ls.skip_nonfinite(optax.sgd(0.1))

  @jax.jit
  def f(state):
    ls.check_not_stalled(state)
    return state

  with pytest.raises(TypeError, match="outside the jitted step"):
    f(tx.init(_PARAMS))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, None, "10", 2**31])
def test_bad_threshold(bad):
  state = ls.skip_nonfinite(optax.sgd(0.1)).init(_PARAMS)
  with pytest.raises(ValueError, match=r"check_not_stalled\(max_consecutive_skips"):
    ls.check_not_stalled(state, max_consecutive_skips=bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, INF, NAN, "1", 1e-40, 1e39])
def test_bad_min_scale(bad):
  # The wrappers take normal float32 scales only: so does the check.
  state = ls.skip_nonfinite(optax.sgd(0.1)).init(_PARAMS)
  with pytest.raises(ValueError, match=r"check_not_stalled\(min_scale"):
    ls.check_not_stalled(state, min_scale=bad)


def test_without_a_loss_scale_state():
  with pytest.raises(ValueError, match=r"exactly one lossscale\.LossScaleState"):
    ls.check_not_stalled(optax.sgd(0.1).init(_PARAMS))


# ---------------------------------------------------------------------------
# nonfinite_leaves


def _reference_counts(tree):
  """Counts with NumPy in float64, keyed by path, for inexact leaves."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(leaf)
    if np.issubdtype(a.dtype, np.inexact) or a.dtype == jnp.bfloat16:
      n = int(np.sum(~np.isfinite(a.astype(np.complex128))))
      if n:
        out[jax.tree_util.keystr(path)] = n
  return out


def test_counts_match_numpy_on_a_random_tree():
  rng = np.random.default_rng(0)
  tree = {}
  for i, dtype in enumerate([np.float32, np.float16, jnp.bfloat16, np.complex64]):
    a = rng.standard_normal((5, 7)).astype(dtype)
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, size=i * 3, replace=False)
    flat[idx[:i]] = INF
    flat[idx[i : 2 * i]] = -INF
    flat[idx[2 * i :]] = NAN
    tree[f"l{i}"] = [jnp.asarray(a), {"k": jnp.asarray(a[:2])}]
  tree["ints"] = jnp.arange(4, dtype=jnp.int32)
  tree["bools"] = jnp.array([True, False])
  expected = _reference_counts(tree)
  assert expected  # the reference sees some
  assert ls.nonfinite_leaves(tree) == expected
  assert list(ls.nonfinite_leaves(tree)) == list(expected)  # tree order


def test_complex_parts_and_python_floats():
  tree = (
    jnp.array([complex(1.0, INF), complex(NAN, 0.0), 1.0 + 2.0j], jnp.complex64),
    NAN,
    1e300,  # a float64 Python scalar: finite, not cast to float32
    np.array([INF, 0.0]),
  )
  assert ls.nonfinite_leaves(tree) == {"[0]": 2, "[1]": 1, "[3]": 1}


def test_integer_float0_none_and_empty_leaves_are_ignored():
  params = {"w": jnp.ones(2), "n": jnp.array(3, jnp.int32)}
  grads = jax.grad(lambda p: jnp.sum(p["w"]), allow_int=True)(params)
  assert grads["n"].dtype == jax.dtypes.float0
  tree = {
    "g": grads,
    "none": None,
    "empty": jnp.zeros((0, 4)),
    "masked": optax.MaskedNode(),
  }
  assert ls.nonfinite_leaves(tree) == {}
  assert ls.nonfinite_leaves({}) == {}


def test_finds_nan_in_optimizer_state_and_pmap_sharded_arrays():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1, momentum=0.9))
  state = tx.init(_PARAMS)
  trace_state, *rest = state.inner_state
  bad = trace_state._replace(trace={"w": trace_state.trace["w"].at[1].set(NAN)})
  state = state._replace(inner_state=(bad, *rest))
  assert ls.nonfinite_leaves(state) == {".inner_state[0].trace['w']": 1}
  n = jax.local_device_count()
  sharded = jax.pmap(lambda x: x)(jnp.ones((n, 3)).at[n - 1, 2].set(INF))
  assert ls.nonfinite_leaves({"x": sharded}) == {"['x']": 1}


def test_nonfinite_leaves_inside_jit_is_a_clear_type_error():
  with pytest.raises(TypeError, match="outside the jitted step"):
    jax.jit(ls.nonfinite_leaves)({"w": jnp.ones(2)})


def _skipped(tx, n, params=None):
  params = {"w": jnp.zeros(2)} if params is None else params
  state = tx.init(params)
  for _ in range(n):
    _, state = jax.jit(tx.update)({"w": jnp.array([jnp.inf, 1.0])}, state, params)
  return state


def test_at_min_scale_raises_on_the_overflow_that_finds_the_scale_at_its_floor():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0, min_scale=1.0)
  state = _skipped(tx, 2)  # 4 -> 2 -> 1: reached the floor, no raise yet
  assert float(state.loss_scale) == 1.0 and int(state.overflows_at_min_scale) == 0
  ls.check_not_stalled(state, at_min_scale=True)
  state = _skipped(tx, 3)  # the third overflow found it at 1
  assert int(state.overflows_at_min_scale) == 1
  ls.check_not_stalled(state)  # off by default
  with pytest.raises(ls.LossScaleStalledError, match="already at its min_scale"):
    ls.check_not_stalled(state, at_min_scale=True)
  # With hysteresis the held-back overflows do not count.
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1.0, hysteresis=3)
  assert int(_skipped(tx, 2).overflows_at_min_scale) == 0
  assert int(_skipped(tx, 4).overflows_at_min_scale) == 2


def test_scale_at_most_raises_after_an_overflow_at_or_below_it():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1.0, min_scale=2.0**-20)
  ls.check_not_stalled(_skipped(tx, 3), scale_at_most=0.1)  # 0.125
  with pytest.raises(ls.LossScaleStalledError, match=r"scale_at_most=0\.125"):
    ls.check_not_stalled(_skipped(tx, 3), scale_at_most=0.125)
  # After a finite step it does not raise (fairseq checks on overflows).
  state = _skipped(tx, 4)
  params = {"w": jnp.zeros(2)}
  _, state = tx.update({"w": jnp.ones(2)}, state, params)
  ls.check_not_stalled(state, scale_at_most=0.125)


def test_batched_floor_triggers_raise_for_any_member():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=2.0)
  params = {"w": jnp.zeros((3, 2))}
  grads = {"w": jnp.ones((3, 2)).at[1, 0].set(jnp.inf)}
  state = jax.vmap(tx.init)(params)
  for _ in range(3):
    _, state = jax.jit(jax.vmap(tx.update))(grads, state, params)
  np.testing.assert_array_equal(state.overflows_at_min_scale, [0, 2, 0])
  with pytest.raises(ls.LossScaleStalledError):
    ls.check_not_stalled(state, at_min_scale=True)
  with pytest.raises(ls.LossScaleStalledError):
    ls.check_not_stalled(state, scale_at_most=1.0)


@pytest.mark.parametrize(
  "kwargs,name",
  [
    (dict(at_min_scale=1), "at_min_scale"),
    (dict(scale_at_most=0.0), "scale_at_most"),
    (dict(scale_at_most=float("nan")), "scale_at_most"),
    # Subnormal: every other scale setting must be a normal float32.
    (dict(scale_at_most=1e-45), "scale_at_most"),
    (dict(scale_at_most=1e-39), "scale_at_most"),
  ],
)
def test_floor_trigger_settings_are_checked(kwargs, name):
  state = ls.dynamic_loss_scale(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
  with pytest.raises(ValueError, match=rf"check_not_stalled\({name}="):
    ls.check_not_stalled(state, **kwargs)
