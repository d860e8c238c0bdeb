#!/usr/bin/env bash
# The training step of the DeepSeek-V3-shaped proxy at EP = every GPU of the host (dsv3-proxy-ep<R>;
# dsv3-proxy on one GPU), one run per MoE path (bench/bench_train.sh tgs, each under its own time
# limit): tokens/s per GPU, MFU, peak memory per GPU, copies dropped. Table in $OUT/tgs.md.
#
#   SLUICE_LIBRARY=build/libsluice.so DATA=corpus.npz OUT=/tmp/train bash bench/run_train_gpu.sh
#   IMPLS="dense-cf1.25 sluice"   the paths (bench_train.sh's names; default these two)
#   STEPS=10 T_RUN=150            steps per run, seconds per run
#   BASELINE=dir                  a second tree (its python/ and bench/, its library dir/libsluice.so):
#                                 the sluice path runs with it too, in turn (new, baseline, new):
#                                 $OUT/tgs-base.md
#   PRESET=dsv3-ep4               another model preset (e.g. DeepSeek-V3's layer widths at EP 4)
#   EXTRA="--opt-state-dtype bfloat16"   more sluice-train flags for every run
# DATA: the corpus (sluice-prepare-data --out corpus.npz), made where the Debian docs are installed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/train-gpu}
mkdir -p "$OUT"
: "${SLUICE_LIBRARY:?a CUDA build of libsluice.so}" "${DATA:?the corpus (sluice-prepare-data --out corpus.npz)}"
export SLUICE_LIBRARY=$(realpath "$SLUICE_LIBRARY") DATA=$(realpath "$DATA")
R=$(nvidia-smi -L | grep -c GPU)
preset=dsv3-proxy
[ "$R" -gt 1 ] && preset=dsv3-proxy-ep$R
preset=${PRESET:-$preset}
export PRESET=$preset EP=$R STEPS=${STEPS:-10}
echo "GPUs: $R, preset $preset, $STEPS steps a run" | tee "$OUT/summary.txt"
run() { # tree, output dir, path
  local tree=$1 dir=$2 impl=$3 lib=$SLUICE_LIBRARY
  [ "$tree" != . ] && lib=$(realpath "$tree/libsluice.so")
  SLUICE_LIBRARY=$lib PYTHONPATH=$(realpath "$tree/python") IMPLS=$impl EXTRA="--eval-batches 1 ${EXTRA:-}" \
    timeout "${T_RUN:-150}" bash "$tree/bench/bench_train.sh" tgs "$dir" >>"$OUT/train.log" 2>&1
  echo "$impl in $dir: rc=$?" | tee -a "$OUT/summary.txt"
}
for impl in ${IMPLS:-dense-cf1.25 sluice}; do run . "$OUT/tgs" "$impl"; done
if [ -n "${BASELINE:-}" ]; then
  run "$BASELINE" "$OUT/tgs-base" sluice
  run . "$OUT/tgs-new2" sluice
  python3 bench/summarize_train.py tgs "$OUT/tgs-base" >>"$OUT/train.log" 2>&1
  python3 bench/summarize_train.py tgs "$OUT/tgs-new2" >>"$OUT/train.log" 2>&1
fi
python3 bench/summarize_train.py tgs "$OUT/tgs" >>"$OUT/train.log" 2>&1
for d in tgs tgs-base tgs-new2; do
  if [ -f "$OUT/$d/tgs.md" ]; then { echo "== $d"; cat "$OUT/$d/tgs.md"; } | tee -a "$OUT/summary.txt"; fi
done
