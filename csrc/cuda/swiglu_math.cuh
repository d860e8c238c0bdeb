/* The SwiGLU's element-wise arithmetic in f32, shared by its kernels (swiglu.cu) and the FP8
 * quantization that computes it on the way (fp8_swiglu.cu), so that both round the same values. */
#ifndef SLUICE_CUDA_SWIGLU_MATH_CUH_
#define SLUICE_CUDA_SWIGLU_MATH_CUH_

#include <cuda_runtime.h>

namespace sluice_cuda {

/* a = silu(g) * u */
__device__ __forceinline__ void fwd1(float g, float u, float *a) {
  *a = g / (1.0f + __expf(-g)) * u;
}
/* d g and d u of a = silu(g) * u, from d a */
__device__ __forceinline__ void bwd1(float g, float u, float da, float *dg, float *du) {
  const float s = 1.0f / (1.0f + __expf(-g));
  *dg = da * u * (s * (1.0f + g * (1.0f - s)));
  *du = da * (g * s);
}

}  // namespace sluice_cuda

#endif  // SLUICE_CUDA_SWIGLU_MATH_CUH_
