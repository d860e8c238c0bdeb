/* A 256x128-tile gmm with a split drain, against the library's gmm on equal-size groups (session 26).
 *
 * cuBLAS's batched kernel on dsv3-down (nvjet_..._256x128_64x4_1x2) keeps the tensor pipe 93% busy
 * where our 128x256 kernel reaches 89.5% (dev/NOTES.md, session 26). The probe asks whether the
 * 256x128 tile's own schedule explains it, before any work on the library: per consumer warpgroup two
 * m64n128 accumulators (its 128 rows), interleaved per k16 step; the tile's last k-block committed
 * as two groups, so the first 64 rows are staged while the second half's wgmmas drain; otherwise the
 * library kernel's roles (one producer thread with TMA copies into 3 stages of 48 KB behind mbarriers,
 * two consumer warpgroups, wait_group 1, the output staged in 64 KB of 128B-swizzled boxes and TMA-
 * stored, the store's read waited for before the next staging). Groups must be multiples of 256 rows
 * (no ragged edge: that is what the probe leaves out); tiles go to CTAs by a fixed stride, the 4 row
 * tiles of a column block of one group next to each other.
 *
 * Checked against the library's output on the same inputs (max |diff| / max |ref|), then both timed
 * in turn, 25 each, for each shape (dsv3-down and dsv3-gateup, 32 groups of 1,024 rows; mixtral, 8
 * of 2,048).
 *
 * Build (the harness's objects): B=build-probe; mkdir -p $B; for f in status gmm_cpu; do
 *   gcc -O2 -fPIC -fopenmp -Iinclude -Icsrc/core -c csrc/core/$f.c -o $B/$f.o; done
 *   nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Iinclude -Icsrc/core \
 *     dev/probe/t2_probe.cu $B/status.o $B/gmm_cpu.o -lgomp -lcuda -lcublas -o $B/t2_probe
 * (dev/probe/t2_probe.sh builds it, runs it and runs it under Nsight Compute on dsv3-down.)
 *
 * Session 42 added to the rotation the 2-CTA A-multicast variant (MC: is what is left of cuBLAS's
 * lead on dsv3-down its 1x2 clusters? no) and cuBLAS's batched product itself, and, with
 * T2_SIZES_DIR, t2r_kernel on the benchmark's own ragged group sizes (the edge the probe had left
 * out: it costs far more than the tile gains). bench/results/t2-probe-h100-20261127/. */

#include <algorithm>
#include <vector>

#include "../../csrc/cuda/gmm_launch.cu"
#include "../../csrc/cuda/sm80_gmm.cu"
#include "../../csrc/cuda/sm90_gmm.cu"
#include "probe.cuh"

#include <cublas_v2.h>
#include <string.h>

#define CKB(x)                                                      \
  do {                                                              \
    cublasStatus_t s_ = (x);                                        \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                              \
      fprintf(stderr, "%s:%d %s: cuBLAS %d\n", __FILE__, __LINE__, #x, (int)s_); \
      exit(1);                                                      \
    }                                                               \
  } while (0)


using namespace sluice_cuda;
using namespace sluice_cuda::sm90;

namespace t2 {
constexpr int TM = 256, TN = 128, KB = 64;
constexpr int A_BYTES2 = TM * KB * 2, SB = A_BYTES2 + TN * KB * 2; /* 32 + 16 KB a stage */
constexpr int SLAB = 64 * KB * 2; /* 8 KB: 64 rows of A */
/* 3 stages: the whole 256x128 output tile staged (64 KB); 4 stages: each warpgroup stages its
 * 128 rows in two 64-row passes through 16 KB (32 KB in all), the second after the first's store
 * has read the buffer */
__host__ __device__ constexpr int cb_of(int stg) { return stg == 3 ? TM * TN * 2 : TM * TN; }
constexpr size_t smem_of(int stg) { return 1024 + (size_t)stg * SB + cb_of(stg) + 2 * stg * 8; }


/* rows: every group's (a multiple of TM); tiles: G x (rows / TM) x (N / TN), row tiles innermost */
#ifdef SLUICE_SM90A_DEVICE
/* One tile's k-blocks for a consumer warpgroup, NA (0, 1, 2) of its two m64n128 accumulators in use
 * (a compile-time choice: a wgmma on a divergent path makes ptxas serialize them all, C7520). One k-block of wgmmas in flight (wait_group 1), a stage released (`release`)
 * once the block after it is waited for; the last block committed as two groups, acc0's first, so
 * that it can be staged while acc1's drain. Leaves both groups of the last block in flight
 * and its stage (s) held. */
template <int NA, int STG, class Release>
__device__ __forceinline__ void t2_kloop(float (&acc0)[64], float (&acc1)[64], uint32_t a0,
                                         uint32_t a1, uint32_t b0, uint32_t b1, int nk,
                                         uint32_t stage0, uint32_t full0, int &s, uint32_t &phase,
                                         Release release) {
  /* a0, a1: the accumulators' 64 A rows (K-major, 128B rows); b0, b1: their 128 columns of B (two
   * 64x64 N-major boxes); byte offsets in the stage */
  auto da_of = [&](uint32_t sa, uint32_t off, int kk) { return make_desc(sa + off + kk * 32, 16, 1024); };
  auto db_of = [&](uint32_t sa, uint32_t off, int kk) {
    return make_desc(sa + off + kk * 2048, BOX_BYTES, 1024);
  };
  int sd = 0;
  for (int kb = 0; kb < nk - 1; ++kb) {
    mbar_wait(full0 + 8 * s, phase);
    const uint32_t sa = stage0 + s * SB;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (NA >= 1)
        wgmma_m64n128k16_bf16<0, 1>(acc0, da_of(sa, a0, kk), db_of(sa, b0, kk), kk == 0 ? sd : 1);
      if constexpr (NA == 2)
        wgmma_m64n128k16_bf16<0, 1>(acc1, da_of(sa, a1, kk), db_of(sa, b1, kk), kk == 0 ? sd : 1);
    }
    sd = 1;
    wgmma_commit();
    wgmma_wait1();
    fence64(acc0);
    fence64(acc1);
    if (kb > 0) release(s == 0 ? STG - 1 : s - 1);
    if (++s == STG) s = 0, phase ^= 1;
  }
  mbar_wait(full0 + 8 * s, phase);
  const uint32_t sa = stage0 + s * SB;
  wgmma_fence();
  if constexpr (NA >= 1) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n128k16_bf16<0, 1>(acc0, da_of(sa, a0, kk), db_of(sa, b0, kk), kk == 0 ? sd : 1);
  }
  wgmma_commit();
  if constexpr (NA == 2) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n128k16_bf16<0, 1>(acc1, da_of(sa, a1, kk), db_of(sa, b1, kk), kk == 0 ? sd : 1);
  }
  wgmma_commit();
}

/* One warpgroup's 64x128 accumulator out through its 16 KB of staging: once the previous store
 * has read the buffer, stage it (128B-swizzled), fence, and TMA-store its two 64x64 boxes at
 * (col, row). */
__device__ __forceinline__ void t2_pass(const float (&h)[64], uint32_t cbase, const CUtensorMap *map_c,
                                        int col, int row, int cw, int lt, int warp, int lane) {
  if (lt == 0) bulk_wait_read0();
  named_bar(2 + cw, 128);
  stage_half_stsm<__nv_bfloat16>(h, cbase, warp, lane);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  named_bar(2 + cw, 128);
  if (lt == 0) {
    for (int b = 0; b < 2; ++b) tma_store_2d(map_c, cbase + b * BOX_BYTES, col + 64 * b, row);
    bulk_commit();
  }
}
#endif

/* MC (4 stages only): on 2-CTA clusters, as cuBLAS's 256x128 1x2 kernel. The pair takes two
 * tiles side by side along N (the same 256 rows of A, two 128-column blocks; N / 128 is even on
 * every shape, so no pair needs a dummy); each CTA loads 128 of the 256 A rows multicast to both
 * (16 KB) and its own B (16 KB): 32 KB a stage from L2 instead of 48. A stage of either CTA is
 * refilled only after both CTAs' consumers released it (16 arrivals: each consumer warp arrives
 * on its own CTA's barrier and on the peer's). */
template <int STG, bool MC>
__global__ void __launch_bounds__(384, 1)
    t2_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
              const __grid_constant__ CUtensorMap map_c, int rows, int k, int n, int groups) {
#ifdef SLUICE_SM90A_DEVICE
  static_assert(!MC || STG == 4, "the multicast probe runs 4 stages");
  extern __shared__ unsigned char smem_raw[];
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  constexpr int CB = cb_of(STG);
  const uint32_t stage0 = smem_u32(base), c_smem = stage0 + STG * SB;
  const uint32_t full0 = c_smem + CB, empty0 = full0 + STG * 8;
  const int mt_n = rows / TM, nt_n = n / TN, nk = k / KB;
  /* MC: units are pairs of tiles (this CTA's: column block 2 * (unit's) + rank) */
  const uint32_t rank = MC ? cluster_ctarank() : 0;
  const int per_g = mt_n * (MC ? nt_n / 2 : nt_n);
  const int units = groups * per_g;
  const int first = MC ? blockIdx.x / 2 : blockIdx.x, stride = MC ? gridDim.x / 2 : gridDim.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STG; ++s)
      mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, MC ? 16 : 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (MC)
    cluster_sync(); /* the peer's barriers exist before any multicast or remote arrive */
  else
    __syncthreads();
  const int wg = threadIdx.x / 128;
  auto decode = [&](int t, int &m0, int &n0, int &g) {
    g = t / per_g;
    const int u = t - g * per_g;
    m0 = g * rows + (u % mt_n) * TM, n0 = (u / mt_n) * TN * (MC ? 2 : 1) + (int)rank * TN;
  };
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int s = 0;
      uint32_t phase = 0;
      for (int t = first; t < units; t += stride) {
        int m0, n0, g;
        decode(t, m0, n0, g);
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          const uint32_t full = full0 + 8 * s, sa = stage0 + s * SB;
          mbar_expect_tx(full, SB);
          if constexpr (MC) /* this CTA's 128 rows of A, to the same offset in both CTAs */
            tma_load_2d_mc(sa + rank * (A_BYTES2 / 2), &map_a, kb * KB, m0 + (int)rank * (TM / 2),
                           full, (uint16_t)3);
          else
            tma_load_2d(sa, &map_a, kb * KB, m0, full);
          tma_load_4d(sa + A_BYTES2, &map_b, 0, kb * KB, n0 / 64, g, full);
          if (++s == STG) s = 0, phase ^= 1;
        }
      }
    }
    if constexpr (MC) { /* neither CTA leaves while the peer may still arrive on its barriers */
      __syncwarp();
      cluster_sync();
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = wg - 1, lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  float acc0[64], acc1[64];
  int s = 0;
  uint32_t phase = 0;
  auto release = [&](int st) {
    if (lane == 0) {
      mbar_arrive(empty0 + 8 * st);
      if constexpr (MC) mbar_arrive_cluster(mapa_shared(empty0 + 8 * st, rank ^ 1));
    }
  };
  const uint32_t cbase = c_smem + cw * (CB / 2); /* this warpgroup's 128 rows: two 16 KB halves */
  for (int t = first; t < units; t += stride) {
    int m0, n0, g;
    decode(t, m0, n0, g);
    /* rows 0-63 of the warpgroup (slab 2 cw) first, then 64-127 */
    t2_kloop<2, STG>(acc0, acc1, 2 * cw * SLAB, (2 * cw + 1) * SLAB, A_BYTES2, A_BYTES2, nk, stage0,
                     full0, s, phase, release);
    wgmma_wait1(); /* the block before and the first half of this one are done */
    fence64(acc0);
    if (nk > 1) release(s == 0 ? STG - 1 : s - 1);
    if constexpr (STG == 4) { /* the first 64 rows leave before the second half is staged */
      t2_pass(acc0, cbase, &map_c, n0, m0 + cw * 128, cw, lt, warp, lane);
      wgmma_wait0();
      fence64(acc1);
      release(s);
      if (++s == STG) s = 0, phase ^= 1;
      t2_pass(acc1, cbase, &map_c, n0, m0 + cw * 128 + 64, cw, lt, warp, lane);
    } else { /* the whole 128 rows staged (two 16 KB halves), then stored */
      if (lt == 0) bulk_wait_read0(); /* the last tile's store has read the staging buffer */
      named_bar(2 + cw, 128);
      stage_half_stsm<__nv_bfloat16>(acc0, cbase, warp, lane);
      wgmma_wait0();
      fence64(acc1);
      release(s);
      if (++s == STG) s = 0, phase ^= 1;
      stage_half_stsm<__nv_bfloat16>(acc1, cbase + CB / 4, warp, lane);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_bar(2 + cw, 128);
      if (lt == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int b = 0; b < 2; ++b)
            tma_store_2d(&map_c, cbase + h * (CB / 4) + b * BOX_BYTES, n0 + 64 * b,
                         m0 + cw * 128 + 64 * h);
        bulk_commit();
      }
    }
  }
  if (lt == 0) bulk_wait0();
  if constexpr (MC) cluster_sync();
#endif
}

/* Ragged groups (session 42): the 4-stage schedule on the benchmark's own group sizes, tiles from a
 * host-built list {m0, n0, rows, group} (a group's tiles column block by column block, its row
 * tiles innermost, as above), in two geometries with the same stage (48 KB), staging (32 KB) and
 * per-warpgroup accumulators (two m64n128):
 *   WIDE = false: 256x128 tiles (t2_kernel's): warpgroup w holds A slabs w and w + 2 (interleaved,
 *     so that a 2-slab edge keeps both busy) against the whole 128-column B;
 *   WIDE = true: 128x256 tiles (the library's geometry): warpgroup w holds slab w against columns
 *     0-127 (acc0) and 128-255 (acc1): the split drain by column halves, and a <= 64-row edge is
 *     one warpgroup with two independent accumulator chains.
 * A group's last row tile of r rows computes only its ceil(r / 64) slabs (skip; else all): the
 * producer loads those slabs as 64-row boxes (map_a64) with the whole B strip. Full tiles leave
 * staged and TMA-stored, acc0 while acc1 drains; an edge tile from registers, masked at the
 * group's end. */
template <bool WIDE>
__global__ void __launch_bounds__(384, 1)
    t2r_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_a64,
               const __grid_constant__ CUtensorMap map_b, const __grid_constant__ CUtensorMap map_c,
               const int4 *__restrict__ tl, int units, int k, int n, __nv_bfloat16 *out,
               int skip) {
#ifdef SLUICE_SM90A_DEVICE
  constexpr int STG = 4, CB = cb_of(STG);
  constexpr int TMV = WIDE ? 128 : TM, TNV = WIDE ? 256 : TN, MAXS = TMV / 64;
  constexpr int AB = TMV * KB * 2; /* a stage's A bytes; B follows */
  static_assert(AB + TNV * KB * 2 == SB, "both geometries fill the same 48 KB stage");
  extern __shared__ unsigned char smem_raw[];
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t stage0 = smem_u32(base), c_smem = stage0 + STG * SB;
  const uint32_t full0 = c_smem + CB, empty0 = full0 + STG * 8;
  const int nk = k / KB;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STG; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int s = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < units; t += gridDim.x) {
        const int4 v = tl[t];
        const int slabs = skip ? (v.z + 63) / 64 : MAXS;
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          const uint32_t full = full0 + 8 * s, sa = stage0 + s * SB;
          mbar_expect_tx(full, slabs * SLAB + TNV * KB * 2);
          if (slabs == MAXS)
            tma_load_2d(sa, &map_a, kb * KB, v.x, full);
          else
            for (int sl = 0; sl < slabs; ++sl)
              tma_load_2d(sa + sl * SLAB, &map_a64, kb * KB, v.x + 64 * sl, full);
          tma_load_4d(sa + AB, &map_b, 0, kb * KB, v.y / 64, v.w, full);
          if (++s == STG) s = 0, phase ^= 1;
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = wg - 1, lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  float acc0[64], acc1[64];
  int s = 0;
  uint32_t phase = 0;
  auto release = [&](int st) {
    if (lane == 0) mbar_arrive(empty0 + 8 * st);
  };
  /* each accumulator's A slab and B columns (stage offsets), output rows and columns */
  const uint32_t a0 = cw * SLAB, a1 = (WIDE ? cw : cw + 2) * SLAB;
  const uint32_t b0 = AB, b1 = AB + (WIDE ? 2 * BOX_BYTES : 0);
  const int r0 = 64 * cw, r1 = WIDE ? 64 * cw : 64 * (cw + 2), c1 = WIDE ? 128 : 0;
  const uint32_t cbase = c_smem + cw * (CB / 2); /* this warpgroup's 16 KB of staging */
  for (int t = blockIdx.x; t < units; t += gridDim.x) {
    const int4 v = tl[t];
    const int m0 = v.x, n0 = v.y, rows = v.z, slabs = skip ? (rows + 63) / 64 : MAXS;
    const bool act0 = cw < slabs, act1 = WIDE ? act0 : cw + 2 < slabs;
    /* the choice per tile, not per k-block */
    if (act1)
      t2_kloop<2, STG>(acc0, acc1, a0, a1, b0, b1, nk, stage0, full0, s, phase, release);
    else if (act0)
      t2_kloop<1, STG>(acc0, acc1, a0, a1, b0, b1, nk, stage0, full0, s, phase, release);
    else
      t2_kloop<0, STG>(acc0, acc1, a0, a1, b0, b1, nk, stage0, full0, s, phase, release);
    if (rows < TMV) { /* an edge tile: this warpgroup's accumulators from registers, masked */
      wgmma_wait0();
      fence64(acc0);
      fence64(acc1);
      if (nk > 1) release(s == 0 ? STG - 1 : s - 1);
      release(s);
      if (++s == STG) s = 0, phase ^= 1;
      if (act0) store_half_regs(acc0, out, SL_DTYPE_BF16, n, m0 + r0, n0, m0 + rows, warp, lane);
      if (act1) store_half_regs(acc1, out, SL_DTYPE_BF16, n, m0 + r1, n0 + c1, m0 + rows, warp, lane);
      continue;
    }
    wgmma_wait1(); /* the block before and this block's acc0 are done */
    fence64(acc0);
    if (nk > 1) release(s == 0 ? STG - 1 : s - 1);
    t2_pass(acc0, cbase, &map_c, n0, m0 + r0, cw, lt, warp, lane);
    wgmma_wait0();
    fence64(acc1);
    release(s);
    if (++s == STG) s = 0, phase ^= 1;
    t2_pass(acc1, cbase, &map_c, n0 + c1, m0 + r1, cw, lt, warp, lane);
  }
  if (lt == 0) bulk_wait0();
#endif
}
} /* namespace t2 */

/* The benchmark's shapes (bench/shapes.py) for ragged() and hybrid() */
struct RaggedShape {
  const char *name;
  int m, g, k, n;
};
static const RaggedShape kRaggedShapes[] = {{"dsv3-gateup-ep8", 32768, 32, 7168, 4096},
                                            {"dsv3-down-ep8", 32768, 32, 2048, 7168},
                                            {"mixtral-up", 16384, 8, 4096, 14336},
                                            {"qwen3-30b-up", 65536, 128, 2048, 1536},
                                            /* the one-GPU model's expert shapes (FINE_SHAPES) */
                                            {"dsv3proxy-gateup", 131072, 256, 1024, 512},
                                            {"dsv3proxy-down", 131072, 256, 256, 1024}};


/* <dir>/<shape>-<dist>.txt into hs (G ints summing to M); false if there is no such file */
static bool read_sizes(const char *dir, const RaggedShape &sh, const char *dist,
                       std::vector<int32_t> &hs) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s-%s.txt", dir, sh.name, dist);
  FILE *f = fopen(path, "r");
  if (!f) {
    printf("%-16s %-8s (no %s)\n", sh.name, dist, path);
    return false;
  }
  hs.assign(sh.g, 0);
  long long sum = 0;
  for (int i = 0; i < sh.g; ++i) {
    if (fscanf(f, "%d", &hs[i]) != 1) {
      fprintf(stderr, "%s: short\n", path);
      exit(1);
    }
    sum += hs[i];
  }
  fclose(f);
  if (sum != sh.m) {
    fprintf(stderr, "%s: sizes sum to %lld, not %d\n", path, sum, sh.m);
    exit(1);
  }
  return true;
}

/* The benchmark's shapes on its own ragged group sizes (files <dir>/<shape>-<dist>.txt, G ints:
 * bench/shapes.py's group_sizes, written by dev/probe/t2_probe.sh): the library's gmm against
 * t2r_kernel, checked (every row: the sizes sum to M) and timed in turn as above. */
static void ragged(const char *dir, int sms, const char *only_shape, int reps) {
  CK(cudaFuncSetAttribute(t2::t2r_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(4)));
  CK(cudaFuncSetAttribute(t2::t2r_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(4)));
  const int skip = getenv("T2R_NOSKIP") ? 0 : 1;
  printf("\nragged group sizes (bench/shapes.py), %s: the library's gmm against the 4-stage schedule on\n"
         "256x128 tiles (t2r) and on 128x256 tiles (t3r: the split drain by column halves)\n",
         skip ? "edge tiles compute only their 64-row slabs" : "edge tiles computed whole");
  printf("%-16s %-8s %9s %9s %9s %8s %8s %9s %9s\n", "shape", "sizes", "lib TF/s", "t2r TF/s",
         "t3r TF/s", "t2r/lib", "t3r/lib", "t2r diff", "t3r diff");
  for (const RaggedShape &sh : kRaggedShapes) {
    if (only_shape && !strstr(sh.name, only_shape)) continue;
    for (const char *dist : {"exact", "uniform", "skewed"}) {
      std::vector<int32_t> hs;
      if (!read_sizes(dir, sh, dist, hs)) continue;
      const int m = sh.m;
      __nv_bfloat16 *x, *w, *o[3];
      int32_t *sizes;
      int *counter;
      float *res;
      CK(cudaMalloc(&x, (size_t)m * sh.k * 2));
      CK(cudaMalloc(&w, (size_t)sh.g * sh.k * sh.n * 2));
      for (int i = 0; i < 3; ++i) {
        CK(cudaMalloc(&o[i], (size_t)m * sh.n * 2));
        CK(cudaMemset(o[i], 0xff, (size_t)m * sh.n * 2)); /* poisoned: NaN */
      }
      CK(cudaMalloc(&sizes, sh.g * 4));
      CK(cudaMalloc(&counter, 4));
      CK(cudaMalloc(&res, 8));
      CK(cudaMemcpy(sizes, hs.data(), sh.g * 4, cudaMemcpyHostToDevice));
      fill_random<<<1024, 256>>>(x, (size_t)m * sh.k, 1u);
      fill_random<<<1024, 256>>>(w, (size_t)sh.g * sh.k * sh.n, 2u);
      GmmArgs a;
      a.lhs = x, a.rhs = w, a.out = o[0], a.group_sizes = sizes, a.group_offset = nullptr;
      a.table = nullptr, a.counter = counter;
      a.m = m, a.k = sh.k, a.n = sh.n, a.num_groups = sh.g, a.num_local_groups = sh.g;
      a.in_dtype = SL_DTYPE_BF16, a.out_dtype = SL_DTYPE_BF16, a.transpose_rhs = 0;
      /* per geometry (0: 256x128, 1: 128x256): the tile list and the tensor maps */
      struct Geo {
        int tm, tn, units;
        int4 *tl;
        CUtensorMap ma, ma64, mb, mc;
      } geo[2];
      for (int gi = 0; gi < 2; ++gi) {
        Geo &G = geo[gi];
        G.tm = gi ? 128 : 256, G.tn = gi ? 256 : 128;
        std::vector<int4> tiles;
        for (int g = 0, gs = 0; g < sh.g; gs += hs[g], ++g)
          for (int nb = 0; nb < sh.n / G.tn; ++nb)
            for (int m0 = gs; m0 < gs + hs[g]; m0 += G.tm)
              tiles.push_back(make_int4(m0, nb * G.tn, std::min(G.tm, gs + hs[g] - m0), g));
        G.units = (int)tiles.size();
        CK(cudaMalloc(&G.tl, tiles.size() * sizeof(int4)));
        CK(cudaMemcpy(G.tl, tiles.data(), tiles.size() * sizeof(int4), cudaMemcpyHostToDevice));
        const uint64_t da[2] = {(uint64_t)sh.k, (uint64_t)m}, sa[1] = {(uint64_t)sh.k * 2};
        const uint32_t boxa[2] = {64, (uint32_t)G.tm}, boxa64[2] = {64, 64};
        const uint64_t db[4] = {64, (uint64_t)sh.k, (uint64_t)sh.n / 64, (uint64_t)sh.g};
        const uint64_t sb[3] = {(uint64_t)sh.n * 2, 128, (uint64_t)sh.k * sh.n * 2};
        const uint32_t boxb[4] = {64, 64, (uint32_t)G.tn / 64, 1};
        const uint64_t dc[2] = {(uint64_t)sh.n, (uint64_t)m}, sc[1] = {(uint64_t)sh.n * 2};
        const uint32_t boxc[2] = {64, 64};
        if (!make_map(&G.ma, x, SL_DTYPE_BF16, 2, da, sa, boxa) ||
            !make_map(&G.ma64, x, SL_DTYPE_BF16, 2, da, sa, boxa64) ||
            !make_map(&G.mb, w, SL_DTYPE_BF16, 4, db, sb, boxb) ||
            !make_map(&G.mc, o[1 + gi], SL_DTYPE_BF16, 2, dc, sc, boxc)) {
          fprintf(stderr, "tensor maps failed\n");
          exit(1);
        }
      }
      auto run = [&](int i) {
        if (i == 0) {
          if (sm90_gmm_launch(a, false, sms, 0, -1) != SL_STATUS_SUCCESS) {
            fprintf(stderr, "library gmm failed\n");
            exit(1);
          }
          return;
        }
        const Geo &G = geo[i - 1];
        const dim3 grid(std::min(sms, G.units));
        if (i == 1)
          t2::t2r_kernel<false><<<grid, 384, t2::smem_of(4)>>>(G.ma, G.ma64, G.mb, G.mc, G.tl,
                                                               G.units, sh.k, sh.n, o[1], skip);
        else
          t2::t2r_kernel<true><<<grid, 384, t2::smem_of(4)>>>(G.ma, G.ma64, G.mb, G.mc, G.tl,
                                                              G.units, sh.k, sh.n, o[2], skip);
      };
      for (int i = 0; i < 3; ++i) run(i);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      float rel[3] = {0, 0, 0};
      for (int i = 1; i < 3; ++i) {
        CK(cudaMemset(res, 0, 8));
        max_diff<<<1024, 256>>>(o[i], o[0], (size_t)m * sh.n, res);
        float hr[2];
        CK(cudaMemcpy(hr, res, 8, cudaMemcpyDeviceToHost));
        rel[i] = hr[0] / hr[1];
      }
      const std::vector<double> med = time_in_turn({0, 1, 2}, reps, run);
      const double fl = 2.0 * m * sh.k * sh.n;
      printf("%-16s %-8s %9.1f %9.1f %9.1f %7.3fx %7.3fx %9.2e %9.2e\n", sh.name, dist,
             fl / med[0] / 1e9, fl / med[1] / 1e9, fl / med[2] / 1e9, med[0] / med[1],
             med[0] / med[2], rel[1], rel[2]);
      cudaFree(x), cudaFree(w), cudaFree(sizes), cudaFree(counter), cudaFree(res);
      for (int i = 0; i < 3; ++i) cudaFree(o[i]);
      for (Geo &G : geo) cudaFree(G.tl);
    }
  }
}

/* The hybrid (session 56): each group's first floor(rows / 256) * 256 rows on the 256x128 tile
 * (t2r_kernel, full tiles only, by a fixed stride), its last 0-255 rows on the library's gmm (V_TM
 * and its merged edges), two launches back to back on one stream. Sessions 26 and 42 measured the
 * tile 1-5% ahead of the library on equal groups of dsv3-down and 12-14% on qwen3's, and far behind
 * on ragged sizes for want of V_TM's edges; the hybrid keeps both. The library's part runs on the
 * remainder rows copied to a compact buffer before any timing (the library takes contiguous groups):
 * the same tiles and bytes as an in-place kernel, at other addresses. Checked (the remainder's
 * output scattered back, every row against the library on all rows, outputs poisoned), then timed
 * in turn: the library on every row, the hybrid both ways round, and its two parts alone. */
static void hybrid(const char *dir, int sms, const char *only_shape, int reps) {
  CK(cudaFuncSetAttribute(t2::t2r_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(4)));
  printf("\nhybrid: each group's multiple-of-256 rows on 256x128 tiles (t2r), the rest on the library's\n"
         "gmm; times in ms (median of %d in turn), x = lib / hybrid\n", reps);
  printf("%-16s %-8s %6s %8s %8s %8s %8s %8s %7s %7s %9s\n", "shape", "sizes", "int%", "lib",
         "int>rem", "rem>int", "int", "rem", "x i>r", "x r>i", "diff");
  enum { H_LIB, H_IR, H_RI, H_INT, H_REM, H_N };
  for (const RaggedShape &sh : kRaggedShapes) {
    if (only_shape && !strstr(sh.name, only_shape)) continue;
    if (sh.n % t2::TN || sh.k % t2::KB) continue;
    for (const char *dist : {"exact", "uniform", "skewed"}) {
      std::vector<int32_t> hs;
      if (!read_sizes(dir, sh, dist, hs)) continue;
      const int m = sh.m, k = sh.k, n = sh.n, G = sh.g;
      std::vector<int32_t> hr(G);
      std::vector<int4> tiles;
      int mr = 0;
      for (int g = 0, gs = 0; g < G; gs += hs[g], ++g) {
        const int hi = hs[g] / t2::TM * t2::TM;
        hr[g] = hs[g] - hi, mr += hr[g];
        for (int nb = 0; nb < n / t2::TN; ++nb)
          for (int m0 = gs; m0 < gs + hi; m0 += t2::TM)
            tiles.push_back(make_int4(m0, nb * t2::TN, t2::TM, g));
      }
      const int units = (int)tiles.size(), mr1 = std::max(mr, 1);
      __nv_bfloat16 *x, *w, *o_lib, *o_hyb, *x_r, *o_r;
      int32_t *sizes, *sizes_r;
      int *counter, *counter_r;
      int4 *tl;
      float *res;
      CK(cudaMalloc(&x, (size_t)m * k * 2));
      CK(cudaMalloc(&w, (size_t)G * k * n * 2));
      CK(cudaMalloc(&o_lib, (size_t)m * n * 2));
      CK(cudaMalloc(&o_hyb, (size_t)m * n * 2));
      CK(cudaMalloc(&x_r, (size_t)mr1 * k * 2));
      CK(cudaMalloc(&o_r, (size_t)mr1 * n * 2));
      CK(cudaMalloc(&sizes, G * 4));
      CK(cudaMalloc(&sizes_r, G * 4));
      CK(cudaMalloc(&counter, 16));
      CK(cudaMalloc(&counter_r, 16));
      CK(cudaMalloc(&tl, std::max<size_t>(tiles.size(), 1) * sizeof(int4)));
      CK(cudaMalloc(&res, 8));
      CK(cudaMemset(o_lib, 0xff, (size_t)m * n * 2)); /* poisoned: NaN */
      CK(cudaMemset(o_hyb, 0xff, (size_t)m * n * 2));
      CK(cudaMemset(o_r, 0xff, (size_t)mr1 * n * 2));
      CK(cudaMemcpy(sizes, hs.data(), G * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sizes_r, hr.data(), G * 4, cudaMemcpyHostToDevice));
      if (units)
        CK(cudaMemcpy(tl, tiles.data(), tiles.size() * sizeof(int4), cudaMemcpyHostToDevice));
      fill_random<<<1024, 256>>>(x, (size_t)m * k, 1u);
      fill_random<<<1024, 256>>>(w, (size_t)G * k * n, 2u);
      /* each group's remainder rows: compact[ro ..) <-> full[gs + hs - hr ..), cols bf16 a row */
      auto copy_rem = [&](__nv_bfloat16 *compact, __nv_bfloat16 *full, int cols, bool to_full) {
        for (int g = 0, gs = 0, ro = 0; g < G; gs += hs[g], ro += hr[g], ++g) {
          if (!hr[g]) continue;
          __nv_bfloat16 *c = compact + (size_t)ro * cols;
          __nv_bfloat16 *f = full + (size_t)(gs + hs[g] - hr[g]) * cols;
          CK(cudaMemcpy(to_full ? f : c, to_full ? c : f, (size_t)hr[g] * cols * 2,
                        cudaMemcpyDeviceToDevice));
        }
      };
      copy_rem(x_r, x, k, false);
      GmmArgs a;
      a.lhs = x, a.rhs = w, a.out = o_lib, a.group_sizes = sizes, a.group_offset = nullptr;
      a.table = nullptr, a.counter = counter;
      a.m = m, a.k = k, a.n = n, a.num_groups = G, a.num_local_groups = G;
      a.in_dtype = SL_DTYPE_BF16, a.out_dtype = SL_DTYPE_BF16, a.transpose_rhs = 0;
      GmmArgs ar = a;
      ar.lhs = x_r, ar.out = o_r, ar.group_sizes = sizes_r, ar.counter = counter_r, ar.m = mr;
      const uint64_t da[2] = {(uint64_t)k, (uint64_t)m}, sa[1] = {(uint64_t)k * 2};
      const uint32_t boxa[2] = {64, (uint32_t)t2::TM}, boxa64[2] = {64, 64};
      const uint64_t db[4] = {64, (uint64_t)k, (uint64_t)n / 64, (uint64_t)G};
      const uint64_t sb[3] = {(uint64_t)n * 2, 128, (uint64_t)k * n * 2};
      const uint32_t boxb[4] = {64, 64, (uint32_t)t2::TN / 64, 1};
      const uint64_t dc[2] = {(uint64_t)n, (uint64_t)m}, sc[1] = {(uint64_t)n * 2};
      const uint32_t boxc[2] = {64, 64};
      CUtensorMap ma, ma64, mb, mc;
      if (!make_map(&ma, x, SL_DTYPE_BF16, 2, da, sa, boxa) ||
          !make_map(&ma64, x, SL_DTYPE_BF16, 2, da, sa, boxa64) ||
          !make_map(&mb, w, SL_DTYPE_BF16, 4, db, sb, boxb) ||
          !make_map(&mc, o_hyb, SL_DTYPE_BF16, 2, dc, sc, boxc)) {
        fprintf(stderr, "tensor maps failed\n");
        exit(1);
      }
      auto lib = [&](const GmmArgs &args) {
        if (args.m > 0 && sm90_gmm_launch(args, false, sms, 0, -1) != SL_STATUS_SUCCESS) {
          fprintf(stderr, "library gmm failed\n");
          exit(1);
        }
      };
      auto interior = [&]() {
        if (units)
          t2::t2r_kernel<false><<<std::min(sms, units), 384, t2::smem_of(4)>>>(
              ma, ma64, mb, mc, tl, units, k, n, o_hyb, 1);
      };
      auto run = [&](int i) {
        switch (i) {
          case H_LIB: lib(a); break;
          case H_IR: interior(), lib(ar); break;
          case H_RI: lib(ar), interior(); break;
          case H_INT: interior(); break;
          case H_REM: lib(ar); break;
        }
      };
      run(H_LIB);
      run(H_IR);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      copy_rem(o_r, o_hyb, n, true);
      CK(cudaMemset(res, 0, 8));
      max_diff<<<1024, 256>>>(o_hyb, o_lib, (size_t)m * n, res);
      float hres[2];
      CK(cudaMemcpy(hres, res, 8, cudaMemcpyDeviceToHost));
      const std::vector<double> med = time_in_turn({H_LIB, H_IR, H_RI, H_INT, H_REM}, reps, run);
      printf("%-16s %-8s %5.1f%% %8.4f %8.4f %8.4f %8.4f %8.4f %6.3fx %6.3fx %9.2e\n", sh.name, dist,
             100.0 * (m - mr) / m, med[H_LIB], med[H_IR], med[H_RI], med[H_INT], med[H_REM],
             med[H_LIB] / med[H_IR], med[H_LIB] / med[H_RI], hres[0] / hres[1]);
      fflush(stdout);
      cudaFree(x), cudaFree(w), cudaFree(o_lib), cudaFree(o_hyb), cudaFree(x_r), cudaFree(o_r);
      cudaFree(sizes), cudaFree(sizes_r), cudaFree(counter), cudaFree(counter_r), cudaFree(tl);
      cudaFree(res);
    }
  }
}

/* The implementations timed in turn: the library's gmm (V_TM), the probe at 3 and 4 stages, the
 * probe's 2-CTA A-multicast variant, and cuBLAS's batched product over the same equal groups
 * (torch.bmm's call: cublasGemmStridedBatchedEx, 32 MiB of workspace as torch gives it). */
enum { I_LIB, I_T23, I_T24, I_MC, I_CUBLAS, N_IMPL };
static const char *kImplName[N_IMPL] = {"lib", "t2-3stg", "t2-4stg", "t2-4stg-mc", "cublas-bmm"};

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Sh {
    const char *name;
    int g, rows, k, n;
  } shapes[] = {{"dsv3-down-ep8", 32, 1024, 2048, 7168},
                {"dsv3-gateup-ep8", 32, 1024, 7168, 4096},
                {"mixtral-up", 8, 2048, 4096, 14336}};
  CK(cudaFuncSetAttribute(t2::t2_kernel<3, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(3)));
  CK(cudaFuncSetAttribute(t2::t2_kernel<4, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(4)));
  CK(cudaFuncSetAttribute(t2::t2_kernel<4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(4)));
  /* the multicast kernel's grid: as many 2-CTA clusters as fit at once (a cluster's SMs share a
   * GPC), at most half the SMs */
  cudaLaunchConfig_t mc_cfg = {};
  cudaLaunchAttribute mc_attr[1];
  mc_attr[0].id = cudaLaunchAttributeClusterDimension;
  mc_attr[0].val.clusterDim.x = 2, mc_attr[0].val.clusterDim.y = 1, mc_attr[0].val.clusterDim.z = 1;
  mc_cfg.blockDim = dim3(384);
  mc_cfg.dynamicSmemBytes = t2::smem_of(4);
  mc_cfg.attrs = mc_attr;
  mc_cfg.numAttrs = 1;
  mc_cfg.gridDim = dim3(2 * (sms / 2));
  int max_clusters = 0;
  CK(cudaOccupancyMaxActiveClusters(&max_clusters, t2::t2_kernel<4, true>, &mc_cfg));
  const int ncl = std::min(max_clusters, sms / 2);
  mc_cfg.gridDim = dim3(2 * ncl);
  printf("%d SMs; 2-CTA clusters co-resident: %d (grid %d)\n", sms, max_clusters, 2 * ncl);
  cublasHandle_t cub;
  CKB(cublasCreate(&cub));
  void *cub_ws;
  CK(cudaMalloc(&cub_ws, 32u << 20));
  CKB(cublasSetWorkspace(cub, cub_ws, 32u << 20));
  /* T2_SHAPE=<substring>, T2_REPS=n, T2_IMPLS=<comma list of names> narrow a run (a profiler) */
  const char *only_shape = getenv("T2_SHAPE");
  const char *only_impls = getenv("T2_IMPLS");
  const int reps = getenv("T2_REPS") ? atoi(getenv("T2_REPS")) : 25;
  if (getenv("T2_HYBRID")) { /* the hybrid alone (needs T2_SIZES_DIR) */
    const char *dir = getenv("T2_SIZES_DIR");
    if (!dir) {
      fprintf(stderr, "T2_HYBRID needs T2_SIZES_DIR\n");
      return 1;
    }
    hybrid(dir, sms, only_shape, reps);
    return 0;
  }
  bool on[N_IMPL];
  for (int i = 0; i < N_IMPL; ++i) on[i] = !only_impls || strstr(only_impls, kImplName[i]);
  on[I_LIB] = true; /* the reference of every check */
  printf("smem: 3 stages %zu B, 4 stages %zu B\n", t2::smem_of(3), t2::smem_of(4));
  printf("%-16s", "shape");
  for (int i = 0; i < N_IMPL; ++i)
    if (on[i]) printf(" %12s", kImplName[i]);
  printf("   (TFLOP/s, median; then x of lib; rel diff vs lib)\n");
  for (const Sh &sh : shapes) {
    const char *no_equal = getenv("T2_NOEQUAL"); /* set and not empty: the ragged part only */
    if ((only_shape && !strstr(sh.name, only_shape)) || (no_equal && *no_equal)) continue;
    const int m = sh.g * sh.rows;
    __nv_bfloat16 *x, *w, *o[N_IMPL];
    int32_t *sizes;
    int *counter;
    float *res;
    CK(cudaMalloc(&x, (size_t)m * sh.k * 2));
    CK(cudaMalloc(&w, (size_t)sh.g * sh.k * sh.n * 2));
    for (int i = 0; i < N_IMPL; ++i) {
      CK(cudaMalloc(&o[i], (size_t)m * sh.n * 2));
      CK(cudaMemset(o[i], 0xff, (size_t)m * sh.n * 2)); /* poisoned: NaN */
    }
    CK(cudaMalloc(&sizes, sh.g * 4));
    CK(cudaMalloc(&counter, 4));
    CK(cudaMalloc(&res, 8));
    std::vector<int32_t> hs(sh.g, sh.rows);
    CK(cudaMemcpy(sizes, hs.data(), sh.g * 4, cudaMemcpyHostToDevice));
    fill_random<<<1024, 256>>>(x, (size_t)m * sh.k, 1u);
    fill_random<<<1024, 256>>>(w, (size_t)sh.g * sh.k * sh.n, 2u);
    GmmArgs a;
    a.lhs = x, a.rhs = w, a.out = o[I_LIB], a.group_sizes = sizes, a.group_offset = nullptr;
    a.table = nullptr, a.counter = counter;
    a.m = m, a.k = sh.k, a.n = sh.n, a.num_groups = sh.g, a.num_local_groups = sh.g;
    a.in_dtype = SL_DTYPE_BF16, a.out_dtype = SL_DTYPE_BF16, a.transpose_rhs = 0;
    const uint64_t da[2] = {(uint64_t)sh.k, (uint64_t)m}, sa[1] = {(uint64_t)sh.k * 2};
    const uint32_t boxa[2] = {64, 256}, boxa_half[2] = {64, 128};
    const uint64_t db[4] = {64, (uint64_t)sh.k, (uint64_t)sh.n / 64, (uint64_t)sh.g};
    const uint64_t sb[3] = {(uint64_t)sh.n * 2, 128, (uint64_t)sh.k * sh.n * 2};
    const uint32_t boxb[4] = {64, 64, 2, 1};
    const uint64_t dc[2] = {(uint64_t)sh.n, (uint64_t)m}, sc[1] = {(uint64_t)sh.n * 2};
    const uint32_t boxc[2] = {64, 64};
    CUtensorMap ma, ma_half, mb, mc[N_IMPL];
    bool ok = make_map(&ma, x, SL_DTYPE_BF16, 2, da, sa, boxa) &&
              make_map(&ma_half, x, SL_DTYPE_BF16, 2, da, sa, boxa_half) &&
              make_map(&mb, w, SL_DTYPE_BF16, 4, db, sb, boxb);
    for (int i = I_T23; i <= I_MC; ++i)
      ok = ok && make_map(&mc[i], o[i], SL_DTYPE_BF16, 2, dc, sc, boxc);
    if (!ok) {
      fprintf(stderr, "tensor maps failed\n");
      return 1;
    }
    const float one = 1.f, zero = 0.f;
    auto run = [&](int i) {
      switch (i) {
        case I_LIB:
          if (sm90_gmm_launch(a, false, sms, 0, -1) != SL_STATUS_SUCCESS) {
            fprintf(stderr, "library gmm failed\n");
            exit(1);
          }
          break;
        case I_T23:
          t2::t2_kernel<3, false><<<sms, 384, t2::smem_of(3)>>>(ma, mb, mc[i], sh.rows, sh.k, sh.n,
                                                                sh.g);
          break;
        case I_T24:
          t2::t2_kernel<4, false><<<sms, 384, t2::smem_of(4)>>>(ma, mb, mc[i], sh.rows, sh.k, sh.n,
                                                                sh.g);
          break;
        case I_MC:
          CK(cudaLaunchKernelEx(&mc_cfg, t2::t2_kernel<4, true>, ma_half, mb, mc[i], sh.rows, sh.k,
                                sh.n, sh.g));
          break;
        case I_CUBLAS: /* column-major: out^T [n, rows] = w^T [n, k] x^T [k, rows], per group */
          CKB(cublasGemmStridedBatchedEx(cub, CUBLAS_OP_N, CUBLAS_OP_N, sh.n, sh.rows, sh.k, &one, w,
                                         CUDA_R_16BF, sh.n, (long long)sh.k * sh.n, x, CUDA_R_16BF,
                                         sh.k, (long long)sh.rows * sh.k, &zero, o[i], CUDA_R_16BF,
                                         sh.n, (long long)sh.rows * sh.n, sh.g, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT));
          break;
      }
    };
    for (int i = 0; i < N_IMPL; ++i)
      if (on[i]) run(i);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    float rel[N_IMPL] = {0};
    for (int i = 1; i < N_IMPL; ++i) {
      if (!on[i]) continue;
      CK(cudaMemset(res, 0, 8));
      max_diff<<<1024, 256>>>(o[i], o[I_LIB], (size_t)m * sh.n, res);
      float hr[2];
      CK(cudaMemcpy(hr, res, 8, cudaMemcpyDeviceToHost));
      rel[i] = hr[0] / hr[1];
    }
    std::vector<int> order;
    for (int i = 0; i < N_IMPL; ++i)
      if (on[i]) order.push_back(i);
    const std::vector<double> med = time_in_turn(order, reps, run);
    const double fl = 2.0 * m * sh.k * sh.n;
    printf("%-16s", sh.name);
    for (int i : order) printf(" %12.1f", fl / med[i] / 1e9);
    printf("\n%-16s", "");
    for (int i : order) printf(" %11.3fx", med[I_LIB] / med[i]);
    printf("\n%-16s", "");
    for (int i : order) printf(" %12.2e", rel[i]);
    printf("\n");
    cudaFree(x), cudaFree(w), cudaFree(sizes), cudaFree(counter), cudaFree(res);
    for (int i = 0; i < N_IMPL; ++i) cudaFree(o[i]);
  }
  if (const char *dir = getenv("T2_SIZES_DIR")) ragged(dir, sms, only_shape, reps);
  return 0;
}
