/* bf16 and f16 values to and from f32 on the device: one at a time, and eight at a time (one
 * 16-byte vector of four pairs), shared by the expert-parallel kernels. */
#ifndef SLUICE_CUDA_HALF_PACK_CUH_
#define SLUICE_CUDA_HALF_PACK_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace sluice_cuda {

__device__ __forceinline__ float to_f32(__nv_bfloat16 h) { return __bfloat162float(h); }
__device__ __forceinline__ float to_f32(__half h) { return __half2float(h); }
__device__ __forceinline__ float2 to_f32x2(__nv_bfloat162 h) { return __bfloat1622float2(h); }
__device__ __forceinline__ float2 to_f32x2(__half2 h) { return __half22float2(h); }

template <typename T>
struct HalfPair; /* the two-element type of a 16-bit float type */
template <>
struct HalfPair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  __device__ static __nv_bfloat16 one(float v) { return __float2bfloat16_rn(v); }
  __device__ static type two(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct HalfPair<__half> {
  using type = __half2;
  __device__ static __half one(float v) { return __float2half_rn(v); }
  __device__ static type two(float a, float b) { return __floats2half2_rn(a, b); }
};

/* f[0..8) = the eight T values of v */
template <typename T>
__device__ __forceinline__ void unpack8(int4 v, float *f) {
  const typename HalfPair<T>::type *h = (const typename HalfPair<T>::type *)&v;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 x = to_f32x2(h[q]);
    f[2 * q] = x.x, f[2 * q + 1] = x.y;
  }
}
/* the eight values of f[0..8), rounded to T, as one vector */
template <typename T>
__device__ __forceinline__ int4 pack8(const float *f) {
  int4 v;
  typename HalfPair<T>::type *h = (typename HalfPair<T>::type *)&v;
#pragma unroll
  for (int q = 0; q < 4; ++q) h[q] = HalfPair<T>::two(f[2 * q], f[2 * q + 1]);
  return v;
}

}  // namespace sluice_cuda

#endif  // SLUICE_CUDA_HALF_PACK_CUH_
