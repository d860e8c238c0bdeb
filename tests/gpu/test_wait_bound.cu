/* The sm90 kernels' mbarrier waits are bounded (csrc/cuda/sm90_gmm.cuh, SLUICE_SM90_WAIT_LIMIT_NS):
 * a wait that never completes must end the launch with an error instead of hanging it, and a wait
 * that completes within the limit must not. This binary uses the real mbar_wait, with the limit
 * lowered to 0.5 s:
 *   1. thread 1 waits for a barrier that thread 0 completes after 50-100 ms: the kernel must succeed;
 *   2. thread 0 waits for a barrier nobody arrives on: the launch must fail (the trap), in well under
 *      the 30 s the host allows it.
 * Case 2 leaves the CUDA context unusable, so it runs last and the binary exits after it.
 * tests/gpu/run.sh runs it as its own step. Hopper only (sm_90a); elsewhere it prints SKIP. */
#define SLUICE_SM90_WAIT_LIMIT_NS 500000000u
#include <cuda_runtime.h>
#include <stdio.h>
#include <time.h>

#include "../../csrc/cuda/sm90_gmm.cuh"

namespace sm90 = sluice_cuda::sm90;

__global__ void wait_kernel(int late_ms, int *out) {
#ifdef SLUICE_SM90A_DEVICE
  __shared__ __align__(8) uint64_t bar;
  const uint32_t b = sm90::smem_u32(&bar);
  if (threadIdx.x == 0) sm90::mbar_init(b, 1);
  __syncthreads();
  if (threadIdx.x == 0 && late_ms > 0) {
    const uint64_t t0 = clock64();
    while (clock64() - t0 < (uint64_t)late_ms * 1000000ull) { /* late_ms/2..late_ms ms */
    }
    sm90::mbar_arrive(b);
  }
  if (threadIdx.x == (late_ms > 0 ? 1 : 0)) {
    sm90::mbar_wait(b, 0);
    *out = 1;
  }
#endif
}

static double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Launches, then polls for up to 30 s; returns the launch's error and its duration. */
static cudaError_t run(int late_ms, int *dout, double *secs) {
  const double t0 = now_s();
  wait_kernel<<<1, 64>>>(late_ms, dout);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  while ((e = cudaStreamQuery(0)) == cudaErrorNotReady && now_s() - t0 < 30) {
  }
  *secs = now_s() - t0;
  return e;
}

int main() {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9) {
    printf("SKIP: no Hopper GPU\n");
    return 0;
  }
  int *dout = nullptr, h = 0;
  if (cudaMalloc(&dout, sizeof(int)) != cudaSuccess) return 2;
  cudaMemset(dout, 0, sizeof(int));
  double secs = 0;
  /* clock64 counts SM cycles (1-2 GHz on H100/H200): 100 M of them are 50-100 ms, well inside the
   * 0.5 s limit. */
  cudaError_t e = run(100, dout, &secs);
  cudaMemcpy(&h, dout, sizeof(int), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess || h != 1) {
    printf("FAIL a wait completed after %.3f s ended with %s (out %d)\n", secs,
           cudaGetErrorString(e), h);
    return 1;
  }
  printf("ok   a wait completed by another thread after %.3f s: the kernel succeeded\n", secs);
  e = run(0, dout, &secs);
  if (e == cudaErrorNotReady) {
    printf("FAIL a wait that never completes still runs after %.1f s\n", secs);
    return 1;
  }
  if (e == cudaSuccess) {
    printf("FAIL a wait that never completes returned success\n");
    return 1;
  }
  printf("ok   a wait that never completes ended the launch after %.3f s: %s\n", secs,
         cudaGetErrorString(e));
  printf("passed 2/2\n");
  return 0;
}
