# session 40 (one H100): the same change on the byte-level model (vocabulary 320, the default corpus):
# base = 6117750's model (one-hot matmul embedding, XLA's f32 head backward) vs new (embed_lookup,
# head_logits), dsv3-proxy, 150 steps each, A B A B.
export PYTHONUNBUFFERED=1 SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so
DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/head3; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME PYTHONPATH
  PYTHONPATH=$2 timeout 150 python3 -m sluice.train --preset dsv3-proxy --steps 150 --log-every 10 \
    --eval-every 0 --no-ckpt --no-progress --data $DATA --out $W/$1 > $W/$1.log 2>&1; echo "$1 rc=$?"
}
for i in 1 2; do one base-$i $PWD/.carry/py_base/python; one new-$i $PWD/python; done
python3 - $W <<'PY'
import json, statistics as st, sys, glob, os
for d in sorted(glob.glob(sys.argv[1] + "/*-[12]")):
    rs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    tr = [r for r in rs if r["kind"] == "train" and r["step"] > 50]
    print(os.path.basename(d), "tgs", round(st.median(r["tgs"] for r in tr)), "ms", round(1000 * st.median(r["step_time"] for r in tr), 1), "mem", max(r["peak_mem_gb"] for r in tr), "loss@150", round(tr[-1]["loss"], 4))
PY
tar czf $OUT/z.tgz -C $OUT head3 && rm -rf $W
