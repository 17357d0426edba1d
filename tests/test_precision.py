"""Tests for the mixed-precision helpers and float16_range_report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale as ls


def test_cast_floating_casts_only_floating_array_leaves():
  tree = {
    "w": jnp.ones((2, 3), jnp.float32),
    "h": jnp.ones(2, jnp.bfloat16),
    "ids": jnp.arange(3, dtype=jnp.int32),
    "mask": jnp.array([True, False]),
    "c": jnp.ones(2, jnp.complex64),
    "py": 1.5,
    "none": None,
  }
  out = jax.jit(ls.cast_floating, static_argnums=1)(tree, jnp.float16)
  assert out["w"].dtype == jnp.float16 and out["w"].shape == (2, 3)
  assert out["h"].dtype == jnp.float16
  assert out["ids"].dtype == jnp.int32
  np.testing.assert_array_equal(out["ids"], [0, 1, 2])
  assert out["mask"].dtype == jnp.bool_
  assert out["c"].dtype == jnp.complex64
  assert out["none"] is None
  back = ls.cast_floating(out, jnp.float32)
  assert back["w"].dtype == jnp.float32 and back["h"].dtype == jnp.float32


def test_cast_floating_rounds_like_float16_and_keeps_gradients_float32():
  x = jnp.array([2049.0, 1e-8, 1e5], jnp.float32)
  with np.errstate(over="ignore"):
    expected = np.array([2049.0, 1e-8, 1e5]).astype(np.float16)
  np.testing.assert_array_equal(ls.cast_floating(x, jnp.float16), expected)

  @jax.jit
  def f(w):
    return jnp.sum(ls.cast_floating(w, jnp.float16) * jnp.float16(3.0)).astype(
      jnp.float32
    )

  g = jax.grad(f)(jnp.ones(4, jnp.float32))
  assert g.dtype == jnp.float32
  np.testing.assert_array_equal(g, np.full(4, 3.0, np.float32))


# Dtype arguments that are not floating dtypes, and how an error names them.
_NOT_FLOATING = [
  (None, "None"),
  (jnp.int32, "int32"),
  ("int8", "int8"),
  (bool, "bool"),
  (jnp.bool_, "bool"),
  (jnp.complex64, "complex64"),
  ("not-a-dtype", "'not-a-dtype'"),
]


@pytest.mark.parametrize(("bad", "shown"), _NOT_FLOATING)
def test_cast_floating_rejects_non_floating_dtypes(bad, shown):
  # `None` is no floating dtype either: NumPy would read it as float64, which
  # JAX (without x64) would have made float32, silently.
  with pytest.raises(
    ValueError, match=r"`cast_floating\(dtype=...\)` must be a floating dtype, got "
  ) as info:
    ls.cast_floating({"w": jnp.ones(2, jnp.float16)}, bad)
  assert str(info.value).endswith(f"got {shown}.")


def test_with_compute_dtype_runs_in_compute_dtype_and_returns_output_dtype():
  seen = {}

  def apply(params, x, ids):
    seen["dtypes"] = (params["w"].dtype, x.dtype, ids.dtype)
    return {"y": params["w"] * x, "ids": ids}

  f = jax.jit(ls.with_compute_dtype(apply, jnp.bfloat16))
  out = f({"w": jnp.full(3, 1.0 + 2.0**-10)}, jnp.ones(3), jnp.arange(3))
  assert seen["dtypes"] == (jnp.bfloat16, jnp.bfloat16, jnp.int32)
  assert out["y"].dtype == jnp.float32 and out["ids"].dtype == jnp.int32
  # 1 + 2**-10 is not a bfloat16 (8 significand bits): it rounds to 1.
  np.testing.assert_array_equal(out["y"], np.ones(3, np.float32))
  g = ls.with_compute_dtype(lambda a: a, jnp.float16, output_dtype=jnp.float16)
  assert g(jnp.ones(2)).dtype == jnp.float16


@pytest.mark.parametrize(("bad", "shown"), _NOT_FLOATING)
def test_with_compute_dtype_rejects_bad_dtypes(bad, shown):
  with pytest.raises(
    ValueError, match=r"with_compute_dtype\(compute_dtype=...\)` must be a floating"
  ) as info:
    ls.with_compute_dtype(lambda x: x, bad)
  assert str(info.value).endswith(f"got {shown}.")
  with pytest.raises(
    ValueError, match=r"with_compute_dtype\(output_dtype=...\)` must be a floating"
  ) as info:
    ls.with_compute_dtype(lambda x: x, jnp.float16, output_dtype=bad)
  assert str(info.value).endswith(f"got {shown}.")


def _numpy_reference(x):
  """Fractions lost to zero / inf when numpy rounds to float16 (independent)."""
  x = np.asarray(x, np.float64)
  with np.errstate(over="ignore"):
    h = x.astype(np.float16)
  under = np.logical_and(x != 0, h == 0)
  over = np.logical_and(np.isinf(h), ~np.isnan(x))
  sub = np.logical_and(h != 0, np.abs(h) < np.finfo(np.float16).smallest_normal)
  return under, over, sub


def test_float16_range_report_matches_numpy_rounding():
  rng = np.random.default_rng(0)
  a = np.sign(rng.normal(size=1000)) * 2.0 ** rng.uniform(-40, 20, size=1000)
  edges = np.array(
    [
      2.0**-25,  # tie between 0 and 2**-24: rounds to even, 0
      np.nextafter(np.float32(2.0**-25), np.float32(1)),  # rounds up: kept
      2.0**-24,
      -(2.0**-26),
      0.0,
      65504.0,
      65519.0,  # rounds down to 65504
      65520.0,  # the tie: rounds to inf
      -70000.0,
      np.inf,
      np.nan,
    ]
  )
  tree = {
    "a": jnp.asarray(a, jnp.float32),
    "edges": jnp.asarray(edges, jnp.float32),
    "ids": jnp.arange(7),
  }
  report = jax.jit(ls.float16_range_report)(tree)
  ua, oa, sa = _numpy_reference(np.asarray(tree["a"]))
  ue, oe, se = _numpy_reference(np.asarray(tree["edges"]))
  np.testing.assert_array_equal(ue, [1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(oe, [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0])
  total = a.size + edges.size
  np.testing.assert_allclose(report.underflow, (ua.sum() + ue.sum()) / total, rtol=1e-6)
  np.testing.assert_allclose(report.overflow, (oa.sum() + oe.sum()) / total, rtol=1e-6)
  np.testing.assert_allclose(report.subnormal, (sa.sum() + se.sum()) / total, rtol=1e-6)
  np.testing.assert_array_equal(se, [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0])
  assert set(report.per_leaf) == {"['a']", "['edges']"}
  np.testing.assert_allclose(
    report.per_leaf["['a']"], (ua.mean(), oa.mean()), rtol=1e-6
  )
  np.testing.assert_allclose(
    report.per_leaf["['edges']"], (ue.mean(), oe.mean()), rtol=1e-6
  )
  assert report.underflow.dtype == jnp.float32
  assert 0.1 < float(report.underflow) < 0.5  # the test data do underflow


def test_float16_range_report_scaling_moves_gradients_into_range():
  g = jnp.asarray([1e-9, 2e-8, 1e-3], jnp.float32)
  assert float(ls.float16_range_report(g).underflow) == pytest.approx(2 / 3)
  assert float(ls.float16_range_report(g * 2.0**15).underflow) == 0.0
  assert float(ls.float16_range_report(g * 2.0**27).overflow) == pytest.approx(1 / 3)


def test_float16_range_report_empty_and_half_precision_trees():
  empty = ls.float16_range_report({})
  assert float(empty.underflow) == 0.0 and float(empty.overflow) == 0.0
  assert empty.per_leaf == {}
  ints = ls.float16_range_report({"ids": jnp.arange(3)})
  assert float(ints.underflow) == 0.0 and ints.per_leaf == {}
  half = ls.float16_range_report([jnp.array([1.0, jnp.inf], jnp.float16)])
  assert float(half.underflow) == 0.0 and float(half.overflow) == 0.5
  assert float(half.subnormal) == 0.0
  bf = ls.float16_range_report([jnp.array([1e-30, 1e30], jnp.bfloat16)])
  assert float(bf.underflow) == 0.5 and float(bf.overflow) == 0.5
