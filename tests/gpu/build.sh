#!/usr/bin/env bash
# Builds the CUDA kernels with nvcc directly (no CMake needed) into $BUILD (default build-gpu/):
#   test_gmm           the GPU test binary (tests/gpu/test_gmm.cu)
#   test_gmm_fp8       the FP8 kernels' tests and timings (tests/gpu/test_gmm_fp8.cu)
#   test_wait_bound    the sm90 kernels' bounded mbarrier wait (tests/gpu/test_wait_bound.cu, sm_90a)
#   libsluice_gpu.so   core + the CUDA grouped GEMM, FP8 quantization and SwiGLU kernels, for the
#                      benchmarks and tests/gpu/test_quantize_fp8.py (ctypes)
#   gmm, tgmm          the dev harnesses (dev/cuda/*.cu; DEV=0 skips them)
# Objects build in parallel; ptxas resource reports go to $BUILD/ptxas-*.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build-gpu}
mkdir -p "$BUILD"
# ARCH: the nvcc -gencode flags (default sm_90a and sm_80; one of them builds in half the time)
ARCH=${ARCH:-"-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80"}
NVCC="nvcc -O3 -std=c++17 -lineinfo $ARCH -Iinclude -Icsrc/core -Xcompiler -fPIC"
# WAIT_LIMIT_NS=<ns>: a test build whose sm90 mbarrier waits trap after that long (csrc/cuda/sm90_gmm.cuh)
# NVCC_FLAGS: more flags for every nvcc compile (e.g. -D options of csrc/cuda)
NVCC="$NVCC ${NVCC_FLAGS:-}"
if [ -n "${WAIT_LIMIT_NS:-}" ]; then NVCC="$NVCC -DSLUICE_SM90_WAIT_LIMIT_NS=${WAIT_LIMIT_NS}u"; fi
pids=()
for f in status gmm_cpu gmm_fp8_cpu fp8_quantize_desc swiglu_cpu; do
  gcc -O2 -fPIC -fopenmp -Iinclude -Icsrc/core -c csrc/core/$f.c -o "$BUILD/$f.o" & pids+=($!)
done
for f in gmm_launch sm80_gmm sm90_gmm_fwd sm90_gmm_wgrad sm90_gmm_fp8 fp8_quantize fp8_swiglu swiglu; do
  $NVCC -Xptxas -v -c csrc/cuda/$f.cu -o "$BUILD/$f.o" >"$BUILD/ptxas-$f.log" 2>&1 & pids+=($!)
done
$NVCC -c tests/gpu/test_gmm.cu -o "$BUILD/test_gmm.o" & pids+=($!)
$NVCC -c tests/gpu/test_gmm_fp8.cu -o "$BUILD/test_gmm_fp8.o" & pids+=($!)
nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Iinclude \
  -o "$BUILD/test_wait_bound" tests/gpu/test_wait_bound.cu & pids+=($!)
if [ "${DEV:-1}" = 1 ]; then
  for h in gmm tgmm; do
    $NVCC -c dev/cuda/$h.cu -o "$BUILD/dev_$h.o" & pids+=($!)
  done
fi
fail=0
for p in "${pids[@]}"; do wait "$p" || fail=1; done
if [ $fail != 0 ]; then cat "$BUILD"/ptxas-*.log | grep -i -B2 -A2 error; exit 1; fi
LIBOBJS="$BUILD/status.o $BUILD/gmm_cpu.o $BUILD/gmm_fp8_cpu.o $BUILD/fp8_quantize_desc.o $BUILD/swiglu_cpu.o $BUILD/gmm_launch.o $BUILD/sm80_gmm.o $BUILD/sm90_gmm_fwd.o $BUILD/sm90_gmm_wgrad.o $BUILD/sm90_gmm_fp8.o $BUILD/fp8_quantize.o $BUILD/fp8_swiglu.o $BUILD/swiglu.o"
nvcc $ARCH -shared -o "$BUILD/libsluice_gpu.so" $LIBOBJS -lgomp
nvcc $ARCH -o "$BUILD/test_gmm" "$BUILD/test_gmm.o" -L"$BUILD" -lsluice_gpu -Xlinker -rpath,'$ORIGIN'
nvcc $ARCH -o "$BUILD/test_gmm_fp8" "$BUILD/test_gmm_fp8.o" -L"$BUILD" -lsluice_gpu -Xlinker -rpath,'$ORIGIN'
if [ "${DEV:-1}" = 1 ]; then
  for h in gmm tgmm; do
    nvcc $ARCH -o "$BUILD/$h" "$BUILD/dev_$h.o" "$BUILD/status.o" "$BUILD/gmm_cpu.o" -lgomp
  done
fi
echo "built $BUILD/test_gmm $BUILD/test_gmm_fp8 $BUILD/libsluice_gpu.so"
