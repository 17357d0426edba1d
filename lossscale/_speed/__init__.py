"""The speed layer: formulations that exist only for speed, and their switch.

The plain core (`lossscale/_wrapper.py` and what it calls) is the rule, the
unscale, one finite check and one conditional per step. Everything that
exists only for speed is in this package, reached from `_wrapper.py` only,
each trick with its wall-time evidence in docs/performance.md's speed-layer
table:

- `split` (`split.py`): one conditional compiled as several small ones,
  scalars hoisted out of them (compile time at thousands of leaves).
- `finite` (`finite.py`): small leaves checked in groups, large ones
  without a product when the factor cannot overflow them (step time).
- `order` (`ordering.py`): bfloat16 state written after the updates, in a
  second conditional, on the CPU (XLA:CPU step time).

`LOSSSCALE_PLAIN=1` (or `true`, `yes`, `on`) turns every trick off;
`LOSSSCALE_PLAIN=split,finite` turns off the ones named (to find which one a
new JAX breaks, or to measure one at a time: `benchmarks/compare.py
--plain`). The variable is read once, when lossscale is imported. With any
of them off the contract tests pass the same way (`make test` runs them
with all of them off), and the step gives the same bits: each trick runs
the same operations on the same values, or reorders them. (On jax 0.4.35's
XLA the split `apply_gradients` is fused differently and may round
otherwise: within 2**-22 of each leaf's largest value per step,
tests/test_plain.py.)
"""

from __future__ import annotations

import os

TRICKS = ("split", "finite", "order")
_ALL_OFF = ("1", "true", "yes", "on")
_NONE_OFF = ("", "0", "false", "no", "off")


def off(value: str | None = None) -> frozenset[str]:
  """The tricks `LOSSSCALE_PLAIN` (or `value`) turns off."""
  if value is None:
    value = os.environ.get("LOSSSCALE_PLAIN", "")
  spelled = value.strip().lower()
  if spelled in _NONE_OFF:
    return frozenset()
  if spelled in _ALL_OFF:
    return frozenset(TRICKS)
  names = frozenset(n.strip() for n in spelled.split(",") if n.strip())
  unknown = sorted(names - set(TRICKS))
  if unknown:
    raise ValueError(
      f"LOSSSCALE_PLAIN must be 1 (every trick off) or a comma-separated list"
      f" of {', '.join(TRICKS)}, got {value!r} (unknown: {', '.join(unknown)})."
    )
  return names


# The tricks on in this process (the switch is read once, at import).
TRICKS_ON = frozenset(TRICKS) - off()

# The modules of the tricks, imported only when one is on.
if TRICKS_ON:
  from lossscale._speed import finite as finite
  from lossscale._speed import ordering as ordering
  from lossscale._speed import split as split
