"""Tracing a function once per argument types, however often it is called.

A wrapper's step traces its inner step (the unscale, the inner optimizer,
its state cast back to its dtypes) where it needs its output shapes (for a
skipped step's zero updates) and again where it runs it (a branch of
`lax.cond`, the second pass of `apply_gradients`, the second call that
writes bfloat16 state last). Tracing an optimizer costs milliseconds per parameter
leaf, so tracing it once matters for models with thousands of leaves.
`once(fn)` routes every call through one `jax.jit` of `fn`: JAX caches the
trace by the arguments' types, so later calls with the same types (under
`eval_shape`, inside `lax.cond`, in another pass) reuse it. Outside any
trace the wrapper does not use it: there `inner` runs op by op, as it does
bare.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax

from lossscale import _speed
from lossscale._dtypes import is_array

# How many static parts (tree structures, non-array values such as a `tx`
# or a `value_fn`) keep their compiled step.
_KEPT = 8


def _key(x: Any) -> Any:
  # Python numbers by their exact spelling: `0.0 == -0.0` and `1 == 1.0 ==
  # True`, but a trace that baked one in is not a trace for the other.
  if isinstance(x, (bool, int, float, complex)):
    return type(x), repr(x)
  return type(x), x


class _Static:
  """What `jax.jit` sees as one static argument: the arguments' tree
  structure and every leaf that is not an array (Python numbers, callables
  such as `optax.lbfgs`'s `value_fn`), compared by value."""

  def __init__(self, treedef: Any, is_array: tuple[bool, ...], values: list[Any]):
    self.treedef, self.is_array, self.values = treedef, is_array, values
    self._key = (treedef, is_array, tuple(_key(v) for v in values))
    self._hash = hash(self._key)  # TypeError when a leaf is not hashable

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Static) and self._key == other._key


def once(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, traced once per argument types (see the module docstring).

  The arrays among the leaves of `fn`'s arguments are traced; every other
  leaf is static. A call with a leaf that is neither an array nor hashable
  runs `fn` as it is.
  """

  def call(static: _Static, arrays: list[Any]) -> Any:
    it = iter(arrays)
    values = iter(static.values)
    leaves = [next(it) if a else next(values) for a in static.is_array]
    return fn(*jax.tree_util.tree_unflatten(static.treedef, leaves))

  # One `jax.jit` per static part, the most recently used few kept: a jit's
  # cache would keep every static value it saw (a new `value_fn` closure
  # each step, and what it captured) for the life of the process.
  jitted: collections.OrderedDict[_Static, Any] = collections.OrderedDict()

  def traced_once(*args: Any) -> Any:
    if not _speed.on("once"):  # `LOSSSCALE_PLAIN=1`: traced wherever it is called
      return fn(*args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    arrays_at = tuple(is_array(x) for x in leaves)
    try:
      static = _Static(
        treedef, arrays_at, [x for x, a in zip(leaves, arrays_at, strict=True) if not a]
      )
    except TypeError:
      return fn(*args)
    compiled = jitted.get(static)
    if compiled is None:
      compiled = jitted[static] = jax.jit(functools.partial(call, static))
      while len(jitted) > _KEPT:
        jitted.popitem(last=False)
    else:
      jitted.move_to_end(static)
    return compiled([x for x, a in zip(leaves, arrays_at, strict=True) if a])

  return traced_once


class Step:
  """A token that names one step (a pytree with no leaves, so a `Decision`
  holding it may be returned from a jitted `tx.update`): the wrapper makes
  one per ordinary call and per decision, and a `Decision` carries its own
  to the calls that apply it."""


jax.tree_util.register_pytree_node(Step, lambda s: ((), s), lambda s, _: s)


class PerStep:
  """`fn` traced once per step (the one cache a wrapper keeps across calls).

  A wrapper's step asks for its inner step several times: for the output
  shapes, in a conditional, for the state in a second call
  (`apply_gradients`' decision and its applied branch, which find the step
  by the `Step` its `Decision` carries). `traced_for(step)` gives the same
  `once(fn)` for calls with the same `Step`, and a new one for a new step,
  which traces `fn` anew, as a new `jax.jit` of the bare optimizer does: so
  Python state the inner optimizer reads (a learning rate changed between
  two jitted steps) is read anew (tests/test_plain.py and
  tests/test_once.py check it). What it keeps is a weak reference to that
  token and the trace: nothing outlives the step but one jit cache entry
  per argument types, replaced by the next step's. With
  `LOSSSCALE_PLAIN=1` there is no cache: `fn` is traced where it is called.
  """

  def __init__(self, fn: Callable[..., Any]) -> None:
    self._fn = fn
    self._key: Any = None  # a weak reference to the step's `Step`
    self._traced: Callable[..., Any] | None = None

  def traced_for(self, step: Step) -> Callable[..., Any]:
    if not _speed.on("once"):
      return self._fn
    ref = self._key
    if self._traced is None or ref is None or ref() is not step:
      self._traced = once(self._fn)
      self._key = weakref.ref(step)
    return self._traced
