"""Tests of all_finite (lossscale/_finite.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale as ls


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_all_finite_per_dtype(dtype):
  ok = {"a": jnp.ones((2, 3), dtype), "b": [jnp.zeros(4, dtype)]}
  assert bool(jax.jit(ls.all_finite)(ok))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    tree = {"a": ok["a"], "b": [ok["b"][0].at[3].set(bad)]}
    assert not bool(jax.jit(ls.all_finite)(tree))


def test_all_finite_ignores_integer_bool_and_missing_leaves():
  tree = {
    "i": jnp.arange(3),
    "b": jnp.array([True]),
    "n": None,
    "m": optax.MaskedNode(),
    "e": jnp.zeros((0, 3)),
    "f": jnp.ones(()),
  }
  assert bool(ls.all_finite(tree))
  assert bool(ls.all_finite({}))
  assert bool(ls.all_finite([]))
  assert ls.all_finite({}).dtype == jnp.bool_


def test_all_finite_complex():
  assert bool(ls.all_finite(jnp.array([1 + 2j])))
  assert not bool(ls.all_finite(jnp.array([complex(1, np.inf)])))
