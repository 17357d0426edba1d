"""Tests of lossscale.apply_gradients (lossscale/_fused.py)."""

import functools
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import _compat
import lossscale as ls
from _helpers import (
  assert_trees_close,
  assert_trees_equal,
  bytes_accessed,
  collectives,
  make_mesh,
  pure_callback_logger,
  recording_wrapper,
  standard_promotion,
)
from lossscale._jax_internals import inspect

INF, NAN = float("inf"), float("nan")


def _params():
  k = jax.random.key(0)
  return {
    "w": jax.random.normal(k, (3, 4), jnp.float32),
    "b": jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32),
  }


def _grads(i, bad=None):
  k = jax.random.fold_in(jax.random.key(1), i)
  g = {
    "w": jax.random.normal(k, (3, 4), jnp.float32),
    "b": jax.random.normal(jax.random.fold_in(k, 1), (4,), jnp.float32),
  }
  if bad is not None:
    g["w"] = g["w"].at[1, 2].set(bad)
  return g


# Finite, finite, inf, finite, NaN, NaN, finite, finite: skips, a back-off
# with hysteresis, growth after two finite steps.
_BAD = [None, None, INF, None, NAN, -INF, None, None]


def _run_both(tx, grads_seq, params, **extra):
  """Runs apply_gradients and tx.update + apply_updates side by side."""

  @jax.jit
  def fused(g, s, p):
    return ls.apply_gradients(tx, g, s, p, **extra)

  @jax.jit
  def composed(g, s, p):
    u, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, u), s

  out = []
  with standard_promotion():
    fs = cs = tx.init(params)
    fp = cp = params
    for g in grads_seq:
      fp, fs = fused(g, fs, fp)
      cp, cs = composed(g, cs, cp)
      out.append(((fp, fs), (cp, cs)))
  return out


def _is_wrapper_state(x):
  return isinstance(x, ls.LossScaleState)


def _whole_step_reference(tx, grads_seq, params):
  """tx.update + apply_updates, with TensorFlow's skip applied by hand: on a
  non-finite step everything but the wrapper's state is put back."""
  update = jax.jit(tx.update)
  out = []
  with standard_promotion():
    state = tx.init(params)
    for g in grads_seq:
      updates, new_state = update(g, state, params)
      leaves = jax.tree.leaves(new_state, is_leaf=_is_wrapper_state)
      (wrapper,) = [n for n in leaves if _is_wrapper_state(n)]
      if bool(wrapper.last_finite):
        params, state = optax.apply_updates(params, updates), new_state
      else:
        state = jax.tree.map(
          functools.partial(lambda w, x: w if _is_wrapper_state(x) else x, wrapper),
          state,
          is_leaf=_is_wrapper_state,
        )
      out.append((params, state))
  return out


def test_same_trajectory_as_update_with_whole_step_skips_with_chains():
  """Pre- and post-wrapper transforms with state (step-counting schedules)."""
  tx = optax.chain(
    optax.clip_by_global_norm(1e4),
    optax.scale_by_schedule(lambda n: 1.0 / (1.0 + n.astype(jnp.float32))),
    ls.dynamic_loss_scale(
      optax.adamw(0.1), initial_scale=8.0, growth_interval=2, hysteresis=2
    ),
    optax.scale_by_schedule(lambda n: 0.5 + 0.5 * (n % 2).astype(jnp.float32)),
  )
  grads = [
    jax.tree.map(lambda x, i=i: 8.0 * x, _grads(i, b)) for i, b in enumerate(_BAD)
  ]
  fused = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
  with standard_promotion():
    fp, fs = _params(), tx.init(_params())
    for g, (rp, rs) in zip(
      grads, _whole_step_reference(tx, grads, _params()), strict=True
    ):
      fp, fs = fused(g, fs, fp)
      # The decision and the scale state machine: exactly the same.
      assert_trees_equal(fs[2]._replace(inner_state=()), rs[2]._replace(inner_state=()))
      # The step-counting schedules before and after the wrapper advance on
      # applied steps only.
      assert_trees_equal((fs[1], fs[3]), (rs[1], rs[3]))
      # Floats: XLA compiles the two programs separately (fusion and FMA
      # contraction may differ by an ulp).
      chex.assert_trees_all_close((fp, fs), (rp, rs), rtol=1e-6, atol=1e-7)
  assert int(fs[2].skipped_steps) == 3
  assert int(fs[1].count) == int(fs[3].count) == len(_BAD) - 3


def test_transforms_after_the_wrapper_do_not_move_params_on_a_skip():
  # With tx.update + apply_updates, weight decay after the wrapper would
  # shrink the params on a skipped step; the fused step skips all of it.
  tx = optax.chain(
    ls.dynamic_loss_scale(optax.sgd(1.0), initial_scale=4.0),
    optax.add_decayed_weights(0.5),
    optax.scale(-0.1),
  )
  params = _params()
  with standard_promotion():
    state = tx.init(params)
    p, s = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(
      _grads(0, INF), state, params
    )
    moved, _ = tx.update(_grads(0, INF), state, params)
  assert_trees_equal(p, params)
  assert_trees_equal(s[1:], state[1:])
  assert float(s[0].loss_scale) == 2.0 and not bool(s[0].last_finite)
  assert any(np.asarray(u).any() for u in jax.tree.leaves(moved))


def test_matches_bare_optimizer_fed_only_the_finite_unscaled_steps():
  """Independent reference: plain AdamW on the finite steps, unscaled."""
  scale = 4.0
  tx = ls.dynamic_loss_scale(
    optax.adamw(0.05), initial_scale=scale, growth_interval=1000
  )
  params = _params()
  step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
  bare = optax.adamw(0.05)
  with standard_promotion():
    state = tx.init(params)
    ref_p, ref_s = params, bare.init(params)
    p = params
    for i, b in enumerate(_BAD):
      g = _grads(i, b)
      scale_now = float(ls.get_loss_scale(state))
      p, state = step(jax.tree.map(lambda x, s=scale_now: x * s, g), state, p)
      if b is None:
        u, ref_s = bare.update(g, ref_s, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
      chex.assert_trees_all_close(p, ref_p, rtol=1e-6, atol=1e-7)
  # The inner count advanced only on the 5 finite steps.
  assert int(state.inner_state[0].count) == 5
  assert int(state.skipped_steps) == 3


def test_skipped_step_leaves_params_and_inner_state_bitwise():
  tx = ls.dynamic_loss_scale(optax.adam(0.1), initial_scale=2.0)
  params = _params()
  step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
  with standard_promotion():
    state = tx.init(params)
    p1, s1 = step(_grads(0), state, params)
    p2, s2 = step(_grads(1, NAN), s1, p1)
  assert_trees_equal((p1, s1.inner_state), (p2, s2.inner_state))
  assert float(s2.loss_scale) == 1.0
  assert int(s2.consecutive_skips) == 1


def test_no_recompilation_across_steps_and_skips():
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0, growth_interval=2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(g, s, p):
    return ls.apply_gradients(tx, g, s, p)

  params = _params()
  state = tx.init(params)
  for i, b in enumerate(_BAD):
    params, state = step(_grads(i, b), state, params)
  assert step._cache_size() == 1
  # lax.cond demands identical types: no weak types, no dtype drift.
  init = tx.init(params)
  jax.lax.cond(jnp.array(True), lambda: init, lambda: state)


def test_extra_args_are_forwarded_lbfgs():
  def loss(p):
    return jnp.sum((p["w"] - 1.0) ** 2) + jnp.sum(p["b"] ** 2)

  scale = 16.0
  tx = ls.static_loss_scale(optax.lbfgs(), scale)
  params = _params()

  def run(fused):
    @jax.jit
    def step(p, s):
      value, g = jax.value_and_grad(loss)(p)
      sg = jax.tree.map(lambda x: x * scale, g)
      # The natural step: `grad=` gets the same (scaled) gradients.
      extra = dict(value=value, grad=sg, value_fn=loss)
      if fused:
        return ls.apply_gradients(tx, sg, s, p, **extra)
      u, s = tx.update(sg, s, p, **extra)
      return optax.apply_updates(p, u), s

    p, s = params, tx.init(params)
    with standard_promotion():
      for _ in range(3):
        p, s = step(p, s)
    return p, s

  fused, composed = run(True), run(False)
  # To rounding: XLA compiles the line search differently in the two steps.
  assert_trees_close(fused, composed, rtol=1e-5, atol=1e-6)
  assert float(loss(fused[0])) < 1e-3 * float(loss(params))


def test_vmap_members_decide_independently():
  tx = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=2.0)
  params = jax.tree.map(lambda x: jnp.stack([x, x + 1.0]), _params())
  g0, g1 = _grads(0, INF), _grads(1)
  grads = jax.tree.map(lambda a, b: jnp.stack([a, b]), g0, g1)
  states = jax.vmap(tx.init)(params)
  step = lambda g, s, p: ls.apply_gradients(tx, g, s, p)
  # vmap traced inside jit, a jitted step batched afterwards, and eagerly.
  for fused in (jax.jit(jax.vmap(step)), jax.vmap(jax.jit(step)), jax.vmap(step)):
    p, s = fused(grads, states, params)
    # Member 0 skipped: parameters untouched, scale backed off.
    chex.assert_trees_all_equal(
      jax.tree.map(lambda x: x[0], p), jax.tree.map(lambda x: x[0], params)
    )
    np.testing.assert_array_equal(s.loss_scale, np.array([1.0, 2.0], np.float32))
    # Member 1 stepped: p - 0.5 * g / 2.
    chex.assert_trees_all_close(
      jax.tree.map(lambda x: x[1], p),
      jax.tree.map(lambda x, g: x[1] - 0.25 * g, params, g1),
      rtol=1e-6,
    )


def _eqns(jaxpr):
  """Every equation of `jaxpr`, in nested calls and branches too."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _eqns(sub)


def _array_selects(jaxpr) -> int:
  """How many `select_n` equations, in nested calls and branches too, choose
  between arrays (not scalars)."""
  return sum(
    eqn.primitive.name == "select_n" and bool(eqn.outvars[0].aval.shape)
    for eqn in _eqns(jaxpr)
  )


def test_a_host_callback_in_the_inner_optimizer_never_sees_nonfinite_values():
  # `jax.pure_callback` has no effect, and a `jax.vmap` around a `lax.scan` of
  # steps batches the step's conditional without the wrapper seeing a batched
  # flag: the callback alone tells it to feed zeros to a bad member.
  logger, seen = pure_callback_logger()
  tx = ls.dynamic_loss_scale(logger)

  def train(grads_seq, state, params):
    def body(carry, g):
      params, state = carry
      return ls.apply_gradients(tx, g, state, params), None

    return jax.lax.scan(body, (params, state), grads_seq)[0]

  params = jnp.zeros((2, 3))
  grads = jnp.array([[[1.0, INF, 2.0], [1.0, 1.0, 1.0]], [[3.0, 1.0, 2.0]] * 2])
  p, s = jax.jit(jax.vmap(train))(grads, jax.vmap(tx.init)(params), params)
  # Member 0: its first step skipped (the scale backed off to 2**14), the
  # second applied (the identity's update: the unscaled gradients).
  np.testing.assert_array_equal(p[0], np.full(3, 2.0**-14, np.float32))
  assert seen and all(np.all(np.isfinite(x)) for x in seen)
  np.testing.assert_array_equal(s.skipped_steps, [1, 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_host_callback_chained_after_the_wrapper_never_sees_nonfinite_values(dtype):
  # apply_gradients runs the transformations chained after the wrapper inside
  # the step's conditional; a `jax.vmap` around the traced step runs both
  # branches, so a callback there would log what the inner optimizer made of
  # the bad member's inf unless the inner optimizer is fed zeros. With
  # bfloat16 parameters the state is not written in a second call of the
  # chain, which would run the callback twice.
  logger, seen = pure_callback_logger()
  # A state after the logger, computed from what it returns: with bfloat16
  # it is the kind written in a second call of the chain.
  wrapper = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
  tx = optax.chain(wrapper, logger, optax.trace(0.5))
  params = jnp.ones((2, 3), dtype)
  states = jax.vmap(tx.init)(params)
  grads = jnp.array([[1.0, INF, 2.0], [4.0, 4.0, 4.0]], dtype)
  step = lambda g, s, p: ls.apply_gradients(tx, g, s, p)
  for ensemble in (jax.jit(jax.vmap(step)), jax.vmap(jax.jit(step))):
    seen.clear()
    p, s = ensemble(grads, states, params)
    jax.effects_barrier()
    assert len(seen) == 2  # once per member
    assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in seen)
    np.testing.assert_array_equal(p[0], params[0])  # skipped
    np.testing.assert_array_equal(p[1], params[1] - 0.5)  # sgd(0.5) on 4 / 4
    np.testing.assert_array_equal(s[0].skipped_steps, [1, 0])
    np.testing.assert_array_equal(s[2].trace[0], jnp.zeros(3, dtype))  # skipped


def _tap(tag, log):
  """An optax transformation that passes its updates on and logs them with
  `jax.debug.callback` as `(tag, array)`."""

  def update(updates, state, params=None):
    del params
    jax.debug.callback(lambda u: log.append((tag, np.asarray(u))), updates)
    return updates, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


@pytest.mark.parametrize("mode", ["eager", "jit", "jit_vmap", "vmap_jit"])
def test_a_debug_callback_anywhere_in_the_chain_runs_once_per_step(mode):
  # Before the wrapper, in the inner optimizer and after the wrapper: each
  # callback runs once per step (per member), on the values the step goes
  # on with: the gradients as given, the unscaled ones, and the applied
  # updates (zeros on a skipped step).
  log = []
  inner = optax.chain(_tap("inner", log), optax.sgd(0.5))
  tx = optax.chain(
    _tap("before", log),
    ls.dynamic_loss_scale(inner, initial_scale=4.0),
    _tap("after", log),
  )
  step = lambda g, s, p: ls.apply_gradients(tx, g, s, p)
  step = {
    "eager": step,
    "jit": jax.jit(step),
    "jit_vmap": jax.jit(jax.vmap(step)),
    "vmap_jit": jax.vmap(jax.jit(step)),
  }[mode]
  good, bad = jnp.full(3, 4.0), jnp.array([4.0, INF, 4.0])
  batches = [[good, bad]] if "vmap" in mode else [[good], [bad]]
  for members in batches:
    log.clear()
    n = len(members)
    params = jnp.ones((n, 3)) if "vmap" in mode else jnp.ones(3)
    state = jax.vmap(tx.init)(params) if "vmap" in mode else tx.init(params)
    grads = jnp.stack(members) if "vmap" in mode else members[0]
    new_params, _ = step(grads, state, params)
    jax.effects_barrier()
    by_tag = {t: [v for u, v in log if u == t] for t in ("before", "inner", "after")}
    assert sorted(v.tolist() for v in by_tag["before"]) == sorted(
      np.asarray(m).tolist() for m in members
    )
    # The inner optimizer is fed the unscaled gradients of a good member;
    # where a batched step runs both branches, zeros for a bad one.
    expected_inner = [[1.0] * 3] + ([[0.0] * 3] if n == 2 else [])
    if n == 1 and members[0] is bad:
      expected_inner = []
    assert sorted(v.tolist() for v in by_tag["inner"]) == sorted(expected_inner)
    expected_after = sorted([[0.0] * 3 if m is bad else [-0.5] * 3 for m in members])
    assert sorted(v.tolist() for v in by_tag["after"]) == expected_after
    applied = np.where(np.isfinite(np.asarray(grads)).all(-1, keepdims=True), 0.5, 1.0)
    np.testing.assert_array_equal(new_params, np.broadcast_to(applied, params.shape))


def test_calls_out_are_found_in_every_nesting():
  # Where the inner optimizer hands values out decides whether it is fed
  # zeros for a bad member: a callback inside control flow, a custom
  # derivative or `lax.custom_root` (JAX 0.12 keeps the latter's jaxprs on
  # an object parameter) counts.
  def cb(x):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(lambda a: a, shape, x, vmap_method="sequential")

  root = lambda x: jax.lax.custom_root(
    lambda v: v - 1.0, x, lambda g, x0: cb(x0 - g(x0)), lambda g, y: y
  )
  nested = {
    "direct": cb,
    "cond": lambda x: jax.lax.cond(x[0] > 0, cb, lambda y: y, x),
    "scan": lambda x: jax.lax.scan(lambda c, _: (cb(c), None), x, None, length=2)[0],
    "while": lambda x: jax.lax.while_loop(lambda c: c[0] < 3, cb, x),
    "checkpoint": jax.checkpoint(cb),
    "jit": jax.jit(cb),
    "custom_root": root,
  }
  x = jnp.ones(3)
  for name, f in nested.items():
    assert inspect(jax.make_jaxpr(f)(x))[1], name
  assert not inspect(
    jax.make_jaxpr(
      lambda y: jax.lax.custom_root(
        lambda v: v - 1.0, y, lambda g, x0: x0 - g(x0), lambda g, z: z
      )
    )(x)
  )[1]


def test_inner_optimizer_sees_zeros_for_a_bad_member_only_where_both_branches_run():
  # Under vmap with a flag per member both branches of the step's conditional
  # run: the inner optimizer then sees zeros for a bad member's gradients (its
  # callbacks would see them), and only then: a select per leaf costs compile
  # time, and where one branch runs nothing can see what the other computes.
  tx, seen = recording_wrapper()
  params = jnp.zeros((2, 3))
  states = jax.vmap(tx.init)(params)
  grads = jnp.array([[1.0, INF, 2.0], [3.0, 1.0, 2.0]])
  step = lambda g, s, p: ls.apply_gradients(tx, g, s, p)
  for fused in (jax.jit(jax.vmap(step)), jax.vmap(jax.jit(step)), jax.vmap(step)):
    seen.clear()
    p, s = fused(grads, states, params)
    jax.effects_barrier()
    assert len(seen) == 2  # one call per member
    assert any(np.array_equal(x, np.zeros(3, np.float32)) for x in seen)
    assert all(np.all(np.isfinite(x)) for x in seen)
    np.testing.assert_array_equal(s.skipped_steps, [1, 0])
    np.testing.assert_array_equal(p[0], params[0])

  plain = ls.dynamic_loss_scale(optax.adam(0.1))
  step = lambda g, s, p: ls.apply_gradients(plain, g, s, p)
  one = _params()
  with standard_promotion():
    assert _array_selects(jax.make_jaxpr(step)(one, plain.init(one), one).jaxpr) == 0
    many = jax.tree.map(lambda x: jnp.stack([x, x]), one)
    batched = jax.make_jaxpr(jax.vmap(step))(many, jax.vmap(plain.init)(many), many)
    assert _array_selects(batched.jaxpr) >= len(jax.tree.leaves(one))


@pytest.mark.parametrize(
  "tx, message",
  [
    (optax.adam(0.1), "found none"),
    (
      optax.chain(
        ls.skip_nonfinite(optax.identity()), ls.dynamic_loss_scale(optax.sgd(0.1))
      ),
      "found 2",
    ),
  ],
)
def test_rejects_tx_without_exactly_one_wrapper(tx, message):
  params = _params()
  with (
    standard_promotion(),
    pytest.raises(ValueError, match=rf"apply_gradients\(tx=\.\.\.\).*{message}"),
  ):
    ls.apply_gradients(tx, _grads(0), tx.init(params), params)


def _cond_container(inner):
  """A transformation that calls `inner` inside its own `lax.cond`."""

  def init(params):
    return (inner.init(params),)

  def update(updates, state, params=None, **extra):
    return jax.lax.cond(
      True,
      lambda: (lambda u, s: (u, (s,)))(
        *inner.update(updates, state[0], params, **extra)
      ),
      lambda: (updates, state),
    )

  return optax.GradientTransformationExtraArgs(init, update)


_CONTROL_FLOW = {
  "MultiSteps": lambda w: optax.MultiSteps(w, 2).gradient_transformation(),
  "apply_if_finite": lambda w: optax.apply_if_finite(w, 3),
  "conditionally_mask": lambda w: optax.conditionally_mask(w, lambda n: n > 0),
  "custom_cond": _cond_container,
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", list(_CONTROL_FLOW))
def test_rejects_wrapper_inside_another_transforms_control_flow(name, jit):
  tx = _CONTROL_FLOW[name](ls.dynamic_loss_scale(optax.sgd(0.1)))
  params = _params()
  step = lambda g, s, p: ls.apply_gradients(tx, g, s, p)
  step = jax.jit(step) if jit else step
  match = "inside optax.MultiSteps" if name == "MultiSteps" else "control flow"
  with standard_promotion(), pytest.raises(ValueError, match=match):
    step(_grads(0), tx.init(params), params)
  # The ordinary step still works there.
  with standard_promotion():
    tx.update(_grads(0), tx.init(params), params)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_already_jitted_update_works(jit):
  inner = ls.dynamic_loss_scale(optax.adam(0.1), initial_scale=4.0)
  tx = optax.GradientTransformation(inner.init, jax.jit(inner.update))
  step = lambda g, s, p: ls.apply_gradients(tx, g, s, p)
  step = jax.jit(step) if jit else step
  params = _params()
  with standard_promotion():
    state = tx.init(params)
    for i, b in enumerate(_BAD):  # ordinary calls in between change nothing
      tx.update(_grads(i, b), state, params)
      p, s = step(_grads(i, b), state, params)
      rp, rs = ls.apply_gradients(inner, _grads(i, b), state, params)
      chex.assert_trees_all_close((p, s), (rp, rs), rtol=1e-6, atol=1e-7)
      params, state = p, s
  assert int(state.skipped_steps) == 3


def test_plain_transformation_dropping_extra_args_is_refused():
  wrapper = ls.dynamic_loss_scale(optax.sgd(0.1))
  tx = optax.GradientTransformation(
    wrapper.init, lambda u, s, p=None: wrapper.update(u, s, p)
  )
  params = _params()
  with pytest.raises(ValueError, match="did not receive the decision"):
    ls.apply_gradients(tx, _grads(0), tx.init(params), params)


_FIRST_STEP = """
import jax, jax.numpy as jnp, optax
import lossscale as ls

traces = []
sgd = optax.sgd(0.1)

def update(updates, state, params=None):
  traces.append(None)
  return sgd.update(updates, state, params)

tx = ls.dynamic_loss_scale(optax.GradientTransformation(sgd.init, update))
params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
step(params, tx.init(params), params)
print(len(traces))
"""


@pytest.mark.speed_layer
def test_a_fresh_process_traces_its_first_step_once():
  """The first step of a process, where nothing has imported the parts of
  JAX lossscale uses yet: an import that registers configuration options
  mid-step changes JAX's tracing context and makes it trace the inner
  optimizer again (it did, when `jax.extend.core` was imported on first
  use)."""
  env = {k: v for k, v in os.environ.items() if k != "LOSSSCALE_PLAIN"}
  out = subprocess.run(
    [sys.executable, "-c", _FIRST_STEP],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
    check=True,
  )
  assert out.stdout.split() == ["1"], out.stderr[-2000:]


@pytest.mark.speed_layer
def test_inner_optimizer_traced_once_per_step():
  # The decision pass needs the inner optimizer's output shapes, the finite
  # branch runs it, and inside shard_map the branches' varying axes are
  # matched first: every one of them evaluates the one trace of the step.
  traces = []

  def counting(inner):
    def update(updates, state, params=None):
      traces.append(None)
      return inner.update(updates, state, params)

    return optax.GradientTransformation(inner.init, update)

  def make_tx():  # a new wrapper: nothing traced yet
    return optax.chain(
      ls.cross_shard_mean("batch"),
      ls.dynamic_loss_scale(counting(optax.sgd(0.1))),
      optax.scale(1.0),
    )

  params = _params()
  state = make_tx().init(params)
  steps = [
    lambda tx, g, s, p: ls.apply_gradients(tx, g, s, p),
    lambda tx, g, s, p: tx.update(g, s, p),
  ]
  # Outside shard_map (axis bound by vmap), jitted; and eagerly, where
  # `inner` runs op by op once per step, after one abstract trace of the
  # chain (`jax.make_jaxpr`) that checks it can take a decision.
  for fn in steps:
    for jit in (True, False):
      traces.clear()
      step = jax.vmap(
        functools.partial(fn, make_tx()), axis_name="batch", in_axes=(0, None, None)
      )
      step = jax.jit(step) if jit else step
      step(jax.tree.map(lambda x: x[None], _grads(0)), state, params)
      first = len(traces)
      # apply_gradients' eager check traces once more; `tx.update` does not.
      assert first == (2 if fn is steps[0] and not jit else 1)
      if not jit:
        step(jax.tree.map(lambda x: x[None], _grads(1)), state, params)
        assert len(traces) == 2 * first
  # Inside shard_map, where the branches' varying axes must be matched.
  mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
  for fn in steps:
    traces.clear()
    step = functools.partial(fn, make_tx())
    sharded = _compat.shard_map(
      lambda g, s, p, step=step: step(jax.tree.map(lambda x: x[0], g), s, p),
      mesh=mesh,
      in_specs=(P("batch"), P(), P()),
      out_specs=P(),
    )
    jax.jit(sharded)(
      jax.tree.map(lambda x: jnp.stack([x, x]), _grads(0)), state, params
    )
    assert len(traces) == 1


def test_rejects_non_transformation():
  with pytest.raises(TypeError, match=r"apply_gradients\(tx=\.\.\.\)"):
    ls.apply_gradients(optax.adam, {}, (), {})
  with pytest.raises(TypeError, match=r"gradient_transformation\(\)"):
    ls.apply_gradients(optax.MultiSteps(optax.sgd(0.1), 2), {}, (), {})


@pytest.mark.filterwarnings("ignore:.*seed.*:DeprecationWarning")
def test_per_example_gradients_with_dpsgd():
  inner = optax.contrib.dpsgd(0.1, l2_norm_clip=1.0, noise_multiplier=0.0, seed=0)
  tx = ls.static_loss_scale(inner, 4.0)
  params = _params()
  per_example = jax.tree.map(lambda x: jnp.stack([x, -2 * x, 3 * x]), _grads(0))
  scaled = jax.tree.map(lambda x: 4.0 * x, per_example)
  with standard_promotion():
    state = tx.init(params)
    p, s = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))(
      scaled, state, params
    )
    u, _ = inner.update(per_example, inner.init(params), params)
  chex.assert_trees_all_close(p, optax.apply_updates(params, u), rtol=1e-6)
  assert bool(s.last_finite)


def test_disabled_wrapper_is_the_bare_optimizer_step():
  inner = optax.adam(0.1)
  tx = ls.dynamic_loss_scale(inner, enabled=False)
  params = _params()
  step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
  with standard_promotion():
    state, bare = tx.init(params), inner.init(params)
    p, ref = params, params
    for i in range(3):
      p, state = step(_grads(i), state, p)
      u, bare = inner.update(_grads(i), bare, ref)
      ref = optax.apply_updates(ref, u)
  chex.assert_trees_all_close((p, state.inner_state), (ref, bare), rtol=1e-6)
  assert int(state.skipped_steps) == 0


# Compiled behaviour (no timings): one conditional around the whole step, no
# params-sized temporaries, and the collectives the design promises.


def _mid_tree():
  return {f"l{i}": jnp.full((256, 256), 0.01, jnp.float32) for i in range(8)}


def test_compiled_step_has_one_cond_and_no_param_sized_temporaries():
  params = _mid_tree()
  tx = ls.dynamic_loss_scale(optax.adamw(1e-3))
  p_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

  def fused(p, s, g):
    return ls.apply_gradients(tx, g, s, p)

  def composed(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def compile_(f):
    with standard_promotion():
      return (
        jax.jit(f, donate_argnums=(0, 1))
        .lower(params, tx.init(params), params)
        .compile()
      )

  c_fused, c_comp = compile_(fused), compile_(composed)
  # One conditional around the step. The finite check has none: leaves of
  # at most 2**16 elements are checked in groups, multiplied by the unscale
  # factor whatever it is (test_finite.py).
  results = re.findall(r"= (\([^)]*\)|\S+) conditional\(", c_fused.as_text())
  assert len(results) == 1
  assert results[0].strip("()") != "pred[]"
  # The composable path must hand the updates out as an array; the fused
  # step writes parameters and moments in place.
  assert c_fused.memory_analysis().temp_size_in_bytes < p_bytes / 2
  # ... once: the unscaled gradients are not written out as well (they are
  # recomputed where they are used, fused into the check and the optimizer).
  assert p_bytes <= c_comp.memory_analysis().temp_size_in_bytes < 1.5 * p_bytes
  # Neither copies a donated parameter or moment buffer (a select-based
  # skip made XLA copy every moment to keep the old values alive).
  for c in (c_fused, c_comp):
    text = c.as_text()
    entry = text[text.index("ENTRY") :].split("\n", 1)[0]
    donated = re.findall(r"([\w.]+): f32\[256,256\]", entry)
    assert len(donated) == 3 * len(params) + len(params)  # p, mu, nu; grads
    copied = set(re.findall(r"copy\(%([\w.]+)\)", text))
    assert not copied & set(donated)


def test_the_finite_check_costs_no_more_than_the_bare_check():
  # XLA's own byte count: the fused step within a few percent of the bare
  # step that also runs `all_finite` (an unscale with two multiplies in the
  # check cost one more pass over the gradients: 1.19x), and the composable
  # step within the updates array it must hand out (that regression: 1.43x).
  params = _mid_tree()
  adam, tx = optax.adamw(1e-3), ls.dynamic_loss_scale(optax.adamw(1e-3))

  def checked(p, s, g):
    u, s = adam.update(g, s, p)
    return optax.apply_updates(p, u), (s, ls.all_finite(g))

  def composed(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def fused(p, s, g):
    return ls.apply_gradients(tx, g, s, p)

  def cost(f, state):
    with standard_promotion():
      lowered = jax.jit(f, donate_argnums=(0, 1)).lower(params, state, params)
      return bytes_accessed(lowered.compile())

  base = cost(checked, adam.init(params))
  assert cost(fused, tx.init(params)) <= 1.14 * base
  assert cost(composed, tx.init(params)) <= 1.39 * base


def _all_reduces(hlo):
  """(all-reduces, all-reduces of scalars only) in compiled HLO text."""
  reduces = [
    (shapes, n) for (op, shapes), n in collectives(hlo).items() if op == "all-reduce"
  ]
  scalar = sum(n for shapes, n in reduces if all(s.endswith("[]") for s in shapes))
  return sum(n for _, n in reduces), scalar


@pytest.mark.parametrize("axis_name, extra_scalar", [(None, 0), ("batch", 1)])
def test_collectives_after_averaging_in_shard_map(axis_name, extra_scalar):
  mesh = make_mesh()
  params = {"w": jnp.ones((8, 4)), "b": jnp.ones((4,))}
  tx = ls.dynamic_loss_scale(optax.sgd(0.1), axis_name=axis_name)

  def step(fused, p, s, g):
    g = jax.lax.pmean(g, "batch")
    if fused:
      return ls.apply_gradients(tx, g, s, p)
    if fused is None:  # the bare optimizer: the baseline count
      u, _ = optax.sgd(0.1).update(g, s.inner_state, p)
      return optax.apply_updates(p, u), s
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def count(fused):
    f = _compat.shard_map(
      functools.partial(step, fused),
      mesh=mesh,
      in_specs=(P(), P(), P("batch")),
      out_specs=(P(), P()),
    )
    grads = {"w": jnp.ones((64, 4)), "b": jnp.ones((32,))}
    hlo = jax.jit(f).lower(params, tx.init(params), grads).compile().as_text()
    return _all_reduces(hlo)

  base_n, base_scalar = count(None)
  for fused in (True, False):
    n, scalar = count(fused)
    assert scalar - base_scalar == extra_scalar
    assert n - base_n == extra_scalar


@pytest.mark.parametrize(
  "make",
  [
    lambda inner: ls.dynamic_loss_scale(inner, initial_scale=64.0, growth_interval=2),
    lambda inner: ls.static_loss_scale(inner, 64.0),
    lambda inner: ls.skip_nonfinite(inner),
  ],
  ids=["dynamic", "static", "skip_nonfinite"],
)
def test_every_wrapper_with_float16_gradients(make):
  tx = make(optax.sgd(0.01, momentum=0.9))
  grads = [
    jax.tree.map(lambda x: (32.0 * x).astype(jnp.float16), _grads(i, b))
    for i, b in enumerate(_BAD[:5])
  ]
  for (fp, fs), (cp, cs) in _run_both(tx, grads, _params()):
    chex.assert_trees_all_close((fp, fs), (cp, cs), rtol=1e-6, atol=1e-7)
    assert int(fs.skipped_steps) == int(cs.skipped_steps)
  assert int(fs.skipped_steps) == 2
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fp))


def test_pmap_with_axis_name_every_replica_skips_together():
  n = 8
  tx = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=2.0, axis_name="i")
  params = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), _params())
  states = jax.pmap(tx.init)(params)
  step = jax.pmap(lambda g, s, p: ls.apply_gradients(tx, g, s, p), axis_name="i")
  good = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), _grads(0))
  # An inf on replica 3 only: every replica skips.
  bad = dict(good, w=good["w"].at[3, 0, 0].set(INF))
  p, s = step(bad, states, params)
  chex.assert_trees_all_equal(p, params)
  np.testing.assert_array_equal(s.skipped_steps, np.ones(n, np.int32))
  np.testing.assert_array_equal(s.loss_scale, np.ones(n, np.float32))
  # A finite step applies everywhere: p - 0.5 * g / scale (scale is now 1).
  p, s = step(good, s, p)
  chex.assert_trees_all_close(
    p, jax.tree.map(lambda x, g: x - 0.5 * g, params, good), rtol=1e-6
  )


@pytest.mark.parametrize("axis_name", [None, "batch"])
def test_cross_shard_mean_in_tx_is_reduced_once(axis_name):
  # The decision is taken on the averaged gradients; the applied branch uses
  # those, so the average is computed once, as with tx.update.
  mesh = make_mesh()
  params = {"w": jnp.ones((8, 4)), "b": jnp.ones((4,))}
  tx = optax.chain(
    ls.cross_shard_mean("batch"),
    ls.dynamic_loss_scale(optax.sgd(0.1), axis_name=axis_name),
  )

  def step(fused, p, s, g):
    if fused:
      return ls.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  def count(fused):
    f = _compat.shard_map(
      functools.partial(step, fused),
      mesh=mesh,
      in_specs=(P(), P(), P("batch")),
      out_specs=(P(), P()),
    )
    grads = {"w": jnp.ones((64, 4)), "b": jnp.ones((32,))}
    hlo = jax.jit(f).lower(params, tx.init(params), grads).compile().as_text()
    return _all_reduces(hlo)

  fused, composed = count(True), count(False)
  assert fused == composed
  if _compat.HAS_SHARD_MAP:  # newer XLA combines the per-leaf means into one
    assert composed[0] == 1 + (axis_name is not None)


def test_integer_parameters_with_float0_gradients_are_kept():
  # `jax.grad(..., allow_int=True)` gives float0 gradients for integer
  # parameters; `optax.masked` passes them through; the step keeps the
  # parameter (optax.apply_updates cannot add a float0).
  params = {"w": jnp.ones(2), "i": jnp.int32(3)}
  inner = optax.masked(optax.sgd(0.5), {"w": True, "i": False})
  tx = ls.dynamic_loss_scale(inner, initial_scale=4.0)
  state = tx.init(params)

  def loss(p):
    return ls.scale_loss(jnp.sum(p["w"] ** 2) * p["i"].astype(jnp.float32), state)

  grads = jax.grad(loss, allow_int=True)(params)
  assert grads["i"].dtype == jax.dtypes.float0
  step = jax.jit(ls.apply_gradients, static_argnums=0)
  for apply in (ls.apply_gradients, step):
    new_params, new_state = apply(tx, grads, state, params)
    assert_trees_equal(new_params["i"], params["i"])
    np.testing.assert_allclose(new_params["w"], 1.0 - 0.5 * 6.0)
    bad = dict(grads, w=grads["w"].at[0].set(INF))
    skipped_params, new_state = apply(tx, bad, state, params)
    assert_trees_equal(skipped_params, params)
    assert int(new_state.skipped_steps) == 1


@pytest.mark.speed_layer
def test_step_holds_no_reduction_per_leaf():
  # A reduction per leaf (the finite check's) made XLA compile a
  # thousand-leaf step for minutes (docs/performance.md, "How cost grows"):
  # both steps reduce small leaves of one size together.
  params = {f"l{i:03d}": jnp.zeros((4, 16) if i % 2 else (64,)) for i in range(640)}
  tx = ls.dynamic_loss_scale(optax.adamw(1e-3))

  def fused(p, s, g):
    return ls.apply_gradients(tx, g, s, p)

  def composed(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for step in (fused, composed):
    with standard_promotion():
      text = jax.jit(step).lower(params, tx.init(params), params).as_text()
    # Twice: the check is a conditional on the scale, with the gradients
    # multiplied by the unscale factor in one branch only.
    assert len(re.findall(r"stablehlo\.reduce\b", text)) <= 2 * (len(params) // 32 + 2)
