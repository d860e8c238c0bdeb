/*
 * swiglu on the GPU (include/sluice.h): element-wise over the first U = sum(group_sizes) rows, U
 * read on the device (each block sums the sizes, negative ones as 0, and clamps to M), so a launch
 * sized for M rows does the work of U. 16-byte vectors where F and the pointers allow (8 bf16/f16
 * or 4 f32 values), else one element per thread; f32 arithmetic. Rows past U are zeroed unless
 * skip_unused_rows. Bandwidth-bound: fwd reads 4F and writes 2F bytes a row (bf16), bwd reads 6F
 * and writes 4F. With row weights the forward scales each row by its weight; the backward, which
 * then also sums each row's d weight, runs a warp per row (swiglu_rows_bwd_kernel).
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../core/internal.h"
#include "half_pack.cuh"
#include "swiglu_math.cuh"

namespace sluice_cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
struct Vec; /* V values of T in one 16-byte vector, to and from f32 */
template <>
struct Vec<float> {
  static constexpr int V = 4;
  __device__ static void load(const float *p, float *f) {
    const float4 a = *(const float4 *)p;
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
  }
  __device__ static void store(float *p, const float *f) {
    *(float4 *)p = make_float4(f[0], f[1], f[2], f[3]);
  }
};
template <typename T>
struct Vec {
  static constexpr int V = 8;
  __device__ static void load(const T *p, float *f) { unpack8<T>(*(const int4 *)p, f); }
  __device__ static void store(T *p, const float *f) { *(int4 *)p = pack8<T>(f); }
};

__device__ __forceinline__ float load1(const float *p) { return *p; }
template <typename T>
__device__ __forceinline__ float load1(const T *p) {
  return to_f32(*p);
}
__device__ __forceinline__ void store1(float *p, float v) { *p = v; }
template <typename T>
__device__ __forceinline__ void store1(T *p, float v) {
  *p = HalfPair<T>::one(v);
}

/* U for this launch, in shared memory: sum(max(group_sizes, 0)) clamped to M. */
__device__ int64_t used_rows(const int32_t *gs, int64_t G, int64_t M) {
  __shared__ long long total;
  if (threadIdx.x < 32) {
    long long s = 0;
    for (int64_t g = threadIdx.x; g < G; g += 32) s += max(gs[g], 0);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) total = s < M ? s : M;
  }
  __syncthreads();
  return total;
}

struct Args {
  const void *h, *dact;
  const float *w; /* row weights [M] or NULL */
  float *dw;      /* bwd with row weights: d row weights [M] */
  const int32_t *gs;
  void *out; /* act [M, F] or dh [M, 2F] */
  int64_t M, F, G;
  int skip, vec;
};

/* A grid-stride walk over the used rows' n = F / V vectors (or F elements) per row, as (row,
 * column). */
template <typename T, bool Bwd>
__global__ void __launch_bounds__(kThreads) swiglu_kernel(Args a) {
  const int64_t used = used_rows(a.gs, a.G, a.M), F = a.F;
  const int64_t stride = (int64_t)gridDim.x * kThreads;
  const int64_t first = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  const T *h = (const T *)a.h, *dact = (const T *)a.dact;
  T *out = (T *)a.out;
  const int64_t ow = Bwd ? 2 * F : F; /* output row width */
  if (a.vec) {
    constexpr int V = Vec<T>::V;
    const int64_t n = F / V;
    const int64_t dr = stride / n, dc = stride % n; /* (r, c) advance without a division */
    for (int64_t r = first / n, cb = first % n; r < used; r += dr, cb += dc) {
      if (cb >= n) cb -= n, ++r;
      if (r >= used) break;
      const int64_t c = cb * V;
      float g[V], u[V];
      Vec<T>::load(h + r * 2 * F + c, g);
      Vec<T>::load(h + r * 2 * F + F + c, u);
      if (!Bwd) {
        float o[V];
        const float wr = a.w ? a.w[r] : 1.0f;
#pragma unroll
        for (int v = 0; v < V; ++v) fwd1(g[v], u[v], &o[v]), o[v] *= wr;
        Vec<T>::store(out + r * F + c, o);
      } else {
        float da[V], dg[V], du[V];
        Vec<T>::load(dact + r * F + c, da);
#pragma unroll
        for (int v = 0; v < V; ++v) bwd1(g[v], u[v], da[v], &dg[v], &du[v]);
        Vec<T>::store(out + r * 2 * F + c, dg);
        Vec<T>::store(out + r * 2 * F + F + c, du);
      }
    }
    if (!a.skip) {
      const float z[V] = {};
      for (int64_t i = used * (ow / V) + first; i < a.M * (ow / V); i += stride)
        Vec<T>::store(out + i * V, z);
    }
  } else {
    const int64_t dr = stride / F, dc = stride % F;
    for (int64_t r = first / F, c = first % F; r < used; r += dr, c += dc) {
      if (c >= F) c -= F, ++r;
      if (r >= used) break;
      const float g = load1(h + r * 2 * F + c), u = load1(h + r * 2 * F + F + c);
      if (!Bwd) {
        float o;
        fwd1(g, u, &o);
        store1(out + r * F + c, a.w ? o * a.w[r] : o);
      } else {
        float dg, du;
        bwd1(g, u, load1(dact + r * F + c), &dg, &du);
        store1(out + r * 2 * F + c, dg);
        store1(out + r * 2 * F + F + c, du);
      }
    }
    if (!a.skip)
      for (int64_t i = used * ow + first; i < a.M * ow; i += stride) store1(out + i, 0.0f);
  }
}

/* The backward with row weights: a warp per used row (F / V vectors, or F elements, over the
 * lanes), d h from dact * w[r], and d w[r] = sum_j dact[r, j] * a[r, j] by a warp reduction in a
 * fixed order. Rows past U: d w zero always, d h zero unless skip. */
template <typename T>
__global__ void __launch_bounds__(kThreads) swiglu_rows_bwd_kernel(Args a) {
  const int64_t used = used_rows(a.gs, a.G, a.M), F = a.F;
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (kThreads / 32);
  const int64_t first = ((int64_t)blockIdx.x * kThreads + threadIdx.x) / 32;
  const T *h = (const T *)a.h, *dact = (const T *)a.dact;
  T *dh = (T *)a.out;
  for (int64_t r = first; r < used; r += warps) {
    const float wr = a.w[r];
    float dot = 0.0f;
    if (a.vec) {
      constexpr int V = Vec<T>::V;
      for (int64_t c = (int64_t)lane * V; c < F; c += 32 * V) {
        float g[V], u[V], da[V], dg[V], du[V];
        Vec<T>::load(h + r * 2 * F + c, g);
        Vec<T>::load(h + r * 2 * F + F + c, u);
        Vec<T>::load(dact + r * F + c, da);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          float act;
          fwd1(g[v], u[v], &act);
          dot += da[v] * act;
          bwd1(g[v], u[v], da[v] * wr, &dg[v], &du[v]);
        }
        Vec<T>::store(dh + r * 2 * F + c, dg);
        Vec<T>::store(dh + r * 2 * F + F + c, du);
      }
    } else {
      for (int64_t c = lane; c < F; c += 32) {
        const float g = load1(h + r * 2 * F + c), u = load1(h + r * 2 * F + F + c),
                    da = load1(dact + r * F + c);
        float act, dg, du;
        fwd1(g, u, &act);
        dot += da * act;
        bwd1(g, u, da * wr, &dg, &du);
        store1(dh + r * 2 * F + c, dg);
        store1(dh + r * 2 * F + F + c, du);
      }
    }
    for (int o = 16; o; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) a.dw[r] = dot;
  }
  const int64_t tid = (int64_t)blockIdx.x * kThreads + threadIdx.x, stride = warps * 32;
  for (int64_t r = used + tid; r < a.M; r += stride) a.dw[r] = 0.0f;
  if (!a.skip)
    for (int64_t i = used * 2 * F + tid; i < a.M * 2 * F; i += stride) store1(dh + i, 0.0f);
}

sl_status launch(const sl_swiglu_desc *d, const void *dact, const void *h, const float *w,
                 const int32_t *gs, void *out, float *dw, void *stream, bool bwd) {
  const char *op = bwd ? "swiglu_bwd" : "swiglu";
  sl_status st = sl_swiglu_desc_check(d, op);
  if (st) return st;
  if (!h || !gs || !out || (bwd && !dact))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: a NULL pointer", op);
  if (bwd && w && !dw)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: row_weights given but drow_weights is NULL", op);
  Args a;
  a.h = h, a.dact = dact, a.w = w, a.dw = bwd ? dw : nullptr, a.gs = gs, a.out = out;
  a.M = d->rows, a.F = d->ff, a.G = d->num_groups, a.skip = d->skip_unused_rows != 0;
  const int V = d->dtype == SL_DTYPE_F32 ? 4 : 8;
  const bool aligned = ((uintptr_t)h | (uintptr_t)out | (uintptr_t)dact) % 16 == 0;
  a.vec = a.F % V == 0 && aligned;
  /* enough threads for the worst case's elements (M rows), at most 64 blocks per SM's worth */
  const int64_t work = a.M * (bwd ? 2 * a.F : a.F) / (a.vec ? V : 1);
  int64_t blocks = (work + kThreads - 1) / kThreads;
  blocks = blocks < 1 ? 1 : blocks > 8448 ? 8448 : blocks;
  cudaStream_t s = (cudaStream_t)stream;
  if (bwd && w && a.M > 0) { /* a warp per row, as many warps as rows, at most 8448 blocks */
    int64_t rb = (a.M + kThreads / 32 - 1) / (kThreads / 32);
    rb = rb > 8448 ? 8448 : rb;
    if (d->dtype == SL_DTYPE_F32)
      swiglu_rows_bwd_kernel<float><<<(unsigned)rb, kThreads, 0, s>>>(a);
    else if (d->dtype == SL_DTYPE_BF16)
      swiglu_rows_bwd_kernel<__nv_bfloat16><<<(unsigned)rb, kThreads, 0, s>>>(a);
    else
      swiglu_rows_bwd_kernel<__half><<<(unsigned)rb, kThreads, 0, s>>>(a);
  } else if (a.M > 0 && a.F > 0) {
    if (d->dtype == SL_DTYPE_F32)
      bwd ? swiglu_kernel<float, true><<<(unsigned)blocks, kThreads, 0, s>>>(a)
          : swiglu_kernel<float, false><<<(unsigned)blocks, kThreads, 0, s>>>(a);
    else if (d->dtype == SL_DTYPE_BF16)
      bwd ? swiglu_kernel<__nv_bfloat16, true><<<(unsigned)blocks, kThreads, 0, s>>>(a)
          : swiglu_kernel<__nv_bfloat16, false><<<(unsigned)blocks, kThreads, 0, s>>>(a);
    else
      bwd ? swiglu_kernel<__half, true><<<(unsigned)blocks, kThreads, 0, s>>>(a)
          : swiglu_kernel<__half, false><<<(unsigned)blocks, kThreads, 0, s>>>(a);
  }
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? SL_STATUS_SUCCESS
                          : sl_set_error(SL_STATUS_CUDA_ERROR, "%s: %s", op, cudaGetErrorString(e));
}

}  // namespace
}  // namespace sluice_cuda

extern "C" sl_status sl_swiglu_fwd_cuda(const sl_swiglu_desc *d, const void *h, const float *w,
                                        const int32_t *group_sizes, void *act, void *stream) {
  return sluice_cuda::launch(d, nullptr, h, w, group_sizes, act, nullptr, stream, false);
}

extern "C" sl_status sl_swiglu_bwd_cuda(const sl_swiglu_desc *d, const void *dact, const void *h,
                                        const float *w, const int32_t *group_sizes, void *dh,
                                        float *dw, void *stream) {
  return sluice_cuda::launch(d, dact, h, w, group_sizes, dh, dw, stream, true);
}
