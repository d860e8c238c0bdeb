#!/usr/bin/env bash
# Session 43's tile-order A/B on one GPU in one call: the dev harness in turn on shapes that span
# tiles_n and K (SPECS="versions:shapes ...", OP=gmm or tgmm), then Nsight Compute (clocks left
# alone; NCU_CASES="version:shape ...", NCU_FULL=1 for the full set, NCU_METRICS for more) on
# uniform sizes: cycles, SM clock, L2 and DRAM bytes. Versions (dev/cuda/gmm.cu): 35 / 20 the
# default (gmm: by stride but the last two waves), 43 every tile by stride, 48 every tile claimed
# (gmm's order before session 43). For tgmm: OP=tgmm SPECS="25,43,48:<shapes>". The harness's
# correctness lines are kept only for a version that came out WRONG. Writes $OUT/order.txt and $OUT/z.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/order-out}
mkdir -p "$OUT"
export BUILD=${BUILD:-build-gpu}
DEV=1 tests/gpu/build.sh >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader; } >"$OUT/order.txt"
for spec in ${SPECS:-"35,48,43:qwen3-30b-up,qwen3-n3072,g32-n1536" "20,48,43:qwen3-k1024,dsv3proxy-gateup,dsv3proxy-down,fine512-gateup,fine512-down"}; do
  IFS=: read -r vers shapes <<<"$spec"
  for r in 1 2; do
    [ $r = 2 ] && vers=$(echo "$vers" | awk -F, '{for (i = NF; i > 0; --i) printf "%s%s", $i, (i > 1 ? "," : "")}')
    echo "== versions $vers shapes $shapes" >>"$OUT/order.txt"
    HARNESS_SHAPES=$shapes timeout 200 "$BUILD/${OP:-gmm}" "$vers" 2>&1 | grep -v "^version.*-> OK$" >>"$OUT/order.txt"
  done
done
if [ "${NCU:-1}" = 1 ]; then
  for c in ${NCU_CASES:-35:qwen3-30b-up 48:qwen3-30b-up 20:dsv3proxy-gateup 48:dsv3proxy-gateup}; do
    v=${c%%:*}; sh=${c#*:}
    timeout 120 ncu --clock-control none --kernel-name regex:gmm_kernel --launch-skip 2 --launch-count 1 \
      ${NCU_FULL:+--set full --import-source no} \
      --metrics gpc__cycles_elapsed.max,smsp__cycles_elapsed.avg.per_second,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum${NCU_METRICS:+,$NCU_METRICS} \
      env HARNESS_NOCHECK=1 HARNESS_REPS=1 HARNESS_SHAPES=$sh HARNESS_MODES=uniform "$BUILD/${OP:-gmm}" "$v" \
      >"$OUT/ncu-$v-$sh.txt" 2>&1
    { echo "== version $v $sh uniform"; grep -E "^ +(gpc__|smsp__|lts__|dram__|sm__pipe|gpu__time|L2 Fabric|L2 Hit|L1/TEX Hit)" "$OUT/ncu-$v-$sh.txt"; } >>"$OUT/order.txt"
  done
fi
cat "$OUT/order.txt"
tar czf "$OUT/z.tgz" -C "$OUT" $(cd "$OUT" && ls ncu-*.txt build.txt 2>/dev/null)
rm -f "$OUT"/ncu-*.txt "$OUT/build.txt"
