"""How tracing and compiling a step grows with the number of parameter leaves.

Usage:
  python benchmarks/compile_time.py [--leaves 250,500,1000,2000,4000]
      [--json benchmarks/results/compile_time_cpu.json]
      [--plot docs/img/compile_time.png]

For each tree size (leaves of 64 float32 each), every variant is a jitted
`step(params, opt_state, grads) -> (params, opt_state)` with
`donate_argnums=(0, 1)`, traced, lowered and compiled from scratch, the
variants one after the other for each size, so that the ratios to the bare
`optax.adamw` step of the same size are taken under the same machine load.
Times are the process's CPU time (`time.process_time`), which another
process on the machine disturbs much less than wall time; wall time is
recorded too.

Then the contract's comparison, repeated: at `--target-leaves` (2000),
the bare step, `apply_gradients` and `tx.update` + `apply_updates`,
`--rounds` times, the order of the three rotated from round to round. In
one process a step's time depends on what ran before it (Python's garbage
collector walks every object the earlier steps left alive, and the same
XLA compile varies by seconds), and the sweep above always compiles the
bare step first; the rounds give each step every place in the order, and
report the median of the per-round ratios to the bare step and their
range.

Then the eager steps: the same variants called without `jax.jit` on a
small tree, median time per step after the first call, and the number of
XLA compilations after the first call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench

import lossscale as ls

SCALE = 2.0**15
_BARE = "adamw (bare)"

_COMPILATIONS: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
  lambda event, *_, **__: (
    _COMPILATIONS.append(event)
    if event == "/jax/core/compile/backend_compile_duration"
    else None
  )
)


def _variants(adam):
  def bare(params, state, grads):
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # One wrapper per variant, so that no variant reuses another's traces.
  tx = ls.dynamic_loss_scale(adam, initial_scale=SCALE)
  tx_fused = ls.dynamic_loss_scale(adam, initial_scale=SCALE)

  def update(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def fused(params, state, grads):
    return ls.apply_gradients(tx_fused, grads, state, params)

  aif = optax.apply_if_finite(adam, 10)

  def apply_if_finite(params, state, grads):
    updates, state = aif.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return {
    _BARE: (adam.init, bare),
    "lossscale: tx.update + apply_updates": (tx.init, update),
    "lossscale.apply_gradients": (tx_fused.init, fused),
    "optax.apply_if_finite": (aif.init, apply_if_finite),
  }


def _params(n_leaves: int) -> dict[str, jax.Array]:
  return {f"l{i:05d}": jnp.zeros((64,), jnp.float32) for i in range(n_leaves)}


def _compile_one(name: str, params, init, step) -> dict[str, float]:
  state = init(params)
  jitted = jax.jit(step, donate_argnums=(0, 1))
  with jax.numpy_dtype_promotion("standard"):  # optax's adam
    w0, c0 = time.perf_counter(), time.process_time()
    traced = jitted.trace(params, state, params)
    c1 = time.process_time()
    lowered = traced.lower()
    c2 = time.process_time()
    compiled = lowered.compile()
    w3, c3 = time.perf_counter(), time.process_time()
  n_leaves = len(jax.tree_util.tree_leaves(params))
  print(
    f"{n_leaves:5d} leaves  {name:40s} trace {c1 - c0:6.2f} s  lower"
    f" {c2 - c1:6.2f} s  compile {c3 - c2:7.2f} s  (CPU; wall {w3 - w0:.1f} s)",
    flush=True,
  )
  return dict(
    trace_s=c1 - c0,
    lower_s=c2 - c1,
    compile_s=c3 - c2,
    total_s=c3 - c0,
    wall_s=w3 - w0,
    temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
  )


def _compile_times(n_leaves: int, make_variants) -> dict[str, dict[str, float]]:
  params = _params(n_leaves)
  return {
    name: _compile_one(name, params, init, step)
    for name, (init, step) in make_variants().items()
  }


_ROTATED = (_BARE, "lossscale.apply_gradients", "lossscale: tx.update + apply_updates")


def _target_rounds(n_leaves: int, rounds: int, make_variants) -> dict:
  """Trace + compile of the contract's steps, `rounds` times, the order
  rotated every round; medians and ranges of the per-round ratios."""
  params = _params(n_leaves)
  totals: dict[str, list[float]] = {k: [] for k in _ROTATED}
  for r in range(rounds):
    order = _ROTATED[r % len(_ROTATED) :] + _ROTATED[: r % len(_ROTATED)]
    for name in order:
      init, step = make_variants()[name]  # new wrappers: nothing traced yet
      totals[name].append(_compile_one(name, params, init, step)["total_s"])
  steps = {}
  for name, seconds in totals.items():
    ratios = [t / b for t, b in zip(seconds, totals[_BARE], strict=True)]
    steps[name] = dict(
      total_s=seconds,
      vs_bare=statistics.median(ratios),
      vs_bare_min=min(ratios),
      vs_bare_max=max(ratios),
    )
  return dict(leaves=n_leaves, rounds=rounds, steps=steps)


def _eager(make_variants, rounds: int) -> dict[str, dict[str, float]]:
  params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
  grads = {"w": jnp.full((4, 4), 0.01), "b": jnp.full(4, 0.01)}
  runners, counts = {}, {}
  for name, (init, step) in make_variants().items():
    scaled = "lossscale" in name
    g = jax.tree.map(lambda x: x * SCALE, grads) if scaled else grads
    box = [params, init(params)]

    def run(box=box, step=step, g=g):
      box[0], box[1] = step(box[0], box[1], g)
      jax.block_until_ready(box[0])

    with jax.numpy_dtype_promotion("standard"):
      run()  # the first call compiles
      start = len(_COMPILATIONS)
      for _ in range(3):
        run()
      counts[name] = len(_COMPILATIONS) - start
    runners[name] = run
  times = {k: [] for k in runners}
  with jax.numpy_dtype_promotion("standard"):
    for _ in range(rounds):
      for name, run in runners.items():
        t = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - t)
  return {
    k: dict(median_ms=statistics.median(v) * 1e3, compilations_after_first=counts[k])
    for k, v in times.items()
  }


def _plot(records, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.0))
  names = list(dict.fromkeys(r["variant"] for r in records))
  for name in names:
    rows = [r for r in records if r["variant"] == name]
    ax.plot(
      [r["leaves"] for r in rows], [r["total_s"] for r in rows], marker="o", label=name
    )
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("parameter leaves (64 float32 each)")
  ax.set_ylabel("trace + compile, CPU seconds")
  ax.set_title("AdamW step: trace and compile time")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--leaves", default="250,500,1000,2000,4000")
  ap.add_argument("--target-leaves", type=int, default=2000)
  ap.add_argument("--rounds", type=int, default=5, help="rounds at --target-leaves")
  ap.add_argument("--eager-rounds", type=int, default=200)
  ap.add_argument("--json", default=None, help="where to write the JSON")
  ap.add_argument("--plot", default=None, help="where to write the plot (PNG)")
  args = ap.parse_args(argv)
  sizes = [int(n) for n in args.leaves.split(",")]

  def make_variants():  # new wrappers for every size: nothing cached
    return _variants(optax.adamw(1e-4))

  records = []
  for n in sizes:
    times = _compile_times(n, make_variants)
    base = times[_BARE]["total_s"]
    for name, t in times.items():
      records.append(dict(variant=name, leaves=n, **t, vs_bare=t["total_s"] / base))
  targets = None
  if args.rounds:
    targets = _target_rounds(args.target_leaves, args.rounds, make_variants)
  eager = _eager(make_variants, args.eager_rounds)

  rows = []
  for n in sizes:
    by_name = {r["variant"]: r for r in records if r["leaves"] == n}
    bare = by_name[_BARE]
    rows.append(
      [
        n,
        f"{bare['total_s']:.2f} s"
        f" (trace + lowering {bare['trace_s'] + bare['lower_s']:.2f} s)",
        *(
          f"{by_name[k]['vs_bare']:.2f}x"
          for k in (
            "lossscale: tx.update + apply_updates",
            "lossscale.apply_gradients",
            "optax.apply_if_finite",
          )
        ),
      ]
    )
  table = _bench.markdown_table(
    [
      "leaves",
      "bare adamw: trace + compile",
      "tx.update + apply_updates",
      "apply_gradients",
      "optax.apply_if_finite",
    ],
    rows,
  )
  base_ms = eager[_BARE]["median_ms"]
  eager_table = _bench.markdown_table(
    [
      "eager step (no jax.jit)",
      "median ms",
      "time / bare",
      "compilations after the first call",
    ],
    [
      [
        k,
        f"{v['median_ms']:.2f}",
        f"{v['median_ms'] / base_ms:.2f}x",
        v["compilations_after_first"],
      ]
      for k, v in eager.items()
    ],
  )
  if targets is not None:
    target_table = _bench.markdown_table(
      [f"at {targets['leaves']} leaves, {targets['rounds']} rounds", "time / bare"],
      [
        [k, f"{v['vs_bare']:.2f}x ({v['vs_bare_min']:.2f}-{v['vs_bare_max']:.2f})"]
        for k, v in targets["steps"].items()
      ],
    )
    eager_table = target_table + "\n\n" + eager_table
  print()
  print(table)
  print()
  print(eager_table)
  payload = dict(
    benchmark="compile_time",
    environment=_bench.environment(),
    leaf_shape=[64],
    results=records,
    targets=targets,
    eager=eager,
  )
  _bench.write_outputs("compile_time", table + "\n\n" + eager_table, payload, args.json)
  if args.plot:
    _plot(records, args.plot)


if __name__ == "__main__":
  main()
