/* What the dev/probe CUDA programs share: the sm90 building blocks and a checked CUDA call. */
#ifndef SLUICE_DEV_PROBE_CUH_
#define SLUICE_DEV_PROBE_CUH_

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "../../csrc/cuda/sm90_gmm.cuh"

using namespace sluice_cuda::sm90;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
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

#endif /* SLUICE_DEV_PROBE_CUH_ */
