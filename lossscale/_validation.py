"""Construction-time validation of configuration values.

Every check runs in Python on concrete values, before anything is traced, and
names the constructor, the argument and the bad value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

_INT32_MAX = 2**31 - 1


def _concrete_number(fn: str, name: str, value: Any) -> float:
  """Accepts Python, NumPy and concrete JAX real scalars (not bools)."""
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    return float(value)
  dtype = getattr(value, "dtype", None)
  if (
    dtype is not None
    and getattr(value, "shape", None) == ()
    and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating))
  ):
    try:
      return float(value)
    except Exception:  # a tracer: configuration must be concrete
      pass
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


def positive_int(fn: str, name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"`{fn}({name}=...)` must be a positive int, got {value!r}.")
  v = int(value)
  if not 1 <= v <= _INT32_MAX:
    raise ValueError(
      f"`{fn}({name}=...)` must be a positive int no larger than"
      f" {_INT32_MAX}, got {value!r}."
    )
  return v


def float32_representable(fn: str, name: str, value: float) -> float:
  """Checks that `value` survives a cast to float32 as a positive finite."""
  with np.errstate(over="ignore", under="ignore"):
    v32 = float(np.float32(value))
  if not (math.isfinite(v32) and v32 > 0.0):
    raise ValueError(
      f"`{fn}({name}=...)` must be representable as a positive finite"
      f" float32, got {value!r}."
    )
  return v32
