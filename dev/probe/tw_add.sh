#!/usr/bin/env bash
# The library's pieces added to the lean tgmm probe one at a time (session 62; dev/probe/tw_probe.cu's
# TW_ADD): each build checked against the library on one shape, then Nsight Compute's cycles of its
# 128x256 probe (impl 1) on $SHAPES, and the library's own (impl 4) once, into $OUT/tw_add.txt.
# Builds: $B/tw-add<mask> for the masks in $ADDS, each
#   nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -DTW_ADD=<mask> -Iinclude \
#     -Icsrc/core dev/probe/tw_probe.cu status.o gmm_cpu.o -lgomp -lcuda (see tw_probe.sh)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tw-add-out}
B=${B:-build-tw2}
ADDS=${ADDS:-"0 1 3 4 7"}
SHAPES=${SHAPES:-"g1-r512-k16896-n2560-10tiles g32-r512-k6912-n4096"}
mkdir -p "$OUT/logs"
sum=$OUT/tw_add.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader; } >"$sum"
cyc() { grep -E "sm__cycles_elapsed.max" "$1" | awk '{print $NF}'; }
ok=""
for a in $ADDS; do
  TW_SHAPES=${SHAPES%% *} TW_IMPLS=0,1 timeout 20 "$B/tw-add$a" >"$OUT/logs/check-$a.txt" 2>&1
  rc=$?
  echo "add $a check: rc $rc $(grep tw-128x256 "$OUT/logs/check-$a.txt" | awk '{print $(NF-1), $NF}')" >>"$sum"
  [ $rc = 0 ] && grep -q "tw-128x256.* OK" "$OUT/logs/check-$a.txt" && ok="$ok $a" # (a hang or a
done                                                                               # wrong one: no ncu)
for s in $SHAPES; do
  for a in $ok lib; do
    bin=$B/tw-add${a/lib/0}; impl=$([ "$a" = lib ] && echo 4 || echo 1)
    TW_SHAPES=$s TW_IMPLS=$impl TW_REPS=1 timeout 40 ncu --clock-control none \
      --kernel-name regex:"tw_kernel|gmm_kernel" --launch-skip 2 --launch-count 1 \
      --metrics sm__cycles_elapsed.max "$bin" >"$OUT/logs/ncu-$s-$a.txt" 2>&1
    echo "$s add $a: cycles $(cyc "$OUT/logs/ncu-$s-$a.txt")" >>"$sum"
  done
done
cat "$sum"
tar czf "$OUT/z.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
