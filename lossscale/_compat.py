"""The few spellings that differ across the supported JAX range.

lossscale supports jax 0.4.35 up to the newest release. Everything else in
the package uses spellings that exist at both ends (`jax.tree_util.*`,
`optax.safe_increment`); what does not is here, once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp


def varying_axes(x: Any) -> frozenset:
  """The manual mesh axes `x` varies over inside `shard_map` (empty outside).

  `x` is an array, a tracer or a `jax.ShapeDtypeStruct`. JAX releases before
  varying-axis types (`jax.typeof(x).vma`) have no such notion: empty there.
  """
  aval = x
  if not isinstance(x, jax.ShapeDtypeStruct) and hasattr(jax, "typeof"):
    aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def cast_to_varying(x: Any, axes: tuple) -> Any:
  """Marks `x` as varying over `axes` too (free: no communication)."""
  return jax.lax.pcast(x, axes, to="varying")


@functools.cache
def _barrier_batches() -> bool:
  """Whether this JAX can `vmap` an optimization barrier (jax 0.4.35 cannot)."""
  try:
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    jax.eval_shape(jax.vmap(jax.lax.optimization_barrier), spec)
  except Exception:
    return False
  return True


def hide_from_constant_folding(x: Any) -> Any:
  """`x`, behind an optimization barrier where JAX can batch one.

  XLA folds and reassociates products of constants: with a loss scale known
  at compile time it would merge two exact factors into one subnormal that
  the CPU flushes to zero. The barrier keeps the factors apart. A JAX that
  cannot batch the barrier (jax 0.4.35, where `lax.cond` under `vmap`
  batches every operand of its branches) gets `x` as it is.
  """
  return jax.lax.optimization_barrier(x) if _barrier_batches() else x


def _jaxlib_version() -> tuple[int, ...]:
  import jaxlib

  parts = []
  for part in jaxlib.__version__.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit()) or "0"
    parts.append(int(digits))
  return tuple(parts)


# XLA before jaxlib 0.9.1 copies the bfloat16 moments of a fused step
# whether or not their writes are ordered after the parameters'; ordering
# them (`_loss_scale.read_after`) only added work there: 1.60x the bare
# step's bytes against 1.07x unordered, at every jaxlib from 0.4.35 to
# 0.9.0.1. From 0.9.1 on, XLA writes them in place once ordered: 1.30x
# against 1.60x (1M bfloat16 parameters, benchmarks/half_precision.py).
ORDER_FUSED_WRITES = _jaxlib_version() >= (0, 9, 1)


def staging() -> bool:
  """Whether the caller runs inside a trace that stages operations out
  (`jax.jit`, `lax.cond`'s branches, `make_jaxpr`), rather than eagerly or
  under an eager `jax.vmap`: there even a constant is a tracer."""
  return isinstance(jnp.zeros((), jnp.bool_), jax.core.Tracer)


def batched(x: Any) -> bool:
  """Whether `x` is batched by an enclosing `jax.vmap` being traced (JAX
  names its tracer class `BatchTracer` from 0.4.35 to 0.12; it is not
  public)."""
  return any(c.__name__ == "BatchTracer" for c in type(x).__mro__)


def order_narrow_writes() -> bool:
  """Whether a step writes bfloat16 optimizer state after the new parameters
  (`_loss_scale.read_after`), in place: on XLA:CPU, where it is faster in
  wall time (`apply_gradients` 0.78x of the bare step against 0.82x,
  `tx.update` 1.14x against 1.51x; 10M bfloat16 AdamW, jaxlib 0.12.0.1,
  in-process A/B), and only there: on XLA:GPU the ordering made XLA copy
  the state (`benchmarks/gpu.sh`, H200, jaxlib 0.11.2, 100M bfloat16
  parameters: `tx.update` 1.61x the bare step ordered, 1.41x not, in one
  process; `apply_gradients` 1.44x and 1.47x). `apply_gradients` orders
  them from jaxlib 0.9.1 only (`ORDER_FUSED_WRITES`)."""
  from lossscale import _speed

  return jax.default_backend() == "cpu" and _speed.on()


def has_effects(closed: Any) -> bool:
  """Whether the traced computation `closed` (a `ClosedJaxpr`) has effects
  (`jax.debug.callback`, `jax.debug.print`, `io_callback`), other than the
  mark a collective over a `jax.vmap` axis leaves, which does nothing."""
  return any(type(e).__name__ != "NamedAxisEffect" for e in closed.effects)


def jaxpr_as_fun(closed: Any) -> Any:
  """`closed` (a `ClosedJaxpr`) as a function of its inputs, which binds its
  equations where it is called (`jax.extend.core`, 0.4.35 to 0.12)."""
  from jax.extend.core import jaxpr_as_fun

  return jaxpr_as_fun(closed)


def hands_out(closed: Any) -> bool:
  """Whether the traced computation `closed` (a `ClosedJaxpr`) hands values
  out of itself: it has effects (`jax.debug.callback`, `jax.debug.print`,
  `io_callback`; not the mark a collective over a `jax.vmap` axis leaves,
  which hands nothing out), or calls out, nested calls and branches
  included (a `jax.pure_callback`, which has no effect, a foreign function,
  a custom call)."""
  if has_effects(closed):
    return True
  names = {eqn.primitive.name for eqn in eqns_within(closed.jaxpr)}
  return any("callback" in n or n == "ffi_call" or "custom_call" in n for n in names)


def eqns_within(jaxpr: Any) -> Iterator[Any]:
  """Every equation of `jaxpr` and of the jaxprs nested in its equations'
  parameters (calls, both branches of a conditional, loop bodies), a
  `ClosedJaxpr`'s or one held in a tuple included, and those an object
  parameter holds as attributes (JAX 0.12 binds `lax.custom_root` as a
  primitive whose one parameter keeps its jaxprs that way)."""
  for eqn in jaxpr.eqns:
    yield eqn
    yield from eqns_nested_in(eqn)


def eqns_nested_in(eqn: Any) -> Iterator[Any]:
  """Every equation of the jaxprs nested in `eqn`'s parameters (see
  `eqns_within`)."""
  for value in eqn.params.values():
    for sub in _nested_jaxprs(value):
      yield from eqns_within(sub)


def _nested_jaxprs(value: Any, depth: int = 0) -> Iterator[Any]:
  for item in value if isinstance(value, (tuple, list)) else (value,):
    item = getattr(item, "jaxpr", item)  # a ClosedJaxpr's Jaxpr
    if hasattr(item, "eqns"):
      yield item
    elif not depth and hasattr(item, "__dict__"):
      for attribute in vars(item).values():
        yield from _nested_jaxprs(attribute, depth + 1)


@functools.cache
def _var_takes_suffix() -> bool:
  import jax.extend.core as jax_core

  return "suffix" in inspect.signature(jax_core.Var).parameters


def new_var(aval: Any) -> Any:
  """A fresh jaxpr variable of type `aval` (jax 0.4.35 also took a suffix).

  Which constructor this JAX has is found once: a large step makes tens of
  thousands of variables.
  """
  import jax.extend.core as jax_core

  var: Any = jax_core.Var
  return var("", aval) if _var_takes_suffix() else var(aval)


@functools.cache
def _jaxprs_hold_consts() -> bool:
  """Whether a jaxpr carries its constants itself: from jax 0.12 on,
  `ClosedJaxpr` is `Jaxpr` (the name kept as an alias, to be removed), and
  `closed.jaxpr`, the closed jaxpr itself, is a legacy accessor too."""
  import jax.extend.core as jax_core

  return getattr(jax_core, "ClosedJaxpr", jax_core.Jaxpr) is jax_core.Jaxpr


def open_jaxpr(closed: Any) -> Any:
  """The jaxpr of a closed one (`jax.make_jaxpr`'s result, a `jit` call's
  `jaxpr` parameter): its `constvars`, `invars`, `outvars` and
  `debug_info` (`eqns`, `effects` and `consts` are the closed one's too)."""
  return closed if _jaxprs_hold_consts() else closed.jaxpr


def close_jaxpr(jaxpr: Any) -> Any:
  """`jaxpr`, built without constants, closed, as `cond_p` takes branches."""
  if _jaxprs_hold_consts():
    return jaxpr
  import jax.extend.core as jax_core

  return jax_core.ClosedJaxpr(jaxpr, [])
