#!/usr/bin/env bash
# The grouped-GEMM benchmark on one GPU: the kernels' resource usage, then the torch part (sluice
# through its C API, torch._grouped_mm, cuBLAS dense and batched; CUDA events, calls queued back to
# back) and the JAX part (jax.lax.ragged_dot, a second process), merged into $RESULTS/gmm-$STAMP.md
# and .json.
#   BUILD=dir      the tests/gpu/build.sh build to time (default build-gpu; built unless SKIP_BUILD=1)
#   BASELINE=dir   a second build (e.g. of main), timed in turn with BUILD in the same call: torch
#                  part BUILD, BASELINE, BASELINE, BUILD; bench/compare_gmm.py's table of the four
#                  runs in $RESULTS/gmm-ab-$STAMP.md
#   SHAPES=fine    tests/shapes.py's fine-grained set instead of the four benchmark shapes
#                  (small-groups: the sweep of rows per group; or a comma-separated list of names)
#   ITERS=n        timed runs per call (default 30)
#   TIMING=graph   each call replayed from a CUDA graph (bench_gmm.py's time_cuda; default queued)
#   SKIP_JAX=1     leaves out the JAX part (ragged_dot, and sluice inside jit)
#   RAGGED_DOT=0   the JAX part times sluice inside jit only
set -uo pipefail
cd "$(dirname "$0")/.."
export BUILD=${BUILD:-build-gpu}
RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -f "$BUILD/libsluice_gpu.so" ]; then
  tests/gpu/build.sh || exit 1
fi
stamp=${STAMP:-$(date -u +%Y%m%d)}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
shapes=()
[ -n "${SHAPES:-}" ] && shapes=(--shapes "$SHAPES")
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-resource-usage "$BUILD/libsluice_gpu.so" 2>&1 | grep -E "Function|REG" |
    paste - - | sed -E 's/ +/ /g' >"$RESULTS/resource-usage-$stamp.txt"
fi
torch_part() { # library dir, output json
  timeout 420 python3 bench/bench_gmm.py --part torch "${shapes[@]}" --timing "${TIMING:-queued}" \
    --iters "${ITERS:-30}" --lib "$1/libsluice_gpu.so" --out "$2"
}
torch_part "$BUILD" "$RESULTS/torch-part.json"
if [ -n "${BASELINE:-}" ]; then
  torch_part "$BASELINE" "$RESULTS/torch-part-base1.json"
  torch_part "$BASELINE" "$RESULTS/torch-part-base2.json"
  torch_part "$BUILD" "$RESULTS/torch-part-new2.json"
  python3 bench/compare_gmm.py --new "$RESULTS/torch-part.json" "$RESULTS/torch-part-new2.json" \
    --base "$RESULTS/torch-part-base1.json" "$RESULTS/torch-part-base2.json" --md "$RESULTS/gmm-ab-$stamp.md"
fi
if [ "${SKIP_JAX:-0}" != 1 ]; then
  # ragged_dot, and sluice inside jit where the CMake build of libsluice is found (build*/ or SLUICE_LIBRARY)
  PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} timeout 400 python3 bench/bench_gmm.py --part jax \
    "${shapes[@]}" $([ "${RAGGED_DOT:-1}" = 0 ] && echo --no-ragged-dot) --out "$RESULTS/jax-part.json"
fi
python3 bench/bench_gmm.py --merge "$RESULTS/torch-part.json" "$RESULTS/jax-part.json" \
  --md "$RESULTS/gmm-$stamp.md" --json "$RESULTS/gmm-$stamp.json"
