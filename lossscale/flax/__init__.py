"""Flax integration: TensorFlow's skipped-step contract for linen and NNX.

Linen: `TrainState`, whose `apply_gradients` skips the whole step. NNX:
`nnx_step`, one training step with an `nnx.Optimizer`, which on a skipped
step puts the model (parameters, BatchNorm statistics, RNG counts, every
other `nnx.Variable` the forward pass wrote) and the optimizer back as they
were, except the wrapper's scale and counters. `nnx.Optimizer.update` alone
does not: its parameters stay (the updates are zeros), but what the forward
pass wrote to the model's other state, inf or NaN BatchNorm statistics
included, stays too. `lossscale.get_loss_scale`, `scale_loss` and
`value_and_grad` accept the `nnx.Optimizer` itself (docs/flax.md).
"""

from __future__ import annotations

try:
  import flax as _flax  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
    "lossscale.flax needs Flax, an optional dependency: install it with"
    " `pip install 'lossscale[flax]'` (or `pip install flax`)."
  ) from e

from lossscale.flax._migration import from_dynamic_scale as from_dynamic_scale
from lossscale.flax._nnx import nnx_step as nnx_step
from lossscale.flax._train_state import TrainState as TrainState

__all__ = ["TrainState", "from_dynamic_scale", "nnx_step"]

# The public path (pickles, reprs and error messages name it), not the
# private module each is written in.
for _public in (TrainState, from_dynamic_scale, nnx_step):
  _public.__module__ = __name__
del _public
