"""`cross_shard_mean` (`lossscale/_distributed.py`): TensorFlow's
`CrossShardOptimizer` reductions, MEAN and SUM, over one or several mesh
axes, and the errors that say how to bind an axis.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import _compat
import lossscale as ls
from _helpers import make_mesh, stack

N = 8  # devices (tests/conftest.py)


def _grads_2d():
  rng = np.random.default_rng(3)
  return rng.standard_normal((N, 5)).astype(np.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduction_over_a_tuple_of_axes_on_2d_mesh(reduction):
  g = _grads_2d()
  mesh = make_mesh((2, 4), ("data", "model"))
  tx = ls.cross_shard_mean(("data", "model"), reduction=reduction)
  count = jnp.arange(N, dtype=jnp.int32)

  @jax.jit
  @_compat.shard_map(
    mesh=mesh, in_specs=P(("data", "model")), out_specs=(P(), P(("data", "model")))
  )
  def reduce(g, count):
    updates, state = tx.update({"g": g[0], "count": count}, tx.init(None))
    assert state == optax.EmptyState()
    return updates["g"], updates["count"]

  out, count_out = reduce(g, count)
  want = g.astype(np.float64).sum(0)
  if reduction == "mean":
    want /= N
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
  # Integer leaves carry no gradient: passed through, not reduced.
  np.testing.assert_array_equal(count_out, np.arange(N))


def test_reduction_over_one_axis_of_a_2d_mesh():
  g = _grads_2d()
  mesh = make_mesh((2, 4), ("data", "model"))
  tx = ls.cross_shard_mean("model")

  @jax.jit
  @_compat.shard_map(mesh=mesh, in_specs=P(("data", "model")), out_specs=P("data"))
  def reduce(g):
    return tx.update({"g": g}, optax.EmptyState())[0]["g"]

  want = g.astype(np.float64).reshape(2, 4, 5).mean(axis=1)
  np.testing.assert_allclose(reduce(g), want, rtol=1e-6, atol=1e-6)


def test_pmap_sum_is_mean_times_replicas():
  g = _grads_2d()
  run = lambda r: jax.pmap(
    lambda g: ls.cross_shard_mean("batch", reduction=r).update(g, optax.EmptyState())[
      0
    ],
    axis_name="batch",
  )(g)
  mean, total = run("mean"), run("sum")
  np.testing.assert_allclose(
    mean[0], g.astype(np.float64).mean(0), rtol=1e-6, atol=1e-6
  )
  np.testing.assert_allclose(
    total[0], g.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6
  )


def test_float16_overflow_in_the_reduction_skips_on_every_replica():
  # 8 replicas of 12288: the mean would fit in float16, the sum (98304) does
  # not. The mean is jax.lax.pmean (sum first), so both reductions overflow
  # loudly: every replica sees the inf, skips and backs off.
  g = jnp.full((N, 2), 12288.0, jnp.float16)

  def run(reduction):
    tx = optax.chain(
      ls.cross_shard_mean("batch", reduction=reduction),
      ls.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0),
    )
    params = jnp.zeros(2, jnp.float16)
    step = lambda g: tx.update(g, tx.init(params), params)
    return jax.pmap(step, axis_name="batch")(g)

  ref = jax.pmap(lambda g: jax.lax.pmean(g, "batch"), axis_name="batch")(g)
  assert np.isinf(np.asarray(ref, np.float32)).all()
  for reduction in ("mean", "sum"):
    updates, state = run(reduction)
    np.testing.assert_array_equal(updates, np.zeros((N, 2)))
    np.testing.assert_array_equal(state[1].skipped_steps, np.ones(N))
    np.testing.assert_array_equal(state[1].loss_scale, np.full(N, 2.0))
  # Halving the gradients (what the backed-off scale does) makes the mean fit.
  updates, state = jax.pmap(
    lambda g: ls.cross_shard_mean("batch").update(g, optax.EmptyState()),
    axis_name="batch",
  )(g / 2)
  np.testing.assert_array_equal(updates, np.full((N, 2), 6144.0))
  # The update keeps each leaf's dtype.
  out = jax.pmap(
    lambda g: ls.cross_shard_mean("batch").update(g, optax.EmptyState())[0],
    axis_name="batch",
  )({"h": g, "b": g.astype(jnp.bfloat16), "z": g.astype(jnp.complex64)})
  assert {k: v.dtype for k, v in out.items()} == {
    "h": jnp.float16,
    "b": jnp.bfloat16,
    "z": jnp.complex64,
  }


# ---------------------------------------------------------------------------
# Errors.


@pytest.mark.parametrize("reduction", ["max", "MEAN", None, 0])
def test_unsupported_reduction(reduction):
  with pytest.raises(
    ValueError, match=re.escape(f"Unsupported reduction: {reduction!r}")
  ):
    ls.cross_shard_mean("batch", reduction=reduction)


@pytest.mark.parametrize(
  "axis_name", [None, (), ["batch"], ("batch", None), "", ("batch", "batch")]
)
def test_invalid_axis_name(axis_name):
  with pytest.raises(ValueError, match=re.escape("`cross_shard_mean(axis_name=...)`")):
    ls.cross_shard_mean(axis_name)


@pytest.mark.parametrize(
  ("make", "axis"),
  [
    (ls.cross_shard_mean, "batch"),
    (ls.cross_shard_mean, ("batch", "model")),
    (lambda a: ls.dynamic_loss_scale(optax.sgd(1.0), axis_name=a), "batch"),
    (lambda a: ls.skip_nonfinite(optax.sgd(1.0), axis_name=a), ("batch", "model")),
  ],
)
def test_unbound_axis_says_how_to_bind_it(make, axis):
  tx = make(axis)
  grads = {"w": jnp.ones(2)}
  state = tx.init(grads)
  bind = (
    re.escape("pmap(axis_name=...)")
    + ".*"
    + re.escape(f"jax.pmap(step, axis_name={axis!r})")
    + ".*shard_map"
  )
  with pytest.raises(NameError, match=bind):
    jax.jit(tx.update)(grads, state)
  with pytest.raises(NameError, match=bind):
    jax.pmap(lambda g: tx.update(g, state)[0], axis_name="other")(stack(grads))
