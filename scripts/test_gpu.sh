#!/usr/bin/env bash
# The GPU test suite, one command on a machine with NVIDIA GPUs (CI has none, so it runs here only):
#   gmm   tests/gpu/run.sh: every grouped-GEMM kernel against a float64 reference with poisoned outputs,
#         under compute-sanitizer (memcheck, racecheck, synccheck, initcheck), SLUICE_DEBUG's checks
#         and the bounded pipeline wait
#   jax   tests/gpu/test_jax_gpu.py: the ops through XLA's CUDA FFI, gradients, the MoE layer
#   fp8   the FP8 ops' and the quantization's Python tests on the GPU (tests/python/ops/test_gmm_fp8.py,
#         test_fp8_quantize.py, test_fp8_swiglu.py, test_ep_fp8.py, tests/python/nn/test_fp8.py: the
#         CUDA kernels against the references, bit for bit where they must be; the multi-device
#         cases skip on one GPU)
#   ep    sluice.ep over every GPU of the host (2 or more): the C API with every transport (peer, IPC,
#         NCCL) against the references, one process per GPU, compute-sanitizer memcheck, the JAX ep tests,
#         the bounded rounds against the worst-case path (tests/python/ops/test_ep_bounded.py)
# PARTS="gmm jax fp8 ep" picks parts. BUILD: tests/gpu/build.sh's folder (default build-gpu, built unless
# SKIP_BUILD=1 finds it); SLUICE_LIBRARY: a CMake build of libsluice.so (default: build/, built here
# for sm_90a if missing). Logs in $LOGS (default $BUILD/logs). Exit status: the number of failed parts.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export BUILD=${BUILD:-build-gpu} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
LOGS=${LOGS:-$BUILD/logs}
mkdir -p "$LOGS"
want() { [[ " ${PARTS:-gmm jax fp8 ep} " == *" $1 "* ]]; }
fails=0
part() { # name, command...: runs it, prints one line, counts a failure
  local name=$1 t0=$SECONDS rc
  shift
  "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  printf '%-6s rc=%-3d %4ds  %s\n' "$name" "$rc" $((SECONDS - t0)) "$(tail -1 "$LOGS/$name.log")"
  [ $rc = 0 ] || fails=$((fails + 1))
}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,power.limit,memory.total --format=csv,noheader
  python3 -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)'
} | tee "$LOGS/versions.txt"
if [ -z "${SLUICE_LIBRARY:-}" ]; then
  if [ ! -f build/libsluice.so ]; then
    cmake -B build -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_CUDA_ARCHITECTURES=90a-real \
      >"$LOGS/cmake.log" 2>&1 && cmake --build build -j --target sluice >>"$LOGS/cmake.log" 2>&1 ||
      { echo "CMake build failed: $(tail -3 "$LOGS/cmake.log")"; exit 1; }
  fi
  export SLUICE_LIBRARY=$PWD/build/libsluice.so
fi
want gmm && part gmm env LOGS="$LOGS/gmm" tests/gpu/run.sh
want jax && part jax timeout 400 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_jax_gpu.py
want fp8 && part fp8 env JAX_PLATFORMS=cuda timeout 400 python3 -m pytest -q -rfs -p no:cacheprovider \
  tests/python/ops/test_gmm_fp8.py tests/python/ops/test_fp8_quantize.py tests/python/ops/test_fp8_swiglu.py \
  tests/python/ops/test_ep_fp8.py \
  tests/python/nn/test_fp8.py
R=$(nvidia-smi -L | wc -l)
if want ep && [ "$R" -ge 2 ]; then
  export SLUICE_EP_TIMEOUT=10
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  part ep-capi timeout 120 python3 tests/gpu/ep_capi_check.py --ranks "$R" --transport peer ipc nccl
  part ep-mp env EP_NPROCS="$R" timeout 300 python3 tests/gpu/test_ep_mp.py ipc nccl
  part ep-san timeout 100 "$SAN" --tool memcheck --leak-check no --error-exitcode 9 \
    python3 tests/gpu/ep_capi_check.py --ranks 1 --quick --transport peer ipc
  # NCCL probes its own kernels with cudaFuncGetAttributes: API errors inside NCCL are not ours; its
  # initialisation is slow under the sanitizer, hence the longer bound.
  part ep-san-nccl env SLUICE_EP_TIMEOUT=90 timeout 150 "$SAN" --tool memcheck --leak-check no \
    --report-api-errors no --error-exitcode 9 python3 tests/gpu/ep_capi_check.py --ranks 1 --quick --transport nccl
  part ep-jax env EP_RANKS="$R" timeout 300 python3 -m pytest -q -rfs -p no:cacheprovider tests/gpu/test_ep_gpu.py
  part ep-bounded env JAX_PLATFORMS=cuda timeout 600 python3 -m pytest -q -rfs -p no:cacheprovider \
    tests/python/ops/test_ep_bounded.py
elif want ep; then
  echo "ep     skipped: needs 2 or more GPUs (this host has $R)"
fi
exit $fails
