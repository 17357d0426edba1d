"""The optimizer step at a base commit against the working tree, interleaved.

Usage:
  python benchmarks/compare.py --base c193e02 [--repeats 3] [--rounds 15]
      [--cases float32:25e6,bfloat16:10e6] [--json PATH]
  python benchmarks/compare.py --plain '1;split;finite;order' [...]
  make bench-compare BASE=c193e02

With `--plain` (alone or beside `--base`), the bases include the working
tree itself with the speed layer switched off (`LOSSSCALE_PLAIN=1`: all of
it; `LOSSSCALE_PLAIN=split`: one trick), each a base of its own, all
interleaved with the working tree as it is: what the speed layer buys, trick
by trick (docs/performance.md, "The speed layer: what it buys").

Each repetition runs one process per tree and case, base and working tree
alternating (ABBA order), each timing its own bare `optax.adamw` step and
lossscale's steps interleaved, round after round, on the same
transformer-shaped tree (`_bench.transformer_shapes`, donated parameters and
state): `apply_gradients` on finite and on overflowing gradients, and
`tx.update` + `optax.apply_updates`. A process reports each step's median
time as a ratio to its own bare step, so load that drifts between processes
cancels. A `compile:LEAVES` case (`--cases float32:25e6,compile:2000`)
instead measures the trace + compile time (CPU seconds of the process) of
each step on a tree of LEAVES leaves of 64 float32, against the bare
step's. The base tree is `git archive`d from BASE (its `lossscale/` only);
both trees are timed by this script.

Prints the median ratio over the repetitions for each tree, side by side,
and exits with status 1 when a row of the working tree is slower than the
base beyond the run's own spread: its median ratio exceeds the base's by
more than the larger half-range of the two trees' repetitions, and by more
than 3%. Timings in tests are not allowed (the machines are shared): run
this before every change to the compiled step and quote its output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCALE = 2.0**15
STEPS = (
  ("apply_gradients", "finite"),
  ("apply_gradients", "overflow"),
  ("tx.update + apply_updates", "finite"),
)
COMPILE_STEPS = (
  ("apply_gradients", "compile"),
  ("tx.update + apply_updates", "compile"),
)


def _report(bare_seconds: float, ratios: dict[str, float]) -> None:
  """Prints a child's result: one JSON line, read by `_run`."""
  import _bench

  import lossscale as ls

  environment = _bench.environment()
  print(
    json.dumps(
      {
        "lossscale": os.path.dirname(os.path.abspath(ls.__file__)),
        "environment": {
          k: v for k, v in environment.items() if k not in ("lossscale", "commit")
        },
        "bare_ms": bare_seconds * 1e3,
        "ratios": ratios,
      }
    )
  )


def child_compile(n_leaves: int) -> None:
  """Trace + compile time (CPU seconds of this process) of each step on a
  tree of `n_leaves` leaves of 64 float32, as a ratio to the bare step's;
  prints one JSON line."""
  sys.path.insert(0, HERE)
  import time

  import jax
  import jax.numpy as jnp
  import optax

  import lossscale as ls

  params = {f"l{i:05d}": jnp.full((64,), 0.01, jnp.float32) for i in range(n_leaves)}
  adam = optax.adamw(1e-4)

  def bare(p, s, g):
    updates, s = adam.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def update(tx):
    def step(p, s, g):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    return step

  def fused(tx):
    return lambda p, s, g: ls.apply_gradients(tx, g, s, p)

  seconds = {}
  for name, make in (
    ("bare adamw / compile", lambda: (bare, adam)),
    (
      "apply_gradients / compile",
      lambda: (fused(tx := ls.dynamic_loss_scale(adam)), tx),
    ),
    (
      "tx.update + apply_updates / compile",
      lambda: (update(tx := ls.dynamic_loss_scale(adam)), tx),
    ),
  ):
    step, tx = make()  # a new wrapper: nothing traced or compiled yet
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):
      t = time.process_time()
      jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile()
      seconds[name] = time.process_time() - t
  base = seconds["bare adamw / compile"]
  _report(base, {k: v / base for k, v in seconds.items()})


def child(dtype_name: str, n_params: float, rounds: int) -> None:
  """Times the steps in this process; prints one JSON line of ratios."""
  sys.path.insert(0, HERE)
  import _bench
  import jax
  import jax.numpy as jnp
  import optax

  import lossscale as ls

  dtype = jnp.dtype(dtype_name)
  params, grads32 = _bench.gpt_tree(n_params, dtype)
  grads = jax.tree.map(lambda g: g.astype(dtype), grads32)
  scaled = jax.tree.map(lambda g: (g * SCALE).astype(dtype), grads32)
  overflow = dict(scaled)
  k = next(k for k in overflow if k.endswith("mlp/in/kernel"))
  overflow[k] = overflow[k].at[3, 5].set(jnp.inf)

  adam = optax.adamw(1e-4)
  tx = ls.dynamic_loss_scale(adam, initial_scale=SCALE)
  # float16 parameters: the bare step with the float32 state lossscale gives.
  bare_params = params
  if dtype == jnp.float16:
    bare_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)

  def bare(p, s, g):
    updates, s = adam.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def update(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  def fused(p, s, g):
    return ls.apply_gradients(tx, g, s, p)

  variants = {
    ("bare adamw", "finite"): (bare, adam.init, bare_params, grads),
    ("apply_gradients", "finite"): (fused, tx.init, params, scaled),
    ("apply_gradients", "overflow"): (fused, tx.init, params, overflow),
    ("tx.update + apply_updates", "finite"): (update, tx.init, params, scaled),
  }
  runners = {}
  for name, (step, init, p0, g) in variants.items():
    box = [_bench.fresh_copy(p0), init(p0)]
    with jax.numpy_dtype_promotion("standard"):  # optax's adam
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(box[0], box[1], g).compile()

    def run(box=box, compiled=compiled, g=g):
      box[0], box[1] = compiled(box[0], box[1], g)
      jax.block_until_ready(box[0])

    run()
    run()  # warm: the second call reuses the donated buffers
    runners[name] = run
  medians = _bench.interleaved_medians(runners, rounds)
  base = medians[("bare adamw", "finite")]
  _report(base, {f"{n} / {c}": t / base for (n, c), t in medians.items()})


def _archive(ref: str, dest: str) -> None:
  archive = subprocess.run(
    ["git", "-C", ROOT, "archive", ref, "lossscale"],
    check=True,
    capture_output=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)


def _run(tree: str, dtype: str, n: float, rounds: int, plain: str | None) -> dict:
  env = dict(os.environ, PYTHONPATH=tree)
  env.pop("LOSSSCALE_PLAIN", None)
  if plain is not None:
    env["LOSSSCALE_PLAIN"] = plain
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--child",
    dtype,
    str(n),
    str(rounds),
  ]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    sys.exit(f"the step failed in {tree} ({dtype}):\n{proc.stderr[-3000:]}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  if os.path.realpath(out["lossscale"]) != os.path.realpath(
    os.path.join(tree, "lossscale")
  ):
    sys.exit(f"imported lossscale from {out['lossscale']}, not from {tree}")
  return out


def _rev(ref: str) -> str:
  return subprocess.run(
    ["git", "-C", ROOT, "rev-parse", "--short=10", ref],
    check=True,
    capture_output=True,
    text=True,
  ).stdout.strip()


def _commit() -> str | None:
  """The working tree's commit, "+dirty" when lossscale/ differs from it;
  None outside a git checkout."""
  try:
    dirty = subprocess.run(
      ["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "lossscale"],
      capture_output=True,
    )
    return _rev("HEAD") + ("+dirty" if dirty.returncode else "")
  except (OSError, subprocess.CalledProcessError):
    return None


def _label(dtype: str, n: float) -> str:
  return (
    f"compile, {n:g} leaves" if dtype == "compile" else f"{dtype}, {n / 1e6:g}M params"
  )


def _repeat(trees: dict, dtype: str, n: float, args: Any) -> dict[str, list[dict]]:
  """`args.repeats` processes per tree for one case, the trees' order
  rotated and reversed from one repetition to the next."""
  runs: dict[str, list[dict]] = {which: [] for which in trees}
  names = list(trees)
  for r in range(args.repeats):
    order = names[r % len(names) :] + names[: r % len(names)]
    for which in order[::-1] if r % 2 else order:
      tree, plain = trees[which]
      out = _run(tree, dtype, n, args.rounds, plain)
      runs[which].append(out)
      print(
        f"{_label(dtype, n)}, {which} #{r + 1}: bare {out['bare_ms']:.1f} ms, "
        + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratios"].items() if v != 1),
        flush=True,
      )
  return runs


def _half_range(xs: list[float]) -> float:
  return (max(xs) - min(xs)) / 2


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--base", help="a git ref (commit, tag, branch)")
  ap.add_argument(
    "--plain",
    help="the working tree with the speed layer off as bases too (or instead):"
    " LOSSSCALE_PLAIN values separated by ';', each a base of its own"
    " (such as '1;split;finite': all tricks off, then one at a time)",
  )
  ap.add_argument(
    "--base-tree",
    default=None,
    help="a folder holding BASE's lossscale/ already (where there is no git"
    " history, such as a copy of the working tree on another machine)",
  )
  ap.add_argument("--repeats", type=int, default=3, help="processes per tree and case")
  ap.add_argument("--rounds", type=int, default=15, help="timed rounds per process")
  ap.add_argument(
    "--cases",
    default="float32:25e6,bfloat16:10e6",
    help="comma-separated dtype:parameters (float32, bfloat16, float16), or"
    " compile:LEAVES for the trace + compile time of a LEAVES-leaf step",
  )
  ap.add_argument("--json", default=None, help="where to write the results")
  args = ap.parse_args(argv)
  if not (args.base or args.plain):
    ap.error("give --base, --plain or both")
  if args.repeats < 1 or args.rounds < 1:
    ap.error("--repeats and --rounds must be positive")
  cases = []
  for case in args.cases.split(","):
    dtype, _, n = case.partition(":")
    if dtype not in ("float32", "bfloat16", "float16", "compile") or not n:
      ap.error(
        "--cases: expected dtype:parameters such as float32:25e6 (or"
        f" compile:LEAVES), got {case!r}"
      )
    cases.append((dtype, float(n)))

  with tempfile.TemporaryDirectory() as tmp:
    # label -> (tree, LOSSSCALE_PLAIN); "work" is the working tree as it is.
    trees: dict[str, tuple[str, str | None]] = {}
    if args.base:
      if args.base_tree:
        tmp = os.path.abspath(args.base_tree)
      else:
        _archive(args.base, tmp)
      trees["base"] = (tmp, None)
    for value in args.plain.split(";") if args.plain else ():
      trees[f"LOSSSCALE_PLAIN={value}"] = (ROOT, value)
    trees["work"] = (ROOT, None)
    results = {}
    for dtype, n in cases:
      results[_label(dtype, n)] = _repeat(trees, dtype, n, args)

  slower = []
  print(f"\nmedian time / bare adamw over {args.repeats} processes each")
  print(f"base = {args.base or ''} {args.plain or ''}, work = working tree\n")
  print("| case | step | base | work | work / base |")
  print("|---|---|---:|---:|---:|")
  summary = []
  for case, runs in results.items():
    for base_label in (label for label in runs if label != "work"):
      for name, kind in COMPILE_STEPS if case.startswith("compile") else STEPS:
        key = f"{name} / {kind}"
        b = [r["ratios"][key] for r in runs[base_label]]
        w = [r["ratios"][key] for r in runs["work"]]
        mb, mw = statistics.median(b), statistics.median(w)
        allowed = max(_half_range(b), _half_range(w), 0.03 * mb)
        flag = " SLOWER" if mw - mb > allowed else ""
        if flag:
          slower.append(f"{case} {key} (against {base_label})")
        shown = case if base_label == "base" else f"{case}, {base_label}"
        print(
          f"| {shown} | {key} | {mb:.2f}x ({min(b):.2f}-{max(b):.2f}) |"
          f" {mw:.2f}x ({min(w):.2f}-{max(w):.2f}) | {mw / mb:.2f}{flag} |"
        )
        row = dict(case=case, step=key, base=b, work=w, base_median=mb)
        row.update(work_median=mw, slower=bool(flag))
        if base_label != "base":
          row["plain"] = trees[base_label][1]
        summary.append(row)
  if args.json:
    first = next(iter(results.values()))["work"][0]
    environment = dict(first["environment"], commit=_commit())
    payload = dict(
      benchmark="compare",
      base=args.base,
      base_commit=(args.base if args.base_tree else _rev(args.base))
      if args.base
      else None,
      plain=args.plain,
      environment=environment,
      repeats=args.repeats,
      rounds=args.rounds,
      results=summary,
    )
    with open(args.json, "w") as f:
      json.dump(payload, f, indent=1)
  if slower:
    print("\nslower than the base beyond the run's spread: " + "; ".join(slower))
    return 1
  print("\nno row slower than the base beyond the run's spread")
  return 0


if __name__ == "__main__":
  if len(sys.argv) == 5 and sys.argv[1] == "--child":
    if sys.argv[2] == "compile":
      child_compile(int(float(sys.argv[3])))
    else:
      child(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]))
  else:
    sys.exit(main())
