"""Every use of JAX's private or unstable surface, in one place.

Jaxprs (`jax.extend.core`), tracer classes, effects and the `cond`
primitive change from release to release; the rest of the package reaches
them only through these functions. tests/test_jax_internals.py checks each
one at both ends of the supported range (jax 0.4.35 and the newest), so a
JAX release that changes one fails there, by name, rather than somewhere
downstream or, worse, in a silent fallback.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
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


def has_effects(closed: Any) -> bool:
  """Whether the traced computation `closed` (a `ClosedJaxpr`) has effects
  (`jax.debug.callback`, `jax.debug.print`, `io_callback`), other than the
  mark a collective over a `jax.vmap` axis leaves, which does nothing."""
  return any(type(e).__name__ != "NamedAxisEffect" for e in closed.effects)


def jaxpr_as_fun(closed: Any) -> Any:
  """`closed` (a `ClosedJaxpr`) as a function of its inputs, which binds its
  equations where it is called (`jax.extend.core`, 0.4.35 to 0.12)."""
  return jax_core.jaxpr_as_fun(closed)


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
  return "suffix" in inspect.signature(jax_core.Var).parameters


def new_var(aval: Any) -> Any:
  """A fresh jaxpr variable of type `aval` (jax 0.4.35 also took a suffix).

  Which constructor this JAX has is found once: a large step makes tens of
  thousands of variables.
  """
  var: Any = jax_core.Var
  return var("", aval) if _var_takes_suffix() else var(aval)


@functools.cache
def _jaxprs_hold_consts() -> bool:
  """Whether a jaxpr carries its constants itself: from jax 0.12 on,
  `ClosedJaxpr` is `Jaxpr` (the name kept as an alias, to be removed), and
  `closed.jaxpr`, the closed jaxpr itself, is a legacy accessor too."""
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
  return jax_core.ClosedJaxpr(jaxpr, [])


def is_literal(v: Any) -> bool:
  """Whether the jaxpr atom `v` is a `Literal` (a constant), not a `Var`."""
  return hasattr(v, "val") and not hasattr(v, "count")


def live_eqns(jaxpr: Any) -> list[Any]:
  """The top-level equations of `jaxpr` whose results are used (or that
  have effects), last first: `make_jaxpr` keeps dead code, such as an
  all-reduce chained before the wrapper that `apply_gradients`' applied
  branch does not use."""
  live = {v for v in jaxpr.outvars if not is_literal(v)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if has_effects(eqn) or any(v in live for v in eqn.outvars):
      kept.append(eqn)
      live.update(v for v in eqn.invars if not is_literal(v))
  return kept


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
