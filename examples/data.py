"""The corpus: the Python standard library's own source, as character ids."""

from __future__ import annotations

import glob
import os

import numpy as np
from config import VOCAB


def load_corpus(max_chars: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
  """Character ids of the standard library's source: (train, validation, files).

  A fixed, sorted selection of the `.py` files next to `os.py`, so it is on
  every machine and nothing is downloaded; every tenth file is held out.
  """
  stdlib = os.path.dirname(os.__file__)
  files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
  train, val, used = [], [], []
  n_train = n_val = 0
  for i, path in enumerate(files):
    with open(path, "rb") as f:
      data = np.frombuffer(f.read(), np.uint8)
    ids = np.where(data < VOCAB, data, ord("?")).astype(np.int32)
    if i % 10 == 9:
      if n_val < max_chars // 10:
        val.append(ids)
        n_val += ids.size
    elif n_train < max_chars:
      train.append(ids)
      n_train += ids.size
    else:
      continue
    used.append(os.path.basename(path))
    if n_train >= max_chars and n_val >= max_chars // 10:
      break
  return np.concatenate(train), np.concatenate(val), used


def batches(data: np.ndarray, n: int, batch: int, seq: int, seed: int) -> np.ndarray:
  """`n` batches of `batch` windows of `seq + 1` characters: [n, batch, seq + 1]."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, data.size - seq - 1, size=(n, batch))
  return data[starts[..., None] + np.arange(seq + 1)]
