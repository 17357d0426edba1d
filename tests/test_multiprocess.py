"""Two JAX processes on loopback (2 CPU devices each, gloo collectives) take
the same decisions as one process on 4 devices: `tests/_multiprocess_worker.py`
runs in each.
"""

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from _helpers import make_mesh

_WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")
# Warnings are errors, as in the suite, with its one exception for a
# dependency's import (pyproject.toml: orbax-checkpoint under JAX 0.12.1).
_ERRORS = (
  "-W",
  "error",
  "-W",
  "ignore:jax.sharding.SingleDeviceSharding is deprecated:DeprecationWarning",
)


def _load_worker():
  spec = importlib.util.spec_from_file_location("_multiprocess_worker", _WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
  """Runs the two workers once; returns what each wrote."""
  tmp_path = tmp_path_factory.mktemp("multiprocess")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the children set 2 devices each themselves
  env["JAX_PLATFORMS"] = "cpu"
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  coordinator = f"127.0.0.1:{_free_port()}"
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  ckpt_dir = (tmp_path / "checkpoints").absolute()
  children = []
  try:
    for i in range(2):
      args = [coordinator, str(i), str(outs[i]), str(ckpt_dir)]
      with open(logs[i], "w") as log:
        children.append(
          subprocess.Popen(
            [sys.executable, *_ERRORS, str(_WORKER), *args],
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
  return [json.loads(out.read_text()) for out in outs]


def test_two_processes_skip_together(two_processes):
  worker = _load_worker()
  results = two_processes
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
  ref = worker.train(make_mesh((4,), ("batch",)), results[0]["bad_positions"])
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


def test_two_processes_skip_a_bad_loss_and_a_spike_together(two_processes):
  # Each device hands the wrapper its own loss; one process's is NaN at one
  # step and spikes at another. Both processes skip both steps, for those
  # reasons, with the scale unmoved and bit-identical windows; as one
  # process on 4 devices does.
  worker = _load_worker()
  first, second = two_processes
  for key in ("reasons", "reason_scales", "windows"):
    assert first[key] == second[key], key
  want = [0] * 8
  want[worker.NAN_STEP], want[worker.SPIKE_STEP] = 2, 3  # SKIP_REASONS order + 1
  assert first["reasons"] == want
  assert first["reason_scales"] == [2.0**8] * 8
  ref = worker.skip_reasons(make_mesh((4,), ("batch",)), first["bad_positions"])
  assert first["reasons"] == ref["reasons"]


def test_set_loss_scale_keeps_a_global_state_global(two_processes):
  # After a jitted step the scale is one array over both processes' devices;
  # `set_loss_scale` keeps it so (a host-local array in its place is what
  # orbax refuses to save in a multi-process run).
  for r in two_processes:
    assert r["reset_global"] == [True, True]
    assert r["reset_sharding_kept"] == [True, True]


def test_upgrade_state_keeps_a_global_state_global(two_processes):
  # The fields an upgraded state gains are placed like the ones it had: one
  # array over both processes' devices, which orbax saves and restores.
  for r in two_processes:
    assert r["upgraded_global"] == [True] * 4
    assert r["upgraded_sharding_kept"] == [True] * 4
    if "upgraded_restored" in r:
      assert r["upgraded_restored"] == [1, 0, 0, 0]


def test_a_global_state_saves_with_orbax_after_set_loss_scale(two_processes):
  if "restored_scale" not in two_processes[0]:
    pytest.skip("this orbax cannot checkpoint across processes with this JAX")
  for r in two_processes:
    assert r["restored_scale"] == 2.0**10
    assert r["restored_good_steps"] == 0
    # The inner state came through too: one step of momentum on gradients of
    # ones, which the wrapper unscaled by the initial scale 2**8.
    assert r["restored_momentum"] == [2.0**-8] * 4


def test_no_placement_leaves_one_process_waiting(two_processes):
  # Both processes finished (the fixture's deadline) and took one decision:
  # a collective inside or after the wrapper joins the decision's axes, or
  # `cross_shard_mean` after a per-replica wrapper refuses at trace time.
  first, second = (r["placements"] for r in two_processes)
  assert "axis_name='i'" in first["update: after"]["error"]
  assert "axis_name='i'" in second["update: after"]["error"]
  agreeing = [k for k in first if k != "update: after"]
  agreeing.remove("update: hand-written pmean, after")  # documented: axis_name
  for key in agreeing:
    scales = first[key]["scales"][0] + second[key]["scales"][0]
    assert scales == [2.0**14] * 4, key
    assert first[key]["skipped"] == second[key]["skipped"] == [[1, 1], [1, 1]], key
    assert first[key]["params"][1] == second[key]["params"][1], key
