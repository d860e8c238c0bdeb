#!/usr/bin/env bash
# The training step's loss and speed with each attention implementation (sluice-train --attention),
# same preset, seed and data: cuDNN's fused kernel must train like XLA's. One GPU; results to $OUT
# (default bench/results/attention-<date>): per implementation the logged loss, TGS and step time.
#   PRESET (dsv3-proxy), IMPL (sluice), STEPS (40), IMPLS_ATT ("auto xla"), DATA (the corpus)
set -uo pipefail
cd "$(dirname "$0")/.."
res=${OUT:-bench/results/attention-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$res"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -f .carry/moe_lib/libsluice.so ] && export SLUICE_LIBRARY=$PWD/.carry/moe_lib/libsluice.so
data=${DATA:-.carry/moe_data/corpus.npz}
flags=(--preset "${PRESET:-dsv3-proxy}" --moe-impl "${IMPL:-sluice}" --steps "${STEPS:-40}"
  --log-every 5 --eval-every 0 --no-ckpt --no-progress)
[ -f "$data" ] && flags+=(--data "$data")
work=$(mktemp -d)
for att in ${IMPLS_ATT:-auto xla}; do
  timeout "${T_RUN:-200}" python3 -m sluice.train "${flags[@]}" --attention "$att" \
    --out "$work/$att" >"$work/$att.log" 2>&1
  echo "attention=$att rc=$?"
  python3 - "$work/$att/metrics.jsonl" "$att" <<'PY' | tee "$res/loss-$att.txt"
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
for r in recs:
    if r["kind"] == "train":
        print(f"{sys.argv[2]:>6} step {r['step']:>4} loss {r['loss']:.4f} grad_norm "
              f"{r['grad_norm']:.4f} tgs {r['tgs']:.0f} step_ms {1e3 * r['step_time']:.1f}")
PY
done
