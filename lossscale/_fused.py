"""`apply_gradients`: one jitted optimizer step that owns `apply_updates`.

The loss-scaling wrappers decide and skip *inside* `tx.update`, which cannot
reach `optax.apply_updates`: the updates have to leave the wrapper as arrays
(zeros on a skipped step) and be added to the parameters afterwards. When the
caller hands over `apply_updates` too, the whole step can sit behind one
`lax.cond`, so a finite step is the bare optimizer step plus the finite
check, and a skipped step touches nothing but the gradients.

The decision is the wrapper's own: `apply_gradients` traces `tx.update`
three times under a trace-time mode that the wrapper (`_loss_scale._wrap`)
consults, and the state machine (`_next_counters`) is the same code:

1. probe: the wrapper computes its finite flag from the updates it receives
   (after every transformation chained before it), records the flag and
   those updates, and returns a skipped step. Nothing but the flag is used,
   so XLA removes the rest.
2. apply (the `lax.cond` true branch): the wrapper takes the recorded flag
   and updates instead of recomputing them, and runs the inner optimizer.
3. skip (the false branch): the wrapper returns zeros and the unchanged
   inner state, exactly as `tx.update` would on a non-finite step.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import optax

from lossscale import _axes

PROBE, APPLY, SKIP = "probe", "apply", "skip"

_local = threading.local()


@dataclasses.dataclass
class Trace:
  """What one `apply_gradients` call tells the wrapper (trace time only)."""

  mode: str
  finite: jax.Array | None = None
  incoming: Any = None
  seen: list = dataclasses.field(default_factory=list)  # wrappers traced


def active() -> Trace | None:
  """The innermost `apply_gradients` trace, or None in ordinary use."""
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


class _Mode:
  def __init__(self, trace: Trace):
    self.trace = trace

  def __enter__(self) -> Trace:
    if not hasattr(_local, "stack"):
      _local.stack = []
    _local.stack.append(self.trace)
    return self.trace

  def __exit__(self, *exc) -> None:
    _local.stack.pop()


def apply_gradients(
  tx: optax.GradientTransformation,
  grads: Any,
  opt_state: optax.OptState,
  params: Any,
  **extra_args: Any,
) -> tuple[Any, optax.OptState]:
  """Applies one loss-scaled optimizer step: `tx.update` + `apply_updates`.

  Gives the same `(new_params, new_opt_state)` as::

      updates, new_opt_state = tx.update(grads, opt_state, params, **extra_args)
      new_params = optax.apply_updates(params, updates)

  but decides *before* running the optimizer: the whole step sits behind one
  `lax.cond`, so a skipped (non-finite) step costs only the finite check
  and leaves `params` and the inner optimizer's state untouched, and a
  finite step does not write its updates out as a separate array. `tx`
  must hold exactly one `dynamic_loss_scale`, `static_loss_scale` or
  `skip_nonfinite` wrapper, anywhere in a chain: the decision is the
  wrapper's own (the same finite flag, computed after the transformations
  chained before it, with the same `axis_name` collective, and the same
  scale rule), so the loss scale, counters and every other state in `tx`
  follow exactly the trajectory of `tx.update` + `optax.apply_updates`.

  Call it inside `jax.jit` (with `donate_argnums` on `params` and
  `opt_state`, returned in the same order they are passed: see the
  performance guide). Measured on a 23M-parameter AdamW step on CPU, a
  finite step costs the bare optimizer step plus the finite check
  (1.2-1.3x), and a skipped step about half a bare step; `tx.update` +
  `optax.apply_updates` costs over 2x there, for its parameter-sized
  updates array (`docs/performance.md`).

  Whether the step was applied can be read from the new state: the
  wrapper's `consecutive_skips` is 0 after an applied step (this is how a
  `TrainState` can count applied steps only).

  Trade-offs against `tx.update` + `optax.apply_updates`:

  - Only the parameters and state come back, not the updates.
  - Transformations chained *after* the wrapper run on zeros on a skipped
    step, as with `tx.update`, but inside the `lax.cond`; on a skipped step
    the parameters come back as they were (XLA may fold `p + 0` to `p`, so
    a `-0.0` parameter may keep its sign, where `apply_updates` gives
    `+0.0`).
  - The wrapper must be traced directly by `tx.update`, not inside another
    transformation's `lax.cond` (`optax.MultiSteps(dynamic_loss_scale(...))`
    is rejected; `dynamic_loss_scale(optax.MultiSteps(...))`, the order
    that drops only a bad micro-batch, works).
  - Under `jax.vmap` with per-member decisions the `lax.cond` becomes a
    select and both branches run, as they do in the wrapper.

  Args:
    tx: a gradient transformation that contains exactly one loss-scaling
      wrapper.
    grads: gradients of the scaled loss (`lossscale.value_and_grad`).
    opt_state: `tx`'s state.
    params: the parameters; `optax.apply_updates` adds the updates to them.
    **extra_args: forwarded to `tx.update` (for example `value`, `grad` and
      `value_fn` for `optax.lbfgs`).

  Returns:
    `(new_params, new_opt_state)`.

  Raises:
    ValueError: when `tx` holds no loss-scaling wrapper, more than one, or
      one traced inside another transformation's control flow.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import lossscale as ls
    >>> tx = ls.dynamic_loss_scale(optax.sgd(0.5), initial_scale=4.0)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda g, s, p: ls.apply_gradients(tx, g, s, p))
    >>> params, state = step({"w": jnp.array([4.0, -8.0])}, state, params)
    >>> params["w"]
    Array([0.5, 2. ], dtype=float32)
    >>> params, state = step({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    >>> params["w"], ls.get_loss_scale(state), state.skipped_steps
    (Array([0.5, 2. ], dtype=float32), Array(2., dtype=float32), Array(1, dtype=int32))
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise ValueError(
      "`apply_gradients(tx=...)` must be an optax.GradientTransformation,"
      f" got {type(tx).__name__} instead."
    )
  with _Mode(Trace(PROBE)) as probe:
    tx.update(grads, opt_state, params, **extra_args)
  if len(probe.seen) > 1 and len(set(probe.seen)) == 1:
    raise ValueError(_CONTROL_FLOW)
  if len(probe.seen) != 1:
    what = "no" if not probe.seen else str(len(probe.seen))
    raise ValueError(
      f"`apply_gradients(tx=...)` must contain exactly one loss-scaling"
      f" wrapper (dynamic_loss_scale, static_loss_scale or skip_nonfinite),"
      f" found {what}."
    )

  def branch(mode):
    def step():
      with _Mode(Trace(mode, probe.finite, probe.incoming)):
        updates, new_state = tx.update(grads, opt_state, params, **extra_args)
      return optax.apply_updates(params, updates), new_state

    return step

  try:
    return _axes.cond(probe.finite, branch(APPLY), branch(SKIP))
  except jax.errors.UnexpectedTracerError as e:
    raise ValueError(_CONTROL_FLOW) from e


_CONTROL_FLOW = (
  "`apply_gradients(tx=...)`: the loss-scaling wrapper is traced inside"
  " another transformation's control flow (such as"
  " optax.MultiSteps(dynamic_loss_scale(...))), so its decision cannot be"
  " taken before the step. Put the wrapper outside (for example"
  " dynamic_loss_scale(optax.MultiSteps(...))), or use tx.update +"
  " optax.apply_updates."
)
