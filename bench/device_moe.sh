#!/usr/bin/env bash
# One measurement session of the MoE layer and the training step on a machine with 2+ GPUs:
# bench_moe.py on one GPU and over all of them (EP = the GPU count, or EP_DEGREE), bench_train.sh tgs
# on one GPU (and with that EP when T_TGS2 > 0). On a one-GPU machine only the one-GPU parts run. Every phase runs under a time limit
# (T_* below, seconds) so the script ends within about 3.5 minutes. T_MOE_SMALL > 0 adds ragged_dot
# at a batch where it fits (MOE_SMALL_BATCH, default 1); CONV_STEPS > 0 adds a convergence phase
# (seed i of CONV_SEEDS on GPU i, its three paths at once; preset CONV_PRESET, default small).
# Results and logs go to $RESULTS (default $OUT, else bench/results/device-<date>): summary.txt,
# moe-{1gpu,ep<N>}.{jsonl,log}, tgs.md, runs.tgz (the run directories), convergence.{md,png,tgz}.
#
# It uses the GPU image's own flax and optax (flax 0.12.10 there; flax 0.12.8, the version pinned for
# jax 0.10.2, does not import under jax 0.11.2), and reads what was carried beside the tree (ignored
# by git), made on a machine with a network:
#   .carry/moe_data/   the corpus: python3 -m sluice.data --out .carry/moe_data/corpus.npz
#   .carry/moe_lib/    a CUDA build of libsluice.so: cmake -S . -B build-cuda -DSLUICE_NATIVE=OFF
#                      && cmake --build build-cuda && cp build-cuda/libsluice.so .carry/moe_lib/
# Where that library does not load, the script builds one there.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
res=${RESULTS:-${OUT:-bench/results/device-$(date -u +%Y%m%d-%H%M)}}
mkdir -p "$res"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1
log() { echo "[$(date -u +%T)] $*" | tee -a "$res/summary.txt"; }

export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$repo/python"
[ -f .carry/moe_lib/libsluice.so ] && export SLUICE_LIBRARY=$repo/.carry/moe_lib/libsluice.so
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$res/summary.txt"
versions="import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax',
optax.__version__, jax.devices()); import sluice; print('sluice has_cuda', sluice.has_cuda())"
if ! python3 -c "$versions" >>"$res/summary.txt" 2>&1; then
  # Without the library nothing imports (the MoE layer lives in the sluice package): build one.
  log "the carried libsluice.so does not load here: building one"
  unset SLUICE_LIBRARY
  (cmake -S . -B build-moe -DSLUICE_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release &&
    cmake --build build-moe -j32) >"$work/build.log" 2>&1 || log "build failed"
  python3 -c "$versions" >>"$res/summary.txt" 2>&1
fi

data=${DATA:-.carry/moe_data/corpus.npz}
moe_shape=(--preset "${MOE_PRESET:-dsv3-proxy}" --batch-size "${MOE_BATCH:-8}")
tgs_env=(DATA="$data" PRESET="${TGS_PRESET:-small}" STEPS="${TGS_STEPS:-15}")

ngpu=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
ep=${EP_DEGREE:-$ngpu} # phases B and C: expert parallelism over every GPU of the host (2, 4 or 8)
bench_moe_1gpu() {
  CUDA_VISIBLE_DEVICES=0 timeout "${T_MOE:-100}" python3 bench/bench_moe.py "${moe_shape[@]}" \
    --budget 4 --json "$res/moe-1gpu.jsonl" >"$res/moe-1gpu.log" 2>&1
  log "bench_moe, 1 GPU: rc=$?"
  # ragged_dot does not fit the full batch (XLA expands it to an M x G x K operand): compare it at
  # the largest batch where it fits.
  if [ "${T_MOE_SMALL:-0}" -gt 0 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout "$T_MOE_SMALL" python3 bench/bench_moe.py \
      --preset "${MOE_PRESET:-dsv3-proxy}" --batch-size "${MOE_SMALL_BATCH:-1}" --budget 3 \
      --variants dense-cf1.25,ragged_dot,sluice --json "$res/moe-1gpu.jsonl" \
      >>"$res/moe-1gpu.log" 2>&1
    log "bench_moe, 1 GPU, batch ${MOE_SMALL_BATCH:-1}: rc=$?"
  fi
}

# Convergence at equal steps: dropless (sluice) vs capacity 1.25 / 2.0, one seed per GPU, the three
# paths of a seed at once on its GPU (small models leave the GPU mostly idle; this is about loss at
# equal steps, not speed). Then the summary table and the loss plot.
convergence() {
  local dir=$work/conv gpu=0 seed name pids=()
  mkdir -p "$dir"
  local flags=(--preset "${CONV_PRESET:-small}" --steps "$CONV_STEPS" --log-every 10
    --eval-every $((CONV_STEPS / 8)) --eval-batches 16 --no-ckpt --no-progress --devices 1)
  [ -f "$data" ] && flags+=(--data "$data")
  for seed in ${CONV_SEEDS:-0 1}; do
    for name in dropless cf1.25 cf2.0; do
      case $name in
        dropless) impl=(--moe-impl sluice) ;;
        *) impl=(--moe-impl dense --capacity-factor "${name#cf}") ;;
      esac
      CUDA_VISIBLE_DEVICES=$((gpu % ngpu)) XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout "$T_CONV" python3 -m sluice.train "${flags[@]}" --seed "$seed" "${impl[@]}" \
        --out "$dir/$name-s$seed" >"$dir/$name-s$seed.log" 2>&1 &
      pids+=($!)
    done
    gpu=$((gpu + 1))
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$((rc + 1)); done
  log "convergence: $rc of ${#pids[@]} runs failed"
  python3 bench/summarize_train.py convergence "$dir" >/dev/null 2>&1
  local runs=() labels=()
  for seed in ${CONV_SEEDS:-0 1}; do
    for name in dropless cf1.25 cf2.0; do runs+=("$dir/$name-s$seed"); labels+=("$name s$seed"); done
  done
  python3 -m sluice.plot "${runs[@]}" --out "$res/convergence.png" \
    --labels "$(IFS=,; echo "${labels[*]}")" \
    --title "${CONV_PRESET:-small}: dropless (sluice) vs capacity factor 1.25 / 2.0" >/dev/null 2>&1
  cp "$dir/convergence.md" "$res/convergence.md" 2>/dev/null
  tar czf "$res/convergence.tgz" -C "$work" conv 2>/dev/null
}
tgs_1gpu() {
  CUDA_VISIBLE_DEVICES=$1 env "${tgs_env[@]}" timeout "${T_TGS:-110}" \
    bench/bench_train.sh tgs "$work/tgs" >"$work/tgs.log" 2>&1
  log "bench_train tgs, 1 GPU: rc=$?"
  [ -f "$work/tgs/tgs.md" ] || bench/bench_train.sh tgs-summary "$work/tgs" >>"$work/tgs.log" 2>&1
  cp "$work/tgs/tgs.md" "$res/tgs.md" 2>/dev/null
}
if [ "$ngpu" -ge 2 ]; then
  if [ "${SKIP_1GPU:-0}" != 1 ]; then # SKIP_1GPU=1: only the phases over several GPUs
    log "phase A: bench_moe on GPU 0 while the training step runs on GPU 1"
    bench_moe_1gpu &
    tgs_1gpu 1
    wait
  fi
  log "phase B: bench_moe, EP $ep"
  timeout "${T_EP:-70}" python3 bench/bench_moe.py "${moe_shape[@]}" --ep "$ep" --budget 3 \
    --variants dense-cf1.25,dense-cf2.0,sluice,sluice+a2a,ragged_dot \
    --json "$res/moe-ep$ep.jsonl" >"$res/moe-ep$ep.log" 2>&1
  log "bench_moe, EP $ep: rc=$?"
  if [ "${T_TGS2:-0}" -gt 0 ]; then
    log "phase C: the training step, EP $ep"
    env "${tgs_env[@]}" EP="$ep" IMPLS="${EP_IMPLS:-dense-cf1.25 sluice ragged_dot}" \
      timeout "$T_TGS2" bench/bench_train.sh tgs "$work/tgs-ep$ep" >"$work/tgs-ep$ep.log" 2>&1
    log "bench_train tgs, EP $ep: rc=$?"
    [ -f "$work/tgs-ep$ep/tgs.md" ] ||
      bench/bench_train.sh tgs-summary "$work/tgs-ep$ep" >>"$work/tgs-ep$ep.log" 2>&1
    { echo; cat "$work/tgs-ep$ep/tgs.md"; } >>"$res/tgs.md" 2>/dev/null
  fi
else
  log "phase A: one GPU: bench_moe, then the training step"
  bench_moe_1gpu
  tgs_1gpu 0
fi

if [ "${CONV_STEPS:-0}" -gt 0 ]; then
  log "phase D: convergence, ${CONV_STEPS} steps"
  T_CONV=${T_CONV:-240}
  convergence
fi

tar czf "$res/runs.tgz" -C "$work" --exclude conv . 2>/dev/null
{
  grep -h -A8 "MoE layer fwd+bwd" "$res"/moe-*.log
  cat "$res/tgs.md"
  cat "$res/convergence.md"
} 2>&1 | tee -a "$res/summary.txt"
