#!/usr/bin/env bash
# The training step of two builds side by side on one machine: the sluice path of $PRESET (default
# dsv3-proxy) for $STEPS steps (default 40) with build A, then B, $REPEAT times (default 2), alternating.
# A build is a libsluice.so (A_LIB, B_LIB; default: SLUICE_LIBRARY or .carry/moe_lib/libsluice.so) and a
# Python tree put first on PYTHONPATH (A_PY, B_PY; default: this checkout's python/), with more
# sluice-train flags for each (A_EXTRA, B_EXTRA, e.g. "--opt-state-dtype bfloat16"). PROFILE=N also
# traces N steps of each run (sluice-profile's summary beside its table). Results in $OUT (default
# bench/results/ab-train-<date>): <A_NAME|B_NAME>-<i>.md, profile-<name>-<i>.txt, and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/ab-train-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
lib=${SLUICE_LIBRARY:-$PWD/.carry/moe_lib/libsluice.so}
data=.carry/moe_data/corpus.npz
[ -f "$data" ] && export DATA=$PWD/$data
for i in $(seq "${REPEAT:-2}"); do
  for side in A B; do
    name_var=${side}_NAME lib_var=${side}_LIB py_var=${side}_PY extra_var=${side}_EXTRA
    name=${!name_var:-$side} l=${!lib_var:-$lib} py=${!py_var:-$PWD/python} extra=${!extra_var:-}
    [ -f "$l" ] || { echo "$name: no library at $l"; continue; }
    work=$(mktemp -d)
    EXTRA=$extra PYTHONPATH=$py SLUICE_LIBRARY=$l PRESET=${PRESET:-dsv3-proxy} STEPS=${STEPS:-40} IMPLS=sluice \
      timeout "${T_RUN:-240}" bench/bench_train.sh tgs "$work" >"$OUT/$name-$i.log" 2>&1
    echo "$name run $i rc=$?: $(grep -h '^| sluice' "$work"/*.md 2>/dev/null)" | tee -a "$OUT/summary.txt"
    cp "$work"/*.md "$OUT/$name-$i.md" 2>/dev/null
    cp "$work"/profile-sluice.txt "$OUT/profile-$name-$i.txt" 2>/dev/null
  done
done
