"""The speed layer: formulations that exist only for speed, and their switch.

The plain core is the rule, the unscale, one finite check, one `lax.cond`
per wrapper and one for `apply_gradients`. Everything that exists only for
speed is in this package, each trick behind `on(name)`, each with its
wall-time evidence beside it:

- `split` (`split.py`): one conditional compiled as several small ones,
  scalars hoisted out of them (compile time at thousands of leaves).
- `once` (`once.py`): the inner optimizer traced once per step however
  often the step asks for it (trace time).
- `finite` (`finite.py`): small leaves checked in groups, large ones
  without a product when the factor cannot overflow them (step time).
- `order` (`ordering.py`): bfloat16 state written after the updates, in a
  second conditional (XLA:CPU step time).

`LOSSSCALE_PLAIN=1` (or `true`, `yes`, `on`) turns every trick off;
`LOSSSCALE_PLAIN=split,once` turns off the ones named (to find which one a
new JAX breaks, or to measure one at a time: `benchmarks/compare.py
--plain`). With any of them off the contract tests pass the same way (`make
test` runs them with all of them off), and the step gives the same bits:
each trick runs the same operations on the same values, or reorders them.
(On jax 0.4.35's XLA the split `apply_gradients` is fused differently and
may round otherwise: within 2**-22 of each leaf's largest value per step,
tests/test_plain.py.)

The variable is read each time a step is traced, so a new `jax.jit` (or
`jax.clear_caches()`) picks a change up; an already compiled step keeps the
formulation it was traced with.
"""

from __future__ import annotations

import os

TRICKS = ("split", "once", "finite", "order")
_ALL_OFF = ("1", "true", "yes", "on")
_NONE_OFF = ("", "0", "false", "no", "off")


def off() -> frozenset[str]:
  """The tricks `LOSSSCALE_PLAIN` turns off."""
  value = os.environ.get("LOSSSCALE_PLAIN", "").strip().lower()
  if value in _NONE_OFF:
    return frozenset()
  if value in _ALL_OFF:
    return frozenset(TRICKS)
  names = frozenset(n.strip() for n in value.split(",") if n.strip())
  unknown = sorted(names - set(TRICKS))
  if unknown:
    raise ValueError(
      f"LOSSSCALE_PLAIN must be 1 (every trick off) or a comma-separated list"
      f" of {', '.join(TRICKS)}, got {os.environ['LOSSSCALE_PLAIN']!r}"
      f" (unknown: {', '.join(unknown)})."
    )
  return names


def on(trick: str) -> bool:
  """Whether the speed layer's `trick` (one of `TRICKS`) is on."""
  return trick not in off()


def plain() -> bool:
  """Whether every trick is off: the plain core alone."""
  return off() == frozenset(TRICKS)
