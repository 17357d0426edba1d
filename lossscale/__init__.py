"""lossscale: mixed-precision loss scaling for JAX, as optax transformations."""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from lossscale._applied import step_applied as step_applied
from lossscale._applied import where_applied as where_applied
from lossscale._diagnostics import LossScaleStalledError as LossScaleStalledError
from lossscale._diagnostics import check_not_stalled as check_not_stalled
from lossscale._diagnostics import nonfinite_leaves as nonfinite_leaves
from lossscale._distributed import cross_shard_mean as cross_shard_mean
from lossscale._fused import apply_gradients as apply_gradients
from lossscale._loss_scale import dynamic_loss_scale as dynamic_loss_scale
from lossscale._loss_scale import skip_nonfinite as skip_nonfinite
from lossscale._loss_scale import static_loss_scale as static_loss_scale
from lossscale._metrics import step_metrics as step_metrics
from lossscale._metrics import unscale_gradients as unscale_gradients
from lossscale._precision import Float16RangeReport as Float16RangeReport
from lossscale._precision import cast_floating as cast_floating
from lossscale._precision import float16_range_report as float16_range_report
from lossscale._precision import with_compute_dtype as with_compute_dtype
from lossscale._restore import set_loss_scale as set_loss_scale
from lossscale._restore import upgrade_state as upgrade_state
from lossscale._rounding import SwallowedUpdates as SwallowedUpdates
from lossscale._rounding import swallowed_updates as swallowed_updates
from lossscale._rule import SKIP_REASONS as SKIP_REASONS
from lossscale._rule import LossScaleState as LossScaleState
from lossscale._rule import SkipSpikes as SkipSpikes
from lossscale._rule import SpikeWindow as SpikeWindow
from lossscale._scaled_grad import get_loss_scale as get_loss_scale
from lossscale._scaled_grad import scale_loss as scale_loss
from lossscale._scaled_grad import value_and_grad as value_and_grad
from lossscale._wrapper import all_finite as all_finite

try:
  __version__ = _metadata.version("lossscale")
except _metadata.PackageNotFoundError:  # running from a source tree
  __version__ = "0.0.0+unknown"

__all__ = [
  "SKIP_REASONS",
  "Float16RangeReport",
  "LossScaleStalledError",
  "LossScaleState",
  "SkipSpikes",
  "SpikeWindow",
  "SwallowedUpdates",
  "all_finite",
  "apply_gradients",
  "cast_floating",
  "check_not_stalled",
  "cross_shard_mean",
  "dynamic_loss_scale",
  "float16_range_report",
  "get_loss_scale",
  "nonfinite_leaves",
  "scale_loss",
  "set_loss_scale",
  "skip_nonfinite",
  "static_loss_scale",
  "step_applied",
  "step_metrics",
  "swallowed_updates",
  "unscale_gradients",
  "upgrade_state",
  "value_and_grad",
  "where_applied",
  "with_compute_dtype",
]

if TYPE_CHECKING:
  # Type checkers see `lossscale.flax` as the module it is (and no
  # `__getattr__`, which would make every misspelt name `Any`).
  from lossscale import flax as flax
else:

  def __getattr__(name):
    # `lossscale.flax` needs the optional flax dependency: import it on use.
    if name == "flax":
      import importlib

      return importlib.import_module("lossscale.flax")
    raise AttributeError(f"module 'lossscale' has no attribute {name!r}")
