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

#endif /* SLUICE_DEV_PROBE_CUH_ */
