"""Which named axes a step communicates over: what keeps replicas together.

A loss-scaling wrapper decides whether to apply a step from the gradients
it is given. Under `jax.pmap` or `shard_map` every replica decides for
itself unless the decision is reduced across replicas (the wrapper's
`axis_name`), or the gradients were all-reduced before it (then they are
the same everywhere). A collective that runs where only some replicas go
(inside the wrapper's conditional, or after it on updates some replicas
skipped) breaks that: the replicas that skip never join the all-reduce
(a hang), or they train on with other scales (a silent drift).

So the wrapper adds to its decision every axis the inner optimizer
communicates over (`communicated_axes` of its trace), `apply_gradients`
adds every axis the rest of the applied step communicates over, and
`cross_shard_mean` refuses, at trace time, updates that a wrapper decided
on per replica (`mark_per_replica` / `check_not_per_replica`).
docs/data-parallel.md has the table of placements.
"""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import jax

from lossscale import _jax_internals

# Primitives that name an axis but exchange nothing between replicas.
_LOCAL = frozenset({"axis_index", "pvary", "pcast", "pbroadcast"})


def _axis_names(eqn: Any) -> list[Hashable]:
  if eqn.primitive.name in _LOCAL:
    return []
  names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  names = names if isinstance(names, (tuple, list)) else (names,)
  # Positional axes (integers, NumPy's too: `reduce_sum`'s, or a collective
  # over a vmapped dimension) are not named axes.
  return [
    n for n in names if isinstance(n, Hashable) and not isinstance(n, numbers.Integral)
  ]


def communicated_axes(closed: Any) -> tuple[Hashable, ...]:
  """The named axes the traced computation `closed` (a `ClosedJaxpr`)
  communicates over, in order of first appearance: collectives (`psum`,
  `pmean`, `all_gather`, `ppermute`...) in its used equations, nested calls
  and branches included."""
  found: dict[Hashable, None] = {}
  for top in reversed(_jax_internals.live_eqns(_jax_internals.open_jaxpr(closed))):
    for eqn in (top, *_jax_internals.eqns_nested_in(top)):
      for name in _axis_names(eqn):
        found[name] = None
  return tuple(found)


def as_tuple(axis_name: Any) -> tuple[Hashable, ...]:
  if axis_name is None:
    return ()
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def union(*groups: Iterable[Hashable]) -> tuple[Hashable, ...]:
  return tuple(dict.fromkeys(n for g in groups for n in g))


# Updates a wrapper returned after deciding per replica (no axis reduced
# over), by the identity of their tracers, weakly: an entry lives as long as
# the trace that made it. Only `cross_shard_mean` reads it, to refuse them.
_per_replica: dict[int, tuple[weakref.ref, tuple[Hashable, ...]]] = {}


def mark_per_replica(updates: Any, agreed: tuple[Hashable, ...]) -> None:
  """Records that `updates` (traced) were decided on with the decision
  reduced over `agreed` only."""
  for x in jax.tree_util.tree_leaves(updates):
    if isinstance(x, jax.core.Tracer):
      key = id(x)
      forget = lambda _, k=key: _per_replica.pop(k, None)
      _per_replica[key] = (weakref.ref(x, forget), agreed)


def check_not_per_replica(fn: str, axis_name: Any, updates: Any) -> None:
  """Raises when `updates` came from a wrapper whose decision was not
  reduced over every axis of `axis_name`: replicas that decided otherwise
  would be averaged together (or wait on each other)."""
  want = as_tuple(axis_name)
  for x in jax.tree_util.tree_leaves(updates):
    entry = _per_replica.get(id(x))
    if entry is None or entry[0]() is not x:
      continue
    missing = [n for n in want if n not in entry[1]]
    if missing:
      raise ValueError(
        f"`{fn}({axis_name!r})` is chained after a loss-scaling wrapper that"
        f" decides per replica: without `axis_name={missing[0]!r}` each replica"
        " skips or applies the step on its own gradients, and the replicas'"
        " scales and optimizer states drift apart. Chain"
        f" `{fn}({axis_name!r})` before the wrapper"
        f" (`optax.chain(lossscale.{fn}({axis_name!r}),"
        " lossscale.dynamic_loss_scale(...))`, which needs no further"
        f" collective), or pass `axis_name={axis_name!r}` to the wrapper."
      )
