"""The switch of the speed layer: `LOSSSCALE_PLAIN=1` turns it off.

The plain core is the rule, the unscale, one finite check, one `lax.cond`
per wrapper and one for `apply_gradients`. Everything that exists only for
speed sits behind `on()`, each with its measurement where it is used:

- `_split.cond`: one conditional compiled as several small ones, scalars
  hoisted out of them (compile time at thousands of leaves).
- `_once.once` and the wrapper's per-step trace: the inner optimizer
  traced once per step however often the step asks for it (trace time).
- `_finite.all_finite_times`: small leaves checked in groups, large ones
  without a product when the factor cannot overflow them (step time).
- `_compat.order_narrow_writes` / `ORDER_FUSED_WRITES`: bfloat16 state
  written after the updates, in a second conditional (XLA:CPU step time).

With the switch on, the contract tests pass the same way (`make test`
runs them both ways): formulations that only reorder work give the same
bits; the split conditionals and grouped checks give the same bits too
(they run the same operations on the same values). Use it as the escape
hatch when a new JAX breaks the speed layer (docs/troubleshooting.md).

The environment variable is read each time a step is traced, so a new
`jax.jit` (or `jax.clear_caches()`) picks a change up; an already compiled
step keeps the formulation it was traced with.
"""

from __future__ import annotations

import os

_OFF = ("1", "true", "yes", "on")


def on() -> bool:
  """Whether the speed layer is on (`LOSSSCALE_PLAIN` unset, or not one of
  1, true, yes, on)."""
  return os.environ.get("LOSSSCALE_PLAIN", "").strip().lower() not in _OFF
