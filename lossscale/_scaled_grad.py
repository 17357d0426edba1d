"""Reading the scale out of an optimizer state, and scaling losses with it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from lossscale._loss_scale import LossScaleState


def _unwrap(x: Any) -> Any:
  # Flax NNX keeps optimizer-state leaves inside `nnx.Variable`s.
  if hasattr(x, "get_value"):
    return x.get_value()
  return getattr(x, "value", x)


def find_state(x: Any) -> LossScaleState:
  """Returns the one `LossScaleState` inside `x` (an opt_state or its owner).

  `x` may be an optax state (the loss-scale state nested anywhere inside),
  a Flax `TrainState` or an `nnx.Optimizer` (anything with an `opt_state`).
  """
  tree = getattr(x, "opt_state", x)
  found = [
    n
    for n in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, LossScaleState))
    if isinstance(n, LossScaleState)
  ]
  if len(found) != 1:
    what = "no" if not found else f"{len(found)}"
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
    x: an optimizer state with a `LossScaleState` nested anywhere inside, a
      `lossscale.flax.TrainState` (or any object with an `opt_state`), or an
      `nnx.Optimizer`.

  Returns:
    The float32 scale (a scalar; one per member under `jax.vmap`).

  Raises:
    ValueError: when `x` does not hold exactly one `LossScaleState`.

  Examples:
    >>> import optax, jax.numpy as jnp
    >>> import lossscale as ls
    >>> tx = optax.chain(optax.clip(1.0), ls.dynamic_loss_scale(optax.sgd(0.1)))
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
      `nnx.Optimizer` (see `get_loss_scale`), or the scale itself.

  Returns:
    The scaled loss as float32.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> ls.scale_loss(jnp.float16(4.0), 2.0**15)
    Array(131072., dtype=float32)
  """
  return jnp.asarray(loss).astype(jnp.float32) * _scale_of(x)


def value_and_grad(
  fun: Callable[..., Any],
  argnums: int | Sequence[int] = 0,
  has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """Like `jax.value_and_grad`, with the loss scaled before differentiation.

  The returned function takes the scale source first, then `fun`'s arguments:
  `grad_fn(opt_state, *args, **kwargs)`. It returns the *unscaled* loss (with
  aux when `has_aux`) and the gradients of the *scaled* loss, ready for a
  loss-scaling wrapper's `update`, which divides them back.

  Args:
    fun: the loss function; returns a scalar loss, or `(loss, aux)` when
      `has_aux`.
    argnums: which of `fun`'s positional arguments to differentiate
      (counted without the leading scale source).
    has_aux: whether `fun` returns `(loss, aux)`.

  Returns:
    `grad_fn(scale_source, *args, **kwargs) -> (loss, grads)` or
    `((loss, aux), grads)`, where `scale_source` is anything
    `lossscale.scale_loss` accepts.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> loss_fn = lambda w, x: jnp.sum(w * x)
    >>> grad_fn = ls.value_and_grad(loss_fn)
    >>> loss, grads = grad_fn(8.0, jnp.ones(2), jnp.array([1.0, 2.0]))
    >>> loss, grads
    (Array(3., dtype=float32), Array([ 8., 16.], dtype=float32))
  """

  def scaled(scale, *args, **kwargs):
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return scale_loss(loss, scale), (loss, aux)

  shifted = argnums + 1 if isinstance(argnums, int) else tuple(a + 1 for a in argnums)
  grad_fn = jax.value_and_grad(scaled, argnums=shifted, has_aux=True)

  def wrapped(scale_source, *args, **kwargs):
    (_, (loss, aux)), grads = grad_fn(_scale_of(scale_source), *args, **kwargs)
    return ((loss, aux), grads) if has_aux else (loss, grads)

  return wrapped
