# session 38 (2 GPUs): the small preset's convergence at router bias rates 1e-3 and 1e-2, dropless
# (sluice) on GPU 0 and capacity 1.25 on GPU 1 side by side, 3 seeds of 400 steps each.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz PRESET=small STEPS=400 SEEDS="0 1 2"
W=$OUT/small; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
for rate in 1e-2 1e-3; do
  D=$W/bias$rate; mkdir -p $D
  CUDA_VISIBLE_DEVICES=0 NAMES=dropless EXTRA="--bias-update-rate $rate" timeout 250 bash bench/bench_train.sh convergence $D > $D/gpu0.txt 2>&1 &
  A=$!
  CUDA_VISIBLE_DEVICES=1 NAMES=cf1.25 EXTRA="--bias-update-rate $rate" timeout 250 bash bench/bench_train.sh convergence $D > $D/gpu1.txt 2>&1 &
  B=$!
  wait $A; echo "gpu0 rc=$?"; wait $B; echo "gpu1 rc=$?"
  python3 bench/summarize_train.py convergence $D | tail -3
done
tar czf $OUT/z.tgz -C $OUT small && rm -rf $W
