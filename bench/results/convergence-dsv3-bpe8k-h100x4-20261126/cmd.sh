# session 40 (4x H100): dropless vs capacity 1.0 / 1.25 at equal steps on subword tokens: the 60 M-byte
# corpus (--sources all) as a byte-level BPE of 8192 tokens (18.5 M training tokens), dsv3-proxy,
# 1000 steps (32.8 M tokens, 1.77 epochs), seeds 0 1 (then SEEDS="2 3"), the six runs over 4 GPUs (one GPU a run).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus-all-bpe8k.npz
W=$OUT/bpe; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
PRESET=dsv3-proxy STEPS=${STEPS:-1000} NAMES="dropless cf1.0 cf1.25" SEEDS="${SEEDS:-0 1}" SIDE_BY_SIDE=1 GPUS=4 \
  timeout 560 bash bench/bench_train.sh convergence $W > $W/run.txt 2>&1; echo "rc=$?"
python3 bench/summarize_train.py convergence $W; cat $W/convergence.md | tail -14
for f in $W/*/metrics.jsonl; do gzip -9 -n $f; done
tar czf $OUT/z.tgz -C $OUT bpe && rm -rf $W
