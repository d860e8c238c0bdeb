#!/usr/bin/env bash
# Nsight Compute on single kernel calls of the harnesses (dev/NOTES.md): for each "op:version:shape:sizes"
# in $CASES, one call after 2 warm-ups, full section set, into $OUT/ncu-<op>-v<version>.txt (the
# sections as text) plus, if SOURCE=1, the per-SASS-instruction warp-stall samples as CSV, and
# one condensed block per case in $OUT/ncu-summary.txt: duration, SM clock, elapsed cycles,
# tensor-pipe activity, DRAM bytes read, L2 traffic and hit rate (is a gap between two cases
# cycles or clock, and does it follow the data movement?). Clocks left alone (METHOD.md).
# Binaries from $BUILD (tests/gpu/build.sh). Example:
#   CASES="gmm:35:dsv3-gateup-ep8:uniform tgmm:25:dsv3-gateup-ep8:uniform" dev/cuda/profile.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-/tmp/profile-out}
mkdir -p "$OUT"
for c in ${CASES:?}; do
  IFS=: read -r op v shape sizes <<<"$c"
  name="ncu-$op-v$v-$shape-$sizes"
  HARNESS_NOCHECK=1 HARNESS_SHAPES=$shape HARNESS_MODES=$sizes HARNESS_REPS=1 \
    timeout 300 ncu --clock-control none --kernel-name regex:gmm_kernel --launch-skip 2 --launch-count 1 --set full \
    --metrics dram__bytes_read.sum,lts__t_bytes.sum --import-source no -f -o "/tmp/$name" "$BUILD/$op" "$v" >"/tmp/$name.log" 2>&1
  echo "$c: ncu rc=$?"
  ncu --import "/tmp/$name.ncu-rep" --print-details all >"$OUT/$name.txt" 2>&1
  echo "== $c" >>"$OUT/ncu-summary.txt"
  grep -E "^ +(Duration|Elapsed Cycles |Tensor \(All\)|L2 Hit Rate |dram__bytes_read.sum |lts__t_bytes.sum |SM Frequency|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput)" \
    "$OUT/$name.txt" | awk '{$1=$1; if (!seen[$0]++) print "  " $0}' >>"$OUT/ncu-summary.txt"
  if [ "${SOURCE:-0}" = 1 ]; then
    ncu --import "/tmp/$name.ncu-rep" --page source --print-source sass --csv >"$OUT/$name-sass.csv" 2>&1
  fi
done
