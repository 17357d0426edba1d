"""docs/skipping.md's figure is current: `examples/skipping.py`'s run, done
again, is the one docs/img/skipping.json (and its plot) holds."""

import importlib.util
import json
import pathlib

import numpy as np

from _helpers import standard_promotion

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example():
  path = ROOT / "examples" / "skipping.py"
  spec = importlib.util.spec_from_file_location("_skipping_example", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_figure_data_is_current():
  example = _example()
  with standard_promotion():  # optax's Adam, as users run it
    run = example.simulate()
  saved = json.loads((ROOT / "docs" / "img" / "skipping.json").read_text())
  assert run["reason"] == saved["reason"]
  assert run["olmo"] == saved["olmo"]
  assert run["scale"] == saved["scale"]
  # float16 arithmetic may round otherwise on another JAX: the values, not
  # the decisions, are compared to a tolerance.
  for key in ("loss", "norm"):
    np.testing.assert_allclose(run[key], saved[key], rtol=1e-3)
  assert (ROOT / "docs" / "img" / "skipping.png").stat().st_size > 10_000


def test_the_run_shows_what_the_page_says():
  saved = json.loads((ROOT / "docs" / "img" / "skipping.json").read_text())
  example = _example()
  reason = saved["reason"]
  skipped = {t: r for t, r in enumerate(reason) if r}
  assert skipped == {0: 1, 1: 1, 4: 1, example.SPIKE_AT: 3, example.NAN_AT: 2}
  # The scale moves on overflows only: not at the spike, not at the NaN.
  scale = saved["scale"]
  assert scale[example.SPIKE_AT] == scale[example.SPIKE_AT - 1]
  assert scale[example.NAN_AT] == scale[example.NAN_AT - 1]
  # OLMo-core's rule, on the same values: the spike, the NaN and the
  # window's worth of steps after it, and the steps while the first steps'
  # inf gradient norms sit in its window.
  olmo_skips = [t for t, taken in enumerate(saved["olmo"]) if not taken]
  window = example.WINDOW
  nan_run = list(range(example.NAN_AT, example.NAN_AT + window + 1))
  assert set(nan_run) <= set(olmo_skips) and example.SPIKE_AT in olmo_skips
  assert set(range(19, 4 + window + 1)) <= set(olmo_skips)
