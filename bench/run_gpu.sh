#!/usr/bin/env bash
# Grouped GEMM benchmark on one GPU: build (tests/gpu/build.sh) unless SKIP_BUILD=1, then the torch
# part (sluice via ctypes, torch._grouped_mm, cuBLAS) and the JAX part (ragged_dot) in two processes,
# merged into $RESULTS/gmm-<date>.md/json, plus the kernels' resource usage.
set -uo pipefail
cd "$(dirname "$0")/.."
export BUILD=${BUILD:-build-gpu}
RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -f "$BUILD/libsluice_gpu.so" ]; then
  tests/gpu/build.sh || exit 1
fi
stamp=${STAMP:-$(date -u +%Y%m%d)} # STAMP names the result files (a second run on one day)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 600 python3 bench/bench_gmm.py --part torch --lib "$BUILD/libsluice_gpu.so" --out "$RESULTS/torch-part.json"
if [ "${SKIP_JAX:-0}" != 1 ]; then
  timeout 600 python3 bench/bench_gmm.py --part jax --out "$RESULTS/jax-part.json"
fi
python3 bench/bench_gmm.py --merge "$RESULTS/torch-part.json" "$RESULTS/jax-part.json" \
  --md "$RESULTS/gmm-$stamp.md" --json "$RESULTS/gmm-$stamp.json"
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-resource-usage "$BUILD/libsluice_gpu.so" 2>&1 | grep -E "Function|REG" |
    paste - - | sed -E 's/ +/ /g' >"$RESULTS/resource-usage-$stamp.txt"
  echo "HGMMA instructions in sm_90a code: $(cuobjdump -sass -arch sm_90a "$BUILD/libsluice_gpu.so" | grep -c HGMMA)" \
    >>"$RESULTS/resource-usage-$stamp.txt"
fi
