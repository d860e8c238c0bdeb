# session 37, call 6 (2x H100): the JAX GPU suites on the final tree.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 SLUICE_EP_TIMEOUT=10
export SLUICE_LIBRARY=$PWD/.carry/new_lib/libsluice.so PYTHONPATH=$PWD/python
W=$OUT/w; mkdir -p $W
{ nvidia-smi -L; python3 -c "import jax; print('jax', jax.__version__)"; date -u; } > $W/machine.txt 2>&1
timeout 220 python3 -m pytest -q tests/gpu/test_jax_gpu.py > $W/jax-gpu.txt 2>&1; echo "jax rc=$?"; tail -1 $W/jax-gpu.txt
timeout 80 python3 -m pytest -q tests/gpu/test_ep_gpu.py > $W/ep-gpu.txt 2>&1; echo "ep rc=$?"; tail -1 $W/ep-gpu.txt
tar czf $OUT/z.tgz -C $OUT w && rm -rf $W
