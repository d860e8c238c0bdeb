/* The FP8 quantization's shared pieces (fp8_quantize.cu, fp8_swiglu.cu): the rule's scale
 * arithmetic on the device, and the 128 x 128 tile kernel for 16-bit values, which fills a tile in
 * shared memory from a source (x's rows as they are, or the SwiGLU and its gradient computed from
 * their inputs) and writes its block maxima, scales, q and q_t. */
#ifndef SLUICE_CUDA_FP8_TILE_CUH_
#define SLUICE_CUDA_FP8_TILE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>

#include "../core/internal.h"
#include "sluice.h"

namespace sluice_cuda {
namespace {

constexpr int kT = 128, kThreads = 256, kLd = kT + 1; /* tile side; smem row stride (floats) */
constexpr float kRcpMax = 1.0f / 448.0f;              /* float32(1/448): fp8.py's RCP_MAX */
constexpr float kScaleMin = 1.17549435e-38f;          /* 2^-126 */

struct QArgs {
  const void *x;
  const int32_t *row_range; /* device int32 [batch][2] (lo, hi) or NULL: rows read from x */
  const int32_t *gather;    /* device int32 [batch][x_rows] or NULL: the row of x each row reads */
  long long src_rows;       /* with gather: the rows of x per problem */
  uint8_t *q, *qt;          /* [B, rows, cols], [B, cols, rows]; NULL: not written */
  float *scale;
  float *scale_t;                      /* quantize_both's q_t scale (128 x 1 blocks) */
  long long batch, rows, cols, x_rows; /* rows of the output; rows present in x (<= rows) */
  int br, bc;                          /* block: (1, 128), (128, 1) or (128, 128) */
  int pow2;
  sl_dtype dtype;
  int whole_rows; /* the grid's order: see tile_grid */
};

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

/* The rows of x per problem, and the row of x that row r (< x_rows) of problem b reads: r itself,
 * or with a gather its index there, -1 (read as zero) where that is outside [0, src_rows). */
__device__ __forceinline__ long long x_rows_per_problem(const QArgs &a) {
  return a.gather ? a.src_rows : a.x_rows;
}
__device__ __forceinline__ long long x_row(const QArgs &a, long long b, long long r) {
  if (!a.gather) return r;
  const int g = __ldg(a.gather + b * a.x_rows + r);
  return g >= 0 && g < a.src_rows ? g : -1;
}

/* ---- 16-bit inputs (bf16, f16) with 16-byte aligned rows: the fast kernels ----
 * Per element they issue about 3 instructions (the general kernel over 10):
 *  - a block's maximum is taken on the raw 16-bit magnitudes, two at a time (max.u16x2): a
 *    sign-magnitude format's magnitude bits order as unsigned integers, with inf above every
 *    finite value and NaN above inf, so one maximum gives both amax and "holds inf or NaN"; a
 *    bf16 maximum with a zero exponent (a float32 subnormal) reads as 0;
 *  - q = v * rcp as fma.rn.ftz(v, rcp, +0): the flush reads a float32 subnormal v as zero, and
 *    adding +0 turns -0 into +0, as the rule's flush does; a product that underflows keeps its
 *    sign, as its e4m3 rounding does;
 *  - two products convert to e4m3 in one instruction. */
template <sl_dtype T>
__device__ __forceinline__ float lo_f(uint32_t w) {
  if constexpr (T == SL_DTYPE_BF16)
    return __uint_as_float(w << 16);
  else
    return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFF)));
}
template <sl_dtype T>
__device__ __forceinline__ float hi_f(uint32_t w) {
  if constexpr (T == SL_DTYPE_BF16)
    return __uint_as_float(w & 0xFFFF0000u);
  else
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}
constexpr uint32_t kMag2 = 0x7FFF7FFFu; /* two 16-bit magnitudes */

/* The amax (float) of a block from the largest 16-bit magnitude m: a bf16 float32 subnormal reads
 * as zero; inf and NaN stay (block_scale makes their scale NaN). */
template <sl_dtype T>
__device__ __forceinline__ float amax_of(uint32_t m) {
  if constexpr (T == SL_DTYPE_BF16)
    return m < 0x80u ? 0.f : __uint_as_float(m << 16);
  else
    return __half2float(__ushort_as_half((unsigned short)m));
}
__device__ __forceinline__ uint32_t max_halves(uint32_t m) { return max(m & 0xFFFFu, m >> 16); }

/* A block's scale and its correctly rounded reciprocal, which multiplies its elements. */
struct BlockScale {
  float s, rcp;
};
__device__ __forceinline__ BlockScale make_scale(float amax, int pow2) {
  BlockScale b;
  b.s = block_scale(amax, pow2);
  b.rcp = __frcp_rn(b.s);
  return b;
}
__device__ __forceinline__ float quotient(float v, const BlockScale &b) {
  float y;
  asm("fma.rn.ftz.f32 %0, %1, %2, 0f00000000;" : "=f"(y) : "f"(v), "f"(b.rcp));
  return y;
}
/* Four elements (x words w0, w1) as four e4m3 bytes (byte i: element i), by scales b0..b3. */
template <sl_dtype T>
__device__ __forceinline__ uint32_t q4(uint32_t w0, uint32_t w1, const BlockScale &b0,
                                       const BlockScale &b1, const BlockScale &b2,
                                       const BlockScale &b3) {
  const float y0 = quotient(lo_f<T>(w0), b0), y1 = quotient(hi_f<T>(w0), b1);
  const float y2 = quotient(lo_f<T>(w1), b2), y3 = quotient(hi_f<T>(w1), b3);
  uint32_t q; /* cvt e4m3x2 d, a, b: a to the upper byte; satfinite clips as the rule does */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n.reg .b16 lo, hi;\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "mov.b32 %0, {lo, hi};\n}"
      : "=r"(q)
      : "f"(y0), "f"(y1), "f"(y2), "f"(y3));
#else /* (no FP8 conversion instruction before sm_89) */
  q = __nv_cvt_float2_to_fp8x2(make_float2(y0, y1), __NV_SATFINITE, __NV_E4M3) |
      (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(y2, y3), __NV_SATFINITE, __NV_E4M3) << 16;
#endif
  return q;
}

/* Byte j of q[0..15] (one column of 16 rows, 4 columns a word) as 16 consecutive bytes. */
__device__ __forceinline__ uint4 column_bytes(const uint32_t (&q)[16], int j) {
  uint32_t o[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) { /* rows 4k .. 4k + 3: byte j of each */
    const uint32_t lo = __byte_perm(q[4 * k], q[4 * k + 1], j | (j + 4) << 4);
    const uint32_t hi = __byte_perm(q[4 * k + 2], q[4 * k + 3], j | (j + 4) << 4);
    o[k] = __byte_perm(lo, hi, 0x5410);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/* The tile kernel's modes: 128 x 1 blocks (q and/or q_t), 128 x 128 blocks (q and/or q_t), or
 * both layouts of an activation (sl_quantize_fp8_both_cuda: q by 1 x 128 blocks from every row,
 * q_t by 128 x 1 blocks from the rows in row_range). */
enum TileMode { kPerCol, kWhole, kBoth };

/* A launch's tiles, problems in z, in one of two orders. Whole rows (column tiles in x, fastest):
 * the CTAs running together read and write contiguous stretches of x, q and the 1 x 128 scales
 * (1.13x for 1 x 128 blocks, 1.06x for both layouts, against column stripes). Column stripes (row
 * tiles in x): a stripe's 128 columns of every row stay in L2 while it passes, so gathered rows,
 * read once per copy, come from there (whole rows: 0.87x for 8 copies of 4096 rows), and q_t's
 * lines are written in order (whole rows: 0.97x for 128 x 1 blocks). tile_grid takes whole rows
 * where asked and the row tiles fit in y (65535), and records the order in a. */
struct TileAt {
  long long rt; /* the tile's row tile (of the launch's height) */
  unsigned ct;  /* its column tile */
};
__device__ __forceinline__ TileAt tile_at(const QArgs &a) {
  return a.whole_rows ? TileAt{blockIdx.y, blockIdx.x} : TileAt{blockIdx.x, blockIdx.y};
}
inline dim3 tile_grid(QArgs &a, long long row_tiles, long long col_tiles, bool whole_rows) {
  a.whole_rows = whole_rows && row_tiles <= 65535;
  return a.whole_rows ? dim3((unsigned)col_tiles, (unsigned)row_tiles, (unsigned)a.batch)
                      : dim3((unsigned)row_tiles, (unsigned)col_tiles, (unsigned)a.batch);
}

/* A 128 x 128 tile through shared memory (cp.async, 16 bytes a copy; rows not read from x are
 * zero-filled), kept as 16-bit values. Thread (warp w, lane l) holds rows [16 w, 16 w + 16) of
 * columns [4 l, 4 l + 4) in registers: the block maxima (per column over the 8 warps, or the whole
 * tile; kBoth also per row, from a second read of the tile: a thread per half row, its 16-byte
 * chunks rotated by lane so that 8 lanes hit 8 bank groups), then q (4 bytes of a row a store, a
 * warp's 128 bytes contiguous) and q_t (transposed through shared memory into 128-byte lines; at
 * the edges of q_t, 16 rows of a column a 16-byte store).
 * FULL: an interior tile (every row read from x and inside row_range, every column present, rows
 * a multiple of 16), which checks nothing per row: the per-row bounds and 64-bit row arithmetic
 * are about a third of the instructions of an edge tile. */
template <sl_dtype T, TileMode MODE, bool FULL, class Src>
__device__ __forceinline__ void quantize_tile16(const QArgs &a, const Src &src, uint16_t *tile,
                                                uint2 (*red)[32], BlockScale *sc,
                                                BlockScale *sc_row, Live range, Live live,
                                                TileAt at) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned ty = at.ct;
  const long long b = blockIdx.z, rt = at.rt, r0 = rt * kT, c0 = (long long)ty * kT;
  const long long R = a.rows, C = a.cols;
  src.template fill<T, FULL>(a, tile, b, r0, c0, range, live);
  const long long rw = r0 + warp * 16; /* this thread's first row */
  uint2 v[16];
  uint32_t m0 = 0u, m1 = 0u;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    v[i] = *reinterpret_cast<const uint2 *>(tile + (warp * 16 + i) * kT + lane * 4);
    if (FULL || MODE != kBoth || range.has(rw + i))
      m0 = __vmaxu2(m0, v[i].x & kMag2), m1 = __vmaxu2(m1, v[i].y & kMag2);
  }
  if (MODE == kBoth) { /* row tid / 2's 1 x 128 block, half tid % 2 of it here */
    const int row = tid >> 1, half = tid & 1;
    const uint4 *src = reinterpret_cast<const uint4 *>(tile + row * kT + half * 64);
    uint32_t m = 0u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint4 u = src[(k + lane) & 7];
      m = __vimax3_u16x2(m, u.x & kMag2, u.y & kMag2);
      m = __vimax3_u16x2(m, u.z & kMag2, u.w & kMag2);
    }
    m = __vmaxu2(m, __shfl_xor_sync(0xffffffffu, m, 1));
    if (half == 0) {
      sc_row[row] = make_scale(amax_of<T>(max_halves(m)), a.pow2);
      if (FULL || (r0 + row < a.x_rows && c0 < C))
        a.scale[((size_t)b * a.x_rows + r0 + row) * ((C + 127) / 128) + ty] = sc_row[row].s;
    }
  }
  if (MODE != kWhole) {
    red[warp][lane] = make_uint2(m0, m1);
    __syncthreads();
    if (tid < kT) { /* column tid: lane tid / 4, word (tid / 2) % 2, half tid % 2 */
      uint32_t m = 0u;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) {
        const uint2 p = red[w][tid >> 2];
        m = max(m, (((tid >> 1) & 1) ? p.y : p.x) >> (16 * (tid & 1)) & 0xFFFFu);
      }
      sc[tid] = make_scale(amax_of<T>(m), a.pow2);
      float *st = MODE == kBoth ? a.scale_t : a.scale;
      if (FULL || c0 + tid < C) st[((size_t)b * ((R + 127) / 128) + rt) * C + c0 + tid] = sc[tid].s;
    }
  } else {
    uint32_t m = max_halves(__vmaxu2(m0, m1));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp][0].x = m;
    __syncthreads();
    if (tid == 0) {
      uint32_t mm = 0u;
      for (int w = 0; w < kThreads / 32; ++w) mm = max(mm, red[w][0].x);
      sc[0] = make_scale(amax_of<T>(mm), a.pow2);
      a.scale[(size_t)b * ((R + 127) / 128) * ((C + 127) / 128) + (size_t)rt * ((C + 127) / 128) +
              ty] = sc[0].s;
    }
  }
  __syncthreads();
  const long long c = c0 + lane * 4;
  if (!FULL && (c >= C || rw >= R)) return;
  uint32_t q[16];             /* row rw + i, columns c .. c + 3 */
  if (MODE == kBoth && a.q) { /* q by each row's 1 x 128 scale, rows of x only */
    uint8_t *qr = a.q + ((size_t)b * a.x_rows + rw) * C + c;
#pragma unroll
    for (int i = 0; i < 16; ++i, qr += C) {
      const BlockScale s = sc_row[warp * 16 + i]; /* (the same for the warp) */
      const uint32_t w = q4<T>(v[i].x, v[i].y, s, s, s, s);
      if (FULL || rw + i < a.x_rows) *reinterpret_cast<uint32_t *>(qr) = w;
    }
  }
  if (MODE == kBoth && !FULL) { /* q_t reads the rows of row_range only */
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (!range.has(rw + i)) v[i] = make_uint2(0u, 0u);
  }
  const BlockScale s0 = sc[MODE == kWhole ? 0 : lane * 4],
                   s1 = sc[MODE == kWhole ? 0 : lane * 4 + 1];
  const BlockScale s2 = sc[MODE == kWhole ? 0 : lane * 4 + 2],
                   s3 = sc[MODE == kWhole ? 0 : lane * 4 + 3];
#pragma unroll
  for (int i = 0; i < 16; ++i) q[i] = q4<T>(v[i].x, v[i].y, s0, s1, s2, s3);
  if (MODE != kBoth && a.q) {
    uint8_t *qr = a.q + ((size_t)b * R + rw) * C + c;
#pragma unroll
    for (int i = 0; i < 16; ++i, qr += C)
      if (FULL || rw + i < R) *reinterpret_cast<uint32_t *>(qr) = q[i];
  }
  /* a tile inside q_t's bounds (whose rows are 16-byte aligned) */
  const bool inside = FULL || (r0 + kT <= R && c0 + kT <= C && R % 16 == 0);
  if (a.qt && inside) {
    /* q_t through shared memory, so that 8 lanes store a 128-byte line (16 bytes a lane to 32
     * columns, as below, left half-filled 32-byte sectors and 60% of HBM where this is 84%):
     * thread (w, l) puts columns 4 l .. 4 l + 3, rows 16 w .. 16 w + 15 as 16-byte chunks of a
     * [128][128] byte tile (column-major: q_t's rows), chunk w of column col at position
     * w ^ (col / 4 % 8) (a warp's 32 chunks in 8 positions: 4 wavefronts a store); then thread t
     * stores chunk t % 8 of columns t / 8 + 32 p. The tile's 16-bit values are all in
     * registers by now. */
    uint8_t *qs = reinterpret_cast<uint8_t *>(tile);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<uint4 *>(qs + (lane * 4 + j) * kT + (warp ^ (lane & 7)) * 16) =
          column_bytes(q, j);
    __syncthreads();
    const int chunk = tid & 7;
    uint8_t *qt = a.qt + ((size_t)b * C + c0) * R + r0 + chunk * 16;
#pragma unroll
    for (int p = 0; p < kT * kT / 16 / kThreads; ++p) {
      const int col = (tid >> 3) + p * (kThreads / 8);
      *reinterpret_cast<uint4 *>(qt + (size_t)col * R) =
          *reinterpret_cast<const uint4 *>(qs + col * kT + (chunk ^ ((col >> 2) & 7)) * 16);
    }
  } else if (a.qt) { /* column c + j: byte j of q[0..15] */
    uint8_t *qb = a.qt + (size_t)b * R * C;
    if (R % 16 == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint4 *>(qb + (c + j) * R + rw) = column_bytes(q, j);
    } else {
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 16 && rw + i < R; ++i)
          qb[(c + j) * R + rw + i] = (uint8_t)(q[i] >> (8 * j));
    }
  }
}

/* Whether the tile at (r0, c0) is interior (quantize_tile16's FULL). */
__device__ __forceinline__ bool interior(const QArgs &a, long long r0, long long c0, Live range,
                                         Live live) {
  return r0 + kT <= a.rows && c0 + kT <= a.cols && a.rows % 16 == 0 && live.lo <= r0 &&
         r0 + kT <= live.hi && range.lo <= r0 && r0 + kT <= range.hi;
}

template <sl_dtype T, TileMode MODE, class Src>
__global__ void __launch_bounds__(kThreads, MODE == kBoth ? 3 : 4)
    quantize_tile16_kernel(QArgs a, Src src) {
  __shared__ __align__(16) uint16_t tile[kT * kT];
  __shared__ uint2 red[kThreads / 32][32];
  __shared__ BlockScale sc[kT], sc_row[MODE == kBoth ? kT : 1];
  const TileAt at = tile_at(a);
  const long long b = blockIdx.z, r0 = at.rt * kT, c0 = (long long)at.ct * kT;
  /* the rows loaded, and (kBoth) the rows q_t reads: row_range's */
  const Live range = live_rows(a, b), live = MODE == kBoth ? Live{0, a.x_rows} : range;
  if (interior(a, r0, c0, range, live))
    quantize_tile16<T, MODE, true>(a, src, tile, red, sc, sc_row, range, live, at);
  else
    quantize_tile16<T, MODE, false>(a, src, tile, red, sc, sc_row, range, live, at);
}

/* A launch's tiles within CUDA's grid: column stripes (row tiles in x, column tiles in y, problems
 * in z) always fit; tile_grid takes whole rows only where the row tiles fit in y. */
inline sl_status check_tiles(const sl_quantize_fp8_desc *d, const char *op) {
  if ((d->rows + kT - 1) / kT > INT32_MAX || (d->cols + kT - 1) / kT > 65535 || d->batch > 65535)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: at most 65535 column tiles of 128 and 65535 problems", op);
  return SL_STATUS_SUCCESS;
}

/* Dynamic shared memory above the 48 KB default, opted into once per device for some kernels. */
struct SmemOptIn {
  static constexpr int kMaxDevices = 64;
  bool raised[kMaxDevices] = {};
  std::mutex mutex;
};
template <class... Kernel>
sl_status opt_in_smem(SmemOptIn &o, int bytes, const char *op, Kernel... kernels) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess && dev >= 0 && dev < SmemOptIn::kMaxDevices) {
    std::lock_guard<std::mutex> lock(o.mutex);
    if (!o.raised[dev]) {
      for (const void *k : {(const void *)kernels...})
        if (err == cudaSuccess)
          err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (err == cudaSuccess) o.raised[dev] = true;
    }
  }
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: %s", op, cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

inline sl_status launched(const char *op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: launch failed: %s", op, cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

}  // namespace
}  // namespace sluice_cuda

#endif /* SLUICE_CUDA_FP8_TILE_CUH_ */
