#!/usr/bin/env bash
# Two builds of the library, A and B, on sluice.ep's benchmark in one call, alternating (A B A B ...):
# the C API (dispatch, combine, redispatch for each transport, one process) and, with MP=1, the jit
# part in one process per GPU (transport ipc). A table of the medians and B/A goes to $OUT/ab.md.
# The checks of B are run_ep_gpu.sh's (SLUICE_LIBRARY=B EP_STEPS="capi mp sanitizer pytest").
#
#   A=old/libsluice.so B=new/libsluice.so OUT=/tmp/ab ROUNDS=2 MP=1 bash bench/ep_ab.sh
#   SMS=64 WORKLOAD=32768,1024,8,256 TRANSPORTS="peer ipc" ...   # blocks, T,H,K,E per rank, transports
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/run-ep-ab}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python:${PYTHONPATH:-} PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
R=${EP_RANKS:-$(nvidia-smi -L | wc -l)}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for v in A B; do
    so=${!v}
    # shellcheck disable=SC2086
    SLUICE_LIBRARY=$so timeout 150 python3 bench/bench_ep.py --part capi --ranks "$R" --sms "${SMS:-24}" \
      --transports ${TRANSPORTS:-peer ipc nccl} --transport-sms "${SMS:-24}" ${WORKLOAD:+--workload $WORKLOAD} \
      --out "$OUT/capi-$v-$round.json" >>"$OUT/log.txt" 2>&1
    echo "capi $v round $round rc=$?"
    if [ "${MP:-0}" = 1 ]; then
      SLUICE_LIBRARY=$so timeout 200 python3 bench/bench_ep.py --part mp --ranks "$R" --sms "${SMS:-24}" --reps 5 \
        --unroll 6 --mp-transports ipc --mp-timeout 110 --out "$OUT/mp-$v-$round.json" >>"$OUT/log.txt" 2>&1
      echo "mp $v round $round rc=$?"
    fi
  done
done
python3 - "$OUT" <<'EOF'
import glob, json, os, statistics, sys

out = sys.argv[1]
vals = {}  # (what, variant) -> [us per round]
for path in sorted(glob.glob(os.path.join(out, "*-[AB]-*.json"))):
    part, v, _ = os.path.basename(path)[:-5].split("-")
    data = json.load(open(path))
    if part == "capi":
        c = data["capi"]
        runs = [(f"{s} SMs NVLink", e) for s, e in c.get("sms", {}).items()]
        runs += [(f"{t}", e) for t, e in c.get("transports", {}).items()]
        for name, e in runs:
            for op in ("dispatch", "combine", "redispatch"):
                if op + "_us" in e:
                    vals.setdefault((f"C API, {name}: {op}", v), []).append(e[op + "_us"])
        if "layout_us" in c:
            vals.setdefault(("C API, layout alone (1 GPU)", v), []).append(c["layout_us"])
    else:
        for tr, e in data["mp"].items():
            for op in ("dispatch", "combine"):
                if f"sluice_{op}_us" in e:
                    key = (f"jit, {data['mp'][tr].get('processes', '?')} processes, {tr}: {op}", v)
                    vals.setdefault(key, []).append(e[f"sluice_{op}_us"])
whats = sorted({w for w, _ in vals}, key=lambda w: (w.split(":")[0], w))
lines = ["| what | A (us, per round) | B (us, per round) | B/A time (medians) |", "| --- | --- | --- | --- |"]
for w in whats:
    a, b = vals.get((w, "A"), []), vals.get((w, "B"), [])
    ratio = f"{statistics.median(b) / statistics.median(a):.3f}" if a and b else "-"
    fa = ", ".join(f"{x:.1f}" for x in a)
    fb = ", ".join(f"{x:.1f}" for x in b)
    lines.append(f"| {w} | {fa} | {fb} | {ratio} |")
open(os.path.join(out, "ab.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
