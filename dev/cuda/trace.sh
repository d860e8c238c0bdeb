#!/usr/bin/env bash
# Cycle accounting of the sm90 kernels (dev/NOTES.md): builds the harnesses with
# -DSLUICE_SM90_TRACE (clock64 counters in the kernel, never in the library) unless $TRACE_BUILD
# already holds them, then runs each with its trace lines (per tile: head, waits, epilogue; the
# producer's and the fixers' waits) after every timed case. The timings of a trace build are
# perturbed by the counters; read its ratios to the default build's, not its TFLOP/s.
#   VERSIONS=20,25 HARNESS_SHAPES=dsv3 dev/cuda/trace.sh   -> $OUT/trace-{gmm,tgmm}.txt
# (without VERSIONS each harness times its default list)
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${TRACE_BUILD:-build-trace}
OUT=${OUT:-/tmp/trace-out}
mkdir -p "$B" "$OUT"
if [ ! -x "$B/tgmm" ] || [ ! -x "$B/gmm" ]; then
  NVCC="nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Iinclude -Icsrc/core"
  for f in status gmm_cpu; do gcc -O2 -fPIC -fopenmp -Iinclude -Icsrc/core -c csrc/core/$f.c -o "$B/$f.o"; done
  for h in gmm tgmm; do
    $NVCC -DSLUICE_SM90_TRACE -o "$B/$h" dev/cuda/$h.cu "$B/status.o" "$B/gmm_cpu.o" -lgomp &
  done
  wait
fi
export HARNESS_REPS=${HARNESS_REPS:-5}
for h in tgmm gmm; do
  timeout 240 "$B/$h" ${VERSIONS:+"$VERSIONS"} >"$OUT/trace-$h.txt" 2>&1
  echo "trace $h rc=$?"
done
