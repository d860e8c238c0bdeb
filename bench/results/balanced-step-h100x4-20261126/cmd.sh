# session 40 (4x H100): dsv3-proxy-ep4 step past the router's balancing (bias rate 1e-2, the presets'
# default): 300 steps each of sluice and capacity 1.25, TGS over the windows past step 200; then the
# sluice.ep checks at 4 ranks on the current library (C API over peer/ipc/nccl, one process per GPU,
# memcheck, the JAX EP suite).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/ep4; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
PRESET=dsv3-proxy-ep4 EP=4 STEPS=${STEPS:-300} IMPLS="sluice dense-cf1.25" \
  EXTRA="--ep-rows-factor 2 --eval-batches 1" \
  timeout 330 bash bench/bench_train.sh tgs $W/step > $W/step.txt 2>&1; echo "step rc=$?"
FROM_STEP=200 python3 bench/summarize_train.py tgs $W/step
OUT=$W/checks EP_STEPS="capi mp sanitizer pytest" timeout 240 bash bench/run_ep_gpu.sh > $W/checks.txt 2>&1
echo "checks rc=$?"; tail -8 $W/checks.txt
find $W -name "*.log" -size +2M -delete
tar czf $OUT/z.tgz -C $OUT ep4 && rm -rf $W
