#!/usr/bin/env bash
# The FP8 benchmark on one GPU (bench/bench_fp8.py): sluice's FP8 gmm/tgmm beside its BF16 kernels,
# torch._scaled_grouped_mm, dense FP8 cuBLAS (torch._scaled_mm) and torch._grouped_mm on the four
# benchmark shapes and DeepGEMM's grouped shapes, uniform and skewed; then the quantization kernel.
# The SM clock and board power are sampled while it runs. Writes $RESULTS/gmm-fp8-$STAMP.md/.json.
#   BUILD=dir     the tests/gpu/build.sh build to time (default build-gpu; built unless SKIP_BUILD=1)
#   SHAPES=list   bench_fp8.py --shapes (default bench,deepgemm)
set -uo pipefail
cd "$(dirname "$0")/.."
export BUILD=${BUILD:-build-gpu}
RESULTS=${RESULTS:-bench/results}
mkdir -p "$RESULTS"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -f "$BUILD/libsluice_gpu.so" ]; then
  tests/gpu/build.sh || exit 1
fi
stamp=${STAMP:-$(date -u +%Y%m%d)}
clocks=$(mktemp)
nvidia-smi --query-gpu=clocks.sm,power.draw,power.limit --format=csv,noheader,nounits -lms 100 \
  >"$clocks" 2>/dev/null &
smi=$!
timeout 500 python3 bench/bench_fp8.py --lib "$BUILD/libsluice_gpu.so" \
  --shapes "${SHAPES:-bench,deepgemm}" --out "$RESULTS/gmm-fp8-$stamp.json"
rc=$?
kill $smi 2>/dev/null
# the samples taken under load (power above a third of the limit): median clock and power
load=$(awk -F', ' '$2 > $3 / 3' "$clocks")
n=$(printf '%s\n' "$load" | grep -c .)
clock=""
if [ "$n" -gt 0 ]; then
  mid=$(( (n + 1) / 2 ))
  c=$(printf '%s\n' "$load" | cut -d, -f1 | sort -n | sed -n "${mid}p")
  p=$(printf '%s\n' "$load" | cut -d, -f2 | sort -n | sed -n "${mid}p")
  lim=$(printf '%s\n' "$load" | head -1 | cut -d, -f3)
  clock="median SM clock $c MHz, median power ${p# } W of ${lim# } W ($n samples at 100 ms under load)"
fi
rm -f "$clocks"
[ $rc = 0 ] || exit $rc
python3 bench/bench_fp8.py --merge "$RESULTS/gmm-fp8-$stamp.json" --clock "$clock" \
  --md "$RESULTS/gmm-fp8-$stamp.md"
