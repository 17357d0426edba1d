"""The decision `apply_gradients` asks a wrapper for, passed in plain sight.

A wrapper's `update` takes one optional keyword argument, `DECISION`, which
`optax.chain` and every other optax combinator pass along like any extra
argument, and which `jax.jit` sees like any other argument:

- absent: the ordinary step. The wrapper unscales, decides, and applies or
  skips the inner optimizer inside its own `lax.cond`.
- `None`: decide only. The wrapper unscales and decides, runs no inner
  optimizer, and returns zero updates (so transformations chained after it can
  be traced) and, in place of its state, a `Decision`: the finite flag and the
  state a skipped step would leave. `DecideOnly(axes)` is the same, with the
  flag reduced over `axes` too (the axes a collective chained after the
  wrapper communicates over: `apply_gradients` asks again with them).
- a `Decision`, returned by a call with `None` on exactly these arguments:
  apply it. The wrapper takes the flag and the gradients it decided on from
  the `Decision` (so whatever computed them before it, a cross-replica mean
  for one, is dead code in this call), runs the inner optimizer without a
  `lax.cond` of its own and advances its counters with that flag.

`Decision` is a different pytree from `LossScaleState` on purpose: a wrapper
traced inside another transformation's control flow (`optax.MultiSteps`,
`optax.apply_if_finite`, ...) cannot return it without breaking that control
flow's type check, so a decision that was not taken on every step cannot go
unnoticed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from lossscale._rule import LossScaleState
from lossscale._speed import once as _once

DECISION = "lossscale_finite"
"""The keyword argument of a wrapper's `update` that carries a decision."""


ORDINARY = object()  # no `DECISION` argument: the ordinary step


class DecideOnly(NamedTuple):
  """`DECISION=DecideOnly(axes)`: decide only, the flag reduced over `axes`
  as well as the wrapper's own (`DECISION=None` is `DecideOnly(())`)."""

  axes: tuple = ()


@dataclasses.dataclass(frozen=True)
class AxisSet:
  """Axis names, as a pytree with no leaves (a `Decision` may be returned
  from a jitted `tx.update`)."""

  names: tuple = ()


jax.tree_util.register_pytree_node(
  AxisSet, lambda a: ((), a.names), lambda names, _: AxisSet(names)
)


class Decision(NamedTuple):
  """What a wrapper returns in place of its state when asked to decide only.

  Attributes:
    finite: bool, whether the step's gradients are finite (reduced over the
      wrapper's `axis_name`, the axes its inner optimizer communicates over
      and those of a `DecideOnly` request).
    skipped: the wrapper's `LossScaleState` after skipping this step.
    incoming: the gradients the wrapper received (after the transformations
      chained before it), still scaled.
    in_order: whether the state the inner optimizer computes wider than it
      stores (float32 for half-precision parameters) may be written in a
      second call, after the new parameters (`read_after`): the inner
      optimizer has no effects and hands no values out.
    zero: whether the inner optimizer is fed zeros in place of non-finite
      gradients (where both branches of the step may run and be seen).
    axes: the axes `finite` was reduced over (an `AxisSet`).
    step: the step's `_speed.once.Step`: the calls that apply the decision
      reuse the inner step's trace it made (lossscale/_speed/once.py).

  Every field is given: only the wrapper builds one (`_wrapper._decided`).
  """

  finite: jax.Array
  skipped: LossScaleState
  incoming: Any
  in_order: bool
  zero: bool
  axes: AxisSet
  step: _once.Step
