"""The true gradients and what to log: read from the state, never fed back."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lossscale._applied import step_applied
from lossscale._rule import SKIP_REASONS
from lossscale._scaled_grad import _unwrap, find_state, get_loss_scale
from lossscale._unscale import numbers_as_arrays, unscale, unscale_factors


def unscale_gradients(grads: Any, x: Any) -> Any:
  """Returns the gradients of the unscaled loss: `grads / loss_scale`.

  `grads` are what [`lossscale.value_and_grad`][] (or `jax.grad` of
  [`lossscale.scale_loss`][]) gives: gradients of the *scaled* loss. Divide
  them by the scale before you read them: to log their norm, to compare them
  with a float32 run's, or to compute anything by hand from them. Unscaled
  exactly as the wrapper unscales them for its inner optimizer (multiplied
  by the float32 reciprocal of the scale, in the wider of float32 and each
  leaf's dtype): float32 leaves come back float32, bfloat16 and float16
  leaves come back float32, since their unscaled values may not fit the
  half-precision range. Leaves that are not floating (None, integers,
  `float0`) come back as they are. With a state whose scale is 1
  (`enabled=False`, `skip_nonfinite`) the values come back unchanged.

  For logging and reading only. Do not feed the result back to the wrapper
  (`tx.update`, `apply_gradients`): it unscales what it is given, so these
  would be divided twice. A change to the gradients belongs inside the
  wrapper, as an optax transformation ([Working with unscaled
  gradients][working-with-unscaled-gradients]).

  Args:
    grads: a pytree of gradients of the scaled loss.
    x: what [`lossscale.get_loss_scale`][] takes: the optimizer state the
      loss was scaled with (before this step's update), a
      [`lossscale.flax.TrainState`][] or an `nnx.Optimizer`.

  Returns:
    The unscaled gradients, with the tree structure of `grads`. Jittable;
    under `jax.vmap` over an ensemble each member divides by its own scale.

  Raises:
    ValueError: when `x` does not hold exactly one `LossScaleState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> scaled = {"w": jnp.array([512.0, -2048.0], jnp.bfloat16)}
    >>> ls.unscale_gradients(scaled, state)
    {'w': Array([ 0.5, -2. ], dtype=float32)}
  """
  state = find_state(x)
  scale = jnp.asarray(_unwrap(state.loss_scale), jnp.float32)
  return unscale(numbers_as_arrays(grads), unscale_factors(scale))


def step_metrics(x: Any) -> dict[str, jax.Array]:
  """Returns what to log after each step, read from the state.

  ```python
  params, opt_state = ls.apply_gradients(tx, grads, opt_state, params)
  metrics = ls.step_metrics(opt_state)
  ```

  Args:
    x: the state after the step: an optimizer state with a
      [`lossscale.LossScaleState`][] nested anywhere inside, a
      [`lossscale.flax.TrainState`][] or an `nnx.Optimizer`.

  Returns:
    A dict of arrays (jittable: return it from the step beside the new
    state; under `jax.vmap`, one value per member):

    - `"loss_scale"`: float32, the scale the next step's loss is multiplied by;
    - `"applied"`: bool, whether this step was applied (its gradients were
      finite; [`lossscale.step_applied`][]);
    - `"skipped_steps"`: int32, steps skipped so far;
    - `"consecutive_skips"`: int32, steps skipped in a row up to this one
      (0 after an applied step; [`lossscale.check_not_stalled`][] reads it);
    - `"skip_reason"`: int32, why this step was skipped: 0 when it was
      applied, else 1 + the index of the reason in `lossscale.SKIP_REASONS`
      (1 the gradients overflowed, 2 the loss itself was not finite, 3 a
      loss spike, 4 a gradient-norm spike; [Skipping bad
      steps][skipping-bad-steps]);
    - `"skipped_overflow"`, `"skipped_nonfinite_loss"`,
      `"skipped_loss_spike"`, `"skipped_grad_norm_spike"`: int32, the steps
      skipped so far for each reason (they add up to `"skipped_steps"`).

    The norm of the true gradients is not in the state: compute it from the
    gradients and the state *before* the step, as the norm of
    `ls.unscale_gradients(grads, opt_state)` (`optax.tree.norm`; after the
    step the scale may have changed).

  Raises:
    ValueError: when `x` does not hold exactly one `LossScaleState`, or holds
      it inside another transformation's control flow.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.1), initial_scale=1024.0)
    >>> params = {"w": jnp.ones(2)}
    >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)
    >>> metrics = ls.step_metrics(state)
    >>> metrics["loss_scale"], metrics["applied"], metrics["skip_reason"]
    (Array(512., dtype=float32), Array(False, dtype=bool), Array(1, dtype=int32))
    >>> ls.SKIP_REASONS[int(metrics["skip_reason"]) - 1], metrics["skipped_overflow"]
    ('overflow', Array(1, dtype=int32))
  """
  applied = step_applied(x)  # also checks that the wrapper runs every step
  state = find_state(x)
  i32 = lambda v: jnp.asarray(_unwrap(v), jnp.int32)
  by_reason = i32(state.skips_by_reason)
  return {
    "loss_scale": get_loss_scale(x),
    "applied": applied,
    "skipped_steps": i32(state.skipped_steps),
    "consecutive_skips": i32(state.consecutive_skips),
    "skip_reason": i32(state.last_skip_reason),
  } | {f"skipped_{name}": by_reason[..., i] for i, name in enumerate(SKIP_REASONS)}
