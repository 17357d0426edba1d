"""Everything that differs across the supported JAX releases, in one place.

Jaxprs (`jax.extend.core`), tracer classes, effects and the `cond`
primitive change from release to release, and a few public spellings moved
(varying-axis types, batching an optimization barrier); the rest of the
package reaches them only through these functions.
tests/test_jax_internals.py checks each one at both ends of the supported
range (jax 0.4.35 and the newest), so a JAX release that changes one fails
there, by name, rather than somewhere downstream or, worse, in a silent
fallback.
"""

from __future__ import annotations

import functools
import inspect as _inspect
import numbers
from collections.abc import Hashable
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp

# `jax.extend.core` is imported with the package, not on first use:
# importing it registers configuration options, which changes JAX's tracing
# context, so a function traced before that import is traced again after
# it (the inner optimizer of a process's first `apply_gradients` step was
# traced twice: tests/test_fused.py).


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


# `closed` (a `ClosedJaxpr`) as a function of its inputs, which binds its
# equations where it is called (`jax.extend.core`, 0.4.35 to 0.12).
jaxpr_as_fun = jax_core.jaxpr_as_fun

# Primitives that name an axis but exchange nothing between replicas.
_LOCAL_AXIS_PRIMITIVES = frozenset({"axis_index", "pvary", "pcast", "pbroadcast"})


def inspect(closed: Any) -> tuple[tuple[Any, ...], bool]:
  """What a traced step (a `ClosedJaxpr`) does beyond computing: the named
  axes it communicates over, in order of first appearance (collectives,
  `psum`, `pmean`, `all_gather`, `ppermute`..., in its used equations,
  nested calls and branches included; `make_jaxpr` keeps dead code, such
  as an all-reduce `apply_gradients`' applied branch no longer uses), and
  whether it hands values out of itself (effects, `jax.debug.callback`,
  `io_callback`, but not the mark a collective over a `jax.vmap` axis
  leaves; or a call out, `jax.pure_callback`, a foreign function, a custom
  call, which have none). One walk, with no helper: it runs on every step."""
  effects = lambda x: any(type(e).__name__ != "NamedAxisEffect" for e in x.effects)
  variable = lambda v: not (hasattr(v, "val") and not hasattr(v, "count"))
  jaxpr = closed if _JAXPRS_HOLD_CONSTS else closed.jaxpr
  live = {v for v in jaxpr.outvars if variable(v)}
  todo: list[Any] = []
  for eqn in reversed(jaxpr.eqns):  # the live top-level equations
    if effects(eqn) or any(v in live for v in eqn.outvars):
      todo.append(eqn)
      live.update(v for v in eqn.invars if variable(v))
  axes: dict[Any, None] = {}
  hands = effects(closed)
  while todo:
    eqn = todo.pop()
    name = eqn.primitive.name
    hands = hands or "callback" in name or name == "ffi_call" or "custom_call" in name
    if name not in _LOCAL_AXIS_PRIMITIVES:
      names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
      names = names if isinstance(names, (tuple, list)) else (names,)
      # Positional axes (integers, NumPy's too: `reduce_sum`'s, or a
      # collective over a vmapped dimension) are not named axes.
      for n in names:
        if isinstance(n, Hashable) and not isinstance(n, numbers.Integral):
          axes[n] = None
    # Nested jaxprs: calls, branches, loop bodies, held as they are, in a
    # tuple, or (JAX 0.12's `custom_root`) as an attribute of a parameter.
    values = list(eqn.params.values())
    values += [a for v in values if hasattr(v, "__dict__") for a in vars(v).values()]
    for value in values:
      for item in value if isinstance(value, (tuple, list)) else (value,):
        item = getattr(item, "jaxpr", item)  # a ClosedJaxpr's Jaxpr
        eqns = getattr(item, "eqns", None)
        if eqns is not None:
          todo.extend(reversed(eqns))
  return tuple(axes), hands


@functools.cache
def _var_takes_suffix() -> bool:
  return "suffix" in _inspect.signature(jax_core.Var).parameters


def new_var(aval: Any) -> Any:
  """A fresh jaxpr variable of type `aval` (jax 0.4.35 also took a suffix).

  Which constructor this JAX has is found once: a large step makes tens of
  thousands of variables.
  """
  var: Any = jax_core.Var
  return var("", aval) if _var_takes_suffix() else var(aval)


# Whether a jaxpr carries its constants itself: from jax 0.12 on,
# `ClosedJaxpr` is `Jaxpr` (the name kept as an alias, to be removed), and
# `closed.jaxpr`, the closed jaxpr itself, is a legacy accessor too.
_JAXPRS_HOLD_CONSTS = getattr(jax_core, "ClosedJaxpr", jax_core.Jaxpr) is jax_core.Jaxpr


def open_jaxpr(closed: Any) -> Any:
  """The jaxpr of a closed one (`jax.make_jaxpr`'s result, a `jit` call's
  `jaxpr` parameter): its `constvars`, `invars`, `outvars` and
  `debug_info` (`eqns`, `effects` and `consts` are the closed one's too)."""
  return closed if _JAXPRS_HOLD_CONSTS else closed.jaxpr


def close_jaxpr(jaxpr: Any) -> Any:
  """`jaxpr`, built without constants, closed, as `cond_p` takes branches."""
  if _JAXPRS_HOLD_CONSTS:
    return jaxpr
  return jax_core.ClosedJaxpr(jaxpr, [])


def is_literal(v: Any) -> bool:
  """Whether the jaxpr atom `v` is a `Literal` (a constant), not a `Var`."""
  return hasattr(v, "val") and not hasattr(v, "count")


def bind_eqn(eqn: Any, args: list[Any]) -> list[Any]:
  """Binds the equation `eqn` to `args` in the current trace; its results
  as a list (jax before 0.5 split its parameters into subfunctions)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns: Any = ()
  if isinstance(params, tuple):  # jax < 0.5: (subfuns, params)
    subfuns, params = params
  with eqn.ctx.manager:
    result = eqn.primitive.bind(*subfuns, *args, **params)
  return list(result) if eqn.primitive.multiple_results else [result]


def repoint_eqn(eqn: Any, invars: list[Any], outvars: list[Any]) -> Any:
  """`eqn` reading `invars` and writing `outvars` instead."""
  return eqn.replace(invars=invars, outvars=outvars)


def closed_jaxpr(
  invars: list[Any], outvars: list[Any], eqns: list[Any], debug_info: Any
) -> Any:
  """A closed jaxpr without constants, from its parts (as `bind_cond` takes
  branches)."""
  return close_jaxpr(jax_core.Jaxpr([], invars, outvars, eqns, debug_info=debug_info))


def bind_cond(index: Any, operands: list[Any], branches: tuple[Any, ...]) -> list[Any]:
  """The `cond` primitive bound directly: `branches[index](*operands)`, the
  branches closed jaxprs taking `operands` (no second trace, as `lax.cond`
  would make)."""
  return jax_core.primitives.cond_p.bind(index, *operands, branches=branches)


def nameless_debug_info(like: Any) -> Any:
  """Debug info for a jaxpr built from `like`'s equations: its function's,
  argument and result names unknown (JAX before 0.5 takes None)."""
  info = getattr(open_jaxpr(like), "debug_info", None)
  if info is None or not hasattr(info, "resolve_result_paths"):
    return None
  try:
    return info._replace(arg_names=None, result_paths=None)
  except (AttributeError, TypeError, ValueError):  # another JAX's spelling
    return None


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


def _barrier_batches() -> bool:
  """Whether this JAX can `vmap` an optimization barrier (jax 0.4.35 cannot):
  asked once, at import, abstractly (no device is touched)."""
  try:
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    jax.eval_shape(jax.vmap(jax.lax.optimization_barrier), spec)
  except Exception:
    return False
  return True


# Whether the unscale factors can sit behind an optimization barrier, which
# keeps XLA from folding them into one subnormal (`_unscale.unscale_factors`).
BARRIER_BATCHES = _barrier_batches()
