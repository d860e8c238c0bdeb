#!/usr/bin/env bash
# A/B of two builds of the library in one call on one GPU (session 62): a change to the kernel that
# is not a variant, judged by cycles and by the benchmark's torch part.
#   dev/probe/lib_ab.sh DIR_A DIR_B
# Each DIR holds a tests/gpu/build.sh build (libsluice_gpu.so and the tgmm harness; DIR_B also
# test_gmm and test_wait_bound when TESTS=1). Steps:
#   1. TESTS=1 (default): tests/gpu/run.sh on DIR_B (the suite with every sanitizer)
#   2. SWEEP=1 (default): dev/cuda/tile_sweep.sh on both harnesses (Nsight Compute's cycles per
#      tile against the tile's length, clock-independent), VERSIONS (default 25, tgmm's default)
#   3. the benchmark's torch part with each library in turn A B B A ... (ROUNDS pairs, default 2),
#      then bench_gmm.py --merge of each into $OUT/torch-<i>-<A|B>.md; a table of gmm/torch and
#      tgmm/torch at the median per run at the end of $OUT/lib_ab.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
A=${1:?DIR_A}
B=${2:?DIR_B}
OUT=${OUT:-/tmp/lib-ab-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
sum=$OUT/lib_ab.txt
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
  echo "A=$A B=$B"; } >"$sum"
if [ "${TESTS:-1}" = 1 ]; then
  SKIP_BUILD=1 BUILD=$B LOGS=$OUT/testlogs tests/gpu/run.sh >"$OUT/suite.txt" 2>&1
  echo "GPU suite on B: rc=$?" >>"$sum"
  cat "$OUT/suite.txt" >>"$sum"
fi
if [ "${SWEEP:-1}" = 1 ]; then
  sw=$OUT/sweepbins
  mkdir -p "$sw"
  ln -sf "$(realpath "$A/tgmm")" "$sw/tgmm-A"
  ln -sf "$(realpath "$B/tgmm")" "$sw/tgmm-B"
  BUILD=$sw BINS="tgmm-A tgmm-B" VERSIONS=${VERSIONS:-25} OUT=$OUT/sweep dev/cuda/tile_sweep.sh >"$OUT/sweep.txt" 2>&1
  echo "tile_sweep rc=$?" >>"$sum"
  cat "$OUT/sweep/summary.txt" >>"$sum"
fi
i=0
for r in $(seq "${ROUNDS:-2}"); do
  for side in $([ $((r % 2)) = 1 ] && echo A B || echo B A); do
    i=$((i + 1))
    dir=$([ $side = A ] && echo "$A" || echo "$B")
    timeout 300 python3 bench/bench_gmm.py --part torch --lib "$dir/libsluice_gpu.so" \
      --out "$OUT/torch-$i-$side.json" >"$OUT/torch-$i-$side.log" 2>&1
    python3 bench/bench_gmm.py --merge "$OUT/torch-$i-$side.json" --md "$OUT/torch-$i-$side.md" \
      --json "$OUT/torch-$i-$side.merged.json" >/dev/null 2>&1
    echo "torch part $i ($side): rc=$?" >>"$sum"
  done
done
python3 - "$OUT" >>"$sum" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
print("run side  gmm/torch(med,min)  tgmm/torch(med,min)  per case tgmm/torch")
for f in sorted(out.glob("torch-*-[AB].json"), key=lambda p: int(p.name.split("-")[1])):
    rows = json.loads(f.read_text())["rows"]
    g = [r["tflops"]["sluice_gmm"] / r["tflops"]["torch_grouped_mm"] for r in rows]
    t = [r["tflops"]["sluice_tgmm"] / r["tflops"]["torch_grouped_mm_wgrad"] for r in rows]
    if not g:
        print(f.name, "no rows"); continue
    print(f"{f.stem:>10}  {statistics.median(g):.4f} {min(g):.3f}   {statistics.median(t):.4f} {min(t):.3f}  "
          + " ".join(f"{x:.3f}" for x in t))
EOF
cat "$sum"
# the device tool returns at most 8 files: the summary, the suite's lines and one archive of the rest
tar czf "$OUT/z.tgz" -C "$OUT" $(cd "$OUT" && ls -d testlogs sweep ./*.log ./torch-* 2>/dev/null)
rm -rf "$OUT/testlogs" "$OUT/sweep" "$OUT"/*.log "$OUT"/torch-* "$OUT/sweepbins"
