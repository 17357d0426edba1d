"""The README's quickstart runs and trains."""

import pathlib
import re

import jax

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_quickstart_runs_and_learns(capsys):
  text = README.read_text()
  code = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
  namespace = {}
  with jax.numpy_dtype_promotion("standard"):  # what users run by default
    exec(compile(code, "README quickstart", "exec"), namespace)
  assert float(namespace["loss"]) < 1e-4
  assert int(namespace["opt_state"].skipped_steps) >= 0
  assert "make demo" in text and "make test" in text
