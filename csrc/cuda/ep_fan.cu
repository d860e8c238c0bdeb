/*
 * fan_out / fan_in / fan_in_bwd on the GPU (local to one rank; see include/sluice.h).
 *
 * fan_out is a stable counting sort of the (row, slot) pairs by local expert, in three launches:
 *   count  (a block per chunk of whole rows, <= 1024 slots): each slot's rank among the earlier
 * slots of its chunk with the same expert (warps in order, __match_any_sync within a warp) and the
 *          chunk's histogram -> workspace [chunks, L];
 *   scan   (one block): per expert (up to 32 threads each, over segments of the chunks), exclusive
 *          sums over chunks; group_sizes; expert starts
 *          (a block-wide scan over the experts);
 *   place  (a block per chunk): pos = start[e] + chunk base + rank;
 * then the rows are copied (a warp per row, to each of its slots' places) and the rows past the
 * pairs are zeroed. The order is (row, slot) within an expert:
 * deterministic. fan_in / fan_in_bwd: a warp per received row, 8 elements per lane, f32 sums in
 * slot order, kBatch slots' rows loaded at once.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "../core/ep_internal.h"
#include "gmm_common.cuh"
#include "half_pack.cuh"

/* Kernels named sluice_cuda::(anonymous namespace)::..., as the gmm kernels sluice_cuda::sm90::...:
 * a profile (sluice-profile) counts them as sluice's. */
namespace sluice_cuda {
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
    if (t == SL_DTYPE_BF16)
      unpack8<__nv_bfloat16>(v, f);
    else
      unpack8<__half>(v, f);
  }
}
__device__ __forceinline__ void store8(sl_dtype t, void *p, int64_t i, const float *f) {
  if (t == SL_DTYPE_F32) {
    *(float4 *)((float *)p + i) = make_float4(f[0], f[1], f[2], f[3]);
    *(float4 *)((float *)p + i + 4) = make_float4(f[4], f[5], f[6], f[7]);
  } else {
    *(int4 *)((uint16_t *)p + i) = t == SL_DTYPE_BF16 ? pack8<__nv_bfloat16>(f) : pack8<__half>(f);
  }
}
__device__ __forceinline__ float load1(sl_dtype t, const void *p, int64_t i) {
  if (t == SL_DTYPE_F32) return ((const float *)p)[i];
  if (t == SL_DTYPE_BF16) return to_f32(((const __nv_bfloat16 *)p)[i]);
  return to_f32(((const __half *)p)[i]);
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

/* A warp per row: the calling warp's index in the grid, and the grid's warp count. */
__device__ __forceinline__ int64_t first_warp() {
  return ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
}
__device__ __forceinline__ int64_t warps() { return (int64_t)gridDim.x * blockDim.x / 32; }
/* Where slot `lane` of row i went (fan_out's pos), or -1: past k, masked, or not below M. */
__device__ __forceinline__ int slot_pos(const int *pos, int64_t i, int64_t k, int64_t M, int lane) {
  const int p = lane < k ? pos[i * k + lane] : -1;
  return p < M ? p : -1;
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
  __shared__ int tot[kMaxLocalFan];
  __shared__ long long warp_sums[32];
  int *start = a.ws + a.chunks * a.L;
  const int tid = threadIdx.x, lane = tid & 31;
  /* Per expert, exclusive sums over the chunks, relative to the expert's start. tpe threads an
   * expert (consecutive lanes; a power of two <= 32, as many as the block has for its experts: 16
   * for 64 experts), each summing a contiguous segment of the chunks (8 loads in flight), the
   * segments' sums scanned across the tpe lanes, then each segment rewritten from its base. */
  int tpe = 1;
  while (tpe < 32 && (int64_t)tpe * 2 * a.L <= (int64_t)blockDim.x) tpe *= 2;
  const int sub = tid & (tpe - 1);
  const unsigned group = tpe == 32 ? 0xffffffffu : ((1u << tpe) - 1) << (lane & ~(tpe - 1));
  const int64_t seg = (a.chunks + tpe - 1) / tpe, c_lo = min(sub * seg, a.chunks),
                c_hi = min(c_lo + seg, a.chunks);
  for (int64_t e = tid / tpe; e < a.L; e += blockDim.x / tpe) { /* the same e for a whole group */
    int sum = 0;
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 8) {
      int v[8];
#pragma unroll
      for (int b = 0; b < 8; ++b) v[b] = c0 + b < c_hi ? a.ws[(c0 + b) * a.L + e] : 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) sum += v[b];
    }
    int incl = sum;
    for (int o = 1; o < tpe; o <<= 1) {
      const int up = __shfl_up_sync(group, incl, o, tpe);
      if (sub >= o) incl += up;
    }
    int run = incl - sum;
    for (int64_t c0 = c_lo; c0 < c_hi; c0 += 8) {
      int v[8];
#pragma unroll
      for (int b = 0; b < 8; ++b) v[b] = c0 + b < c_hi ? a.ws[(c0 + b) * a.L + e] : 0;
#pragma unroll
      for (int b = 0; b < 8; ++b)
        if (c0 + b < c_hi) a.ws[(c0 + b) * a.L + e] = run, run += v[b];
    }
    if (sub == tpe - 1) tot[e] = incl;
  }
  __syncthreads();
  /* Exclusive sums over the experts: a contiguous run of experts per thread, the threads' sums
   * scanned across the block. fan_place adds start[e] to the chunks' relative bases. */
  const int64_t eseg = (a.L + blockDim.x - 1) / blockDim.x, lo = min(tid * eseg, a.L),
                hi = min(lo + eseg, a.L);
  int mine = 0;
  for (int64_t e = lo; e < hi; ++e) mine += tot[e];
  int run = (int)(block_inclusive_scan(mine, warp_sums) - mine);
  for (int64_t e = lo; e < hi; ++e) {
    start[e] = run;
    run += tot[e];
    /* the pairs of e that land below M (all of them unless max_rows cuts) */
    const int64_t b0 = min((int64_t)start[e], a.M), b1 = min((int64_t)run, a.M);
    a.group_sizes[e] = (int)(b1 - b0);
  }
  if (tid == (int)blockDim.x - 1) start[a.L] = run; /* total */
}

__global__ void __launch_bounds__(1024) fan_place_kernel(FanArgs a) {
  const int tid = threadIdx.x;
  const int64_t c = blockIdx.x, row = c * a.chunk_rows + tid / a.k, j = tid % a.k;
  if (tid < a.chunk_rows * a.k && row < a.N) {
    const int e = slot_expert(a, row, j, nullptr);
    int p = -1;
    if (e >= 0) p = a.ws[a.chunks * a.L + e] + a.ws[c * a.L + e] + a.pos[row * a.k + j];
    if (p >= a.M) p = -1; /* past max_rows: left out */
    a.pos[row * a.k + j] = p;
  }
}

/* xs[pos[i, j]] = x[i]: a warp per row, each 16-byte vector of the row loaded once (four per lane
 * in flight) and stored to every slot's place. Its own launch, so that the whole GPU copies, not
 * one block per chunk of slots (32 blocks for 16k rows of k = 2). */
__global__ void __launch_bounds__(256) fan_copy_kernel(FanArgs a) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = first_warp(); i < a.N; i += warps()) {
    const int p = slot_pos(a.pos, i, a.k, a.M, lane);
    const char *src = a.x + i * a.row_bytes;
    if (a.row_bytes % 16 == 0) {
      const int64_t n = a.row_bytes / 16;
      for (int64_t c0 = 0; c0 < n; c0 += 4 * 32) {
        int4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (c0 + lane + 32 * u < n) v[u] = ((const int4 *)src)[c0 + lane + 32 * u];
        for (int j = 0; j < a.k; ++j) {
          const int pj = __shfl_sync(0xffffffffu, p, j);
          if (pj < 0) continue;
          int4 *dst = (int4 *)(a.xs + (int64_t)pj * a.row_bytes);
#pragma unroll
          for (int u = 0; u < 4; ++u)
            if (c0 + lane + 32 * u < n) dst[c0 + lane + 32 * u] = v[u];
        }
      }
    } else {
      for (int j = 0; j < a.k; ++j) {
        const int pj = __shfl_sync(0xffffffffu, p, j);
        if (pj >= 0) copy_bytes(a.xs + (int64_t)pj * a.row_bytes, src, a.row_bytes, lane);
      }
    }
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
  for (int64_t r = total + first_warp(); r < M; r += warps())
    zero_bytes(rows + r * row_bytes, row_bytes, lane);
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

/* A warp per received row, 8 elements per lane. The slots are taken kBatch at a time: their loads
 * are issued together, then summed in slot order (one load in flight per warp left the HBM ~40%
 * idle). A masked slot is skipped, not added as zero. */
constexpr int kBatch = 4;

/* 8 elements of dtype XT as loaded (one 16-byte vector for 16-bit types, two for f32), converted
 * to f32 only where they are summed. */
struct Raw8 {
  int4 lo, hi;
};
template <int XT>
__device__ __forceinline__ Raw8 load_raw8(const void *p, int64_t i) {
  Raw8 r;
  if (XT == SL_DTYPE_F32) {
    r.lo = ((const int4 *)((const float *)p + i))[0];
    r.hi = ((const int4 *)((const float *)p + i))[1];
  } else {
    r.lo = *(const int4 *)((const uint16_t *)p + i);
  }
  return r;
}
template <int XT>
__device__ __forceinline__ void raw8_to_f32(const Raw8 &r, float *f) {
  if (XT == SL_DTYPE_F32) {
    const int w[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
    for (int q = 0; q < 8; ++q) f[q] = __int_as_float(w[q]);
  } else {
    if (XT == SL_DTYPE_BF16)
      unpack8<__nv_bfloat16>(r.lo, f);
    else
      unpack8<__half>(r.lo, f);
  }
}

/* Slots j0 .. j0 + kBatch - 1 of the warp's row: their places in ys (-1 past k, masked, or out of
 * range) and weights, from lanes j0 + b, and (lanes whose 8 elements at h lie in the row) their
 * rows' 8 elements at h, loaded together. */
template <int XT, bool Load = true>
__device__ __forceinline__ void load_slots(int p, float wt, int j0, int64_t k, const void *ys,
                                           int64_t H, int64_t h, int *pj, float *wj, Raw8 *r) {
#pragma unroll
  for (int b = 0; b < kBatch; ++b) {
    const int src = (j0 + b) & 31;
    pj[b] = __shfl_sync(0xffffffffu, p, src);
    wj[b] = __shfl_sync(0xffffffffu, wt, src);
    if (j0 + b >= k) pj[b] = -1;
  }
  if (Load)
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (pj[b] >= 0 && h < H) r[b] = load_raw8<XT>(ys, (int64_t)pj[b] * H + h);
}

/* XT: a.x_dtype as a template argument, so that the kBatch loads in flight hold their raw 16-byte
 * vectors (4 registers each for 16-bit rows), not a three-way choice. */
template <int XT>
__global__ void __launch_bounds__(256) fan_in_kernel(FanInArgs a) {
  const sl_dtype xt = (sl_dtype)XT;
  const int lane = threadIdx.x & 31;
  const bool vec = a.H % 8 == 0;
  for (int64_t i = first_warp(); i < a.N; i += warps()) {
    const int p = slot_pos(a.pos, i, a.k, a.M, lane);
    const float wt = lane < a.k ? a.w[i * a.k + lane] : 0.0f;
    /* Every lane runs the same trip counts: the shuffles need the whole warp. */
    if (vec) {
      for (int64_t h0 = 0; h0 < a.H; h0 += 256) {
        const int64_t h = h0 + (int64_t)lane * 8;
        const bool in = h < a.H;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int j0 = 0; j0 < a.k; j0 += kBatch) {
          int pj[kBatch];
          float wj[kBatch];
          Raw8 r[kBatch];
          load_slots<XT>(p, wt, j0, a.k, a.ys, a.H, h, pj, wj, r);
#pragma unroll
          for (int b = 0; b < kBatch; ++b)
            if (pj[b] >= 0 && in) {
              float v[8];
              raw8_to_f32<XT>(r[b], v);
              for (int q = 0; q < 8; ++q) acc[q] += wj[b] * v[q];
            }
        }
        if (in) store8(a.out_dtype, a.out, i * a.H + h, acc);
      }
    } else {
      for (int64_t h0 = 0; h0 < a.H; h0 += 32) {
        const int64_t h = h0 + lane;
        float acc = 0.0f;
        for (int j = 0; j < a.k; ++j) {
          const int pj = __shfl_sync(0xffffffffu, p, j);
          const float wj = __shfl_sync(0xffffffffu, wt, j);
          if (pj >= 0 && h < a.H) acc += wj * load1(xt, a.ys, (int64_t)pj * a.H + h);
        }
        if (h < a.H) store1(a.out_dtype, a.out, i * a.H + h, acc);
      }
    }
  }
}

/* dys[pos[i,j]] = w[i,j] * dout[i]; dw[i,j] = <dout[i], ys[pos[i,j]]> (Dot; else no ys read, no
 * dw). A warp per row i: each 256-element slice of dout[i] is read once and serves all k slots,
 * kBatch slots' loads in flight together; lane j keeps slot j's dot product (f32, summed slice by
 * slice in a fixed order). */
template <int XT, bool Dot>
__global__ void __launch_bounds__(256) fan_in_bwd_kernel(FanInArgs a) {
  const sl_dtype xt = (sl_dtype)XT;
  const int lane = threadIdx.x & 31;
  for (int64_t i = first_warp(); i < a.N; i += warps()) {
    const int p = slot_pos(a.pos, i, a.k, a.M, lane);
    const float wt = lane < a.k ? a.w[i * a.k + lane] : 0.0f;
    float dot = 0.0f; /* slot `lane`'s */
    if (a.H % 8 == 0) {
      for (int64_t h0 = 0; h0 < a.H; h0 += 256) {
        const int64_t h = h0 + (int64_t)lane * 8;
        const bool in = h < a.H;
        float g[8];
        if (in) load8(a.out_dtype, a.dout, i * a.H + h, g);
        for (int j0 = 0; j0 < a.k; j0 += kBatch) {
          int pj[kBatch];
          float wj[kBatch], part[kBatch];
          Raw8 r[kBatch];
          load_slots<XT, Dot>(p, wt, j0, a.k, a.ys, a.H, h, pj, wj, r);
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            part[b] = 0.0f;
            if (pj[b] >= 0 && in) {
              float y[8], s[8];
              if (Dot) raw8_to_f32<XT>(r[b], y);
              for (int q = 0; q < 8; ++q) {
                if (Dot) part[b] += g[q] * y[q];
                s[q] = wj[b] * g[q];
              }
              store8(xt, a.dys, (int64_t)pj[b] * a.H + h, s);
            }
          }
          if (Dot) {
            for (int o = 16; o; o >>= 1)
#pragma unroll
              for (int b = 0; b < kBatch; ++b) part[b] += __shfl_xor_sync(0xffffffffu, part[b], o);
#pragma unroll
            for (int b = 0; b < kBatch; ++b)
              if (lane == j0 + b) dot += part[b];
          }
        }
      }
    } else { /* rows not a multiple of 16 bytes: an element per lane, a slot at a time */
      for (int j = 0; j < a.k; ++j) {
        const int pj = __shfl_sync(0xffffffffu, p, j);
        const float wj = __shfl_sync(0xffffffffu, wt, j);
        float part = 0.0f;
        for (int64_t h = lane; pj >= 0 && h < a.H; h += 32) {
          const float g = load1(a.out_dtype, a.dout, i * a.H + h);
          if (Dot) part += g * load1(xt, a.ys, (int64_t)pj * a.H + h);
          store1(xt, a.dys, (int64_t)pj * a.H + h, wj * g);
        }
        if (Dot) {
          for (int o = 16; o; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
          if (lane == j) dot = part;
        }
      }
    }
    if (Dot && lane < a.k) a.dw[i * a.k + lane] = p >= 0 ? dot : 0.0f;
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

/* f(std::integral_constant<int, t>) for the row dtype t: the fan_in kernels' template argument. */
template <class F>
void by_x_dtype(sl_dtype t, F f) {
  if (t == SL_DTYPE_BF16)
    f(std::integral_constant<int, SL_DTYPE_BF16>());
  else if (t == SL_DTYPE_F16)
    f(std::integral_constant<int, SL_DTYPE_F16>());
  else
    f(std::integral_constant<int, SL_DTYPE_F32>());
}

int blocks_for(int64_t warps, int per_block_warps) {
  int64_t b = (warps + per_block_warps - 1) / per_block_warps;
  return (int)(b < 1 ? 1 : b > 1024 ? 1024 : b);
}

}  // namespace
}  // namespace sluice_cuda
using namespace sluice_cuda;

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
  if (a.N > 0) fan_copy_kernel<<<blocks_for(a.N, 8), 256, 0, s>>>(a);
  if (a.M > 0 && !d->skip_unused_rows)
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
  if (a.N > 0)
    by_x_dtype(a.x_dtype, [&](auto xt) {
      fan_in_kernel<decltype(xt)::value><<<blocks_for(a.N, 8), 256, 0, (cudaStream_t)stream>>>(a);
    });
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? SL_STATUS_SUCCESS : fail(e, "fan_in");
}

extern "C" sl_status sl_ep_fan_in_bwd_cuda(const sl_ep_fan_desc *d, const void *dout,
                                           const void *ys, const float *w, const int32_t *pos,
                                           const int32_t *group_sizes, void *dys, float *dw,
                                           void *stream) {
  sl_status st = check(d, "fan_in_bwd");
  if (st) return st;
  if ((ys == nullptr) != (dw == nullptr))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep fan_in_bwd: ys and dw must be both given or both NULL (no dw)");
  cudaStream_t s = (cudaStream_t)stream;
  FanInArgs a = {};
  a.ys = ys, a.dout = dout, a.w = w, a.pos = pos, a.dys = dys, a.dw = dw;
  a.x_dtype = d->x_dtype, a.out_dtype = d->out_dtype;
  a.N = d->num_rows, a.H = d->hidden, a.k = d->topk, a.M = sl_ep_fan_rows(d);
  const int64_t row_bytes = a.H * (int64_t)sl_dtype_size(a.x_dtype);
  if (a.N > 0)
    by_x_dtype(a.x_dtype, [&](auto xt) {
      if (dw)
        fan_in_bwd_kernel<decltype(xt)::value, true><<<blocks_for(a.N, 8), 256, 0, s>>>(a);
      else
        fan_in_bwd_kernel<decltype(xt)::value, false><<<blocks_for(a.N, 8), 256, 0, s>>>(a);
    });
  if (a.M > 0 && !d->skip_unused_rows)
    fan_zero_tail_kernel<<<blocks_for(a.M, 8), 256, 0, s>>>((char *)dys, a.M, row_bytes, nullptr,
                                                            group_sizes, d->num_local_experts);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? SL_STATUS_SUCCESS : fail(e, "fan_in_bwd");
}
