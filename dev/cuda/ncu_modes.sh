#!/usr/bin/env bash
# Nsight Compute on one harness call per (version, shape, sizes) in $CASES ("op:version:shape:sizes"),
# with the clocks left alone (--clock-control none; METHOD.md): duration, SM clock, elapsed
# cycles, tensor-pipe activity, DRAM bytes read, L2 traffic and hit rate, condensed into
# $OUT/ncu-modes.txt. Answers "is a gap between two size patterns cycles or clock, and does it
# follow DRAM/L2 traffic?". Binaries from $BUILD (tests/gpu/build.sh). Example:
#   CASES="gmm:20:dsv3-gateup-ep8:uniform gmm:20:dsv3-gateup-ep8:ragged" dev/cuda/ncu_modes.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-/tmp/ncu-modes}
mkdir -p "$OUT"
f="$OUT/ncu-modes.txt"
for clock in ${CLOCKS:-none}; do
  for c in ${CASES:?}; do
    IFS=: read -r op v shape sizes <<<"$c"
    rep="/tmp/ncu-$op-$v-$shape-$sizes-$clock"
    HARNESS_NOCHECK=1 HARNESS_SHAPES=$shape HARNESS_MODES=$sizes HARNESS_REPS=1 \
      timeout 200 ncu --clock-control "$clock" --kernel-name regex:gmm_kernel --launch-skip 2 \
      --launch-count 1 --set full --metrics dram__bytes_read.sum,lts__t_bytes.sum,sm__cycles_elapsed.max \
      -f -o "$rep" "$BUILD/$op" "$v" >"$rep.log" 2>&1
    echo "== $c clock=$clock (ncu rc=$?)" >>"$f"
    ncu --import "$rep.ncu-rep" --print-details all 2>&1 |
      grep -E "^ +(Duration|Elapsed Cycles |Tensor \(All\)|L2 Hit Rate |dram__bytes_read.sum |lts__t_bytes.sum |SM Frequency)" |
      awk '{$1=$1; if (!seen[$0]++) print "  " $0}' >>"$f"
  done
done
cat "$f"
