"""The loss side of loss scaling: read the scale, scale the loss, differentiate it."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lossscale._rule import LossScaleState, states_in

T = TypeVar("T")


def _unwrap(x: Any) -> Any:
  # Flax NNX keeps optimizer-state leaves inside `nnx.Variable`s.
  if hasattr(x, "get_value"):
    return x.get_value()
  return getattr(x, "value", x)


def in_multi_steps(tree: Any) -> bool:
  """Whether a `LossScaleState` in `tree` sits inside `optax.MultiSteps`."""
  is_multi = lambda x: isinstance(x, optax.MultiStepsState)
  nodes = jax.tree_util.tree_leaves(tree, is_leaf=is_multi)
  return any(is_multi(node) and states_in(node) for node in nodes)


def multi_steps_error() -> ValueError:
  """The one message for a wrapper inside `optax.MultiSteps`."""
  return ValueError(
    "The loss-scaling wrapper is inside optax.MultiSteps"
    " (`optax.MultiSteps(dynamic_loss_scale(...), k)`): an inf in one"
    " micro-batch enters MultiSteps' accumulator, which it resets by"
    " multiplying by zero (inf * 0 = NaN), so every later step is skipped"
    " and training stops. Put the wrapper outside:"
    " `dynamic_loss_scale(optax.MultiSteps(inner, k).gradient_transformation())`"
    " drops a bad micro-batch alone; for PyTorch's accumulation (one scale"
    " and one decision per optimizer step), accumulate the scaled gradients"
    " yourself and call the wrapper once per optimizer step (the"
    " 'Gradient accumulation' section of the How-it-works page)."
  )


def find_state(x: Any) -> LossScaleState:
  """Returns the one `LossScaleState` inside `x` (an opt_state or its owner).

  `x` may be an optax state (the loss-scale state nested anywhere inside),
  a Flax `TrainState` or an `nnx.Optimizer` (anything with an `opt_state`).
  A state inside `optax.MultiSteps` is refused: there one inf micro-batch
  makes every later step NaN.
  """
  tree = getattr(x, "opt_state", x)
  if in_multi_steps(tree):
    raise multi_steps_error()
  found = states_in(tree)
  if len(found) != 1:
    what = "none" if not found else f"{len(found)}"
    raise ValueError(
      f"Expected exactly one lossscale.LossScaleState inside the given"
      f" {type(x).__name__}, found {what}. Build the optimizer with"
      " lossscale.dynamic_loss_scale / static_loss_scale / skip_nonfinite,"
      " and pass its state (or a TrainState / nnx.Optimizer holding it)."
    )
  return found[0]


def get_loss_scale(x: Any) -> jax.Array:
  """Returns the current loss scale as a float32 array.

  Args:
    x: an optimizer state with a [`lossscale.LossScaleState`][] nested
      anywhere inside, a [`lossscale.flax.TrainState`][] (or any object with
      an `opt_state`), or an `nnx.Optimizer`.

  Returns:
    The float32 scale (a scalar; one per member under `jax.vmap`).

  Raises:
    ValueError: when `x` does not hold exactly one `LossScaleState`.

  Examples:
    >>> import optax, jax.numpy as jnp
    >>> import lossscale as ls
    >>> inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    >>> tx = optax.chain(optax.add_decayed_weights(1e-4), ls.dynamic_loss_scale(inner))
    >>> ls.get_loss_scale(tx.init(jnp.zeros(3)))
    Array(32768., dtype=float32)
  """
  return jnp.asarray(_unwrap(find_state(x).loss_scale), jnp.float32)


def _scale_of(x: Any) -> jax.Array:
  if isinstance(x, (int, float)) or (
    hasattr(x, "dtype") and hasattr(x, "shape") and not isinstance(x, LossScaleState)
  ):
    return jnp.asarray(x, jnp.float32)
  return get_loss_scale(x)


def scale_loss(loss: jax.Array, x: Any) -> jax.Array:
  """Returns `loss * loss_scale`, computed in float32.

  The product is taken in float32 whatever the loss dtype, so a float16 loss
  times a scale of 2**15 does not overflow.

  Args:
    loss: the (unscaled) loss, any floating dtype.
    x: where to read the scale: an optimizer state, a TrainState, an
      `nnx.Optimizer` (see [`lossscale.get_loss_scale`][]), or the scale
      itself.

  Returns:
    The scaled loss as float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> ls.scale_loss(jnp.float16(4.0), 2.0**15)
    Array(131072., dtype=float32)
  """
  return jnp.asarray(loss).astype(jnp.float32) * _scale_of(x)


def _is_inexact_array(x: Any) -> bool:
  # The leaves `equinox.filter_value_and_grad` differentiates: floating or
  # complex JAX/NumPy arrays. Python scalars are not arrays.
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) and bool(
    jnp.issubdtype(x.dtype, jnp.inexact)
  )


def _check_argnums(argnums: Any) -> int | tuple[int, ...]:
  try:
    return operator.index(argnums)
  except TypeError:
    pass
  try:
    nums = tuple(operator.index(a) for a in argnums)
  except TypeError:
    raise TypeError(
      "`lossscale.value_and_grad(argnums=...)` must be an int or a sequence of"
      f" ints, got {argnums!r} instead."
    ) from None
  if not nums:
    raise ValueError(
      "`lossscale.value_and_grad(argnums=...)` must name at least one"
      " positional argument, got () instead."
    )
  if len(set(nums)) != len(nums):
    raise ValueError(
      f"`lossscale.value_and_grad(argnums={argnums!r})` repeats an argument;"
      " jax.value_and_grad does not support repeated argnums either."
    )
  return nums


def _positions(argnums: int | tuple[int, ...], n: int) -> tuple[int, ...]:
  """`argnums` as non-negative positions among `n` positional arguments."""
  nums = (argnums,) if isinstance(argnums, int) else argnums
  if max(nums) >= n:  # jax.value_and_grad raises TypeError here, too.
    raise TypeError(
      f"`lossscale.value_and_grad(argnums={argnums!r})` needs at least"
      f" {max(nums) + 1}, got {n} positional arguments after the scale source."
    )
  if min(nums) < -n:  # ... and ValueError here.
    raise ValueError(
      f"`lossscale.value_and_grad(argnums={argnums!r})`: index {min(nums)} is"
      f" out of range (valid: -{n} to {n - 1}), got {n} positional arguments"
      " after the scale source."
    )
  positions = tuple(a + n if a < 0 else a for a in nums)
  if len(set(positions)) != len(positions):
    raise ValueError(
      f"`lossscale.value_and_grad(argnums={argnums!r})` names the same"
      f" argument twice among {n} positional arguments; jax.value_and_grad"
      " does not support repeated argnums either."
    )
  return positions


def _is_nnx(x: Any) -> bool:
  """A Flax NNX object (module, optimizer, variable), without importing Flax."""
  return any(c.__module__.startswith("flax.nnx") for c in type(x).__mro__)


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """Like `jax.value_and_grad`, with the loss scaled before differentiation.

  The returned function takes the scale source first, then `fun`'s arguments:
  `grad_fn(scale_source, *args, **kwargs)`. The scale source is never
  differentiated; `argnums` counts `fun`'s own positional arguments, negative
  values from the end, as in `jax.value_and_grad`. It returns the *unscaled*
  loss (with aux when `has_aux`) and the gradients of the *scaled* loss
  [`scale_loss(loss, scale_source)`][lossscale.scale_loss], which a
  loss-scaling wrapper's `update` divides back.

  A differentiated argument may be any pytree, such as an Equinox module: its
  floating and complex array leaves (JAX or NumPy) are differentiated, and
  every other leaf (integer or bool arrays, functions, Python numbers) gets
  `None`, as `equinox.filter_value_and_grad` does. So a Python `float` gets
  `None`; pass `jnp.asarray(x)` to differentiate it. When every leaf is a
  floating array, the result is exactly that of `jax.value_and_grad`. A Flax
  NNX module is differentiated by `nnx.value_and_grad` (its `nnx.Param`
  variables, with the updates the loss makes to its other state, such as
  BatchNorm statistics, carried out as NNX does).

  Args:
    fun: the loss function; returns a real scalar loss, or `(loss, aux)` when
      `has_aux`.
    argnums: which of `fun`'s positional arguments to differentiate: an int
      or a sequence of ints (then the gradients come as a tuple).
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    `grad_fn(scale_source, *args, **kwargs) -> (loss, grads)`, or
    `((loss, aux), grads)` with `has_aux`, where `scale_source` is anything
    [`lossscale.scale_loss`][] accepts.

  Raises:
    TypeError: `argnums` is not an int or a sequence of ints; or, when called,
      it points past the last positional argument, `fun` returns a loss that
      is not a real floating scalar, or (with `has_aux`) not a pair.
    ValueError: `argnums` is empty or names an argument twice; or, when
      called, a negative index is below `-len(args)`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> params = {"w": jnp.array([1.0, 2.0]), "steps": 3}
    >>> loss_fn = lambda p, x: jnp.sum(p["w"] * x)
    >>> ls.value_and_grad(loss_fn)(8.0, params, jnp.array([1.0, -1.0]))
    (Array(-1., dtype=float32), {'steps': None, 'w': Array([ 8., -8.], dtype=float32)})

  References:
    Micikevicius et al., 2018, "Mixed Precision Training" (loss scaling).
  """
  argnums = _check_argnums(argnums)

  def wrapped(scale_source, *args, **kwargs):
    scale = _scale_of(scale_source)
    positions = _positions(argnums, len(args))
    diff_argnums = positions[0] if isinstance(argnums, int) else tuple(positions)

    def scaled_loss(out):
      if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
        if hasattr(out, "shape") and hasattr(out, "dtype"):  # maybe a tracer
          got = f"a {out.dtype}{list(out.shape)} array"
        elif isinstance(out, (tuple, list)):
          got = f"a {type(out).__name__} of {len(out)}"
        else:
          got = type(out).__name__
        raise TypeError(
          "`lossscale.value_and_grad(has_aux=True)` needs `fun` to return a"
          f" pair (loss, aux), got {got} instead."
        )
      loss, aux = out if has_aux else (out, None)
      dtype = jnp.asarray(loss).dtype
      if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
          "`lossscale.value_and_grad` needs `fun` to return a real floating"
          f" loss (as jax.value_and_grad does), got dtype {dtype} instead."
        )
      return scale_loss(loss, scale), (loss, aux)

    # Flax NNX modules hold state the loss may update (BatchNorm statistics,
    # Dropout's RNG counts): NNX's own transformation carries those updates
    # out, and differentiates their `nnx.Param` variables, as
    # `nnx.Optimizer(..., wrt=nnx.Param)` expects.
    with_nnx = [any(map(_is_nnx, jax.tree.leaves(a, is_leaf=_is_nnx))) for a in args]
    args = list(args)
    # Arguments with leaves that cannot be differentiated: jax differentiates
    # a copy holding None there; `scaled` puts the original leaves back.
    held = {}
    for i in positions:
      if with_nnx[i]:
        continue  # NNX decides, by its own rules
      leaves, treedef = jax.tree.flatten(args[i])
      keep = [_is_inexact_array(x) for x in leaves]
      if not all(keep):
        held[i] = (treedef, leaves, keep)
        args[i] = treedef.unflatten(
          [x if k else None for x, k in zip(leaves, keep, strict=True)]
        )

    def scaled(*diff_args):
      full = list(diff_args)
      for i, (treedef, leaves, keep) in held.items():
        diff = treedef.flatten_up_to(full[i])
        full[i] = treedef.unflatten(
          [d if k else x for d, x, k in zip(diff, leaves, keep, strict=True)]
        )
      return scaled_loss(fun(*full, **kwargs))

    if any(with_nnx):
      from flax import nnx

      transform = nnx.value_and_grad
    else:
      transform = jax.value_and_grad
    grad_fn = transform(scaled, argnums=diff_argnums, has_aux=True)
    (_, (loss, aux)), grads = grad_fn(*args)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped
