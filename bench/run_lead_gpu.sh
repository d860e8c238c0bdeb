#!/usr/bin/env bash
# The JAX-level GPU checks in one call on a 2-GPU machine: build libsluice in-tree (Hopper only),
# the gmm/tgmm ops through XLA's CUDA FFI (tests/gpu/test_jax_gpu.py), sluice.ep through JAX on 2 GPUs
# (tests/gpu/test_ep_gpu.py), and the SwiGLU jax.grad benchmark against ragged_dot. Logs to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false SLUICE_EP_TIMEOUT=20
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lead-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$OUT/env.txt"
( cmake -B build -DPython_EXECUTABLE=$(command -v python3) -DCMAKE_CUDA_ARCHITECTURES=90a-real \
  && cmake --build build -j 32 --target sluice ) >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build ok"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_jax_gpu.py 2>&1 | tee "$OUT/test_jax_gpu.log" | tail -15
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ep_gpu.py 2>&1 | tee "$OUT/test_ep_gpu.log" | tail -15
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 bench/bench_swiglu.py --out "$OUT/swiglu.json" 2>&1 | tee "$OUT/swiglu.log" | grep -v Warning
