"""Speed layer: bfloat16 optimizer state written after the updates, in place.

The inner optimizer computes in float32 and stores its bfloat16 state
rounded; XLA copies that state before the step unless the writes are
ordered after the new updates (`read_after`), which the wrapper does in a
second conditional (`staged_in_order`) and `apply_gradients` in its one.
On XLA:CPU only, where it is faster in wall time; evidence beside each.
Off with `LOSSSCALE_PLAIN=1` (or `LOSSSCALE_PLAIN=order`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lossscale import _axes, _speed
from lossscale._dtypes import is_half, is_inexact


def _jaxlib_version() -> tuple[int, ...]:
  import jaxlib

  parts = []
  for part in jaxlib.__version__.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit()) or "0"
    parts.append(int(digits))
  return tuple(parts)


# XLA before jaxlib 0.9.1 copies the bfloat16 moments of a fused step
# whether or not their writes are ordered after the parameters'; ordering
# them (`read_after`) only added work there: 1.60x the bare
# step's bytes against 1.07x unordered, at every jaxlib from 0.4.35 to
# 0.9.0.1. From 0.9.1 on, XLA writes them in place once ordered: 1.30x
# against 1.60x (1M bfloat16 parameters, benchmarks/half_precision.py).
ORDER_FUSED_WRITES = _jaxlib_version() >= (0, 9, 1)


def order_narrow_writes() -> bool:
  """Whether a step writes bfloat16 optimizer state after the new parameters
  (`read_after`), in place: on XLA:CPU, where it is faster in
  wall time (`apply_gradients` 0.78x of the bare step against 0.82x,
  `tx.update` 1.14x against 1.51x; 10M bfloat16 AdamW, jaxlib 0.12.0.1,
  in-process A/B), and only there: on XLA:GPU the ordering made XLA copy
  the state (`benchmarks/gpu.sh`, H200, jaxlib 0.11.2, 100M bfloat16
  parameters: `tx.update` 1.61x the bare step ordered, 1.41x not, in one
  process; `apply_gradients` 1.44x and 1.47x). `apply_gradients` orders
  them from jaxlib 0.9.1 only (`orders_fused_writes`)."""
  return jax.default_backend() == "cpu" and _speed.on("order")


def orders_fused_writes() -> bool:
  """Whether `apply_gradients` writes bfloat16 state after the new
  parameters (where the wrapper found `order_narrow_writes` true)."""
  return ORDER_FUSED_WRITES and _speed.on("order")


def staged_in_order(finite, apply, skip, inner_state, operands):
  """The wrapper's staged step for state stored narrower than it is
  computed (bfloat16 moments): the updates in one conditional, the state
  in a second, after the updates are out (`read_after`), in place. In one
  conditional XLA copies the state first. Evidence: in-process A/B,
  XLA:CPU, jaxlib 0.12.0.1, 10M bfloat16 AdamW: tx.update + apply_updates
  1.14x of bare in two conditionals, 1.51x in one. The inner optimizer's
  second call reuses its trace (`_speed.once`), and XLA keeps of each call
  only what its conditional returns."""
  new_updates = _axes.cond(
    finite, lambda: apply()[0], lambda: skip()[0], operands=operands
  )
  new_state = _axes.cond(
    finite,
    lambda: apply(read_after(inner_state, new_updates)[0])[1],
    lambda: inner_state,
    operands=(*operands, new_updates),
  )
  return new_updates, new_state


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
