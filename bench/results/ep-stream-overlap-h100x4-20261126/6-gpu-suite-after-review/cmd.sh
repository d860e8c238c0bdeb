# session 41 (4x H100), call 8 (after the review: the stream carried in the ops' config, not a module dict): the JAX EP GPU suite at 4 ranks with the new test of the exchange
# on XLA stream 1 beside independent work (bitwise against the main stream).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
W=$OUT/s41h; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
OUT=$W/checks EP_STEPS="pytest" timeout 300 bash bench/run_ep_gpu.sh > $W/checks.txt 2>&1
echo "checks rc=$?"; tail -4 $W/checks.txt; grep -E "passed|failed|error" $W/checks/log.txt | tail -5
tar czf $OUT/z.tgz -C $OUT s41h && rm -rf $W
