"""Tests for swallowed_updates: the updates a parameter's dtype rounds away.

Two references, both independent of `lossscale`: NumPy with ml_dtypes
rounding `p + u` as optax.apply_updates computes it, and the spacing of the
dtype's numbers around `p` (float64 arithmetic: an update is lost when the
float32 sum lies within half a gap of `p`, a tie going to the even one).
Data avoid float32 subnormals, which XLA's CPU flushes to zero and NumPy
does not.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import standard_promotion
from lossscale import _rounding

BF16 = ml_dtypes.bfloat16


def _numpy_reference(p, u):
  """`(swallowed, moving)` boolean masks, from NumPy (ml_dtypes) rounding."""
  p, u = np.asarray(p), np.asarray(u)
  with standard_promotion():  # JAX's default, under which optax adds
    wide = np.dtype(jnp.promote_types(p.dtype, u.dtype))
  new = (p.astype(wide) + u.astype(wide)).astype(p.dtype)
  moving = (u != 0) & np.isfinite(u) & np.isfinite(p)
  return moving & (new == p), moving  # `==`: -0.0 equals 0.0


def _lost_by_spacing(p, s, nmant):
  """Whether `s` (a float) rounds to the normal, finite, nonzero `p` in a
  format with `nmant` fraction bits, by the gaps between its numbers."""
  frac, exp = math.frexp(abs(p))  # |p| = frac * 2**exp, 0.5 <= frac < 1
  ulp = 2.0 ** (exp - 1 - nmant)
  d = s - p  # exact in float64 for the float32 values used here
  toward_zero = d != 0 and (d > 0) != (p > 0)
  gap = ulp / 2 if toward_zero and frac == 0.5 else ulp
  odd = int(abs(p) / ulp) % 2 == 1
  return abs(d) < gap / 2 or (abs(d) == gap / 2 and not odd)


def _spacing_reference(p, u):
  """`(swallowed, moving)` from the spacing of `p`'s dtype around each `p`;
  `p + u` added in float32, as optax adds a narrower parameter to a float32
  update (no ml_dtypes rounding)."""
  nmant = {np.dtype(BF16): 7, np.dtype(np.float16): 10, np.dtype(np.float32): 23}
  bits = nmant[np.dtype(np.asarray(p).dtype)]
  p64 = np.asarray(p).astype(np.float64).ravel()
  u32 = np.asarray(u).astype(np.float32).ravel()
  moving = (u32 != 0) & np.isfinite(u32) & np.isfinite(p64)
  sums = p64.astype(np.float32) + u32
  lost = [
    bool(m) and _lost_by_spacing(float(pi), float(si), bits)
    for pi, si, m in zip(p64, sums, moving, strict=True)
  ]
  return np.array(lost), moving


def _fraction(swallowed, moving):
  return swallowed.sum() / moving.sum() if moving.any() else 0.0


def _params_and_updates(dtype, log2_rel, size=2000, seed=0):
  """Normal parameters across many binades, updates `2**log2_rel` relative
  (uniform in that range) with random signs, some zeros, and ties."""
  rng = np.random.RandomState(seed)
  lo, hi = {np.dtype(np.float16): (-8, 8)}.get(np.dtype(dtype), (-30, 30))
  p = rng.choice([-1.0, 1.0], size) * 2.0 ** rng.uniform(lo, hi, size)
  p = p.astype(dtype)
  u = p.astype(np.float64) * rng.choice([-1.0, 1.0], size)
  u = (u * 2.0 ** rng.uniform(*log2_rel, size)).astype(np.float32)
  u[::50] = 0.0
  nmant = {np.dtype(BF16): 7, np.dtype(np.float16): 10}.get(np.dtype(dtype), 23)
  # Exact ties: half the gap above each of these parameters.
  half_gap = 2.0 ** (np.floor(np.log2(np.abs(p[1::97].astype(np.float64)))) - nmant - 1)
  u[1::97] = np.sign(p[1::97].astype(np.float64)) * half_gap
  return p, u


@pytest.mark.parametrize(
  ("dtype", "log2_rel"),
  [(BF16, (-11, -6)), (np.float16, (-14, -9)), (np.float32, (-27, -22))],
  ids=["bfloat16", "float16", "float32"],
)
def test_matches_both_references_across_the_rounding_edge(dtype, log2_rel):
  p, u = _params_and_updates(dtype, log2_rel)
  ref, moving = _numpy_reference(p, u)
  spacing, moving2 = _spacing_reference(p, u)
  np.testing.assert_array_equal(ref, spacing)
  np.testing.assert_array_equal(moving, moving2)
  expected = _fraction(ref, moving)
  assert 0.2 < expected < 0.8  # the data straddle the edge
  report = ls.swallowed_updates(jnp.asarray(p), jnp.asarray(u))
  assert report.fraction.dtype == jnp.float32 and report.fraction.shape == ()
  np.testing.assert_allclose(report.fraction, expected, rtol=1e-6)
  np.testing.assert_allclose(report.per_leaf, expected, rtol=1e-6)
  # And as optax.apply_updates moves them (by value: -0.0 == 0.0).
  with standard_promotion():
    applied = np.asarray(optax.apply_updates(jnp.asarray(p), jnp.asarray(u)))
  np.testing.assert_array_equal(moving & (applied == p), ref)


@pytest.mark.parametrize("u_dtype", [np.float32, BF16], ids=["f32", "bf16"])
def test_bfloat16_updates_below_2_to_the_minus_9_relative_are_all_swallowed(u_dtype):
  p, u = _params_and_updates(BF16, (-14, math.log2(0.99) - 9))
  u[1::97] *= 0.25  # no ties here: all strictly below
  u = u.astype(u_dtype)
  assert (np.abs(u.astype(np.float64)) < 2.0**-9 * np.abs(p.astype(np.float64))).all()
  report = jax.jit(ls.swallowed_updates)(jnp.asarray(p), jnp.asarray(u))
  np.testing.assert_array_equal(report.fraction, 1.0)
  # Above 2**-8 |p| (the largest half gap, at powers of two), none is.
  big = (p.astype(np.float64) * -(2.0**-7.9)).astype(np.float32)
  report = jax.jit(ls.swallowed_updates)(jnp.asarray(p), jnp.asarray(big))
  np.testing.assert_array_equal(report.fraction, 0.0)


def test_float32_parameters_keep_ordinary_updates():
  rng = np.random.RandomState(1)
  p = rng.normal(size=(64, 64)).astype(np.float32)
  u = (-1e-3 * rng.normal(size=(64, 64))).astype(np.float32)  # lr 1e-3
  report = ls.swallowed_updates({"w": jnp.asarray(p)}, {"w": jnp.asarray(u)})
  ref, moving = _numpy_reference(p, u)
  np.testing.assert_allclose(report.fraction, _fraction(ref, moving), rtol=1e-6)
  assert float(report.fraction) < 1e-3
  # The same updates on the same values in bfloat16 lose some.
  pb = p.astype(BF16)
  lossy = ls.swallowed_updates({"w": jnp.asarray(pb)}, {"w": jnp.asarray(u)})
  ref, moving = _numpy_reference(pb, u)
  np.testing.assert_allclose(lossy.fraction, _fraction(ref, moving), rtol=1e-6)
  assert float(lossy.fraction) > 0.1


def test_hand_computed_cases_ties_zeros_and_non_finite_values():
  b = 2.0**-8
  p = jnp.array(
    [1.0, 1.0, 1.0, 1.0 + 2**-7, 1.0, 0.0, np.nan, np.inf, 1.0, 1.0],
    jnp.bfloat16,
  )
  u = jnp.array(
    [b, b * (1 + 2**-10), -b / 2, b, 0.0, 1e-30, 1.0, 1.0, np.nan, -np.inf],
    jnp.float32,
  )
  # Counted (moving): 0, 1, 2, 3, 5; swallowed: 0 (tie, 1 is even) and 2
  # (the tie below a power of two, where the gap is half); 1e-30 is a
  # normal bfloat16, so 0 moves to it.
  report = ls.swallowed_updates(p, u)
  np.testing.assert_array_equal(report.fraction, np.float32(2 / 5))
  ref, moving = _numpy_reference(p, u)
  np.testing.assert_array_equal(moving, [1, 1, 1, 1, 0, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(ref, [1, 0, 1, 0, 0, 0, 0, 0, 0, 0])


def test_a_zero_parameter_turned_into_minus_zero_has_not_moved():
  # float16's smallest subnormal is 2**-24: -1e-9 rounds to -0.0.
  p, u = jnp.zeros(2, jnp.float16), jnp.array([-1e-9, 1e-3], jnp.float32)
  with standard_promotion():
    new = optax.apply_updates(p, u)
  assert bool(jnp.signbit(new[0])) and float(new[0]) == 0.0  # new bits, same value
  np.testing.assert_array_equal(ls.swallowed_updates(p, u).fraction, 0.5)
  np.testing.assert_array_equal(
    ls.swallowed_updates(-p, -u).fraction, 0.5
  )  # -0.0 to +0.0 alike


def test_counts_what_apply_updates_does_not_the_exact_sum():
  # 1 + 2**-8 + 2**-31 lies just above the tie between the bfloat16 numbers
  # 1 and 1 + 2**-7, so rounding the exact sum moves the parameter; optax
  # adds in float32 first, which rounds 2**-31 away, and then the tie goes
  # to 1. What counts is what apply_updates does.
  p = jnp.ones(1, jnp.bfloat16)
  u = jnp.array([2.0**-8 + 2.0**-31], jnp.float32)
  assert float(u[0]) != 2.0**-8
  with standard_promotion():
    assert float(optax.apply_updates(p, u)[0]) == 1.0
  np.testing.assert_array_equal(ls.swallowed_updates(p, u).fraction, 1.0)


def _mixed_tree():
  rng = np.random.RandomState(2)
  w = rng.normal(size=(8, 4)).astype(np.float32)
  params = {
    "bf16": jnp.asarray(w, jnp.bfloat16),
    "f16": jnp.asarray(w[0], jnp.float16),
    "f32": jnp.asarray(w[1] * 2.0**20),
    "ids": jnp.arange(3, dtype=jnp.int32),
    "step": jnp.int32(7),
    "py": 1.5,
    "none": None,
    "layers": [jnp.asarray(w[2], jnp.bfloat16), jnp.asarray(w[3], jnp.float32)],
  }
  g = rng.normal(size=(8, 4)).astype(np.float32) * 1e-3
  updates = {
    "bf16": jnp.asarray(g),  # a float32 update on a bfloat16 parameter
    "f16": jnp.asarray(g[0] * 1e-1, jnp.float16),
    "f32": jnp.asarray(g[1] * 1e-1),
    "ids": None,  # what lossscale.value_and_grad gives integer parameters
    "step": np.zeros((), jax.dtypes.float0),  # what jax.grad(allow_int) gives
    "py": 0.1,
    "none": None,
    "layers": [jnp.asarray(g[2], jnp.bfloat16), jnp.zeros(4)],
  }
  return params, updates


def test_a_mixed_tree_per_leaf_and_in_total():
  params, updates = _mixed_tree()
  report = ls.swallowed_updates(params, updates)
  assert jax.tree.structure(report.per_leaf) == jax.tree.structure(params)
  assert report.per_leaf["none"] is None
  for name in ("ids", "step", "py"):
    np.testing.assert_array_equal(report.per_leaf[name], 0.0)
  np.testing.assert_array_equal(report.per_leaf["layers"][1], 0.0)  # zero updates
  pairs = [
    (params["bf16"], updates["bf16"], report.per_leaf["bf16"]),
    (params["f16"], updates["f16"], report.per_leaf["f16"]),
    (params["f32"], updates["f32"], report.per_leaf["f32"]),
    (params["layers"][0], updates["layers"][0], report.per_leaf["layers"][0]),
    (params["layers"][1], updates["layers"][1], report.per_leaf["layers"][1]),
  ]
  lost, counted = 0, 0
  for p, u, got in pairs:
    assert got.dtype == jnp.float32 and got.shape == ()
    ref, moving = _numpy_reference(p, u)
    np.testing.assert_allclose(got, _fraction(ref, moving), rtol=1e-6)
    lost, counted = lost + ref.sum(), counted + moving.sum()
  assert 0 < lost < counted
  np.testing.assert_allclose(report.fraction, lost / counted, rtol=1e-6)


def test_eager_jit_and_vmap_agree():
  params, updates = _mixed_tree()
  del params["py"], updates["py"]  # jit would make the Python float an array
  eager = ls.swallowed_updates(params, updates)
  jitted = jax.jit(ls.swallowed_updates)(params, updates)
  jax.tree.map(np.testing.assert_array_equal, jitted, eager)
  # vmap over an ensemble of three: member k's updates are scaled by 10**k.
  floats = ["bf16", "f16", "f32", "layers"]
  stack = lambda *xs: jnp.stack(xs)
  members = [
    {k: jax.tree.map(lambda u, m=m: u * (10.0**m), updates[k]) for k in floats}
    for m in range(3)
  ]
  batched_p = {k: jax.tree.map(lambda p: jnp.stack([p] * 3), params[k]) for k in floats}
  batched_u = jax.tree.map(stack, *members)
  out = jax.jit(jax.vmap(ls.swallowed_updates))(batched_p, batched_u)
  assert out.fraction.shape == (3,)
  for i, member in enumerate(members):
    one = ls.swallowed_updates({k: params[k] for k in floats}, member)
    got = jax.tree.map(lambda x, i=i: x[i], out)
    jax.tree.map(np.testing.assert_array_equal, got, one)
  assert len(set(np.asarray(out.fraction).tolist())) == 3  # they differ


def test_a_bfloat16_norm_scale_freezes_under_adamw_while_the_weights_train():
  # A LayerNorm-like scale (values ~1) and a layer's weights (~0.01), both
  # bfloat16 without a float32 copy, AdamW at lr 1e-4: each update is about
  # 1e-4, far below half a bfloat16 step at 1.0 (2**-8 = 0.0039) and above
  # it at 0.01 (2**-15 = 3e-5).
  i, j = np.arange(32)[:, None], np.arange(4)
  x = jnp.asarray(np.sin(0.7 * (j + 1) * i + j), jnp.bfloat16)
  y = jnp.asarray(x @ jnp.array([[0.5], [-0.25], [0.125], [1.0]], jnp.bfloat16))
  params = {
    "scale": jnp.ones(4, jnp.bfloat16),
    "w": jnp.full((4, 1), 0.01, jnp.bfloat16),
  }
  tx = optax.adamw(1e-4)

  def loss_fn(params):
    pred = (x * params["scale"]) @ params["w"]
    return jnp.mean((pred - y).astype(jnp.float32) ** 2)

  @jax.jit
  def step(params, opt_state):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, updates

  with standard_promotion():  # optax's adam needs it
    opt_state = tx.init(params)
    w0 = params["w"]
    for _ in range(20):
      before = params
      params, opt_state, updates = step(params, opt_state)
      report = ls.swallowed_updates(before, updates)
      for name in ("scale", "w"):
        ref, moving = _numpy_reference(before[name], updates[name])
        assert moving.all()
        np.testing.assert_allclose(report.per_leaf[name], _fraction(ref, moving))
      np.testing.assert_array_equal(report.per_leaf["scale"], 1.0)
      np.testing.assert_array_equal(report.per_leaf["w"], 0.0)
      np.testing.assert_array_equal(report.fraction, 0.5)
  np.testing.assert_array_equal(params["scale"], np.ones(4, BF16))  # frozen
  assert (np.abs(np.asarray(params["w"] - w0, np.float32)) > 1e-3).all()  # trained


def test_zero_updates_and_a_skipped_step_give_zero_not_nan():
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.zeros(0, jnp.bfloat16)}
  zeros = jax.tree.map(jnp.zeros_like, params)
  report = jax.jit(ls.swallowed_updates)(params, zeros)
  jax.tree.map(
    np.testing.assert_array_equal,
    report,
    ls.SwallowedUpdates(0.0, {"w": 0.0, "b": 0.0}),
  )
  tx = ls.skip_nonfinite(optax.adamw(1e-4))
  with standard_promotion():
    grads = {"w": jnp.array([1.0, jnp.inf, 1.0], jnp.bfloat16), "b": params["b"]}
    updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_array_equal(ls.swallowed_updates(params, updates).fraction, 0.0)
  nothing = ls.swallowed_updates(
    {"n": jnp.arange(3), "none": None}, {"n": None, "none": None}
  )
  assert nothing.fraction.dtype == jnp.float32 and float(nothing.fraction) == 0.0


def test_large_leaves_are_counted_in_chunks(monkeypatch):
  p, u = _params_and_updates(BF16, (-11, -6), size=1003)
  exact = ls.swallowed_updates(jnp.asarray(p), jnp.asarray(u))
  monkeypatch.setattr(_rounding, "_EXACT_BELOW", 10)
  monkeypatch.setattr(_rounding, "_CHUNK", 64)  # 1003 = 15 * 64 + 43
  chunked = ls.swallowed_updates(jnp.asarray(p), jnp.asarray(u))
  ref, moving = _numpy_reference(p, u)
  np.testing.assert_allclose(chunked.fraction, _fraction(ref, moving), rtol=1e-6)
  np.testing.assert_array_equal(chunked.fraction, exact.fraction)


def test_trees_that_differ_are_refused_naming_both():
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(
    ValueError, match=r"`swallowed_updates\(updates=...\)` must have the tree"
  ) as info:
    ls.swallowed_updates(params, {"w": jnp.ones(3)})
  assert "params:  PyTreeDef({'b': *, 'w': *})" in str(info.value)
  assert "updates: PyTreeDef({'w': *})" in str(info.value)


def test_a_per_example_leading_axis_is_refused():
  params = {"w": jnp.ones((3, 2), jnp.bfloat16)}
  with pytest.raises(
    ValueError,
    match=r"`swallowed_updates\(updates=...\)` must have the shapes of `params`, got"
    r" shape \(8, 3, 2\) at \['w'\] instead, where `params` has shape \(3, 2\)",
  ):
    ls.swallowed_updates(params, {"w": jnp.ones((8, 3, 2))})
  with pytest.raises(ValueError, match=r"at the root instead"):
    ls.swallowed_updates(jnp.ones(3), jnp.ones(1))  # no broadcasting either
