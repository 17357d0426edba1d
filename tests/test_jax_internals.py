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
  """The primitives of `jaxpr`'s equations, nested ones included."""
  names = []
  for eqn in jaxpr.eqns:
    names.append(eqn.primitive.name)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          names += _primitives(sub)
  return names


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


def test_inspect_finds_values_handed_out():
  def printing(x):
    jax.debug.print("{}", x)
    return x

  def calling_out(x):
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct((), jnp.float32), x)

  def calling_out_in_a_branch(x):
    return jax.lax.cond(x > 0, lambda: calling_out(x), lambda: x)

  def vmap_collective(x):
    return jax.vmap(lambda y: jax.lax.psum(y, "i"), axis_name="i")(x)

  x, xs = jnp.float32(1.0), jnp.ones(2)
  closed = {
    "print": jax.make_jaxpr(printing)(x),
    "pure_callback": jax.make_jaxpr(calling_out)(x),
    "in a branch": jax.make_jaxpr(calling_out_in_a_branch)(x),
    "vmap collective": jax.make_jaxpr(vmap_collective)(xs),
    "plain": jax.make_jaxpr(jnp.sin)(x),
  }
  handed_out = {k: internals.inspect(c)[1] for k, c in closed.items()}
  assert handed_out == {
    "print": True,
    "pure_callback": True,
    "in a branch": True,
    "vmap collective": False,
    "plain": False,
  }


def test_inspect_finds_the_named_axes_of_live_collectives():
  def f(x):
    dead = jax.lax.psum(x, "dead")  # noqa: F841 - kept by make_jaxpr, not used
    inner = jax.jit(lambda y: jax.lax.pmean(y, ("b", "a")))
    x = jax.lax.cond(x.sum() > 0, lambda: inner(x), lambda: x)
    x = x + jax.lax.axis_index("c").astype(x.dtype)  # names an axis only
    return jax.lax.psum(x, "a"), jnp.sum(x, axis=0)  # positional: no name

  # Traced under bound names, as inside `pmap` or `shard_map`.
  inner = jax.make_jaxpr(f, axis_env=[("a", 1), ("b", 1), ("c", 1), ("dead", 1)])(
    jnp.ones(3)
  )
  assert internals.inspect(inner) == (("b", "a"), False)


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
