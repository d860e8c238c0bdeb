#!/usr/bin/env bash
# What limits the grouped GEMMs (bench/clocks_gmm.py): clock, power and work per cycle under
# sustained load for sluice, torch._grouped_mm and cuBLAS, then Nsight Compute's tensor-pipe
# cycles of one call of each (clocks left alone). Library from $BUILD (tests/gpu/build.sh) unless
# it is missing; results into $RESULTS/clocks-<stamp>.md/json and ncu-clocks-<stamp>.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export BUILD=${BUILD:-build-gpu} PYTHONUNBUFFERED=1
RESULTS=${RESULTS:-bench/results}
stamp=${STAMP:-$(date -u +%Y%m%d)}
mkdir -p "$RESULTS"
[ -f "$BUILD/libsluice_gpu.so" ] || tests/gpu/build.sh || exit 1
nvidia-smi -q -d POWER,CLOCK,PERFORMANCE >"$RESULTS/smi-$stamp.txt" 2>&1
timeout 400 python3 bench/clocks_gmm.py --part sustained --zeros --lib "$BUILD/libsluice_gpu.so" \
  --out "$RESULTS/clocks-$stamp.json" ${CLOCKS_ARGS:-}
python3 bench/clocks_gmm.py --table "$RESULTS/clocks-$stamp.json" --md "$RESULTS/clocks-$stamp.md"
if command -v ncu >/dev/null && [ "${SKIP_NCU:-0}" != 1 ]; then
  timeout 400 ncu --clock-control none --nvtx --nvtx-include "prof/" --set full -f -o /tmp/clocks-prof \
    python3 bench/clocks_gmm.py --part ncu --shapes "${NCU_SHAPES:-dsv3-gateup-ep8,mixtral-up}" \
    --lib "$BUILD/libsluice_gpu.so" >/tmp/clocks-ncu.log 2>&1
  echo "ncu rc=$?"; tail -5 /tmp/clocks-ncu.log
  ncu --import /tmp/clocks-prof.ncu-rep --print-details all 2>&1 |
    grep -E "^  [A-Za-z_].*\(|Duration|SM Frequency|Tensor|Compute \(SM\) Throughput|DRAM Throughput|L2 Hit Rate  " \
    >"$RESULTS/ncu-clocks-$stamp.txt"
fi
