"""Shared helpers for the benchmarks: trees, compiled statistics, timing."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def transformer_shapes(n_params: float, n_layers: int = 12) -> dict[str, tuple]:
  """Leaf shapes of a GPT-style decoder with about `n_params` parameters.

  12 leaves per block (two layer norms, fused QKV, attention output, two MLP
  matrices, their biases) plus token and position embeddings and a final
  layer norm: 148 leaves for 12 layers. The width is the multiple of 64
  that brings the total closest to `n_params`.
  """

  def total(d):
    vocab, ctx = 8 * d, 1024
    return n_layers * (12 * d * d + 13 * d) + (vocab + ctx) * d + 2 * d

  d = min(range(64, 16384, 64), key=lambda d: abs(total(d) - n_params))
  vocab, ctx = 8 * d, 1024
  shapes = {"embed": (vocab, d), "pos_embed": (ctx, d)}
  for i in range(n_layers):
    b = f"block{i:02d}"
    shapes.update(
      {
        f"{b}/ln1/scale": (d,),
        f"{b}/ln1/bias": (d,),
        f"{b}/attn/qkv/kernel": (d, 3 * d),
        f"{b}/attn/qkv/bias": (3 * d,),
        f"{b}/attn/out/kernel": (d, d),
        f"{b}/attn/out/bias": (d,),
        f"{b}/ln2/scale": (d,),
        f"{b}/ln2/bias": (d,),
        f"{b}/mlp/in/kernel": (d, 4 * d),
        f"{b}/mlp/in/bias": (4 * d,),
        f"{b}/mlp/out/kernel": (4 * d, d),
        f"{b}/mlp/out/bias": (d,),
      }
    )
  shapes.update({"ln_f/scale": (d,), "ln_f/bias": (d,)})
  return shapes


def gpt_tree(n_params: float, dtype: Any, n_layers: int = 12) -> tuple[dict, dict]:
  """Parameters of `dtype` shaped by `transformer_shapes`, and float32
  gradients for them (`1e-3` times a normal), the same for every run."""
  shapes = transformer_shapes(n_params, n_layers)
  key = jax.random.key(0)
  params = {
    k: (0.02 * jax.random.normal(jax.random.fold_in(key, i), s)).astype(dtype)
    for i, (k, s) in enumerate(shapes.items())
  }
  grads = {
    k: 1e-3 * jax.random.normal(jax.random.fold_in(key, 10**6 + i), s, jnp.float32)
    for i, (k, s) in enumerate(shapes.items())
  }
  return params, grads


def tree_bytes(tree: Any) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def fresh_copy(tree: Any) -> Any:
  """A copy with its own buffers (the originals survive donation)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@dataclasses.dataclass
class Compiled:
  """Statistics of one compiled executable, read from XLA."""

  bytes_accessed: float
  flops: float
  temp_bytes: int
  fusions: int
  copies: int
  conditionals: int
  all_reduces: int
  scalar_all_reduces: int


_FUSION = re.compile(r"[\])}] fusion\(")
_COPY = re.compile(r"[\])}] copy\(")
_COND = re.compile(r"[\])}] conditional\(")
_ALL_REDUCE = re.compile(r" = (.*?) all-reduce(?:-start)?\(")
_SCALAR = re.compile(r"\(?\w+\[\](?:, \w+\[\])*\)?")


def compiled_stats(compiled: Any) -> Compiled:
  """Reads cost and memory analysis and counts ops in the optimised HLO."""
  cost = compiled.cost_analysis()
  if isinstance(cost, list):  # older jax returns one dict per program
    cost = cost[0]
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  reduces = _ALL_REDUCE.findall(text)
  return Compiled(
    bytes_accessed=float(cost.get("bytes accessed", math.nan)),
    flops=float(cost.get("flops", math.nan)),
    temp_bytes=int(getattr(mem, "temp_size_in_bytes", -1)),
    fusions=len(_FUSION.findall(text)),
    copies=len(_COPY.findall(text)),
    conditionals=len(_COND.findall(text)),
    all_reduces=len(reduces),
    scalar_all_reduces=sum(1 for shape in reduces if _SCALAR.fullmatch(shape)),
  )


def interleaved_medians(
  runners: dict[str, Callable[[], None]], rounds: int
) -> dict[str, float]:
  """Times every runner once per round, round after round (seconds).

  Interleaving puts the variants side by side under the same machine load,
  so their ratios are meaningful even when the absolute times drift.
  """
  times: dict[str, list[float]] = {k: [] for k in runners}
  for _ in range(rounds):
    for name, run in runners.items():
      t = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - t)
  return {k: statistics.median(v) for k, v in times.items()}


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
  lines = ["| " + " | ".join(headers) + " |"]
  align = ["---"] + ["---:"] * (len(headers) - 1)
  lines.append("|" + "|".join(align) + "|")
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def environment() -> dict[str, Any]:
  """Where and with what a benchmark ran (`benchmarks/docs_tables.py` shows
  it beside the tables): the versions of lossscale, jax, optax and of the
  peers installed here, the device, and the commit of this checkout."""
  from importlib import metadata

  import optax

  import lossscale

  dev = jax.devices()[0]
  env = {
    "lossscale": lossscale.__version__,
    "commit": _commit(),
    "jax": jax.__version__,
    "optax": optax.__version__,
    "backend": jax.default_backend(),
    "device": getattr(dev, "device_kind", str(dev)),
    "devices": jax.device_count(),
    "cpu_count": os.cpu_count(),
  }
  for peer in ("jmp", "flax"):
    with contextlib.suppress(metadata.PackageNotFoundError):
      env[peer] = metadata.version(peer)
  return env


def _commit() -> str | None:
  """This checkout's commit, with "+dirty" when lossscale/ or benchmarks/
  differ from it; None outside a git checkout."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(
      ["git", "rev-parse", "--short=10", "HEAD"],
      cwd=root,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()
    diff = subprocess.run(
      ["git", "diff", "--quiet", "HEAD", "--", "lossscale", "benchmarks/*.py"],
      cwd=root,
      capture_output=True,
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return head + ("+dirty" if diff.returncode == 1 else "")


def write_outputs(name: str, table: str, payload: dict, json_path: str | None) -> None:
  """Writes the JSON to `json_path` and, when `$OUT` is set, table and JSON there."""
  paths = [json_path] if json_path else []
  out = os.environ.get("OUT")
  if out:
    os.makedirs(out, exist_ok=True)
    paths.append(os.path.join(out, f"{name}.json"))
    with open(os.path.join(out, f"{name}.md"), "w") as f:
      f.write(table + "\n")
  for p in paths:
    os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
    with open(p, "w") as f:
      json.dump(payload, f, indent=1, default=_jsonable)
    print(f"wrote {p}")


def _jsonable(x):
  if isinstance(x, np.generic):
    return x.item()
  if dataclasses.is_dataclass(x):
    return dataclasses.asdict(x)
  raise TypeError(type(x))
