# session 40 (4x H100): where the EP 4 step's time goes once the router is balanced: dsv3-proxy-ep4,
# sluice, 260 steps, 3 steps traced from step 250.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz
W=$OUT/ep4prof; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
PRESET=dsv3-proxy-ep4 EP=4 STEPS=260 IMPLS=sluice PROFILE=3 PROFILE_FROM=250 \
  EXTRA="--ep-rows-factor 2 --eval-batches 1" \
  timeout 140 bash bench/bench_train.sh tgs $W > $W/run.txt 2>&1; echo "rc=$?"
rm -rf $W/sluice/profile/plugins
head -45 $W/profile-sluice.txt
tar czf $OUT/z.tgz -C $OUT ep4prof && rm -rf $W
