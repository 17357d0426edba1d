#!/usr/bin/env python3
"""The docs' benchmark tables, generated from `benchmarks/results/*.json`.

Usage:
  python benchmarks/docs_tables.py --write   # rewrite every generated block
  python benchmarks/docs_tables.py --check   # exit 1 where a page and its JSON differ

(`make docs-tables` runs `--write`; `tests/test_docs_tables.py` runs the
check.) A generated block in README.md or docs/*.md lies between two HTML
comments, which the rendered page does not show:

  <!-- generated: KIND from PATH by benchmarks/docs_tables.py; do not edit -->

  ...

  <!-- end generated -->

The first names the renderer, KIND (a key of `RENDERERS`, such as
`optimizer_step`), and the JSON file, PATH, relative to the repository
root (`benchmarks/results/optimizer_step_cpu.json`); everything between the
two is what the renderer makes of that file: a line saying where and with
what it was measured (from the JSON's `environment`), then the table. To
change a number, re-run the benchmark; to change a table's form, change its
renderer; then `make docs-tables`. Renderers read the fields they show by
name and ignore any others, so a benchmark may record more than they show;
a field they need and do not find is an error that names it. This script
needs only the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/*.md")

_BEGIN = re.compile(
  r"^(?P<indent>[ \t]*)<!-- generated: (?P<kind>[\w-]+) from (?P<source>\S+)"
  r" by benchmarks/docs_tables\.py; do not edit -->[ \t]*$"
)
_END = re.compile(r"^[ \t]*<!-- end generated -->[ \t]*$")
_ANY_MARKER = re.compile(r"<!--\s*(end )?generated\b")


class TableError(Exception):
  """A page's markers, or a JSON file, that no table can be made from."""


@dataclasses.dataclass(frozen=True)
class Block:
  """One generated block: lines `begin` and `end` (0-based) are its markers."""

  page: pathlib.Path
  kind: str
  source: str
  begin: int
  end: int
  indent: str

  def name(self, root: pathlib.Path) -> str:
    return f"{self.page.relative_to(root).as_posix()}: {self.kind} from {self.source}"


# ---------------------------------------------------------------------------
# Reading the JSON


def _where(record: dict) -> str:
  keys = [f"{k}={record[k]!r}" for k in ("variant", "case", "leaves") if k in record]
  return "{" + ", ".join(keys) + "}" if keys else "the top level"


def _field(record: dict, name: str) -> Any:
  """`record[name]`, or an error naming the field and the record."""
  if not isinstance(record, dict) or name not in record:
    raise TableError(f"no field {name!r} in {_where(record)}")
  return record[name]


def _records(data: dict, key: str = "results") -> list[dict]:
  records = _field(data, key)
  if not isinstance(records, list) or not records:
    raise TableError(f"{key!r} must be a non-empty list")
  return records


def _find(records: list[dict], **match: Any) -> dict | None:
  return next(
    (r for r in records if all(r.get(k) == v for k, v in match.items())), None
  )


def _environment(data: dict) -> dict:
  """The run's environment: `environment`, or the older spellings."""
  env = data.get("environment") or data.get("env")  # half_precision.py wrote env
  if not env and "jax_version" in data:  # compile_phases.py wrote only this
    env = {"jax": data["jax_version"]}
  return env or {}


# ---------------------------------------------------------------------------
# Formatting


def _table(headers: list[str], rows: Iterable[list[Any]], align: str = "") -> list[str]:
  """A markdown table. `align` has an "l" (text, left) or "r" (a number,
  right) per column; columns it does not reach are numbers, and without it
  the first column is text."""
  align = (align or "l").ljust(len(headers), "r")
  lines = ["| " + " | ".join(headers) + " |"]
  lines.append("|" + "|".join("---" if a == "l" else "---:" for a in align) + "|")
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return lines


def _x(ratio: float) -> str:
  return f"{ratio:.2f}x"


def _num(value: float | None, fmt: str) -> str:
  return "-" if value is None else format(value, fmt)


def _met(ok: bool) -> str:
  return "met" if ok else "**not met**"


def _source_line(data: dict, source: str, what: str) -> str:
  """Where and with what the JSON was measured, from its `environment`."""
  env = _environment(data)
  versions = []
  if env.get("commit"):
    versions.append(f"lossscale at {env['commit']}")
  elif env.get("lossscale"):
    versions.append(f"lossscale {env['lossscale']}")
  versions += [
    f"{name} {env[name]}" for name in ("jax", "optax", "jmp", "flax") if env.get(name)
  ]
  place = []
  backend = str(env.get("backend", ""))
  if backend:
    label = backend.upper() if backend in ("cpu", "gpu", "tpu") else backend
    device = env.get("device")
    if device and str(device).lower() != backend.lower():
      label += f" ({device})"
    place.append(label)
  if env.get("devices") not in (None, 1):
    place.append(f"{env['devices']} devices")
  if env.get("cpu_count"):
    cores = "cores" if backend == "cpu" else "CPU cores"
    place.append(f"{env['cpu_count']} {cores}")
  measured = "; ".join(", ".join(part) for part in (versions, place) if part)
  return f"`{source}` ({measured or 'environment not recorded'}): {what}."


# Short names of the steps, for the tables that compare a few of them.
_SHORT = {
  "adamw (bare)": "bare adamw",
  "adamw (plain)": "bare adamw",
  "bare": "bare adamw",
  "lossscale: tx.update + apply_updates": "`tx.update` + `apply_updates`",
  "update": "`tx.update` + `apply_updates`",
  "lossscale.apply_gradients": "`apply_gradients`",
  "fused": "`apply_gradients`",
  "optax.apply_if_finite": "`optax.apply_if_finite`",
  "apply_if_finite": "`optax.apply_if_finite`",
  "lossscale wrapper via jnp.where (old)": "`jnp.where` (before `lax.cond`)",
}
_UPDATE = "lossscale: tx.update + apply_updates"
_FUSED = "lossscale.apply_gradients"
_PEERS = ("optax.", "jmp ", "flax ")


# ---------------------------------------------------------------------------
# Renderers: one per kind of table. Each takes the JSON and its path and
# returns the block's lines.


def _optimizer_step_what(data: dict) -> str:
  parameters = _field(data, "parameters")
  return (
    f"{_field(data, 'leaves')} leaves, {parameters / 1e6:.1f}M"
    f" {data.get('dtype', 'float32')} parameters, median of"
    f" {_field(data, 'rounds')} interleaved rounds"
    + ("" if data.get("donated", True) else ", nothing donated")
  )


def optimizer_step(data: dict, source: str) -> list[str]:
  """Every variant of `optimizer_step.py`, every column it records."""
  rows = []
  for r in _records(data):
    name, ratio = _field(r, "variant"), _x(_field(r, "time_vs_plain"))
    if name == _FUSED:
      name, ratio = f"**{name}**", f"**{ratio}**"
    rows.append(
      [
        name,
        _field(r, "case"),
        f"{_field(r, 'median_ms'):.1f}",
        ratio,
        f"{_field(r, 'bytes_accessed_mb'):.0f}",
        _x(_field(r, "bytes_vs_plain")),
        _x(_field(r, "bytes_vs_analytic_min")),
        f"{_field(r, 'temp_mb'):.1f}",
        _field(r, "fusions"),
        _field(r, "copies"),
      ]
    )
  headers = [
    "variant",
    "case",
    "median ms",
    "time / plain",
    "XLA MB accessed",
    "bytes / plain",
    "bytes / minimum",
    "temp MB",
    "fusions",
    "copies",
  ]
  return [
    _source_line(data, source, _optimizer_step_what(data)),
    "",
    *_table(headers, rows, align="ll"),
  ]


def optimizer_step_compact(data: dict, source: str) -> list[str]:
  """`optimizer_step.py`'s time, bytes, temporaries and copies (a `--dtype`
  or `--no-donate` run)."""
  rows = [
    [
      _field(r, "variant"),
      _field(r, "case"),
      f"{_field(r, 'median_ms'):.1f}",
      _x(_field(r, "time_vs_plain")),
      _x(_field(r, "bytes_vs_plain")),
      f"{_field(r, 'temp_mb'):.1f}",
      _field(r, "copies"),
    ]
    for r in _records(data)
  ]
  headers = [
    "variant",
    "case",
    "median ms",
    "time / plain",
    "bytes / plain",
    "temp MB",
    "copies",
  ]
  return [
    _source_line(data, source, _optimizer_step_what(data)),
    "",
    *_table(headers, rows, align="ll"),
  ]


def optimizer_step_targets(data: dict, source: str) -> list[str]:
  """The step-time targets, against one `optimizer_step.py` run.

  float32: `apply_gradients` <= 1.25x the bare step, a skipped step <= 0.5x,
  `tx.update` + `apply_updates` ahead of every peer in the run. bfloat16 and
  float16: `apply_gradients` no slower than the bare step. Both: no
  parameter-sized temporary beyond one float32 updates array.
  """
  records = _records(data)

  def get(variant, case):
    r = _find(records, variant=variant, case=case)
    if r is None:
      raise TableError(f"no result for variant={variant!r}, case={case!r}")
    return r

  rows = []
  fused = _field(get(_FUSED, "finite"), "time_vs_plain")
  if data.get("dtype", "float32") == "float32":
    rows.append(
      ["`apply_gradients`: finite step <= 1.25x bare", _x(fused), _met(fused <= 1.25)]
    )
    skip = _field(get(_FUSED, "overflow"), "time_vs_plain")
    rows.append(
      ["`apply_gradients`: skipped step <= 0.5x bare", _x(skip), _met(skip <= 0.5)]
    )
    for case in ("finite", "overflow"):
      ours = _field(get(_UPDATE, case), "median_ms")
      peers = [
        r
        for r in records
        if r.get("case") == case and str(r.get("variant")).startswith(_PEERS)
      ]
      if not peers:
        continue
      fastest = min(peers, key=lambda r: _field(r, "median_ms"))
      rows.append(
        [
          f"`tx.update` + `apply_updates` ahead of every peer ({case})",
          f"{ours:.1f} ms; fastest peer {_field(fastest, 'median_ms'):.1f} ms"
          f" ({_field(fastest, 'variant')})",
          _met(ours < _field(fastest, "median_ms")),
        ]
      )
  else:
    rows.append(
      [
        "`apply_gradients`: finite step no slower than bare",
        _x(fused),
        _met(fused <= 1.0),
      ]
    )
  # One float32 array the size of the parameters.
  updates_mb = _field(data, "parameters") * 4 / 1e6
  fused_temp = _field(get(_FUSED, "finite"), "temp_mb")
  update_temp = _field(get(_UPDATE, "finite"), "temp_mb")
  rows.append(
    [
      "`apply_gradients`: no parameter-sized temporary",
      f"{fused_temp:.1f} MB (a float32 updates array: {updates_mb:.1f} MB)",
      _met(fused_temp < updates_mb),
    ]
  )
  rows.append(
    [
      "`tx.update` + `apply_updates`: no temporary beyond one float32 updates array",
      f"{update_temp:.1f} MB",
      _met(update_temp < 2 * updates_mb),
    ]
  )
  return [
    _source_line(data, source, _optimizer_step_what(data)),
    "",
    *_table(["target", "measured", ""], rows, align="lll"),
  ]


def optimizer_step_evidence(data: dict, source: str) -> list[str]:
  """`optimizer_step.py --evidence`: the wrapper's `jnp.where` formulation
  beside the `lax.cond` ones, both cases in one row."""
  records = _records(data)
  rows = []
  for variant in ("lossscale wrapper via jnp.where (old)", _UPDATE, _FUSED):
    finite = _find(records, variant=variant, case="finite")
    overflow = _find(records, variant=variant, case="overflow")
    if finite is None or overflow is None:
      raise TableError(f"no finite and overflow results for variant={variant!r}")
    rows.append(
      [
        _SHORT[variant],
        _x(_field(finite, "time_vs_plain")),
        _x(_field(overflow, "time_vs_plain")),
        f"{_field(finite, 'bytes_accessed_mb'):.0f}",
        f"{_field(finite, 'temp_mb'):.1f}",
        _field(finite, "copies"),
      ]
    )
  headers = [
    "formulation",
    "finite: time / plain",
    "overflow: time / plain",
    "XLA MB accessed",
    "temp MB",
    "copies",
  ]
  return [
    _source_line(data, source, _optimizer_step_what(data)),
    "",
    *_table(headers, rows, align="l"),
  ]


def _compile_what(data: dict) -> str:
  shape = data.get("leaf_shape", [64])
  return (
    f"leaves of {'x'.join(map(str, shape))} float32, each step traced and"
    " compiled from scratch, the steps of one size side by side in one"
    " process; CPU seconds"
  )


def _by_leaves(records: list[dict]) -> dict[int, dict[str, dict]]:
  out: dict[int, dict[str, dict]] = {}
  for r in records:
    out.setdefault(_field(r, "leaves"), {})[_field(r, "variant")] = r
  return out


def compile_time(data: dict, source: str) -> list[str]:
  """`compile_time.py`: the bare step's trace + compile time per tree size,
  and every other step's as a multiple of it."""
  records = _records(data)
  sizes = _by_leaves(records)
  others = [
    v
    for v in dict.fromkeys(_field(r, "variant") for r in records)
    if v != "adamw (bare)"
  ]
  rows = []
  for leaves, steps in sizes.items():
    bare = steps.get("adamw (bare)")
    if bare is None:
      raise TableError(f"no 'adamw (bare)' result at {leaves} leaves")
    trace = _field(bare, "trace_s") + _field(bare, "lower_s")
    rows.append(
      [
        leaves,
        f"{_field(bare, 'total_s'):.2f} s (trace + lowering {trace:.2f} s)",
        *(_x(_field(steps[v], "vs_bare")) if v in steps else "-" for v in others),
      ]
    )
  headers = [
    "leaves",
    "bare adamw: trace + compile",
    *(_SHORT.get(v, v) for v in others),
  ]
  return [_source_line(data, source, _compile_what(data)), "", *_table(headers, rows)]


# The compile-time contract (at this many leaves, at most these multiples of
# the bare step's trace + compile time).
CONTRACT_LEAVES = 2000
CONTRACT = {_FUSED: 1.5, _UPDATE: 2.5}


def compile_time_targets(data: dict, source: str) -> list[str]:
  """`compile_time.py` against the contract: trace + compile at 2000 leaves
  (the median of the rotated rounds where the file has them, else the
  sweep's one measurement), and no compilation after an eager step's first
  call."""
  rounds = data.get("targets")
  if rounds and _field(rounds, "leaves") == CONTRACT_LEAVES:
    steps = _field(rounds, "steps")
    how = f"median of {_field(rounds, 'rounds')} rounds in rotated order; range"
  else:
    steps = _by_leaves(_records(data)).get(CONTRACT_LEAVES, {})
    how = "one measurement, after the bare step"
  rows = []
  for variant, bound in CONTRACT.items():
    target = (
      f"{_SHORT[variant]}: trace + compile at {CONTRACT_LEAVES} leaves <= {bound}x bare"
    )
    if variant in steps:
      ratio = _field(steps[variant], "vs_bare")
      shown = _x(ratio)
      if "vs_bare_min" in steps[variant]:
        low = _field(steps[variant], "vs_bare_min")
        high = _field(steps[variant], "vs_bare_max")
        shown += f" ({low:.2f}-{high:.2f})"
      rows.append([target, shown, _met(ratio <= bound)])
    else:
      rows.append([target, "not measured", ""])
  eager = _field(data, "eager")
  ours = {k: v for k, v in eager.items() if k in (_UPDATE, _FUSED)}
  if ours:
    counts = [_field(v, "compilations_after_first") for v in ours.values()]
    rows.append(
      [
        "eager steps ("
        + ", ".join(_SHORT[k] for k in ours)
        + "): no compilation after the first call",
        ", ".join(map(str, counts)),
        _met(not any(counts)),
      ]
    )
  return [
    _source_line(data, source, _compile_what(data)),
    "",
    *_table(["target", f"measured ({how})", ""], rows, align="lll"),
  ]


def compile_time_eager(data: dict, source: str) -> list[str]:
  """`compile_time.py`'s eager steps: time per call and compilations."""
  eager = _field(data, "eager")
  bare = _field(_field(eager, "adamw (bare)"), "median_ms")
  rows = [
    [
      name,
      f"{_field(r, 'median_ms'):.2f}",
      _x(_field(r, "median_ms") / bare),
      _field(r, "compilations_after_first"),
    ]
    for name, r in eager.items()
  ]
  headers = [
    "eager step (no `jax.jit`)",
    "median ms",
    "time / bare",
    "compilations after the first call",
  ]
  what = (
    "a 20-parameter tree, median of the calls after the first, the steps interleaved"
  )
  return [_source_line(data, source, what), "", *_table(headers, rows)]


def compile_phases(data: dict, source: str) -> list[str]:
  """`compile_phases.py`: each step compiled in a process of its own, with
  XLA's pass times and buffer assignment's scan from its log."""
  records = _records(data, "records")
  rows = []
  for leaves, steps in _by_leaves(records).items():
    bare = steps.get("bare")
    for variant, r in steps.items():
      total = _field(r, "trace_s") + _field(r, "lower_s") + _field(r, "compile_s")
      if bare is None:
        ratio = "-"
      else:
        base = (
          _field(bare, "trace_s") + _field(bare, "lower_s") + _field(bare, "compile_s")
        )
        ratio = _x(total / base)
      rows.append(
        [
          leaves,
          _SHORT.get(variant, variant),
          f"{total:.2f}",
          ratio,
          _num(_field(r, "passes_s"), ".2f"),
          _num(_field(r, "scan_s"), ".2f"),
          f"{_field(r, 'temp_bytes') / 1e3:.0f}",
        ]
      )
  headers = [
    "leaves",
    "step",
    "trace + compile (CPU s)",
    "/ bare",
    "HLO passes (s)",
    "buffer assignment: scan (s)",
    "temporaries (KB)",
  ]
  what = "leaves of 64 float32, each step in a process of its own with XLA's log on"
  return [_source_line(data, source, what), "", *_table(headers, rows, align="rl")]


def half_precision(data: dict, source: str) -> list[str]:
  """`half_precision.py`: bytes and temporaries per parameter dtype."""
  results = _field(data, "results")
  rows = []
  for key, r in results.items():
    dtype, _, step = key.partition("/")
    rows.append(
      [
        dtype,
        step,
        f"{_field(r, 'temp_bytes') / 1e6:.1f}",
        f"{_field(r, 'bytes_accessed') / 1e6:.0f}",
        _x(_field(r, "ratio")),
      ]
    )
  headers = ["params", "step", "temp MB", "bytes accessed MB", "bytes / bare"]
  what = (
    f"{_field(data, 'params') / 1e6:.0f}M parameters in {_field(data, 'leaves')}"
    " leaves, gradients of the parameters' dtype; compiled, not timed"
  )
  return [_source_line(data, source, what), "", *_table(headers, rows, align="ll")]


def train_step(data: dict, source: str) -> list[str]:
  """`train_step.py`: forward, backward and update in one jitted step."""
  rows = [
    [
      _field(r, "variant"),
      f"{_field(r, 'median_ms'):.1f}",
      _x(_field(r, "time_vs_no_scaling")),
      f"{_field(r, 'temp_mb'):.1f}",
    ]
    for r in _records(data)
  ]
  what = (
    f"an MLP of {_field(data, 'depth')} x {_field(data, 'width')},"
    f" {_field(data, 'parameters') / 1e6:.2f}M parameters, batch"
    f" {_field(data, 'batch')}, median of {_field(data, 'rounds')} interleaved rounds"
  )
  headers = ["variant", "median ms", "time / no scaling", "temp MB"]
  return [_source_line(data, source, what), "", *_table(headers, rows)]


def distributed(data: dict, source: str) -> list[str]:
  """`distributed.py`: collectives in the compiled data-parallel step."""
  rows = [
    [
      _field(r, "variant"),
      _field(r, "all_reduces"),
      _field(r, "scalar_all_reduces"),
      _field(r, "extra_all_reduces"),
    ]
    for r in _records(data)
  ]
  what = (
    f"{_field(data, 'leaves')} leaves, {_field(data, 'parameters') / 1e6:.1f}M"
    " parameters; all-reduces counted in the compiled HLO"
  )
  headers = ["variant", "all-reduces", "scalar all-reduces", "extra vs plain"]
  return [_source_line(data, source, what), "", *_table(headers, rows)]


def finite_check(data: dict, source: str) -> list[str]:
  """`finite_check.py`: the check alone, per formulation and gradient dtype,
  against the bare AdamW step on the same tree."""
  rows = [
    [
      _field(r, "dtype"),
      _field(r, "variant"),
      f"{_field(r, 'median_ms'):.2f}",
      _x(_field(r, "vs_bare_step")),
      f"{_field(r, 'temp_mb'):.1f}",
    ]
    for r in _records(data)
  ]
  what = (
    "each check alone over the GPT-shaped tree, interleaved with the bare"
    f" AdamW step on it, median of {_field(data, 'rounds')} rounds"
  )
  headers = ["gradients", "check", "median ms", "time / bare step", "temp MB"]
  return [_source_line(data, source, what), "", *_table(headers, rows, align="ll")]


def compare(data: dict, source: str) -> list[str]:
  """`compare.py --json`: the working tree against a base commit, each step's
  median ratio to its own process's bare AdamW step."""
  rows = []
  plain = any("plain" in r for r in _records(data))
  base = data.get("base")
  for r in _records(data):
    runs, work = _field(r, "base"), _field(r, "work")
    b, w = _field(r, "base_median"), _field(r, "work_median")
    against = f"`LOSSSCALE_PLAIN={r['plain']}`" if "plain" in r else base
    rows.append(
      [
        _field(r, "case"),
        *([against] if plain else []),
        _field(r, "step"),
        f"{_x(b)} ({min(runs):.2f}-{max(runs):.2f})",
        f"{_x(w)} ({min(work):.2f}-{max(work):.2f})",
        f"{w / b:.2f}" + (" **slower**" if _field(r, "slower") else ""),
      ]
    )
  what = (
    f"time / bare AdamW, median over {_field(data, 'repeats')} processes per"
    f" tree and case ({_field(data, 'rounds')} rounds each)"
  )
  if base:
    what += f", base {base} ({_field(data, 'base_commit')})"
  if plain:
    what += ", this version with the speed layer off as the row says"
  what += " and this version alternating"
  if plain:
    headers = ["case", "against", "step", "against", "this version", "this / against"]
    return [_source_line(data, source, what), "", *_table(headers, rows, align="lll")]
  headers = ["case", "step", "base", "this version", "this / base"]
  return [_source_line(data, source, what), "", *_table(headers, rows, align="ll")]


def spikes(data: dict, source: str) -> list[str]:
  """`spikes.py`: `apply_gradients` with the loss given and `SkipSpikes` on,
  each step's median ratio to its process's bare AdamW step."""
  rows = _records(data, "rows")
  first = _field(rows[0], "median")
  table = [
    [
      _field(r, "step"),
      f"{_x(_field(r, 'median'))} ({_field(r, 'min'):.2f}-{_field(r, 'max'):.2f})",
      f"{_field(r, 'median') / first:.3f}",
    ]
    for r in rows
  ]
  what = (
    f"float32, {_field(data, 'params') / 1e6:g}M params, AdamW: time / bare step,"
    f" median over {len(_records(data, 'runs'))} processes"
    f" ({_field(data, 'rounds')} rounds each, interleaved)"
  )
  headers = ["step", "time / bare step", f"/ {_field(rows[0], 'step')}"]
  return [_source_line(data, source, what), "", *_table(headers, table, align="l")]


RENDERERS: dict[str, Callable[[dict, str], list[str]]] = {
  "spikes": spikes,
  "optimizer_step": optimizer_step,
  "finite_check": finite_check,
  "compare": compare,
  "optimizer_step_compact": optimizer_step_compact,
  "optimizer_step_targets": optimizer_step_targets,
  "optimizer_step_evidence": optimizer_step_evidence,
  "compile_time": compile_time,
  "compile_time_targets": compile_time_targets,
  "compile_time_eager": compile_time_eager,
  "compile_phases": compile_phases,
  "half_precision": half_precision,
  "train_step": train_step,
  "distributed": distributed,
}


# ---------------------------------------------------------------------------
# Pages


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  return sorted(p for pattern in PAGES for p in root.glob(pattern))


def find_blocks(page: pathlib.Path, lines: list[str]) -> list[Block]:
  """The generated blocks of a page, its lines given; bad markers raise."""
  blocks, open_at = [], None
  for i, line in enumerate(lines):
    begin, end = _BEGIN.match(line), _END.match(line)
    where = f"{page}:{i + 1}"
    if begin:
      if open_at is not None:
        raise TableError(
          f"{where}: a block opens before the one at line {open_at.begin + 1} ends"
        )
      if begin["kind"] not in RENDERERS:
        raise TableError(
          f"{where}: unknown table kind {begin['kind']!r};"
          f" known: {', '.join(RENDERERS)}"
        )
      open_at = Block(page, begin["kind"], begin["source"], i, -1, begin["indent"])
    elif end:
      if open_at is None:
        raise TableError(f"{where}: '<!-- end generated -->' without a block to end")
      blocks.append(dataclasses.replace(open_at, end=i))
      open_at = None
    elif _ANY_MARKER.search(line):
      raise TableError(
        f"{where}: a marker in neither form (the opening one is '<!-- generated: KIND"
        " from PATH.json by benchmarks/docs_tables.py; do not edit -->')"
      )
  if open_at is not None:
    raise TableError(f"{page}:{open_at.begin + 1}: the block is never ended")
  return blocks


def render(block: Block, root: pathlib.Path = ROOT) -> list[str]:
  """The lines between the block's markers, as its JSON gives them."""
  path = root / block.source
  try:
    data = json.loads(path.read_text())
  except FileNotFoundError:
    raise TableError(f"{block.name(root)}: no such file {block.source}") from None
  except json.JSONDecodeError as e:
    raise TableError(f"{block.name(root)}: {block.source} is not JSON: {e}") from None
  try:
    lines = RENDERERS[block.kind](data, block.source)
  except TableError as e:
    raise TableError(f"{block.name(root)}: {e}") from None
  indent = block.indent
  return ["", *(indent + line if line else line for line in lines), ""]


def _rendered(root: pathlib.Path) -> list[tuple[pathlib.Path, list[str], list[str]]]:
  """(page, its lines, its lines with every block rendered) for every page."""
  out = []
  for page in pages(root):
    lines = page.read_text().split("\n")
    new = list(lines)
    for block in reversed(find_blocks(page, lines)):
      new[block.begin + 1 : block.end] = render(block, root)
    out.append((page, lines, new))
  return out


def check(root: pathlib.Path = ROOT) -> list[str]:
  """One message per generated block that differs from its JSON."""
  problems = []
  for page in pages(root):
    lines = page.read_text().split("\n")
    for block in find_blocks(page, lines):
      want = render(block, root)
      have = lines[block.begin + 1 : block.end]
      if have == want:
        continue
      i = next(
        (i for i, (a, b) in enumerate(zip(have, want, strict=False)) if a != b),
        min(len(have), len(want)),
      )
      line_no = block.begin + 2 + i
      problems.append(
        f"{page.relative_to(root).as_posix()}:{line_no}: table {block.kind} differs"
        f" from {block.source} (run `make docs-tables`)\n"
        f"  page:      {have[i] if i < len(have) else '<the block ends>'}\n"
        f"  generated: {want[i] if i < len(want) else '<the block ends>'}"
      )
  return problems


def write(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """Rewrites every block that differs from its JSON; returns the pages."""
  changed = []
  for page, lines, new in _rendered(root):
    if new != lines:
      page.write_text("\n".join(new))
      changed.append(page)
  return changed


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  mode = ap.add_mutually_exclusive_group(required=True)
  mode.add_argument("--write", action="store_true", help="rewrite the tables in place")
  mode.add_argument(
    "--check", action="store_true", help="exit 1 when a table differs from its JSON"
  )
  ap.add_argument("--root", type=pathlib.Path, default=ROOT, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  root = args.root.resolve()
  try:
    if args.write:
      for page in write(root):
        print(f"wrote {page.relative_to(root).as_posix()}")
      return 0
    problems = check(root)
  except TableError as e:
    print(f"docs_tables: {e}", file=sys.stderr)
    return 1
  for message in problems:
    print(message, file=sys.stderr)
  return 1 if problems else 0


if __name__ == "__main__":
  sys.exit(main())
