/*
 * fan_out / fan_in / fan_in_bwd on the GPU (local to one rank; see include/sluice.h).
 *
 * fan_out is a stable counting sort of the (row, slot) pairs by local expert, in three launches:
 *   count  (a block per chunk of whole rows, <= 1024 slots): each slot's rank among the earlier
 * slots of its chunk with the same expert (warps in order, __match_any_sync within a warp) and the
 *          chunk's histogram -> workspace [chunks, L];
 *   scan   (one block): per expert, exclusive sums over chunks; group_sizes; expert starts;
 *   place  (a block per chunk): pos = start[e] + chunk base + rank; copy the rows (warp per row);
 * then the rows past the pairs are zeroed. The order is (row, slot) within an expert:
 * deterministic. fan_in / fan_in_bwd: a warp per received row, 8 elements per lane, f32 sums in
 * slot order.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../core/ep_internal.h"

namespace {

constexpr int kMaxLocalFan = 8192;

/* ---- 8 elements at a time through f32 ---- */
__device__ __forceinline__ void load8(sl_dtype t, const void *p, int64_t i, float *f) {
  if (t == SL_DTYPE_F32) {
    const float4 a = *(const float4 *)((const float *)p + i),
                 b = *(const float4 *)((const float *)p + i + 4);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
  } else {
    const int4 v = *(const int4 *)((const uint16_t *)p + i);
    if (t == SL_DTYPE_BF16) {
      const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
      for (int q = 0; q < 4; ++q) {
        const float2 x = __bfloat1622float2(h[q]);
        f[2 * q] = x.x, f[2 * q + 1] = x.y;
      }
    } else {
      const __half2 *h = (const __half2 *)&v;
      for (int q = 0; q < 4; ++q) {
        const float2 x = __half22float2(h[q]);
        f[2 * q] = x.x, f[2 * q + 1] = x.y;
      }
    }
  }
}
__device__ __forceinline__ void store8(sl_dtype t, void *p, int64_t i, const float *f) {
  if (t == SL_DTYPE_F32) {
    *(float4 *)((float *)p + i) = make_float4(f[0], f[1], f[2], f[3]);
    *(float4 *)((float *)p + i + 4) = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    int4 v;
    if (t == SL_DTYPE_BF16) {
      __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
      for (int q = 0; q < 4; ++q) h[q] = __floats2bfloat162_rn(f[2 * q], f[2 * q + 1]);
    } else {
      __half2 *h = (__half2 *)&v;
      for (int q = 0; q < 4; ++q) h[q] = __floats2half2_rn(f[2 * q], f[2 * q + 1]);
    }
    *(int4 *)((uint16_t *)p + i) = v;
  }
}
__device__ __forceinline__ float load1(sl_dtype t, const void *p, int64_t i) {
  if (t == SL_DTYPE_F32) return ((const float *)p)[i];
  if (t == SL_DTYPE_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
  return __half2float(((const __half *)p)[i]);
}
__device__ __forceinline__ void store1(sl_dtype t, void *p, int64_t i, float v) {
  if (t == SL_DTYPE_F32)
    ((float *)p)[i] = v;
  else if (t == SL_DTYPE_BF16)
    ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
  else
    ((__half *)p)[i] = __float2half_rn(v);
}

__device__ __forceinline__ void copy_bytes(char *dst, const char *src, int64_t bytes, int lane) {
  if (bytes % 16 == 0) {
    for (int64_t i = lane; i < bytes / 16; i += 32) ((int4 *)dst)[i] = ((const int4 *)src)[i];
  } else if (bytes % 4 == 0) {
    for (int64_t i = lane; i < bytes / 4; i += 32) ((int *)dst)[i] = ((const int *)src)[i];
  } else {
    for (int64_t i = lane; i < bytes / 2; i += 32) ((short *)dst)[i] = ((const short *)src)[i];
  }
}
__device__ __forceinline__ void zero_bytes(char *dst, int64_t bytes, int lane) {
  if (bytes % 16 == 0) {
    for (int64_t i = lane; i < bytes / 16; i += 32) ((int4 *)dst)[i] = make_int4(0, 0, 0, 0);
  } else if (bytes % 4 == 0) {
    for (int64_t i = lane; i < bytes / 4; i += 32) ((int *)dst)[i] = 0;
  } else {
    for (int64_t i = lane; i < bytes / 2; i += 32) ((short *)dst)[i] = 0;
  }
}

struct FanArgs {
  const char *x;
  const int *idx;
  char *xs;
  int *group_sizes, *pos;
  int *ws; /* [chunks * L] bases, [L] starts, total, bad */
  int64_t N, k, L, M, row_bytes, chunk_rows, chunks;
};

/* The slot's local expert, or -1 (masked, out of range, or repeating an earlier slot of its row).
 */
__device__ __forceinline__ int slot_expert(const FanArgs &a, int64_t row, int64_t j, int *bad) {
  int e = a.idx[row * a.k + j];
  bool ok = e >= 0 && e < a.L;
  for (int64_t i = 0; i < j && ok; ++i) ok = a.idx[row * a.k + i] != e;
  if (!ok) {
    if (bad && e != -1) atomicAdd(bad, 1);
    e = -1;
  }
  return e;
}

__global__ void __launch_bounds__(1024) fan_count_kernel(FanArgs a) {
  __shared__ int cnt[kMaxLocalFan];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < a.L; e += blockDim.x) cnt[e] = 0;
  const int64_t c = blockIdx.x, row = c * a.chunk_rows + tid / a.k, j = tid % a.k;
  const bool mine = tid < a.chunk_rows * a.k && row < a.N;
  const int e = mine ? slot_expert(a, row, j, a.ws + a.chunks * a.L + a.L + 1) : -1;
  __syncthreads();
  int rank = -1;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) { /* warps in slot order */
    if (warp == w) {
      const unsigned peers = __match_any_sync(0xffffffffu, e);
      const int leader = __ffs(peers) - 1;
      int base = (lane == leader && e >= 0) ? cnt[e] : 0;
      base = __shfl_sync(0xffffffffu, base, leader);
      if (e >= 0) rank = base + __popc(peers & ((1u << lane) - 1));
      if (lane == leader && e >= 0) cnt[e] += __popc(peers);
    }
    __syncthreads();
  }
  if (mine) a.pos[row * a.k + j] = rank;
  for (int e2 = tid; e2 < a.L; e2 += blockDim.x) a.ws[c * a.L + e2] = cnt[e2];
}

__global__ void __launch_bounds__(1024) fan_scan_kernel(FanArgs a) {
  int *start = a.ws + a.chunks * a.L;
  for (int64_t e = threadIdx.x; e < a.L; e += blockDim.x) {
    int run = 0;
    for (int64_t c = 0; c < a.chunks; ++c) {
      const int v = a.ws[c * a.L + e];
      a.ws[c * a.L + e] = run;
      run += v;
    }
    a.group_sizes[e] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) { /* L <= 8192: a serial scan is a few microseconds */
    int run = 0;
    for (int64_t e = 0; e < a.L; ++e) {
      start[e] = run;
      run += a.group_sizes[e];
      /* the pairs of e that land below M (all of them unless max_rows cuts) */
      const int64_t lo = min((int64_t)start[e], a.M), hi = min((int64_t)run, a.M);
      a.group_sizes[e] = (int)(hi - lo);
    }
    start[a.L] = run; /* total */
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < a.chunks * a.L; i += blockDim.x) a.ws[i] += start[i % a.L];
}

__global__ void __launch_bounds__(1024) fan_place_kernel(FanArgs a) {
  __shared__ int prow[1024];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t c = blockIdx.x, row = c * a.chunk_rows + tid / a.k, j = tid % a.k;
  const bool mine = tid < a.chunk_rows * a.k && row < a.N;
  int p = -1;
  if (mine) {
    const int e = slot_expert(a, row, j, nullptr);
    if (e >= 0) p = a.ws[c * a.L + e] + a.pos[row * a.k + j];
    if (p >= a.M) p = -1; /* past max_rows: left out */
    a.pos[row * a.k + j] = p;
  }
  prow[tid] = p;
  __syncthreads();
  for (int i = 0; i < 32; ++i) {
    const int s = warp * 32 + i;
    const int q = prow[s];
    if (q < 0) continue;
    const int64_t r = c * a.chunk_rows + s / a.k;
    copy_bytes(a.xs + (int64_t)q * a.row_bytes, a.x + r * a.row_bytes, a.row_bytes, lane);
  }
}

__global__ void fan_zero_tail_kernel(char *rows, int64_t M, int64_t row_bytes, const int *total_p,
                                     const int *group_sizes, int64_t L) {
  int64_t total;
  if (total_p) {
    total = *total_p;
  } else {
    total = 0;
    for (int64_t e = 0; e < L; ++e) total += max(group_sizes[e], 0);
  }
  const int lane = threadIdx.x & 31;
  const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32,
                nw = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t r = total + gw; r < M; r += nw) zero_bytes(rows + r * row_bytes, row_bytes, lane);
}

/* ---- fan_in: a warp per row ---- */
struct FanInArgs {
  const void *ys, *dout;
  const float *w;
  const int *pos;
  void *out, *dys;
  float *dw;
  sl_dtype x_dtype, out_dtype;
  int64_t N, H, k, M;
};

__global__ void __launch_bounds__(256) fan_in_kernel(FanInArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32,
                nw = (int64_t)gridDim.x * blockDim.x / 32;
  const bool vec = a.H % 8 == 0;
  for (int64_t i = gw; i < a.N; i += nw) {
    int p = lane < a.k ? a.pos[i * a.k + lane] : -1;
    if (p >= a.M) p = -1;
    const float wt = lane < a.k ? a.w[i * a.k + lane] : 0.0f;
    /* Every lane runs the same trip counts: the shuffles below need the whole warp. */
    if (vec) {
      for (int64_t h0 = 0; h0 < a.H; h0 += 256) {
        const int64_t h = h0 + (int64_t)lane * 8;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, v[8];
        for (int j = 0; j < a.k; ++j) {
          const int pj = __shfl_sync(0xffffffffu, p, j);
          const float wj = __shfl_sync(0xffffffffu, wt, j);
          if (pj < 0 || h >= a.H) continue;
          load8(a.x_dtype, a.ys, (int64_t)pj * a.H + h, v);
          for (int q = 0; q < 8; ++q) acc[q] += wj * v[q];
        }
        if (h < a.H) store8(a.out_dtype, a.out, i * a.H + h, acc);
      }
    } else {
      for (int64_t h0 = 0; h0 < a.H; h0 += 32) {
        const int64_t h = h0 + lane;
        float acc = 0.0f;
        for (int j = 0; j < a.k; ++j) {
          const int pj = __shfl_sync(0xffffffffu, p, j);
          const float wj = __shfl_sync(0xffffffffu, wt, j);
          if (pj >= 0 && h < a.H) acc += wj * load1(a.x_dtype, a.ys, (int64_t)pj * a.H + h);
        }
        if (h < a.H) store1(a.out_dtype, a.out, i * a.H + h, acc);
      }
    }
  }
}

__global__ void __launch_bounds__(256) fan_in_bwd_kernel(FanInArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32,
                nw = (int64_t)gridDim.x * blockDim.x / 32;
  const bool vec = a.H % 8 == 0;
  for (int64_t i = gw; i < a.N; i += nw) {
    for (int j = 0; j < a.k; ++j) {
      int pj = a.pos[i * a.k + j];
      if (pj >= a.M) pj = -1;
      const float wj = a.w[i * a.k + j];
      float dot = 0.0f;
      if (pj >= 0) {
        if (vec) {
          float g[8], y[8];
          for (int64_t h = (int64_t)lane * 8; h < a.H; h += 256) {
            load8(a.out_dtype, a.dout, i * a.H + h, g);
            load8(a.x_dtype, a.ys, (int64_t)pj * a.H + h, y);
            for (int q = 0; q < 8; ++q) dot += g[q] * y[q], g[q] *= wj;
            store8(a.x_dtype, a.dys, (int64_t)pj * a.H + h, g);
          }
        } else {
          for (int64_t h = lane; h < a.H; h += 32) {
            const float g = load1(a.out_dtype, a.dout, i * a.H + h);
            dot += g * load1(a.x_dtype, a.ys, (int64_t)pj * a.H + h);
            store1(a.x_dtype, a.dys, (int64_t)pj * a.H + h, wj * g);
          }
        }
      }
      for (int o = 16; o; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      if (lane == 0) a.dw[i * a.k + j] = pj >= 0 ? dot : 0.0f;
    }
  }
}

sl_status fail(cudaError_t e, const char *op) {
  return sl_set_error(SL_STATUS_CUDA_ERROR, "ep %s: %s", op, cudaGetErrorString(e));
}

sl_status check(const sl_ep_fan_desc *d, const char *op) {
  if (d == NULL || d->struct_size < sizeof(sl_ep_fan_desc) || d->num_rows < 0 || d->hidden < 0 ||
      d->topk < 1 || d->num_local_experts < 1)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: bad descriptor", op);
  if (d->topk > 32 || d->num_local_experts > kMaxLocalFan)
    return sl_set_error(SL_STATUS_UNSUPPORTED,
                        "ep %s: CUDA needs k <= 32 and L <= %d (k=%lld L=%lld)", op, kMaxLocalFan,
                        (long long)d->topk, (long long)d->num_local_experts);
  return SL_STATUS_SUCCESS;
}

int blocks_for(int64_t warps, int per_block_warps) {
  int64_t b = (warps + per_block_warps - 1) / per_block_warps;
  return (int)(b < 1 ? 1 : b > 1024 ? 1024 : b);
}

}  // namespace

extern "C" sl_status sl_ep_fan_out_cuda(const sl_ep_fan_desc *d, const void *recv_x,
                                        const int32_t *recv_idx, void *xs, int32_t *group_sizes,
                                        int32_t *pos, void *workspace, void *stream) {
  sl_status st = check(d, "fan_out");
  if (st) return st;
  cudaStream_t s = (cudaStream_t)stream;
  FanArgs a;
  a.x = (const char *)recv_x;
  a.idx = recv_idx;
  a.xs = (char *)xs;
  a.group_sizes = group_sizes;
  a.pos = pos;
  a.ws = (int *)workspace;
  a.N = d->num_rows, a.k = d->topk, a.L = d->num_local_experts, a.M = sl_ep_fan_rows(d);
  a.row_bytes = d->hidden * (int64_t)sl_dtype_size(d->x_dtype);
  a.chunk_rows = ep_fan_chunk_rows(a.k);
  a.chunks = (a.N + a.chunk_rows - 1) / a.chunk_rows;
  int *bad = a.ws + a.chunks * a.L + a.L + 1;
  cudaMemsetAsync(bad, 0, sizeof(int), s);
  if (a.chunks > 0) fan_count_kernel<<<(unsigned)a.chunks, 1024, 0, s>>>(a);
  fan_scan_kernel<<<1, 1024, 0, s>>>(a);
  if (a.chunks > 0) fan_place_kernel<<<(unsigned)a.chunks, 1024, 0, s>>>(a);
  if (a.M > 0)
    fan_zero_tail_kernel<<<blocks_for(a.M, 8), 256, 0, s>>>(
        a.xs, a.M, a.row_bytes, a.ws + a.chunks * a.L + a.L, nullptr, 0);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(e, "fan_out");
  if (sl_debug_enabled()) {
    int nbad = 0;
    e = cudaMemcpyAsync(&nbad, bad, sizeof nbad, cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess) e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) return fail(e, "fan_out (SLUICE_DEBUG)");
    if (nbad)
      return sl_set_error(SL_STATUS_INVALID_VALUE,
                          "ep fan_out: %d topk_idx slot(s) outside [-1, %lld) or repeating a local "
                          "expert of the same row (treated as -1)",
                          nbad, (long long)a.L);
  }
  return SL_STATUS_SUCCESS;
}

extern "C" sl_status sl_ep_fan_in_cuda(const sl_ep_fan_desc *d, const void *ys, const float *w,
                                       const int32_t *pos, void *out, void *stream) {
  sl_status st = check(d, "fan_in");
  if (st) return st;
  FanInArgs a = {};
  a.ys = ys, a.w = w, a.pos = pos, a.out = out;
  a.x_dtype = d->x_dtype, a.out_dtype = d->out_dtype;
  a.N = d->num_rows, a.H = d->hidden, a.k = d->topk, a.M = sl_ep_fan_rows(d);
  if (a.N > 0) fan_in_kernel<<<blocks_for(a.N, 8), 256, 0, (cudaStream_t)stream>>>(a);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? SL_STATUS_SUCCESS : fail(e, "fan_in");
}

extern "C" sl_status sl_ep_fan_in_bwd_cuda(const sl_ep_fan_desc *d, const void *dout,
                                           const void *ys, const float *w, const int32_t *pos,
                                           const int32_t *group_sizes, void *dys, float *dw,
                                           void *stream) {
  sl_status st = check(d, "fan_in_bwd");
  if (st) return st;
  cudaStream_t s = (cudaStream_t)stream;
  FanInArgs a = {};
  a.ys = ys, a.dout = dout, a.w = w, a.pos = pos, a.dys = dys, a.dw = dw;
  a.x_dtype = d->x_dtype, a.out_dtype = d->out_dtype;
  a.N = d->num_rows, a.H = d->hidden, a.k = d->topk, a.M = sl_ep_fan_rows(d);
  const int64_t row_bytes = a.H * (int64_t)sl_dtype_size(a.x_dtype);
  if (a.N > 0) fan_in_bwd_kernel<<<blocks_for(a.N, 8), 256, 0, s>>>(a);
  if (a.M > 0)
    fan_zero_tail_kernel<<<blocks_for(a.M, 8), 256, 0, s>>>((char *)dys, a.M, row_bytes, nullptr,
                                                            group_sizes, d->num_local_experts);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? SL_STATUS_SUCCESS : fail(e, "fan_in_bwd");
}
