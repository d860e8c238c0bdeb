/* Hopper (sm_90a) FP8 grouped GEMMs with DeepSeek-V3's fine-grained scaling (sluice.h, "FP8 grouped
 * GEMM"): gmm_fp8 (the forward and the input gradient, rhs [G_local, N, K]) and tgmm_fp8 (the weight
 * gradient, operands transposed: [K, M] and [N, M]).
 *
 * One persistent kernel serves both: a CTA per SM, 384 threads. Warpgroup 0's first thread issues
 * the TMA copies; warpgroups 1 and 2 each compute 64 rows of a 128 x BN output tile (BN = 128 NSUB).
 * A k-block is one scale block, 128 e4m3 values of the contraction: 128 bytes, so a tile row is
 * one 128B-swizzled shared-memory row, and A (128 x 128 B) and B (BN x 128 B) of a stage are one
 * TMA box each, read K-major by wgmma m64n128k32 (e4m3 x e4m3 -> f32). For each k-block and each
 * 128 columns a warpgroup runs 4 wgmmas into a fresh partial accumulator, waits for them, and adds
 * partial x scales into its f32 total: the promotion DeepSeek-V3 describes (the FP8 wgmma's own
 * accumulation keeps fewer bits than f32, so no partial sum is longer than one block). While one
 * warpgroup promotes, the other's wgmmas keep the tensor cores busy. The consumers' wgmma
 * descriptors are stage 0's, made once: a stage, a 32-byte k step and a 128-column sub-tile are
 * additions to the start-address field, so a batch's four wgmmas issue back to back from uniform
 * registers (an m64n128k32 takes the tensor pipe 64 cycles, less than rebuilding a descriptor from
 * an address does).
 *   gmm:  scale = lhs_scale[row, kb] x rhs_scale[j, nb, kb]: two row scales and one block scalar
 *         per thread, 128 columns and k-block, loaded before the wait for the k-block's stage.
 *   tgmm: the k-blocks are the absolute 128-row blocks of the ragged dim from the group's first row
 *         to its last; the rows of a block outside the group are zeroed in A (each warpgroup its
 *         own 64 rows of A) before the wgmmas, so they add nothing (a non-finite value there makes
 *         its block's scale NaN, as the quantization defines, and the reference agrees);
 *         scale = lhs_scale[mb, k] x rhs_scale[mb, n]: the k-block's 128 row and BN column
 *         scales come with its operands (two more TMA boxes), 2 row and 32 column scales a thread
 *         and 128 columns. The per-element scale makes tgmm's promotion twice gmm's work,
 *         and its two consumer warpgroups take turns issuing their wgmmas (turn_wait).
 * Tiles go to CTAs by a fixed stride; the producer and the consumers decode each tile from the
 * group table (gmm_common.cuh) themselves. A bf16 output, and tgmm's f32 output on 256-column tiles
 * (in two passes), are staged in shared memory for TMA stores that overlap the next tile; a gmm
 * half that crosses its group's end, and the other f32 outputs, are stored from registers,
 * masked. */
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "../core/internal.h"
#include "sluice.h"
#include "sm90_gmm_pipeline.cuh"

namespace sluice_cuda {
namespace sm90 {
namespace fp8 {

constexpr int kThreads = 384, kBM = 128, kKB = 128; /* tile rows; contraction per k-block */

/* A launch's arguments: the problem (as the 16-bit kernels see it) and the two scale arrays. */
struct Fp8Args {
  GmmArgs g;
  const float *sa; /* gmm: [M, ceil(K/128)]; tgmm: [ceil(M/128), K] */
  const float *sb; /* gmm: [G_local, ceil(N/128), ceil(K/128)]; tgmm: [ceil(M/128), N] */
};

template <int NSUB, bool WGRAD, int STAGES>
struct Shape {
  static constexpr int kBN = 128 * NSUB, kStages = STAGES;
  static constexpr int kABytes = kBM * kKB, kBBytes = kBN * kKB;
  /* tgmm: the k-block's 128 row and BN column scales after A and B */
  static constexpr int kScaleBytes = WGRAD ? (kBM + kBN) * 4 : 0;
  static constexpr int kLoadBytes = kABytes + kBBytes + kScaleBytes; /* TMA bytes a stage */
  static constexpr int kStageBytes = (kLoadBytes + 1023) / 1024 * 1024;
  static constexpr int kCBytes = kBM * kBN * 2; /* the bf16 output tile, staged for TMA stores */
  static constexpr size_t kPipeBytes =
      1024 /* alignment slack */ + (size_t)kStages * kStageBytes + kCBytes + 2 * 8 * kStages;
};

/* A tile: local group j with rows [gs, ge); output rows from m0 (gmm: rows of lhs; tgmm: rows of
 * out[j], K) and columns from n0; nk k-blocks, the first (tgmm) at absolute row block mb0. */
struct Tile {
  int j, gs, ge, m0, n0, nk, mb0;
};

template <int BN, bool WGRAD>
__device__ __forceinline__ Tile decode(const GmmArgs &a, const int *tab, int t, int tiles_n,
                                       int tiles_k) {
  const int GL = a.num_local_groups;
  const int *start = tab + kTableHeader, *end = start + GL, *prefix = end + GL;
  const int r = find_group(prefix, GL, t);
  const int u = t - prefix[r];
  Tile d;
  d.j = WGRAD ? prefix[GL + 1 + r] : r; /* tgmm: order[] follows the prefix (long groups first) */
  d.gs = start[d.j], d.ge = end[d.j];
  int mt, nt;
  if (!WGRAD) {
    panel_raster(u, (d.ge - d.gs + kBM - 1) / kBM, tiles_n, mt, nt);
    d.m0 = d.gs + mt * kBM;
    d.nk = (a.k + kKB - 1) / kKB;
    d.mb0 = 0;
  } else {
    panel_raster(u, tiles_k, tiles_n, mt, nt);
    d.m0 = mt * kBM;
    d.mb0 = d.gs / kKB;
    d.nk = d.ge > d.gs ? (d.ge - 1) / kKB - d.mb0 + 1 : 0;
  }
  d.n0 = nt * BN;
  return d;
}

#ifdef SLUICE_SM90A_DEVICE
/* D (f32, 64 per thread) = or += A * B, m64n128k32, e4m3 operands K-major in shared memory. */
__device__ __forceinline__ void wgmma_e4m3(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" SL_WGMMA_REGS_LO
      "}, %64, %65, p, 1, 1;\n}\n"
      : SL_WGMMA_ACC_LO(d)
      : "l"(da), "l"(db), "r"(scale_d));
}

/* tgmm's consumer warpgroups take turns issuing their wgmmas (named barriers 4 and 5, both
 * warpgroups' 256 threads): warpgroup w waits on barrier 4 + w for its turn, issues, and hands the
 * turn to the other on barrier 5 - w. A batch thus always queues behind the other warpgroup's,
 * and each warpgroup's wait and promotion (tgmm's is twice gmm's) run while the other's batch
 * computes, instead of the two drifting into step and promoting at the same time. gmm, whose
 * promotion is half tgmm's, runs without them (docs/design-notes.md). */
__device__ __forceinline__ void turn_wait(int cw) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(4 + cw) : "memory");
}
__device__ __forceinline__ void turn_pass(int cw) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(5 - cw) : "memory");
}

__device__ __forceinline__ void fence_part(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* tgmm: zero the bytes outside [lo, hi) of this warpgroup's 64 rows of A (128B-swizzled rows of
 * 128 bytes from sa; logical 16-byte chunk c of row r lies at chunk c ^ (r % 8)). */
__device__ __forceinline__ void zero_outside(uint32_t sa, int cw, int lt, int lo, int hi) {
  const int row = cw * 64 + (lt >> 1);
  const uint32_t rbase = sa + row * 128;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int c = (lt & 1) * 4 + q, b0 = 16 * c;
    if (b0 >= lo && b0 + 16 <= hi) continue;
    const uint32_t addr = rbase + ((c ^ (row & 7)) << 4);
    uint32_t v[4] = {0u, 0u, 0u, 0u};
    if (b0 + 16 > lo && b0 < hi) {
      asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                   : "r"(addr));
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t keep = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int idx = b0 + 4 * w + b;
          if (idx >= lo && idx < hi) keep |= 0xFFu << (8 * b);
        }
        v[w] &= keep;
      }
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v[0]), "r"(v[1]),
                 "r"(v[2]), "r"(v[3])
                 : "memory");
  }
}
#endif /* SLUICE_SM90A_DEVICE */

template <int NSUB, bool WGRAD, int STAGES>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_sa,
               const __grid_constant__ CUtensorMap map_sb, Fp8Args args) {
#ifdef SLUICE_SM90A_DEVICE
  using S = Shape<NSUB, WGRAD, STAGES>;
  constexpr int BN = S::kBN;
  const GmmArgs &a = args.g;
  extern __shared__ __align__(1024) unsigned char smem_fp8[];
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_fp8 + 1023) & ~(uintptr_t)1023);
  const uint32_t stage0 = smem_u32(base), c_smem = stage0 + STAGES * S::kStageBytes;
  const uint32_t full0 = c_smem + S::kCBytes, empty0 = full0 + 8 * STAGES;
  const int tiles_n = (a.n + BN - 1) / BN, tiles_k = (a.k + kBM - 1) / kBM;
  const int *tab = a.table;
  if (tab == nullptr) {
    int *t = reinterpret_cast<int *>(smem_fp8 + S::kPipeBytes);
    build_group_table(a, t, WGRAD ? 0 : kBM, tiles_n, tiles_n * tiles_k, kTilesPlain);
    tab = t;
  }
  const int total_tiles = tab[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8); /* lane 0 of each consumer warp */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (!WGRAD && !a.skip_unused) zero_outside_rows(a, tab[0], tab[1]);
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x != 0) return;
    int s = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
      const Tile d = decode<BN, WGRAD>(a, tab, t, tiles_n, tiles_k);
      for (int kb = 0; kb < d.nk; ++kb) {
        const uint32_t full = full0 + 8 * s, sa = stage0 + s * S::kStageBytes;
        mbar_wait(empty0 + 8 * s, phase ^ 1);
        mbar_expect_tx(full, S::kLoadBytes);
        if (!WGRAD) {
          tma_load_2d(sa, &map_a, kb * kKB, d.m0, full);
          tma_load_3d(sa + S::kABytes, &map_b, kb * kKB, d.n0, d.j, full);
        } else {
          const int row = (d.mb0 + kb) * kKB;
          tma_load_2d(sa, &map_a, row, d.m0, full);
          tma_load_2d(sa + S::kABytes, &map_b, row, d.n0, full);
          tma_load_2d(sa + S::kABytes + S::kBBytes, &map_sa, d.m0, d.mb0 + kb, full);
          tma_load_2d(sa + S::kABytes + S::kBBytes + kBM * 4, &map_sb, d.n0, d.mb0 + kb, full);
        }
        if (++s == STAGES) s = 0, phase ^= 1;
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  /* the warpgroup index through a shuffle from lane 0, which the compiler knows to be uniform */
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const int M = a.m, K = a.k, N = a.n;
  const int KB = (K + kKB - 1) / kKB, NB = (N + 127) / 128; /* gmm's scale blocks */
  /* stage 0's descriptors: A's 64 rows of this warpgroup and B; a stage, a 32-byte k step and
   * a 128-column sub-tile are additions to the start address field (16-byte units) */
  const uint64_t desc_a0 = make_desc(stage0 + cw * 64 * 128, 16, 1024);
  const uint64_t desc_b0 = make_desc(stage0 + S::kABytes, 16, 1024);
  int s = 0;
  uint32_t phase = 0;
  float total[64 * NSUB];
  float part[64];
  if (WGRAD && cw == 1) turn_pass(cw); /* the first turn is consumer 0's */
  for (int t = blockIdx.x; t < total_tiles; t += gridDim.x) {
    const Tile d = decode<BN, WGRAD>(a, tab, t, tiles_n, tiles_k);
#pragma unroll
    for (int i = 0; i < 64 * NSUB; ++i) total[i] = 0.f;
    /* gmm: a tile with at most 64 rows of its group leaves warpgroup 2 nothing to compute */
    const bool idle = !WGRAD && cw == 1 && d.ge - d.m0 <= 64;
    /* gmm's scales: this thread's rows r0 and r0 + 8 (clamped into the array) and the weight's
     * 128-column blocks of the tile, each pointer advanced a k-block at a time */
    const int r0 = d.m0 + cw * 64 + warp * 16 + (lane >> 2);
    const float *sa0 = args.sa + (size_t)min(r0, M - 1) * KB;
    const float *sa1 = args.sa + (size_t)min(r0 + 8, M - 1) * KB;
    const float *sw0 = args.sb + ((size_t)d.j * NB + min(d.n0 >> 7, NB - 1)) * KB;
    const float *sw1 = args.sb + ((size_t)d.j * NB + min((d.n0 >> 7) + 1, NB - 1)) * KB;
    for (int kb = 0; kb < d.nk; ++kb) {
      /* gmm: the k-block's scales, loaded before the wait so that the wait and the wgmmas hide
       * their latency */
      float fs0 = 0.f, fs1 = 0.f, fw0 = 0.f, fw1 = 0.f;
      if constexpr (!WGRAD) {
        fs0 = __ldg(sa0++), fs1 = __ldg(sa1++), fw0 = __ldg(sw0++);
        if constexpr (NSUB > 1) fw1 = __ldg(sw1++);
      }
      mbar_wait(full0 + 8 * s, phase);
      const uint32_t sa = stage0 + s * S::kStageBytes, sb = sa + S::kABytes;
      const uint64_t soff = (uint32_t)(s * S::kStageBytes) >> 4;
      if (!idle) {
        int mb = 0;
        if constexpr (WGRAD) {
          mb = d.mb0 + kb;
          const int lo = max(d.gs - mb * kKB, 0), hi = min(d.ge - mb * kKB, kKB);
          if (lo > 0 || hi < kKB) { /* the same for the whole warpgroup */
            zero_outside(sa, cw, lt, lo, hi);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_bar(2 + cw, 128);
          }
        }
#pragma unroll
        for (int sub = 0; sub < NSUB; ++sub) {
          if constexpr (WGRAD) turn_wait(cw);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kKB / 32; ++kk)
            wgmma_e4m3(part, desc_a0 + soff + 2 * kk, desc_b0 + soff + sub * 1024 + 2 * kk, kk > 0);
          wgmma_commit();
          if constexpr (WGRAD) turn_pass(cw);
          if constexpr (!WGRAD) {
            const float sw = sub == 0 ? fw0 : fw1;
            const float f0 = fs0 * sw, f1 = fs1 * sw;
            wgmma_wait0();
            fence_part(part);
#pragma unroll
            for (int i = 0; i < 16; ++i) {
              total[sub * 64 + 4 * i + 0] = fmaf(part[4 * i + 0], f0, total[sub * 64 + 4 * i + 0]);
              total[sub * 64 + 4 * i + 1] = fmaf(part[4 * i + 1], f0, total[sub * 64 + 4 * i + 1]);
              total[sub * 64 + 4 * i + 2] = fmaf(part[4 * i + 2], f1, total[sub * 64 + 4 * i + 2]);
              total[sub * 64 + 4 * i + 3] = fmaf(part[4 * i + 3], f1, total[sub * 64 + 4 * i + 3]);
            }
          } else {
            /* the k-block's scales, as the producer's TMA put them beside the operands */
            const uint32_t ssa = sb + S::kBBytes, ssb = ssa + kBM * 4;
            const int rr = cw * 64 + warp * 16 + (lane >> 2);
            float s0, s1;
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(s0) : "r"(ssa + rr * 4));
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(s1) : "r"(ssa + rr * 4 + 32));
            wgmma_wait0();
            fence_part(part);
#pragma unroll
            for (int i = 0; i < 16; ++i) {
              float2 c;
              asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                           : "=f"(c.x), "=f"(c.y)
                           : "r"(ssb + (sub * 128 + 8 * i + 2 * (lane & 3)) * 4));
              total[sub * 64 + 4 * i + 0] += part[4 * i + 0] * (s0 * c.x);
              total[sub * 64 + 4 * i + 1] += part[4 * i + 1] * (s0 * c.y);
              total[sub * 64 + 4 * i + 2] += part[4 * i + 2] * (s1 * c.x);
              total[sub * 64 + 4 * i + 3] += part[4 * i + 3] * (s1 * c.y);
            }
          }
        }
      }
      if (lane == 0) mbar_arrive(empty0 + 8 * s); /* this warp is done with the stage */
      if (++s == STAGES) s = 0, phase ^= 1;
    }
    if (idle) continue;

    /* Epilogue: this warpgroup's 64 x BN half. */
    const int row0 = d.m0 + cw * 64;
    const bool whole = WGRAD || row0 + 64 <= d.ge;
    if (a.out_dtype == SL_DTYPE_BF16 && whole) {
      const uint32_t cbase = c_smem + cw * (S::kCBytes / 2);
      if (lt == 0) bulk_wait_read0(); /* the previous tile's store has read the buffer */
      named_bar(2 + cw, 128);
      stage_half_stsm<__nv_bfloat16, 64 * NSUB, BOX_BYTES>(total, cbase, warp, lane);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_bar(2 + cw, 128);
      if (lt == 0) {
#pragma unroll
        for (int b = 0; b < 2 * NSUB; ++b) {
          const int col = d.n0 + 64 * b;
          if (col >= N) break;
          if (WGRAD)
            tma_store_3d(&map_c, cbase + b * BOX_BYTES, col, row0, d.j);
          else
            tma_store_2d(&map_c, cbase + b * BOX_BYTES, col, row0);
        }
        bulk_commit();
      }
    } else if (WGRAD && NSUB == 2 && a.out_dtype == SL_DTYPE_F32) {
      /* f32 (tgmm on 256-column tiles): the half in two passes of 128 columns, each staged as four
       * 64 x 32 boxes for TMA stores, the second after the first's store has read the buffer, so
       * that the tile's stores overlap the next tile's k-blocks */
      const uint32_t cbase = c_smem + cw * (S::kCBytes / 2);
      const auto &t128 = *reinterpret_cast<const float(*)[128]>(&total[0]);
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        if (lt == 0) bulk_wait_read0();
        named_bar(2 + cw, 128);
        if (p == 0)
          stage_f32<0, 16, BOX_BYTES>(t128, cbase, warp, lane);
        else
          stage_f32<16, 32, BOX_BYTES>(t128, cbase, warp, lane);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_bar(2 + cw, 128);
        if (lt == 0) {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int col = d.n0 + 128 * p + 32 * b;
            if (col >= N) break;
            tma_store_3d(&map_c, cbase + b * BOX_BYTES, col, row0, d.j);
          }
          bulk_commit();
        }
      }
    } else if (WGRAD) {
      const size_t es = a.out_dtype == SL_DTYPE_F32 ? 4 : 2;
      store_half_regs(total, (char *)a.out + (size_t)d.j * K * N * es, a.out_dtype, N, row0, d.n0,
                      K, warp, lane);
    } else {
      store_half_regs(total, a.out, a.out_dtype, N, row0, d.n0, d.ge, warp, lane);
    }
  }
  if (lt == 0) bulk_wait0(); /* stores done before the CTA's shared memory goes away */
#else
  (void)map_a, (void)map_b, (void)map_c, (void)map_sa, (void)map_sb, (void)args;
#endif
}

/* A tensor map of an f32 scale array [rows, cols] (cols % 4 == 0) read as boxes of box x 1,
 * unswizzled, zero past the edges. */
inline bool scale_map(CUtensorMap *map, const float *ptr, uint64_t cols, uint64_t rows,
                      uint32_t box) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr) return false;
  cuuint64_t d[2] = {cols, rows}, st[1] = {cols * 4};
  cuuint32_t b[2] = {box, 1}, es[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float *>(ptr), d, st, b, es,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int NSUB, bool WGRAD, int STAGES>
sl_status launch(const Fp8Args &fa, int sms, cudaStream_t stream) {
  using S = Shape<NSUB, WGRAD, STAGES>;
  const GmmArgs &a = fa.g;
  const char *who = WGRAD ? "tgmm_fp8 (sm90)" : "gmm_fp8 (sm90)";
  const uint64_t M = a.m, K = a.k, N = a.n, GL = a.num_local_groups;
  CUtensorMap m[5];
  memset(m, 0, sizeof m);
  bool ok;
  const uint32_t box_a[2] = {kKB, kBM};
  if (!WGRAD) {
    const uint64_t da[2] = {K, M}, sa[1] = {K};
    const uint64_t db[3] = {K, N, GL}, sb[2] = {K, N * K};
    const uint32_t box_b[3] = {kKB, (uint32_t)S::kBN, 1};
    ok = make_map(&m[0], a.lhs, SL_DTYPE_F8E4M3, 2, da, sa, box_a) &&
         make_map(&m[1], a.rhs, SL_DTYPE_F8E4M3, 3, db, sb, box_b);
  } else {
    const uint64_t da[2] = {M, K}, sa[1] = {M};
    const uint64_t db[2] = {M, N}, sb[1] = {M};
    const uint32_t box_b[2] = {kKB, (uint32_t)S::kBN};
    ok = make_map(&m[0], a.lhs, SL_DTYPE_F8E4M3, 2, da, sa, box_a) &&
         make_map(&m[1], a.rhs, SL_DTYPE_F8E4M3, 2, db, sb, box_b) &&
         scale_map(&m[3], fa.sa, K, (M + 127) / 128, kBM) &&
         scale_map(&m[4], fa.sb, N, (M + 127) / 128, S::kBN);
  }
  if (ok && WGRAD && NSUB == 2 && a.out_dtype == SL_DTYPE_F32) {
    /* f32 weight gradients, staged as 64 x 32 boxes (tgmm on 256-column tiles) */
    const uint32_t box_c[3] = {32, 64, 1};
    const uint64_t dc[3] = {N, K, GL}, sc[2] = {N * 4, K * N * 4};
    ok = make_map(&m[2], a.out, SL_DTYPE_F32, 3, dc, sc, box_c);
  }
  if (ok && a.out_dtype == SL_DTYPE_BF16) {
    const uint32_t box_c[3] = {64, 64, 1};
    if (WGRAD) {
      const uint64_t dc[3] = {N, K, GL}, sc[2] = {N * 2, K * N * 2};
      ok = make_map(&m[2], a.out, SL_DTYPE_BF16, 3, dc, sc, box_c);
    } else {
      const uint64_t dc[2] = {N, M}, sc[1] = {N * 2};
      ok = make_map(&m[2], a.out, SL_DTYPE_BF16, 2, dc, sc, box_c);
    }
  }
  if (!ok)
    return sl_set_error(SL_STATUS_UNSUPPORTED, "%s: the operands' TMA tensor maps could not be made",
                        who);
  const void *kernel = (const void *)fp8_kernel<NSUB, WGRAD, STAGES>;
  const int tiles_n = (a.n + S::kBN - 1) / S::kBN, tiles_k = (a.k + kBM - 1) / kBM;
  Fp8Args b = fa;
  size_t smem;
  sl_status st = place_table(a, &b.g, kernel, S::kPipeBytes, WGRAD ? 0 : kBM, tiles_n,
                             tiles_k * tiles_n, kTilesPlain, stream, &smem, who);
  if (st != SL_STATUS_SUCCESS) return st;
  void *args[6] = {(void *)&m[0], (void *)&m[1], (void *)&m[2],
                   (void *)&m[3], (void *)&m[4], (void *)&b};
  cudaError_t err =
      cudaLaunchKernel(kernel, dim3((unsigned)(sms > 0 ? sms : 1)), dim3(kThreads), args, smem,
                       stream);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: launch failed: %s", who,
                        cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

} /* namespace fp8 */
} /* namespace sm90 */
} /* namespace sluice_cuda */

namespace {

using sluice_cuda::GmmArgs;
using sluice_cuda::sm90::fp8::Fp8Args;

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

sl_status run(bool tgmm, const sl_gmm_desc *d, const void *lhs, const float *lhs_scale,
              const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
              const int32_t *group_offset, void *out, void *workspace, void *stream_ptr) {
  const char *op = tgmm ? "tgmm_fp8" : "gmm_fp8";
  sl_status st = sl_gmm_fp8_check(d, tgmm ? 1 : 0, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->num_groups > INT32_MAX || d->m > INT32_MAX || d->k > INT32_MAX || d->n > INT32_MAX)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: every dimension must fit in int32", op);
  const size_t B = (size_t)d->batch, M = (size_t)d->m, K = (size_t)d->k, N = (size_t)d->n;
  const size_t G = (size_t)d->num_groups, GL = (size_t)d->num_local_groups;
  const size_t out_elems = tgmm ? GL * K * N : M * N;
  const size_t es = d->out_dtype == SL_DTYPE_F32 ? 4 : 2;
  const size_t MB = (M + 127) / 128, KB = (K + 127) / 128, NB = (N + 127) / 128;
  const size_t lhs_elems = M * K, rhs_elems = tgmm ? M * N : GL * N * K;
  const size_t ls_elems = tgmm ? MB * K : M * KB, rs_elems = tgmm ? MB * N : GL * NB * KB;
  if ((lhs_elems > 0 && (lhs == NULL || lhs_scale == NULL)) ||
      (rhs_elems > 0 && (rhs == NULL || rhs_scale == NULL)) || (out == NULL && out_elems > 0) ||
      (group_sizes == NULL && G > 0))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: a required pointer is NULL", op);
  if (out_elems == 0) return SL_STATUS_SUCCESS;
  if (workspace == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: workspace is NULL; pass sl_gmm_cuda_workspace_size() bytes of device "
                        "memory",
                        op);
  cudaStream_t stream = (cudaStream_t)stream_ptr;
  if (tgmm && M == 0) {
    cudaError_t err = cudaMemsetAsync(out, 0, B * out_elems * es, stream);
    if (err != cudaSuccess)
      return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: %s", op, cudaGetErrorString(err));
    return SL_STATUS_SUCCESS;
  }
  int major = 0, sms = 0;
  st = sluice_cuda::gmm_device(op, &major, &sms);
  if (st != SL_STATUS_SUCCESS) return st;
  if (major != 9)
    return sl_set_error(SL_STATUS_UNSUPPORTED,
                        "%s: the FP8 kernels need an sm_90 (Hopper) GPU; this one is sm_%d", op,
                        major * 10);
  if ((tgmm ? M : K) % 16 != 0 || N % 8 != 0 || (tgmm && K % 4 != 0) || !aligned16(lhs) || !aligned16(rhs) ||
      !aligned16(out) || ((uintptr_t)lhs_scale & 15) || ((uintptr_t)rhs_scale & 15))
    return sl_set_error(SL_STATUS_UNSUPPORTED,
                        "%s: the CUDA kernel needs %s %% 16 == 0 (got %zu), N %% 8 == 0 (got %zu)%s "
                        "and 16-byte aligned operands (16-byte aligned scales); pad with zeros",
                        op, tgmm ? "M" : "K", tgmm ? M : K, N, tgmm ? ", K % 4 == 0" : "");
  for (size_t b = 0; b < B; ++b) {
    Fp8Args fa;
    GmmArgs &a = fa.g;
    a.lhs = (const char *)lhs + b * lhs_elems;
    a.rhs = (const char *)rhs + b * rhs_elems;
    a.out = (char *)out + b * out_elems * es;
    fa.sa = lhs_scale + b * ls_elems;
    fa.sb = rhs_scale + b * rs_elems;
    a.group_sizes = group_sizes + b * G;
    a.group_offset = group_offset ? group_offset + b : NULL;
    a.table = (int *)workspace; /* the group table, where it does not fit in shared memory */
    a.counter = nullptr;        /* (tiles go by a fixed stride: no counter) */
    a.m = (int)M, a.k = (int)K, a.n = (int)N;
    a.num_groups = (int)G, a.num_local_groups = (int)GL;
    a.in_dtype = SL_DTYPE_F8E4M3, a.out_dtype = d->out_dtype;
    a.transpose_rhs = !tgmm;
    a.skip_unused = tgmm ? 0 : (d->skip_unused_rows != 0);
    /* 256-column tiles where N allows: 128-column tiles read each A row twice as often from L2
     * (gmm dsv3-gateup 998 vs 1174 TFLOP/s, tgmm 671 vs 879); tgmm's 256-column tiles fit 3
     * stages beside the staged output, gmm's 3 measured level with 4 */
    if (N > 128)
      st = tgmm ? sluice_cuda::sm90::fp8::launch<2, true, 3>(fa, sms, stream)
                : sluice_cuda::sm90::fp8::launch<2, false, 3>(fa, sms, stream);
    else
      st = tgmm ? sluice_cuda::sm90::fp8::launch<1, true, 5>(fa, sms, stream)
                : sluice_cuda::sm90::fp8::launch<1, false, 5>(fa, sms, stream);
    if (st != SL_STATUS_SUCCESS) return st;
  }
  return sluice_cuda::gmm_debug_check(op, d, group_sizes, group_offset, stream);
}

} /* namespace */

extern "C" {

sl_status sl_gmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs, const float *lhs_scale,
                          const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                          const int32_t *group_offset, void *out, void *workspace, void *stream) {
  return run(false, desc, lhs, lhs_scale, rhs, rhs_scale, group_sizes, group_offset, out,
             workspace, stream);
}

sl_status sl_tgmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs_t, const float *lhs_scale,
                           const void *rhs_t, const float *rhs_scale, const int32_t *group_sizes,
                           const int32_t *group_offset, void *out, void *workspace, void *stream) {
  return run(true, desc, lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes, group_offset, out,
             workspace, stream);
}

} /* extern "C" */
