"""Where a step's compile time goes: XLA's passes and its buffer assignment.

Usage:
  python benchmarks/compile_phases.py [--leaves 500,1000,2000]
      [--variants bare,update,fused] [--json out.json]

Each variant of `benchmarks/compile_time.py` (the jitted AdamW step on
leaves of 64 float32, params and state donated) is compiled in a process of
its own with XLA's logging switched on
(`TF_CPP_VMODULE=hlo_pass_pipeline=1,buffer_assignment=1`). From that log:

- `passes_s`: the time of the HLO passes on the step's module, summed, and
  the three largest;
- `scan_s`: buffer assignment, from "Number of buffers to assign" to the
  heap simulation. Each buffer that is neither a parameter nor an output
  is first offered, in turn, to every reusable allocation made before it
  (with the arguments donated: their buffers) before it goes to the heap
  simulator, so this phase grows as the number of such temporaries times
  the number of donated arrays;
- `temp_bytes`: the compiled step's temporaries (`memory_analysis`).

Logging slows the passes a little; the trace and compile times printed are
CPU seconds of the child process and are comparable with each other, not
with `compile_time.py`'s. Only the step's module (`jit_<variant>`) is read,
and a pipeline nested in another counts once, by its own passes. The log's
wording is XLA's (jaxlib 0.4.35 to 0.10.2 write the same lines); a phase
the log does not show is reported as None. The persistent compilation
cache is off in the child.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys

_CHILD = r"""
import json, sys
sys.path.insert(0, {bench!r})
import optax
import compile_time
name = {name!r}
make = lambda: {{name: compile_time._variants(optax.adamw(1e-4))[name]}}
print("RESULT", json.dumps(compile_time._compile_times({n}, make)[name]))
"""

VARIANTS = {
  "bare": "adamw (bare)",
  "update": "lossscale: tx.update + apply_updates",
  "fused": "lossscale.apply_gradients",
  "apply_if_finite": "optax.apply_if_finite",
}

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def _time(line: str) -> datetime.datetime | None:
  m = re.search(r"(\d\d:\d\d:\d\d\.\d+)", line)
  return datetime.datetime.strptime(m.group(1), "%H:%M:%S.%f") if m else None


def _seconds(a: str | None, b: str | None) -> float | None:
  t0, t1 = _time(a or ""), _time(b or "")
  if t0 is None or t1 is None:
    return None
  return (t1 - t0).total_seconds() % 86400  # a phase across midnight


def parse_log(log: str, module: str) -> dict:
  """`module`'s pass times and buffer-assignment phases, from XLA's log."""
  lines = log.splitlines()
  times: collections.Counter[str] = collections.Counter()
  pipelines: set[str] = set()
  current = None
  for line in lines:
    m = re.search(r"Running HLO pass pipeline on module (\S+): (.*)$", line)
    if m:
      current = m.group(1)
      if current == module:
        pipelines.add(m.group(2).strip())
    m = re.search(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) \(", line)
    if m and current == module:
      times[m.group(1)] += float(m.group(2)) * _UNITS[m.group(3)]
  # A pipeline run inside another is also logged as one of its passes:
  # counted once, by its own passes.
  passes = {k: v for k, v in times.items() if k not in pipelines}
  at = next(
    (i for i, x in enumerate(lines) if f"Assigning buffers to module {module}" in x),
    None,
  )
  scan = heap = n_buffers = None
  if at is not None:
    after = lines[at:]
    count = next((x for x in after if "Number of buffers to assign" in x), None)
    heap_line = next((x for x in after if "Running whole-module heap" in x), None)
    done_line = next((x for x in after if "Buffer assignment done" in x), None)
    n_buffers = int(count.split()[-1]) if count else None
    scan, heap = _seconds(count, heap_line), _seconds(heap_line, done_line)
  top = sorted(passes.items(), key=lambda kv: -kv[1])[:3]
  return dict(
    module=module,
    passes_s=sum(passes.values()) if passes else None,
    top_passes={k: round(v, 3) for k, v in top},
    buffers=n_buffers,
    scan_s=scan,
    heap_s=heap,
  )


def measure(n_leaves: int, variant: str) -> dict:
  bench = os.path.dirname(os.path.abspath(__file__))
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL="0",
    TF_CPP_VMODULE="hlo_pass_pipeline=1,buffer_assignment=1",
    # A persistent compilation cache would hand back the step uncompiled.
    JAX_ENABLE_COMPILATION_CACHE="false",
  )
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  child = _CHILD.format(bench=bench, n=n_leaves, name=VARIANTS[variant])
  out = subprocess.run(
    [sys.executable, "-c", child], env=env, capture_output=True, text=True
  )
  if out.returncode:
    sys.exit(f"{variant} at {n_leaves} leaves failed:\n{out.stderr[-3000:]}")
  result = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
  times = json.loads(result.removeprefix("RESULT "))
  return dict(
    variant=variant,
    leaves=n_leaves,
    **{k: times[k] for k in ("trace_s", "lower_s", "compile_s", "temp_bytes")},
    # The step function's name in compile_time._variants, as jax.jit names
    # its module.
    **parse_log(out.stderr, f"jit_{variant}"),
  )


def _fmt(x: float | None) -> str:
  return "-" if x is None else f"{x:.2f}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--leaves", default="500,1000,2000")
  ap.add_argument("--variants", default="bare,update,fused")
  ap.add_argument("--json", default=None, help="where to write the JSON")
  args = ap.parse_args(argv)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    ap.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
  try:
    sizes = [int(x) for x in args.leaves.split(",") if x.strip()]
  except ValueError:
    ap.error(f"--leaves: comma-separated integers, got {args.leaves!r}")
  records = []
  print(
    "| leaves | variant | trace + compile (CPU s) | HLO passes (s) | buffer"
    " assignment: scan (s) | heap simulation (s) | temporaries (KB) |"
  )
  print("|---:|---|---:|---:|---:|---:|---:|")
  for n in sizes:
    for v in variants:
      r = measure(n, v)
      records.append(r)
      total = r["trace_s"] + r["lower_s"] + r["compile_s"]
      print(
        f"| {n} | {v} | {total:.2f} | {_fmt(r['passes_s'])} | {_fmt(r['scan_s'])}"
        f" | {_fmt(r['heap_s'])} | {r['temp_bytes'] / 1e3:.0f} |",
        flush=True,
      )
  if args.json:
    payload = dict(
      benchmark="compile_phases", environment=_environment(), records=records
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(payload, f, indent=2)
    print(f"wrote {args.json}")


def _environment() -> dict:
  """`_bench.environment()` (imported here: this process compiles nothing)."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _bench

  return _bench.environment()


if __name__ == "__main__":
  main()
