"""Argument checks: settings at construction, gradient trees at the step.

Settings are checked in Python on concrete values, before anything is
traced; each error names the constructor, the argument and the bad value.
The gradient-tree checks (`check_gradients`) run when a step is traced, and
say what does not fit before the inner optimizer fails on it deep inside.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale._rule import LossScaleState
from lossscale._unscale import is_array, is_inexact

_INT32_MAX = 2**31 - 1


INT32_MAX = _INT32_MAX  # where the int32 counters saturate


_F32_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 2**-126


def _check_not_traced(fn: str, name: str, value: Any) -> None:
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
      f"`{fn}({name}=...)` must be a concrete number, got a traced value: the"
      " settings are fixed when the wrapper is built. Under"
      " `optax.inject_hyperparams`, inject the inner optimizer's"
      " hyperparameters instead (`inject_hyperparams(optax.adam)(...)` as"
      " `inner`)."
    )


def _is_real_dtype(dtype: Any) -> bool:
  """Integer or floating, bfloat16 and the other ml_dtypes floats included."""
  return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))


def _concrete_number(fn: str, name: str, value: Any) -> float:
  """Accepts Python, NumPy and concrete JAX real scalars (not bools)."""
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    return float(value)
  _check_not_traced(fn, name, value)
  dtype = getattr(value, "dtype", None)
  if (
    dtype is not None and getattr(value, "shape", None) == () and _is_real_dtype(dtype)
  ):
    return float(value)
  raise ValueError(f"`{fn}({name}=...)` must be a real number, got {value!r} instead.")


def positive_finite(fn: str, name: str, value: Any) -> float:
  """Returns `value` as a float, or raises naming `fn(name=...)`."""
  v = _concrete_number(fn, name, value)
  if not (math.isfinite(v) and v > 0.0):
    raise ValueError(
      f"`{fn}({name}=...)` must be a positive finite number, got {value!r}."
    )
  return v


def at_least_one(fn: str, name: str, value: Any) -> float:
  v = _concrete_number(fn, name, value)
  if not (math.isfinite(v) and v >= 1.0):
    raise ValueError(f"`{fn}({name}=...)` must be a finite number >= 1, got {value!r}.")
  return v


def in_unit_interval(fn: str, name: str, value: Any) -> float:
  """Checks `0 < value <= 1`."""
  v = _concrete_number(fn, name, value)
  if not (0.0 < v <= 1.0):
    raise ValueError(
      f"`{fn}({name}=...)` must be in the interval (0, 1], got {value!r}."
    )
  return v


def fraction(fn: str, name: str, value: Any) -> float:
  """Checks `0 <= value <= 1`."""
  v = _concrete_number(fn, name, value)
  if not (0.0 <= v <= 1.0):
    raise ValueError(
      f"`{fn}({name}=...)` must be in the interval [0, 1], got {value!r}."
    )
  return v


def non_negative_int(fn: str, name: str, value: Any) -> int:
  """Accepts Python, NumPy and concrete JAX integer scalars in [0, 2**31 - 1]."""
  return int_at_least(fn, name, value, 0, "a non-negative int")


def positive_int(fn: str, name: str, value: Any) -> int:
  """Accepts Python, NumPy and concrete JAX integer scalars in [1, 2**31 - 1]."""
  return int_at_least(fn, name, value, 1, "a positive int")


def int_at_least(fn: str, name: str, value: Any, lowest: int, kind: str) -> int:
  v = None
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    v = int(value)
  else:
    _check_not_traced(fn, name, value)
    dtype = getattr(value, "dtype", None)
    if (
      dtype is not None
      and getattr(value, "shape", None) == ()
      and np.issubdtype(dtype, np.integer)
    ):
      v = int(value)
  if v is None:
    raise ValueError(f"`{fn}({name}=...)` must be {kind}, got {value!r}.")
  if not lowest <= v <= _INT32_MAX:
    raise ValueError(
      f"`{fn}({name}=...)` must be {kind} no larger than {_INT32_MAX}, got {value!r}."
    )
  return v


def boolean(fn: str, name: str, value: Any) -> bool:
  """Accepts `True` and `False` (Python or NumPy bools) only."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"`{fn}({name}=...)` must be True or False, got {value!r}.")
  return bool(value)


def float32_scale(fn: str, name: str, value: Any) -> float:
  """A loss-scale setting: a positive number that is a normal float32.

  Below float32's smallest normal (2**-126) the reciprocal `1 / scale`
  overflows to inf and every step would be skipped. Returns the value as
  float32 rounds it, so the closure holds exactly what the state will.
  """
  v = positive_finite(fn, name, value)
  with np.errstate(over="ignore", under="ignore"):
    v32 = float(np.float32(v))
  if not (math.isfinite(v32) and v32 >= _F32_MIN_NORMAL):
    raise ValueError(
      f"`{fn}({name}=...)` must be a normal float32, between 2**-126"
      f" (about 1.18e-38) and the float32 maximum (about 3.4e38), got {value!r}."
    )
  return v32


def check_inner(fn: str, inner: Any) -> None:
  if isinstance(inner, optax.MultiSteps):
    raise TypeError(
      f"`{fn}(inner=...)` must be an optax.GradientTransformation, got an"
      " optax.MultiSteps object: pass `multi_steps.gradient_transformation()`."
    )
  if not isinstance(inner, optax.GradientTransformation):
    raise TypeError(
      f"`{fn}(inner=...)` must be an optax.GradientTransformation, got"
      f" {type(inner).__name__} instead."
    )


# Flax's float8 layers keep their scales and amax histories in this
# collection; their "gradients" are their new values, not gradients.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def check_update(fn: str, updates: Any, state: Any, params: Any, apply: Any) -> None:
  """What a wrapper's `update` refuses before its step is traced: Flax's
  float8 state among the gradients (it would be divided by the loss
  scale), a state that is not its own, and (with `params`) gradients that
  cannot be the gradient of `params` for the inner optimizer, which
  `apply()` runs (under `eval_shape`, only where the trees differ)."""
  for path, _ in jax.tree_util.tree_flatten_with_path(updates)[0]:
    if any(getattr(k, "key", None) == OVERWRITE_WITH_GRADIENT for k in path):
      raise ValueError(
        f"`{fn}`: the gradients hold Flax's float8 state at"
        f" {jax.tree_util.keystr(path)} (the `{OVERWRITE_WITH_GRADIENT}`"
        " collection, whose 'gradients' are the new scales and amax"
        " histories, not gradients of the scaled loss): the wrapper would"
        " divide them by the loss scale. Give the wrapper the trained"
        " parameters' gradients only (`grads['params']`) and overwrite the"
        " float8 state yourself, or use lossscale.flax.TrainState, which"
        " does both as Flax's TrainState does."
      )
  if not isinstance(state, LossScaleState):
    raise TypeError(
      f"`{fn}(...).update` expects the lossscale.LossScaleState that the"
      f" wrapper's `init` builds, got {type(state).__name__} instead. Build"
      " the state with `tx.init(params)` of the same wrapper (an optimizer"
      " state saved without the wrapper cannot be resumed as one)."
    )
  shapes = lambda t: [getattr(x, "shape", None) for x in jax.tree.leaves(t)]
  g_def: Any = jax.tree.structure(updates)  # Any: see `cast_like`
  if params is None or (
    g_def == jax.tree.structure(params) and shapes(updates) == shapes(params)
  ):
    return  # the common case: the gradients have the params' tree and shapes
  _check_gradients(fn, updates, params, state.inner_state, apply)


def _gradients_tree_in(params: Any, grads: Any) -> Any:
  """`params`, or the first subtree of it with the gradients' structure
  (`optax.lookahead`'s `LookaheadParams(fast, slow)` holds two), or None."""
  g_def: Any = jax.tree.structure(grads)  # Any: see `cast_like`
  if g_def == jax.tree.structure(params) or _none_for_integers(grads, params):
    return params
  like = lambda x: x is not params and jax.tree.structure(x) == g_def
  subtrees = [x for x in jax.tree.leaves(params, is_leaf=like) if like(x)]
  return subtrees[0] if subtrees else None


def _is_none(x: Any) -> bool:
  return x is None


def _params_without_gradient(grads: Any, params: Any) -> list[tuple[str, Any]] | None:
  """`(where, parameter)` for each leaf of `params` whose gradient is None,
  when `grads` is `params`' tree with None at some leaves (what
  `value_and_grad` gives non-array and integer parameters), else None."""
  # None counts as a leaf on both sides: a None parameter (an optional
  # submodule) has a None gradient, beside integer parameters' None.
  g_leaves, g_def = jax.tree_util.tree_flatten(grads, is_leaf=_is_none)
  p_leaves, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_none)
  g_def = cast(Any, g_def)  # see `cast_like`
  if g_def != p_def or len(g_leaves) != len(p_leaves):
    return None
  return [
    (jax.tree_util.keystr(path) or "the root", p)
    for g, (path, p) in zip(g_leaves, p_leaves, strict=True)
    if g is None and p is not None
  ]


def _none_for_integers(grads: Any, params: Any) -> bool:
  """Whether `grads` is `params`' tree with None at some integer or boolean
  leaves (what `value_and_grad` gives them), and nowhere else."""
  nones = _params_without_gradient(grads, params)
  return bool(nones) and all(is_array(p) and not is_inexact(p) for _, p in nones or ())


def _structure_mismatch(fn: str, grads: Any, params: Any) -> str:
  number = _python_number_without_gradient(grads, params)
  if number is not None:
    where, value = number
    return (
      f"`{fn}`: the parameter at {where} is a Python {type(value).__name__}"
      f" ({value!r}) and its gradient is None: `lossscale.value_and_grad`"
      " differentiates array leaves only (as `equinox.filter_value_and_grad`"
      " does), while under `jax.jit` a Python number arrives as an array and"
      f" is differentiated. Hold it as an array (`jnp.asarray({value!r})`) to"
      " train it, or leave it out of the params given to the optimizer"
      " (`eqx.filter(params, eqx.is_inexact_array)`) to keep it fixed."
    )
  return (
    f"`{fn}`: the gradient tree does not match the params tree the"
    f" optimizer state was built for.\n  gradients: {jax.tree.structure(grads)}"
    f"\n  params:    {jax.tree.structure(params)}"
  )


def _python_number_without_gradient(grads: Any, params: Any) -> tuple[str, Any] | None:
  """`(where, value)` of the first Python-number parameter whose gradient is
  None (what `value_and_grad` gives it outside `jax.jit`), or None."""
  for where, p in _params_without_gradient(grads, params) or ():
    if isinstance(p, (int, float, complex)) and not isinstance(p, bool):
      return where, p
  return None


def _shape_pairs(grads: Any, params: Any) -> Iterator[tuple[str, Any, Any]]:
  """`(where, gradient shape, parameter shape)` for each pair of leaves that
  both have a shape."""
  # None leaves count as leaves (a None gradient of an integer parameter).
  for (path, g), p in zip(
    jax.tree_util.tree_leaves_with_path(grads, is_leaf=_is_none),
    jax.tree_util.tree_leaves(params, is_leaf=_is_none),
    strict=True,
  ):
    g_shape, p_shape = getattr(g, "shape", None), getattr(p, "shape", None)
    if g_shape is not None and p_shape is not None:
      yield jax.tree_util.keystr(path) or "the root", g_shape, p_shape


def _shape_mismatch(fn: str, grads: Any, params: Any) -> str | None:
  """Why a leaf of `grads` cannot be the gradient of `params`' leaf, or None.

  A gradient may carry leading dimensions the parameter lacks: per-example
  gradients, shaped `(batch, *param.shape)`, as `optax.contrib.dpsgd` takes.
  """
  for where, g_shape, p_shape in _shape_pairs(grads, params):
    if len(g_shape) < len(p_shape) or g_shape[len(g_shape) - len(p_shape) :] != p_shape:
      return (
        f"`{fn}`: the gradient at {where} has shape {g_shape}, but the"
        f" parameter there has shape {p_shape} (a gradient has the"
        " parameter's shape, or per-example gradients a leading batch"
        " dimension before it)."
      )
  return None


def _leading_dims_at(grads: Any, params: Any) -> str | None:
  """The path of the first gradient with leading (per-example) dimensions."""
  for where, g_shape, p_shape in _shape_pairs(grads, params):
    if g_shape != p_shape:
      return f"{where} has shape {g_shape}"
  return None


def _check_gradients(
  fn: str, grads: Any, params: Any, inner_state: Any, apply: Any
) -> None:
  """Raises a clear `ValueError` when `grads` cannot be the gradient of
  `params` for the inner optimizer (`apply` runs it, under `eval_shape`)."""
  target = _gradients_tree_in(params, grads)
  if target is not None:
    mismatch = _shape_mismatch(fn, grads, target)
    if mismatch is not None:
      raise ValueError(mismatch)
    at = _leading_dims_at(grads, target)
    if at is None:
      return
    mismatch = (
      f"`{fn}`: the gradient at {at}, with leading dimensions before its"
      " parameter's shape: per-example gradients, which the inner optimizer"
      " does not take (it would broadcast them into its state or updates)."
      " Use an optimizer that takes them (optax.contrib.dpsgd), or reduce"
      " them first."
    )
  else:
    mismatch = _structure_mismatch(fn, grads, params)
  # Some optimizers take other params (`optax.lookahead`), or per-example
  # gradients (`optax.contrib.dpsgd`): refuse only what `inner` itself cannot
  # take, or takes by changing its state's shapes or returning updates that
  # do not fit `params`.
  try:
    new_updates, new_state = jax.eval_shape(apply)
  except Exception as e:
    first_line = (str(e).splitlines() or [""])[0]
    raise ValueError(
      f"{mismatch}\n  (the inner optimizer raised {type(e).__name__}: {first_line})"
    ) from e
  if not (_keeps_types(new_updates, params) and _keeps_types(new_state, inner_state)):
    raise ValueError(mismatch)


def _keeps_types(new: Any, old: Any) -> bool:
  """Whether `new` has `old`'s tree structure and leaf shapes (a None in
  `new` standing for an integer leaf of `old`, as `optax.masked` passes a
  None gradient through)."""
  if _none_for_integers(new, old):
    pairs = zip(
      jax.tree.leaves(new, is_leaf=_is_none),
      jax.tree.leaves(old, is_leaf=_is_none),
      strict=True,
    )
    kept = [(n, o) for n, o in pairs if n is not None and o is not None]
    new, old = [n for n, _ in kept], [o for _, o in kept]
  new_def: Any = jax.tree.structure(new)  # Any: see `cast_like`
  if new_def != jax.tree.structure(old):
    return False
  shapes = lambda t: [getattr(x, "shape", None) for x in jax.tree.leaves(t)]
  return shapes(new) == shapes(old)


def loss_value(fn: str, spikes: Any, loss: Any) -> Any:
  """The loss the decision reads, optax's `value=`: a real floating scalar,
  or a Python float (taken as float32, as `jax.jit` would; a Python int is
  refused, as `jax.jit` makes it an int32); with `spikes` testing the loss
  it must be given."""
  if isinstance(loss, float):
    loss = jnp.asarray(loss, jnp.float32)
  if loss is not None:
    dtype, shape = getattr(loss, "dtype", None), getattr(loss, "shape", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
        f"`{fn}(...).update(value=...)` must be the loss, a real floating scalar"
        f" (optax's name for it), got {type(loss).__name__} of dtype {dtype} and"
        f" shape {shape} instead."
      )
  if spikes is not None and spikes.loss and loss is None:
    raise ValueError(
      f"`{fn}(skip_spikes=...)` tests the loss, and `update` was not given it:"
      " pass the unscaled loss as optax's `value=`"
      " (`tx.update(grads, state, params, value=loss)`,"
      " `ls.apply_gradients(tx, grads, state, params, value=loss)`,"
      " `TrainState.apply_gradients(grads=grads, value=loss)`,"
      " `lossscale.flax.nnx_step(..., pass_loss=True)`), or test"
      " the gradient norm only (`SkipSpikes(loss=False)`)."
    )
  return loss
