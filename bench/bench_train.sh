#!/usr/bin/env bash
# Whole-model training benchmarks of the three MoE paths, with sluice-train on the real corpus.
#
#   bench/bench_train.sh tgs [OUT]           each path for $STEPS steps of $PRESET: TGS, MFU, memory
#   bench/bench_train.sh tgs-summary OUT     the table of a tgs run that was cut short
#   bench/bench_train.sh convergence [OUT]   dropless vs capacity factor 1.25 vs 2.0 at equal steps,
#                                            for each seed: validation loss table and loss plots
#
# Environment:
#   PRESET    tgs: small, convergence: tiny
#   STEPS     tgs: 30, convergence: 400
#   IMPLS     tgs: the paths (default 'dense-cf1.25 dense-cf2.0 ragged_dot sluice'); a path's name
#             ending in -remat adds --remat (sluice-remat: the sluice path, blocks recomputed), one
#             ending in -fp8 adds --fp8 (sluice-fp8: the sluice path, linear layers in FP8)
#   DROPLESS  convergence: the dropless path, sluice (default) or ragged_dot
#   SEEDS     convergence: the seeds (default '0 1')
#   NAMES     convergence: the paths (default 'dropless cf1.25 cf2.0'): dropless, fp8 (dropless
#             with --fp8), nodrop, or cfX for the dense path at capacity factor X
#   SIDE_BY_SIDE  convergence: 1 runs the runs (seed by seed, each seed's paths in turn) on $GPUS
#             GPUs at once, run j on GPU j mod GPUS (CUDA_VISIBLE_DEVICES), each GPU's in turn; GPUS
#             defaults to the number of paths: path i on GPU i (default 0: one run at a time)
#   CONTROL   convergence: 1 adds 'nodrop', the dense path with a capacity that drops nothing (the
#             same model as dropless computed another way: the spread between the two is the noise)
#   PROFILE   tgs: N > 0 also traces N steps of each path after its compiling step (sluice-train
#             --profile; left out of its TGS) and copies where their device time went to
#             OUT/profile-<path>.txt (the traces stay in OUT/<path>/profile); PROFILE_FROM=S traces
#             from step S instead (a balanced router)
#   FROM_STEP tgs: the figures from the logged windows past this step only (a router balanced by then;
#             the first steps from initialisation are the least balanced)
#   EP        expert-parallel degree (default 1); DEVICES: use the first N devices
#   DATA      a token file from sluice-prepare-data (default: the installed Python docs)
#   EXTRA     more sluice-train flags; PY: the python (default python3)
# Results land in OUT (default bench/results/train-<mode>-<date>): one sluice-train run directory
# per path, a summary table (.md) and the same figures as JSON (bench/summarize_train.py). A
# convergence run that already finished in OUT is not run again.
set -euo pipefail
mode=${1:?usage: bench_train.sh tgs|tgs-summary|convergence [OUT]}
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
out=${2:-$repo/bench/results/train-$mode-$(date -u +%Y%m%d-%H%M)}
py=${PY:-python3}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$repo/python"  # a PYTHONPATH given first wins
mkdir -p "$out"
common=(--no-progress --overwrite --ep "${EP:-1}")  # a path's run directory is made again
[[ -n "${DEVICES:-}" ]] && common+=(--devices "$DEVICES")
[[ -n "${DATA:-}" ]] && common+=(--data "$DATA")
# shellcheck disable=SC2206
[[ -n "${EXTRA:-}" ]] && common+=($EXTRA)

# run NAME FLAGS...: one sluice-train run into $out/NAME; a failure (out of memory, say) is recorded
# in $out/NAME.log and the other runs go on.
run() {
  local name=$1
  shift
  echo "== $name: sluice-train $*" >&2
  if ! "$py" -m sluice.cli.train "$@" "${common[@]}" --out "$out/$name" >"$out/$name.log" 2>&1; then
    echo "   failed, see $out/$name.log" >&2
    tail -3 "$out/$name.log" >&2 || true
  fi
}

finished() {  # NAME STEPS: the run's last evaluation was at step STEPS
  grep -q "\"kind\": \"eval\", \"step\": $2," "$out/$1/metrics.jsonl" 2>/dev/null
}

case $mode in
tgs)
  flags=(--preset "${PRESET:-small}" --steps "${STEPS:-30}" --log-every 5 --eval-every 0 --no-ckpt)
  [[ "${PROFILE:-0}" -gt 0 ]] && flags+=(--profile "$PROFILE" --profile-from "${PROFILE_FROM:-0}")
  for name in ${IMPLS:-dense-cf1.25 dense-cf2.0 ragged_dot sluice}; do
    case $name in
      dense-cf*) run "$name" "${flags[@]}" --moe-impl dense --capacity-factor "${name#dense-cf}" ;;
      *-remat) run "$name" "${flags[@]}" --moe-impl "${name%-remat}" --remat ;;
      *-fp8) run "$name" "${flags[@]}" --moe-impl "${name%-fp8}" --fp8 ;;
      *) run "$name" "${flags[@]}" --moe-impl "$name" ;;
    esac
    cp "$out/$name/profile/summary.txt" "$out/profile-$name.txt" 2>/dev/null || true
  done
  "$py" "$here/summarize_train.py" tgs "$out"
  ;;
tgs-summary)
  "$py" "$here/summarize_train.py" tgs "$out"
  ;;
convergence)
  preset=${PRESET:-tiny}
  steps=${STEPS:-400}
  flags=(--preset "$preset" --steps "$steps" --log-every 10 --eval-every $((steps / 8))
    --eval-batches 16 --no-ckpt)
  # shellcheck disable=SC2206
  names=(${NAMES:-dropless cf1.25 cf2.0})
  [[ "${CONTROL:-0}" == 1 ]] && names+=(nodrop)
  # shellcheck disable=SC2206
  seeds=(${SEEDS:-0 1})
  run_one() {  # NAME SEED
    finished "$1-s$2" "$steps" && return 0
    case $1 in
      dropless) impl=(--moe-impl "${DROPLESS:-sluice}") ;;
      fp8) impl=(--moe-impl sluice --fp8) ;;
      nodrop) impl=(--moe-impl dense --capacity-factor 1000) ;;
      *) impl=(--moe-impl dense --capacity-factor "${1#cf}") ;;
    esac
    run "$1-s$2" "${flags[@]}" --seed "$2" "${impl[@]}"
  }
  if [[ "${SIDE_BY_SIDE:-0}" == 1 ]]; then  # run j on GPU j mod GPUS, all GPUs at once
    gpus=${GPUS:-${#names[@]}}
    pids=()
    for ((g = 0; g < gpus; g++)); do
      (
        export CUDA_VISIBLE_DEVICES=$g
        j=0
        for seed in "${seeds[@]}"; do
          for name in "${names[@]}"; do
            if ((j % gpus == g)); then run_one "$name" "$seed"; fi
            j=$((j + 1))
          done
        done
      ) &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
  else  # one run at a time, seed by seed: a time limit cuts every path alike
    for seed in "${seeds[@]}"; do
      for name in "${names[@]}"; do run_one "$name" "$seed"; done
    done
  fi
  runs=()
  labels=()
  for seed in "${seeds[@]}"; do
    for name in "${names[@]}"; do
      runs+=("$out/$name-s$seed")
      labels+=("$name s$seed")
    done
  done
  labels_csv=$(IFS=,; echo "${labels[*]}")
  "$py" -m sluice.cli.plot "${runs[@]}" --out "$out/loss.png" --labels "$labels_csv" \
    --title "$preset: ${names[*]} (dropless: ${DROPLESS:-sluice}), $steps steps"
  "$py" "$here/summarize_train.py" convergence "$out"
  ;;
*)
  echo "unknown mode $mode (tgs, tgs-summary or convergence)" >&2
  exit 2
  ;;
esac
