#!/usr/bin/env bash
# Grouped GEMM benchmark on one GPU: build (tests/gpu/build.sh) unless SKIP_BUILD=1, then the torch
# part (sluice via ctypes, torch._grouped_mm, cuBLAS) and the JAX part (ragged_dot) in two processes,
# merged into $RESULTS/gmm-<date>.md/json, then each implementation alone under sustained load
# ($RESULTS/sustained-<date>.md/json: clock, power, TFLOP/s), plus the kernels' resource usage.
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
# the kernels' resource usage first, so that it lands even when a timed part runs out of time
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-resource-usage "$BUILD/libsluice_gpu.so" 2>&1 | grep -E "Function|REG" |
    paste - - | sed -E 's/ +/ /g' >"$RESULTS/resource-usage-$stamp.txt"
  echo "HGMMA instructions in sm_90a code: $(cuobjdump -sass -arch sm_90a "$BUILD/libsluice_gpu.so" | grep -c HGMMA)" \
    >>"$RESULTS/resource-usage-$stamp.txt"
fi
timeout 600 python3 bench/bench_gmm.py --part torch --lib "$BUILD/libsluice_gpu.so" --out "$RESULTS/torch-part.json"
# SYNCED=1: the torch part again with each call waited for before the next (sessions 1-10's timing;
# the GPU idles between calls), merged into gmm-<date>-synced.md beside the default's file
if [ "${SYNCED:-0}" = 1 ]; then
  timeout 600 python3 bench/bench_gmm.py --part torch --timing synced --lib "$BUILD/libsluice_gpu.so" \
    --out "$RESULTS/torch-part-synced.json"
fi
# ORDER_AB=1: the torch part again with gmm's tiles all claimed in turn (SLUICE_GMM_TILE_ORDER=1,
# the order before session 43), merged into gmm-<date>-order1.md beside the default's file; then the
# default once more (torch-part-r2), so that the old order sits between two runs of the new
if [ "${ORDER_AB:-0}" = 1 ]; then
  SLUICE_GMM_TILE_ORDER=1 timeout 600 python3 bench/bench_gmm.py --part torch \
    --lib "$BUILD/libsluice_gpu.so" --out "$RESULTS/torch-part-order1.json"
  timeout 600 python3 bench/bench_gmm.py --part torch --lib "$BUILD/libsluice_gpu.so" \
    --out "$RESULTS/torch-part-r2.json"
fi
# REPEATS=N: the torch part N more times as it is (torch-part-rep2 ...), merged into
# gmm-<date>-rep2.md ..., so that one call gives the run-to-run spread of the ratios
for r in $(seq 2 $((${REPEATS:-0} + 1))); do # (seq 2 1: none)
  timeout 600 python3 bench/bench_gmm.py --part torch --lib "$BUILD/libsluice_gpu.so" \
    --out "$RESULTS/torch-part-rep$r.json"
done
if [ "${SKIP_JAX:-0}" != 1 ]; then
  timeout 600 python3 bench/bench_gmm.py --part jax --out "$RESULTS/jax-part.json"
fi
python3 bench/bench_gmm.py --merge "$RESULTS/torch-part.json" "$RESULTS/jax-part.json" \
  --md "$RESULTS/gmm-$stamp.md" --json "$RESULTS/gmm-$stamp.json"
if [ "${SYNCED:-0}" = 1 ]; then
  python3 bench/bench_gmm.py --merge "$RESULTS/torch-part-synced.json" "$RESULTS/jax-part.json" \
    --md "$RESULTS/gmm-$stamp-synced.md" --json "$RESULTS/gmm-$stamp-synced.json"
fi
if [ "${ORDER_AB:-0}" = 1 ]; then
  for part in order1 r2; do
    python3 bench/bench_gmm.py --merge "$RESULTS/torch-part-$part.json" "$RESULTS/jax-part.json" \
      --md "$RESULTS/gmm-$stamp-$part.md" --json "$RESULTS/gmm-$stamp-$part.json"
  done
fi
for r in $(seq 2 $((${REPEATS:-0} + 1))); do
  python3 bench/bench_gmm.py --merge "$RESULTS/torch-part-rep$r.json" "$RESULTS/jax-part.json" \
    --md "$RESULTS/gmm-$stamp-rep$r.md" --json "$RESULTS/gmm-$stamp-rep$r.json"
done
# The same implementations each alone and back to back (bench/clocks_gmm.py): the chip runs at its
# power cap, and a kernel's own power draw sets its clock only when it runs alone for a while.
if [ "${SKIP_SUSTAINED:-0}" != 1 ]; then
  timeout 400 python3 bench/clocks_gmm.py --part sustained --lib "$BUILD/libsluice_gpu.so" \
    --dists uniform,skewed --rounds 1 --out "$RESULTS/sustained-$stamp.json" >/dev/null
  python3 bench/clocks_gmm.py --table "$RESULTS/sustained-$stamp.json" --md "$RESULTS/sustained-$stamp.md"
fi
