"""`LOSSSCALE_PLAIN=1`: the plain core, with the speed layer off.

The switch is read when a step is traced. With it, a wrapper's step and
`apply_gradients` are each one `lax.cond`; without it the speed layer
splits them. Both give the same bits. `make test` also runs the contract
test files with the switch on (`make test-plain`).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls
from _helpers import standard_promotion
from lossscale import _jax_internals, _speed


def _conds(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  names = (
    e.primitive.name
    for e in _jax_internals.eqns_within(_jax_internals.open_jaxpr(closed))
  )
  return collections.Counter(names)["cond"]


@pytest.fixture(params=["fast", "plain"])
def mode(request, monkeypatch):
  if request.param == "plain":
    monkeypatch.setenv("LOSSSCALE_PLAIN", "1")
  else:
    monkeypatch.delenv("LOSSSCALE_PLAIN", raising=False)
  return request.param


@pytest.mark.parametrize("value", ["1", "true", "ON", " yes "])
def test_switch_spellings(value, monkeypatch):
  monkeypatch.setenv("LOSSSCALE_PLAIN", value)
  assert _speed.plain()
  assert not any(_speed.on(t) for t in _speed.TRICKS)
  for value in ("0", "off", ""):
    monkeypatch.setenv("LOSSSCALE_PLAIN", value)
    assert not _speed.plain() and all(_speed.on(t) for t in _speed.TRICKS)
  monkeypatch.delenv("LOSSSCALE_PLAIN")
  assert not _speed.off()


def test_the_switch_turns_off_the_tricks_it_names(monkeypatch):
  monkeypatch.setenv("LOSSSCALE_PLAIN", "split, Once")
  assert [_speed.on(t) for t in _speed.TRICKS] == [False, False, True, True]
  assert not _speed.plain()
  monkeypatch.setenv("LOSSSCALE_PLAIN", ",".join(_speed.TRICKS))
  assert _speed.plain()


def test_an_unknown_trick_is_refused_by_name(monkeypatch):
  monkeypatch.setenv("LOSSSCALE_PLAIN", "split,fast")
  with pytest.raises(ValueError, match=r"LOSSSCALE_PLAIN.*'split,fast'.*unknown: fast"):
    _speed.on("split")


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
def test_plain_and_fast_give_the_same_bits(fused, dtype, monkeypatch):
  steps = [False, True, False, True, True]
  monkeypatch.delenv("LOSSSCALE_PLAIN", raising=False)
  fast = _run(fused, dtype, steps)
  monkeypatch.setenv("LOSSSCALE_PLAIN", "1")
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

  compiled = {}
  for value in ("0", "1"):
    monkeypatch.setenv("LOSSSCALE_PLAIN", value)
    compiled[value] = jax.jit(lambda g, s, p: step(g, s, p))
  state = tx.init(params)
  for t in range(4):
    grads = jax.tree.map(
      lambda p, t=t: jnp.asarray(rng.standard_normal(p.shape) * 2.0**4, p.dtype), params
    )
    with standard_promotion():
      monkeypatch.setenv("LOSSSCALE_PLAIN", "0")
      fast = compiled["0"](grads, state, params)
      monkeypatch.setenv("LOSSSCALE_PLAIN", "1")
      plain = compiled["1"](grads, state, params)
    for x, y in zip(jax.tree.leaves(fast), jax.tree.leaves(plain), strict=True):
      x, y = np.asarray(x), np.asarray(y)
      if np.issubdtype(x.dtype, np.floating):
        np.testing.assert_allclose(x, y, rtol=0, atol=2.0**-22 * np.abs(x).max())
      else:
        np.testing.assert_array_equal(x, y)
    params, state = fast
