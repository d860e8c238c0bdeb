#!/usr/bin/env bash
# A/B of two builds of the harnesses in one call on the GPU machine, for a change that is not a
# variant (a tile order, a launch parameter): dev/cuda/ab.sh DIR_A DIR_B, each DIR holding `gmm`
# and `tgmm` built from the same harness source (`BUILD=DIR tests/gpu/build.sh` in each tree; each
# harness checks its versions against the CPU reference first). The builds run in turn A B B A per op, so neither always runs first (the
# power state drifts over a call); dev/cuda/ab_table.py reads the four outputs back as B/A.
# GMM_VERS / TGMM_VERS: the versions each harness times (default: the library's defaults, 35 / 25);
# HARNESS_SHAPES, HARNESS_MODES, HARNESS_REPS pass through. Output: $OUT/ab-<op>-<i>-<A|B>.txt.
set -uo pipefail
A=$1
B=$2
OUT=${OUT:-/tmp/ab-out}
mkdir -p "$OUT"
for op in gmm tgmm; do
  vers=$([ $op = gmm ] && echo "${GMM_VERS:-35}" || echo "${TGMM_VERS:-25}")
  i=0
  for side in A B B A; do
    i=$((i + 1))
    dir=$([ $side = A ] && echo "$A" || echo "$B")
    timeout 120 "$dir/$op" "$vers" >"$OUT/ab-$op-$i-$side.txt" 2>&1
    echo "$op run $i ($side, $dir): rc=$? $(tail -1 "$OUT/ab-$op-$i-$side.txt")"
  done
done
