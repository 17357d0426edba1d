"""Tests of the step's conditional split into small ones (lossscale/_speed/split.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import (
  assert_trees_close,
  assert_trees_equal,
  primitive_count,
  standard_promotion,
)

# The split conditionals are the speed layer's: skipped where it is off, or
# cannot be imported (`make test-plain`).
_split = pytest.importorskip("lossscale._speed.split")
pytestmark = pytest.mark.speed_layer

INF = float("inf")


def _params(n):
  # Leaves of three shapes, as a model has: matrices, vectors, scalars.
  shapes = [(3, 4), (4,), ()]
  return {
    f"l{i:03d}": jnp.full(shapes[i % 3], 0.1 * (i % 7) - 0.3, jnp.float32)
    for i in range(n)
  }


def _grads(params, step, scale=1.0):
  return {
    k: (jnp.cos(p + 0.37 * step + 0.01 * i) * scale).astype(p.dtype)
    for i, (k, p) in enumerate(params.items())
  }


def _conds(closed_jaxpr):
  """Every `cond` of the step in a jaxpr, in calls too, as (outputs,
  reduce_sums inside); the finite check's own (one bool out) is left out,
  and the choice of platform (`lax.platform_dependent`, the speed layer's
  `order`) is looked into: its CPU branch, the first."""
  found = []
  platform = set()  # the platform's index (jax 0.4.35 clamps it first)
  for e in closed_jaxpr.eqns:
    if e.primitive.name == "platform_index" or (
      e.primitive.name == "clamp" and any(id(v) in platform for v in e.invars)
    ):
      platform.update(id(v) for v in e.outvars)
  for eqn in closed_jaxpr.eqns:
    check = len(eqn.outvars) == 1 and eqn.outvars[0].aval.dtype == jnp.bool_
    if eqn.primitive.name == "cond" and id(eqn.invars[0]) in platform:
      found += _conds(eqn.params["branches"][0])
    elif eqn.primitive.name == "cond" and not check:
      reductions = sum(
        sum(e.primitive.name == "reduce_sum" for e in b.eqns)
        for b in eqn.params["branches"]
      )
      found.append((len(eqn.outvars), reductions))
    elif eqn.primitive.name in ("pjit", "jit"):
      found += _conds(eqn.params["jaxpr"])
  return found


INNERS = {
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  # A scalar from every leaf (the global norm): computed once, before the
  # conditionals, not once per conditional.
  "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
  # Every leaf in one computation: one group, one conditional.
  "flatten": lambda: optax.flatten(optax.adam(1e-2)),
  "schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20)),
  "lamb": lambda: optax.lamb(1e-2),
}


def _stepper(tx, path):
  """`tx`'s step `(params, state, grads) -> (params, state)`: `tx.update`
  + `optax.apply_updates` ("update") or `apply_gradients`."""

  def step(p, s, g):
    if path == "update":
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return ls.apply_gradients(tx, g, s, p)

  return step


@pytest.mark.parametrize("path", ["update", "apply_gradients"])
@pytest.mark.parametrize("inner", sorted(INNERS))
def test_split_step_matches_the_bare_optimizer(inner, path):
  # 60 leaves, at most 8 outputs per conditional: many conditionals, and a
  # skipped step between applied ones.
  params = _params(60)
  tx = ls.dynamic_loss_scale(INNERS[inner](), initial_scale=8.0, growth_interval=100)
  bare = INNERS[inner]()

  step = _stepper(tx, path)
  with standard_promotion(), pytest.MonkeyPatch.context() as m:
    m.setattr(_split, "_OUTPUTS", 8)
    jitted = jax.jit(step)
    conds = _conds(jax.make_jaxpr(step)(params, tx.init(params), params))
    state, bare_state, p, bp = tx.init(params), bare.init(params), params, params
    for i in range(4):
      g = _grads(p, i, scale=float(ls.get_loss_scale(state)))
      if i == 2:
        g["l006"] = g["l006"].at[1, 1].set(INF)
      new_p, state = jitted(p, state, g)
      if i == 2:
        assert_trees_equal(new_p, p)
        assert int(state.skipped_steps) == 1
      else:
        u, bare_state = bare.update(_grads(bp, i), bare_state, bp)
        bp = optax.apply_updates(bp, u)
        assert_trees_close(new_p, bp, rtol=1e-5, atol=1e-6)
      p = new_p
    assert_trees_close(state.inner_state, bare_state, rtol=1e-5, atol=1e-6)
  if inner == "flatten":
    assert max(n for n, _ in conds) > 8  # coupled: one group
  else:
    assert len(conds) > 10
    assert max(n for n, _ in conds) <= 8
  if inner == "clip_adam":
    # The global norm's reductions sit before the conditionals.
    assert sum(r for _, r in conds) == 0


def test_a_large_step_is_split_into_bounded_conditionals():
  # What can be asserted about compile time without timing it: the step of
  # 600 leaves is no single conditional over them all, but conditionals of
  # at most `_OUTPUTS` outputs each, and the same number of them for the
  # fused and the composable step.
  params = _params(600)
  tx = ls.dynamic_loss_scale(optax.adamw(1e-3))
  state = tx.init(params)
  with standard_promotion():
    fused = _conds(
      jax.make_jaxpr(lambda p, s, g: ls.apply_gradients(tx, g, s, p))(
        params, state, params
      )
    )
    update = _conds(jax.make_jaxpr(tx.update)(params, state, params))
  for conds in (fused, update):
    outputs = [n for n, _ in conds]
    assert max(outputs) <= _split._OUTPUTS
    assert sum(outputs) >= 3 * 600  # updates or params, mu and nu
    assert len(conds) >= 3 * 600 // _split._OUTPUTS


def test_small_steps_keep_one_conditional():
  params = _params(6)
  tx = ls.dynamic_loss_scale(optax.adamw(1e-3))
  with standard_promotion():
    conds = _conds(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
  assert len(conds) == 1


def test_split_step_under_vmap_keeps_each_member_apart():
  # An ensemble: one member's overflow skips that member only.
  params = _params(12)
  tx = ls.dynamic_loss_scale(optax.adam(1e-2), initial_scale=4.0)
  stacked = jax.tree.map(lambda x: jnp.stack([x, x + 1.0]), params)
  grads = jax.tree.map(lambda x: jnp.ones_like(x) * 4.0, stacked)
  grads["l004"] = grads["l004"].at[1].set(INF)
  with standard_promotion(), pytest.MonkeyPatch.context() as m:
    m.setattr(_split, "_OUTPUTS", 4)
    states = jax.vmap(tx.init)(stacked)
    new, states = jax.jit(jax.vmap(lambda p, s, g: ls.apply_gradients(tx, g, s, p)))(
      stacked, states, grads
    )
  np.testing.assert_array_equal(states.skipped_steps, [0, 1])
  assert_trees_equal(
    jax.tree.map(lambda x: x[1], new), jax.tree.map(lambda x: x[1], stacked)
  )
  changed = jax.tree.map(lambda a, b: bool(jnp.all(a[0] != b[0])), new, stacked)
  assert all(jax.tree.leaves(changed))


def test_effects_keep_one_conditional():
  # A callback in the inner optimizer: its order is kept, in one conditional.
  seen = []

  def record(updates, state, params=None):
    del params
    jax.debug.callback(lambda: seen.append(1))
    return updates, state

  tx = ls.dynamic_loss_scale(
    optax.chain(
      optax.GradientTransformation(lambda p: optax.EmptyState(), record), optax.sgd(0.1)
    )
  )
  params = _params(9)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(_split, "_OUTPUTS", 2)
    conds = _conds(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
    jax.jit(tx.update)(params, tx.init(params), params)
    jax.effects_barrier()
  assert len(conds) == 1
  assert seen == [1]


def test_a_scalar_of_one_leaf_stays_in_its_conditional():
  # LAMB's trust ratio norms belong to one leaf each: they stay inside the
  # conditionals (a skipped step computes none), where the global norm of
  # `clip_by_global_norm` is computed once before them.
  params = _params(60)
  counts = {}
  for name in ("adamw", "lamb", "clip_adam"):
    tx = ls.dynamic_loss_scale(INNERS[name]())
    with standard_promotion(), pytest.MonkeyPatch.context() as m:
      m.setattr(_split, "_OUTPUTS", 8)
      step = lambda p, s, g, tx=tx: ls.apply_gradients(tx, g, s, p)
      jaxpr = jax.make_jaxpr(step)(params, tx.init(params), params)
    counts[name] = primitive_count(jaxpr, "reduce_sum")  # not inside conds
    assert len(_conds(jaxpr)) > 10
  assert counts["lamb"] == counts["adamw"]  # the finite check's only
  assert counts["clip_adam"] > counts["adamw"]


def test_debug_nans_skipped_step_makes_no_nan():
  # A skipped step's gradients are zeros for the optimizer: a scalar computed
  # before the conditionals (a global norm of 0, divided by) would be NaN,
  # which `jax.debug_nans` reports outside `jit`. There the step is one
  # conditional.
  params = _params(40)
  tx = ls.dynamic_loss_scale(INNERS["clip_adam"](), initial_scale=4.0)
  grads = _grads(params, 0, scale=4.0)
  grads["l003"] = grads["l003"].at[0, 0].set(INF)
  with standard_promotion(), jax.debug_nans(True), jax.disable_jit():
    new, state = ls.apply_gradients(tx, grads, tx.init(params), params)
  assert int(state.skipped_steps) == 1
  assert_trees_equal(new, params)


def test_built_conditionals_match_lax_cond_on_odd_outputs():
  # The conditionals are built from the traced equations, not traced again:
  # constants and literals as outputs, values passed straight through,
  # operands both branches read, an inlined call whose output is its
  # input, integer and boolean outputs, a scalar several groups use. JAX's
  # own checks (`jax_enable_checks`) type-check every built jaxpr.
  n = 40
  xs = [jnp.full((3,), i - 20.0, jnp.float32) for i in range(n)]
  ints = jnp.arange(n, dtype=jnp.int32)

  @jax.jit
  def pair(x, y):  # an inlined call: several outputs, one its own input
    return x * 2.0 + y, y, jnp.sum(x) > 0

  def true_fn():
    total = sum(jnp.sum(x) for x in xs)  # a scalar every group uses
    out = []
    for i, x in enumerate(xs):
      a, b, positive = pair(x, xs[(i + 1) % n])
      out.append((a / total, b, positive, ints[i] + 1, jnp.float32(1.5), x))
    return out, ints

  def false_fn():
    return [
      (x, jnp.zeros(3), jnp.bool_(False), ints[i], jnp.float32(-1.0), xs[0])
      for i, x in enumerate(xs)
    ], ints * 2

  traced_again = []
  lax_cond = jax.lax.cond

  def counting_cond(*args, **kwargs):
    traced_again.append(1)
    return lax_cond(*args, **kwargs)

  with jax.enable_checks(True):
    for pred in (True, False):
      with pytest.MonkeyPatch.context() as m:
        m.setattr(jax.lax, "cond", counting_cond)
        split = jax.jit(lambda p: _split.cond(p, true_fn, false_fn))(pred)
        jaxpr = jax.make_jaxpr(lambda p: _split.cond(p, true_fn, false_fn))(pred)
      whole = jax.jit(lambda p: jax.lax.cond(p, true_fn, false_fn))(pred)
      assert_trees_equal(split, whole)
      assert len(_conds(jaxpr)) > 1
  # Every conditional was built, none traced again by `lax.cond` (its
  # fallback, for a JAX whose jaxprs this cannot build).
  assert not traced_again


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("path", ["update", "apply_gradients"])
def test_a_300_leaf_step_builds_every_conditional(path, dtype):
  # `_split` falls back to `lax.cond` where this JAX builds or binds
  # jaxprs in a way it does not know: the same step, only slower. This
  # fails instead, on each supported JAX, for a model-sized AdamW step.
  params = {k: v.astype(dtype) for k, v in _params(300).items()}
  tx = ls.dynamic_loss_scale(optax.adamw(1e-3))
  raised = []
  build = _split._bind_built_cond

  def recording(*args, **kwargs):
    try:
      return build(*args, **kwargs)
    except Exception as e:
      raised.append(e)
      raise

  step = _stepper(tx, path)
  with standard_promotion(), pytest.MonkeyPatch.context() as m:
    m.setattr(_split, "_bind_built_cond", recording)
    jaxpr = jax.make_jaxpr(step)(params, tx.init(params), _grads(params, 0))
  assert not raised, raised[:1]
  assert len(_conds(jaxpr)) > 1  # split, not one conditional
