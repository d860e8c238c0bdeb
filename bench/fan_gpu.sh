#!/usr/bin/env bash
# The local fan kernels (csrc/cuda/ep_fan.cu: fan_out, fan_in, fan_in_bwd) on one GPU, in one device call:
#   1. bench/bench_fan.py: the library NEW against a second build OLD (when the file exists) and torch's
#      gather/sort equivalents, in turn; their outputs compared -> $OUT/fan.{md,json}
#   2. correctness with NEW: bench/run_ep_gpu.sh's capi (the C API against the references), sanitizer
#      (memcheck) and pytest (tests/gpu/test_ep_gpu.py: needs 2 GPUs) steps on one rank -> $OUT/ep/, and
#      tests/gpu/test_jax_gpu.py -k fan (the ops and their VJPs in f32, bf16, f16 through JAX)
#   3. train (PARTS): the one-GPU training step (bench/bench_train.sh tgs, PRESET dsv3-proxy, STEPS 40,
#      the sluice path) with each library, bench/ab_train.sh -> $OUT/train/ (PROFILE=N: and where each
#      step's device time went)
# PARTS picks the steps (default "bench checks"; "train" alone fits one 10-minute device call).
# NEW defaults to .carry/moe_lib/libsluice.so, OLD to .carry/fan_old/libsluice.so (both built elsewhere
# for sm_90a and carried: this script builds nothing). OUT defaults to bench/results/fan-<date>.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/fan-$(date -u +%Y%m%d)}
mkdir -p "$OUT"
NEW=${NEW:-.carry/moe_lib/libsluice.so}
OLD=${OLD:-.carry/fan_old/libsluice.so}
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 SLUICE_LIBRARY=$PWD/$NEW
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv
} >"$OUT/env.txt" 2>&1
libs=(--lib "new=$NEW")
[ -f "$OLD" ] && libs+=(--lib "old=$OLD")
want() { [[ " ${PARTS:-bench checks} " == *" $1 "* ]]; }
if want bench; then
  timeout 240 python3 bench/bench_fan.py "${libs[@]}" --md "$OUT/fan.md" --json "$OUT/fan.json" \
    >"$OUT/bench_fan.log" 2>&1
  echo "bench_fan rc=$?"
fi
if want checks; then
  OUT=$OUT/ep EP_RANKS=1 EP_STEPS="capi sanitizer pytest" timeout 300 bash bench/run_ep_gpu.sh \
    >"$OUT/ep.log" 2>&1
  echo "ep checks rc=$?"
  cat "$OUT/ep/summary.txt"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_jax_gpu.py -k fan \
    >"$OUT/test_jax_gpu_fan.log" 2>&1
  echo "JAX GPU fan tests rc=$?: $(tail -1 "$OUT/test_jax_gpu_fan.log")"
fi
if want train; then
  A_NAME=new A_LIB=$PWD/$NEW B_NAME=old B_LIB=$PWD/$OLD REPEAT=${REPEAT:-1} OUT=$OUT/train \
    bash bench/ab_train.sh
fi
cat "$OUT/fan.md" "$OUT"/train/summary.txt 2>/dev/null
