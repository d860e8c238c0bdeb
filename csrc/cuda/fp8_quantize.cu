/* FP8 block quantization on the GPU (sluice.h: sl_quantize_fp8_cuda), bit for bit the rule of
 * python/sluice/ops/fp8.py: per block, amax over |x| (float32 subnormals read as zero), scale =
 * max(amax * float32(1/448), 2^-126) or its power-of-two rounding, q = e4m3_rn(clip(x / scale,
 * -448, 448)) with an IEEE division, and a block holding inf or NaN gets scale NaN and q NaN.
 *
 * One CTA per 128 x 128 tile of one problem, 256 threads: the tile is read once (16-byte loads)
 * into shared memory as float32, the block maxima are reduced there (per row for 1 x 128 blocks,
 * per column for 128 x 1, the whole tile for 128 x 128), and q leaves row-major and/or transposed
 * (16-byte stores where the rows allow), so the weight gradient's transposed operands cost no
 * separate pass. The kernel moves 2 + 1 (+ 1) bytes an element and nothing else. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#include "../core/internal.h"
#include "sluice.h"

namespace {

constexpr int kT = 128, kThreads = 256, kLd = kT + 1; /* tile side; smem row stride (floats) */
constexpr float kRcpMax = 1.0f / 448.0f;             /* float32(1/448): fp8.py's RCP_MAX */
constexpr float kScaleMin = 1.17549435e-38f;         /* 2^-126 */

struct QArgs {
  const void *x;
  const int32_t *row_range; /* device int32 [batch][2] (lo, hi) or NULL: rows read from x */
  uint8_t *q, *qt;           /* [B, rows, cols], [B, cols, rows]; NULL: not written */
  float *scale;
  long long batch, rows, cols, x_rows; /* rows of the output; rows present in x (<= rows) */
  int br, bc;                   /* block: (1, 128), (128, 1) or (128, 128) */
  int pow2;
  sl_dtype dtype;
};

__device__ __forceinline__ float load_one(const void *x, sl_dtype t, size_t i) {
  if (t == SL_DTYPE_BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(x)[i]);
  if (t == SL_DTYPE_F16) return __half2float(reinterpret_cast<const __half *>(x)[i]);
  return reinterpret_cast<const float *>(x)[i];
}

/* Two 16-bit values (bf16 or f16, by t) packed in w, as float32. */
__device__ __forceinline__ void unpack2(uint32_t w, sl_dtype t, float &lo, float &hi) {
  if (t == SL_DTYPE_BF16) {
    const __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162 *>(&w);
    lo = __low2float(h), hi = __high2float(h);
  } else {
    const __half2 h = *reinterpret_cast<const __half2 *>(&w);
    lo = __low2float(h), hi = __high2float(h);
  }
}

/* fp8.py's _pow2_ceil: the smallest power of two p >= 2^-126 with 448 p >= amax, from s. */
__device__ __forceinline__ float pow2_ceil(float s, float amax) {
  int e;
  const float m = frexpf(s, &e);
  float p = ldexpf(1.0f, m == 0.5f ? e - 1 : e);
  if (448.0f * p < amax) p *= 2.0f;
  const float half = 0.5f * p;
  return (448.0f * half >= amax && half >= kScaleMin) ? half : p;
}

/* An element's contribution to its block's maximum: |v|, and +inf for inf or NaN, so that one
 * maximum also says whether the block holds a non-finite value (fmaxf alone drops NaN). */
__device__ __forceinline__ float amax_term(float v) {
  const float a = fabsf(v);
  return a <= 3.40282347e38f ? a : __int_as_float(0x7f800000);
}

/* A block's scale from its maximum (amax_term's): NaN for a block with inf or NaN. */
__device__ __forceinline__ float block_scale(float amax, int pow2) {
  if (!(amax <= 3.40282347e38f)) return __int_as_float(0x7fffffff);
  float s = fmaxf(__fmul_rn(amax, kRcpMax), kScaleMin);
  return pow2 ? pow2_ceil(s, amax) : s;
}

/* e4m3_rn(clip(v / s)) with v / s an IEEE division, from rcp = 1/s rounded: v * rcp is within
 * 2.5 units in the last place of the rounded quotient, so it rounds to the same e4m3 value
 * unless an e4m3 tie (mantissa bits 19..0 = 0x80000 in e4m3's normal range) lies within 4 units
 * of it, or it falls in e4m3's subnormal range; only those (about 1e-5 of random values, and
 * small ones) take the division. satfinite clips as the rule does; NaN stays NaN. */
__device__ __forceinline__ uint8_t to_e4m3(float v, float s, float rcp) {
  float y = v * rcp;
  const uint32_t bits = __float_as_uint(y), e = (bits >> 23) & 0xFF;
  if (v != 0.f && (e < 121 || (bits & 0xFFFFF) - 0x7FFFCu < 9u)) y = __fdiv_rn(v, s);
  return (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
}

/* The rows of problem b read from x, [lo, hi): those present and inside row_range[b]; the others
 * read as zero. */
struct Live {
  long long lo, hi;
  __device__ __forceinline__ bool has(long long r) const { return r >= lo && r < hi; }
};
__device__ __forceinline__ Live live_rows(const QArgs &a, long long b) {
  Live l{0, a.x_rows};
  if (a.row_range) {
    l.lo = max((long long)a.row_range[2 * b], 0LL);
    l.hi = min(l.hi, (long long)a.row_range[2 * b + 1]);
  }
  return l;
}

/* The same with the IEEE division for every element (the tile kernel: the reciprocal's test cost
 * it more than it saved). */
__device__ __forceinline__ uint8_t to_e4m3_div(float v, float s) {
  return (uint8_t)__nv_cvt_float_to_fp8(__fdiv_rn(v, s), __NV_SATFINITE, __NV_E4M3);
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(QArgs a) {
  extern __shared__ float tile[]; /* [kT][kLd], then the block scales */
  float *sc = tile + kT * kLd;    /* per row (1 x 128), per column (128 x 1) or sc[0] (128 x 128) */
  __shared__ float red_amax[kThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long b = blockIdx.z, r0 = (long long)blockIdx.x * kT, c0 = (long long)blockIdx.y * kT;
  const long long R = a.rows, C = a.cols;
  const Live live = live_rows(a, b);
  const size_t es = a.dtype == SL_DTYPE_F32 ? 4 : 2;
  const char *xb = (const char *)a.x + (size_t)b * a.x_rows * C * es;

  /* load: 8 elements a step, the 16-bit inputs as one 16-byte load (batching a thread's 8 loads
   * before their use, as the row and column kernels do, cost this kernel 8-20%: 127 registers
   * left 2 CTAs an SM) */
  const bool vec = (C % 8 == 0) && ((uintptr_t)a.x % 16 == 0) && es == 2;
  for (int i = tid; i < kT * (kT / 8); i += kThreads) {
    const int rr = i / (kT / 8), cc = (i % (kT / 8)) * 8;
    const long long r = r0 + rr, c = c0 + cc;
    float v[8];
    if (vec && live.has(r) && c + 8 <= C) {
      const uint4 u = __ldg(reinterpret_cast<const uint4 *>(xb + ((size_t)r * C + c) * 2));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) unpack2(w[k], a.dtype, v[2 * k], v[2 * k + 1]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        v[k] = (live.has(r) && c + k < C) ? load_one(xb, a.dtype, (size_t)r * C + c + k) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float f = fabsf(v[k]) < kScaleMin ? 0.f : v[k]; /* float32 subnormals read as zero */
      tile[rr * kLd + cc + k] = f;
    }
  }
  __syncthreads();

  /* block maxima: two threads per row or column (64 elements each), or the whole tile */
  if (a.br == 1 || a.bc == 1) {
    const int line = tid >> 1, half = tid & 1;
    float m = 0.f;
    for (int k = half * 64; k < half * 64 + 64; ++k)
      m = fmaxf(m, amax_term(a.br == 1 ? tile[line * kLd + k] : tile[k * kLd + line]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    if (half == 0) sc[line] = block_scale(m, a.pow2);
  } else {
    float m = 0.f;
    for (int i = tid; i < kT * kT; i += kThreads) m = fmaxf(m, amax_term(tile[(i / kT) * kLd + i % kT]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_amax[warp] = m;
    __syncthreads();
    if (tid == 0) {
      float mm = 0.f;
      for (int w = 0; w < kThreads / 32; ++w) mm = fmaxf(mm, red_amax[w]);
      sc[0] = block_scale(mm, a.pow2);
    }
  }
  __syncthreads();

  auto at = [&](int rr, int cc) { return a.br == 1 ? rr : (a.bc == 1 ? cc : 0); };
  /* the scales: [rows, ceil(C/128)], [ceil(R/128), C] or [ceil(R/128), ceil(C/128)] */
  float *sb = a.scale + (size_t)b * (a.br == 1 ? R : (R + 127) / 128) *
                            (a.bc == 1 ? C : (C + 127) / 128);
  if (a.br == 1) {
    if (tid < kT && r0 + tid < R) sb[(size_t)(r0 + tid) * ((C + 127) / 128) + blockIdx.y] = sc[tid];
  } else if (a.bc == 1) {
    if (tid < kT && c0 + tid < C) sb[(size_t)blockIdx.x * C + c0 + tid] = sc[tid];
  } else if (tid == 0) {
    sb[(size_t)blockIdx.x * ((C + 127) / 128) + blockIdx.y] = sc[0];
  }

  /* q [rows, cols]: 16 bytes of a row per step */
  if (a.q) {
    uint8_t *qb = a.q + (size_t)b * R * C;
    const bool qvec = C % 16 == 0 && ((uintptr_t)a.q % 16 == 0);
    for (int i = tid; i < kT * (kT / 16); i += kThreads) {
      const int rr = i / (kT / 16), cc = (i % (kT / 16)) * 16;
      const long long r = r0 + rr, c = c0 + cc;
      if (r >= R || c >= C) continue;
      uint8_t v[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int i = at(rr, cc + k);
        v[k] = to_e4m3_div(tile[rr * kLd + cc + k], sc[i]);
      }
      if (qvec) {
        *reinterpret_cast<uint4 *>(qb + (size_t)r * C + c) = *reinterpret_cast<const uint4 *>(v);
      } else {
        for (int k = 0; k < 16 && c + k < C; ++k) qb[(size_t)r * C + c + k] = v[k];
      }
    }
  }
  /* q_t [cols, rows]: 16 bytes of a column per step */
  if (a.qt) {
    uint8_t *qb = a.qt + (size_t)b * R * C;
    const bool qvec = R % 16 == 0 && ((uintptr_t)a.qt % 16 == 0);
    for (int i = tid; i < kT * (kT / 16); i += kThreads) {
      const int cc = i / (kT / 16), rr = (i % (kT / 16)) * 16;
      const long long r = r0 + rr, c = c0 + cc;
      if (r >= R || c >= C) continue;
      uint8_t v[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int i = at(rr + k, cc);
        v[k] = to_e4m3_div(tile[(rr + k) * kLd + cc], sc[i]);
      }
      if (qvec) {
        *reinterpret_cast<uint4 *>(qb + (size_t)c * R + r) = *reinterpret_cast<const uint4 *>(v);
      } else {
        for (int k = 0; k < 16 && r + k < R; ++k) qb[(size_t)c * R + r + k] = v[k];
      }
    }
  }
}


/* Four elements of row r from column c (c + 4 <= C) as float32, subnormals flushed; vec: one 8-byte
 * (16-bit x) or 16-byte (float32 x) load. */
__device__ __forceinline__ void load4(const QArgs &a, const char *xb, long long r, long long c,
                                      bool vec, float (&v)[4]) {
  const long long C = a.cols;
  if (vec) {
    if (a.dtype == SL_DTYPE_F32) {
      const float4 f = __ldg(reinterpret_cast<const float4 *>(xb + ((size_t)r * C + c) * 4));
      v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
      const uint2 u = __ldg(reinterpret_cast<const uint2 *>(xb + ((size_t)r * C + c) * 2));
      unpack2(u.x, a.dtype, v[0], v[1]);
      unpack2(u.y, a.dtype, v[2], v[3]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = c + k < C ? load_one(xb, a.dtype, (size_t)r * C + c + k) : 0.f;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = fabsf(v[k]) < kScaleMin ? 0.f : v[k];
}

/* 1 x 128 blocks written row-major: a warp per block (128 columns of a row), 4 elements a lane, no
 * shared memory. CTA (x, y, z) takes rows [32 x, 32 x + 32) of column block y of problem z, each
 * warp kRowBlocks rows at once so that their loads are in flight together (and no index needs a
 * division). The activations' layout, read and written at the speed of the memory. */
constexpr int kRowBlocks = 4, kRowsPerCta = kRowBlocks * kThreads / 32;
__global__ void __launch_bounds__(kThreads) quantize_rows_kernel(QArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long R = a.rows, C = a.cols, nbc = (C + 127) / 128, b = blockIdx.z;
  const long long r0 = (long long)blockIdx.x * kRowsPerCta + warp * kRowBlocks;
  const long long c = (long long)blockIdx.y * 128 + lane * 4;
  const size_t es = a.dtype == SL_DTYPE_F32 ? 4 : 2;
  const char *xb = (const char *)a.x + (size_t)b * a.x_rows * C * es;
  const bool vec = C % 4 == 0 && (uintptr_t)a.x % (4 * es) == 0 && c + 4 <= C;
  const Live live = live_rows(a, b);
  float v[kRowBlocks][4];
#pragma unroll
  for (int u = 0; u < kRowBlocks; ++u) {
    if (live.has(r0 + u) && c < C)
      load4(a, xb, r0 + u, c, vec, v[u]);
    else
      v[u][0] = v[u][1] = v[u][2] = v[u][3] = 0.f;
  }
#pragma unroll
  for (int u = 0; u < kRowBlocks; ++u) {
    const long long r = r0 + u;
    if (r >= R) break;
    float m = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) m = fmaxf(m, amax_term(v[u][k]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float sc = block_scale(m, a.pow2), rcp = __frcp_rn(sc);
    if (lane == 0) a.scale[((size_t)b * R + r) * nbc + blockIdx.y] = sc;
    if (c >= C) continue;
    uint8_t q[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) q[k] = to_e4m3(v[u][k], sc, rcp);
    uint8_t *dst = a.q + ((size_t)b * R + r) * C + c;
    if (C % 4 == 0 && (uintptr_t)a.q % 4 == 0 && c + 4 <= C)
      *reinterpret_cast<uint32_t *>(dst) = *reinterpret_cast<const uint32_t *>(q);
    else
      for (int k = 0; k < 4 && c + k < C; ++k) dst[k] = q[k];
  }
}

/* 128 x 1 blocks (the weight gradient's operands): tiles of 128 rows x 32 columns through shared
 * memory, q_t written 16 rows (bytes) of a column a thread, q 16 columns of a row a thread. */
constexpr int kCols = 32;
__global__ void __launch_bounds__(kThreads) quantize_cols_kernel(QArgs a) {
  __shared__ float tile[kT][kCols + 1];
  __shared__ float sc[kCols], rc[kCols];
  const int tid = threadIdx.x;
  const long long b = blockIdx.z, r0 = (long long)blockIdx.x * kT, c0 = (long long)blockIdx.y * kCols;
  const long long R = a.rows, C = a.cols;
  const Live live = live_rows(a, b);
  const size_t es = a.dtype == SL_DTYPE_F32 ? 4 : 2;
  const char *xb = (const char *)a.x + (size_t)b * a.x_rows * C * es;
  const bool vec = C % 4 == 0 && (uintptr_t)a.x % (4 * es) == 0;
  /* 128 x 32 elements, 4 a step, 4 steps a thread; the loads first, then the stores */
  float v[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = tid + j * kThreads, rr = i / (kCols / 4), cc = (i % (kCols / 4)) * 4;
    const long long r = r0 + rr, c = c0 + cc;
    if (live.has(r) && c < C)
      load4(a, xb, r, c, vec && c + 4 <= C, v[j]);
    else
      v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = tid + j * kThreads, rr = i / (kCols / 4), cc = (i % (kCols / 4)) * 4;
#pragma unroll
    for (int k = 0; k < 4; ++k) tile[rr][cc + k] = v[j][k];
  }
  __syncthreads();
  { /* column c's maximum: 8 threads, rows part, part + 8, ... */
    const int c = tid >> 3, part = tid & 7;
    float m = 0.f;
#pragma unroll
    for (int k = 0; k < kT / 8; ++k) m = fmaxf(m, amax_term(tile[k * 8 + part][c]));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (part == 0) sc[c] = block_scale(m, a.pow2), rc[c] = __frcp_rn(sc[c]);
  }
  __syncthreads();
  if (tid < kCols && c0 + tid < C) a.scale[((size_t)b * ((R + 127) / 128) + blockIdx.x) * C + c0 + tid] = sc[tid];
  if (a.qt) { /* column c, rows [16 part, 16 part + 16) */
    const int c = tid >> 3, part = tid & 7;
    const long long r = r0 + 16 * part;
    if (c0 + c < C && r < R) {
      uint8_t q[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) q[k] = to_e4m3(tile[16 * part + k][c], sc[c], rc[c]);
      uint8_t *dst = a.qt + ((size_t)b * C + c0 + c) * R + r;
      if (R % 16 == 0 && (uintptr_t)a.qt % 16 == 0)
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(q);
      else
        for (int k = 0; k < 16 && r + k < R; ++k) dst[k] = q[k];
    }
  }
  if (a.q) { /* row rr, columns [16 h, 16 h + 16) */
    const int rr = tid >> 1, h = tid & 1;
    const long long r = r0 + rr, c = c0 + 16 * h;
    if (r < R && c < C) {
      uint8_t q[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) q[k] = to_e4m3(tile[rr][16 * h + k], sc[16 * h + k], rc[16 * h + k]);
      uint8_t *dst = a.q + ((size_t)b * R + r) * C + c;
      if (C % 16 == 0 && (uintptr_t)a.q % 16 == 0)
        *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(q);
      else
        for (int k = 0; k < 16 && c + k < C; ++k) dst[k] = q[k];
    }
  }
}

constexpr size_t kSmemBytes = (size_t)(kT * kLd + kT) * sizeof(float);
constexpr int kMaxDevices = 64;
bool g_smem_raised[kMaxDevices];
std::mutex g_smem_mutex;

} /* namespace */

extern "C" sl_status sl_quantize_fp8_cuda(const sl_quantize_fp8_desc *d, const void *x,
                                          const int32_t *row_range, void *q, void *q_t,
                                          float *scale, void *stream) {
  const char *op = "quantize_fp8";
  sl_status st = sl_quantize_fp8_check(d, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->rows == 0 || d->cols == 0 || d->batch == 0) return SL_STATUS_SUCCESS;
  if ((x == NULL && d->x_rows > 0) || scale == NULL || (q == NULL && q_t == NULL))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: x, scale and at least one of q and q_t must be given", op);
  if ((d->rows + kT - 1) / kT > INT32_MAX || (d->cols + kCols - 1) / kCols > 65535 ||
      d->batch > 65535)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: at most 65535 column tiles of 32 and 65535 problems", op);
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess && dev >= 0 && dev < kMaxDevices) {
    std::lock_guard<std::mutex> lock(g_smem_mutex);
    if (!g_smem_raised[dev]) {
      err = cudaFuncSetAttribute(quantize_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kSmemBytes);
      if (err == cudaSuccess) g_smem_raised[dev] = true;
    }
  }
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: %s", op, cudaGetErrorString(err));
  QArgs a;
  a.x = x, a.row_range = row_range, a.q = (uint8_t *)q, a.qt = (uint8_t *)q_t, a.scale = scale;
  a.batch = d->batch, a.rows = d->rows, a.cols = d->cols, a.x_rows = d->x_rows;
  a.br = d->block_rows, a.bc = d->block_cols, a.pow2 = d->power_of_two != 0;
  a.dtype = d->dtype;
  cudaStream_t s = (cudaStream_t)stream;
  if (a.br == 1 && a.qt == nullptr) {
    const dim3 grid((unsigned)((d->rows + kRowsPerCta - 1) / kRowsPerCta),
                    (unsigned)((d->cols + 127) / 128), (unsigned)d->batch);
    quantize_rows_kernel<<<grid, kThreads, 0, s>>>(a);
  } else if (a.bc == 1) {
    const dim3 grid((unsigned)((d->rows + kT - 1) / kT), (unsigned)((d->cols + kCols - 1) / kCols),
                    (unsigned)d->batch);
    quantize_cols_kernel<<<grid, kThreads, 0, s>>>(a);
  } else {
    const dim3 grid((unsigned)((d->rows + kT - 1) / kT), (unsigned)((d->cols + kT - 1) / kT),
                    (unsigned)d->batch);
    quantize_kernel<<<grid, kThreads, kSmemBytes, s>>>(a);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: launch failed: %s", op, cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}
