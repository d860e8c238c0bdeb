/* The GPU tests' check of a CUDA runtime call: prints the call, file and line, and exits 2. */
#ifndef SLUICE_TESTS_GPU_CUDA_OK_H_
#define SLUICE_TESTS_GPU_CUDA_OK_H_

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CUDA_OK(x)                                                                        \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                            \
    }                                                                                     \
  } while (0)

#endif /* SLUICE_TESTS_GPU_CUDA_OK_H_ */
