"""Mixed-precision helpers for code that is not Flax, and float16 diagnostics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# float16 rounds |x| <= 2**-25 to zero (2**-25 is the tie between 0 and the
# smallest subnormal 2**-24, and rounds to even: 0) and |x| >= 65520 to inf
# (65520 is the tie between the largest finite value, 65504, and the next
# power of two).
_F16_ZERO_AT = 2.0**-25
_F16_INF_AT = 65520.0
_F16_MIN_NORMAL = 2.0**-14


def _floating_dtype(fn: str, arg: str, dtype: Any) -> np.dtype:
  if dtype is None:  # NumPy reads None as float64, which JAX makes float32
    raise ValueError(f"`{fn}({arg}=...)` must be a floating dtype, got None.")
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(
      f"`{fn}({arg}=...)` must be a floating dtype, got {dtype!r}."
    ) from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"`{fn}({arg}=...)` must be a floating dtype, got {dt}.")
  return dt


def _is_floating(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def cast_floating(tree: Any, dtype: Any) -> Any:
  """Casts every floating-point array leaf of `tree` to `dtype`.

  Integer, boolean, complex and key leaves, and leaves that are not arrays
  (Python scalars, `None`), are returned as they are. Use it to make a float16
  or bfloat16 compute copy of float32 master parameters, and to cast outputs
  back to float32; the cast is differentiable, so gradients flow back to the
  float32 parameters in float32.

  Args:
    tree: a pytree.
    dtype: a floating dtype (`jnp.float16`, `jnp.bfloat16`, `jnp.float32`...).

  Returns:
    `tree` with its floating array leaves cast to `dtype`.

  Raises:
    ValueError: when `dtype` is not a floating dtype (`None`, an integer,
      bool or complex dtype).

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> tree = {"w": jnp.ones(2), "step": jnp.int32(3)}
    >>> ls.cast_floating(tree, jnp.float16)
    {'step': Array(3, dtype=int32), 'w': Array([1., 1.], dtype=float16)}
  """
  dt = _floating_dtype("cast_floating", "dtype", dtype)
  return jax.tree.map(lambda x: x.astype(dt) if _is_floating(x) else x, tree)


def with_compute_dtype(
  fn: Callable[..., Any], compute_dtype: Any, *, output_dtype: Any = jnp.float32
) -> Callable[..., Any]:
  """Wraps `fn` to run in `compute_dtype` and return `output_dtype`.

  The mixed-precision policy in one function: the floating leaves of every
  argument (float32 master parameters, inputs) are cast to `compute_dtype`
  (float16 or bfloat16), `fn` runs on them, and the floating leaves of its
  result are cast to `output_dtype` (float32 by default, so that the loss is
  reduced and scaled in float32). Integer arguments such as token ids are
  passed as they are.

  Args:
    fn: the function to wrap, such as `apply(params, x) -> logits`.
    compute_dtype: the floating dtype `fn` computes in.
    output_dtype: the floating dtype of the result.

  Returns:
    The wrapped function, with `fn`'s signature.

  Raises:
    ValueError: when either dtype is not a floating dtype (`None`, an
      integer, bool or complex dtype).

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> f = ls.with_compute_dtype(lambda w, x: w * x, jnp.float16)
    >>> f(jnp.float32(2049.0), jnp.float32(1.0))  # 2049 is not a float16
    Array(2048., dtype=float32)
  """
  compute = _floating_dtype("with_compute_dtype", "compute_dtype", compute_dtype)
  output = _floating_dtype("with_compute_dtype", "output_dtype", output_dtype)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    args, kwargs = cast_floating((args, kwargs), compute)
    return cast_floating(fn(*args, **kwargs), output)

  return wrapped


class Float16RangeReport(NamedTuple):
  """What casting a pytree to float16 would lose ([`lossscale.float16_range_report`][]).

  Attributes:
    underflow: float32 fraction of all floating elements that are nonzero but
      round to zero in float16 (`0 < |x| <= 2**-25`).
    overflow: float32 fraction that become inf in float16 (`|x| >= 65520`,
      the values that do not round to the largest finite 65504), including
      infs already present.
    subnormal: float32 fraction that survive only as float16 subnormals
      (`2**-25 < |x| < 2**-14`), with fewer than float16's 11 significant
      bits: not lost, but rounded coarsely.
    per_leaf: `{path: (underflow, overflow)}` for every floating leaf, the
      fractions of that leaf's elements; paths as `jax.tree_util.keystr`.
  """

  underflow: jax.Array
  overflow: jax.Array
  subnormal: jax.Array
  per_leaf: dict[str, tuple[jax.Array, jax.Array]]


def float16_range_report(tree: Any) -> Float16RangeReport:
  """Measures which elements of `tree` float16 would flush to zero or to inf.

  Use it on float32 gradients (of the loss times the scale you mean to use)
  to see how much a float16 backward pass would lose: an element is lost to
  underflow when it is nonzero but rounds to zero in float16 (`|x| <= 2**-25`;
  the smallest float16 subnormal is `2**-24`) and lost to overflow when it
  rounds to inf (`|x| >= 65520`; the largest finite float16 is 65504).
  Only floating leaves count; NaNs are neither. Works under `jax.jit`.

  Args:
    tree: a pytree of arrays (integer leaves are ignored).

  Returns:
    A [`lossscale.Float16RangeReport`][] with the overall fractions and one
    pair per leaf.

  Examples:
    >>> import jax.numpy as jnp
    >>> import lossscale as ls
    >>> grads = {"a": jnp.array([1e-9, 1e-3, 0.0, 1e5]), "b": jnp.array([2e-8])}
    >>> report = ls.float16_range_report(grads)
    >>> report.underflow, report.overflow, report.subnormal
    (Array(0.4, dtype=float32), Array(0.2, dtype=float32), Array(0., dtype=float32))
    >>> report.per_leaf["['a']"]
    (Array(0.25, dtype=float32), Array(0.25, dtype=float32))
    >>> scaled = {"a": grads["a"] * 2.0**10, "b": grads["b"] * 2.0**10}
    >>> ls.float16_range_report(scaled).underflow  # a loss scale of 2**10
    Array(0., dtype=float32)
  """
  per_leaf = {}
  lost_under, lost_over, coarse, total = [], [], [], 0
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    if not _is_floating(x) or x.size == 0:
      continue
    # Exact in float32 for every narrower float (float64 stays float64).
    mag = jnp.abs(x if x.dtype.itemsize > 4 else x.astype(jnp.float32))
    under = jnp.sum(jnp.logical_and(mag > 0, mag <= _F16_ZERO_AT), dtype=jnp.int32)
    over = jnp.sum(mag >= _F16_INF_AT, dtype=jnp.int32)
    sub = jnp.logical_and(mag > _F16_ZERO_AT, mag < _F16_MIN_NORMAL)
    coarse.append(jnp.sum(sub, dtype=jnp.int32))
    n = jnp.float32(x.size)
    per_leaf[jax.tree_util.keystr(path)] = (
      under.astype(jnp.float32) / n,
      over.astype(jnp.float32) / n,
    )
    lost_under.append(under)
    lost_over.append(over)
    total += x.size
  if not total:
    zero = jnp.zeros([], jnp.float32)
    return Float16RangeReport(zero, zero, zero, per_leaf)
  n = jnp.float32(total)
  zero_count = jnp.zeros([], jnp.int32)  # an int32 start keeps `sum` an Array
  return Float16RangeReport(
    underflow=sum(lost_under, zero_count).astype(jnp.float32) / n,
    overflow=sum(lost_over, zero_count).astype(jnp.float32) / n,
    subnormal=sum(coarse, zero_count).astype(jnp.float32) / n,
    per_leaf=per_leaf,
  )
