"""Eager steps: compiled once, the inner optimizer run op by op, Python state it
reads read on every step; and every traced step traces it anew."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import CompilationCounter, assert_trees_close, standard_promotion

INF, NAN = float("inf"), float("nan")

WRAPPERS = {
  "dynamic": lambda inner: ls.dynamic_loss_scale(inner, initial_scale=4.0),
  "static": lambda inner: ls.static_loss_scale(inner, 4.0),
  "skip_nonfinite": ls.skip_nonfinite,
  "disabled": lambda inner: ls.dynamic_loss_scale(inner, enabled=False),
}


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}


def _grads(i, bad=None):
  g = jax.tree.map(lambda x: x * 0.0 + 0.5 * (i + 1), _params())
  if bad is not None:
    g["w"] = g["w"].at[1, 2].set(bad)
  return g


_BAD = [None, INF, None, NAN, None, None]


def _eager_and_jitted(step, state, params):
  """Runs `step` eagerly (counting compilations after the first call) and
  jitted, over `_BAD`; returns both results and the count."""
  with standard_promotion():
    out = {}
    for name, fn in [("jitted", jax.jit(step)), ("eager", step)]:
      p, s = fn(_grads(0), state, params)  # the first call compiles
      counter = CompilationCounter()
      for i, bad in enumerate(_BAD):
        p, s = fn(_grads(i, bad), s, p)
      out[name] = (p, s), counter.count
  return out["eager"][0], out["jitted"][0], out["eager"][1]


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_eager_update_compiles_only_on_its_first_call(name):
  tx = WRAPPERS[name](optax.adam(0.1))

  def step(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  eager, jitted, compilations = _eager_and_jitted(step, tx.init(_params()), _params())
  assert compilations == 0
  assert_trees_close(eager, jitted)
  if name in ("dynamic", "static", "skip_nonfinite"):
    assert int(eager[1].skipped_steps) == 2


def test_eager_apply_gradients_compiles_only_on_its_first_call():
  tx = optax.chain(
    optax.clip_by_global_norm(1e3),
    ls.dynamic_loss_scale(optax.adamw(0.1), initial_scale=4.0, growth_interval=2),
  )

  def step(g, s, p):
    return ls.apply_gradients(tx, g, s, p)

  eager, jitted, compilations = _eager_and_jitted(step, tx.init(_params()), _params())
  assert compilations == 0
  assert_trees_close(eager, jitted)
  assert int(eager[1][1].skipped_steps) == 2


def test_eager_extra_arguments_callables_and_python_numbers():
  # optax.lbfgs takes a callable (`value_fn`) and runs a line search in a
  # `lax.while_loop` of fresh closures, which JAX compiles on every eager
  # call: the wrapped step, run op by op, compiles what the bare one does,
  # no more, and takes the same steps.
  def loss(p):
    return jnp.sum((p["w"] - 1.0) ** 2) + jnp.sum(p["b"] ** 2)

  value_and_grad = jax.jit(jax.value_and_grad(loss))

  def run(tx, scale):
    params = _params()
    state = tx.init(params)
    with standard_promotion():
      for i in range(4):
        if i == 1:
          counter = CompilationCounter()
        value, g = value_and_grad(params)
        scaled = jax.tree.map(lambda x: scale * x, g)
        extra = dict(value=float(value), grad=g, value_fn=loss)
        if scale == 1:
          u, state = tx.update(g, state, params, **extra)
          params = optax.apply_updates(params, u)
        else:
          params, state = ls.apply_gradients(tx, scaled, state, params, **extra)
    return params, counter.count

  bare, bare_compilations = run(optax.lbfgs(), 1)
  wrapped, compilations = run(ls.static_loss_scale(optax.lbfgs(), 16.0), 16.0)
  assert compilations <= bare_compilations
  assert_trees_close(wrapped, bare)
  assert float(loss(wrapped)) < 1e-3

  scalar = ls.static_loss_scale(optax.sgd(1.0), 2.0)
  s = scalar.init(jnp.zeros(()))
  scalar.update(1.0, s)
  counter = CompilationCounter()
  u, _ = scalar.update(3.0, s)
  assert counter.count == 0
  assert float(u) == -1.5


def test_unhashable_static_argument_runs_uncompiled():
  class Unhashable:
    __hash__ = None

  seen = []

  def record(updates, state, params=None, *, tag=None):
    seen.append(tag)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), record)
  tx = ls.skip_nonfinite(inner)
  state = tx.init(jnp.zeros(2))
  tag = Unhashable()
  u, _ = tx.update(jnp.ones(2), state, tag=tag)
  assert seen and all(t is tag for t in seen)
  assert u.tolist() == [1.0, 1.0]


def test_eager_steps_keep_only_a_few_static_arguments_alive():
  # A new `value_fn` closure every step (and what it captures), or a new
  # `tx` every call: the compiled steps kept for them are bounded, not one
  # per step for the life of the process.
  import gc
  import weakref

  class Captured:
    pass

  def f(w):
    return jnp.sum((w - 1.0) ** 2)

  tx = ls.static_loss_scale(optax.lbfgs(), 4.0)
  w = jnp.zeros(3)
  state = tx.init(w)
  refs = []
  with standard_promotion():
    for _ in range(20):
      captured = Captured()
      refs.append(weakref.ref(captured))
      value_fn = lambda p, c=captured: f(p)
      v, g = ls.value_and_grad(value_fn)(state, w)
      u, state = tx.update(g, state, w, value=v, grad=g, value_fn=value_fn)
      w = optax.apply_updates(w, u)
      del captured, value_fn
    txs = []
    for _ in range(20):
      captured = Captured()
      refs.append(weakref.ref(captured))
      fresh = ls.dynamic_loss_scale(optax.sgd(lambda count, c=captured: 0.1))
      ls.apply_gradients(
        fresh, {"w": jnp.ones(2)}, fresh.init({"w": jnp.ones(2)}), {"w": jnp.ones(2)}
      )
      del captured, fresh
    del txs
  gc.collect()
  alive = sum(r() is not None for r in refs)
  assert alive <= 20, f"{alive} of 40 captured objects still alive"
  assert float(f(w)) < float(f(jnp.zeros(3)))


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("name", list(WRAPPERS))
def test_eager_steps_read_the_inner_optimizers_python_state_every_step(name, fused):
  # A learning rate held in Python and changed between steps: the bare
  # optimizer, run eagerly, reads it on every step, and so does the wrapped
  # one (run op by op), step for step, skipped steps included.
  lr = {"now": 0.1}
  schedule = lambda count: lr["now"]
  tx = WRAPPERS[name](optax.sgd(schedule))
  bare = optax.sgd(schedule)
  params = want = _params()
  state, bare_state = tx.init(params), bare.init(want)
  with standard_promotion():
    for i, bad in enumerate([None, None, INF, None, None]):
      if i == 2:
        lr["now"] = 0.01
      g = _grads(i, bad)
      scale = ls.get_loss_scale(state)
      scaled = jax.tree.map(lambda x, s=scale: x * s, g)
      if fused:
        params, state = ls.apply_gradients(tx, scaled, state, params)
      else:
        u, state = tx.update(scaled, state, params)
        params = optax.apply_updates(params, u)
      if bad is None or name == "disabled":
        u, bare_state = bare.update(g, bare_state, want)
        want = optax.apply_updates(want, u)
      assert_trees_close(params, want)
  assert float(want["b"][0]) != float(_params()["b"][0])


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("how", ["fresh jit", "eager vmap"])
def test_each_step_traces_the_inner_optimizer_anew(how, fused):
  # One wrapper, a learning rate held in Python and changed between steps:
  # a new `jax.jit` of the step (or an eager `jax.vmap`, whose flag is per
  # member) reads the new value, as the bare optimizer does; a step's passes
  # share one trace, steps do not.
  lr = {"now": 0.1}
  tx = ls.dynamic_loss_scale(optax.sgd(lambda count: lr["now"]), initial_scale=1.0)
  params = {"w": jnp.zeros(3)}
  grads = {"w": jnp.ones(3)}

  def step(g, s, p):
    if fused:
      return ls.apply_gradients(tx, g, s, p)[0]["w"]
    return optax.apply_updates(p, tx.update(g, s, p)[0])["w"]

  got = []
  for now in (0.1, 0.5, 2.0):
    lr["now"] = now
    if how == "fresh jit":  # a new function: JAX caches traces by function
      out = jax.jit(lambda g, s, p: step(g, s, p))(grads, tx.init(params), params)
    else:
      stacked = jax.tree.map(lambda x: jnp.stack([x, x]), (grads, params))
      states = jax.vmap(tx.init)(stacked[1])
      out = jax.vmap(step)(stacked[0], states, stacked[1])[0]
    got.append(float(out[0]))
  np.testing.assert_allclose(got, [-0.1, -0.5, -2.0])
