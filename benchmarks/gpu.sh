#!/usr/bin/env bash
# Runs the optimizer-step comparison (and the float16 train step) on a CUDA GPU.
#
#   bash benchmarks/gpu.sh [PARAMS]        # PARAMS defaults to 100e6
#
# Installs jax[cuda12] and the peers from pip when the current Python has no
# CUDA-enabled JAX (a peer that is missing, such as jmp on an offline GPU box,
# is reported as skipped), then runs benchmarks/optimizer_step.py with --params and
# benchmarks/train_step.py. Writes optimizer_step.{json,md} and
# train_step.{json,md} to $OUT when it is set (benchmarks/results/ otherwise).
# Budget: about 1-2 minutes of installs, well under a minute of compiling and
# timing at 100M parameters on a recent GPU; the whole script stays under 5
# minutes (each step is bounded by `timeout`).
set -euo pipefail
cd "$(dirname "$0")/.."
PARAMS="${1:-100e6}"
PY="${PYTHON:-python3}"
OUT="${OUT:-benchmarks/results/gpu}"
export OUT
mkdir -p "$OUT"

if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  echo "== installing jax[cuda12] and the peers"
  "$PY" -m pip install --quiet --upgrade "jax[cuda12]" optax chex flax jmp || echo "pip install failed (offline?): running with what is installed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # lossscale from this tree
"$PY" - <<'PY'
import jax
print("backend:", jax.default_backend(), jax.devices())
assert jax.default_backend() == "gpu", "no CUDA device visible to JAX"
PY

# Leave GPU memory to the benchmark's own buffers (14 copies of the state).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== optimizer step, ${PARAMS} parameters"
timeout 180 "$PY" benchmarks/optimizer_step.py --params "$PARAMS" --rounds 30
echo "== float16 train step"
timeout 60 "$PY" benchmarks/train_step.py --width 2048 --depth 8 --batch 1024 --rounds 30
echo "== results in $OUT"
ls -l "$OUT"
