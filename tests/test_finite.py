"""The finite check: `lossscale.all_finite`, the core's (`_unscale.all_finite`,
with the unscale factor) and the speed layer's grouped one, which must give
the same flag."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import primitive_count


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_all_finite_per_dtype(dtype):
  ok = {"a": jnp.ones((2, 3), dtype), "b": [jnp.zeros(4, dtype)]}
  assert bool(jax.jit(ls.all_finite)(ok))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    tree = {"a": ok["a"], "b": [ok["b"][0].at[3].set(bad)]}
    assert not bool(jax.jit(ls.all_finite)(tree))


def test_all_finite_ignores_integer_bool_and_missing_leaves():
  tree = {
    "i": jnp.arange(3),
    "b": jnp.array([True]),
    "n": None,
    "m": optax.MaskedNode(),
    "e": jnp.zeros((0, 3)),
    "f": jnp.ones(()),
  }
  assert bool(ls.all_finite(tree))
  assert bool(ls.all_finite({}))
  assert bool(ls.all_finite([]))
  assert ls.all_finite({}).dtype == jnp.bool_


def test_all_finite_complex():
  assert bool(ls.all_finite(jnp.array([1 + 2j])))
  assert not bool(ls.all_finite(jnp.array([complex(1, np.inf)])))


def test_debug_nans_does_not_flag_a_plain_overflow():
  # The fast check turns inf into NaN (inf * 0); under `jax.debug_nans` the
  # check must not manufacture a NaN out of an ordinary overflow.
  grads = {"w": jnp.array([jnp.inf, 1.0]), "b": jnp.ones(2)}
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  params = jax.tree.map(jnp.zeros_like, grads)
  with jax.debug_nans(True):
    assert not bool(ls.all_finite(grads))
    assert not bool(jax.jit(ls.all_finite)(grads))
    _, state = tx.update(grads, tx.init(params), params)
    new_params, state = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(
      grads, state, params
    )
  assert int(state.skipped_steps) == 2
  np.testing.assert_array_equal(new_params["w"], params["w"])
  # Off again: the fast check, same answers.
  assert not bool(jax.jit(ls.all_finite)(grads))
  assert bool(jax.jit(ls.all_finite)({"w": jnp.ones(2)}))


def test_all_finite_checks_python_and_numpy_scalars():
  # A tree may hold plain numbers (a loss, a metric): they are read too.
  assert bool(ls.all_finite({"loss": 1.5, "n": 3, "z": 1j, "np": np.float16(2)}))
  for bad in (float("nan"), float("inf"), complex(0, float("inf")), np.float16(np.inf)):
    assert not bool(ls.all_finite({"w": jnp.ones(2), "loss": bad}))
    assert not bool(jax.jit(ls.all_finite)({"w": jnp.ones(2), "loss": bad}))


def _many_leaves():
  """Leaves the check groups (many of one size, in more than one group of
  32), leaves of other dtypes and sizes, and one leaf large enough for a
  reduction of its own."""
  tree = {f"s{i:02d}": jnp.ones((2, 4) if i % 2 else (8,)) for i in range(70)}
  tree.update(
    big=jnp.ones(70_000),
    half=jnp.ones((3,), jnp.bfloat16),
    f16=jnp.ones((8,), jnp.float16),
    c=jnp.ones(3, jnp.complex64),
    scalar=jnp.ones(()),
    empty=jnp.ones(0),
    i=jnp.arange(3),
  )
  return tree


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan, complex(0, np.inf)])
def test_all_finite_finds_a_bad_element_in_any_leaf_of_a_group(bad):
  tree = _many_leaves()
  check = jax.jit(ls.all_finite)
  assert bool(check(tree))
  for key, x in tree.items():
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.inexact):
      continue
    if isinstance(bad, complex) and not jnp.iscomplexobj(x):
      continue
    flat = x.reshape(-1)
    for at in {0, flat.size - 1}:
      bad_tree = dict(tree, **{key: flat.at[at].set(bad).reshape(x.shape)})
      assert not bool(check(bad_tree)), (key, at)


@pytest.mark.speed_layer
def test_all_finite_reduces_small_leaves_together():
  # A reduction per leaf made a thousand-leaf step compile for minutes
  # (docs/performance.md, "How cost grows"): leaves of one shape and dtype
  # are added up elementwise, 32 at a time, and reduced once.
  tree = {f"l{i:03d}": jnp.ones((4, 16) if i % 3 else (64,)) for i in range(640)}
  tree["own"] = jnp.ones(70_000)  # large: reduced on its own
  jaxpr = jax.make_jaxpr(ls.all_finite)(tree)
  shaped = sum(1 for i in range(640) if i % 3)  # 427 of (4, 16), 213 of (64,)
  groups = -(-shaped // 32) + -(-(640 - shaped) // 32)
  assert primitive_count(jaxpr, "reduce_sum") == groups + 1
  # Leaves are reduced in their own shapes: no reshape, which gathers a leaf
  # sharded on another than its first dimension under SPMD sharding.
  assert primitive_count(jaxpr, "reshape") == 0


@pytest.mark.speed_layer
def test_only_large_leaves_are_checked_behind_a_conditional_on_the_factor():
  # A factor of at most 1 checks a large leaf as it is (the cheaper
  # reduction); small leaves take the factor whatever it is, so that a
  # thousand of them are not compiled twice, once in each branch.
  from lossscale._speed.finite import all_finite as all_finite_times

  small = {f"s{i:03d}": jnp.ones(64) for i in range(100)}
  jaxpr = jax.make_jaxpr(all_finite_times)(small, jnp.float32(0.5))
  assert primitive_count(jaxpr, "cond") == 0
  large = dict(small, big=jnp.ones(70_000), other=jnp.ones((300, 300)))
  jaxpr = jax.make_jaxpr(all_finite_times)(large, jnp.float32(0.5))
  (cond,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
  # Its operands: the two large leaves and the factor (jax 0.4.35 passes
  # each branch's own), no small leaf.
  assert sorted({v.aval.size for v in cond.invars[1:]}) == [1, 70_000, 90_000]
  # Outside any trace the branch is chosen in Python.
  assert bool(all_finite_times(large, jnp.float32(0.5)))
  assert not bool(all_finite_times(dict(large, big=jnp.full(70_000, 3e38)), 2.0))


def _checks():
  """The core's check, and the speed layer's where it is importable."""
  from lossscale import _unscale, _wrapper

  found = {"core": _unscale.all_finite}
  if _wrapper.TRICKS:
    from lossscale._speed import finite

    found["grouped"] = finite.all_finite
  return found


@pytest.mark.parametrize("which", ["core", "grouped"])
@pytest.mark.parametrize("size", [8, 100_000])  # grouped, and reduced alone
def test_check_of_the_unscaled_gradients_is_exact_at_the_float32_range(size, which):
  if which not in _checks():
    pytest.skip("the speed layer is off in this process")
  # Factors of at most 1 check the leaves as they are, larger ones multiply.
  check = jax.jit(_checks()[which])
  big = jnp.full(size, 3e38, jnp.float32)  # finite, whose sum is not
  assert bool(check({"g": big, "h": big}, jnp.float32(1.0)))
  assert bool(check({"g": big}, jnp.float32(1.125)))  # 3.375e38: finite
  assert not bool(check({"g": big}, jnp.float32(1.25)))  # overflows
  half = jnp.full(size, 3e38, jnp.bfloat16)
  assert not bool(check({"g": half}, jnp.float32(2.0)))
  for at in (0, size // 2, size - 1):
    for v in (jnp.nan, jnp.inf):
      g = jnp.ones(size, jnp.float32).at[at].set(v)
      assert not bool(check({"g": g}, jnp.float32(0.5))), (at, v)
      assert not bool(check({"g": g}, jnp.float32(2.0))), (at, v)
  huge = jnp.full(size, 3e38 + 3e38j, jnp.complex64)  # |z| overflows; parts do not
  assert bool(check({"z": huge}, jnp.float32(1.0)))
  assert not bool(check({"z": huge.at[at].set(complex(1, np.nan))}, jnp.float32(1)))


def test_a_scale_below_one_known_at_compile_time_still_skips_an_overflow():
  # A state closed over by `jit` (or made by `tx.init` in the same jit) is a
  # constant: `(g * factor) * 0` would be folded into `g * 0` by XLA, and an
  # overflow that only the unscale makes would be applied as -inf.
  tx = ls.static_loss_scale(optax.sgd(1.0), 0.25)
  params = {"w": jnp.ones(4)}
  state = tx.init(params)
  g = {"w": jnp.full(4, 3e38)}  # finite; 3e38 / 0.25 is not
  p, s = jax.jit(lambda g: ls.apply_gradients(tx, g, state, params))(g)
  assert not bool(s.last_finite)
  np.testing.assert_array_equal(p["w"], params["w"])
  u, s = jax.jit(lambda g: tx.update(g, state, params))(g)
  assert not bool(s.last_finite)
  np.testing.assert_array_equal(u["w"], jnp.zeros(4))
