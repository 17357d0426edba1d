"""Construction-time validation of configuration values.

Every check runs in Python on concrete values, before anything is traced, and
names the constructor, the argument and the bad value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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
  return _int_at_least(fn, name, value, 0, "a non-negative int")


def positive_int(fn: str, name: str, value: Any) -> int:
  """Accepts Python, NumPy and concrete JAX integer scalars in [1, 2**31 - 1]."""
  return _int_at_least(fn, name, value, 1, "a positive int")


def _int_at_least(fn: str, name: str, value: Any, lowest: int, kind: str) -> int:
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
