"""Speed layer: bfloat16 optimizer state written after the updates, in place.

The inner optimizer computes in float32 and stores its bfloat16 state
rounded; XLA copies that state before the step unless its writes are
ordered after the new updates (`read_after`), which the wrapper does in a
second conditional (`staged`) and `apply_gradients` in a second call of the
chain inside its one (`fused_state`). On XLA:CPU only, where it is faster in
wall time (docs/performance.md, the speed-layer table, rows `order`): the
choice is `jax.lax.platform_dependent`, made when the step is lowered for
the device it runs on, not when it is traced. Off with `LOSSSCALE_PLAIN=1`
(or `LOSSSCALE_PLAIN=order`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lossscale import _jax_internals
from lossscale._unscale import is_half, is_inexact


def _jaxlib_version() -> tuple[int, ...]:
  import jaxlib

  parts = []
  for part in jaxlib.__version__.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit()) or "0"
    parts.append(int(digits))
  return tuple(parts)


# XLA before jaxlib 0.9.1 copies the bfloat16 moments of a fused step
# whether or not their writes are ordered after the parameters'; ordering
# them only adds work there (docs/performance.md, the speed-layer table).
ORDER_FUSED_WRITES = _jaxlib_version() >= (0, 9, 1)


def _orderable(traced: Any, inner_state: Any) -> bool:
  """Whether the step has bfloat16 (or float16) state to order, and may be
  called twice: no effects, nothing handed out (a callback would run
  twice)."""
  narrow = lambda x: is_inexact(x) and jnp.finfo(x.dtype).bits < 32
  if not any(narrow(x) for x in jax.tree.leaves(inner_state)):
    return False
  _, hands_out = _jax_internals.inspect(traced.closed)
  return not hands_out


def staged(applied, traced, operands, skip, run, choose):
  """The wrapper's step for state stored narrower than it is computed: on
  the CPU the updates in one conditional and the state in a second, after
  the updates are out (`read_after`), in place; elsewhere one
  conditional."""
  inner_state = operands[3]
  one = lambda: choose(applied, lambda: run(traced, operands), skip, operands)
  if not _orderable(traced, inner_state):
    return one()

  def ordered() -> Any:
    new_updates = choose(
      applied, lambda: run(traced, operands)[0], lambda: skip()[0], operands
    )
    # Read after the updates inside the branch: outside it, the old state
    # would be an operand of the conditional twice, and copied.
    later = lambda: (
      *operands[:3],
      read_after(inner_state, new_updates)[0],
      *operands[4:],
    )
    new_state = choose(
      applied,
      lambda: run(traced, later())[1],
      lambda: inner_state,
      (*operands, new_updates),
    )
    return new_updates, new_state

  return jax.lax.platform_dependent(cpu=ordered, default=one)


def fused_state(traced, update, opt_state, new_params, new_state):
  """`apply_gradients`' new state, on the CPU written after the new
  parameters (`update(read_after(opt_state, new_params))`, a second call of
  the chain whose updates XLA drops), elsewhere `new_state` as it is."""
  if not ORDER_FUSED_WRITES or not _orderable(traced, opt_state):
    return new_state
  old, ordered = read_after(opt_state, new_params)
  if not ordered:
    return new_state
  return jax.lax.platform_dependent(
    cpu=lambda: update(old)[1], default=lambda: new_state
  )


def read_after(old: Any, after: Any) -> tuple[Any, bool]:
  """`old`, its half-precision leaves read only after `after` is computed.

  The inner optimizer computes in float32 and its bfloat16 state is stored
  rounded, while its updates come from the unrounded values: the old state
  is read twice, once for the updates (the new parameters) and once for the
  new state. To write the new state over the old in place, XLA must run
  the second read last, and nothing tells it so: it copies the old state
  first (a parameter-sized temporary per moment). Here each such leaf of
  `old`, in a subtree with `after`'s structure (Adam's `mu` and `nu` have
  the parameters'), is selected by a flag that is always true but computed
  from one element of the leaf of `after` at its place: the value is
  unchanged, bit for bit, and the new state now depends on the new
  parameters, so XLA writes it after them, in place. Returns the tree and
  whether any leaf was so ordered.
  """
  after_def: Any = jax.tree.structure(after)
  matches = lambda x: jax.tree.structure(x) == after_def
  ordered = []

  def leaf(x: Any, a: Any) -> Any:
    # Half-precision leaves are floating (`compute_dtype` keeps complex).
    if not (
      is_half(x)
      and is_inexact(a)
      and jnp.issubdtype(a.dtype, jnp.floating)
      and jnp.size(a) > 0
    ):
      return x
    ordered.append(True)
    return _after(x, a)

  tree = jax.tree.map(
    lambda o: jax.tree.map(leaf, o, after) if matches(o) else o, old, is_leaf=matches
  )
  return tree, bool(ordered)


@functools.partial(jax.jit, inline=True)
def _after(x: jax.Array, a: jax.Array) -> jax.Array:
  # One element of `a` times 0 is 0 or NaN, so `keep` is always true; XLA
  # does not fold `a * 0` (inf times 0 is NaN), so it cannot see that. A
  # select copies bits: subnormals and NaN payloads are kept.
  # `a[0, ..., 0]`, not `a.reshape(-1)[0]`: flattening a leaf sharded on
  # another than its first dimension makes XLA gather it whole.
  zero = a[(0,) * a.ndim].astype(jnp.float32) * jnp.float32(0)
  keep = (zero == 0) | jnp.isnan(zero)
  return jnp.where(keep, x, -x)
