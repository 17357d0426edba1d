"""Replicas take the same decision, and data-parallel training matches one device.

Under `jax.pmap`, `shard_map` (1-D and 2-D meshes) and SPMD `jax.jit` on
sharded params and state, training with `cross_shard_mean` and a wrapper
follows single-device training on the averaged gradients, replicas hold
the same bits, and the wrapper's `axis_name` costs one scalar all-reduce.
Without averaging, only `axis_name` keeps the replicas' decisions together.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.tree_utils import tree_get

import _compat
import lossscale as ls
from _helpers import (
  INF,
  NAN,
  ScaleRule,
  collectives,
  collectives_per_run,
  elements,
  make_mesh,
  reference_rule,
  stack,
  standard_promotion,
)

N = 8  # devices (tests/conftest.py)

STEPS = 20
ROWS, FEATURES, OUTPUTS = 2, 8, 3  # rows per device

# step -> (device whose data holds the bad value, the value)
BAD = {
  3: (5, np.inf),
  4: (0, np.nan),
  9: (2, -np.inf),
  10: (7, np.inf),
  16: (3, np.nan),
}
RULE = ScaleRule(initial_scale=2.0**10, growth_interval=3)
LR = 1e-2


def _loss(params, x, y):
  return jnp.mean(jnp.square(x @ params["w"] + params["b"] - y))


def _data():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((STEPS, N, ROWS, FEATURES)).astype(np.float32)
  y = rng.standard_normal((STEPS, N, ROWS, OUTPUTS)).astype(np.float32)
  for t, (d, v) in BAD.items():
    x[t, d, 0, 0] = v
  return x, y


def _init_params():
  rng = np.random.default_rng(1)
  return {
    "w": jnp.asarray(rng.standard_normal((FEATURES, OUTPUTS)), jnp.float32),
    "b": jnp.zeros((OUTPUTS,), jnp.float32),
  }


def _averaged_tx(axis_name=None):
  return optax.chain(
    ls.cross_shard_mean("batch"), RULE.tx(optax.adamw(LR), axis_name=axis_name)
  )


def _update(tx, grads, opt_state, params):
  # optax's adam needs standard promotion; lossscale itself runs strict.
  with jax.numpy_dtype_promotion("standard"):
    return tx.update(grads, opt_state, params)


def _scaled(loss, opt_state):
  """`ls.scale_loss`, or the loss itself for a bare optimizer's state."""
  is_ls = lambda n: isinstance(n, ls.LossScaleState)
  if any(map(is_ls, jax.tree.leaves(opt_state, is_leaf=is_ls))):
    return ls.scale_loss(loss, opt_state)
  return loss


def _counters(opt_state):
  scale = tree_get(opt_state, "loss_scale")
  return np.asarray(scale), np.asarray(tree_get(opt_state, "skipped_steps"))


@pytest.fixture(scope="module")
def reference():
  """Single device: the wrapper fed the mean of the per-device gradients."""
  x, y = _data()
  tx = RULE.tx(optax.adamw(LR))

  @jax.jit
  def step(params, opt_state, x, y):
    def grad_on(xd, yd):
      return jax.grad(lambda p: ls.scale_loss(_loss(p, xd, yd), opt_state))(params)

    grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), jax.vmap(grad_on)(x, y))
    updates, opt_state = _update(tx, grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = _init_params()
  opt_state = tx.init(params)
  history = []
  for t in range(STEPS):
    params, opt_state = step(params, opt_state, x[t], y[t])
    history.append((*_counters(opt_state), jax.tree.map(np.asarray, params)))
  return history


def test_reference_follows_the_scale_rule(reference):
  expected = reference_rule(RULE, [t not in BAD for t in range(STEPS)])
  np.testing.assert_array_equal([h[0] for h in reference], [e[0] for e in expected])
  np.testing.assert_array_equal([h[1] for h in reference], [e[3] for e in expected])
  scales = [h[0] for h in reference]
  assert min(scales) < RULE.initial_scale < max(scales)  # both directions


# ---------------------------------------------------------------------------
# Data-parallel training matches one device.


def _assert_matches(history, reference):
  for t, ((scale, skipped, params), (r_scale, r_skipped, r_params)) in enumerate(
    zip(history, reference, strict=True)
  ):
    assert scale == r_scale, t
    assert skipped == r_skipped, t
    for name in params:
      np.testing.assert_allclose(
        params[name], r_params[name], rtol=1e-6, atol=1e-7, err_msg=f"step {t}"
      )


def _assert_replicas_identical(tree):
  """Every device's copy of every leaf is bit-for-bit the same."""
  for leaf in jax.tree.leaves(tree):
    copies = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
    assert len(copies) == N
    assert all(c == copies[0] for c in copies)


def _pmap_step(tx):
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: _scaled(_loss(p, x, y), opt_state))(params)
    updates, opt_state = _update(tx, grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return jax.pmap(step, axis_name="batch")


@pytest.mark.parametrize("axis_name", [None, "batch"])
def test_pmap_replicas_skip_together_and_match_single_device(reference, axis_name):
  x, y = _data()
  tx = _averaged_tx(axis_name)
  step = _pmap_step(tx)
  params = stack(_init_params())
  opt_state = stack(tx.init(_init_params()))
  history = []
  for t in range(STEPS):
    params, opt_state = step(params, opt_state, x[t], y[t])
    # pmap's outputs hold one slice per device: compare the slices.
    for leaf in jax.tree.leaves((params, opt_state)):
      leaf = np.asarray(leaf)
      assert all(leaf[i].tobytes() == leaf[0].tobytes() for i in range(N)), t
    scale, skipped = _counters(opt_state)
    history.append(
      (scale[0], skipped[0], jax.tree.map(lambda a: np.asarray(a[0]), params))
    )
  _assert_matches(history, reference)


def _shard_map_step(tx, mesh):
  @jax.jit
  @_compat.shard_map(
    mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")), out_specs=(P(), P())
  )
  def step(params, opt_state, x, y):
    # Differentiate a per-shard copy of the params: the gradients are then
    # this shard's own (varying), and `cross_shard_mean` averages them. (With
    # the replicated params, shard_map's check_vma would already psum them.)
    local = _compat.pcast_varying(params, "batch")
    grads = jax.grad(lambda p: _scaled(_loss(p, x, y), opt_state))(local)
    updates, opt_state = _update(tx, grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


@pytest.mark.parametrize("axis_name", [None, "batch"])
def test_shard_map_replicas_skip_together_and_match_single_device(reference, axis_name):
  x, y = _data()
  mesh = make_mesh()
  tx = _averaged_tx(axis_name)
  step = _shard_map_step(tx, mesh)
  params = jax.device_put(_init_params(), NamedSharding(mesh, P()))
  opt_state = jax.device_put(tx.init(_init_params()), NamedSharding(mesh, P()))
  history = []
  for t in range(STEPS):
    xt = x[t].reshape(N * ROWS, FEATURES)
    yt = y[t].reshape(N * ROWS, OUTPUTS)
    params, opt_state = step(params, opt_state, xt, yt)
    _assert_replicas_identical((params, opt_state))
    history.append((*_counters(opt_state), jax.tree.map(np.asarray, params)))
  _assert_matches(history, reference)


def _fsdp_shardings(mesh, tree):
  """`w`-shaped leaves (params, adam moments) sharded by rows; rest replicated."""
  w_shape = (FEATURES, OUTPUTS)
  return jax.tree.map(
    lambda a: NamedSharding(mesh, P("batch") if a.shape == w_shape else P()), tree
  )


def _spmd_step(tx, mesh):
  params = _init_params()
  p_shard = _fsdp_shardings(mesh, params)
  s_shard = _fsdp_shardings(mesh, jax.eval_shape(tx.init, params))
  data = NamedSharding(mesh, P("batch"))

  @jax.jit
  def step(params, opt_state, x, y):
    # One global loss over the whole batch: no axis names anywhere.
    grads = jax.grad(lambda p: _scaled(_loss(p, x, y), opt_state))(params)
    updates, opt_state = _update(tx, grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(
    step,
    in_shardings=(p_shard, s_shard, data, data),
    out_shardings=(p_shard, s_shard),
  )
  params = jax.device_put(params, p_shard)
  opt_state = jax.device_put(tx.init(_init_params()), s_shard)
  return step, params, opt_state


def test_spmd_jit_with_sharded_params_and_state_matches_single_device(reference):
  x, y = _data()
  mesh = make_mesh()
  tx = RULE.tx(optax.adamw(LR))
  step, params, opt_state = _spmd_step(tx, mesh)
  history = []
  for t in range(STEPS):
    xt = x[t].reshape(N * ROWS, FEATURES)
    yt = y[t].reshape(N * ROWS, OUTPUTS)
    params, opt_state = step(params, opt_state, xt, yt)
    history.append((*_counters(opt_state), jax.tree.map(np.asarray, params)))
  _assert_matches(history, reference)
  # FSDP-like: the params and adam's moments stayed sharded, one row block
  # per device; the scale is replicated.
  mu_w = tree_get(opt_state, "mu")["w"]
  for a in (params["w"], mu_w):
    assert a.sharding.spec == P("batch")
    assert a.addressable_shards[0].data.shape == (FEATURES // N, OUTPUTS)
  assert tree_get(opt_state, "loss_scale").sharding.is_fully_replicated


# ---------------------------------------------------------------------------
# What agreement costs: collectives in the compiled step.


def _shapes(counter):
  return sorted(
    s for (_, shapes), n in counter.items() for s in shapes for _ in range(n)
  )


def _compile_averaged(kind, tx):
  x, y = _data()
  params = _init_params()
  if kind == "pmap":
    lowered = _pmap_step(tx).lower(stack(params), stack(tx.init(params)), x[0], y[0])
  else:
    mesh = make_mesh()
    lowered = _shard_map_step(tx, mesh).lower(
      params,
      tx.init(params),
      x[0].reshape(N * ROWS, FEATURES),
      y[0].reshape(N * ROWS, OUTPUTS),
    )
  return collectives(lowered.compile().as_text())


@pytest.mark.parametrize("kind", ["pmap", "shard_map"])
def test_averaging_then_loss_scaling_adds_no_collective(kind):
  bare = _compile_averaged(
    kind, optax.chain(ls.cross_shard_mean("batch"), optax.adamw(LR))
  )
  # The bare step all-reduces the gradients, each exactly once.
  assert {op for op, _ in bare} == {"all-reduce"}
  assert _shapes(bare) == ["f32[3]", "f32[8,3]"]
  # The loss-scaling wrapper without an axis name adds nothing.
  assert _compile_averaged(kind, _averaged_tx()) == bare
  # With an axis name: exactly one more, the int32 scalar finite flag.
  with_axis = _compile_averaged(kind, _averaged_tx("batch"))
  assert with_axis - bare == collections.Counter({("all-reduce", ("s32[]",)): 1})
  assert bare - with_axis == collections.Counter()


def test_spmd_fsdp_finite_check_costs_one_scalar_all_reduce():
  x, y = _data()
  mesh = make_mesh()
  found = []
  for tx in (optax.adamw(LR), RULE.tx(optax.adamw(LR))):
    step, params, opt_state = _spmd_step(tx, mesh)
    xt = x[0].reshape(N * ROWS, FEATURES)
    yt = y[0].reshape(N * ROWS, OUTPUTS)
    text = step.lower(params, opt_state, xt, yt).compile().as_text()
    found.append(collectives_per_run(text))
  bare, scaled = found

  def operands(counter):
    return collections.Counter(
      (op, shape) for (op, shapes), n in counter.items() for shape in shapes * n
    )

  extra = operands(scaled) - operands(bare)
  assert operands(bare) - operands(scaled) == collections.Counter()
  # Each device checks its own shard of the sharded gradients; the compiler
  # combines the flags with one scalar all-reduce and adds nothing else. The
  # check is a conditional on the scale (a factor of at most 1 checks the
  # gradients as they are): each branch holds one, and one branch runs. (XLA's
  # all-reduce combiner may carry that scalar inside a gradient all-reduce, so
  # compare the reduced operands and allow at most one more op.)
  ((op, shape),) = extra.elements()
  assert op == "all-reduce" and shape.endswith("[]")
  assert sum(scaled.values()) <= sum(bare.values()) + 1


# ---------------------------------------------------------------------------
# Without averaging, only the wrapper's axis name keeps decisions together.


FACTORIES = {
  "dynamic": lambda axis: ls.dynamic_loss_scale(optax.sgd(0.1), axis_name=axis),
  "static": lambda axis: ls.static_loss_scale(optax.sgd(0.1), 256.0, axis_name=axis),
  "skip_nonfinite": lambda axis: ls.skip_nonfinite(optax.sgd(0.1), axis_name=axis),
}


def _per_replica_run(tx, bad_device=3):
  """Two steps of per-replica training; an inf on `bad_device` at step 1."""
  x, y = _data()
  x[1] = np.where(np.isfinite(x[1]), x[1], 0.0)
  x[1, bad_device, 0, 0] = np.inf
  rng = np.random.default_rng(2)
  params = {
    "w": jnp.asarray(rng.standard_normal((N, FEATURES, OUTPUTS)), jnp.float32),
    "b": jnp.zeros((N, OUTPUTS), jnp.float32),
  }
  opt_state = stack(tx.init(jax.tree.map(lambda a: a[0], params)))
  step = _pmap_step(tx)
  params, opt_state = step(params, opt_state, x[0], y[0])
  before = jax.tree.map(np.asarray, params)
  params, opt_state = step(params, opt_state, x[1], y[1])
  changed = np.array(
    [not np.array_equal(params["w"][i], before["w"][i]) for i in range(N)]
  )
  return _counters(opt_state), changed


@pytest.mark.parametrize("factory", list(FACTORIES))
def test_axis_name_makes_every_replica_skip(factory):
  (scale, skipped), changed = _per_replica_run(FACTORIES[factory]("batch"))
  np.testing.assert_array_equal(skipped, np.ones(N))
  assert not changed.any()
  assert len(set(scale.tolist())) == 1


def test_without_axis_name_replicas_disagree():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=256.0)
  (scale, skipped), changed = _per_replica_run(tx, bad_device=3)
  expected_skip = np.zeros(N, np.int32)
  expected_skip[3] = 1
  np.testing.assert_array_equal(skipped, expected_skip)
  np.testing.assert_array_equal(changed, expected_skip == 0)
  np.testing.assert_array_equal(scale, np.where(expected_skip, 128.0, 256.0))


@pytest.mark.parametrize(
  ("axis_name", "skipping"),
  [(("data", "model"), [1] * 8), ("model", [0, 0, 0, 0, 1, 1, 1, 1])],
)
def test_wrapper_axis_name_tuple_on_2d_mesh(axis_name, skipping):
  # An inf on device 5 (data row 1): reduced over both axes every device
  # skips; reduced over "model" only, just data row 1 skips.
  mesh = make_mesh((2, 4), ("data", "model"))
  tx = ls.static_loss_scale(optax.sgd(1.0), 2.0, axis_name=axis_name)
  g = np.ones((N, 3), np.float32)
  g[5, 1] = np.inf
  spec = P(("data", "model"))

  @jax.jit
  @_compat.shard_map(mesh=mesh, in_specs=spec, out_specs=(spec, spec))
  def step(g):
    updates, state = tx.update(g[0], tx.init(g[0]))
    return updates[None], state.skipped_steps[None]

  updates, skipped = step(g)
  np.testing.assert_array_equal(skipped, skipping)
  want = np.where(np.array(skipping)[:, None] == 1, 0.0, -0.5 * np.ones((N, 3)))
  np.testing.assert_array_equal(updates, want)


# ---------------------------------------------------------------------------
# Fault injection on 8 replicas, 500 steps.


_N_STEPS = 500

_BATCH = 4
_FAULT_RULE = ScaleRule(growth_interval=20)


def _linear_loss(params, x, y):
  pred = x @ params["w"] + params["b"]
  return jnp.mean((pred - y) ** 2)


def _fault_plan(n_dev, seed=0):
  """Per step and replica: 0 clean, 1/2 inf/NaN in the local gradient before
  the all-reduce, 3/4 inf/NaN after it (this replica only; only `axis_name`
  keeps the replicas together then)."""
  rng = np.random.default_rng(seed)
  kinds = np.zeros((_N_STEPS, n_dev), np.int32)
  for t in rng.choice(_N_STEPS, size=60, replace=False):
    replicas = rng.choice(n_dev, size=rng.integers(1, 4), replace=False)
    kinds[t, replicas] = rng.integers(1, 5, size=len(replicas))
  positions = rng.integers(0, 4 * 3, size=(_N_STEPS, n_dev))
  x = rng.standard_normal((_N_STEPS, n_dev, _BATCH, 4)).astype(np.float32)
  w_true = rng.standard_normal((4, 3)).astype(np.float32)
  y = x @ w_true + np.float32(0.1) * rng.standard_normal((_N_STEPS, n_dev, _BATCH, 3))
  return kinds, positions, x, y.astype(np.float32)


def test_fault_injection_on_eight_replicas():
  n_dev = jax.local_device_count()
  assert n_dev == 8
  kinds, positions, x, y = _fault_plan(n_dev)
  injected = (kinds != 0).any(axis=1)
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  make_inner = lambda: optax.adamw(optax.cosine_decay_schedule(0.05, _N_STEPS), 1e-3)
  tx = ls.dynamic_loss_scale(make_inner(), growth_interval=20, axis_name="batch")
  grad_fn = ls.value_and_grad(_linear_loss)

  def poison(g, kind, pos, when):
    bad = jnp.where(kind == when[0], INF, NAN)
    hit = jnp.logical_or(kind == when[0], kind == when[1])
    flat = g.reshape(-1)
    return flat.at[pos].set(jnp.where(hit, bad, flat[pos])).reshape(g.shape)

  def replica(params, state, xs, ys, ks, ps):
    def step(carry, inputs):
      params, state = carry
      x, y, kind, pos = inputs
      _, grads = grad_fn(state, params, x, y)
      grads["w"] = poison(grads["w"], kind, pos, (1, 2))
      grads = jax.lax.pmean(grads, "batch")
      grads["w"] = poison(grads["w"], kind, pos, (3, 4))
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      state_finite = jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(state)])
      )
      trace = (params, state.loss_scale, state.skipped_steps, state_finite)
      return (params, state), trace

    return jax.lax.scan(step, (params, state), (xs, ys, ks, ps))

  replicate = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n_dev), t)
  swap = lambda a: jnp.asarray(np.swapaxes(a, 0, 1))  # (replica, step, ...)
  with standard_promotion():
    (final_params, final_state), trace = jax.pmap(replica, axis_name="batch")(
      replicate(params),
      replicate(tx.init(params)),
      swap(x),
      swap(y),
      swap(kinds),
      swap(positions),
    )
  trace_params, scales, skipped, state_finite = jax.tree.map(np.asarray, trace)

  # Replicas never diverge: every step, every replica holds the same bits.
  for leaf in jax.tree.leaves((trace_params, scales, skipped)):
    assert (leaf == leaf[:1]).all()
  # Every injected step, and only those, is skipped.
  steps_skipped = np.diff(skipped[0], prepend=0) == 1
  np.testing.assert_array_equal(steps_skipped, injected)
  assert skipped[0, -1] == injected.sum() == int(final_state.skipped_steps[0])
  # No NaN or inf ever reaches the params or the optimizer state.
  assert all(np.isfinite(v).all() for v in jax.tree.leaves(trace_params))
  assert state_finite.all()
  assert ls.nonfinite_leaves((final_params, final_state)) == {}
  # The scale follows the independent model fed the injection pattern.
  expected_scales = [s[0] for s in reference_rule(_FAULT_RULE, ~injected)]
  np.testing.assert_array_equal(scales[0], np.array(expected_scales, np.float32))
  # And the params follow bare adamw fed the clean mean gradients only.
  reference_params = _bare_adamw_on_clean_steps(make_inner(), params, x, y, injected)
  for got, want in zip(
    jax.tree.leaves(final_params), jax.tree.leaves(reference_params), strict=True
  ):
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=1e-6)
  assert np.abs(final_params["w"][0]).max() > 0.5  # it did train


def _bare_adamw_on_clean_steps(opt, params, x, y, injected):
  """optax alone, on the mean gradient of all replicas' data, skipping by
  Python control flow: independent of lossscale."""
  n_dev = x.shape[1]

  @jax.jit
  def step(params, state, x, y):
    grads = jax.grad(
      lambda p: jnp.mean(jnp.stack([_linear_loss(p, x[d], y[d]) for d in range(n_dev)]))
    )(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  with standard_promotion():
    state = opt.init(params)
    for t in np.flatnonzero(~injected):
      params, state = step(params, state, x[t], y[t])
  return params


@pytest.mark.parametrize("fused", [True, False], ids=["apply_gradients", "update"])
def test_bfloat16_params_sharded_on_a_later_dimension_are_not_gathered(fused):
  # Tensor-parallel sharding of the second dimension: reading one element of
  # a parameter (the ordering flag of the bfloat16 moments) or checking a
  # leaf must not flatten it, which makes XLA gather it whole.
  mesh = make_mesh()
  shard = NamedSharding(mesh, P(None, "batch"))
  params = {"v": jax.device_put(jnp.ones((64, 64), jnp.bfloat16), shard)}
  grads = {"v": jax.device_put(jnp.ones((64, 64), jnp.bfloat16), shard)}
  tx = ls.dynamic_loss_scale(optax.adam(1e-3))

  def step(g, s, p):
    if fused:
      return ls.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  with jax.numpy_dtype_promotion("standard"):
    state = jax.jit(tx.init)(params)
    hlo = jax.jit(step).lower(grads, state, params).compile().as_text()
    p, _ = jax.jit(step)(grads, state, params)
  for (op, shapes), _ in collectives(hlo).items():
    for shape in shapes:
      assert elements(shape) <= 8, (op, shape)  # one value per device at most
  assert p["v"].sharding.is_equivalent_to(shard, 2)
