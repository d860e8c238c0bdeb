# session 39 (2 GPUs): dsv3-proxy convergence on the ~60 M-token corpus (sluice-prepare-data --sources all),
# dropless (sluice) on GPU 0 and capacity 1.25 on GPU 1 side by side, 2 seeds of 1600 steps (~0.9 epoch).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus-all.npz PRESET=dsv3-proxy STEPS=${STEPS:-1600} SEEDS="${SEEDS:-0 1}" EXTRA="${EXTRA:---eval-batches 64}"
W=$OUT/conv; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; git log -1 --format=%H; } > $W/machine.txt 2>&1
( while sleep 20; do nvidia-smi --query-gpu=index,clocks.sm,power.draw,memory.used --format=csv,noheader; done ) > $W/smi.txt 2>&1 &
SMI=$!
CUDA_VISIBLE_DEVICES=0 NAMES=dropless timeout ${T:-575} bash bench/bench_train.sh convergence $W > $W/gpu0.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 NAMES=cf1.25 timeout ${T:-575} bash bench/bench_train.sh convergence $W > $W/gpu1.txt 2>&1 &
B=$!
wait $A; echo "gpu0 rc=$?"; wait $B; echo "gpu1 rc=$?"; kill $SMI
python3 bench/summarize_train.py convergence $W; cat $W/convergence.md
runs=$(ls -d $W/*-s*/ | tr '\n' ' '); python3 -m sluice.plot $runs --out $W/loss.png --title "dsv3-proxy: dropless (sluice) vs capacity factor 1.25, $STEPS steps $EXTRA" || true
tar czf $OUT/z.tgz -C $OUT conv && rm -rf $W
