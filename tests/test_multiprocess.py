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

from _helpers import make_mesh

_WORKER = pathlib.Path(__file__).with_name("_multiprocess_worker.py")
_ERRORS = ("-W", "error")  # warnings are errors, as in the suite (pyproject.toml)


def _load_worker():
  spec = importlib.util.spec_from_file_location("_multiprocess_worker", _WORKER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_skip_together(tmp_path):
  worker = _load_worker()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the children set 2 devices each themselves
  env["JAX_PLATFORMS"] = "cpu"
  root = str(pathlib.Path(__file__).resolve().parents[1])
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  coordinator = f"127.0.0.1:{_free_port()}"
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  children = []
  try:
    for i in range(2):
      with open(logs[i], "w") as log:
        children.append(
          subprocess.Popen(
            [sys.executable, *_ERRORS, str(_WORKER), coordinator, str(i), str(outs[i])],
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
  results = [json.loads(out.read_text()) for out in outs]

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
