#!/usr/bin/env bash
# Sustained-load comparison of sm90 kernel variants (bench/clocks_gmm.py): for each "variant:impls"
# in $RUNS, one process with SLUICE_GMM_VARIANT=SLUICE_TGMM_VARIANT=variant runs the listed
# implementations back to back (clock, power, TFLOP/s); then, if $NCU_VARIANTS is set, Nsight
# Compute's DRAM and L2 bytes of one call per variant. The interleaved harness cannot show what
# this shows: a kernel's own power draw sets its clock only when it runs alone for a while.
#   RUNS="14:sluice_gmm,torch_grouped_mm 11:sluice_gmm" NCU_VARIANTS="14 11" dev/cuda/sustained.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
OUT=${OUT:-/tmp/sustained-out}
SHAPES=${SHAPES:-dsv3-gateup-ep8,dsv3-down-ep8,mixtral-up,qwen3-30b-up}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
i=0
for r in ${RUNS:?}; do
  v=${r%%:*} impls=${r#*:} i=$((i + 1))
  SLUICE_GMM_VARIANT=$v SLUICE_TGMM_VARIANT=$v timeout 300 python3 bench/clocks_gmm.py --part sustained \
    --lib "$BUILD/libsluice_gpu.so" --shapes "$SHAPES" --impls "$impls" --rounds "${ROUNDS:-1}" --dists "${DISTS:-uniform}" \
    --out "$OUT/sustained-$i-v$v.json" >/dev/null
  python3 bench/clocks_gmm.py --table "$OUT/sustained-$i-v$v.json" --md "$OUT/sustained-$i-v$v.md" | grep '^| [a-z]' |
    sed "s/^/v$v /"
done
for v in ${NCU_VARIANTS:-}; do
  SLUICE_GMM_VARIANT=$v SLUICE_TGMM_VARIANT=$v timeout 200 ncu --clock-control none --nvtx \
    --nvtx-include "prof/" --section SpeedOfLight --metrics dram__bytes_read.sum,lts__t_bytes.sum \
    -f -o "/tmp/ncu-v$v" python3 bench/clocks_gmm.py --part ncu --lib "$BUILD/libsluice_gpu.so" \
    --shapes "${NCU_SHAPES:-dsv3-gateup-ep8}" --impls sluice_gmm,sluice_tgmm >/dev/null 2>&1
  echo "ncu v$v rc=$?"
  ncu --import "/tmp/ncu-v$v.ncu-rep" --print-details all 2>&1 |
    grep -E "^  [A-Za-z_].*\(|^    (Duration|SM Frequency|dram__bytes|lts__t_bytes)" | cut -c1-90
done
