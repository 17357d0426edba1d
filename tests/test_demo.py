"""Runs examples/demo.py at its --quick size and checks what it writes."""

import importlib.util
import json
import math
import pathlib
import sys

import jax
import pytest

DEMO = pathlib.Path(__file__).resolve().parents[1] / "examples" / "demo.py"


@pytest.fixture(scope="module")
def demo():
  spec = importlib.util.spec_from_file_location("lossscale_demo", DEMO)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  try:
    spec.loader.exec_module(module)
    yield module
  finally:
    del sys.modules[spec.name]


def test_quick_demo_writes_table_figure_and_json(demo, tmp_path, capsys):
  # optax.adamw needs standard promotion (tests run with strict).
  with jax.numpy_dtype_promotion("standard"):
    payload = demo.main(["--quick", "--out", str(tmp_path)])
  out = capsys.readouterr().out

  assert "| mode | train loss | val loss | tokens/s | skipped | final scale" in out
  for mode in demo.MODES:
    assert f"| {mode} |" in out
  png = (tmp_path / "demo.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  assert (tmp_path / "results.md").read_text().startswith("| mode |")

  saved = json.loads((tmp_path / "results.json").read_text())
  assert saved == json.loads(json.dumps(payload))
  results = {r["mode"]: r for r in saved["results"]}
  assert list(results) == list(demo.MODES)
  steps = saved["config"]["steps"]
  start = math.log(demo.VOCAB)  # an untrained model's loss, about ln(128)
  for r in results.values():
    assert len(r["losses"]) == steps
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["val_loss"] < start and r["train_loss"] < start
    assert r["evals"][-1][0] == steps
    assert 0.0 <= r["grad_zeroed_fraction"] <= 1.0
  # Only the loss-scaling modes have a scale and count skipped steps.
  assert results["float32"]["skipped_steps"] is None
  assert results["float16"]["final_loss_scale"] is None
  scaling = results["float16+scaling"]
  assert len(scaling["scales"]) == steps
  assert scaling["scales"][0] == 2.0**15
  assert scaling["skipped_steps"] == len(scaling["skipped_at"])
  assert results["bfloat16"]["final_loss_scale"] == 1.0
  # float32 gradients are float32's own: nothing zeroed, no error.
  assert results["float32"]["grad_zeroed_fraction"] == 0.0
  assert results["float32"]["grad_relative_error"] == 0.0


def test_demo_rejects_too_few_steps(demo, tmp_path):
  with pytest.raises(SystemExit):
    demo.main(["--quick", "--steps", "1", "--out", str(tmp_path)])
