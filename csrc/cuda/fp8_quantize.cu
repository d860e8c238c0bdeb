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
  const int32_t *valid_rows; /* device int32 [batch] or NULL */
  uint8_t *q, *qt;           /* [B, rows, cols], [B, cols, rows]; NULL: not written */
  float *scale;
  long long rows, cols, x_rows; /* rows of the output; rows present in x (<= rows) */
  int br, bc;                   /* block: (1, 128), (128, 1) or (128, 128) */
  int pow2;
  sl_dtype dtype;
};

__device__ __forceinline__ float load_one(const void *x, sl_dtype t, size_t i) {
  if (t == SL_DTYPE_BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16 *>(x)[i]);
  if (t == SL_DTYPE_F16) return __half2float(reinterpret_cast<const __half *>(x)[i]);
  return reinterpret_cast<const float *>(x)[i];
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

/* amax and "any non-finite" -> the block's scale. */
__device__ __forceinline__ float block_scale(float amax, bool bad, int pow2) {
  if (bad) return __int_as_float(0x7fffffff);
  float s = fmaxf(__fmul_rn(amax, kRcpMax), kScaleMin);
  return pow2 ? pow2_ceil(s, amax) : s;
}

__device__ __forceinline__ uint8_t to_e4m3(float v, float s) {
  float y = __fdiv_rn(v, s);
  y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y); /* NaN stays NaN */
  return (uint8_t)__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
}

__global__ void __launch_bounds__(kThreads) quantize_kernel(QArgs a) {
  extern __shared__ float tile[]; /* [kT][kLd], then the block scales */
  float *sc = tile + kT * kLd;    /* per row (1 x 128), per column (128 x 1) or sc[0] (128 x 128) */
  __shared__ float red_amax[kThreads / 32];
  __shared__ int red_bad[kThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long b = blockIdx.z, r0 = (long long)blockIdx.x * kT, c0 = (long long)blockIdx.y * kT;
  const long long R = a.rows, C = a.cols;
  long long live = a.x_rows; /* rows read from x; the rest are zero */
  if (a.valid_rows) live = min(live, (long long)max(a.valid_rows[b], 0));
  const size_t es = a.dtype == SL_DTYPE_F32 ? 4 : 2;
  const char *xb = (const char *)a.x + (size_t)b * a.x_rows * C * es;

  /* load: 8 elements (16 bytes of 16-bit input) per step; float32 input 4 per step */
  const bool vec = (C % 8 == 0) && ((uintptr_t)a.x % 16 == 0) && es == 2;
  for (int i = tid; i < kT * (kT / 8); i += kThreads) {
    const int rr = i / (kT / 8), cc = (i % (kT / 8)) * 8;
    const long long r = r0 + rr, c = c0 + cc;
    float v[8];
    if (vec && r < live && c + 8 <= C) {
      const uint4 u = *reinterpret_cast<const uint4 *>(xb + ((size_t)r * C + c) * 2);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (a.dtype == SL_DTYPE_BF16) {
          __nv_bfloat162 h = *reinterpret_cast<const __nv_bfloat162 *>(&w[k]);
          v[2 * k] = __low2float(h), v[2 * k + 1] = __high2float(h);
        } else {
          __half2 h = *reinterpret_cast<const __half2 *>(&w[k]);
          v[2 * k] = __low2float(h), v[2 * k + 1] = __high2float(h);
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        v[k] = (r < live && c + k < C) ? load_one(xb, a.dtype, (size_t)r * C + c + k) : 0.f;
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
    bool bad = false;
    for (int k = half * 64; k < half * 64 + 64; ++k) {
      const float v = a.br == 1 ? tile[line * kLd + k] : tile[k * kLd + line];
      bad |= !isfinite(v);
      m = fmaxf(m, fabsf(v));
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    bad |= __shfl_xor_sync(0xffffffffu, (int)bad, 1) != 0;
    if (half == 0) sc[line] = block_scale(m, bad, a.pow2);
  } else {
    float m = 0.f;
    bool bad = false;
    for (int i = tid; i < kT * kT; i += kThreads) {
      const float v = tile[(i / kT) * kLd + i % kT];
      bad |= !isfinite(v);
      m = fmaxf(m, fabsf(v));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      bad |= __shfl_xor_sync(0xffffffffu, (int)bad, o) != 0;
    }
    if (lane == 0) red_amax[warp] = m, red_bad[warp] = bad;
    __syncthreads();
    if (tid == 0) {
      float mm = 0.f;
      int bb = 0;
      for (int w = 0; w < kThreads / 32; ++w) mm = fmaxf(mm, red_amax[w]), bb |= red_bad[w];
      sc[0] = block_scale(mm, bb != 0, a.pow2);
    }
  }
  __syncthreads();

  auto scale_of = [&](int rr, int cc) {
    return a.br == 1 ? sc[rr] : (a.bc == 1 ? sc[cc] : sc[0]);
  };
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
      for (int k = 0; k < 16; ++k) v[k] = to_e4m3(tile[rr * kLd + cc + k], scale_of(rr, cc + k));
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
      for (int k = 0; k < 16; ++k) v[k] = to_e4m3(tile[(rr + k) * kLd + cc], scale_of(rr + k, cc));
      if (qvec) {
        *reinterpret_cast<uint4 *>(qb + (size_t)c * R + r) = *reinterpret_cast<const uint4 *>(v);
      } else {
        for (int k = 0; k < 16 && r + k < R; ++k) qb[(size_t)c * R + r + k] = v[k];
      }
    }
  }
}

constexpr size_t kSmemBytes = (size_t)(kT * kLd + kT) * sizeof(float);
constexpr int kMaxDevices = 64;
bool g_smem_raised[kMaxDevices];
std::mutex g_smem_mutex;

} /* namespace */

extern "C" sl_status sl_quantize_fp8_cuda(const sl_quantize_fp8_desc *d, const void *x,
                                          const int32_t *valid_rows, void *q, void *q_t,
                                          float *scale, void *stream) {
  const char *op = "quantize_fp8";
  sl_status st = sl_quantize_fp8_check(d, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->rows == 0 || d->cols == 0 || d->batch == 0) return SL_STATUS_SUCCESS;
  if ((x == NULL && d->x_rows > 0) || scale == NULL || (q == NULL && q_t == NULL))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: x, scale and at least one of q and q_t must be given", op);
  if ((d->rows + kT - 1) / kT > INT32_MAX || (d->cols + kT - 1) / kT > 65535 || d->batch > 65535)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: at most 65535 column tiles of 128 and 65535 problems", op);
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
  a.x = x, a.valid_rows = valid_rows, a.q = (uint8_t *)q, a.qt = (uint8_t *)q_t, a.scale = scale;
  a.rows = d->rows, a.cols = d->cols, a.x_rows = d->x_rows;
  a.br = d->block_rows, a.bc = d->block_cols, a.pow2 = d->power_of_two != 0;
  a.dtype = d->dtype;
  const dim3 grid((unsigned)((d->rows + kT - 1) / kT), (unsigned)((d->cols + kT - 1) / kT),
                  (unsigned)d->batch);
  quantize_kernel<<<grid, kThreads, kSmemBytes, (cudaStream_t)stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: launch failed: %s", op, cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}
