#!/usr/bin/env bash
# The one-GPU training step, measured in one device call. Two modes:
#   bench/profile_gpu.sh            each MoE path of $PRESET trains $STEPS steps, the $PROFILE after its
#                                   compiling step traced by jax.profiler (sluice-train --profile); the
#                                   summaries (device time by category and by kernel, per step) and the
#                                   TGS table of the same runs (bench/bench_train.sh tgs)
#   bench/profile_gpu.sh attention  the step's loss and speed with each attention implementation
#                                   (sluice-train --attention $ATTENTION, path $IMPL, same seed and data):
#                                   loss-<implementation>.txt
# Results to $OUT (default bench/results/profile-<date>).
#   PRESET (dsv3-proxy), IMPLS ("sluice dense-cf1.25"), STEPS (12; attention: 40), PROFILE (3),
#   IMPL (sluice), ATTENTION ("auto xla"), DATA (the corpus, default .carry/moe_data/corpus.npz)
# Uses the libsluice.so carried in .carry/moe_lib (SLUICE_LIBRARY) when it loads, else builds one.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-profile}
res=${OUT:-bench/results/profile-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$res"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -f .carry/moe_lib/libsluice.so ] && export SLUICE_LIBRARY=$PWD/.carry/moe_lib/libsluice.so
if ! python3 -c "import sluice, sys; sys.exit(0 if sluice.has_cuda() else 1)" 2>/dev/null; then
  unset SLUICE_LIBRARY
  (cmake -S . -B build-prof -DSLUICE_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release &&
    cmake --build build-prof -j"$(nproc)") >"$res/build.log" 2>&1 || echo "build failed" >&2
fi
work=$(mktemp -d)
data=${DATA:-.carry/moe_data/corpus.npz}
[ -f "$data" ] && export DATA=$data

if [ "$mode" = attention ]; then
  flags=(--preset "${PRESET:-dsv3-proxy}" --moe-impl "${IMPL:-sluice}" --steps "${STEPS:-40}"
    --log-every 5 --eval-every 0 --no-ckpt --no-progress)
  [ -f "$data" ] && flags+=(--data "$data")
  for att in ${ATTENTION:-auto xla}; do
    timeout "${T_RUN:-200}" python3 -m sluice.train "${flags[@]}" --attention "$att" \
      --out "$work/$att" >"$work/$att.log" 2>&1
    echo "attention=$att rc=$?"
    python3 - "$work/$att/metrics.jsonl" "$att" <<'PY' | tee "$res/loss-$att.txt"
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if r["kind"] == "train":
        print(f"{sys.argv[2]:>6} step {r['step']:>4} loss {r['loss']:.4f} grad_norm "
              f"{r['grad_norm']:.4f} tgs {r['tgs']:.0f} step_ms {1e3 * r['step_time']:.1f}")
PY
  done
  exit 0
fi

PRESET=${PRESET:-dsv3-proxy} STEPS=${STEPS:-12} PROFILE=${PROFILE:-3} \
  IMPLS="${IMPLS:-sluice dense-cf1.25}" bench/bench_train.sh tgs "$work"
cp "$work"/profile-*.txt "$work"/tgs.md "$res"/ 2>/dev/null
for f in "$work"/*.log; do tail -5 "$f" >"$res/$(basename "$f")"; done
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__)"
  cat "$res/tgs.md"
  for f in "$res"/profile-*.txt; do echo "== $f"; head -30 "$f"; done
} 2>&1 | tee "$res/summary.txt"
