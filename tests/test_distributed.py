"""Tests for `cross_shard_mean` and consistent skips across replicas.

Covers `jax.pmap`, `jax.shard_map` (1-D and 2-D meshes), SPMD `jax.jit` on
sharded params and optimizer state, and two JAX processes on loopback. The
reference throughout is single-device training on the averaged gradients.
"""

import collections
import importlib.util
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.tree_utils import tree_get

import _compat
import lossscale as ls

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
CONFIG = dict(initial_scale=2.0**10, growth_interval=3)
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
    ls.cross_shard_mean("batch"),
    ls.dynamic_loss_scale(optax.adamw(LR), **CONFIG, axis_name=axis_name),
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


def _expected_history():
  """Hand-run of the documented rule (hysteresis 1) on the BAD schedule."""
  scale, good, skipped, scales, skips = CONFIG["initial_scale"], 0, 0, [], []
  for t in range(STEPS):
    if t in BAD:
      scale, good, skipped = scale / 2, 0, skipped + 1
    else:
      good += 1
      if good == CONFIG["growth_interval"]:
        scale, good = scale * 2, 0
    scales.append(scale)
    skips.append(skipped)
  return scales, skips


@pytest.fixture(scope="module")
def reference():
  """Single device: the wrapper fed the mean of the per-device gradients."""
  x, y = _data()
  tx = ls.dynamic_loss_scale(optax.adamw(LR), **CONFIG)

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


def test_reference_follows_the_hand_computed_schedule(reference):
  scales, skips = _expected_history()
  np.testing.assert_array_equal([h[0] for h in reference], scales)
  np.testing.assert_array_equal([h[1] for h in reference], skips)
  assert min(scales) < CONFIG["initial_scale"] < max(scales)  # both directions


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


def _stack(tree):
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *jnp.shape(a))), tree)


@pytest.mark.parametrize("axis_name", [None, "batch"])
def test_pmap_replicas_skip_together_and_match_single_device(reference, axis_name):
  x, y = _data()
  tx = _averaged_tx(axis_name)
  step = _pmap_step(tx)
  params = _stack(_init_params())
  opt_state = _stack(tx.init(_init_params()))
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


def _mesh(shape=(N,), names=("batch",)):
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


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
  mesh = _mesh()
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
  mesh = _mesh()
  tx = ls.dynamic_loss_scale(optax.adamw(LR), **CONFIG)
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


# Collective counts in the compiled HLO.

_COLLECTIVE = re.compile(
  r"=\s*(\([^)]*\)|\S+)\s+"
  r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


def _collectives(hlo_text):
  """Counter of (op, sorted operand shapes), layouts dropped."""
  found = collections.Counter()
  for shape, op in _COLLECTIVE.findall(hlo_text):
    shape = re.sub(r"\{[^}]*\}", "", shape).strip("()")
    found[op, tuple(sorted(s.strip() for s in shape.split(", ")))] += 1
  return found


def _shapes(counter):
  return sorted(
    s for (_, shapes), n in counter.items() for s in shapes for _ in range(n)
  )


def _compile_averaged(kind, tx):
  x, y = _data()
  params = _init_params()
  if kind == "pmap":
    lowered = _pmap_step(tx).lower(_stack(params), _stack(tx.init(params)), x[0], y[0])
  else:
    mesh = _mesh()
    lowered = _shard_map_step(tx, mesh).lower(
      params,
      tx.init(params),
      x[0].reshape(N * ROWS, FEATURES),
      y[0].reshape(N * ROWS, OUTPUTS),
    )
  return _collectives(lowered.compile().as_text())


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
  mesh = _mesh()
  found = []
  for tx in (optax.adamw(LR), ls.dynamic_loss_scale(optax.adamw(LR), **CONFIG)):
    step, params, opt_state = _spmd_step(tx, mesh)
    xt = x[0].reshape(N * ROWS, FEATURES)
    yt = y[0].reshape(N * ROWS, OUTPUTS)
    found.append(
      _collectives(step.lower(params, opt_state, xt, yt).compile().as_text())
    )
  bare, scaled = found
  # Each device checks its own shard of the sharded gradients; the compiler
  # combines the flags with one scalar all-reduce and adds nothing else. (XLA's
  # all-reduce combiner may carry that scalar inside a gradient all-reduce, so
  # compare the reduced operands and allow at most one more op.)

  def operands(counter):
    return collections.Counter(
      (op, shape) for (op, shapes), n in counter.items() for shape in shapes * n
    )

  extra = operands(scaled) - operands(bare)
  assert operands(bare) - operands(scaled) == collections.Counter()
  ((op, shape),) = extra.elements()
  assert op == "all-reduce" and shape.endswith("[]")
  assert sum(scaled.values()) <= sum(bare.values()) + 1


# Sharded updates without averaging: only the wrapper's axis name keeps the
# replicas' decisions in step.

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
  opt_state = _stack(tx.init(jax.tree.map(lambda a: a[0], params)))
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


# Reductions and multi-axis meshes.


def _grads_2d():
  rng = np.random.default_rng(3)
  return rng.standard_normal((N, 5)).astype(np.float32)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduction_over_a_tuple_of_axes_on_2d_mesh(reduction):
  g = _grads_2d()
  mesh = _mesh((2, 4), ("data", "model"))
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
  mesh = _mesh((2, 4), ("data", "model"))
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


@pytest.mark.parametrize(
  ("axis_name", "skipping"),
  [(("data", "model"), [1] * 8), ("model", [0, 0, 0, 0, 1, 1, 1, 1])],
)
def test_wrapper_axis_name_tuple_on_2d_mesh(axis_name, skipping):
  # An inf on device 5 (data row 1): reduced over both axes every device
  # skips; reduced over "model" only, just data row 1 skips.
  mesh = _mesh((2, 4), ("data", "model"))
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


# Errors.


@pytest.mark.parametrize("reduction", ["max", "MEAN", None, 0])
def test_unsupported_reduction(reduction):
  with pytest.raises(
    ValueError, match=re.escape(f"Unsupported reduction: {reduction!r}")
  ):
    ls.cross_shard_mean("batch", reduction=reduction)


@pytest.mark.parametrize("axis_name", [None, (), ["batch"], ("batch", None)])
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
    jax.pmap(lambda g: tx.update(g, state)[0], axis_name="other")(_stack(grads))


# Two processes on loopback.

_WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")


def _load_worker():
  spec = importlib.util.spec_from_file_location("_multiprocess_worker", _WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_skip_together(tmp_path):
  worker = _load_worker()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the children set 2 devices each themselves
  env["JAX_PLATFORMS"] = "cpu"
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  coordinator = f"127.0.0.1:{_free_port()}"
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  children = []
  try:
    for i in range(2):
      with open(logs[i], "w") as log:
        children.append(
          subprocess.Popen(
            [sys.executable, str(_WORKER), coordinator, str(i), str(outs[i])],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
          )
        )
    # Wait for both; stop early if one fails (the other would block in a
    # collective until its timeout).
    deadline = time.monotonic() + 240
    while any(c.poll() is None for c in children) and time.monotonic() < deadline:
      if any(c.poll() not in (None, 0) for c in children):
        break
      time.sleep(0.2)
  finally:
    for child in children:
      if child.poll() is None:
        child.kill()
      child.wait()
  for i, child in enumerate(children):
    assert child.returncode == 0, (
      f"process {i} exited with {child.returncode}:\n{logs[i].read_text()[-4000:]}"
    )
  results = [json.loads(out.read_text()) for out in outs]

  for i, r in enumerate(results):
    assert r["process_index"] == i
    assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 4, 2)
  assert results[0]["bad_positions"] == results[1]["bad_positions"]
  assert len(results[0]["bad_positions"]) == 2  # process 1's two devices

  # Both processes took the same decisions and hold bit-identical params.
  for key in ("scales_a", "skipped_a", "params_a_hex", "scales_b", "skipped_b"):
    assert results[0][key] == results[1][key], key
  skipped = np.cumsum([t in worker.BAD_STEPS for t in range(worker.STEPS)])
  for key in ("skipped_a", "skipped_b"):
    np.testing.assert_array_equal(results[0][key], skipped)

  # And the same as one process on 4 devices, with the inf in the same rows.
  ref = worker.train(_mesh((4,), ("batch",)), results[0]["bad_positions"])
  for key in ("scales_a", "skipped_a", "scales_b", "skipped_b"):
    assert results[0][key] == ref[key], key
  for name, value in ref["params_a"].items():
    np.testing.assert_allclose(
      results[0]["params_a"][name], value, rtol=1e-6, atol=1e-7
    )
  per_device = {**results[0]["params_b"], **results[1]["params_b"]}
  assert sorted(per_device) == sorted(ref["params_b"]) == ["0", "1", "2", "3"]
  for pos, params in ref["params_b"].items():
    for name, value in params.items():
      np.testing.assert_allclose(per_device[pos][name], value, rtol=1e-6, atol=1e-7)


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
