"""Data parallel cannot hang or drift, wherever the collective stands.

Every placement of `cross_shard_mean` (or a hand-written `pmean`) before,
inside and after a wrapper, under `jax.pmap` and `shard_map`, with
`tx.update` and with `apply_gradients`: either every replica takes the same
decision, or the step fails at trace time with an error naming `axis_name`.
Each (mapper, style) runs in a subprocess with a timeout
(`tests/_placements.py`): a placement that hangs fails here instead of
stalling the suite. docs/data-parallel.md has the same table.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import _placements
from _helpers import standard_promotion

_WORKER = pathlib.Path(__file__).with_name("_placements.py")
_TIMEOUT = 300  # seconds, for all placements of one (mapper, style)

# Placements whose gradients are averaged before the inner optimizer runs:
# their finite step is the inner optimizer on the mean gradients, unscaled.
_MEAN_FIRST = {
  "before": 2.0**14,
  "inside": 2.0**14,
  "inside, axis_name": 2.0**14,
  "static, inside": 128.0,
  "skip_nonfinite, inside": 1.0,
  "hand-written pmean, inside": 2.0**14,
}
# tx.update cannot see a collective chained after the wrapper: our own
# `cross_shard_mean` refuses per-replica updates; a hand-written `pmean`
# cannot be told apart (documented: pass `axis_name`).
_REFUSED = {("tx.update", "after")}
_UNDETECTED = {("tx.update", "hand-written pmean, after")}


def _run_all(mapper, style):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the child sets 2 devices itself
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  try:
    done = subprocess.run(
      [sys.executable, str(_WORKER), mapper, style],
      env=env,
      cwd=pathlib.Path(__file__).parent,
      capture_output=True,
      text=True,
      timeout=_TIMEOUT,
    )
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"{mapper} / {style}: a placement hung:\n{e.stdout}\n{e.stderr}")
  assert done.returncode == 0, done.stderr[-4000:]
  return {r["placement"]: r for r in map(json.loads, done.stdout.splitlines())}


def _reference(scale):
  """The inner optimizer on the replicas' mean (finite) gradients."""
  inner = _placements._inner()
  params = {"w": jnp.ones(3)}
  grads = {"w": jnp.asarray(_placements.GRADS[1].mean(0)) / scale}
  with standard_promotion():
    updates, _ = inner.update(grads, inner.init(params), params)
  return np.asarray(optax.apply_updates(params, updates)["w"])


@pytest.mark.parametrize("style", ["tx.update", "apply_gradients"])
@pytest.mark.parametrize("mapper", ["pmap", "shard_map"])
def test_every_placement_agrees_or_refuses_at_trace_time(mapper, style):
  results = _run_all(mapper, "update" if style == "tx.update" else style)
  assert set(results) == set(_placements.PLACEMENTS)
  for name, r in results.items():
    if (style, name) in _REFUSED:
      assert "axis_name='i'" in r["error"] and "before the wrapper" in r["error"]
      continue
    assert "error" not in r, (name, r)
    if (style, name) in _UNDETECTED:
      assert r["scales"][0][0] != r["scales"][0][1], name  # documented drift
      continue
    for scales, skipped in zip(r["scales"], r["skipped"], strict=True):
      assert scales[0] == scales[1] and skipped == [1, 1], (name, r)
    first, second = (np.asarray(p) for p in r["params"])
    np.testing.assert_array_equal(first, np.ones((2, 3)), err_msg=name)  # skipped
    np.testing.assert_array_equal(second[0], second[1], err_msg=name)
    assert not np.array_equal(second, first), name  # the finite step applied
    if name in _MEAN_FIRST:
      np.testing.assert_allclose(second[0], _reference(_MEAN_FIRST[name]), rtol=1e-6)
