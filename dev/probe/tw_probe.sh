#!/usr/bin/env bash
# The 192x256 tgmm probe (dev/probe/tw_probe.cu) on one GPU, in one call: two timing runs (the
# library's tgmm, the probe's 128x256 and 192x256 tiles, in turn, checked against the library),
# then each once under Nsight Compute (clocks left alone) on the shapes in $NCU_SHAPES, with the
# elapsed cycles and tensor-pipe activity condensed into $OUT/ncu-summary.txt.
# Binary from $B (built here when absent: nvcc 13, sm_90a).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tw-out}
B=${B:-build-sweep}
NCU_SHAPES=${NCU_SHAPES:-"g32-r1024-k7168-n4096 g32-r1024-k6912-n4096 g32-r1024-k2304-n7168 g128-r512-k2304-n1536"}
mkdir -p "$OUT" "$B"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader; } >"$OUT/device.txt"
if [ ! -x "$B/tw_probe" ]; then
  for f in status gmm_cpu; do gcc -O2 -fPIC -fopenmp -Iinclude -Icsrc/core -c csrc/core/$f.c -o $B/$f.o; done
  nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -Iinclude -Icsrc/core \
    dev/probe/tw_probe.cu $B/status.o $B/gmm_cpu.o -lgomp -lcuda -o $B/tw_probe >"$OUT/build.txt" 2>&1 ||
    { echo "build failed"; tail -30 "$OUT/build.txt"; exit 1; }
fi
for r in 1 2; do timeout 300 "$B/tw_probe" >"$OUT/timing-$r.txt" 2>&1; echo "timing $r rc=$?"; done
for s in $NCU_SHAPES; do
  for i in ${NCU_IMPLS:-0 1 2}; do
    TW_SHAPES=$s TW_IMPLS=$i TW_REPS=1 timeout 300 ncu --clock-control none \
      --kernel-name regex:"tw_kernel|gmm_kernel" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --print-details all \
      --metrics sm__cycles_elapsed.max "$B/tw_probe" >"$OUT/ncu-$s-$i.txt" 2>&1
    c=$(grep -E "sm__cycles_elapsed.max" "$OUT/ncu-$s-$i.txt" | awk '{print $NF}')
    tp=$(grep -E "Tensor \(All\)" "$OUT/ncu-$s-$i.txt" | head -1 | awk '{print $NF}')
    echo "$s impl $i: cycles $c tensor% $tp" >>"$OUT/ncu-summary.txt"
  done
done
cat "$OUT"/timing-*.txt "$OUT/ncu-summary.txt"
