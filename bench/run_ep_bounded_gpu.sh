#!/usr/bin/env bash
# Bounded dropless expert parallelism (sluice.ep.bounded_moe, the MoE layer's default) on every GPU
# of one host: its tests on the GPUs, then the dsv3-proxy-ep<R> training step per path.
#   1. tests/python/ops/test_ep_bounded.py on the GPUs (the rounds against the worst-case path, bit
#      for bit), again with SLUICE_DEBUG=1 (a row past a receive buffer is an error there);
#   2. sluice-train dsv3-proxy-ep<R> at batch $BATCH (default the preset's): bounded (F = 2, the
#      default), bounded at F = 1.5, worst case (--ep-worst-case), capacity factor 1.25 (dense), and
#      a forced overflow (--ep-rows-factor 0.5: every step runs several rounds); tokens/s per GPU,
#      peak memory, rounds, and each against the worst case's tokens/s and capacity 1.25's memory;
#   3. the largest batch each of bounded / worst case / capacity 1.25 fits (BATCHES, ascending; a
#      path stops at its first failure).
#
#   SLUICE_LIBRARY=build/libsluice.so DATA=corpus.npz OUT=/tmp/bounded bash bench/run_ep_bounded_gpu.sh
#   STEPS=16 (steps a run, logged every 4; tokens/s is the median over the records past the
#   compiling step)   BATCH=64   BATCHES="96 112 128 160 192"   PARTS="tests train batch" (default all)
#   CAP_GIB=80 (each GPU's memory for XLA; default: 95% of it)
# Results: $OUT/summary.txt (a line per step and the tables), the runs under $OUT/runs/, the
# output of every step in $OUT/log.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ep-bounded}
mkdir -p "$OUT/runs"
LOG=$OUT/log.txt
: >"$LOG"
: >"$OUT/summary.txt"
: "${SLUICE_LIBRARY:?a CUDA build of libsluice.so}" "${DATA:?the corpus (sluice-prepare-data --out corpus.npz)}"
export SLUICE_LIBRARY=$(realpath "$SLUICE_LIBRARY") DATA=$(realpath "$DATA") PYTHONPATH=$PWD/python
want() { [[ " ${PARTS:-tests train batch} " == *" $1 "* ]]; }
step() {
  local name=$1 start=$SECONDS rc
  shift
  echo "===== $name: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
  return $rc
}
{ date -u; git log -1 --oneline; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } >>"$LOG" 2>&1
R=$(nvidia-smi -L | grep -c GPU)
if [ -n "${CAP_GIB:-}" ]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round($CAP_GIB * 1024 / $mib, 3))")
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
PRESET=dsv3-proxy-ep$R
STEPS=${STEPS:-16}
echo "GPUs: $R, preset $PRESET, $STEPS steps a run, XLA memory fraction $XLA_PYTHON_CLIENT_MEM_FRACTION" |
  tee -a "$OUT/summary.txt"

if want tests; then
  (cd tests && step tests env JAX_PLATFORMS=cuda timeout 900 python3 -m pytest -q -p no:cacheprovider \
    python/ops/test_ep_bounded.py)
  (cd tests && step tests-debug env JAX_PLATFORMS=cuda SLUICE_DEBUG=1 timeout 900 python3 -m pytest -q \
    -p no:cacheprovider python/ops/test_ep_bounded.py)
fi

train() { # name, flags...: one sluice-train run into $OUT/runs/name
  local name=$1
  shift
  step "$name" timeout "${T_RUN:-600}" python3 -m sluice.cli.train --preset "$PRESET" --ep "$R" \
    --data "$DATA" --steps "$STEPS" --log-every 4 --eval-every 0 --no-ckpt --no-progress \
    --overwrite --out "$OUT/runs/$name" "$@"
}
declare -A PATHS=(
  [bounded]="--moe-impl sluice"
  [worst-case]="--moe-impl sluice --ep-worst-case"
  [cf1.25]="--moe-impl dense --capacity-factor 1.25"
)
batch=()
[ -n "${BATCH:-}" ] && batch=(--batch-size "$BATCH")
if want train; then
  for p in bounded worst-case cf1.25; do
    # shellcheck disable=SC2086
    train "$p" ${PATHS[$p]} "${batch[@]}"
  done
  train bounded-f1.5 --moe-impl sluice --ep-rows-factor 1.5 "${batch[@]}"
  train overflow --moe-impl sluice --ep-rows-factor 0.5 "${batch[@]}"
fi
if want batch; then
  for p in bounded worst-case cf1.25; do
    for b in ${BATCHES:-96 112 128 160 192}; do
      # shellcheck disable=SC2086
      train "$p-b$b" ${PATHS[$p]} --batch-size "$b" --steps 8 || break
    done
  done
fi

python3 - "$OUT/runs" <<'EOF' | tee -a "$OUT/summary.txt"
import json, os, statistics, sys

root = sys.argv[1]
rows = {}
for name in sorted(os.listdir(root)):
    f = os.path.join(root, name, "metrics.jsonl")
    if not os.path.exists(f):
        continue
    tr = [json.loads(line) for line in open(f)]
    tr = [r for r in tr if r.get("kind") == "train"]
    cfg = json.load(open(os.path.join(root, name, "config.json")))
    batch = cfg.get("hp", {}).get("batch_size", "?")
    most = lambda k: max(r.get(k, 0) for r in tr)
    rows[name] = (batch, tr and dict(
        tgs=statistics.median(r["tgs"] for r in tr),
        step=statistics.median(r["step_time"] for r in tr),
        mem=max((r["peak_mem_gb"] or 0) for r in tr),
        rounds=most("ep_rounds"), recv=most("ep_peak_recv_rows"),
        pairs=most("ep_peak_expert_rows"), dropped=most("dropped")))
print("| run | batch | tokens/s/GPU | step s | peak GiB/GPU | rounds | peak recv rows | peak expert rows"
      " | dropped | tokens/s vs worst case | memory vs cf1.25 |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name, (batch, m) in rows.items():
    if not m:
        print(f"| {name} | {batch} | failed | | | | | | | | |")
        continue
    # the train part's runs against its worst-case and cf1.25 runs; "<path>-b<B>" against theirs
    path, _, b = name.rpartition("-b")
    path, suffix = (path, "-b" + b) if path and b.isdigit() else (name, "")
    w, c = rows.get("worst-case" + suffix, (0, None))[1], rows.get("cf1.25" + suffix, (0, None))[1]
    vs_w = f"{m['tgs'] / w['tgs']:.3f}x" if w and path not in ("worst-case", "cf1.25") else ""
    vs_c = f"{m['mem'] / c['mem']:.3f}x" if c and path != "cf1.25" else ""
    print(f"| {name} | {batch} | {m['tgs']:,.0f} | {m['step']:.3f} | {m['mem']:.1f} | {m['rounds']} | "
          f"{m['recv']} | {m['pairs']} | {m['dropped']:.3f} | {vs_w} | {vs_c} |")
EOF
