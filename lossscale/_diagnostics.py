"""Host-side diagnostics: failing loudly on stalled runs, finding inf and NaN.

Both functions run in Python on concrete arrays, between jitted steps: they
read a few scalars (or count non-finite elements) and never change the
optimizer's compiled step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _checks
from lossscale._scaled_grad import _unwrap, find_state
from lossscale._unscale import is_inexact

# Well above the longest stretch of skips a healthy run shows: backing off
# from the largest default scale (2**24) to the smallest (1.0) takes 24
# consecutive skips with `hysteresis=1`, and a healthy run skips one step at
# a time (rarely a few) after each growth.
DEFAULT_MAX_CONSECUTIVE_SKIPS = 100


class LossScaleStalledError(FloatingPointError):
  """Raised by [`lossscale.check_not_stalled`][] when every recent step was skipped.

  A subclass of `FloatingPointError`, so `except FloatingPointError` in a
  training loop catches it too.
  """


def _concrete(fn: str, name: str, x: Any) -> np.ndarray:
  x = _unwrap(x)
  if isinstance(x, jax.core.Tracer):
    raise TypeError(
      f"`{fn}` reads concrete values on the host, but got a traced {name}"
      " (it was called inside `jax.jit`, `pmap`, `vmap` or `grad`). Call it"
      " outside the jitted step, on the state the step returned."
    )
  return np.asarray(jax.device_get(x))


def check_not_stalled(
  x: Any,
  *,
  max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE_SKIPS,
  min_scale: float | None = None,
  at_min_scale: bool = False,
  scale_at_most: float | None = None,
) -> None:
  """Raises `LossScaleStalledError` when too many steps in a row were skipped.

  A loss-scaling wrapper never applies a non-finite update: when the
  gradients stay non-finite it skips every step, silently. Call this on the
  host after each step (it reads a few scalars) to turn such a stall into a
  loud [`lossscale.LossScaleStalledError`][] that names the likely causes
  ([Troubleshooting][every-step-is-skipped] has them in full):

  ```python
  params, opt_state = train_step(params, opt_state, batch)
  lossscale.check_not_stalled(opt_state)
  ```

  It raises once `consecutive_skips >= max_consecutive_skips`; for a state
  batched with `jax.vmap` (an ensemble), when any member has stalled. Two
  more triggers stop a run where DeepSpeed and fairseq stop theirs
  ([Coming from PyTorch][stopping-where-deepspeed-and-fairseq-stop]):
  `at_min_scale=True` (DeepSpeed's `raise_error_at_min_scale`) raises once an
  overflow would have backed off a scale already at the wrapper's
  `min_scale`, and `scale_at_most=x` (fairseq's `min_loss_scale`) raises when
  the last step overflowed and left the scale at or below `x`.

  Args:
    x: an optimizer state with a [`lossscale.LossScaleState`][] nested
      anywhere inside, a Flax `TrainState` or an `nnx.Optimizer` (anything
      [`lossscale.get_loss_scale`][] accepts). Concrete values, not tracers.
    max_consecutive_skips: how many skipped steps in a row are tolerated, a
      positive int32. The default, 100, is far above the 24 skips that back
      the largest default scale (2**24) off to 1.0.
    min_scale: the wrapper's `min_scale`, if known; only used to say in the
      message whether the scale is pinned at its floor (the state does not
      record it).
    at_min_scale: also raise once the state has counted an overflow that
      would have backed off a scale already at `min_scale`
      (`overflows_at_min_scale > 0`): DeepSpeed's `raise_error_at_min_scale`,
      on the same step when checked after every step.
    scale_at_most: also raise when the last step was skipped and the scale
      it left is at or below this, a normal float32 (as every scale
      setting is): fairseq's
      `min_loss_scale` (fairseq then restores the scale before; the run
      stops either way).

  Raises:
    LossScaleStalledError: when `consecutive_skips >= max_consecutive_skips`,
      or a trigger of `at_min_scale` or `scale_at_most` fires. The message
      gives the numbers (consecutive and total skips, the current scale) and
      the likely causes.
    ValueError: for an invalid `max_consecutive_skips`, `min_scale`,
      `at_min_scale` or `scale_at_most`, or when `x` does not hold exactly
      one `LossScaleState`.
    TypeError: when called on traced values (inside `jax.jit`).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> nan_grads = {"w": jnp.array([jnp.nan, 1.0])}
    >>> for _ in range(3):
    ...   _, state = tx.update(nan_grads, state, params)
    >>> ls.check_not_stalled(state, max_consecutive_skips=4)  # passes
    >>> try:
    ...   ls.check_not_stalled(state, max_consecutive_skips=3)
    ... except ls.LossScaleStalledError as e:
    ...   print(str(e).split(" because")[0])
    The last 3 optimizer steps were all skipped
  """
  fn = "check_not_stalled"
  # At most the int32 maximum, where the counter saturates.
  max_consecutive_skips = _checks.positive_int(
    fn, "max_consecutive_skips", max_consecutive_skips
  )
  if min_scale is not None:
    min_scale = _checks.float32_scale(fn, "min_scale", min_scale)
  at_min_scale = _checks.boolean(fn, "at_min_scale", at_min_scale)
  if scale_at_most is not None:
    scale_at_most = _checks.float32_scale(fn, "scale_at_most", scale_at_most)
  state = find_state(x)
  _check_floor(fn, state, at_min_scale, scale_at_most)
  consecutive = _concrete(fn, "state", state.consecutive_skips)
  worst = int(consecutive.max(initial=0))
  if worst < max_consecutive_skips:
    return

  stalled = consecutive >= max_consecutive_skips
  scales = _concrete(fn, "state", state.loss_scale).astype(np.float32)
  skipped = _concrete(fn, "state", state.skipped_steps)
  if consecutive.ndim == 0:
    where, scale, total = "", float(scales), int(skipped)
  else:
    members = np.argwhere(np.broadcast_to(stalled, consecutive.shape))
    stalled_members = [tuple(int(i) for i in m) for m in members]
    where = f" (batched or replicated state: members {stalled_members})"
    scale = float(np.min(np.broadcast_to(scales, consecutive.shape)[stalled]))
    total = int(np.broadcast_to(skipped, consecutive.shape)[stalled].max())
  reasons = _concrete(fn, "state", state.last_skip_reason)
  reason = int(np.max(np.broadcast_to(reasons, consecutive.shape)[stalled]))
  raise LossScaleStalledError(
    f"The last {worst} optimizer steps were all skipped{where}"
    f" {_cause(reason, scale, min_scale)} ({total} skipped steps in total; limit"
    f" max_consecutive_skips={max_consecutive_skips}). See the Troubleshooting"
    " page of the lossscale docs."
  )


def _cause(reason: int, scale: float, min_scale: float | None) -> str:
  """Why the steps were skipped, by the last skip's reason, and what to do."""
  if reason == 2:  # nonfinite_loss
    return (
      "because the loss itself is inf or NaN: no loss scale fixes this (the"
      f" scale, {scale:g}, was left alone). Likely causes: NaN or inf in the"
      " input data or labels; NaN or inf already in the parameters (check"
      " with lossscale.nonfinite_leaves(params)); a loss computed in float16"
      " that overflows (compute it and its reductions in float32); a log or a"
      " division of zero in the loss"
    )
  if reason in (3, 4):  # loss_spike, grad_norm_spike
    what = "loss" if reason == 3 else "unscaled gradient norm"
    return (
      f"because the {what} was a spike against its window, step after step:"
      " its level may have moved for good (a new data mix, a schedule"
      " change), which the window takes in only slowly. Raise SkipSpikes'"
      " sigmas or shorten its window, or look for a bad shard of the data"
    )
  if min_scale is None:
    scale_note = (
      f"The loss scale is now {scale:g}; a dynamic scale backs off to its"
      " min_scale and stays there, and if it is there the gradients are"
      " non-finite even unscaled (give check_not_stalled the wrapper's"
      " min_scale to have this checked)."
    )
  elif scale <= float(np.float32(min_scale)):
    scale_note = (
      f"The loss scale is {scale:g}, at the min_scale={min_scale:g} you gave:"
      " backing off no longer helps, so the gradients are non-finite even"
      " unscaled."
    )
  else:
    scale_note = (
      f"The loss scale is {scale:g}, above the min_scale={min_scale:g} you"
      " gave: a dynamic scale is still backing off (a static one never does)."
    )
  return (
    f"because the gradients held inf or NaN. {scale_note} Likely causes: NaN"
    " or inf already in the parameters or the optimizer state (check with"
    " lossscale.nonfinite_leaves(params)); NaN or inf in the input data or"
    " labels; a learning rate too high, so the model diverged; a loss"
    " computed in float16 that overflows even at the minimum scale (compute"
    " the loss and its reductions in float32). Give the wrapper the loss as"
    " `value=` to tell a bad loss from an overflow"
  )


def _check_floor(
  fn: str, state: Any, at_min_scale: bool, scale_at_most: float | None
) -> None:
  """The DeepSpeed (`at_min_scale`) and fairseq (`scale_at_most`) triggers."""
  scales = _concrete(fn, "state", state.loss_scale).astype(np.float32)
  if at_min_scale:
    hits = _concrete(fn, "state", state.overflows_at_min_scale)
    if int(hits.max(initial=0)) > 0:
      raise LossScaleStalledError(
        f"An overflow would have backed off a loss scale already at its"
        f" min_scale ({int(hits.max())} such overflows; the scale is now"
        f" {float(np.min(scales)):g}): the loss scale cannot decrease any more"
        " (check_not_stalled(at_min_scale=True), DeepSpeed's"
        " raise_error_at_min_scale). The gradients overflow even at the"
        " lowest scale allowed: see the Troubleshooting page of the lossscale"
        " docs."
      )
  if scale_at_most is not None:
    skipped = np.logical_not(_concrete(fn, "state", state.last_finite))
    low = np.logical_and(skipped, scales <= np.float32(scale_at_most))
    if low.any():
      low_scales = np.broadcast_to(scales, low.shape)[low]
      raise LossScaleStalledError(
        f"The last step overflowed and left the loss scale at"
        f" {float(np.min(low_scales)):g}, at or below"
        f" scale_at_most={scale_at_most:g} (fairseq's min_loss_scale). The"
        " loss is probably exploding: lower the learning rate, clip the"
        " gradients or enlarge the batch; see the Troubleshooting page of the"
        " lossscale docs."
      )


def nonfinite_leaves(tree: Any) -> dict[str, int]:
  """Returns the leaves of `tree` holding inf or NaN, with their counts.

  A debugging aid for the host, between steps: find out which parameters,
  gradients or optimizer-state entries went bad. Only floating and complex
  leaves can hold inf or NaN; integer, boolean and `float0` leaves are never
  reported.

  Args:
    tree: a pytree of concrete arrays (parameters, gradients, an optimizer
      state, a whole `TrainState`). Python floats count as leaves too.

  Returns:
    A dict, in tree order, from each offending leaf's path (as
    `jax.tree_util.keystr` writes it; `""` for a bare array) to its number
    of non-finite elements. Empty when everything is finite.

  Raises:
    TypeError: when called on traced values (inside `jax.jit`).

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> grads = {"dense": {"w": jnp.array([1.0, jnp.inf, jnp.nan]),
    ...                    "b": jnp.zeros(2)},
    ...          "step": jnp.array(3)}
    >>> ls.nonfinite_leaves(grads)
    {"['dense']['w']": 2}
    >>> ls.nonfinite_leaves({"w": jnp.ones(3)})
    {}
  """
  found = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    leaf = _unwrap(leaf)
    if isinstance(leaf, jax.core.Tracer):
      _concrete("nonfinite_leaves", "tree", leaf)
    if isinstance(leaf, jax.Array):
      if not is_inexact(leaf):
        continue
      # On the device: no host copy of a large parameter.
      count = int(jnp.sum(jnp.logical_not(jnp.isfinite(leaf))))
    else:
      leaf = np.asarray(leaf)  # numpy arrays and Python scalars, as they are
      if not is_inexact(leaf):
        continue
      count = int(np.sum(np.logical_not(np.isfinite(leaf))))
    if count:
      found[jax.tree_util.keystr(path)] = count
  return found
