"""One AdamW step with loss scaling, side by side with the alternatives.

Usage:
  python benchmarks/optimizer_step.py [--params 25e6] [--rounds 15]
      [--dtype float32] [--no-donate]
      [--json benchmarks/results/optimizer_step_cpu.json]

Every variant is a jitted `step(params, opt_state, grads) -> (params,
opt_state)` with `donate_argnums=(0, 1)` (none with `--no-donate`) on a
transformer-shaped float32 tree (148 leaves). All variants run interleaved
in one process, so the ratios to the bare `optax.adamw` step are taken
under the same machine load. Two cases: finite gradients, and an overflow
step (one inf in one leaf).

Peers: `optax.apply_if_finite` (fed unscaled gradients), jmp's
`DynamicLossScale` with `jmp.select_tree`, and the unscale / finite / select
logic of Flax's `flax.training.dynamic_scale.DynamicScale` (as its
`value_and_grad` and the Flax examples write it).

Reported per variant: median step time and its ratio to plain AdamW;
XLA's `cost_analysis()` bytes accessed, against plain and against the
analytic minimum (gradients read once; parameters and both moments read and
written once); `memory_analysis()` temporary bytes; fusion, copy and
conditional counts in the optimised HLO.

With `--dtype bfloat16` or `--dtype float16` the parameters and gradients
have that dtype (peers that cannot take them are best left out with
`--only`); the plain AdamW rows of a float16 run keep float32 optimizer
state, the state lossscale gives float16 parameters.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _bench

import lossscale as ls

SCALE = 2.0**15


# Variants: (init(params) -> state, step(params, state, grads) -> (params, state),
# whether the step is fed gradients of the scaled loss).


def plain(adam):
  def step(params, state, grads):
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return adam.init, step, False


def plain_with_check(adam):
  """The bare step plus `lossscale.all_finite` (no skip): the floor of any skip."""

  def init(params):
    return adam.init(params), jnp.array(True)

  def step(params, state, grads):
    updates, inner = adam.update(grads, state[0], params)
    return optax.apply_updates(params, updates), (inner, ls.all_finite(grads))

  return init, step, False


def lossscale_update(adam):
  tx = ls.dynamic_loss_scale(adam, initial_scale=SCALE)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step, True


def lossscale_apply_gradients(adam):
  tx = ls.dynamic_loss_scale(adam, initial_scale=SCALE)

  def step(params, state, grads):
    return ls.apply_gradients(tx, grads, state, params)

  return tx.init, step, True


def optax_apply_if_finite(adam):
  tx = optax.apply_if_finite(adam, max_consecutive_errors=2**30)

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx.init, step, False


def jmp_dynamic_loss_scale(adam):
  import jmp

  # The state keeps jmp's arrays: its pytree unflattening cannot rebuild a
  # DynamicLossScale from the placeholders `jax.jit(...).lower` passes.
  def init(params):
    scale = jnp.asarray(SCALE, jnp.float32)
    return adam.init(params), (scale, jnp.zeros([], jnp.int32))

  def step(params, state, grads):
    inner, (scale, counter) = state
    loss_scale = jmp.DynamicLossScale(scale, counter)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_inner = adam.update(grads, inner, params)
    new_params = optax.apply_updates(params, updates)
    params, inner = jmp.select_tree(finite, (new_params, new_inner), (params, inner))
    return params, (inner, (loss_scale.loss_scale, loss_scale.counter))

  return init, step, True


def flax_dynamic_scale(adam):
  from flax.training.dynamic_scale import DynamicScale

  def init(params):
    return adam.init(params), DynamicScale(scale=jnp.asarray(SCALE, jnp.float32))

  def step(params, state, grads):
    inner, ds = state
    # flax.training.dynamic_scale.DynamicScale.value_and_grad, after the
    # gradient (flax 0.12.8): unscale, finite check, scale update.
    grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / ds.scale, grads)
    finite = jnp.array(True)
    for g in jax.tree.leaves(grads):
      finite &= jnp.all(jax.lax.is_finite(g))
    grow = ds.fin_steps == ds.growth_interval
    fin_scale = jnp.where(
      grow & finite,
      jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(jnp.float32).max),
      ds.scale,
    )
    inf_scale = ds.scale * ds.backoff_factor
    if ds.minimum_scale is not None:
      inf_scale = jnp.maximum(inf_scale, ds.minimum_scale)
    ds = ds.replace(
      fin_steps=jnp.where(grow | (~finite), 0, ds.fin_steps + 1),
      scale=jnp.where(finite, fin_scale, inf_scale),
    )
    # The Flax examples' skip: update, then select with jnp.where.
    updates, new_inner = adam.update(grads, inner, params)
    new_params = optax.apply_updates(params, updates)
    select = functools.partial(jnp.where, finite)
    params = jax.tree.map(select, new_params, params)
    inner = jax.tree.map(select, new_inner, inner)
    return params, (inner, ds)

  return init, step, True


def lossscale_select_formulation(adam):
  """The select-based skip this library used before `lax.cond` (evidence only).

  Same decision and the same state machine (`next_counters`); the inner
  optimizer always runs (on zeros when skipping) and `jnp.where` picks the
  updates and the inner state.
  """
  from lossscale import _rule, _unscale

  rule = _rule.Rule(
    initial_scale=SCALE,
    dynamic=True,
    growth_interval=2000,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=1.0,
    max_scale=2.0**24,
  )

  def init(params):
    counters = _rule.init_counters(rule)
    return _rule.LossScaleState(**counters, inner_state=adam.init(params))

  def step(params, state, grads):
    u = _unscale.unscale(grads, _unscale.unscale_factors(state.loss_scale))
    finite = ls.all_finite(u)
    safe = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), u)
    updates, inner = adam.update(safe, state.inner_state, params)
    updates = jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), updates)
    inner = optax.tree.where(finite, inner, state.inner_state)
    counters = _rule.next_counters(rule, state, finite)
    new_state = _rule.LossScaleState(**counters, inner_state=inner)
    return optax.apply_updates(params, updates), new_state

  return init, step, True


VARIANTS = {
  "adamw (plain)": plain,
  "adamw + all_finite, no skip": plain_with_check,
  "lossscale: tx.update + apply_updates": lossscale_update,
  "lossscale.apply_gradients": lossscale_apply_gradients,
  "optax.apply_if_finite": optax_apply_if_finite,
  "jmp DynamicLossScale + select_tree": jmp_dynamic_loss_scale,
  "flax DynamicScale + where": flax_dynamic_scale,
}
EVIDENCE = {
  "lossscale wrapper via jnp.where (old)": lossscale_select_formulation,
}


def misordered_donation(adam):
  """`step(grads, opt_state, params) -> (params, opt_state)`, donating 1 and 2.

  JAX pairs donated input buffers with outputs of the same shape in order,
  so the new parameters land in the old first moment's buffers, the new
  first moment in the second moment's, and so on: XLA must copy to keep
  the old values alive.
  """
  _, step, _ = plain(adam)
  return jax.jit(lambda g, s, p: step(p, s, g), donate_argnums=(1, 2))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=float, default=25e6, help="about this many")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--rounds", type=int, default=15)
  ap.add_argument("--only", default="", help="comma-separated variant names")
  ap.add_argument(
    "--evidence",
    action="store_true",
    help="also run the select-based wrapper formulation (why lax.cond)",
  )
  ap.add_argument(
    "--dtype", default="float32", choices=["float32", "bfloat16", "float16"]
  )
  ap.add_argument(
    "--no-donate",
    action="store_true",
    help="jit every step without donate_argnums (what not donating costs)",
  )
  ap.add_argument("--json", default=None, help="where to write the JSON")
  args = ap.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  if not 0 < args.params <= 5e9:
    ap.error(f"--params must be in (0, 5e9], got {args.params}")

  params, grads32 = _bench.gpt_tree(args.params, dtype, args.layers)
  shapes = {k: x.shape for k, x in params.items()}
  grads = jax.tree.map(lambda g: g.astype(dtype), grads32)
  scaled = jax.tree.map(lambda g: (g * SCALE).astype(dtype), grads32)

  def overflow(tree):
    tree = dict(tree)
    k = next(k for k in tree if k.endswith("mlp/in/kernel"))
    tree[k] = tree[k].at[3, 5].set(jnp.inf)
    return tree

  inputs = {
    ("finite", False): grads,
    ("finite", True): scaled,
    ("overflow", False): overflow(grads),
    ("overflow", True): overflow(scaled),
  }
  n = sum(x.size for x in jax.tree.leaves(params))
  p_bytes = _bench.tree_bytes(params)
  m_bytes = 2 * p_bytes if dtype == jnp.float16 else p_bytes  # float32 moments
  analytic_min = p_bytes + 2 * (p_bytes + 2 * m_bytes)  # grads; params, mu, nu r+w
  print(
    f"{len(shapes)} leaves, {n / 1e6:.1f}M {dtype.name} parameters;"
    f" analytic minimum {analytic_min / 1e6:.0f} MB per AdamW step"
    + ("; nothing donated" if args.no_donate else ""),
    flush=True,
  )

  adam = optax.adamw(1e-4)
  variants = {**VARIANTS, **(EVIDENCE if args.evidence else {})}
  only = {"adamw (plain)", *args.only.split(",")} if args.only else set(variants)
  names = [v for v in variants if v in only]
  runners, stats = {}, {}
  for name in names:
    try:
      init, step, wants_scaled = variants[name](adam)
    except ImportError as e:  # a peer that is not installed here (jmp on a GPU box)
      print(f"skipped {name}: {e}", flush=True)
      continue
    jitted = jax.jit(step, donate_argnums=() if args.no_donate else (0, 1))
    for case in ("finite", "overflow"):
      if name.startswith("adamw") and case == "overflow":
        continue  # no skip logic: the overflow step would write NaNs
      g = inputs[(case, wants_scaled)]
      init_params = params
      if name.startswith("adamw") and dtype == jnp.float16:
        init_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
      box = [_bench.fresh_copy(params), init(init_params)]
      with jax.numpy_dtype_promotion("standard"):  # optax's adam, flax, jmp
        compiled = jitted.lower(box[0], box[1], g).compile()
      stats[(name, case)] = _bench.compiled_stats(compiled)

      def run(box=box, compiled=compiled, g=g):
        box[0], box[1] = compiled(box[0], box[1], g)
        jax.block_until_ready(box[0])

      run()  # warm up
      runners[(name, case)] = run
      print(f"compiled {name} / {case}", flush=True)

  if not args.only and dtype == jnp.float32 and not args.no_donate:
    bad = misordered_donation(adam)
    box = [adam.init(params), _bench.fresh_copy(params)]
    with jax.numpy_dtype_promotion("standard"):
      compiled = bad.lower(grads, box[0], box[1]).compile()
    key_bad = ("adamw, misordered donation", "finite")
    stats[key_bad] = _bench.compiled_stats(compiled)

    def run_bad(box=box, compiled=compiled):
      box[1], box[0] = compiled(grads, box[0], box[1])
      jax.block_until_ready(box[1])

    run_bad()
    runners[key_bad] = run_bad

  medians = _bench.interleaved_medians(runners, args.rounds)
  base_t = medians[("adamw (plain)", "finite")]
  base_b = stats[("adamw (plain)", "finite")].bytes_accessed
  rows, records = [], []
  for (name, case), t in medians.items():
    s = stats[(name, case)]
    rec = dict(
      variant=name,
      case=case,
      median_ms=t * 1e3,
      time_vs_plain=t / base_t,
      bytes_accessed_mb=s.bytes_accessed / 1e6,
      bytes_vs_plain=s.bytes_accessed / base_b,
      bytes_vs_analytic_min=s.bytes_accessed / analytic_min,
      temp_mb=s.temp_bytes / 1e6,
      fusions=s.fusions,
      copies=s.copies,
      conditionals=s.conditionals,
    )
    records.append(rec)
    rows.append(
      [
        name,
        case,
        f"{rec['median_ms']:.1f}",
        f"{rec['time_vs_plain']:.2f}x",
        f"{rec['bytes_accessed_mb']:.0f}",
        f"{rec['bytes_vs_plain']:.2f}x",
        f"{rec['bytes_vs_analytic_min']:.2f}x",
        f"{rec['temp_mb']:.1f}",
        s.fusions,
        s.copies,
      ]
    )
  table = _bench.markdown_table(
    [
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
    ],
    rows,
  )
  print()
  print(table)
  payload = dict(
    benchmark="optimizer_step",
    environment=_bench.environment(),
    dtype=dtype.name,
    leaves=len(shapes),
    parameters=n,
    analytic_min_bytes=analytic_min,
    rounds=args.rounds,
    donated=not args.no_donate,
    results=records,
  )
  _bench.write_outputs("optimizer_step", table, payload, args.json)


if __name__ == "__main__":
  main()
