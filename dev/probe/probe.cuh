/* What the dev CUDA programs (dev/probe/*.cu and the dev/cuda harnesses) share: the sm90 building
 * blocks, a checked CUDA call and random inputs made on the device. */
#ifndef SLUICE_DEV_PROBE_CUH_
#define SLUICE_DEV_PROBE_CUH_

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "../../csrc/cuda/sm90_gmm.cuh"

using namespace sluice_cuda::sm90;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

/* After a launch recorded between e0 and e1: waits for it, checks it, and returns its time in ms
 * and (*mean_cycles) the mean over the grid's sms CTAs of the per-CTA cycle counts in cyc
 * (device). */
static inline float probe_finish(cudaEvent_t e0, cudaEvent_t e1, const long long *cyc, int sms,
                                 double *mean_cycles) {
  CK(cudaEventSynchronize(e1));
  CK(cudaGetLastError());
  float t;
  CK(cudaEventElapsedTime(&t, e0, e1));
  std::vector<long long> h(sms);
  CK(cudaMemcpy(h.data(), cyc, sms * sizeof(long long), cudaMemcpyDeviceToHost));
  double mean = 0;
  for (long long x : h) mean += (double)x;
  *mean_cycles = mean / sms;
  return t;
}

/* A 32-bit hash finaliser: the random inputs' bits. */
__host__ __device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
  return x;
}

/* Random bf16 in [-1, 1) from a hash of the index: the timing inputs are made on the device. */
__global__ void fill_random(__nv_bfloat16 *p, size_t n, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t x = mix32((uint32_t)i * 2654435761u ^ (uint32_t)(i >> 32) * 40503u ^ seed);
    p[i] = __float2bfloat16_rn((float)(x >> 8) * (2.f / 16777216.f) - 1.f);
  }
}

/* max |a - b| / max |b| over n bf16 (res: two floats, zeroed; a NaN in a counts as infinite) */
__global__ void max_diff(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n, float *res) {
  float d = 0.f, r = 0.f;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d = fmaxf(d, isnan(x) ? INFINITY : fabsf(x - y));
    r = fmaxf(r, fabsf(y));
  }
  atomicMax(reinterpret_cast<int *>(&res[0]), __float_as_int(d));
  atomicMax(reinterpret_cast<int *>(&res[1]), __float_as_int(r));
}

/* The implementations in `order` timed in turn (CUDA events around each call; two warm-up rounds,
 * then reps; the order rotated by one every round): the median ms of each, by implementation index
 * (0 for those not in order). */
template <class Run>
static std::vector<double> time_in_turn(const std::vector<int> &order, int reps, Run run) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int n = (int)order.size();
  const int top = *std::max_element(order.begin(), order.end()) + 1;
  std::vector<std::vector<float>> t(top);
  for (int r = 0; r < reps + 2; ++r)
    for (int v = 0; v < n; ++v) {
      const int i = order[(r + v) % n];
      CK(cudaEventRecord(e0));
      run(i);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 2) t[i].push_back(ms);
    }
  CK(cudaGetLastError());
  std::vector<double> med(top, 0.0);
  for (int i : order) {
    std::sort(t[i].begin(), t[i].end());
    med[i] = t[i][t[i].size() / 2];
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return med;
}

#ifdef SLUICE_SM90A_DEVICE
namespace sluice_cuda {
namespace sm90 {
/* m64n128k16 on a 64-register accumulator (N = 128: the probes' 256x128 tile and two column halves
 * of the library's 128x256; sm90 V_SD, session 42, in the history at 8835583) */
#define SL_WGMMA_REGS64 "{" SL_WGMMA_REGS_LO "}"
#define SL_WGMMA_ACC64(d) SL_WGMMA_ACC_LO(d)
#define SL_WGMMA_PRE64 "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
#define SL_WGMMA_POST64 ", %64, %65, p, 1, 1, %66, %67;\n}\n"
SL_WGMMA_FN(wgmma_m64n128k16_bf16, "m64n128k16", "bf16", 64)

__device__ __forceinline__ void fence64(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* 2-CTA clusters (the t2 probe's A-multicast variant; the library's cluster kernels were removed
 * at 46c75da): a TMA box that lands at the same shared-memory offset of every CTA in `mask`,
 * completing bytes on the mbarrier at the same offset in each; an arrive on another CTA's barrier
 * (an address from mapa_shared; .release.cta, as the consumer only read the stage through wgmma
 * and waited for those reads); a barrier of every thread of the cluster. */
__device__ __forceinline__ void tma_load_2d_mc(uint32_t dst, const void *map, int c0, int c1,
                                               uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::"
      "cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t mapa_shared(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                   : "memory");
}
} /* namespace sm90 */
} /* namespace sluice_cuda */

/* Random bf16 in +-[0.5, 2) over `bytes` of shared memory from base, by the whole CTA: the
 * multipliers switch as on real data. */
__device__ __forceinline__ void fill_smem_random(unsigned char *base, int bytes) {
  for (int i = threadIdx.x; i < bytes / 4; i += blockDim.x) {
    const uint32_t x = mix32((uint32_t)i * 2654435761u ^ (blockIdx.x * 40503u));
    const uint32_t lo = 0x3f80u | ((x & 0x7fu)) | ((x & 0x80u) << 8);            /* +-[1, 2) */
    const uint32_t hi = 0x3f00u | ((x >> 8) & 0x7fu) | (((x >> 15) & 1u) << 15); /* +-[0.5, 1) */
    reinterpret_cast<uint32_t *>(base)[i] = lo | (hi << 16);
  }
}
#endif

#endif /* SLUICE_DEV_PROBE_CUH_ */
