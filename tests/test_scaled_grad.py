"""Tests of get_loss_scale, scale_loss and value_and_grad (_scaled_grad.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale as ls
from _helpers import assert_trees_equal


def test_get_loss_scale_finds_the_state_anywhere():
  inner = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=64.0)
  tx = optax.chain(optax.clip(1.0), optax.masked(inner, {"w": True}))
  state = tx.init({"w": jnp.ones(2)})
  scale = ls.get_loss_scale(state)
  assert scale.dtype == jnp.float32 and scale.shape == ()
  assert float(scale) == 64.0


def test_get_loss_scale_under_jit():
  tx = ls.static_loss_scale(optax.sgd(0.1), 5.0)
  state = tx.init(jnp.ones(2))
  assert float(jax.jit(ls.get_loss_scale)(state)) == 5.0


def test_get_loss_scale_errors():
  with pytest.raises(ValueError, match="found none"):
    ls.get_loss_scale(optax.adam(1e-3).init(jnp.ones(2)))
  both = optax.chain(
    ls.skip_nonfinite(optax.sgd(1.0)), ls.skip_nonfinite(optax.sgd(1.0))
  )
  with pytest.raises(ValueError, match="found 2"):
    ls.get_loss_scale(both.init(jnp.ones(2)))


def test_scale_loss_is_float32_and_does_not_overflow_float16():
  loss = jnp.float16(60000.0)
  tx = ls.dynamic_loss_scale(optax.sgd(0.1))
  scaled = ls.scale_loss(loss, tx.init(jnp.ones(1)))
  assert scaled.dtype == jnp.float32
  assert float(scaled) == 60000.0 * 2.0**15
  assert float(ls.scale_loss(jnp.float32(3.0), 4.0)) == 12.0


def test_value_and_grad_scales_gradients_and_returns_unscaled_loss():
  def loss_fn(w, x):
    return jnp.sum((w * x) ** 2), {"n": x.shape[0]}

  w, x = jnp.array([1.0, -2.0]), jnp.array([3.0, 0.5])
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0)
  state = tx.init(w)
  grad_fn = jax.jit(ls.value_and_grad(loss_fn, has_aux=True))
  (loss, aux), grads = grad_fn(state, w, x)
  (ref_loss, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(w, x)
  assert float(loss) == float(ref_loss)
  assert aux == {"n": 2}
  np.testing.assert_allclose(grads, ref_grads * 1024.0)
  # The wrapper divides the scale back out.
  updates, _ = tx.update(grads, state, w)
  np.testing.assert_allclose(updates, -0.1 * ref_grads, rtol=1e-6)


def test_value_and_grad_argnums_tuple():
  f = lambda a, b: jnp.sum(a * b)
  loss, (ga, gb) = ls.value_and_grad(f, argnums=(0, 1))(
    2.0, jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
  )
  assert float(loss) == 11.0
  np.testing.assert_allclose(ga, [6.0, 8.0])
  np.testing.assert_allclose(gb, [2.0, 4.0])


def test_scaling_rescues_float16_gradients_from_underflow():
  w32 = jnp.array([0.5, 0.25], jnp.float32)

  def loss_fn(w, x):  # float16 compute; d loss / d w = 2**-10 * x
    return jnp.float16(2.0**-10) * jnp.sum(w.astype(jnp.float16) * x)

  x = jnp.array([2.0**-20, 3 * 2.0**-21], jnp.float16)
  exact = np.float32(2.0**-10) * np.asarray(x, np.float32)  # ~2**-30
  _, g_plain = jax.value_and_grad(loss_fn)(w32, x)
  np.testing.assert_array_equal(g_plain, [0.0, 0.0])  # flushed to zero
  _, g_scaled = ls.value_and_grad(loss_fn)(2.0**15, w32, x)
  assert g_scaled.dtype == jnp.float32
  np.testing.assert_array_equal(g_scaled / np.float32(2.0**15), exact)


# value_and_grad against jax.value_and_grad of the unscaled loss times the scale.


def _loss4(a, b, c, d, *, bias):
  """A loss of four positional pytree arguments and one keyword argument."""
  d32 = d.astype(jnp.float32)  # a float16 argument
  return (
    jnp.sum(jnp.sin(a) * 2.0)
    + jnp.sum(b["u"] ** 2) * b["v"]
    + jnp.sum(c[0] * c[1])
    + jnp.sum(d32**3)
    + jnp.sum(bias * a)
  )


def _args4():
  a = jnp.array([0.5, -1.5])
  b = {"u": jnp.array([1.0, 2.0, -3.0]), "v": jnp.float32(0.25)}
  c = (jnp.array([[1.0], [2.0]]), jnp.array([[-0.5], [4.0]]))
  d = jnp.array([0.5, 1.25], jnp.float16)
  return (a, b, c, d), {"bias": jnp.array([3.0, 5.0])}


def _reference(fun, argnums, has_aux, scale):
  """jax.value_and_grad of the loss times the scale, returning the plain loss."""

  def scaled(*args, **kwargs):
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return loss.astype(jnp.float32) * jnp.float32(scale), (loss, aux)

  def grad_fn(*args, **kwargs):
    (_, (loss, aux)), grads = jax.value_and_grad(scaled, argnums, has_aux=True)(
      *args, **kwargs
    )
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return grad_fn


@st.composite
def _argnums(draw, n=4):
  if draw(st.booleans()):
    return draw(st.integers(-n, n - 1))
  positions = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
  nums = [p - n if draw(st.booleans()) else p for p in positions]
  return nums if draw(st.booleans()) else tuple(nums)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
  argnums=_argnums(),
  has_aux=st.booleans(),
  scale=st.sampled_from([1.0, 2.0**-3, 3.0, 1000.5, 2.0**15]),
)
def test_value_and_grad_matches_jax_for_any_argnums(argnums, has_aux, scale):
  fun = (lambda *a, **k: (_loss4(*a, **k), {"n": 2})) if has_aux else _loss4
  args, kwargs = _args4()
  out = ls.value_and_grad(fun, argnums, has_aux=has_aux)(scale, *args, **kwargs)
  ref = _reference(fun, argnums, has_aux, scale)(*args, **kwargs)
  assert_trees_equal(out, ref)


def test_negative_argnums_never_differentiate_the_scale_source():
  # The bug this guards against: -1 was shifted to 0, the scale source.
  f = lambda w, x: jnp.sum(w * x)
  w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, -4.0])
  loss, g = ls.value_and_grad(f, argnums=-1)(4.0, w, x)
  np.testing.assert_array_equal(g, 4.0 * w)
  _, (gw, gx) = ls.value_and_grad(f, argnums=(-2, -1))(4.0, w, x)
  np.testing.assert_array_equal(gw, 4.0 * x)
  np.testing.assert_array_equal(gx, 4.0 * w)
  assert float(loss) == -5.0


def test_value_and_grad_under_jit_with_negative_argnums():
  args, kwargs = _args4()
  grad_fn = jax.jit(ls.value_and_grad(_loss4, argnums=(-1, 0)))
  ref = _reference(_loss4, (3, 0), False, 2.0**15)(*args, **kwargs)
  assert_trees_equal(grad_fn(2.0**15, *args, **kwargs), ref)


@pytest.mark.parametrize("argnums", [4, (0, 4), (-1, 9), -5, (0, -5)])
def test_out_of_range_argnums_raise_the_error_type_jax_raises(argnums):
  args, kwargs = _args4()
  with pytest.raises((TypeError, ValueError)) as jax_error:
    jax.value_and_grad(_loss4, argnums)(*args, **kwargs)
  grad_fn = ls.value_and_grad(_loss4, argnums)
  with pytest.raises(
    type(jax_error.value),
    match=r"argnums=.*got 4 positional arguments after the scale source",
  ):
    grad_fn(1.0, *args, **kwargs)


@pytest.mark.parametrize("argnums", [(0, 0), [2, 2], (1, -3), (-1, 3)])
def test_repeated_argnums_raise_a_clear_error(argnums):
  args, kwargs = _args4()
  # jax.value_and_grad does not support them either: it passes None for one of
  # the two, so the error comes from inside the function, of varying type.
  with pytest.raises(ValueError, match=r"argnums=.*(twice|repeats)"):
    ls.value_and_grad(_loss4, argnums)(1.0, *args, **kwargs)


@pytest.mark.parametrize("argnums", [1.0, "a", None, [0, 1.5]])
def test_argnums_of_the_wrong_type_raise_type_error_as_jax(argnums):
  with pytest.raises(TypeError):
    jax.value_and_grad(_loss4, argnums)
  with pytest.raises(TypeError, match=r"argnums=\.\.\.\)` must be an int"):
    ls.value_and_grad(_loss4, argnums)


def test_empty_argnums_is_rejected():
  with pytest.raises(ValueError, match="at least one"):
    ls.value_and_grad(_loss4, ())


def test_a_loss_that_is_not_real_floating_or_a_missing_aux_is_a_type_error():
  w = jnp.array([1.0, 2.0])
  int_loss = lambda w: jnp.sum(w).astype(jnp.int32)
  with pytest.raises(TypeError):
    jax.value_and_grad(int_loss)(w)
  with pytest.raises(TypeError, match="real floating loss"):
    ls.value_and_grad(int_loss)(1.0, w)
  # The message says what came back, not the tracer's class.
  with pytest.raises(TypeError, match=r"pair \(loss, aux\), got a float32\[\] array"):
    ls.value_and_grad(lambda w: jnp.sum(w), has_aux=True)(1.0, w)
  with pytest.raises(TypeError, match=r"got a tuple of 3"):
    ls.value_and_grad(lambda w: (jnp.sum(w), 1, 2), has_aux=True)(1.0, w)


def test_leaves_that_are_not_floating_arrays_get_none():
  def f(p, k):
    h = jnp.sum(p["w"] * p["np"]) + p["f16"].astype(jnp.float32)[0]
    return p["act"](h) * p["gain"] + p["n"].astype(jnp.float32) + k

  p = {
    "w": jnp.array([1.0, -2.0]),
    "np": np.array([0.5, 3.0], np.float32),  # NumPy arrays are differentiated
    "f16": jnp.array([2.0], jnp.float16),
    "n": jnp.array(3, jnp.int32),
    "flag": jnp.array(True),
    "gain": 1.5,  # a Python float is not an array: None, as in Equinox
    "act": jnp.tanh,
    "none": None,
  }
  loss, g = ls.value_and_grad(f)(8.0, p, 0.25)
  # Reference: jax.value_and_grad of the array leaves, the rest held fixed.
  arrays = {k: p[k] for k in ("w", "np", "f16")}
  ref_loss, ref = _reference(lambda a: f({**p, **a}, 0.25), 0, False, 8.0)(arrays)
  assert_trees_equal(loss, ref_loss)
  assert_trees_equal({k: g[k] for k in arrays}, ref)
  assert jax.tree.structure(g, is_leaf=lambda x: x is None) == jax.tree.structure(
    p, is_leaf=lambda x: x is None
  )
  for k in ("n", "flag", "gain", "act", "none"):
    assert g[k] is None, k
  # A whole argument with nothing to differentiate: None, not an error.
  _, gk = ls.value_and_grad(f, argnums=1)(8.0, p, 0.25)
  assert gk is None
  _, gk = ls.value_and_grad(f, argnums=1)(8.0, p, jnp.float32(0.25))
  np.testing.assert_array_equal(gk, jnp.float32(8.0))
