"""With `LOSSSCALE_BLOCK_SPEED=1`, `lossscale._speed` cannot be imported.

Imported by tests/conftest.py before lossscale (and by subprocesses the
tests start): the plain core must run with the speed layer absent, as if
`lossscale/_speed/` were deleted (`make test-plain`).
"""

import importlib.abc
import os
import sys


class _Blocked(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name == "lossscale._speed" or name.startswith("lossscale._speed."):
      raise ModuleNotFoundError(
        f"{name} is blocked (LOSSSCALE_BLOCK_SPEED=1)", name=name
      )
    return None


if os.environ.get("LOSSSCALE_BLOCK_SPEED") and not any(
  isinstance(f, _Blocked) for f in sys.meta_path
):
  sys.meta_path.insert(0, _Blocked())
