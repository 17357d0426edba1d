"""Each use of JAX's private surface (`lossscale/_jax_internals.py`), checked
on its own: the suite runs at both ends of the supported range (`make test`
runs it on the newest JAX and on jax 0.4.35), so a release that changes one
fails here, by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lossscale import _jax_internals as internals


def _primitives(jaxpr):
  return [e.primitive.name for e in internals.eqns_within(jaxpr)]


def test_staging_tells_a_trace_from_an_eager_call():
  seen = []

  def f(x):
    seen.append(internals.staging())
    return x

  f(1.0)
  jax.jit(f)(1.0)
  jax.make_jaxpr(lambda x: f(x))(1.0)  # not `f`: `jit(f)`'s trace is cached
  jax.vmap(f)(jnp.ones(2))  # an eager vmap stages nothing
  assert seen == [False, True, True, False]


def test_batched_tells_a_vmapped_value():
  seen = []

  def f(x):
    seen.append(internals.batched(x))
    return x

  jax.vmap(f)(jnp.ones(2))
  jax.jit(f)(jnp.ones(2))
  f(jnp.ones(2))
  assert seen == [True, False, False]


def test_effects_and_values_handed_out():
  def printing(x):
    jax.debug.print("{}", x)
    return x

  def calling_out(x):
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct((), jnp.float32), x)

  def vmap_collective(x):
    return jax.vmap(lambda y: jax.lax.psum(y, "i"), axis_name="i")(x)

  x, xs = jnp.float32(1.0), jnp.ones(2)
  closed = {
    "print": jax.make_jaxpr(printing)(x),
    "pure_callback": jax.make_jaxpr(calling_out)(x),
    "vmap collective": jax.make_jaxpr(vmap_collective)(xs),
    "plain": jax.make_jaxpr(jnp.sin)(x),
  }
  effects = {k: internals.has_effects(c) for k, c in closed.items()}
  assert effects == {
    "print": True,
    "pure_callback": False,
    "vmap collective": False,
    "plain": False,
  }
  handed_out = {k: internals.hands_out(c) for k, c in closed.items()}
  assert handed_out == {
    "print": True,
    "pure_callback": True,
    "vmap collective": False,
    "plain": False,
  }


def test_eqns_within_reaches_calls_and_branches():
  def f(x):
    inner = jax.jit(lambda y: jnp.sin(y))
    return jax.lax.cond(x > 0, lambda: inner(x), lambda: jnp.cos(x))

  jaxpr = internals.open_jaxpr(jax.make_jaxpr(f)(1.0))
  names = _primitives(jaxpr)
  assert {"cond", "sin", "cos", "gt"} <= set(names)
  (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
  nested = {e.primitive.name for e in internals.eqns_nested_in(cond)}
  assert {"sin", "cos"} <= nested and "cond" not in nested


def test_live_eqns_drop_dead_code_and_literals():
  def f(x):
    dead = jnp.cos(x)  # noqa: F841 - kept by make_jaxpr, not used
    return jnp.sin(x), 2.0

  jaxpr = internals.open_jaxpr(jax.make_jaxpr(f)(1.0))
  assert "cos" in [e.primitive.name for e in jaxpr.eqns]
  assert [e.primitive.name for e in internals.live_eqns(jaxpr)] == ["sin"]
  assert internals.is_literal(jaxpr.outvars[1])
  assert not internals.is_literal(jaxpr.outvars[0])


def test_a_jaxpr_runs_as_a_function():
  closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
  (out,) = internals.jaxpr_as_fun(closed)(jnp.float32(0.5))
  np.testing.assert_array_equal(out, jnp.sin(jnp.float32(0.5)) * 2)


def test_equations_rebound_and_repointed_build_a_conditional():
  """What `_speed.split` does: equations evaluated one by one in a trace,
  and re-pointed at fresh variables to build the branches of a `cond`
  primitive bound directly."""

  def f(x):
    return jnp.sin(x) * 2 + 1

  closed = jax.make_jaxpr(f)(1.0)
  jaxpr = internals.open_jaxpr(closed)
  x = jnp.float32(0.7)

  def evaluate(y):
    env = {jaxpr.invars[0]: y}
    for eqn in jaxpr.eqns:
      args = [env[v] if not internals.is_literal(v) else v.val for v in eqn.invars]
      env.update(zip(eqn.outvars, internals.bind_eqn(eqn, args), strict=True))
    return env[jaxpr.outvars[0]]

  np.testing.assert_array_equal(evaluate(x), f(x))
  np.testing.assert_array_equal(jax.jit(evaluate)(x), jax.jit(f)(x))

  def branch(eqns_from):
    invar = internals.new_var(jaxpr.invars[0].aval)
    env = {jaxpr.invars[0]: invar}
    eqns = []
    for eqn in eqns_from:
      ins = [v if internals.is_literal(v) else env[v] for v in eqn.invars]
      outs = [internals.new_var(v.aval) for v in eqn.outvars]
      env.update(zip(eqn.outvars, outs, strict=True))
      eqns.append(internals.repoint_eqn(eqn, ins, outs))
    info = internals.nameless_debug_info(closed)
    return internals.closed_jaxpr([invar], [env[jaxpr.outvars[0]]], eqns, info)

  identity = internals.closed_jaxpr(
    [v := internals.new_var(jaxpr.invars[0].aval)],
    [v],
    [],
    internals.nameless_debug_info(closed),
  )
  branches = (identity, branch(jaxpr.eqns))

  @jax.jit
  def built(pred, y):
    index = jax.lax.convert_element_type(pred, jnp.int32)
    return internals.bind_cond(index, [y], branches)[0]

  np.testing.assert_array_equal(built(True, x), f(x))
  np.testing.assert_array_equal(built(False, x), x)
  assert "cond" in _primitives(internals.open_jaxpr(jax.make_jaxpr(built)(True, x)))


@pytest.mark.parametrize("shape", [(), (3, 2)])
def test_new_var_has_the_type_asked_for(shape):
  aval = jax.make_jaxpr(lambda x: x)(jnp.zeros(shape)).in_avals[0]
  var = internals.new_var(aval)
  assert var.aval.shape == shape and var.aval.dtype == jnp.float32
