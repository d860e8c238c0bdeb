# session 38 (2 GPUs): controls for the small preset's dropless-vs-capacity result (bias rate 1e-2):
# 'nodrop' (the dense path with a capacity that cannot drop: the same model computed the capacity
# path's way) on GPU 0, dropless through jax.lax.ragged_dot on GPU 1; 3 seeds (ragged_dot: 2) of 400 steps.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
export DATA=$PWD/.carry/moe_data/corpus.npz PRESET=small STEPS=400 SEEDS="0 1 2" EXTRA="--bias-update-rate 1e-2"
W=$OUT/ctrl; mkdir -p $W/nodrop $W/ragged_dot
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
CUDA_VISIBLE_DEVICES=0 NAMES=nodrop timeout 330 bash bench/bench_train.sh convergence $W/nodrop > $W/gpu0.txt 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 SEEDS="0 1" NAMES=dropless DROPLESS=ragged_dot timeout 330 bash bench/bench_train.sh convergence $W/ragged_dot > $W/gpu1.txt 2>&1 &
B=$!
wait $A; echo "gpu0 rc=$?"; wait $B; echo "gpu1 rc=$?"
for d in nodrop ragged_dot; do python3 bench/summarize_train.py convergence $W/$d | grep "^| [a-z]"; done
rm -rf $W/*/*/ckpt
