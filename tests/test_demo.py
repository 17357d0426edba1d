"""The examples: `examples/demo.py --quick` end to end, and the quickstart."""

import json
import math
import os
import pathlib
import re
import runpy
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

import lossscale as ls
from _helpers import standard_promotion

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.py"
QUICKSTART = ROOT / "examples" / "quickstart.py"
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


def test_quick_demo_prints_tables_and_writes_figure_and_json(tmp_path):
  proc = _run("--quick", "--out", str(tmp_path))
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout

  assert "| mode | train loss | val loss | tokens/s | skipped | final scale" in out
  for mode in MODES:
    assert f"| {mode} |" in out
    assert mode in proc.stderr  # its progress bar
  assert "Validation loss vs float32: float16+scaling" in out
  assert "| tokens per backward pass | float16 grad error, no scaling" in out
  png = (tmp_path / "demo.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  assert (tmp_path / "results.md").read_text().startswith("| mode |")

  saved = json.loads((tmp_path / "results.json").read_text())
  results = {r["mode"]: r for r in saved["results"]}
  assert list(results) == MODES
  cfg = saved["config"]
  steps = cfg["steps"]
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
  # float16 computes: its gradients differ from float32's, but not wildly.
  assert 0.0 < results["float16"]["grad_relative_error"] < 0.1

  # The sweep: batch * seq tokens, times sweep_factor, up to sweep_max_tokens.
  sweep = saved["gradient_error_vs_tokens"]
  assert sweep["loss_scale"] == cfg["sweep_scale"]
  tokens = [p["tokens"] for p in sweep["points"]]
  first = cfg["batch"] * cfg["seq"]
  assert tokens[0] == first and len(tokens) >= 2
  assert tokens == [first * cfg["sweep_factor"] ** i for i in range(len(tokens))]
  assert tokens[-1] <= cfg["sweep_max_tokens"] < tokens[-1] * cfg["sweep_factor"]
  for p in sweep["points"]:
    assert p["tokens"] == p["sequences"] * cfg["seq"]
    for key in ("error_unscaled", "error_scaled"):
      assert 0.0 < p[key] < 0.1, (key, p)
    for key in ("zeroed_unscaled", "zeroed_scaled"):
      assert 0.0 <= p[key] <= 1.0, (key, p)
  for p in sweep["points"]:  # every point is a row of the printed table
    assert f"| {p['tokens']:,} | {p['error_unscaled']:.1e} |" in out


def test_demo_rejects_too_few_steps(tmp_path):
  proc = _run("--quick", "--steps", "1", "--out", str(tmp_path))
  assert proc.returncode == 2
  assert "--steps must be at least 2, got 1" in proc.stderr


def _quickstart_body():
  """examples/quickstart.py without its module docstring."""
  source = QUICKSTART.read_text()
  docstring = re.match(r'"""(.*?)"""\n\n', source, re.S)
  assert docstring, "quickstart.py starts with a module docstring"
  return source[docstring.end() :]


def test_readme_quickstart_is_examples_quickstart():
  readme = (ROOT / "README.md").read_text()
  section = readme.split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert blocks == [_quickstart_body()]


def test_quickstart_runs_and_learns(capsys):
  with standard_promotion():  # what users run by default
    ns = runpy.run_path(str(QUICKSTART), run_name="__main__")
  # The independent reference: the least-squares solution of the same data.
  x, y = np.asarray(ns["x"]), np.asarray(ns["y"])
  w_ref = np.linalg.lstsq(x, y, rcond=None)[0]
  np.testing.assert_allclose(ns["params"]["w"], w_ref, atol=2e-3)
  out = capsys.readouterr().out
  # What the README says it prints, on every supported JAX (its data comes
  # from NumPy, not from a random stream that changed across JAX versions).
  readme = " ".join((ROOT / "README.md").read_text().split())
  claim = (
    "It prints a loss near 2e-7, the loss scale 16384, one skipped step and the"
    " weights `[1, -2, 0.5]` (to three decimals): the first step's gradients"
    " overflowed float16 at the initial scale 2^15"
  )
  assert claim in readme
  opt_state = ns["opt_state"]
  assert 1e-7 <= float(ns["loss"]) < 3e-7
  assert f"loss {float(ns['loss']):.1e}, loss scale 16384," in out
  assert int(opt_state.skipped_steps) == 1 and "skipped steps 1," in out
  np.testing.assert_allclose(ns["params"]["w"].ravel(), [1.0, -2.0, 0.5], atol=1e-3)
  # The one skip is the first step's: replayed, step 0 is skipped at 2**15.
  tx, loss_fn = ns["tx"], ns["loss_fn"]
  state = tx.init({"w": jnp.zeros((3, 1))})
  with standard_promotion():
    _, grads = ls.value_and_grad(loss_fn)(state, {"w": jnp.zeros((3, 1))}, x, y)
    _, state = tx.update(grads, state, {"w": jnp.zeros((3, 1))})
  assert int(state.skipped_steps) == 1 and float(state.loss_scale) == 2.0**14
