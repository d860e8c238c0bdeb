/* Hopper grouped GEMM (sm_90a): wgmma m64n256k16 fed by TMA through a 4-stage mbarrier pipeline.
 *
 * One persistent CTA per SM, 3 warpgroups: warpgroup 0 produces (one thread issues the TMA loads),
 * warpgroups 1 and 2 each own 64 rows of the 128x256 output tile. Every CTA builds the group table
 * from the device's group_sizes at entry (gmm_common.cuh) and walks tiles t = blockIdx.x,
 * + gridDim.x, ... in the same order in producer and consumers, so no tile mixes groups:
 *
 *   gmm   tile = (group j, 128 rows of j, 256 cols). A = lhs rows [K-major, box 64x128], B = rhs[j]
 *         through a 3-d map [G_local, K, N] (N-major, 4 boxes of 64x64) or [G_local, N, K]
 *         (K-major, one 64x256 box). A tile may load rows of the next group; the epilogue stores
 *         only this group's rows. K edges and M edges are zero-filled by TMA bounds.
 *   tgmm  tile = (group j, 128 rows of out[j] = K dim, 256 cols), contraction over the group's
 *         rows in blocks of 64: A = lhs^T (M-major, 2 boxes), B = rhs rows (N-major, 4 boxes).
 *         Rows of the last block past the group's end belong to the next group and would join the
 *         contraction: the consumers zero them in shared memory before the wgmma.
 *
 * Shared memory per stage: A 16 KB + B 32 KB, 128B-swizzled, 1024-byte aligned; 4 stages = 192 KB.
 * The mainloop waits for each k-block's wgmmas before releasing its stage (the other consumer
 * warpgroup keeps the tensor cores busy meanwhile). The epilogue stores from registers. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "../core/internal.h"
#include "gmm_common.cuh"
#include "sm90_gmm.cuh"

namespace sluice_cuda {
namespace sm90 {

constexpr int BM = 128, BN = 256, BK = 64, THREADS = 384;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int BOX_BYTES = 64 * 64 * 2; /* one 64x64 swizzled box */
constexpr int C_BYTES = BM * BN * 2;   /* 16-bit output tile staged for the TMA store */
static_assert(
    A_BYTES == 2 * BOX_BYTES && B_BYTES == 4 * BOX_BYTES,
    "a stage is 2 A boxes and 4 B boxes of 64x64: the TMA issue and the fix-up assume it");

/* Kernel variants (dev/cuda/gmm.cu times each):
 *   V_BASE   4 stages, each k-block's wgmmas waited before the next (wait_group 0), epilogue
 *            stores straight from registers.
 *   V_WAIT1  as V_BASE, but one k-block of wgmmas stays in flight (wait_group 1): the stage is
 *            released one k-block later.
 *   V_TMA_C  V_WAIT1 with the epilogue staged in shared memory (128B-swizzled, conflict-free) and
 *            written by TMA bulk stores that overlap the next tile's mainloop; 3 stages to make
 *            room for the 64 KB tile. 16-bit outputs; a gmm half-tile that crosses its group's
 *            end falls back to masked register stores.
 *            The default for 16-bit outputs (fastest in dev/NOTES.md's measurements).
 *   V_TMA_C0 V_TMA_C with wait_group 0: predicted faster (3 stages and a k-block in flight leave
 *            the producer one stage of lookahead), measured equal on tgmm and 0-11% slower on gmm.
 * In every variant the tgmm rows past a group's end are zeroed by warps 1-3 of the producer
 * warpgroup as soon as the block lands, off the consumers' path; consumers wait for a per-stage
 * "fixed" barrier on those blocks only. */
enum Variant { V_BASE = 0, V_WAIT1 = 1, V_TMA_C = 2, V_TMA_C0 = 3 };
__host__ __device__ constexpr bool has_tma_c(int v) { return v == V_TMA_C || v == V_TMA_C0; }
__host__ __device__ constexpr int stages_of(int v) { return has_tma_c(v) ? 3 : 4; }
__host__ __device__ constexpr size_t pipe_bytes(int v) {
  return 1024 /* alignment slack */ + (size_t)stages_of(v) * STAGE_BYTES +
         (has_tma_c(v) ? C_BYTES : 0) + 4 * stages_of(v) * 8;
}

template <typename T, bool TGMM, bool TRANS_B, int VARIANT>
__global__ void __launch_bounds__(THREADS, 1)
    gmm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_c, GmmArgs a) {
#ifdef SLUICE_SM90A_DEVICE
  constexpr int STAGES = stages_of(VARIANT);
  constexpr size_t PIPE_BYTES = pipe_bytes(VARIANT);
  constexpr bool WAIT1 = VARIANT == V_WAIT1 || VARIANT == V_TMA_C, TMA_C = has_tma_c(VARIANT);
  extern __shared__ __align__(1024) unsigned char smem_sm90[];
  unsigned char *smem_raw = smem_sm90;
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t stage0 = smem_u32(base);
  const uint32_t c_smem = stage0 + STAGES * STAGE_BYTES; /* TMA_C only */
  uint64_t *bars =
      reinterpret_cast<uint64_t *>(base + STAGES * STAGE_BYTES + (TMA_C ? C_BYTES : 0));
  const uint32_t full0 = smem_u32(bars), empty0 = full0 + STAGES * 8, fixed0 = empty0 + STAGES * 8;
  const uint32_t issued0 =
      fixed0 + STAGES * 8; /* tgmm: producer issued a block that needs fixing */

  const int tiles_n = (a.n + BN - 1) / BN, tiles_k = (a.k + BM - 1) / BM;
  int *tab = a.table;
  if (tab == nullptr) {
    tab = reinterpret_cast<int *>(smem_raw + PIPE_BYTES);
    build_group_table(a, tab, TGMM ? 0 : BM, tiles_n, tiles_k * tiles_n);
  }
  const int GL = a.num_local_groups;
  const int *start = tab + kTableHeader, *end = start + GL, *tile_prefix = end + GL;
  const int total_tiles = tab[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8);  /* lane 0 of each consumer warp */
      mbar_init(fixed0 + 8 * s, 1);  /* tgmm: the fixer warps zeroed the rows past the group */
      mbar_init(issued0 + 8 * s, 1); /* tgmm: the producer issued such a block into stage s */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (!TGMM) zero_outside_rows(a, tab[0], tab[1]);
  __syncthreads();

  /* Decodes tile t into (group j, first row m0, first column n0, k-blocks nk, group rows). */
  auto decode = [&](int t, int &j, int &m0, int &n0, int &nk, int &gs, int &ge) {
    j = find_group(tile_prefix, GL, t);
    const int u = t - tile_prefix[j];
    gs = start[j];
    ge = end[j];
    int mt, nt;
    if (TGMM) {
      panel_raster(u, tiles_k, tiles_n, mt, nt);
      m0 = mt * BM;
      nk = (ge - gs + BK - 1) / BK;
    } else {
      panel_raster(u, (ge - gs + BM - 1) / BM, tiles_n, mt, nt);
      m0 = gs + mt * BM;
      nk = (a.k + BK - 1) / BK;
    }
    n0 = nt * BN;
  };

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int s = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        int j, m0, n0, nk, gs, ge;
        decode(t, j, m0, n0, nk, gs, ge);
        for (int kb = 0; kb < nk; ++kb) {
          const uint32_t full = full0 + 8 * s;
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          mbar_expect_tx(full, STAGE_BYTES);
          const uint32_t sa = stage0 + s * STAGE_BYTES, sb = sa + A_BYTES;
          if (TGMM) {
            const int r0 = gs + kb * BK;
            tma_load_2d(sa, &map_a, m0, r0, full);
            tma_load_2d(sa + BOX_BYTES, &map_a, m0 + 64, r0, full);
#pragma unroll
            for (int i = 0; i < 4; ++i)
              tma_load_2d(sb + i * BOX_BYTES, &map_b, n0 + 64 * i, r0, full);
          } else {
            const int k0 = kb * BK;
            tma_load_2d(sa, &map_a, k0, m0, full);
            if (TRANS_B) {
              tma_load_3d(sb, &map_b, k0, n0, j, full);
            } else {
#pragma unroll
              for (int i = 0; i < 4; ++i)
                tma_load_3d(sb + i * BOX_BYTES, &map_b, n0 + 64 * i, k0, j, full);
            }
          }
          if (TGMM && kb == nk - 1 && ge - gs - kb * BK < BK) mbar_arrive(issued0 + 8 * s);
          if (++s == STAGES) s = 0, phase ^= 1;
        }
      }
    } else if (TGMM && threadIdx.x >= 32) {
      /* Fixers (warps 1-3): the last block of a group's contraction holds rows of the next group
       * (or TMA zeros past M); zero them in shared memory before the consumers read the stage. */
      const int ft = threadIdx.x - 32;
      long long blk = 0;         /* k-blocks issued so far, as the producer counts them */
      uint32_t issued_phase = 0; /* bit s: parity of stage s's next "issued" phase */
      for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
        int j, m0, n0, nk, gs, ge;
        decode(t, j, m0, n0, nk, gs, ge);
        const int rv = ge - gs - (nk - 1) * BK; /* valid rows of the last block */
        if (nk > 0 && rv < BK) {
          const long long b = blk + nk - 1;
          const int s = (int)(b % STAGES);
          /* Wait until the producer has issued block b: only then is stage s's current full phase
           * b's own (a parity wait further ahead could match an older phase). Neither barrier can
           * lap the fixers: stage s is not refilled until the consumers saw this block fixed. */
          mbar_wait(issued0 + 8 * s, (issued_phase >> s) & 1);
          issued_phase ^= 1u << s;
          mbar_wait(full0 + 8 * s, (uint32_t)((b / STAGES) & 1));
          const uint32_t sa = stage0 + s * STAGE_BYTES, sb = sa + A_BYTES;
          const int chunks = (BK - rv) * 6 * 8; /* rows x (2 A + 4 B boxes) x 16-byte chunks */
          for (int c = ft; c < chunks; c += 96) {
            const int row = rv + c / 48, box = (c % 48) / 8, ch = c % 8;
            const uint32_t addr =
                (box < 2 ? sa + box * BOX_BYTES : sb + (box - 2) * BOX_BYTES) + row * 128 + ch * 16;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0)
                         : "memory");
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          named_bar(4, 96);
          if (ft == 0) mbar_arrive(fixed0 + 8 * s);
        }
        blk += nk;
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1; /* which 64 rows of the tile */
    const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
    float acc[128];
    int s = 0;
    uint32_t phase = 0, fixed_phase = 0; /* bit s: parity of stage s's next "fixed" phase */
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      int j, m0, n0, nk, gs, ge;
      decode(t, j, m0, n0, nk, gs, ge);
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      for (int kb = 0; kb < nk; ++kb) {
        mbar_wait(full0 + 8 * s, phase);
        const uint32_t sa = stage0 + s * STAGE_BYTES, sb = sa + A_BYTES;
        if (TGMM && kb == nk - 1 && ge - gs - kb * BK < BK) {
          mbar_wait(fixed0 + 8 * s, (fixed_phase >> s) & 1);
          fixed_phase ^= 1u << s;
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          uint64_t da, db;
          if (TGMM) {
            da = make_desc(sa + cw * BOX_BYTES + kk * 2048, BOX_BYTES, 1024);
            db = make_desc(sb + kk * 2048, BOX_BYTES, 1024);
          } else {
            da = make_desc(sa + cw * 64 * 128 + kk * 32, 16, 1024);
            db = TRANS_B ? make_desc(sb + kk * 32, 16, 1024)
                         : make_desc(sb + kk * 2048, BOX_BYTES, 1024);
          }
          constexpr int TA = TGMM ? 1 : 0, TB = TRANS_B ? 0 : 1;
          if constexpr (std::is_same<T, __nv_bfloat16>::value)
            wgmma_m64n256k16_bf16<TA, TB>(acc, da, db, 1);
          else
            wgmma_m64n256k16_f16<TA, TB>(acc, da, db, 1);
        }
        wgmma_commit();
        if (WAIT1) {
          /* k-block kb stays in flight; kb-1 is done, so its stage goes back to the producer. */
          wgmma_wait1();
          fence_operands(acc);
          if (kb > 0 && lane == 0) mbar_arrive(empty0 + 8 * (s == 0 ? STAGES - 1 : s - 1));
        } else {
          wgmma_wait0();
          fence_operands(acc);
          if (lane == 0) mbar_arrive(empty0 + 8 * s);
        }
        if (++s == STAGES) s = 0, phase ^= 1;
      }
      if (WAIT1 && nk > 0) {
        wgmma_wait0();
        fence_operands(acc);
        if (lane == 0) mbar_arrive(empty0 + 8 * (s == 0 ? STAGES - 1 : s - 1));
      }

      /* Epilogue: thread holds rows warp*16 + lane/4 (+8), columns 8i + 2*(lane%4) (+1). */
      const int row_limit = TGMM ? a.k : ge;
      void *out =
          TGMM ? (void *)((char *)a.out + (size_t)j * a.k * a.n * dtype_bytes(a.out_dtype)) : a.out;
      if (TMA_C && (TGMM || m0 + cw * 64 + 64 <= ge)) {
        /* This warpgroup's 64x256 half: 4 boxes of 64x64, 128B-swizzled like the TMA map. */
        const uint32_t cbase = c_smem + cw * (C_BYTES / 2);
        if (lt == 0) bulk_wait_read0(); /* the previous tile's store has read the staging buffer */
        named_bar(2 + cw, 128);
#pragma unroll
        for (int i = 0; i < 32; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = warp * 16 + (lane >> 2) + h * 8;
            const uint32_t addr = cbase + (i >> 3) * BOX_BYTES + r * 128 +
                                  (((i & 7) ^ (r & 7)) << 4) + (lane & 3) * 4;
            uint32_t packed;
            if (a.out_dtype == SL_DTYPE_BF16) {
              __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
              packed = *reinterpret_cast<uint32_t *>(&v);
            } else {
              __half2 v = __floats2half2_rn(acc[4 * i + 2 * h], acc[4 * i + 2 * h + 1]);
              packed = *reinterpret_cast<uint32_t *>(&v);
            }
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
          }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_bar(2 + cw, 128);
        if (lt == 0) {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            if (TGMM)
              tma_store_3d(&map_c, cbase + b * BOX_BYTES, n0 + 64 * b, m0 + cw * 64, j);
            else
              tma_store_2d(&map_c, cbase + b * BOX_BYTES, n0 + 64 * b, m0 + cw * 64);
          }
          bulk_commit();
        }
      } else {
        const bool pair_ok = (a.n % 2) == 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + cw * 64 + warp * 16 + (lane >> 2) + h * 8;
          if (row < row_limit) {
#pragma unroll
            for (int i = 0; i < 32; ++i) {
              const int col = n0 + i * 8 + (lane & 3) * 2;
              const size_t idx = (size_t)row * a.n + col;
              const float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
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
    }
    if (TMA_C && lt == 0) bulk_wait0(); /* stores done before the CTA's shared memory goes away */
  }
#else
  (void)map_a, (void)map_b, (void)map_c, (void)a;
#endif
}

/* cuTensorMapEncodeTiled through the runtime, so libsluice does not link libcuda. */
static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (fn == nullptr) {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
  }
  return fn;
}

/* A tensor map with 128B swizzle and zero fill out of bounds; dims[0] is the contiguous one. */
static bool make_map(CUtensorMap *map, const void *ptr, sl_dtype dt, int rank, const uint64_t *dims,
                     const uint64_t *strides_bytes, const uint32_t *box) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr) return false;
  cuuint64_t d[3], st[2];
  cuuint32_t b[3], es[3] = {1, 1, 1};
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) st[i] = strides_bytes[i];
  CUresult r = encode(
      map, dt == SL_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      (cuuint32_t)rank, const_cast<void *>(ptr), d, st, b, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

static bool tma_c_ok(const GmmArgs &a) {
  return (a.out_dtype == SL_DTYPE_BF16 || a.out_dtype == SL_DTYPE_F16) && a.n % 8 == 0 &&
         ((uintptr_t)a.out & 15) == 0;
}

template <typename T, bool TGMM, bool TRANS_B, int VARIANT>
static sl_status launch(const GmmArgs &a, int num_sms, cudaStream_t stream) {
  CUtensorMap ma, mb, mc;
  memset(&mc, 0, sizeof mc);
  const uint64_t M = a.m, K = a.k, N = a.n, GL = a.num_local_groups;
  const uint32_t box64[3] = {64, 64, 1};
  bool ok;
  if (TGMM) {
    const uint64_t da[2] = {K, M}, sa[1] = {K * 2}, db[2] = {N, M}, sb[1] = {N * 2};
    ok = make_map(&ma, a.lhs, a.in_dtype, 2, da, sa, box64) &&
         make_map(&mb, a.rhs, a.in_dtype, 2, db, sb, box64);
    if (has_tma_c(VARIANT)) {
      const uint64_t dc[3] = {N, K, GL}, sc[2] = {N * 2, K * N * 2};
      ok = ok && make_map(&mc, a.out, a.out_dtype, 3, dc, sc, box64);
    }
  } else {
    const uint64_t da[2] = {K, M}, sa[1] = {K * 2};
    const uint32_t boxa[2] = {64, 128};
    ok = make_map(&ma, a.lhs, a.in_dtype, 2, da, sa, boxa);
    if (TRANS_B) {
      const uint64_t db[3] = {K, N, GL}, sb[2] = {K * 2, N * K * 2};
      const uint32_t boxb[3] = {64, 256, 1};
      ok = ok && make_map(&mb, a.rhs, a.in_dtype, 3, db, sb, boxb);
    } else {
      const uint64_t db[3] = {N, K, GL}, sb[2] = {N * 2, K * N * 2};
      ok = ok && make_map(&mb, a.rhs, a.in_dtype, 3, db, sb, box64);
    }
    if (has_tma_c(VARIANT)) {
      const uint64_t dc[2] = {N, M}, sc[1] = {N * 2};
      ok = ok && make_map(&mc, a.out, a.out_dtype, 2, dc, sc, box64);
    }
  }
  if (!ok) return SL_STATUS_UNSUPPORTED; /* the caller falls back to the portable kernel */

  auto kernel = gmm_kernel<T, TGMM, TRANS_B, VARIANT>;
  const size_t smem =
      pipe_bytes(VARIANT) + (a.table ? 0 : table_ints(a.num_local_groups) * sizeof(int));
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (sm90): %zu bytes of shared memory: %s", smem,
                        cudaGetErrorString(err));
  const long long tiles_n = (a.n + BN - 1) / BN;
  const long long tiles = TGMM ? (long long)a.num_local_groups * ((a.k + BM - 1) / BM) * tiles_n
                               : ((a.m + BM - 1) / BM + a.num_local_groups) * tiles_n;
  long long grid = (!TGMM || tiles > num_sms) ? num_sms : tiles;
  if (grid < 1) grid = 1;
  kernel<<<(unsigned)grid, THREADS, smem, stream>>>(ma, mb, mc, a);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (sm90): launch failed: %s",
                        cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

template <typename T, int VARIANT>
static sl_status launch_v(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t s) {
  if (tgmm) return launch<T, true, false, VARIANT>(a, num_sms, s);
  return a.transpose_rhs ? launch<T, false, true, VARIANT>(a, num_sms, s)
                         : launch<T, false, false, VARIANT>(a, num_sms, s);
}

template <typename T>
static sl_status launch_t(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t s, int variant) {
  if (variant < 0) variant = tma_c_ok(a) ? V_TMA_C : V_BASE;
  if (has_tma_c(variant) && !tma_c_ok(a)) return SL_STATUS_UNSUPPORTED;
  if (variant == V_BASE) return launch_v<T, V_BASE>(a, tgmm, num_sms, s);
  if (variant == V_WAIT1) return launch_v<T, V_WAIT1>(a, tgmm, num_sms, s);
  if (variant == V_TMA_C) return launch_v<T, V_TMA_C>(a, tgmm, num_sms, s);
  return launch_v<T, V_TMA_C0>(a, tgmm, num_sms, s);
}

} /* namespace sm90 */

bool sm90_gmm_supports(const GmmArgs &a, bool tgmm) {
  if (a.in_dtype != SL_DTYPE_BF16 && a.in_dtype != SL_DTYPE_F16) return false;
  if (a.k <= 0 || a.n <= 0 || a.m <= 0 || a.num_local_groups <= 0) return false;
  if (((uintptr_t)a.lhs & 15) || ((uintptr_t)a.rhs & 15)) return false;
  /* TMA: every row stride a multiple of 16 bytes. */
  if (a.k % 8) return false;
  if ((tgmm || !a.transpose_rhs) && a.n % 8) return false;
  return true;
}

sl_status sm90_gmm_launch(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t stream,
                          int variant) {
  if (!sm90_gmm_supports(a, tgmm)) return SL_STATUS_UNSUPPORTED;
  if (a.table) {
    const int tiles_n = (a.n + sm90::BN - 1) / sm90::BN, tiles_k = (a.k + sm90::BM - 1) / sm90::BM;
    sl_status st =
        table_build_launch(a, tgmm, tgmm ? 0 : sm90::BM, tiles_n, tiles_k * tiles_n, stream);
    if (st != SL_STATUS_SUCCESS) return st;
  }
  if (a.in_dtype == SL_DTYPE_BF16)
    return sm90::launch_t<__nv_bfloat16>(a, tgmm, num_sms, stream, variant);
  return sm90::launch_t<__half>(a, tgmm, num_sms, stream, variant);
}

} /* namespace sluice_cuda */
