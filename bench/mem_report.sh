#!/usr/bin/env bash
# Where a training step's device memory goes, by XLA's own buffer assignment. For each set of
# sluice-train flags given (one quoted argument each), trains 2 steps with the compiled train step's
# HLO dumped, then prints the peak device memory the run measured and, from XLA's memory-usage
# report of jit_train_step, its total and the largest slices of its temporary allocation (shapes),
# then what is live at once at the step's peak, by value and by the JAX operation that made it
# (bench/hlo_peak.py: the report lists slices by offset, which values share across time).
#
#   OUT=/tmp/mem bash bench/mem_report.sh "--preset dsv3-proxy-ep2 --ep 2 --moe-impl sluice" \
#       "--preset dsv3-proxy-ep2 --ep 2 --moe-impl sluice --remat"
#   TOP=40 (slices listed, default 25), DATA=corpus.npz (sluice-train --data)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/mem-report}
mkdir -p "$out"
i=0
for flags in "$@"; do
  i=$((i + 1))
  dump=$out/dump$i
  rm -rf "$dump" "$out/run$i"
  echo "=== [$i] sluice-train $flags"
  # shellcheck disable=SC2086
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_module_re=.*train_step.*" \
    python3 -m sluice.cli.train $flags --steps 2 --log-every 1 --eval-every 0 --no-ckpt --no-progress \
    ${DATA:+--data $DATA} --out "$out/run$i" >"$out/run$i.log" 2>&1 || { tail -5 "$out/run$i.log"; continue; }
  grep -h '"kind": "train"' "$out/run$i/metrics.jsonl" | tail -1 |
    python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print("measured peak:", {k: v for k, v in r.items() if "mem" in k})'
  report=$(ls "$dump"/*train_step*after_optimizations-memory-usage-report.txt 2>/dev/null | head -1)
  [ -n "$report" ] || { echo "no memory-usage report in $dump"; continue; }
  # XLA's total, then the largest slices of its first (the temporary) allocation: cumulative size,
  # size, offset, values sharing the slice, their shapes
  awk -v top="${TOP:-25}" '/^Total bytes/ {print; next} /cumulative_size/ {s++; if (s > 1) exit; print; next}
    /^ *-+$/ {next} s == 1 && NF && n < top {print substr($0, 1, 300); n++}' "$report"
  python3 bench/hlo_peak.py "$dump" --top "${TOP:-25}" | cut -c1-250
done
