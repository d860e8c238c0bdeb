/* Portable grouped GEMM (sm_80 and up): mma.sync m16n8k16 tensor cores fed by a 3-stage cp.async
 * pipeline, one persistent 128x256 tile per CTA at a time, 8 warps of 64x64.
 *
 * Used on every GPU that is not sm_90, and on sm_90 for what the wgmma kernel does not cover
 * (operands whose rows are not 16-byte aligned). f32 inputs take the naive kernel at the end of
 * this file: correct, slow, there so every dtype of the API works on the GPU.
 *
 * Operand layouts, as they sit in shared memory (every row padded by 8 elements, which makes the
 * 8 row addresses of an ldmatrix land in 8 different 16-byte bank groups):
 *   gmm  A = lhs rows of a group   [m][k]  ldmatrix            B = rhs[j] [k][n]  ldmatrix.trans
 *                                                               (transpose_rhs:  [n][k]  ldmatrix)
 *   tgmm A = lhs^T (rows contract) [k][m]  ldmatrix.trans      B = rhs rows [k][n] ldmatrix.trans
 * Rows outside the tile's group (tgmm: they would join the contraction) and columns past the edge
 * are zero-filled by cp.async's src-size, so no tile mixes groups. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>
#include <type_traits>

#include "../core/internal.h"
#include "gmm_common.cuh"

namespace sluice_cuda {
namespace sm80 {

constexpr int BM = 128, BN = 256, BK = 32, STAGES = 3, THREADS = 256, PAD = 8;

template <bool TGMM, bool TRANS_B>
struct Layout {
  /* A: [BM][BK+PAD] (gmm) or [BK][BM+PAD] (tgmm). B: [BK][BN+PAD] or [BN][BK+PAD] (transposed). */
  static constexpr int A_ELEMS = TGMM ? BK * (BM + PAD) : BM * (BK + PAD);
  static constexpr int B_ELEMS = TRANS_B ? BN * (BK + PAD) : BK * (BN + PAD);
  static constexpr int STAGE_ELEMS = A_ELEMS + B_ELEMS;
  static constexpr size_t PIPE_BYTES = (size_t)STAGES * STAGE_ELEMS * 2;
};

__device__ inline uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Loads a R x C tile (C a multiple of 8) into smem [R][C+PAD]. Smem row r holds global row
 * row0 + r when it lies in [row_lo, row_hi), else zeros; column col0 + c is read when < col_hi.
 * VEC: 16-byte cp.async (global rows 16-byte aligned); else element loads through registers. */
template <int R, int C, bool VEC, typename T>
__device__ inline void load_tile(T *smem, const T *g, long long ld, int row0, int row_lo,
                                 int row_hi, int col0, int col_hi) {
  constexpr int CHUNKS = R * C / 8;
  static_assert(CHUNKS % THREADS == 0, "tile chunks must divide evenly over the threads");
#pragma unroll
  for (int i = 0; i < CHUNKS / THREADS; ++i) {
    const int chunk = threadIdx.x + i * THREADS;
    const int r = chunk / (C / 8), c = (chunk % (C / 8)) * 8;
    const int gr = row0 + r, gc = col0 + c;
    T *dst = smem + r * (C + PAD) + c;
    const bool row_ok = gr >= row_lo && gr < row_hi;
    if (VEC) {
      int bytes = row_ok ? min(max(col_hi - gc, 0), 8) * 2 : 0;
      const T *src = bytes > 0 ? g + (long long)gr * ld + gc : g;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                   "r"(bytes));
    } else {
      alignas(16) T v[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        unsigned short bits = 0;
        if (row_ok && gc + e < col_hi)
          bits = reinterpret_cast<const unsigned short *>(g)[(long long)gr * ld + gc + e];
        reinterpret_cast<unsigned short *>(v)[e] = bits;
      }
      *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(v);
    }
  }
}

__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <bool TRANS>
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void *p) {
  if (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

template <typename T>
__device__ inline void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* One persistent kernel for gmm and tgmm. Tiles are enumerated group by group (table built at
 * entry); within a group, gmm walks m-tiles fastest (CTAs running together share rhs columns), tgmm
 * walks k-tiles fastest (they share rhs rows of the group). */
template <typename T, bool TGMM, bool TRANS_B, bool VEC>
__global__ void __launch_bounds__(THREADS, 1) gmm_kernel(GmmArgs a) {
  using L = Layout<TGMM, TRANS_B>;
  extern __shared__ __align__(128) unsigned char smem_sm80[];
  unsigned char *smem_raw = smem_sm80;
  T *pipe = reinterpret_cast<T *>(smem_raw);
  int *tab = a.table;
  if (tab == nullptr) {
    tab = reinterpret_cast<int *>(smem_raw + L::PIPE_BYTES);
    const int tiles_n = (a.n + BN - 1) / BN, tiles_k = (a.k + BM - 1) / BM;
    build_group_table(a, tab, TGMM ? 0 : BM, tiles_n, tiles_k * tiles_n);
  }
  const int GL = a.num_local_groups;
  const int *start = tab + kTableHeader, *end = start + GL, *tile_prefix = end + GL;
  const int total_tiles = tab[2];
  if (!TGMM && !a.skip_unused) zero_outside_rows(a, tab[0], tab[1]);

  const T *lhs = reinterpret_cast<const T *>(a.lhs);
  const T *rhs = reinterpret_cast<const T *>(a.rhs);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp & 1, wn = warp >> 1; /* warp tile: rows wm*64.., cols wn*64.. */
  const int tiles_n = (a.n + BN - 1) / BN, tiles_k = (a.k + BM - 1) / BM;

  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const int j = find_group(tile_prefix, GL, t);
    const int u = t - tile_prefix[j];
    const int gs = start[j], ge = end[j];
    int m0, n0, nk;
    int mt, nt;
    if (TGMM) {
      panel_raster(u, tiles_k, tiles_n, mt, nt);
      m0 = mt * BM; /* rows of out[j] (the K dim) */
      nk = (ge - gs + BK - 1) / BK;
    } else {
      panel_raster(u, (ge - gs + BM - 1) / BM, tiles_n, mt, nt);
      m0 = gs + mt * BM; /* rows of lhs/out */
      nk = (a.k + BK - 1) / BK;
    }
    n0 = nt * BN;
    const T *rhs_j = TGMM ? rhs : rhs + (size_t)j * a.k * a.n;

    auto load_stage = [&](int kb, int s) {
      T *sa = pipe + s * L::STAGE_ELEMS, *sb = sa + L::A_ELEMS;
      const int k0 = kb * BK;
      if (TGMM) {
        const int r0 = gs + k0;
        load_tile<BK, BM, VEC>(sa, lhs, a.k, r0, gs, ge, m0, a.k);
        load_tile<BK, BN, VEC>(sb, rhs, a.n, r0, gs, ge, n0, a.n);
      } else {
        load_tile<BM, BK, VEC>(sa, lhs, a.k, m0, gs, ge, k0, a.k);
        if (TRANS_B)
          load_tile<BN, BK, VEC>(sb, rhs_j, a.k, n0, 0, a.n, k0, a.k);
        else
          load_tile<BK, BN, VEC>(sb, rhs_j, a.n, k0, 0, a.k, n0, a.n);
      }
    };

    float acc[4][8][4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage(s, s);
      cp_async_commit();
    }
    for (int kb = 0; kb < nk; ++kb) {
      cp_async_wait<STAGES - 2>();
      __syncthreads(); /* stage kb landed for all threads; stage kb-1 is free to overwrite */
      if (kb + STAGES - 1 < nk) load_stage(kb + STAGES - 1, (kb + STAGES - 1) % STAGES);
      cp_async_commit();
      const T *sa = pipe + (kb % STAGES) * L::STAGE_ELEMS, *sb = sa + L::A_ELEMS;
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        uint32_t af[4][4], bf[8][2];
        const int q = lane >> 3, r = lane & 7;
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
          const int mrow = wm * 64 + mi * 16;
          if (TGMM)
            ldmatrix_x4<true>(af[mi],
                              sa + (kk + r + (q >> 1) * 8) * (BM + PAD) + mrow + (q & 1) * 8);
          else
            ldmatrix_x4<false>(af[mi],
                               sa + (mrow + (lane & 15)) * (BK + PAD) + kk + (lane >> 4) * 8);
        }
#pragma unroll
        for (int n2 = 0; n2 < 4; ++n2) {
          const int ncol = wn * 64 + n2 * 16;
          uint32_t rr[4];
          if (TRANS_B)
            ldmatrix_x4<false>(rr, sb + (ncol + r + (q >> 1) * 8) * (BK + PAD) + kk + (q & 1) * 8);
          else
            ldmatrix_x4<true>(rr, sb + (kk + r + (q & 1) * 8) * (BN + PAD) + ncol + (q >> 1) * 8);
          bf[2 * n2][0] = rr[0];
          bf[2 * n2][1] = rr[1];
          bf[2 * n2 + 1][0] = rr[2];
          bf[2 * n2 + 1][1] = rr[3];
        }
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) mma16816<T>(acc[mi][ni], af[mi], bf[ni]);
      }
    }
    cp_async_wait<0>();
    __syncthreads(); /* the next tile's prologue overwrites stages this one may still read */

    /* Epilogue: straight from registers, masked to this tile's group rows and the matrix edge. */
    const int row_limit = TGMM ? a.k : ge; /* rows [m0, row_limit) are this tile's */
    const bool pair_ok = (a.n % 2) == 0;
    void *out =
        TGMM ? (void *)((char *)a.out + (size_t)j * a.k * a.n * dtype_bytes(a.out_dtype)) : a.out;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm * 64 + mi * 16 + (lane >> 2) + h * 8;
        if (row >= row_limit) continue;
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          const int col = n0 + wn * 64 + ni * 8 + (lane & 3) * 2;
          const size_t idx = (size_t)row * a.n + col;
          const float v0 = acc[mi][ni][2 * h], v1 = acc[mi][ni][2 * h + 1];
          if (pair_ok && col + 1 < a.n)
            store_out2(out, a.out_dtype, idx, v0, v1);
          else {
            if (col < a.n) store_out(out, a.out_dtype, idx, v0);
            if (col + 1 < a.n) store_out(out, a.out_dtype, idx + 1, v1);
          }
        }
      }
  }
}

/* f32 inputs (and nothing else): one thread per output element, f32 accumulation. */
template <bool TGMM>
__global__ void __launch_bounds__(256) naive_kernel(GmmArgs a) {
  extern __shared__ __align__(16) unsigned char smem_naive[];
  unsigned char *smem_raw = smem_naive;
  int *tab = a.table;
  if (tab == nullptr) {
    tab = reinterpret_cast<int *>(smem_raw);
    build_group_table(a, tab, TGMM ? 0 : 1, 1, 1);
  }
  const int GL = a.num_local_groups;
  const int *start = tab + kTableHeader, *end = start + GL;
  const int lo = tab[0], hi = tab[1];
  const float *lhs = reinterpret_cast<const float *>(a.lhs);
  const float *rhs = reinterpret_cast<const float *>(a.rhs);
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t total = TGMM ? (size_t)GL * a.k * a.n : (size_t)a.m * a.n;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    float acc = 0.f;
    if (TGMM) {
      const int j = (int)(i / ((size_t)a.k * a.n));
      const int kk = (int)(i / a.n % a.k), col = (int)(i % a.n);
      for (int r = start[j]; r < end[j]; ++r)
        acc += lhs[(size_t)r * a.k + kk] * rhs[(size_t)r * a.n + col];
    } else {
      const int row = (int)(i / a.n), col = (int)(i % a.n);
      if (row >= lo && row < hi) {
        int j = 0, jhi = GL; /* first j with end[j] > row */
        while (j < jhi) {
          int mid = (j + jhi) >> 1;
          if (end[mid] > row)
            jhi = mid;
          else
            j = mid + 1;
        }
        const float *w = rhs + (size_t)j * a.k * a.n;
        for (int kk = 0; kk < a.k; ++kk)
          acc += lhs[(size_t)row * a.k + kk] *
                 (a.transpose_rhs ? w[(size_t)col * a.k + kk] : w[(size_t)kk * a.n + col]);
      }
    }
    store_out(a.out, a.out_dtype, i, acc);
  }
}

__global__ void __launch_bounds__(1024)
    table_kernel(GmmArgs a, int bm, int tiles_n, int tiles_per_group, int layout) {
  build_group_table(a, a.table, bm, tiles_n, tiles_per_group, layout);
}

template <typename T, bool TGMM, bool TRANS_B, bool VEC>
sl_status launch(const GmmArgs &a, int num_sms, cudaStream_t stream) {
  using L = Layout<TGMM, TRANS_B>;
  auto kernel = gmm_kernel<T, TGMM, TRANS_B, VEC>;
  const int tiles_n = (a.n + BN - 1) / BN, tiles_k = (a.k + BM - 1) / BM;
  GmmArgs b;
  size_t smem;
  sl_status st = place_table(a, &b, (const void *)kernel, L::PIPE_BYTES, TGMM ? 0 : BM, tiles_n,
                             tiles_k * tiles_n, kTilesPlain, stream, &smem,
                             TGMM ? "tgmm (sm80)" : "gmm (sm80)");
  if (st != SL_STATUS_SUCCESS) return st;
  /* Upper bound on tiles without reading device sizes; the grid is persistent anyway. */
  long long tiles = TGMM ? (long long)a.num_local_groups * tiles_k * tiles_n
                         : ((long long)(a.m + BM - 1) / BM + a.num_local_groups) * tiles_n;
  long long grid = tiles < num_sms ? tiles : num_sms;
  if (!TGMM && a.m > 0 && grid < num_sms) grid = num_sms; /* zeroing rows needs the whole grid */
  if (grid < 1) grid = 1;
  kernel<<<(unsigned)grid, THREADS, smem, stream>>>(b);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (sm80): launch failed: %s",
                        cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

template <typename T>
sl_status launch_t(const GmmArgs &a, bool tgmm, bool vec, int num_sms, cudaStream_t s) {
  if (tgmm)
    return vec ? launch<T, true, false, true>(a, num_sms, s)
               : launch<T, true, false, false>(a, num_sms, s);
  if (a.transpose_rhs)
    return vec ? launch<T, false, true, true>(a, num_sms, s)
               : launch<T, false, true, false>(a, num_sms, s);
  return vec ? launch<T, false, false, true>(a, num_sms, s)
             : launch<T, false, false, false>(a, num_sms, s);
}

} /* namespace sm80 */

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

namespace {

/* A kernel's shared-memory facts on one device, found once: its static bytes and the dynamic bytes
 * it is allowed, raised to the device's opt-in limit on first use. Asking the runtime on every
 * call (cudaFuncGetAttributes, cudaFuncSetAttribute) made a gmm call's host path 20 us instead of
 * 15 (H200), which problems of tens of microseconds pay in full when XLA runs the call from the
 * host. */
struct KernelSmem {
  const void *kernel;
  int dev;
  size_t static_bytes;
  int dynamic_limit;
};
constexpr int kKernelSmemSlots = 64;
KernelSmem g_kernel_smem[kKernelSmemSlots];
int g_kernel_smem_used = 0;
std::mutex g_kernel_smem_mutex;

cudaError_t kernel_smem(const void *kernel, KernelSmem *out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(g_kernel_smem_mutex);
  for (int i = 0; i < g_kernel_smem_used; ++i)
    if (g_kernel_smem[i].kernel == kernel && g_kernel_smem[i].dev == dev) {
      *out = g_kernel_smem[i];
      return cudaSuccess;
    }
  KernelSmem k{kernel, dev, 0, 0};
  int optin = 0;
  cudaFuncAttributes fa;
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&fa, kernel);
  if (err != cudaSuccess) return err;
  k.static_bytes = fa.sharedSizeBytes;
  k.dynamic_limit = optin - (int)fa.sharedSizeBytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, k.dynamic_limit);
  if (err != cudaSuccess) return err;
  if (g_kernel_smem_used < kKernelSmemSlots) g_kernel_smem[g_kernel_smem_used++] = k;
  *out = k;
  return cudaSuccess;
}

} /* namespace */

sl_status place_table(const GmmArgs &a, GmmArgs *b, const void *kernel, size_t pipe_bytes, int bm,
                      int tiles_n, int tiles_per_group, int layout, cudaStream_t stream,
                      size_t *smem, const char *who) {
  *b = a;
  const size_t table = (size_t)table_ints(a.num_local_groups) * sizeof(int);
  KernelSmem ks;
  cudaError_t err = kernel_smem(kernel, &ks);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: shared memory limits: %s", who,
                        cudaGetErrorString(err));
  if (pipe_bytes > (size_t)ks.dynamic_limit) /* (an error, not UNSUPPORTED: no silent fallback) */
    return sl_set_error(SL_STATUS_CUDA_ERROR,
                        "%s: the kernel needs %zu bytes of shared memory; this device allows %d",
                        who, pipe_bytes, ks.dynamic_limit);
  if (pipe_bytes + table <= (size_t)ks.dynamic_limit) {
    b->table = nullptr; /* each CTA builds it in its shared memory */
    *smem = pipe_bytes + table;
    return SL_STATUS_SUCCESS;
  }
  if (a.table == nullptr)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: the group table of %d local groups (%zu bytes) does not fit in "
                        "shared memory beside the kernel's own %zu bytes (this device allows %d "
                        "per block); pass a workspace of sl_gmm_cuda_workspace_size() bytes",
                        who, a.num_local_groups, table, ks.static_bytes + pipe_bytes,
                        ks.dynamic_limit + (int)ks.static_bytes);
  sm80::table_kernel<<<1, 1024, 0, stream>>>(a, bm, tiles_n, tiles_per_group, layout);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: group table launch failed: %s", who,
                        cudaGetErrorString(err));
  *smem = pipe_bytes;
  return SL_STATUS_SUCCESS;
}

sl_status sm80_gmm_launch(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t stream) {
  /* 16-byte cp.async needs every operand row to start on 16 bytes. */
  const bool vec = aligned16(a.lhs) && aligned16(a.rhs) && a.k % 8 == 0 &&
                   ((!tgmm && a.transpose_rhs) || a.n % 8 == 0);
  if (a.in_dtype == SL_DTYPE_BF16)
    return sm80::launch_t<__nv_bfloat16>(a, tgmm, vec, num_sms, stream);
  if (a.in_dtype == SL_DTYPE_F16) return sm80::launch_t<__half>(a, tgmm, vec, num_sms, stream);
  return naive_gmm_launch(a, tgmm, num_sms, stream);
}

sl_status naive_gmm_launch(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t stream) {
  auto kernel = tgmm ? sm80::naive_kernel<true> : sm80::naive_kernel<false>;
  GmmArgs b;
  size_t smem;
  sl_status st = place_table(a, &b, (const void *)kernel, 0, tgmm ? 0 : 1, 1, 1, kTilesPlain,
                             stream, &smem, tgmm ? "tgmm (f32)" : "gmm (f32)");
  if (st != SL_STATUS_SUCCESS) return st;
  kernel<<<num_sms * 8, 256, smem, stream>>>(b);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (f32): launch failed: %s",
                        cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

} /* namespace sluice_cuda */
