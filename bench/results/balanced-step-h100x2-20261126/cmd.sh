# session 38 (2 GPUs): dsv3-proxy-ep2 training step past the router's balancing (bias rate 1e-2):
# 300 steps each of sluice and capacity 1.25, TGS over the windows past step 200.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/ep2; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
PRESET=dsv3-proxy-ep2 EP=2 STEPS=${STEPS:-300} IMPLS="sluice dense-cf1.25" \
  EXTRA="--ep-rows-factor 2 --eval-batches 1 --bias-update-rate 0.01" \
  timeout 400 bash bench/bench_train.sh tgs $W > $W/run.txt 2>&1; echo "rc=$?"
FROM_STEP=200 python3 bench/summarize_train.py tgs $W
tar czf $OUT/z.tgz -C $OUT ep2 && rm -rf $W
