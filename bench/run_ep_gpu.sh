#!/usr/bin/env bash
# The sluice.ep benchmark over every GPU of one host, DeepEP's workload (bench/bench_ep.py): dispatch and
# combine through the C API per transport (CUDA events, a sweep of SM counts), inside jit(shard_map)
# against XLA's NCCL all-to-all of the same rows and ragged_all_to_all, and in one process per GPU.
# The checks of the same code are scripts/test_gpu.sh's "ep" part.
#
#   SLUICE_LIBRARY=build/libsluice.so OUT=/tmp/ep bash bench/run_ep_gpu.sh
#   PARTS="capi jax mp"   a subset (default: all three)
#   BASELINE=dir          a second tree (its python/ and bench/; its library in dir/libsluice.so), whose
#                         jit part runs in turn with this one's: new, baseline, baseline, new
# Results: $OUT/ep-*.json and $OUT/ep.md; a one-line status per step in $OUT/summary.txt, the output
# of every step in $OUT/log.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep-bench}
mkdir -p "$OUT"
LOG=$OUT/log.txt
: >"$LOG"
: >"$OUT/summary.txt"
export PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
: "${SLUICE_LIBRARY:?a CUDA build of libsluice.so (cmake -B build ...; SLUICE_LIBRARY=build/libsluice.so)}"
export SLUICE_LIBRARY=$(realpath "$SLUICE_LIBRARY")
step() {
  local name=$1 start=$SECONDS rc
  shift
  echo "===== $name: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
}
want() { [[ " ${PARTS:-capi jax mp} " == *" $1 "* ]]; }
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >>"$LOG" 2>&1
R=${EP_RANKS:-$(nvidia-smi -L | wc -l)}
echo "ranks: $R" | tee -a "$OUT/summary.txt"
new=(env PYTHONPATH="$PWD/python" python3 bench/bench_ep.py)
[ -n "${BASELINE:-}" ] && base=(env PYTHONPATH="$BASELINE/python" SLUICE_LIBRARY="$(realpath "$BASELINE/libsluice.so")"
  python3 "$BASELINE/bench/bench_ep.py")
jax_args=(--part jax --ranks "$R" --sms 64 --reps 5)
if want jax; then
  step jax timeout 200 "${new[@]}" "${jax_args[@]}" --out "$OUT/ep-jax.json"
  if [ -n "${BASELINE:-}" ]; then
    step jax-base1 timeout 200 "${base[@]}" "${jax_args[@]}" --out "$OUT/ep-jax-base1.json"
    step jax-base2 timeout 200 "${base[@]}" "${jax_args[@]}" --out "$OUT/ep-jax-base2.json"
    step jax-new2 timeout 200 "${new[@]}" "${jax_args[@]}" --out "$OUT/ep-jax-new2.json"
  fi
fi
want capi && step capi timeout 150 "${new[@]}" --part capi --ranks "$R" --sms 20 24 32 64 \
  --transports peer ipc nccl --transport-sms 64 --out "$OUT/ep-capi.json"
want mp && step mp timeout 240 "${new[@]}" --part mp --ranks "$R" --sms 64 --reps 5 --unroll 6 \
  --mp-timeout 110 --out "$OUT/ep-mp.json"
"${new[@]}" --report "$OUT"/ep-capi.json "$OUT"/ep-jax.json "$OUT"/ep-mp.json --md "$OUT/ep.md" >>"$LOG" 2>&1
for f in "$OUT"/ep-jax-*.json; do
  [ -f "$f" ] && "${new[@]}" --report "$f" --md "${f%.json}.md" >>"$LOG" 2>&1
done
cat "$OUT/summary.txt"
cat "$OUT/ep.md" 2>/dev/null
