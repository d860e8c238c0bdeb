# session 39 (2 GPUs): the dsv3-proxy convergence of cmd_long.sh without the shared expert
# (--shared-experts 0), seed 0: dropless on GPU 0, capacity 1.25 on GPU 1.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus-all.npz PRESET=dsv3-proxy STEPS=1600 SEEDS=0 EXTRA="--eval-batches 64 --shared-experts 0"
W=$OUT/conv; mkdir -p $W
CUDA_VISIBLE_DEVICES=0 NAMES=dropless timeout ${T:-380} bash bench/bench_train.sh convergence $W > $W/gpu0.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 NAMES=cf1.25 timeout ${T:-380} bash bench/bench_train.sh convergence $W > $W/gpu1.txt 2>&1 &
B=$!
wait $A; echo "gpu0 rc=$?"; wait $B; echo "gpu1 rc=$?"
tail -n 1 $W/*.log
tar czf $OUT/z.tgz -C $OUT conv && rm -rf $W
