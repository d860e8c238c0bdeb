#!/usr/bin/env bash
# Where a training step's time goes on one GPU (one device call): each MoE path of $PRESET trains
# $STEPS steps, the $PROFILE after its compiling step traced by jax.profiler (sluice-train --profile),
# and the summaries (device time by category and by op, per step) land in $OUT (default
# bench/results/profile-<date>) with the TGS table of the same runs (bench/bench_train.sh tgs).
#   PRESET (dsv3-proxy), IMPLS ("sluice dense-cf1.25"), STEPS (12), PROFILE (3), DATA (the corpus)
# Uses the libsluice.so carried in .carry/moe_lib (SLUICE_LIBRARY) when it loads, else builds one.
set -uo pipefail
cd "$(dirname "$0")/.."
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
