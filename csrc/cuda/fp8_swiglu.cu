/* The SwiGLU activation and its gradient quantized to FP8 as they are computed (sluice.h:
 * sl_swiglu_quantize_fp8_cuda, sl_swiglu_bwd_quantize_fp8_cuda). fp8_tile.cuh's tile kernel in
 * both layouts (q by 1 x 128 blocks, q_t by 128 x 1), with a source that computes each 128 x 128
 * tile from the SwiGLU's inputs (swiglu_math.cuh's arithmetic, each value rounded once to the
 * 16-bit type) where sl_quantize_fp8_both_cuda reads it: q, q_t and the scales are bit for bit
 * those of sl_swiglu_*_cuda's output quantized by sl_quantize_fp8_both_cuda, and the 16-bit
 * activation (gradient) is never written nor read back. Bytes a row, bf16, F the expert width:
 * the forward reads 4F and writes 2F (the two passes: 10F), the backward reads 6F and writes 4F
 * (18F). */
#include "fp8_tile.cuh"
#include "half_pack.cuh"
#include "swiglu_math.cuh"

namespace sluice_cuda {
namespace {

template <sl_dtype T>
struct Half; /* the CUDA type of a 16-bit sl_dtype */
template <>
struct Half<SL_DTYPE_BF16> {
  using type = __nv_bfloat16;
};
template <>
struct Half<SL_DTYPE_F16> {
  using type = __half;
};

/* The forward's tile: row r of the activation is silu(h[r, :F]) * h[r, F:] (times w[r]) inside
 * row_range, zero outside. QArgs: x = h [B, x_rows, 2F], cols = F. Thread t computes 8 columns
 * (t % 16) of rows t / 16 + 16 j, as the load source's cp.async copies would place them. */
struct SwigluRows {
  const float *w; /* [B, x_rows], or NULL: 1 */
  template <sl_dtype T, bool FULL>
  __device__ __forceinline__ void fill(const QArgs &a, uint16_t *tile, long long b, long long r0,
                                       long long c0, Live range, Live) const {
    using H = typename Half<T>::type;
    const int tid = threadIdx.x, cc = (tid & 15) * 8;
    const long long F = a.cols, c = c0 + cc;
    const H *h = (const H *)a.x + (size_t)b * a.x_rows * 2 * F;
#pragma unroll 2
    for (int j = 0; j < kT * kT / 8 / kThreads; ++j) {
      const int rr = (tid >> 4) + 16 * j;
      const long long r = r0 + rr;
      int4 out = make_int4(0, 0, 0, 0);
      if (FULL || (range.has(r) && c < F)) {
        float g[8], u[8], o[8];
        unpack8<H>(__ldg(reinterpret_cast<const int4 *>(h + r * 2 * F + c)), g);
        unpack8<H>(__ldg(reinterpret_cast<const int4 *>(h + r * 2 * F + F + c)), u);
        const float wr = w ? __ldg(w + b * a.x_rows + r) : 1.0f;
#pragma unroll
        for (int v = 0; v < 8; ++v) fwd1(g[v], u[v], &o[v]), o[v] *= wr;
        out = pack8<H>(o);
      }
      *reinterpret_cast<int4 *>(tile + rr * kT + cc) = out;
    }
    __syncthreads();
  }
};

/* The backward's two tiles of dh [B, x_rows, 2F] (cols = 2F, F a multiple of 128) for the
 * columns [c0, c0 + 128) of F: d gate into tile[0 .. kT * kT) and d up (dh's columns F + c0 ..)
 * into the 128 x 128 after it, from dact [B, x_rows, F] and h, read once for both; zero outside
 * row_range. With row weights also, per row, the sum of dact * silu(gate) * up over these columns
 * (a fixed order: 8 columns a thread, then the row's 16 threads by shuffles) into
 * parts[b, r, c0 / 128]; the caller sums a row's parts for d w[r]. */
struct SwigluBwdRows {
  const void *dact;
  const float *w; /* [B, x_rows], or NULL: 1 (no parts then) */
  float *parts;   /* with w: [B, x_rows, F / 128] */
  template <sl_dtype T, bool FULL>
  __device__ __forceinline__ void fill(const QArgs &a, uint16_t *tile, long long b, long long r0,
                                       long long c0, Live range) const {
    using H = typename Half<T>::type;
    const int tid = threadIdx.x, cc = (tid & 15) * 8;
    const long long F = a.cols / 2, c = c0 + cc;
    const H *h = (const H *)a.x + (size_t)b * a.x_rows * 2 * F;
    const H *da_b = (const H *)dact + (size_t)b * a.x_rows * F;
#pragma unroll 2
    for (int j = 0; j < kT * kT / 8 / kThreads; ++j) {
      const int rr = (tid >> 4) + 16 * j;
      const long long r = r0 + rr;
      int4 dg_out = make_int4(0, 0, 0, 0), du_out = dg_out;
      float dot = 0.0f;
      if (FULL || range.has(r)) {
        float g[8], u[8], da[8], dg[8], du[8];
        unpack8<H>(__ldg(reinterpret_cast<const int4 *>(h + r * 2 * F + c)), g);
        unpack8<H>(__ldg(reinterpret_cast<const int4 *>(h + r * 2 * F + F + c)), u);
        unpack8<H>(__ldg(reinterpret_cast<const int4 *>(da_b + r * F + c)), da);
        const float wr = w ? __ldg(w + b * a.x_rows + r) : 1.0f;
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          bwd1(g[v], u[v], da[v] * wr, &dg[v], &du[v]);
          if (w) {
            float act;
            fwd1(g[v], u[v], &act);
            dot += da[v] * act;
          }
        }
        dg_out = pack8<H>(dg), du_out = pack8<H>(du);
      }
      *reinterpret_cast<int4 *>(tile + rr * kT + cc) = dg_out;
      *reinterpret_cast<int4 *>(tile + kT * kT + rr * kT + cc) = du_out;
      if (w) { /* the row's 16 threads are one half-warp */
#pragma unroll
        for (int m = 1; m < 16; m <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
        if ((tid & 15) == 0 && r < a.x_rows) parts[(b * a.x_rows + r) * (F / kT) + c0 / kT] = dot;
      }
    }
    __syncthreads();
  }
};

/* quantize_tile16's source for a tile already in shared memory. */
struct Filled {
  template <sl_dtype T, bool FULL>
  __device__ __forceinline__ void fill(const QArgs &, uint16_t *, long long, long long, long long,
                                       Live, Live) const {}
};

/* The backward: CTA (x, y, z) computes rows [128 x, 128 x + 128) of dh's column tiles y (d gate)
 * and y + F / 128 (d up) of problem z, then quantizes one after the other (column stripes: in
 * whole rows it measures 0.97x). */
constexpr int kBwdSmem = 2 * kT * kT * 2; /* the two 16-bit tiles */
template <sl_dtype T, bool FULL>
__device__ __forceinline__ void swiglu_bwd_tiles(const QArgs &a, const SwigluBwdRows &src,
                                                 uint16_t *tiles, uint2 (*red)[32], BlockScale *sc,
                                                 BlockScale *sc_row, long long b, long long r0,
                                                 long long c0, Live range, Live live, unsigned up) {
  src.fill<T, FULL>(a, tiles, b, r0, c0, range);
  quantize_tile16<T, kBoth, FULL>(a, Filled{}, tiles, red, sc, sc_row, range, live,
                                  TileAt{blockIdx.x, blockIdx.y});
  __syncthreads();
  quantize_tile16<T, kBoth, FULL>(a, Filled{}, tiles + kT * kT, red, sc, sc_row, range, live,
                                  TileAt{blockIdx.x, up});
}
template <sl_dtype T>
__global__ void __launch_bounds__(kThreads, 3) swiglu_bwd_tiles_kernel(QArgs a, SwigluBwdRows src) {
  extern __shared__ __align__(16) uint16_t tiles[];
  __shared__ uint2 red[kThreads / 32][32];
  __shared__ BlockScale sc[kT], sc_row[kT];
  const long long b = blockIdx.z, r0 = (long long)blockIdx.x * kT, c0 = (long long)blockIdx.y * kT;
  const Live range = live_rows(a, b), live{0, a.x_rows};
  const unsigned up = blockIdx.y + (unsigned)(a.cols / 2 / kT); /* d up's column tile */
  if (interior(a, r0, c0, range, live))
    swiglu_bwd_tiles<T, true>(a, src, tiles, red, sc, sc_row, b, r0, c0, range, live, up);
  else
    swiglu_bwd_tiles<T, false>(a, src, tiles, red, sc, sc_row, b, r0, c0, range, live, up);
}

/* The checks and QArgs of both entry points: desc describes the quantized array (the activation,
 * cols = F; or dh, cols = 2F) as sl_quantize_fp8_both_cuda's does, h has x_rows rows of 2F. */
sl_status prepare(const sl_quantize_fp8_desc *d, const void *h, const int32_t *row_range, void *q,
                  float *scale, void *q_t, float *scale_t, const char *op, int bwd, int f_align,
                  QArgs *a) {
  sl_status st = sl_quantize_fp8_check(d, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->block_rows != 1 || d->block_cols != 128)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: the descriptor's block must be 1x128 (q's; q_t's is 128x1), got %dx%d",
                        op, d->block_rows, d->block_cols);
  if (d->dtype != SL_DTYPE_BF16 && d->dtype != SL_DTYPE_F16)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: h must be BF16 or F16 (dtype %d)", op,
                        (int)d->dtype);
  const long long f = bwd ? d->cols / 2 : d->cols; /* the SwiGLU's F */
  if ((bwd && d->cols % 2 != 0) || f % f_align != 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: F must be a multiple of %d, got cols %lld (F = %lld)", op, f_align,
                        (long long)d->cols, f);
  if ((st = check_tiles(d, op)) != SL_STATUS_SUCCESS) return st;
  if ((h == NULL && d->x_rows > 0) || (q == NULL && d->x_rows > 0) ||
      (scale == NULL && d->x_rows > 0) || q_t == NULL || scale_t == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: h, q, scale (where h has rows), q_t and scale_t must be given", op);
  if (((uintptr_t)h | (uintptr_t)q | (uintptr_t)q_t) % 16 != 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: h, q and q_t must be 16-byte aligned", op);
  *a = QArgs{};
  a->x = h, a->row_range = row_range;
  a->q = (uint8_t *)q, a->qt = (uint8_t *)q_t, a->scale = scale, a->scale_t = scale_t;
  a->batch = d->batch, a->rows = d->rows, a->cols = d->cols, a->x_rows = d->x_rows;
  a->br = 1, a->bc = 128, a->pow2 = d->power_of_two != 0, a->dtype = d->dtype;
  return SL_STATUS_SUCCESS;
}

}  // namespace
}  // namespace sluice_cuda

using namespace sluice_cuda;  // the entry points below, in C linkage

extern "C" sl_status sl_swiglu_quantize_fp8_cuda(const sl_quantize_fp8_desc *d, const void *h,
                                                 const float *row_weights, const int32_t *row_range,
                                                 void *q, float *scale, void *q_t, float *scale_t,
                                                 void *stream) {
  const char *op = "swiglu_quantize_fp8";
  QArgs a;
  sl_status st = prepare(d, h, row_range, q, scale, q_t, scale_t, op, 0, 8, &a);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->rows == 0 || d->cols == 0 || d->batch == 0) return SL_STATUS_SUCCESS;
  const dim3 tiles = tile_grid(a, (d->rows + kT - 1) / kT, (d->cols + kT - 1) / kT, true);
  cudaStream_t s = (cudaStream_t)stream;
  if (a.dtype == SL_DTYPE_BF16)
    quantize_tile16_kernel<SL_DTYPE_BF16, kBoth>
        <<<tiles, kThreads, 0, s>>>(a, SwigluRows{row_weights});
  else
    quantize_tile16_kernel<SL_DTYPE_F16, kBoth>
        <<<tiles, kThreads, 0, s>>>(a, SwigluRows{row_weights});
  return launched(op);
}

extern "C" sl_status sl_swiglu_bwd_quantize_fp8_cuda(const sl_quantize_fp8_desc *d,
                                                     const void *dact, const void *h,
                                                     const float *row_weights,
                                                     const int32_t *row_range, void *q,
                                                     float *scale, void *q_t, float *scale_t,
                                                     float *drow_weight_parts, void *stream) {
  const char *op = "swiglu_bwd_quantize_fp8";
  QArgs a;
  sl_status st = prepare(d, h, row_range, q, scale, q_t, scale_t, op, 1, kT, &a);
  if (st != SL_STATUS_SUCCESS) return st;
  if ((dact == NULL && d->x_rows > 0) || (uintptr_t)dact % 16 != 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: dact must be given, 16-byte aligned", op);
  if (row_weights != NULL && drow_weight_parts == NULL && d->x_rows > 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: row_weights given but drow_weight_parts is NULL", op);
  if (d->rows == 0 || d->cols == 0 || d->batch == 0) return SL_STATUS_SUCCESS;
  static SmemOptIn bwd_kernels;
  st = opt_in_smem(bwd_kernels, kBwdSmem, op, swiglu_bwd_tiles_kernel<SL_DTYPE_BF16>,
                   swiglu_bwd_tiles_kernel<SL_DTYPE_F16>);
  if (st != SL_STATUS_SUCCESS) return st;
  const dim3 tiles((unsigned)((d->rows + kT - 1) / kT), (unsigned)(d->cols / 2 / kT),
                   (unsigned)d->batch);
  const SwigluBwdRows src{dact, row_weights, drow_weight_parts};
  cudaStream_t s = (cudaStream_t)stream;
  if (a.dtype == SL_DTYPE_BF16)
    swiglu_bwd_tiles_kernel<SL_DTYPE_BF16><<<tiles, kThreads, kBwdSmem, s>>>(a, src);
  else
    swiglu_bwd_tiles_kernel<SL_DTYPE_F16><<<tiles, kThreads, kBwdSmem, s>>>(a, src);
  return launched(op);
}
