# session 40 (one H100): where the BPE-8192 step's extra time goes. dsv3-proxy on the BPE file, 150
# steps each: the embedding as a gather (default above ONE_HOT_MAX_VOCAB=1024) vs as a one-hot GEMM
# (ONE_HOT_MAX_VOCAB raised), A B A B, each run's first also profiled (3 steps after compiling).
export PYTHONUNBUFFERED=1 SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
DATA=$PWD/.carry/moe_data/corpus-all-bpe8k.npz
W=$OUT/head; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME ONE_HOT_MAX EXTRA...
  local name=$1 max=$2; shift 2
  timeout 150 python3 -c "import sys, sluice.model as m; m.ONE_HOT_MAX_VOCAB = $max; from sluice.train import main; sys.exit(main())" \
    --preset dsv3-proxy --steps 150 --log-every 10 --eval-every 0 --no-ckpt --no-progress --data $DATA \
    --out $W/$name "$@" > $W/$name.log 2>&1; echo "$name rc=$?"
}
one gather-1 1024 --profile 3
one onehot-1 8192 --profile 3
one gather-2 1024
one onehot-2 8192
for d in gather-1 onehot-1; do cp $W/$d/profile/summary.txt $W/profile-$d.txt 2>/dev/null; rm -rf $W/$d/profile; done
python3 - $W <<'PY'
import json, statistics as st, sys, glob, os
for d in sorted(glob.glob(sys.argv[1] + "/*-[12]")):
    rs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    tr = [r for r in rs if r["kind"] == "train" and r["step"] > 50]
    print(os.path.basename(d), "tgs", round(st.median(r["tgs"] for r in tr)), "ms", round(1000 * st.median(r["step_time"] for r in tr), 1), "mem", max(r["peak_mem_gb"] for r in tr), "loss", round(tr[-1]["loss"], 4))
PY
head -30 $W/profile-gather-1.txt
tar czf $OUT/z.tgz -C $OUT head && rm -rf $W
