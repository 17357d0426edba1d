#!/usr/bin/env bash
# The optimizer-step benchmarks on a CUDA GPU, where lossscale's one
# formulation of the step (the same on every backend) is measured.
#
#   bash benchmarks/gpu.sh [PARAMS] [BASE_TREE]
#
# PARAMS (default 100e6) sizes the GPT-shaped tree; BASE_TREE, a folder
# holding the lossscale/ of the commit to compare against (`git archive
# c193e02 lossscale | tar -x -C BASE_TREE` beside the repository: a copy of
# the working tree has no git history), adds `compare.py` against it.
# Installs jax[cuda12] and the peers from pip when the current Python has no
# CUDA-enabled JAX (a peer that is missing, such as jmp on an offline GPU
# box, is reported as skipped). Writes the JSON and tables to $OUT when it
# is set (benchmarks/results/gpu otherwise). Budget: each step is bounded by
# `timeout`; about 10 minutes in all on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PARAMS="${1:-100e6}"
BASE_TREE="${2:-}"
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu}"
export OUT PYTHONUNBUFFERED=1
mkdir -p "$OUT"

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  echo "== installing jax[cuda12] and the peers"
  "$PY" -m pip install --quiet --upgrade "jax[cuda12]" optax chex flax jmp || echo "pip install failed (offline?): running with what is installed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # lossscale from this tree
"$PY" - <<'PY'
import jax, optax
print("backend:", jax.default_backend(), jax.devices(), "jax", jax.__version__, "optax", optax.__version__)
assert jax.default_backend() == "gpu", "no CUDA device visible to JAX"
PY

# Leave GPU memory to the benchmark's own buffers (14 copies of the state).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== the finite check alone, in the formulations tried"
timeout 120 "$PY" benchmarks/finite_check.py --rounds 30
echo "== optimizer step, ${PARAMS} parameters, float32 and bfloat16"
timeout 180 "$PY" benchmarks/optimizer_step.py --params "$PARAMS" --rounds 30 --json "$OUT/optimizer_step_float32.json"
timeout 120 "$PY" benchmarks/optimizer_step.py --params "$PARAMS" --rounds 30 --dtype bfloat16 \
  --only "lossscale: tx.update + apply_updates,lossscale.apply_gradients,optax.apply_if_finite" \
  --json "$OUT/optimizer_step_bfloat16.json"
# XLA:GPU reads each conditional's predicate back to the host: is the split
# step (about ten conditionals at 300 leaves) slower there than one? Rule:
# keep per backend what wins on that backend, in wall time.
echo "== the speed layer off (all of it; the split conditionals alone) against on"
timeout 300 "$PY" benchmarks/compare.py --plain '1;split' \
  --cases "float32:${PARAMS},bfloat16:${PARAMS}" --repeats 2 --rounds 30 \
  --json "$OUT/compare_plain.json" || echo "(some rows slower with the speed layer on: see above)"
if [ -n "$BASE_TREE" ]; then
  echo "== against the base in $BASE_TREE"
  timeout 240 "$PY" benchmarks/compare.py --base c193e02 --base-tree "$BASE_TREE" \
    --cases "float32:${PARAMS},bfloat16:${PARAMS}" --repeats 2 --rounds 30 \
    --json "$OUT/compare.json"
fi
echo "== results in $OUT"
ls -l "$OUT"
