#!/usr/bin/env bash
# Expert parallelism over every GPU of one host, in one call (issue 6's run at 8 GPUs; 2 and 4 work the
# same): the sluice.ep suite and benchmark (bench/run_ep_gpu.sh: checks on every transport, one process
# and one process per GPU, dispatch/combine against NCCL's all-to-all and ragged_all_to_all), then the
# DeepSeek-V3-shaped proxy training step at EP = the GPU count for dense cf1.25, ragged_dot and sluice
# (TGS, MFU, peak memory per GPU). Each part has a time limit so the call ends inside the device tool's
# 10 minutes; PARTS="ep tgs" picks parts.
#
#   SLUICE_LIBRARY=$PWD/.carry/moe_lib/libsluice.so OUT=/tmp/out bash bench/run_ep_scale.sh
#
# Needs what bench/device_moe.sh needs beside the tree: .carry/moe_data/corpus.npz (the corpus) and a
# CUDA build of libsluice.so (SLUICE_LIBRARY; without it run_ep_gpu.sh builds the ep part only, and the
# training step then lacks sluice.gmm). The sluice run bounds its expert block to ROWS_FACTOR (default 2)
# times the balanced mean (--ep-rows-factor): the unbounded worst case is 8x the mean at 8 ranks.
# XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.95 here (the EP 2 and EP 4 runs needed more than 75%).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/ep-scale-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
R=$(nvidia-smi -L | grep -c GPU)
echo "GPUs: $R" | tee "$OUT/summary.txt"
want() { [[ " ${PARTS:-ep tgs} " == *" $1 "* ]]; }
if want ep; then
  OUT=$OUT/ep timeout "${T_EP:-330}" bash bench/run_ep_gpu.sh >"$OUT/ep-run.log" 2>&1
  echo "ep suite rc=$?" | tee -a "$OUT/summary.txt"
  cat "$OUT/ep/summary.txt" >>"$OUT/summary.txt" 2>/dev/null
fi
if want tgs; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
  tgs=(PRESET="dsv3-proxy-ep$R" EP="$R" STEPS="${STEPS:-10}" DATA=.carry/moe_data/corpus.npz)
  # one run per path, each under its own limit; --eval-batches 1: the batch grows with R
  for impl in ${IMPLS:-sluice dense-cf1.25 ragged_dot}; do
    extra="--eval-batches 1"
    [ "$impl" = sluice ] && extra="$extra --ep-rows-factor ${ROWS_FACTOR:-2}"
    env "${tgs[@]}" IMPLS="$impl" EXTRA="$extra" timeout "${T_TGS:-150}" \
      bash bench/bench_train.sh tgs "$OUT/tgs" >>"$OUT/tgs.log" 2>&1
    echo "tgs $impl rc=$?" | tee -a "$OUT/summary.txt"
  done
  bash bench/bench_train.sh tgs-summary "$OUT/tgs" >>"$OUT/tgs.log" 2>&1
  cat "$OUT/tgs/tgs.md" >>"$OUT/summary.txt" 2>/dev/null
fi
cat "$OUT/summary.txt"
cat "$OUT/ep/ep.md" 2>/dev/null
