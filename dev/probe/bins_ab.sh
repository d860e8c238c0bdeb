#!/usr/bin/env bash
# Several builds of one dev harness side by side on one GPU, in one call (session 62: builds of tgmm
# with -DSLUICE_TGMM_LAG=0/2/3/4): each checked against the CPU reference (the harness's own
# problems, every version), then dev/cuda/tile_sweep.sh's cycles per tile for all of them, then the
# plain harness in turn on TIME_SHAPES (uniform and skewed sizes), ROUNDS times, the order of the
# builds reversed every round.
#   BUILD=build-lag BINS="tgmm-L0 tgmm-L2" VERSIONS=25 dev/probe/bins_ab.sh
# Writes $OUT/bins_ab.txt (every line that matters) and $OUT/z.tgz (the logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:?the folder of the builds}
BINS=${BINS:?the builds to compare}
VERSIONS=${VERSIONS:-25}
OUT=${OUT:-/tmp/bins-ab-out}
mkdir -p "$OUT/logs"
sum=$OUT/bins_ab.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
  echo "BUILD=$BUILD BINS=$BINS VERSIONS=$VERSIONS"; } >"$sum"
for b in $BINS; do
  HARNESS_SHAPES=none timeout 120 "$BUILD/$b" "$VERSIONS" >"$OUT/logs/check-$b.txt" 2>&1
  echo "check $b: rc=$? $(grep -c -- '-> OK' "$OUT/logs/check-$b.txt") OK, $(grep -c WRONG "$OUT/logs/check-$b.txt") WRONG" >>"$sum"
done
if [ "${SWEEP:-1}" = 1 ]; then
  BUILD=$BUILD BINS="$BINS" VERSIONS=$VERSIONS OUT=$OUT/sweep dev/cuda/tile_sweep.sh >"$OUT/logs/sweep.txt" 2>&1
  grep -E "^ +[0-9]+ +[0-9]+ |fit:|tiles," "$OUT/sweep/summary.txt" >>"$sum"
fi
order=$BINS
for r in $(seq "${ROUNDS:-2}"); do
  for b in $order; do
    HARNESS_NOCHECK=1 HARNESS_SHAPES=${TIME_SHAPES:-dsv3-gateup-ep8,dsv3-down-ep8,mixtral-up} \
      HARNESS_MODES=uniform,skewed timeout 200 "$BUILD/$b" "$VERSIONS" >"$OUT/logs/time-$r-$b.txt" 2>&1
    echo "== round $r $b" >>"$sum"
    grep -E "uniform|skewed" "$OUT/logs/time-$r-$b.txt" >>"$sum"
  done
  order=$(echo $order | awk '{for (i = NF; i > 0; --i) printf "%s%s", $i, (i > 1 ? " " : "")}')
done
cat "$sum"
tar czf "$OUT/z.tgz" -C "$OUT" logs $(cd "$OUT" && ls -d sweep 2>/dev/null)
rm -rf "$OUT/logs" "$OUT/sweep"
