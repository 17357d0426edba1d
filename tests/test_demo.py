"""Runs `python examples/demo.py --quick` and checks what it prints and writes."""

import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"
MODES = ["float32", "float16", "float16+scaling", "bfloat16"]


def _run(*args):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
  )
  env["JAX_PLATFORMS"] = "cpu"
  # The quick run is compile-bound: less XLA optimisation makes it about a
  # third faster (the test checks outputs, not speed or exact numerics).
  env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
  return subprocess.run(
    [sys.executable, str(DEMO), *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )


def test_quick_demo_prints_table_and_writes_figure_and_json(tmp_path):
  proc = _run("--quick", "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout

  assert "| mode | train loss | val loss | tokens/s | skipped | final scale" in out
  for mode in MODES:
    assert f"| {mode} |" in out
    assert mode in proc.stderr  # its progress bar
  assert "Validation loss vs float32: float16+scaling" in out
  png = (tmp_path / "demo.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  assert (tmp_path / "results.md").read_text().startswith("| mode |")

  saved = json.loads((tmp_path / "results.json").read_text())
  results = {r["mode"]: r for r in saved["results"]}
  assert list(results) == MODES
  steps = saved["config"]["steps"]
  start = math.log(128)  # an untrained model's loss: ln(vocabulary size)
  for r in results.values():
    assert len(r["losses"]) == steps
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["val_loss"] < start and r["train_loss"] < start
    assert r["evals"][-1][0] == steps
    assert 0.0 <= r["grad_zeroed_fraction"] <= 1.0
    assert 0.0 <= r["f16_underflow_at_scale"] <= 1.0
  # Only the loss-scaling modes have a scale and count skipped steps.
  assert results["float32"]["skipped_steps"] is None
  assert results["float16"]["final_loss_scale"] is None
  scaling = results["float16+scaling"]
  assert len(scaling["scales"]) == steps
  assert scaling["scales"][0] == 2.0**15
  assert scaling["skipped_steps"] == len(scaling["skipped_at"])
  assert results["bfloat16"]["final_loss_scale"] == 1.0
  # float32's gradients are the reference: nothing zeroed, no error.
  assert results["float32"]["grad_zeroed_fraction"] == 0.0
  assert results["float32"]["grad_relative_error"] == 0.0


def test_demo_rejects_too_few_steps(tmp_path):
  proc = _run("--quick", "--steps", "1", "--out", str(tmp_path))
  assert proc.returncode == 2
  assert "--steps must be at least 2, got 1" in proc.stderr
