/* FP8 block quantization on the GPU (sluice.h: sl_quantize_fp8_cuda), bit for bit the rule of
 * python/sluice/ops/fp8.py: per block, amax over |x| (zeros and float32 subnormals read as +0),
 * scale = max(amax * float32(1/448), 2^-126) or its power-of-two rounding, rcp = 1 / scale
 * correctly rounded, q = e4m3_rn(clip(x * rcp, -448, 448)), and a block holding inf or NaN gets
 * scale NaN and q NaN.
 *
 * Three kernels, each moving 2 + 1 (+ 1) bytes an element and nothing else:
 *   quantize_rows16_kernel   16-bit x, 1 x 128 blocks, q row-major (the activations)
 *   quantize_tile16_kernel   16-bit x, 128 x 1 or 128 x 128 blocks, q and/or q_t (the weight
 *                            gradient's transposed operands, the weights in both layouts), and
 *                            both layouts of an activation (fp8_tile.cuh; its source here:
 *                            LoadRows)
 *   quantize_kernel          everything else (float32 x, widths not a multiple of 8, unaligned
 *                            pointers, 1 x 128 blocks with q_t): a 128 x 128 tile in shared
 *                            memory as float32, a product by the block's reciprocal per element.
 * sl_quantize_fp8_both_cuda's gather (rows picked by index) is read where a tile kernel or the
 * general one loads its rows: the fanned-out copies of token rows are quantized without being
 * written first. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "fp8_tile.cuh"

namespace sluice_cuda {
namespace {

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

/* e4m3_rn(clip(v * rcp)) (satfinite clips as the rule does; NaN stays NaN); v already flushed. */
__device__ __forceinline__ uint8_t to_e4m3_mul(float v, float rcp) {
  return (uint8_t)__nv_cvt_float_to_fp8(__fmul_rn(v, rcp), __NV_SATFINITE, __NV_E4M3);
}

/* The general kernel: one CTA per 128 x 128 tile of one problem, 256 threads; the tile is read once
 * into shared memory as float32, the block maxima are reduced there (per row for 1 x 128 blocks,
 * per column for 128 x 1, the whole tile for 128 x 128), and q leaves row-major and/or transposed
 * (16-byte stores where the rows allow). */
__global__ void __launch_bounds__(kThreads) quantize_kernel(QArgs a) {
  extern __shared__ float tile[]; /* [kT][kLd], then the block scales and their reciprocals */
  float *sc = tile + kT * kLd;    /* per row (1 x 128), per column (128 x 1) or sc[0] (128 x 128) */
  float *rc = sc + kT;
  __shared__ float red_amax[kThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const TileAt t = tile_at(a);
  const long long b = blockIdx.z, rt = t.rt, r0 = rt * kT, c0 = (long long)t.ct * kT;
  const long long R = a.rows, C = a.cols;
  const Live live = live_rows(a, b);
  const size_t es = a.dtype == SL_DTYPE_F32 ? 4 : 2;
  const char *xb = (const char *)a.x + (size_t)b * x_rows_per_problem(a) * C * es;

  /* load: 8 elements a step, the 16-bit inputs as one 16-byte load (batching a thread's 8 loads
   * before their use, as the row and column kernels do, cost this kernel 8-20%: 127 registers
   * left 2 CTAs an SM) */
  const bool vec = (C % 8 == 0) && ((uintptr_t)a.x % 16 == 0) && es == 2;
  for (int i = tid; i < kT * (kT / 8); i += kThreads) {
    const int rr = i / (kT / 8), cc = (i % (kT / 8)) * 8;
    const long long c = c0 + cc, r = live.has(r0 + rr) ? x_row(a, b, r0 + rr) : -1;
    float v[8];
    if (vec && r >= 0 && c + 8 <= C) {
      const uint4 u = __ldg(reinterpret_cast<const uint4 *>(xb + ((size_t)r * C + c) * 2));
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) unpack2(w[k], a.dtype, v[2 * k], v[2 * k + 1]);
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        v[k] = (r >= 0 && c + k < C) ? load_one(xb, a.dtype, (size_t)r * C + c + k) : 0.f;
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
    if (half == 0) sc[line] = block_scale(m, a.pow2), rc[line] = __frcp_rn(sc[line]);
  } else {
    float m = 0.f;
    for (int i = tid; i < kT * kT; i += kThreads)
      m = fmaxf(m, amax_term(tile[(i / kT) * kLd + i % kT]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red_amax[warp] = m;
    __syncthreads();
    if (tid == 0) {
      float mm = 0.f;
      for (int w = 0; w < kThreads / 32; ++w) mm = fmaxf(mm, red_amax[w]);
      sc[0] = block_scale(mm, a.pow2), rc[0] = __frcp_rn(sc[0]);
    }
  }
  __syncthreads();

  auto at = [&](int rr, int cc) { return a.br == 1 ? rr : (a.bc == 1 ? cc : 0); };
  /* the scales: [rows, ceil(C/128)], [ceil(R/128), C] or [ceil(R/128), ceil(C/128)] */
  float *sb =
      a.scale + (size_t)b * (a.br == 1 ? R : (R + 127) / 128) * (a.bc == 1 ? C : (C + 127) / 128);
  if (a.br == 1) {
    if (tid < kT && r0 + tid < R) sb[(size_t)(r0 + tid) * ((C + 127) / 128) + t.ct] = sc[tid];
  } else if (a.bc == 1) {
    if (tid < kT && c0 + tid < C) sb[(size_t)rt * C + c0 + tid] = sc[tid];
  } else if (tid == 0) {
    sb[(size_t)rt * ((C + 127) / 128) + t.ct] = sc[0];
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
        v[k] = to_e4m3_mul(tile[rr * kLd + cc + k], rc[i]);
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
        v[k] = to_e4m3_mul(tile[(rr + k) * kLd + cc], rc[i]);
      }
      if (qvec) {
        *reinterpret_cast<uint4 *>(qb + (size_t)c * R + r) = *reinterpret_cast<const uint4 *>(v);
      } else {
        for (int k = 0; k < 16 && r + k < R; ++k) qb[(size_t)c * R + r + k] = v[k];
      }
    }
  }
}

/* 1 x 128 blocks written row-major: 16 lanes per block (16 bytes a lane), each half-warp 4 rows,
 * all 4 loads in flight before their use; a CTA takes 64 rows of one column block of problem
 * blockIdx.z (tile_at, whole rows where they fit). */
constexpr int kRowsPerHalf = 4, kRowsPerCta = kRowsPerHalf * 2 * (kThreads / 32);
template <sl_dtype T>
__global__ void __launch_bounds__(kThreads) quantize_rows16_kernel(QArgs a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hl = lane & 15;
  const long long R = a.rows, C = a.cols, nbc = (C + 127) / 128, b = blockIdx.z;
  const TileAt t = tile_at(a);
  const long long r0 = t.rt * kRowsPerCta + (warp * 2 + (lane >> 4)) * kRowsPerHalf;
  const long long c = (long long)t.ct * 128 + hl * 8;
  const uint16_t *xb = (const uint16_t *)a.x + (size_t)b * a.x_rows * C;
  const Live live = live_rows(a, b);
  uint4 v[kRowsPerHalf];
#pragma unroll
  for (int u = 0; u < kRowsPerHalf; ++u) {
    v[u] = make_uint4(0u, 0u, 0u, 0u);
    if (live.has(r0 + u) && c < C)
      v[u] = __ldg(reinterpret_cast<const uint4 *>(xb + (r0 + u) * C + c));
  }
#pragma unroll
  for (int u = 0; u < kRowsPerHalf; ++u) {
    const long long r = r0 + u;
    uint32_t m = __vimax3_u16x2(v[u].x & kMag2, v[u].y & kMag2, v[u].z & kMag2);
    m = __vmaxu2(m, v[u].w & kMag2);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) m = __vmaxu2(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (r >= R) continue;
    const BlockScale bs = make_scale(amax_of<T>(max_halves(m)), a.pow2);
    if (hl == 0) a.scale[((size_t)b * R + r) * nbc + t.ct] = bs.s;
    if (c >= C) continue;
    const uint2 o =
        make_uint2(q4<T>(v[u].x, v[u].y, bs, bs, bs, bs), q4<T>(v[u].z, v[u].w, bs, bs, bs, bs));
    *reinterpret_cast<uint2 *>(a.q + ((size_t)b * R + r) * C + c) = o;
  }
}

/* The tile kernel's source for sl_quantize_fp8_cuda and sl_quantize_fp8_both_cuda: x's rows (or
 * the gathered ones) by cp.async, 16 bytes a copy; rows not read from x are zero-filled. */
struct LoadRows {
  template <sl_dtype T, bool FULL>
  __device__ __forceinline__ void fill(const QArgs &a, uint16_t *tile, long long b, long long r0,
                                       long long c0, Live, Live live) const {
    const int tid = threadIdx.x, cc = (tid & 15) * 8;
    const long long C = a.cols;
    const uint16_t *xb = (const uint16_t *)a.x + (size_t)b * x_rows_per_problem(a) * C;
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(tile + (tid >> 4) * kT + cc);
#pragma unroll
    for (int j = 0; j < kT * kT / 8 / kThreads; ++j) {
      const long long rr = r0 + (tid >> 4) + 16 * j, c = c0 + cc;
      long long r;
      bool in;
      if (FULL) {
        r = x_row(a, b, rr), in = r >= 0;
      } else {
        r = live.has(rr) ? x_row(a, b, rr) : -1, in = r >= 0 && c < C;
      }
      const uint16_t *src = in ? xb + r * C + c : xb;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst + j * 16 * kT * 2),
                   "l"(src), "r"(in ? 16 : 0));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  }
};

constexpr size_t kSmemBytes = (size_t)(kT * kLd + 2 * kT) * sizeof(float);

/* The checks both entry points share, the general kernel's shared-memory opt-in, and x's
 * arguments (its pointers are checked by the callers, after zero sizes have returned). */
sl_status prepare(const sl_quantize_fp8_desc *d, const void *x, const int32_t *row_range,
                  const char *op, QArgs *a) {
  sl_status st = sl_quantize_fp8_check(d, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if ((st = check_tiles(d, op)) != SL_STATUS_SUCCESS) return st;
  static SmemOptIn general;
  if ((st = opt_in_smem(general, (int)kSmemBytes, op, quantize_kernel)) != SL_STATUS_SUCCESS)
    return st;
  *a = QArgs{};
  a->x = x, a->row_range = row_range;
  a->batch = d->batch, a->rows = d->rows, a->cols = d->cols, a->x_rows = d->x_rows;
  a->br = d->block_rows, a->bc = d->block_cols, a->pow2 = d->power_of_two != 0;
  a->dtype = d->dtype;
  return SL_STATUS_SUCCESS;
}

/* 16-bit x whose rows are 16-byte aligned, and aligned outputs: the fast kernels' inputs. */
bool fast16(const QArgs &a, const void *q, const void *q_t) {
  return (a.dtype == SL_DTYPE_BF16 || a.dtype == SL_DTYPE_F16) && a.cols % 8 == 0 &&
         (uintptr_t)a.x % 16 == 0 && (uintptr_t)q % 16 == 0 && (uintptr_t)q_t % 16 == 0;
}

/* sl_quantize_fp8_cuda's work, with an optional gather (a.gather, a.src_rows already set), after
 * the checks: the fast kernels for 16-bit x, the general one for the rest (float32 x, odd widths,
 * 1 x 128 blocks with q_t) and for gathered 1 x 128 or 128 x 128 blocks. */
sl_status quantize_rows(const sl_quantize_fp8_desc *d, QArgs a, void *q, void *q_t, float *scale,
                        cudaStream_t s, const char *op) {
  a.q = (uint8_t *)q, a.qt = (uint8_t *)q_t, a.scale = scale;
  const bool fast = fast16(a, q, q_t), bf16 = a.dtype == SL_DTYPE_BF16;
  const long long col_tiles = (d->cols + kT - 1) / kT, row_tiles = (d->rows + kT - 1) / kT;
  if (fast && a.br == 1 && a.qt == nullptr && !a.gather) {
    const dim3 grid = tile_grid(a, (d->rows + kRowsPerCta - 1) / kRowsPerCta, col_tiles, true);
    if (bf16)
      quantize_rows16_kernel<SL_DTYPE_BF16><<<grid, kThreads, 0, s>>>(a);
    else
      quantize_rows16_kernel<SL_DTYPE_F16><<<grid, kThreads, 0, s>>>(a);
  } else if (fast && a.br == 128 && (a.bc == 1 || !a.gather)) {
    const dim3 tiles = tile_grid(a, row_tiles, col_tiles, a.bc != 1 && !a.gather);
    if (a.bc == 1)
      bf16
          ? quantize_tile16_kernel<SL_DTYPE_BF16, kPerCol><<<tiles, kThreads, 0, s>>>(a, LoadRows{})
          : quantize_tile16_kernel<SL_DTYPE_F16, kPerCol><<<tiles, kThreads, 0, s>>>(a, LoadRows{});
    else
      bf16 ? quantize_tile16_kernel<SL_DTYPE_BF16, kWhole><<<tiles, kThreads, 0, s>>>(a, LoadRows{})
           : quantize_tile16_kernel<SL_DTYPE_F16, kWhole><<<tiles, kThreads, 0, s>>>(a, LoadRows{});
  } else {
    const dim3 tiles = tile_grid(a, row_tiles, col_tiles, false);
    quantize_kernel<<<tiles, kThreads, kSmemBytes, s>>>(a);
  }
  return launched(op);
}

}  // namespace
}  // namespace sluice_cuda

using namespace sluice_cuda;  // the entry points below, in C linkage

extern "C" sl_status sl_quantize_fp8_cuda(const sl_quantize_fp8_desc *d, const void *x,
                                          const int32_t *row_range, void *q, void *q_t,
                                          float *scale, void *stream) {
  const char *op = "quantize_fp8";
  QArgs a;
  sl_status st = prepare(d, x, row_range, op, &a);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->rows == 0 || d->cols == 0 || d->batch == 0) return SL_STATUS_SUCCESS;
  if ((x == NULL && d->x_rows > 0) || scale == NULL || (q == NULL && q_t == NULL))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: x, scale and at least one of q and q_t must be given", op);
  return quantize_rows(d, a, q, q_t, scale, (cudaStream_t)stream, op);
}

extern "C" sl_status sl_quantize_fp8_both_cuda(const sl_quantize_fp8_desc *d, const void *x,
                                               const int32_t *row_range, const int32_t *gather,
                                               void *q, float *scale, void *q_t, float *scale_t,
                                               void *stream) {
  const char *op = "quantize_fp8_both";
  QArgs a;
  sl_status st = prepare(d, x, row_range, op, &a);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->block_rows != 1 || d->block_cols != 128)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: the descriptor's block must be 1x128 (q's; q_t's is 128x1), got %dx%d",
                        op, d->block_rows, d->block_cols);
  if (gather != NULL && d->src_rows < 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: with a gather, src_rows (the rows of x) must be >= 0, got %lld", op,
                        (long long)d->src_rows);
  if (d->rows == 0 || d->cols == 0 || d->batch == 0) return SL_STATUS_SUCCESS;
  const long long x_in = gather ? d->src_rows : d->x_rows; /* rows x holds */
  if ((x == NULL && x_in > 0) || (q == NULL && d->x_rows > 0) || (scale == NULL && d->x_rows > 0) ||
      q_t == NULL || scale_t == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: x, q, scale (where x has rows), q_t and scale_t must be given", op);
  a.gather = gather, a.src_rows = gather ? d->src_rows : 0;
  cudaStream_t s = (cudaStream_t)stream;
  if (!fast16(a, q, q_t)) { /* the two passes it stands for */
    sl_quantize_fp8_desc dq = *d, dt = *d;
    dq.rows = d->x_rows;
    dt.block_rows = 128, dt.block_cols = 1;
    QArgs aq = a, at = a;
    aq.rows = dq.rows, aq.row_range = NULL;
    at.br = 128, at.bc = 1;
    st = dq.rows == 0 ? SL_STATUS_SUCCESS : quantize_rows(&dq, aq, q, NULL, scale, s, op);
    return st != SL_STATUS_SUCCESS ? st : quantize_rows(&dt, at, NULL, q_t, scale_t, s, op);
  }
  a.q = (uint8_t *)q, a.qt = (uint8_t *)q_t, a.scale = scale, a.scale_t = scale_t;
  const dim3 tiles = tile_grid(a, (d->rows + kT - 1) / kT, (d->cols + kT - 1) / kT, !gather);
  if (a.dtype == SL_DTYPE_BF16)
    quantize_tile16_kernel<SL_DTYPE_BF16, kBoth><<<tiles, kThreads, 0, s>>>(a, LoadRows{});
  else
    quantize_tile16_kernel<SL_DTYPE_F16, kBoth><<<tiles, kThreads, 0, s>>>(a, LoadRows{});
  return launched(op);
}