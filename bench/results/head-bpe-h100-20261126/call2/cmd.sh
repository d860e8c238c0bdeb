# session 40 (one H100): the BPE-8192 step's embedding and head. dsv3-proxy on the BPE file, 150
# steps each, A B C A B C: base = 6117750's model with ONE_HOT_MAX_VOCAB raised to 8192 (one-hot
# matmul forward, its GEMM backward); emb = embed_lookup (gather forward, one-hot GEMM backward);
# new = emb + head_logits (the logits' gradient in bf16: the head's backward GEMMs in bf16, not TF32).
export PYTHONUNBUFFERED=1 SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so
DATA=$PWD/.carry/moe_data/corpus-all-bpe8k.npz
W=$OUT/head2; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
one() {  # NAME PYTHONPATH EXTRA...
  local name=$1 py=$2; shift 2
  PYTHONPATH=$py timeout 150 python3 -c "import sys, sluice.model as m; m.ONE_HOT_MAX_VOCAB = 8192; from sluice.train import main; sys.exit(main())" \
    --preset dsv3-proxy --steps 150 --log-every 10 --eval-every 0 --no-ckpt --no-progress --data $DATA \
    --out $W/$name "$@" > $W/$name.log 2>&1; echo "$name rc=$?"
}
for i in 1 2; do
  one base-$i $PWD/.carry/py_base/python
  one emb-$i $PWD/.carry/py_emb/python
  one new-$i $PWD/python $([ $i = 1 ] && echo --profile 3)
done
cp $W/new-1/profile/summary.txt $W/profile-new-1.txt 2>/dev/null; rm -rf $W/new-1/profile
python3 - $W <<'PY'
import json, statistics as st, sys, glob, os
for d in sorted(glob.glob(sys.argv[1] + "/*-[12]")):
    rs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    tr = [r for r in rs if r["kind"] == "train" and r["step"] > 50]
    print(os.path.basename(d), "tgs", round(st.median(r["tgs"] for r in tr)), "ms", round(1000 * st.median(r["step_time"] for r in tr), 1), "mem", max(r["peak_mem_gb"] for r in tr), "loss@150", round(tr[-1]["loss"], 4))
PY
head -24 $W/profile-new-1.txt
tar czf $OUT/z.tgz -C $OUT head2 && rm -rf $W
