"""`LOSSSCALE_PLAIN=1`: the plain core, with the speed layer off.

The switch is read once, when lossscale is imported; `lossscale._wrapper`,
the one module that reaches the speed layer, holds the tricks that are on
(`TRICKS`), which these tests set directly to compare both in one process.
With every trick off, a wrapper's step and `apply_gradients` are each one
`lax.cond`; with them on the speed layer splits them. Both give the same
bits. `make test` also runs the whole suite with the switch on and the
speed layer unimportable (`make test-plain`).
"""

import collections
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import standard_promotion
from lossscale import _jax_internals, _wrapper

TESTS = pathlib.Path(__file__).resolve().parent
ALL_TRICKS = ("split", "finite", "order")


def _off(value):
  from lossscale import _speed

  return _speed.off(value)


def _names(jaxpr):
  """The primitives of `jaxpr`'s equations, nested ones included."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _names(sub)


def _conds(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  return collections.Counter(_names(_jax_internals.open_jaxpr(closed)))["cond"]


def _switch(monkeypatch, on):
  """Sets the tricks the wrapper uses (`on`: all, or none)."""
  monkeypatch.setattr(_wrapper, "TRICKS", frozenset(ALL_TRICKS if on else ()))


@pytest.fixture(params=["fast", "plain"])
def mode(request, monkeypatch):
  if request.param == "fast":
    if not _wrapper.TRICKS:
      pytest.skip("the speed layer is off in this process (LOSSSCALE_PLAIN)")
    _switch(monkeypatch, True)
  else:
    _switch(monkeypatch, False)
  return request.param


@pytest.mark.speed_layer
@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_switch_spellings(value):
  assert _off(value) == frozenset(ALL_TRICKS)
  for value in ("0", "off", ""):
    assert _off(value) == frozenset()


@pytest.mark.speed_layer
def test_the_switch_turns_off_the_tricks_it_names():
  assert _off("split, Finite") == {"split", "finite"}
  assert _off(",".join(ALL_TRICKS)) == frozenset(ALL_TRICKS)


@pytest.mark.speed_layer
def test_an_unknown_trick_is_refused_by_name():
  with pytest.raises(ValueError, match=r"LOSSSCALE_PLAIN.*'split,fast'.*unknown: fast"):
    _off("split,fast")


def _python(code, **env):
  """Runs `code` in a fresh Python with `env` added; returns its stdout."""
  environ = dict(os.environ, JAX_PLATFORMS="cpu", **env)
  environ.pop("XLA_FLAGS", None)
  environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(TESTS), str(TESTS.parent), environ.get("PYTHONPATH")])
  )
  proc = subprocess.run(
    [sys.executable, "-c", code],
    env=environ,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_the_switch_is_read_once_at_import():
  code = "from lossscale import _wrapper; print(sorted(_wrapper.TRICKS))"
  assert _python(code, LOSSSCALE_PLAIN="split").strip() == "['finite', 'order']"
  assert _python(code, LOSSSCALE_PLAIN="1").strip() == "[]"


_WITHOUT_SPEED = """
import sys
import _speed_blocker  # noqa: F401 (before lossscale)
import jax, jax.numpy as jnp, optax
import lossscale as ls
from lossscale import _wrapper
assert _wrapper.TRICKS == frozenset() and "lossscale._speed" not in sys.modules
tx = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
params = {"w": jnp.ones(2)}
state = tx.init(params)
step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
p, s = step({"w": jnp.array([4.0, 8.0])}, state, params)
q, s = step({"w": jnp.array([jnp.inf, 8.0])}, s, p)
print(p["w"].tolist(), q["w"].tolist(), int(s.skipped_steps), float(s.loss_scale))
"""


@pytest.mark.parametrize("plain", ["1", ""])
def test_the_core_runs_where_the_speed_layer_cannot_be_imported(plain):
  # `make test-plain` runs the whole suite so; this is the quick check that
  # a missing `lossscale/_speed/` is the plain core, switch or no switch.
  out = _python(_WITHOUT_SPEED, LOSSSCALE_PLAIN=plain, LOSSSCALE_BLOCK_SPEED="1")
  assert out.split() == ["[0.5,", "0.0]", "[0.5,", "0.0]", "1", "2.0"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_300_leaf_adamw_step_is_one_conditional_when_plain(dtype, mode):
  params = {f"p{i}": jnp.ones((4, 3), dtype) for i in range(300)}
  tx = ls.dynamic_loss_scale(optax.adamw(1e-3))
  state = tx.init(params)
  with standard_promotion():
    fused = _conds(
      lambda g, s, p: ls.apply_gradients(tx, g, s, p), params, state, params
    )
    composed = _conds(lambda g, s, p: tx.update(g, s, p), params, state, params)
  if mode == "plain":
    assert (fused, composed) == (1, 1)
  else:  # the speed layer splits the conditional (and the finite check)
    assert fused > 1 and composed > 1


def _run(fused, dtype, steps):
  tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    ls.dynamic_loss_scale(optax.adamw(1e-2), initial_scale=2.0**4, growth_interval=2),
    optax.trace(0.5),
  )
  rng = np.random.default_rng(0)
  params = {
    f"p{i}": jnp.asarray(rng.standard_normal((i + 1, 3)), dtype) for i in range(40)
  }
  state = tx.init(params)

  def step(g, s, p):
    if fused:
      return ls.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(step)
  out = []
  for t, bad in enumerate(steps):
    grads = jax.tree.map(lambda p, t=t: jnp.full(p.shape, 0.5 + t, p.dtype), params)
    if bad:
      grads["p7"] = grads["p7"].at[0, 0].set(jnp.inf)
    with standard_promotion():
      params, state = step(grads, state, params)
    out.append((params, state))
  return out


@pytest.mark.parametrize("fused", [False, True], ids=["tx.update", "apply_gradients"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.speed_layer
def test_plain_and_fast_give_the_same_bits(fused, dtype, monkeypatch):
  steps = [False, True, False, True, True]
  _switch(monkeypatch, True)
  fast = _run(fused, dtype, steps)
  _switch(monkeypatch, False)
  plain = _run(fused, dtype, steps)
  for a, b in zip(fast, plain, strict=True):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_new_jit_of_the_same_tx_reads_a_changed_learning_rate(mode):
  lr = [0.1]
  inner = optax.GradientTransformation(
    lambda p: optax.EmptyState(),
    lambda u, s, p=None: (jax.tree.map(lambda g: -lr[0] * g, u), s),
  )
  tx = ls.dynamic_loss_scale(inner, initial_scale=1.0)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  grads = {"w": jnp.ones(2)}
  for fused in (False, True):
    lr[0] = 0.1
    for want in (0.1, 0.25):
      lr[0] = want
      if fused:
        step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
      else:
        step = jax.jit(lambda g, s, p: optax.apply_updates(p, tx.update(g, s, p)[0]))
      new = step(grads, state, params)
      new = new[0] if fused else new
      np.testing.assert_allclose(new["w"], 1.0 - want, rtol=1e-6)


@pytest.mark.speed_layer
@pytest.mark.parametrize("fused", [False, True], ids=["tx.update", "apply_gradients"])
def test_plain_and_fast_round_a_large_step_alike(fused, monkeypatch):
  """A step split into several conditionals, with a leaf large enough to be
  checked on its own: on the newest XLA the same bits; on jax 0.4.35's XLA
  the split `apply_gradients` fuses the AdamW step differently and may
  round otherwise: each float leaf within 2**-22 of its largest magnitude
  per step (measured: 1.5e-7 of it), the bound docs/troubleshooting.md
  states. Each step starts both from the same parameters and state."""
  rng = np.random.default_rng(1)
  params = {
    f"p{i:02d}": jnp.asarray(rng.standard_normal(3), jnp.float32) for i in range(40)
  }
  params["big"] = jnp.asarray(rng.standard_normal(70_000), jnp.float32)
  tx = ls.dynamic_loss_scale(optax.adamw(1e-2), initial_scale=2.0**4, growth_interval=2)

  def step(g, s, p):
    if fused:
      return ls.apply_gradients(tx, g, s, p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  compiled = {on: jax.jit(lambda g, s, p: step(g, s, p)) for on in (True, False)}
  state = tx.init(params)
  for t in range(4):
    grads = jax.tree.map(
      lambda p, t=t: jnp.asarray(rng.standard_normal(p.shape) * 2.0**4, p.dtype), params
    )
    with standard_promotion():
      _switch(monkeypatch, True)
      fast = compiled[True](grads, state, params)
      _switch(monkeypatch, False)
      plain = compiled[False](grads, state, params)
    for x, y in zip(jax.tree.leaves(fast), jax.tree.leaves(plain), strict=True):
      x, y = np.asarray(x), np.asarray(y)
      if np.issubdtype(x.dtype, np.floating):
        np.testing.assert_allclose(x, y, rtol=0, atol=2.0**-22 * np.abs(x).max())
      else:
        np.testing.assert_array_equal(x, y)
    params, state = fast
