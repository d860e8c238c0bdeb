#!/usr/bin/env bash
# Harness only, both ops, in one device call (a first look at new variants before the full
# dev/cuda/device_sweep.sh): build unless SKIP_BUILD=1 and $BUILD holds the binaries, then
#   $BUILD/gmm  "$GMM_VERSIONS"   -> $OUT/harness-gmm.txt
#   $BUILD/tgmm "$TGMM_VERSIONS"  -> $OUT/harness-tgmm.txt
# (every version checked against the CPU reference first; the first listed is the reference of
# the "vs first" column), plus nvidia-smi before and after, each run under a 120 s limit.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/harness-out}
mkdir -p "$OUT"
export BUILD=${BUILD:-build-gpu}
if [ "${SKIP_BUILD:-0}" = 1 ] && [ -x "$BUILD/gmm" ] && [ -x "$BUILD/tgmm" ]; then
  echo "using the binaries in $BUILD"
else
  tests/gpu/build.sh >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
q="name,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active"
nvidia-smi --query-gpu=$q --format=csv >"$OUT/smi.txt" 2>&1
timeout 120 "$BUILD/gmm" "${GMM_VERSIONS:-20,16}" >"$OUT/harness-gmm.txt" 2>&1
echo "gmm rc=$?" >>"$OUT/harness-gmm.txt"
timeout 120 "$BUILD/tgmm" "${TGMM_VERSIONS:-20,16}" >"$OUT/harness-tgmm.txt" 2>&1
echo "tgmm rc=$?" >>"$OUT/harness-tgmm.txt"
nvidia-smi --query-gpu=$q --format=csv,noheader >>"$OUT/smi.txt" 2>&1
cat "$OUT/harness-gmm.txt" "$OUT/harness-tgmm.txt" "$OUT/smi.txt"
