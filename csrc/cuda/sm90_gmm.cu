/* Hopper grouped GEMM (sm_90a): wgmma fed by TMA through an mbarrier pipeline.
 *
 * One persistent CTA per SM, 3 warpgroups: warpgroup 0 produces (one thread issues the TMA loads;
 * in tgmm, warps 1-3 zero rows past a group's end), warpgroups 1 and 2 consume. Every CTA builds
 * the group table from the device's group_sizes at entry (gmm_common.cuh) and walks tiles
 * t = blockIdx.x, + gridDim.x, ... in the same order in producer and consumers, so no tile mixes
 * groups. The consumers share each 128x256 tile cooperatively, 64 rows each (m64n256k16). (A
 * ping-pong kernel, V_PP - each warpgroup on its own 128x128 tile, the two alternating so that one's
 * epilogue overlaps the other's mainloop - measured 3-11% slower and is in the history at f265b23.)
 *
 *   gmm   tile = (group j, 128 rows of j, BN cols). A = lhs rows [K-major, box 64x128], B = rhs[j]
 *         through a 3-d map [G_local, K, N] (N-major, boxes of 64x64) or [G_local, N, K]
 *         (K-major, one 64xBN box). A tile may load rows of the next group; the epilogue stores
 *         only this group's rows. K edges and M edges are zero-filled by TMA bounds.
 *   tgmm  tile = (group j, 128 rows of out[j] = K dim, BN cols), contraction over the group's
 *         rows in blocks of 64 (V_K32: 32): A = lhs^T (M-major, 2 boxes), B = rhs rows (N-major
 *         boxes).
 *         Rows of the last block past the group's end belong to the next group and would join the
 *         contraction: they are zeroed in shared memory before the wgmma.
 *
 * Shared memory per stage: A 16 KB + B (BN x 64 x 2 bytes), 128B-swizzled, 1024-byte aligned
 * (V_K32: half of each, for 32-row blocks). */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "../core/internal.h"
#include "gmm_common.cuh"
#include "sm90_gmm.cuh"

namespace sluice_cuda {
namespace sm90 {

constexpr int BM = 128, BN = 256, BK = 64, THREADS = 384;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2; /* a stage: stage_bytes_of(variant) */
constexpr int BOX_BYTES = 64 * 64 * 2;                      /* one 64x64 swizzled box */
constexpr int C_BYTES = BM * BN * 2; /* 16-bit output tile staged for the TMA store */
static_assert(
    A_BYTES == 2 * BOX_BYTES && B_BYTES == 4 * BOX_BYTES,
    "a stage is 2 A boxes and 4 B boxes of 64x64: the TMA issue and the fix-up assume it");

/* Kernel variants (dev/cuda/gmm.cu times each; dev/NOTES.md has every version's prediction and
 * measurement, including the variants removed since - V_WAIT1 1, V_TMA_C0 3, V_PP 5 (session
 * 12, at f265b23), V_MC 6, V_MCN 7,
 * V_OV 8, V_4S 9, 21-22, used twice: V_RS, V_RS4 (session 8), V_3W, V_FC (session 9, in the
 * history at 43419fc and 6add3a9), and 24-27: V_LG2, V_LG3, V_K16, V_KS (session 10, at 1874ec4
 * and 0943536), 28-31 (session 12's diagnostics) and 32, V_TL (session 13: the last wave of
 * tiles in 128x128 halves, 0.99x; in the history at 9ad54f8), and 2, 4, 19, 20: V_TMA_C,
 * V_TMA_CS, V_MD, V_MD4 (removed in session 17, below; in the history at 16d7722) - whose numbers
 * are not to be reused again; 33 is V_TM; 34, V_TM1 (session 22: V_TM's merged rows in one TMA
 * copy), was folded into V_TM; 35, V_SD (session 42: the split drain on two m64n128 column
 * halves, 0.95-1.04x; in the history at 8835583), was removed; the next new variant is 36,
 * harness version 38):
 *   V_BASE   4 stages, each k-block's wgmmas waited before the next (wait_group 0), epilogue
 *            stores straight from registers. Any output dtype: the f32-output path until
 *            session 13, now only where the staged epilogue cannot run (an f32 row not a
 *            multiple of 16 bytes, an output not 16-byte aligned).
 *   V_TMA_C  (2, 3 stages, wait_group 1, the epilogue staged in shared memory for TMA stores: 93%
 *            tensor-pipe cycles, the gmm default until V_AHS; in the history at 16d7722)
 *   V_TMA_CS (4, V_TMA_C with the ragged-edge skips: tgmm +2-5% on ragged sizes, gmm no gain, the
 *            tgmm default until V_AHS; in the history at 16d7722)
 * Every variant but V_BASE has what these two brought (described under V_AHS).
 * In every variant the tgmm rows past a group's end are zeroed by warps 1-3 of the producer
 * warpgroup as soon as the block lands, off the consumers' path; consumers wait for a per-stage
 * "fixed" barrier on those blocks only. */
enum Variant { V_BASE = 0, V_AHS = 11, V_DYN = 14, V_FB = 18, V_K32 = 23, V_TM = 33 };
__host__ __device__ constexpr bool is_variant(int v) {
  return v == V_BASE || v == V_AHS || v == V_DYN || v == V_FB || v == V_K32 || v == V_TM;
}
/* V_AHS: 3 stages, one k-block of wgmmas in flight (wait_group 1: a stage goes back one block
 * later), the epilogue staged in shared memory (128B-swizzled, conflict-free) and written by TMA
 * bulk stores that overlap the next tile's mainloop (a gmm half-tile that crosses its group's end
 * falls back to masked register stores), as V_TMA_C had; V_TMA_CS's skips of ragged-edge work (in
 * gmm, a tile with <= 64 rows of its group leaves consumer warpgroup 2 idle: it only passes the
 * stages back; in tgmm, the last contraction block issues only the k16 steps that hold rows of
 * the group, ceil(rows/16) of 4, and only rows up to the next multiple of 16 need zeroing, none
 * when the group ends on one); and less work at tile boundaries, where both consumer warpgroups
 * leave the tensor pipe idle together (dev/cuda/trace.sh measured ~1000-1600 cycles of head -
 * decoding the next tile, zeroing the accumulators - and ~1800 of epilogue per tile, against 16 x
 * 1024 cycles of wgmma on a dsv3 tgmm tile). The next tile is decoded while the last k-block
 * drains, and the first wgmma of a tile runs with scale_d = 0 instead of on zeroed accumulators
 * (head ~250 cycles). The epilogue is staged with stmatrix (a quarter of the shared-memory store
 * instructions; the output dtype branch taken once per tile). +1-3% gmm, +1-5% tgmm over V_TMA_CS
 * (harness, 2026-11-22, session 4); the default of both ops until V_DYN, and still what runs when
 * V_DYN has no workspace for its counter. */
/* V_DYN: V_AHS with tiles handed out at run time instead of by a fixed stride. With a stride
 * (CTA c takes tiles c, c + grid, ...) the CTAs that share an operand drift apart over a kernel's
 * tiles (SMs do not run at one speed), and the operand is read from DRAM again by the late ones:
 * on dsv3-gateup gmm V_AHS read 6.0 GB from DRAM where the inputs are 2.35 GB (Nsight Compute,
 * 2026-11-22), and the extra DRAM traffic costs power, which is what bounds these kernels (the
 * chip runs at its 700 W cap, clocks fall to ~1.3-1.5 GHz). Here each CTA's first tile is its
 * index and every later one is claimed with an atomic add on a counter in the workspace (zeroed
 * by the launcher), so the tiles in flight are always about one grid's worth of consecutive
 * tiles and operands are shared while they are in L2. The producer thread claims one tile ahead
 * and passes each tile index (then an end mark) to the consumers and fixers through a small ring
 * in shared memory guarded by mbarriers. Needs the workspace's counter; without one, V_AHS runs.
 * (Since session 43 gmm claims only its last waves' tiles and takes the rest by the stride:
 * kClaimedWaves.)
 * The default of both ops in session 5: DRAM reads 5.5 -> 3.0 GB and +5% alone under load on
 * dsv3-gateup gmm, tgmm +2-10% on skewed sizes (dev/NOTES.md, session 5). V_FB (below) is V_DYN
 * with fewer TMA instructions, the default since session 6. */
/* V_FB: V_DYN whose producer loads a stage's B (and tgmm's A) with one TMA copy of a 3-d or 4-d
 * box instead of one copy per 64-column box: the tensor is viewed with its contiguous dimension
 * split into 64-element blocks (dims {64, rows, cols/64[, G]}), so the box {64, 64, 4} lands as the
 * same four 128B-swizzled 8 KB boxes. 2 TMA instructions per k-block instead of 5 (gmm) or 6
 * (tgmm). Needs the split dimension to be a multiple of 64 (else the view would alias the next
 * row instead of zero-filling): otherwise V_DYN runs. The default of both ops since session 6 (of
 * gmm only since session 10, where V_K32 took tgmm; since session 14 the gmm default where V_TM
 * does not apply: transpose_rhs, f32 outputs, and since session 18 K < 2048):
 * gmm level with V_DYN (0.99-1.01x), tgmm +0.2-1.8% in all 16 harness cases (2026-11-24). */
/* V_MD, V_MD4 (19, 20: V_FB on 2-CTA clusters with TMA multicast of the shared operand, V_MD4 with
 * a fourth stage: L2 traffic -23%, +1-3% alone, 0.95-1.0x of V_FB in turn; in the history at
 * 16d7722) */
/* V_K32: V_FB with k-blocks of 32 rows (tgmm: contraction rows; gmm: K columns) in 6 stages of
 * 24 KB (the 144 KB of V_FB's 3 x 48 KB). The two consumer warpgroups still hold the last two
 * blocks (wait_group 1), now 64 rows instead of 128, so the producer's lookahead is 4 blocks of 32
 * rather than one of 64, and (tgmm) a group's last, partial block loads and waits for 32 rows
 * rather than 64. tgmm harness (one H200, 2026-11-24, gmm-harness-20261124-J.txt): 1.000-1.006x
 * of V_FB on uniform sizes, 1.010-1.026x ragged, 1.002-1.012x skewed. Written as the control of a
 * lag experiment (warpgroup 2 held 2-3 blocks behind warpgroup 1, so that each epilogue overlaps
 * the other's wgmmas: 0.96-1.00x of V_FB, removed; in the history at 1874ec4). gmm (session 13):
 * A's 32-column blocks are 64-byte rows, loaded and read with the 64B swizzle; N-major B only
 * (transpose_rhs runs V_FB). In turn with other kernels it is a little faster than V_FB (two
 * interleaved harness calls: 0.989-1.022x, geomean 1.005x both times; bench gmm/torch 1.13x
 * against 1.12x in one call), alone under sustained load a little slower (-0.2..-4.2%, gateup
 * most: its clock settles 45-60 MHz lower - twice the TMA requests and barrier traffic per flop),
 * so it is not the gmm default: SLUICE_GMM_VARIANT=23 selects it. The tgmm default. */
/* V_TM (gmm, N-major B, 16-bit outputs): V_FB whose groups with a partial last row tile of <= 64
 * rows take their last 128 + r rows (129..192: merged_rows) as "merged" tiles instead of a full tile and an
 * edge tile. The edge tile of V_FB computes its few rows against a whole 256-column strip of the
 * weights (a lone warpgroup when r <= 64, the stages needed twice as fast per flop as a full
 * tile's): measured at ~0.9 of a full tile on dsv3-gateup for 64 rows (session 6). A merged tile
 * is transposed: 128 output columns (two m64 halves, one per warpgroup) by the 129..192 rows as
 * the wgmma's N (m64nNk16, N = 160 or 192: the rows rounded up to 32), A = the weights'
 * 64x64 boxes read MN-major, B = the rows of lhs K-major, both straight from the stage as the
 * producer lands them (x: one 192-row box since session 22; w: two 64x64 boxes). Two
 * merged tiles per 256 columns do the work of 1.0..1.5 full tiles where V_FB spends ~1.9.
 * Its epilogue stages the transposed accumulators with stmatrix.trans, stores the whole 64-row
 * boxes by TMA and the last rows (which a TMA box would write past the group's end) from shared
 * memory with 16-byte stores. The merged tiles of a group come in its last panel, two after each
 * column block's row tiles, so they share the weights' strip with them. Measured (one H200,
 * 2026-11-24, dev/NOTES.md session 14): a merged tile of 192 rows costs ~0.91 of a full tile
 * (82% of the pipe's rate per flop), not the ~0.77 modelled, so merging pays only where the edge
 * tile has <= 64 rows (with <= 96, tiles of 224 rows, no better): in turn 0.97-1.04x
 * of V_FB by case (geomean 1.002-1.004x in two harness calls; ragged sizes +0.5..+1.9%, tile
 * multiples level, qwen3 "halves" -2..-3%), alone under sustained load +0.3..+1.9% on 7 of the 8
 * bench cases; bench gmm/torch 1.12-1.13x against 1.12x. The gmm default since session 14
 * (transpose_rhs, f32 outputs and, since session 18, K < 2048 run V_FB: resolve_variant). */
__host__ __device__ constexpr bool has_merge(int v) { return v == V_TM; }
__host__ __device__ constexpr bool is_k32(int v) { return v == V_K32; }
__host__ __device__ constexpr bool has_fused_boxes(int v) {
  return v == V_FB || is_k32(v) || has_merge(v);
}
__host__ __device__ constexpr bool is_dyn(int v) {
  return v == V_DYN || v == V_FB || is_k32(v) || has_merge(v);
}
/* Every variant but V_BASE has V_AHS's staged TMA epilogue (TMA_C), skips (SKIP) and lookahead
 * with the stmatrix epilogue (AHEAD): kept apart as the features the kernel tests. */
__host__ __device__ constexpr bool has_tma_c(int v) { return v != V_BASE; }
__host__ __device__ constexpr bool has_skip(int v) { return v != V_BASE; }
__host__ __device__ constexpr bool has_ahead(int v) { return v != V_BASE; }
__host__ __device__ constexpr int stages_of(int v) { return is_k32(v) ? 6 : has_tma_c(v) ? 3 : 4; }
/* contraction rows (tgmm) or K columns (gmm) per k-block, and one 64-wide swizzled input box */
__host__ __device__ constexpr int bk_of(int v) { return is_k32(v) ? 32 : BK; }
__host__ __device__ constexpr int in_box_bytes(int v) { return 64 * bk_of(v) * 2; }
__host__ __device__ constexpr int stage_bytes_of(int v) { return (BM + BN) * bk_of(v) * 2; }
/* TMA_C staging: the 128x256 tile (64 KB). */
__host__ __device__ constexpr int c_bytes_of(int v) { return has_tma_c(v) ? C_BYTES : 0; }
constexpr int RING = 4; /* V_DYN: decoded tiles in flight from the producer to the others */
/* A decoded tile (the kernel's decode): index, group, first row and column, k-blocks, the group's
 * rows [gs, ge), V_TM's merged rows (0 for a plain tile). V_DYN's ring slots hold one each. */
struct Tile {
  int t, j, m0, n0, nk, gs, ge, tok;
};
/* gmm's tile order (session 43): every tile but those of the last kClaimedWaves waves goes by a
 * fixed stride (CTA c takes c, c + grid, ...) and only those are claimed in turn. Neighbouring
 * CTAs then work in step on neighbouring tiles (a column block's row tiles share the weights'
 * strip, a group's column blocks its rows), and the L2 serves their concurrent requests for the
 * same lines once: Nsight Compute on qwen3 (one H100), 139 M -> 87 M L2 sectors requested by the
 * SMs (-38%), dsv3-down -27%; with the stride taken from the SM's id instead 115 M, from a
 * scrambled CTA index 166 M: the merging follows where the block scheduler puts neighbouring CTA
 * indices. The claimed last waves keep what run-time claims were for (V_DYN, session 5): tiles of
 * unequal cost (ragged edges, merged tiles) and SMs that do not run at one speed; the whole kernel
 * by stride was 1-5% slower on dsv3-gateup's and mixtral's ragged sizes. Harness, in turn against
 * every tile claimed (one H100, bench/results/tile-order-h100-20261127/, three samples a case):
 * qwen3 +2.5..+5.5% (skewed +0.4%), the dsv3-proxy model's K = 1024 gate/up +2..+7%, dsv3 and
 * mixtral level (0.98-1.07x, the machine's noise), the model's K = 256 down 0.99-1.016x; two
 * claimed waves are as good as six. tgmm claims every tile: its tiles (long groups first) differ
 * in cost by their group's rows, and a stride lost 9-13% on skewed sizes. */
constexpr int kClaimedWaves = 2;
/* ...except where K >= kClaimAllK: there gmm claims every tile, as tgmm does (measured, not yet
 * explained). On dsv3-gateup (K 7168, 112 k-blocks a tile) the stride cost cycles on both cards:
 * one H100, Nsight Compute 3.862 vs 3.829 M cycles, alone under load 1.3% slower
 * (bench/results/s44-h100-20261127/); one H200, in turn 1.8-2.6% slower, alone 3.5-4.9%
 * (bench/results/s53-h200-20261128/). At K 2048 (dsv3-down, qwen3) and below
 * (the model's shapes) the stride gained on both cards; mixtral (K 4096) was level. */
constexpr int kClaimAllK = 4096;
__host__ __device__ constexpr size_t pipe_bytes(int v) {
  return 1024 /* alignment slack */ + (size_t)stages_of(v) * stage_bytes_of(v) + c_bytes_of(v) +
         4 * stages_of(v) * 8 +
         (is_dyn(v) ? RING * (8 + 8 + 32) : 0) /* V_DYN's ring: two barriers, a Tile a slot */;
}
/* tgmm: the last contraction block of a group holds rv valid rows (1..bk_of(v)); rows
 * [rv, fix_end) belong to the next group (or are TMA zeros past M) and must be zeroed before the
 * wgmma reads them. With the skips only the k16 steps below ceil16(rv) run, so only those rows
 * matter. */
__host__ __device__ constexpr int fix_end(int v, int rv) {
  return has_skip(v) ? ((rv + 15) & ~15) : bk_of(v);
}

#ifdef SLUICE_SM90A_DEVICE
template <typename T, int TA, int TB>
__device__ __forceinline__ void wgmma_tile(float (&acc)[128], uint64_t da, uint64_t db,
                                           int scale_d = 1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    wgmma_m64n256k16_bf16<TA, TB>(acc, da, db, scale_d);
  else
    wgmma_m64n256k16_f16<TA, TB>(acc, da, db, scale_d);
}

/* The four 8x8 fragments of an stmatrix.x4 from column groups i, i+1 of an accumulator: matrix m
 * is rows +8*(m%2) of group i + m/2, each register two adjacent columns as OT. */
template <typename OT, int NREG>
__device__ __forceinline__ void pack_x4(const float (&acc)[NREG], int i, uint32_t (&p)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float lo = acc[4 * (i + (m >> 1)) + 2 * (m & 1)],
                hi = acc[4 * (i + (m >> 1)) + 2 * (m & 1) + 1];
    if constexpr (std::is_same<OT, __nv_bfloat16>::value) {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      p[m] = *reinterpret_cast<uint32_t *>(&v);
    } else {
      __half2 v = __floats2half2_rn(lo, hi);
      p[m] = *reinterpret_cast<uint32_t *>(&v);
    }
  }
}

/* V_TM's merged tiles: D[64 columns of the output, NT rows] += W^T (MN-major) * x^T (K-major), on
 * the first NT / 2 accumulators. */
template <typename T, int NT>
__device__ __forceinline__ void wgmma_tok(float (&acc)[128], uint64_t da, uint64_t db,
                                          int scale_d) {
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  float(&d)[NT / 2] = *reinterpret_cast<float(*)[NT / 2]>(&acc[0]);
  if constexpr (NT == 160) {
    if constexpr (BF) wgmma_m64n160k16_bf16<1, 0>(d, da, db, scale_d);
    else wgmma_m64n160k16_f16<1, 0>(d, da, db, scale_d);
  } else {
    static_assert(NT == 192, "merged tiles are 160 or 192 rows");
    if constexpr (BF) wgmma_m64n192k16_bf16<1, 0>(d, da, db, scale_d);
    else wgmma_m64n192k16_f16<1, 0>(d, da, db, scale_d);
  }
}

/* V_TM: a merged tile's accumulators (this warpgroup's 64 output columns x NT rows; thread holds
 * columns warp*16 + lane/4 (+8), rows 8i + 2*(lane%4) (+1)) staged as output rows: NT rows of
 * 128 bytes from cbase, 128B-swizzled, so every 64 rows are one TMA box. stmatrix.trans stores
 * each 8x8 fragment transposed: lane l addresses output row 8i' + l%8 (i' = i + l/16) at the
 * 16-byte chunk of its columns (2*warp + (l/8)%2). */
template <typename OT, int NT>
__device__ __forceinline__ void stage_tok_stsm(const float (&acc)[128], uint32_t cbase, int warp,
                                               int lane) {
  const int q = lane >> 3;
  const int c = 2 * warp + (q & 1);
#pragma unroll
  for (int i = 0; i < NT / 8; i += 2) {
    const int r = 8 * (i + (q >> 1)) + (lane & 7);
    const uint32_t addr = cbase + r * 128 + ((c ^ (r & 7)) << 4);
    uint32_t p[4];
    pack_x4<OT>(acc, i, p);
    asm volatile(
        "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
        "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3])
        : "memory");
  }
}

/* One 64-row accumulator half (NREG/4 column groups of 8) into 128B-swizzled 64x64 boxes at
 * cbase, by stmatrix, the output type OT fixed: thread holds rows warp*16 + lane/4 (+8), columns
 * 8i + 2*(lane%4) (+1); per pair of 8-column groups one stmatrix.x4 of the four 8x8 matrices (rows
 * 0-7 / 8-15 of the warp's 16) x (groups i, i+1); lane l gives the address of row l%8 of matrix
 * l/8. */
template <typename OT, int NREG>
__device__ __forceinline__ void stage_half_stsm(const float (&acc)[NREG], uint32_t cbase, int warp,
                                                int lane) {
  const int q = lane >> 3;                           /* the matrix this lane addresses */
  const int r = warp * 16 + (q & 1) * 8 + (lane & 7); /* its row in the 64-row half */
  const uint32_t row_base = cbase + r * 128;
#pragma unroll
  for (int i = 0; i < NREG / 4; i += 2) {
    const int c = i + (q >> 1); /* 8-column group (16-byte chunk) of this lane's matrix */
    const uint32_t addr = row_base + (c >> 3) * BOX_BYTES + (((c & 7) ^ (r & 7)) << 4);
    uint32_t p[4];
    pack_x4<OT>(acc, i, p);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3])
                 : "memory");
  }
}

/* An f32 output's 8-column groups [C0, C1) of one 64-row accumulator half, staged for the TMA
 * store from cbase on: boxes of 64 rows x 32 columns (128 bytes a row, 8 KB), 128B-swizzled like
 * the 16-bit ones (16-byte chunk c of row r at chunk c ^ (r % 8)). One 8-byte store per pair of
 * columns: a warp's 32 stores cover two chunks of each of 8 rows, which the swizzle spreads over
 * all 32 banks (two wavefronts for 256 bytes, the minimum). */
template <int C0, int C1>
__device__ __forceinline__ void stage_f32(const float (&acc)[128], uint32_t cbase, int warp,
                                          int lane) {
#pragma unroll
  for (int i = C0; i < C1; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + (lane >> 2) + h * 8;
      const int c = 8 * (i - C0) + 2 * (lane & 3); /* column from the pass's first */
      const uint32_t addr = cbase + (c >> 5) * BOX_BYTES + r * 128 +
                            ((((c & 31) >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc[4 * i + 2 * h]),
                   "f"(acc[4 * i + 2 * h + 1])
                   : "memory");
    }
}

/* Masked stores of one 64-row accumulator half straight from registers: rows from row0, only
 * rows < row_limit and columns < n. */
template <int NREG>
__device__ __forceinline__ void store_half_regs(const float (&acc)[NREG], void *out,
                                                sl_dtype out_dtype, int n, int row0, int n0,
                                                int row_limit, int warp, int lane) {
  const bool pair_ok = (n % 2) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + warp * 16 + (lane >> 2) + h * 8;
    if (row < row_limit) {
#pragma unroll
      for (int i = 0; i < NREG / 4; ++i) {
        const int col = n0 + i * 8 + (lane & 3) * 2;
        const size_t idx = (size_t)row * n + col;
        const float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
        if (pair_ok && col + 1 < n)
          store_out2(out, out_dtype, idx, v0, v1);
        else {
          if (col < n) store_out(out, out_dtype, idx, v0);
          if (col + 1 < n) store_out(out, out_dtype, idx + 1, v1);
        }
      }
    }
  }
}

#endif /* SLUICE_SM90A_DEVICE */

/* Cycle accounting for dev/cuda/gmm.cu (built with -DSLUICE_SM90_TRACE only; the library never
 * is): per CTA, where the first consumer warpgroup, the producer thread and the fixer warps spend
 * their cycles (clock64), summed over the CTA's tiles of one launch. */
#ifdef SLUICE_SM90_TRACE
enum TraceSlot {
  TR_TILES,     /* tiles the consumers computed */
  TR_BLOCKS,    /* k-blocks they computed */
  TR_HEAD,      /* previous epilogue's end -> first full-barrier wait (decode, zeroing) */
  TR_FULL0,     /* waiting for a tile's first block to land */
  TR_FULL,      /* waiting for the other blocks (and the fix-up) */
  TR_WAIT1,     /* wgmma.wait_group 1 in the mainloop */
  TR_WAIT0,     /* the tile-end wgmma.wait_group 0 */
  TR_EPI,       /* the epilogue: staging and the TMA store issue */
  TR_CONS,      /* the consumer's whole loop */
  TR_P_EMPTY,   /* producer: waiting for a free stage */
  TR_P_EMPTY0,  /* producer: of that, for a tile's first block */
  TR_PROD,      /* producer: its whole loop */
  TR_FIX_WAIT,  /* fixers: waiting for the block to be issued and land */
  TR_FIX_WORK,  /* fixers: zeroing, fence, barrier */
  TR_EPI_READ,  /* of the epilogue: waiting for the last store to have read the staging buffer */
  TR_EPI_BAR,   /* ... the two warpgroup barriers */
  TR_EPI_STAGE, /* ... the staging stores */
  TR_EPI_FENCE, /* ... the async-proxy fence */
  TR_P_ISSUE,   /* producer: expect_tx and the stage's TMA copies issued */
  TR_N
};
__device__ unsigned long long g_sm90_trace[1024][TR_N];
#define SL_TR(x) const long long x = clock64()
#define SL_TR_ADD(slot, d) (tr[slot] += (unsigned long long)(d))
#define SL_TR_DECL unsigned long long tr[TR_N] = {}
/* after a full-barrier wait that began at w0: a tile's first block counts apart, with the head */
#define SL_TR_FULL(w0)                           \
  do {                                           \
    const long long w1_ = clock64();             \
    if (tr_first) {                              \
      tr[TR_FULL0] += w1_ - w0;                  \
      tr[TR_HEAD] += w0 - epi_end;               \
      tr_first = false;                          \
    } else {                                     \
      tr[TR_FULL] += w1_ - w0;                   \
    }                                            \
  } while (0)
#define SL_TR_STORE(cond)                                                         \
  do {                                                                            \
    if (cond)                                                                     \
      for (int i_ = 0; i_ < TR_N; ++i_)                                           \
        if (tr[i_]) g_sm90_trace[blockIdx.x][i_] = tr[i_];                        \
  } while (0)
#else
#define SL_TR(x)
#define SL_TR_ADD(slot, d)
#define SL_TR_DECL
#define SL_TR_FULL(w0)
#define SL_TR_STORE(cond)
#endif

template <typename T, bool TGMM, bool TRANS_B, int VARIANT>
__global__ void __launch_bounds__(THREADS, 1)
    gmm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_c,
               const __grid_constant__ CUtensorMap map_a2,
               const __grid_constant__ CUtensorMap map_b2,
               const __grid_constant__ CUtensorMap map_cf, GmmArgs a) {
#ifdef SLUICE_SM90A_DEVICE
  constexpr int STAGES = stages_of(VARIANT);
  constexpr size_t PIPE_BYTES = pipe_bytes(VARIANT);
  constexpr bool SKIP = has_skip(VARIANT);
  constexpr bool WAIT1 = VARIANT != V_BASE; /* one k-block of wgmmas in flight */
  constexpr bool TMA_C = has_tma_c(VARIANT);
  constexpr bool AHEAD = has_ahead(VARIANT); /* V_AHS: also the stmatrix epilogue */
  constexpr bool DYN = is_dyn(VARIANT);
  constexpr bool FB = has_fused_boxes(VARIANT); /* (gmm with transpose_rhs: nothing to fuse) */
  constexpr int TBN = BN, NB = TBN / 64; /* tile columns, 64-column B boxes */
  constexpr int SBYTES = stage_bytes_of(VARIANT);
  /* rows of a k-block, one input box, a stage's A part */
  constexpr int BKV = bk_of(VARIANT), IBOX = in_box_bytes(VARIANT), A_B = 2 * IBOX;
  static_assert(!is_k32(VARIANT) || !TRANS_B, "V_K32: an N-major B");
  constexpr bool MERGE = has_merge(VARIANT);
  static_assert(!MERGE || (!TRANS_B && !TGMM && BKV == 64), "V_TM: gmm, an N-major B");
  const int cid = blockIdx.x, ncl = gridDim.x; /* this CTA's first tile, the CTA count */
  extern __shared__ __align__(1024) unsigned char smem_sm90[];
  unsigned char *smem_raw = smem_sm90;
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t stage0 = smem_u32(base);
  const uint32_t c_smem = stage0 + STAGES * SBYTES; /* TMA_C only */
  uint64_t *bars = reinterpret_cast<uint64_t *>(base + STAGES * SBYTES + c_bytes_of(VARIANT));
  const uint32_t full0 = smem_u32(bars), empty0 = full0 + STAGES * 8, fixed0 = empty0 + STAGES * 8;
  const uint32_t issued0 =
      fixed0 + STAGES * 8;                     /* tgmm: producer issued a block that needs fixing */
  /* V_DYN's ring: slot r holds a decoded tile (ring0 + 32r, a Tile), filled (tfull0 + 8r, the
   * producer arrives) and read by every consumer and fixer thread (tempty0 + 8r, each arrives) */
  const uint32_t tfull0 = issued0 + STAGES * 8, tempty0 = tfull0 + RING * 8, ring0 = tempty0 + RING * 8;

  /* units of work per group: tiles (tgmm: tiles_k x tiles_n of out[j] each) */
  const int tiles_n = (a.n + TBN - 1) / TBN, tiles_k = (a.k + BM - 1) / BM;
  int *tab = a.table;
  if (tab == nullptr) {
    tab = reinterpret_cast<int *>(smem_raw + PIPE_BYTES);
    build_group_table(a, tab, TGMM ? 0 : BM, tiles_n, tiles_n * tiles_k,
                      MERGE ? kTilesMerged : kTilesPlain);
  }
  const int GL = a.num_local_groups;
  const int *start = tab + kTableHeader, *end = start + GL, *tile_prefix = end + GL;
  const int *order = tile_prefix + GL + 1; /* tgmm: long groups first (build_group_table) */
  const int total_tiles = tab[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8);  /* lane 0 of each consumer warp (both warpgroups) */
      mbar_init(fixed0 + 8 * s, 1);  /* tgmm: the fixer warps zeroed the rows past the group */
      mbar_init(issued0 + 8 * s, 1); /* tgmm: the producer issued such a block into stage s */
    }
    if constexpr (DYN) {
      for (int r = 0; r < RING; ++r) {
        mbar_init(tfull0 + 8 * r, 1);
        mbar_init(tempty0 + 8 * r, 32 * (8 + (TGMM ? 3 : 0))); /* consumer, fixer threads */
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (!TGMM && !a.skip_unused) zero_outside_rows(a, tab[0], tab[1]);
  __syncthreads();

  /* The group of the tile this thread decoded last: its tiles [g_lo, g_hi), index g_j and rows
   * [g_gs, g_ge). A CTA's tiles come mostly from one group after another, so most decodes need
   * none of find_group's dependent shared-memory loads, which the mainloop's wgmma reads and TMA
   * writes keep slow (session 61: decoding cost tgmm ~2% of a 1,024-row tile). Measured on
   * dsv3-gateup's K and N (Nsight Compute, session 62): tgmm's fixed cycles a tile 2,414 -> 1,972,
   * 2.6% fewer cycles at 1,024 rows a group. */
  int g_lo = 0, g_hi = 0, g_j = 0, g_gs = 0, g_ge = 0;
  /* Decodes tile t into (group j, first row m0, first column n0, k-blocks nk, group rows; tok:
   * MERGE, the rows of a merged tile, else 0). */
  auto decode = [&](int t, int &j, int &m0, int &n0, int &nk, int &gs, int &ge, int &tok) {
    if (t < g_lo || t >= g_hi) {
      const int r = find_group(tile_prefix, GL, t); /* tgmm: the r-th group of order[] */
      g_lo = tile_prefix[r], g_hi = tile_prefix[r + 1];
      g_j = TGMM ? order[r] : r;
      g_gs = start[g_j], g_ge = end[g_j];
    }
    j = g_j;
    const int u = t - g_lo;
    gs = g_gs;
    ge = g_ge;
    const int tm = TGMM ? tiles_k : (ge - gs + BM - 1) / BM; /* row tiles of the group */
    int mt, nt;
    tok = 0;
    if (MERGE && merged_rows(ge - gs)) {
      /* full row tiles tmn, in panels of 16; the last panel (height hl, 0..16) also holds the
       * two merged tiles of each column block, after its row tiles */
      const int tmn = (ge - gs) / BM - 1;
      const int np = tmn > 0 ? (tmn + 15) / 16 : 1, before = (np - 1) * 16 * tiles_n;
      if (u < before) {
        panel_raster(u, tmn, tiles_n, mt, nt);
      } else {
        const int hl = tmn - (np - 1) * 16, rem = u - before;
        nt = rem / (hl + 2);
        const int q = rem - nt * (hl + 2);
        mt = (np - 1) * 16 + q;
        if (q >= hl) {
          m0 = gs + tmn * BM;
          n0 = nt * TBN + (q - hl) * (TBN / 2);
          nk = (a.k + BKV - 1) / BKV;
          tok = ge - m0;
          return;
        }
      }
    } else if (TGMM && !a.tgmm_panels) {
      /* tgmm: a column block's row tiles one after another, so the CTAs at work together share
       * one strip of the rhs (dy) and the lhs's column blocks in turn. Against gmm's panels
       * (harness version 49, in turn, one H200): +0.4..+1.1% on dsv3, +0.1..+0.4% on mixtral,
       * +1.3..+2.2% on qwen3, every case ahead (session 61) */
      mt = u % tm, nt = u / tm;
    } else {
      panel_raster(u, tm, tiles_n, mt, nt);
    }
    m0 = (TGMM ? 0 : gs) + mt * BM;
    nk = TGMM ? (ge - gs + BKV - 1) / BKV : (a.k + BKV - 1) / BKV;
    n0 = nt * TBN;
  };
  /* tgmm: does the last block of a tile with nk blocks over `rows` rows need zeroing? */
  auto needs_fix = [&](int nk, int rows) {
    const int rv = rows - (nk - 1) * BKV;
    return TGMM && nk > 0 && rv < fix_end(VARIANT, rv);
  };
  /* Tile t decoded once (t >= total_tiles: the end, nothing else set). */
  auto decode_tile = [&](int t) {
    Tile d{t, 0, 0, 0, 0, 0, 0, 0};
    if (t < total_tiles) decode(t, d.j, d.m0, d.n0, d.nk, d.gs, d.ge, d.tok);
    return d;
  };
  /* V_DYN: the next tile from the ring, as the producer decoded it (called by every consumer and
   * fixer thread, in tile order; t >= total_tiles ends the CTA's work). The producer decodes
   * each tile once, off the consumers' path, where each consumer had decoded it again while its
   * last k-block drained (find_group's dependent shared-memory loads; with a closed-form decode
   * instead, tgmm's 1,024-row tiles took 2% fewer cycles). Measured on dsv3-gateup (Nsight
   * Compute, with tgmm's order below): 0.6% fewer cycles on equal groups, 2.1% on ragged ones
   * (session 61). Each thread hands the slot back itself after its read, so no read can meet the
   * producer's next write to the slot. */
  int ring_slot = 0;
  uint32_t ring_phase = 0;
  auto ring_get = [&]() {
    mbar_wait(tfull0 + 8 * ring_slot, ring_phase);
    Tile d;
    const uint32_t at = ring0 + 32 * ring_slot;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d.t), "=r"(d.j), "=r"(d.m0), "=r"(d.n0)
                 : "r"(at)
                 : "memory");
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d.nk), "=r"(d.gs), "=r"(d.ge), "=r"(d.tok)
                 : "r"(at + 16)
                 : "memory");
    mbar_arrive(tempty0 + 8 * ring_slot);
    if (++ring_slot == RING) ring_slot = 0, ring_phase ^= 1;
    return d;
  };

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int s = 0;
      uint32_t phase = 0;
      SL_TR_DECL;
      SL_TR(p_begin);
      /* V_DYN: publish a decoded tile into the ring; claim the tile after next early, so the
       * atomic's latency hides behind a tile of loads */
      int claim = 0;
      auto ring_put = [&](const Tile &d) {
        mbar_wait(tempty0 + 8 * ring_slot, ring_phase ^ 1);
        const uint32_t at = ring0 + 32 * ring_slot;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(d.t), "r"(d.j),
                     "r"(d.m0), "r"(d.n0)
                     : "memory");
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at + 16), "r"(d.nk),
                     "r"(d.gs), "r"(d.ge), "r"(d.tok)
                     : "memory");
        mbar_arrive(tfull0 + 8 * ring_slot);
        if (++ring_slot == RING) ring_slot = 0, ring_phase ^= 1;
      };
      int *const counter = a.counter; /* V_DYN: the tile counter, in the workspace */
      /* the tiles below `stat` go by the stride, the rest are claimed from `base` on (a claim past
       * the last tile ends the CTA's work) */
      const bool claim_all = a.tile_order == 1 || (!a.tile_order && (TGMM || a.k >= kClaimAllK));
      const int stat = claim_all ? 0
                       : a.tile_order == 2 ? total_tiles
                                           : ncl * max(0, total_tiles / ncl - kClaimedWaves);
      const int base = max(stat, ncl);
      auto after = [&](int t) { return t + ncl < stat ? t + ncl : base + atomicAdd(counter, 1); };
      Tile cur; /* the tile being loaded, decoded */
      auto next_tile = [&](int t) {
        if constexpr (DYN) {
          t = claim;
          cur = decode_tile(t);
          ring_put(cur);
          if (t < total_tiles) claim = after(t);
          return t;
        } else {
          cur = decode_tile(t + ncl);
          return t + ncl;
        }
      };
      cur = decode_tile(cid);
      if constexpr (DYN) {
        claim = after(cid);
        ring_put(cur);
      }
      for (int t = cid; t < total_tiles; t = next_tile(t)) {
        const int j = cur.j, m0 = cur.m0, n0 = cur.n0, nk = cur.nk, gs = cur.gs, ge = cur.ge,
                  tok = cur.tok;
        const bool fix = needs_fix(nk, ge - gs);
        if (MERGE && tok) {
          /* a merged tile: x rows [m0, m0 + 192) in one box (rows past the tile's 129..192 are
           * loaded, and their columns of the accumulator never stored; TMA zero-fills past M);
           * the weights' 128 columns [n0, n0 + 128) as two 64x64 boxes, after the 32 KB that x
           * may take. One copy of x instead of a 128-row and one or two 32-row boxes: +0.2..+4.5%
           * where groups end in merged tiles (V_TM1, session 22) */
          const uint32_t bytes = 192 * BKV * 2 + A_BYTES;
          for (int kb = 0; kb < nk; ++kb) {
            const uint32_t full = full0 + 8 * s;
            mbar_wait(empty0 + 8 * s, phase ^ 1);
            mbar_expect_tx(full, bytes);
            const uint32_t sa = stage0 + s * SBYTES;
            const int k0 = kb * BKV;
            tma_load_2d(sa, &map_a2, k0, m0, full);
            tma_load_4d(sa + 2 * A_BYTES, &map_b2, 0, k0, n0 / 64, j, full);
            if (++s == STAGES) s = 0, phase ^= 1;
          }
          continue;
        }
        for (int kb = 0; kb < nk; ++kb) {
          const uint32_t full = full0 + 8 * s;
          SL_TR(w0);
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          SL_TR(w1);
          SL_TR_ADD(TR_P_EMPTY, w1 - w0);
          if (kb == 0) SL_TR_ADD(TR_P_EMPTY0, w1 - w0);
          mbar_expect_tx(full, SBYTES);
          const uint32_t sa = stage0 + s * SBYTES, sb = sa + A_B;
          if (TGMM) {
            const int r0 = gs + kb * BKV;
            if (FB) {
              tma_load_3d(sa, &map_a, 0, r0, m0 / 64, full);
              tma_load_3d(sb, &map_b, 0, r0, n0 / 64, full);
            } else {
              tma_load_2d(sa, &map_a, m0, r0, full);
              tma_load_2d(sa + BOX_BYTES, &map_a, m0 + 64, r0, full);
#pragma unroll
              for (int i = 0; i < NB; ++i)
                tma_load_2d(sb + i * BOX_BYTES, &map_b, n0 + 64 * i, r0, full);
            }
          } else {
            const int k0 = kb * BKV;
            tma_load_2d(sa, &map_a, k0, m0, full);
            if (TRANS_B) {
              tma_load_3d(sb, &map_b, k0, n0, j, full);
            } else if (FB) {
              tma_load_4d(sb, &map_b, 0, k0, n0 / 64, j, full);
            } else {
#pragma unroll
              for (int i = 0; i < NB; ++i)
                tma_load_3d(sb + i * BOX_BYTES, &map_b, n0 + 64 * i, k0, j, full);
            }
          }
          SL_TR(w2);
          SL_TR_ADD(TR_P_ISSUE, w2 - w1);
          if (fix && kb == nk - 1) mbar_arrive(issued0 + 8 * s);
          if (++s == STAGES) s = 0, phase ^= 1;
        }
      }
      SL_TR(p_end);
      SL_TR_ADD(TR_PROD, p_end - p_begin);
      SL_TR_STORE(true);
    } else if (TGMM && threadIdx.x >= 32) {
      /* Fixers (warps 1-3): the last block of a group's contraction holds rows of the next group
       * (or TMA zeros past M); zero them in shared memory before the consumers read the stage. */
      const int ft = threadIdx.x - 32;
      long long blk = 0;         /* k-blocks issued so far, as the producer counts them */
      uint32_t issued_phase = 0; /* bit s: parity of stage s's next "issued" phase */
      SL_TR_DECL;
      for (Tile d = DYN ? ring_get() : decode_tile(cid); d.t < total_tiles;
           d = DYN ? ring_get() : decode_tile(d.t + ncl)) {
        const int nk = d.nk, gs = d.gs, ge = d.ge;
        if (needs_fix(nk, ge - gs)) {
          const int rv = ge - gs - (nk - 1) * BKV; /* valid rows of the last block */
          const int fe = fix_end(VARIANT, rv);
          const long long b = blk + nk - 1;
          const int s = (int)(b % STAGES);
          /* Wait until the producer has issued block b: only then is stage s's current full phase
           * b's own (a parity wait further ahead could match an older phase). Neither barrier can
           * lap the fixers: stage s is not refilled until the consumers saw this block fixed. */
          SL_TR(f0);
          mbar_wait(issued0 + 8 * s, (issued_phase >> s) & 1);
          issued_phase ^= 1u << s;
          mbar_wait(full0 + 8 * s, (uint32_t)((b / STAGES) & 1));
          SL_TR(f1);
          SL_TR_ADD(TR_FIX_WAIT, f1 - f0);
          const uint32_t sa = stage0 + s * SBYTES, sb = sa + A_B;
          constexpr int PER_ROW = (2 + NB) * 8; /* (2 A + NB B boxes) x 16-byte chunks */
          const int chunks = (fe - rv) * PER_ROW;
          for (int c = ft; c < chunks; c += 96) {
            const int row = rv + c / PER_ROW, box = (c % PER_ROW) / 8, ch = c % 8;
            const uint32_t addr =
                (box < 2 ? sa + box * IBOX : sb + (box - 2) * IBOX) + row * 128 + ch * 16;
            asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0)
                         : "memory");
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          named_bar(4, 96);
          if (ft == 0) mbar_arrive(fixed0 + 8 * s);
          SL_TR(f2);
          SL_TR_ADD(TR_FIX_WORK, f2 - f1);
        }
        blk += nk;
      }
      SL_TR_STORE(ft == 0);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1; /* which 64 rows of the tile */
    const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
    float acc[128];
    int s = 0;
    uint32_t phase = 0, fixed_phase = 0; /* bit s: parity of stage s's next "fixed" phase */
    /* Hands stage st back to the producer. */
    auto release = [&](int st) {
      if (lane == 0) mbar_arrive(empty0 + 8 * st);
    };
    SL_TR_DECL;
    SL_TR(c_begin);
#ifdef SLUICE_SM90_TRACE
    long long epi_end = c_begin;
    bool tr_first = true;
#endif
    /* AHEAD: the next tile, decoded while the current one's last k-block drains; the
     * accumulators are defined once here and then left to scale_d = 0 on a tile's first wgmma */
    Tile nx{0, 0, 0, 0, 0, 0, 0, 0}; /* the next tile; V_DYN: as the producer decoded it */
    auto next_of = [&](int nt) {
      if constexpr (DYN)
        nx = ring_get();
      else if constexpr (AHEAD)
        nx = decode_tile(nt);
      else
        nx.t = nt;
    };
    next_of(cid);
    if constexpr (AHEAD) {
#pragma unroll
      for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    }
    for (int t = nx.t; t < total_tiles; t = nx.t) {
      int j, m0, n0, nk, gs, ge, tok;
      if constexpr (AHEAD)
        j = nx.j, m0 = nx.m0, n0 = nx.n0, nk = nx.nk, gs = nx.gs, ge = nx.ge, tok = nx.tok;
      else
        decode(t, j, m0, n0, nk, gs, ge, tok);
      /* every path through a tile calls this once */
      auto decode_next = [&]() { next_of(t + ncl); };
      const bool fix = needs_fix(nk, ge - gs);
#ifdef SLUICE_SM90_TRACE
      tr_first = true;
#endif
      if (SKIP && !TGMM && cw == 1 && ge - m0 <= 64) {
        /* No row of this half is in the group: pass the stages back untouched (after the fixers,
         * who write into the last one, are done with it). */
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(full0 + 8 * s, phase);
          if (fix && kb == nk - 1) {
            mbar_wait(fixed0 + 8 * s, (fixed_phase >> s) & 1);
            fixed_phase ^= 1u << s;
          }
          release(s);
          if (++s == STAGES) s = 0, phase ^= 1;
        }
        decode_next();
        continue;
      }
      if constexpr (MERGE) {
        if (tok) {
          /* A merged tile (V_TM): this warpgroup's 64 output columns [n0 + 64 cw, +64) of the
           * rows [m0, m0 + tok), tok rounded up to NT; one m64nNTk16 per k16 step, the choice
           * made once per tile (a wgmma on a conditional path inside the loop: C7515). */
          auto merged = [&](auto nt_c) {
            constexpr int NT = decltype(nt_c)::value;
            int sd = 0;
            for (int kb = 0; kb < nk; ++kb) {
              mbar_wait(full0 + 8 * s, phase);
              const uint32_t sx = stage0 + s * SBYTES, sw = sx + 2 * A_BYTES;
              wgmma_fence();
#pragma unroll
              for (int kk = 0; kk < BKV / 16; ++kk) {
                const uint64_t da = make_desc(sw + cw * BOX_BYTES + kk * 2048, BOX_BYTES, 1024);
                const uint64_t db = make_desc(sx + kk * 32, 16, 1024);
                wgmma_tok<T, NT>(acc, da, db, kk == 0 ? sd : 1);
              }
              sd = 1;
              wgmma_commit();
              wgmma_wait1();
              fence_operands(acc);
              if (kb > 0) release(s == 0 ? STAGES - 1 : s - 1);
              if (++s == STAGES) s = 0, phase ^= 1;
            }
            decode_next();
            wgmma_wait0();
            fence_operands(acc);
            release(s == 0 ? STAGES - 1 : s - 1);
            /* Epilogue: stage the rows, TMA-store the whole 64-row boxes, copy the rest. */
            const uint32_t cbase = c_smem + cw * (C_BYTES / 2);
            if (lt == 0) bulk_wait_read0();
            named_bar(2 + cw, 128);
            if (a.out_dtype == SL_DTYPE_BF16)
              stage_tok_stsm<__nv_bfloat16, NT>(acc, cbase, warp, lane);
            else
              stage_tok_stsm<__half, NT>(acc, cbase, warp, lane);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_bar(2 + cw, 128);
            const int boxes = tok / 64, col = n0 + cw * 64;
            if (lt == 0) {
              for (int b = 0; b < boxes; ++b)
                tma_store_2d(&map_c, cbase + b * BOX_BYTES, col, m0 + 64 * b);
              bulk_commit();
            }
            if (col < a.n) {
              /* rows [64 boxes, tok): a TMA box would write past the group's end */
              for (int i = lt; i < (tok - 64 * boxes) * 8; i += 128) {
                const int r = 64 * boxes + (i >> 3), c = i & 7;
                uint32_t v0, v1, v2, v3;
                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                             : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                             : "r"(cbase + r * 128 + ((c ^ (r & 7)) << 4))
                             : "memory");
                uint4 *dst = reinterpret_cast<uint4 *>(
                    (char *)a.out + ((size_t)(m0 + r) * a.n + col + 8 * c) * 2);
                *dst = make_uint4(v0, v1, v2, v3);
              }
            }
          };
          if (((tok + 31) & ~31) == 160) /* (tok 129..192: merged_rows) */
            merged(std::integral_constant<int, 160>{});
          else
            merged(std::integral_constant<int, 192>{});
          continue;
        }
      }
      if constexpr (!AHEAD) {
#pragma unroll
        for (int i = 0; i < 128; ++i) acc[i] = 0.f;
      }
      /* AHEAD: the first k16 step of the tile ignores the accumulators' old values */
      int sd0 = AHEAD ? 0 : 1;
      if constexpr (SKIP && TGMM) {
        /* The last block issues only the k16 steps that hold rows of the group: the count is a
         * template argument chosen once per tile, and the fix-up wait is a select, because a
         * wgmma or a wgmma wait on a conditional path makes ptxas serialize them (C7517-C7520). */
        auto kblock = [&](auto nkk_c, auto last_c) {
          constexpr int NKK = decltype(nkk_c)::value;
          SL_TR(w0);
          mbar_wait(full0 + 8 * s, phase);
          SL_TR_FULL(w0);
          if constexpr (decltype(last_c)::value) {
            SL_TR(f0);
            mbar_wait(fix ? fixed0 + 8 * s : full0 + 8 * s, fix ? (fixed_phase >> s) & 1 : phase);
            fixed_phase ^= (fix ? 1u : 0u) << s;
            SL_TR(f1);
            SL_TR_ADD(TR_FULL, f1 - f0);
          }
          const uint32_t sa = stage0 + s * SBYTES, sb = sa + A_B;
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < NKK; ++kk) {
            const uint64_t da = make_desc(sa + cw * IBOX + kk * 2048, IBOX, 1024);
            const uint64_t db = make_desc(sb + kk * 2048, IBOX, 1024);
            wgmma_tile<T, 1, 1>(acc, da, db, kk == 0 ? sd0 : 1);
          }
          sd0 = 1;
          wgmma_commit();
          SL_TR(v0);
          wgmma_wait1();
          SL_TR_ADD(TR_WAIT1, clock64() - v0);
          fence_operands(acc);
        };
        auto release_prev = [&](int kb) {
          if (kb > 0) release(s == 0 ? STAGES - 1 : s - 1);
          if (++s == STAGES) s = 0, phase ^= 1;
        };
        auto mainloop = [&](auto nkl_c) {
          int kb = 0;
          for (; kb < nk - 1; ++kb) {
            kblock(std::integral_constant<int, BKV / 16>{}, std::false_type{});
            release_prev(kb);
          }
          kblock(nkl_c, std::true_type{});
          release_prev(kb);
        };
        if (nk > 0) {
          const int nkl = (ge - gs - (nk - 1) * BKV + 15) / 16; /* 1 .. BKV / 16 */
          if (nkl == 1)
            mainloop(std::integral_constant<int, 1>{});
          else if constexpr (BKV == 32) /* (no 3- or 4-step block to instantiate) */
            mainloop(std::integral_constant<int, 2>{});
          else if (nkl == 2)
            mainloop(std::integral_constant<int, 2>{});
          else if (nkl == 3)
            mainloop(std::integral_constant<int, 3>{});
          else
            mainloop(std::integral_constant<int, 4>{});
        }
        decode_next(); /* (AHEAD) while the last k-block drains */
        SL_TR(d0);
        wgmma_wait0(); /* unconditional (C7518) */
        fence_operands(acc);
        SL_TR(d1);
        SL_TR_ADD(TR_WAIT0, d1 - d0);
        if (nk > 0) release(s == 0 ? STAGES - 1 : s - 1);
      } else {
        for (int kb = 0; kb < nk; ++kb) {
          SL_TR(w0);
          mbar_wait(full0 + 8 * s, phase);
          SL_TR_FULL(w0);
          const uint32_t sa = stage0 + s * SBYTES, sb = sa + A_B;
          if (fix && kb == nk - 1) {
            mbar_wait(fixed0 + 8 * s, (fixed_phase >> s) & 1);
            fixed_phase ^= 1u << s;
          }
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < BKV / 16; ++kk) {
            uint64_t da, db;
            if (TGMM) {
              da = make_desc(sa + cw * BOX_BYTES + kk * 2048, BOX_BYTES, 1024);
              db = make_desc(sb + kk * 2048, BOX_BYTES, 1024);
            } else if (BKV == 32) {
              /* gmm V_K32: A's 32-column blocks are 64-byte rows (64B swizzle, 8-row groups 512
               * bytes apart); B as tgmm V_K32's, four 32x64 boxes IBOX apart */
              da = make_desc<true>(sa + cw * 64 * 64 + kk * 32, 16, 512);
              db = make_desc(sb + kk * 2048, IBOX, 1024);
            } else {
              da = make_desc(sa + cw * 64 * 128 + kk * 32, 16, 1024);
              db = TRANS_B ? make_desc(sb + kk * 32, 16, 1024)
                           : make_desc(sb + kk * 2048, BOX_BYTES, 1024);
            }
            constexpr int TA = TGMM ? 1 : 0, TB = TRANS_B ? 0 : 1;
            wgmma_tile<T, TA, TB>(acc, da, db, kk == 0 ? sd0 : 1);
          }
          sd0 = 1;
          wgmma_commit();
          if (WAIT1) {
            /* k-block kb stays in flight; kb-1 is done, so its stage goes back to the producer. */
            SL_TR(v0);
            wgmma_wait1();
            SL_TR_ADD(TR_WAIT1, clock64() - v0);
            fence_operands(acc);
            if (kb > 0) release(s == 0 ? STAGES - 1 : s - 1);
          } else {
            wgmma_wait0();
            fence_operands(acc);
            release(s);
          }
          if (++s == STAGES) s = 0, phase ^= 1;
        }
        decode_next(); /* (AHEAD) while the last k-block drains */
        /* AHEAD: the wait is unconditional, since the accumulators carry over to the next tile
         * (a wait on a conditional path before their next wgmma: C7518) */
        if (WAIT1 && (AHEAD || nk > 0)) {
          SL_TR(d0);
          wgmma_wait0();
          fence_operands(acc);
          SL_TR(d1);
          SL_TR_ADD(TR_WAIT0, d1 - d0);
          if (nk > 0) release(s == 0 ? STAGES - 1 : s - 1);
        }
      }
      SL_TR(e0);
      if constexpr (AHEAD && TGMM) { /* (gmm: nk > 0; a write here would cost C7518 there) */
        if (nk == 0) { /* tgmm, empty group: no wgmma defined this tile's zeros */
          /* (the volatile asm keeps this a branch: as plain stores the compiler turned it into
           * 128 selects that every tile ran after its last wgmma, ~1% of a 1,024-row tile) */
#pragma unroll
          for (int i = 0; i < 128; ++i) asm volatile("mov.b32 %0, 0;\n" : "=f"(acc[i]));
        }
      }

      /* Epilogue: thread holds rows warp*16 + lane/4 (+8), columns 8i + 2*(lane%4) (+1). */
      const int row_limit = TGMM ? a.k : ge;
      void *out =
          TGMM ? (void *)((char *)a.out + (size_t)j * a.k * a.n * dtype_bytes(a.out_dtype)) : a.out;
      if (TMA_C && (TGMM || m0 + cw * 64 + 64 <= ge)) {
        /* This warpgroup's 64x256 half: 4 boxes of 64x64, 128B-swizzled like the TMA map, staged
         * by stmatrix in one pass. An f32 output is twice the bytes: two passes of boxes of 64 rows
         * x 32 columns, the second after the first's store has read the buffer. */
        const uint32_t cbase = c_smem + cw * (C_BYTES / 2);
        auto pass = [&](auto p_c, auto f32_c) {
          constexpr int P = decltype(p_c)::value;
          constexpr bool F32 = decltype(f32_c)::value;
          constexpr int NP = F32 ? 2 : 1; /* passes */
          constexpr int PCOLS = TBN / NP, BOXC = F32 ? 32 : 64, NBOX = PCOLS / BOXC;
          constexpr int C0 = P * PCOLS / 8; /* the pass's first 8-column group */
          if (lt == 0) bulk_wait_read0(); /* the previous store has read the staging buffer */
          SL_TR(x0);
          SL_TR_ADD(TR_EPI_READ, x0 - e0);
          named_bar(2 + cw, 128);
          SL_TR(x1);
          SL_TR_ADD(TR_EPI_BAR, x1 - x0);
          if constexpr (F32) {
            stage_f32<C0, C0 + PCOLS / 8>(acc, cbase, warp, lane);
          } else {
            if (a.out_dtype == SL_DTYPE_BF16)
              stage_half_stsm<__nv_bfloat16>(acc, cbase, warp, lane);
            else
              stage_half_stsm<__half>(acc, cbase, warp, lane);
          }
          SL_TR(x2);
          SL_TR_ADD(TR_EPI_STAGE, x2 - x1);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          SL_TR(x3);
          SL_TR_ADD(TR_EPI_FENCE, x3 - x2);
          named_bar(2 + cw, 128);
          SL_TR(x4);
          SL_TR_ADD(TR_EPI_BAR, x4 - x3);
          if (lt == 0) {
            if (a.store_per_box) {
#pragma unroll
              for (int b = 0; b < NBOX; ++b) {
                const int c0 = n0 + P * PCOLS + BOXC * b;
                if (TGMM)
                  tma_store_3d(&map_c, cbase + b * BOX_BYTES, c0, m0 + cw * 64, j);
                else
                  tma_store_2d(&map_c, cbase + b * BOX_BYTES, c0, m0 + cw * 64);
              }
            } else {
              /* the half's NBOX boxes in one store: the output viewed with its columns split
               * into BOXC-wide blocks ({BOXC, rows, N/BOXC[, G]}, the launcher's map), so the box
               * {BOXC, 64, NBOX} is the staged boxes as they lie, one after another (session 22:
               * fewer TMA copies per tile) */
              const int cb = (n0 + P * PCOLS) / BOXC;
              if (TGMM)
                tma_store_4d(&map_cf, cbase, 0, m0 + cw * 64, cb, j);
              else
                tma_store_3d(&map_cf, cbase, 0, m0 + cw * 64, cb);
            }
            bulk_commit();
          }
        };
        using I0 = std::integral_constant<int, 0>;
        using I1 = std::integral_constant<int, 1>;
        /* (f32 only where the launcher allows it: tma_c_ok) */
        if (a.out_dtype == SL_DTYPE_F32) {
          pass(I0{}, std::true_type{});
          pass(I1{}, std::true_type{});
        } else {
          pass(I0{}, std::false_type{});
        }
      } else {
        store_half_regs(acc, out, a.out_dtype, a.n, m0 + cw * 64, n0, row_limit, warp, lane);
      }
#ifdef SLUICE_SM90_TRACE
      epi_end = clock64();
      SL_TR_ADD(TR_EPI, epi_end - e0);
      SL_TR_ADD(TR_TILES, 1);
      SL_TR_ADD(TR_BLOCKS, nk);
#endif
    }
    if (TMA_C && lt == 0) bulk_wait0(); /* stores done before the CTA's shared memory goes away */
    SL_TR(c_end);
    SL_TR_ADD(TR_CONS, c_end - c_begin);
    SL_TR_STORE(cw == 0 && lt == 0);
  }
#else
  (void)map_a, (void)map_b, (void)map_c, (void)map_cf, (void)a;
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

/* A tensor map with 128B swizzle (sw64: 64B) and zero fill out of bounds; dims[0] is the
 * contiguous one. */
static bool make_map(CUtensorMap *map, const void *ptr, sl_dtype dt, int rank, const uint64_t *dims,
                     const uint64_t *strides_bytes, const uint32_t *box, bool sw64 = false) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr) return false;
  cuuint64_t d[4], st[3];
  cuuint32_t b[4], es[4] = {1, 1, 1, 1};
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) st[i] = strides_bytes[i];
  CUresult r = encode(
      map,
      dt == SL_DTYPE_BF16  ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
      : dt == SL_DTYPE_F32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      (cuuint32_t)rank, const_cast<void *>(ptr), d, st, b, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
      sw64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

/* The staged epilogue and its TMA store (has_tma_c): 16-bit and f32 outputs, every output row a
 * multiple of 16 bytes, the output 16-byte aligned. */
static bool tma_c_ok(const GmmArgs &a) {
  const bool half = a.out_dtype == SL_DTYPE_BF16 || a.out_dtype == SL_DTYPE_F16;
  const bool f32 = a.out_dtype == SL_DTYPE_F32;
  return ((half && a.n % 8 == 0) || (f32 && a.n % 4 == 0)) && ((uintptr_t)a.out & 15) == 0;
}

template <typename T, bool TGMM, bool TRANS_B, int VARIANT>
static sl_status launch(const GmmArgs &a, int num_sms, cudaStream_t stream) {
  /* ma2, mb2 (V_TM): the same tensors as ma, mb with a merged tile's boxes (192 rows of lhs, 128
   * columns of rhs); otherwise unused copies */
  CUtensorMap ma, mb, mc, ma2, mb2, mcf;
  memset(&mc, 0, sizeof mc);
  memset(&mcf, 0, sizeof mcf);
  const uint64_t M = a.m, K = a.k, N = a.n, GL = a.num_local_groups;
  constexpr bool MERGE = has_merge(VARIANT);
  const uint32_t box64[3] = {64, 64, 1};
  bool ok;
  constexpr uint32_t BKV = bk_of(VARIANT); /* rows of a k-block */
  const uint32_t box_fa[3] = {64, BKV, 2}, box_fb[4] = {64, BKV, 4, 1};
  const uint32_t box_fb2[4] = {64, 64, 2, 1};
  /* the staged output's boxes: 128 bytes x 64 rows (64 16-bit or 32 f32 columns), stored box by
   * box through mc (V_TM's merged tiles always), or a warpgroup's 4 boxes in one store through mcf,
   * the output viewed with its columns split into blocks of a box's width ({BOXC, rows, N/BOXC[,
   * G]}), which needs N to be a multiple of that width */
  const uint64_t ob = dtype_bytes(a.out_dtype), boxc = 128 / ob;
  const uint32_t box_c[3] = {(uint32_t)boxc, 64, 1}, box_cf[4] = {(uint32_t)boxc, 64, 4, 1};
  const bool per_box = a.store_per_box || N % boxc != 0;
  if (TGMM) {
    if (has_fused_boxes(VARIANT)) {
      /* lhs [M, K] as {64, M, K/64}, rhs [M, N] as {64, M, N/64} (K, N % 64 == 0) */
      const uint64_t da[3] = {64, M, K / 64}, sa[2] = {K * 2, 128};
      const uint64_t db[3] = {64, M, N / 64}, sb[2] = {N * 2, 128};
      ok = make_map(&ma, a.lhs, a.in_dtype, 3, da, sa, box_fa) &&
           make_map(&mb, a.rhs, a.in_dtype, 3, db, sb, box_fb);
    } else {
      const uint64_t da[2] = {K, M}, sa[1] = {K * 2}, db[2] = {N, M}, sb[1] = {N * 2};
      ok = make_map(&ma, a.lhs, a.in_dtype, 2, da, sa, box64) &&
           make_map(&mb, a.rhs, a.in_dtype, 2, db, sb, box64);
    }
    if (has_tma_c(VARIANT)) {
      const uint64_t dc[3] = {N, K, GL}, sc[2] = {N * ob, K * N * ob};
      const uint64_t dcf[4] = {boxc, K, N / boxc, GL}, scf[3] = {N * ob, boxc * ob, K * N * ob};
      ok = ok && (per_box ? make_map(&mc, a.out, a.out_dtype, 3, dc, sc, box_c)
                          : make_map(&mcf, a.out, a.out_dtype, 4, dcf, scf, box_cf));
    }
  } else {
    const uint64_t da[2] = {K, M}, sa[1] = {K * 2};
    const uint32_t boxa[2] = {BKV, 128}; /* (V_K32: 64-byte rows, 64B swizzle) */
    const uint32_t boxa192[2] = {BKV, 192}; /* V_TM: a merged tile's rows */
    ok = make_map(&ma, a.lhs, a.in_dtype, 2, da, sa, boxa, BKV == 32);
    if (MERGE) ok = ok && make_map(&ma2, a.lhs, a.in_dtype, 2, da, sa, boxa192);
    if (TRANS_B) {
      const uint64_t db[3] = {K, N, GL}, sb[2] = {K * 2, N * K * 2};
      const uint32_t boxb[3] = {64, (uint32_t)BN, 1};
      ok = ok && make_map(&mb, a.rhs, a.in_dtype, 3, db, sb, boxb);
    } else if (has_fused_boxes(VARIANT)) {
      /* rhs [G, K, N] as {64, K, N/64, G} (resolve_variant: N % 64 == 0) */
      const uint64_t db[4] = {64, K, N / 64, GL}, sb[3] = {N * 2, 128, K * N * 2};
      ok = ok && make_map(&mb, a.rhs, a.in_dtype, 4, db, sb, box_fb);
      /* (V_TM: a merged tile's 128 columns) */
      if (MERGE) ok = ok && make_map(&mb2, a.rhs, a.in_dtype, 4, db, sb, box_fb2);
    } else {
      const uint64_t db[3] = {N, K, GL}, sb[2] = {N * 2, K * N * 2};
      ok = ok && make_map(&mb, a.rhs, a.in_dtype, 3, db, sb, box64);
    }
    if (has_tma_c(VARIANT)) {
      const uint64_t dc[2] = {N, M}, sc[1] = {N * ob};
      const uint64_t dcf[3] = {boxc, M, N / boxc}, scf[2] = {N * ob, boxc * ob};
      /* (V_TM's merged tiles store box by box whatever the rest does) */
      if (per_box || MERGE) ok = ok && make_map(&mc, a.out, a.out_dtype, 2, dc, sc, box_c);
      if (!per_box) ok = ok && make_map(&mcf, a.out, a.out_dtype, 3, dcf, scf, box_cf);
    }
  }
  if (!ok) return SL_STATUS_UNSUPPORTED; /* the caller falls back to the portable kernel */
  if (!MERGE) ma2 = ma, mb2 = mb;

  if (is_dyn(VARIANT)) { /* the tile counter starts at 0 in every launch */
    const cudaError_t e = cudaMemsetAsync(a.counter, 0, sizeof(int), stream);
    if (e != cudaSuccess)
      return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (sm90): tile counter: %s",
                          cudaGetErrorString(e));
  }
  auto kernel = gmm_kernel<T, TGMM, TRANS_B, VARIANT>;
  const int tiles_n = (a.n + BN - 1) / BN, tiles_k = (a.k + BM - 1) / BM;
  /* the table's units: tiles, with V_TM's merged ones */
  GmmArgs b;
  size_t smem;
  sl_status st = place_table(a, &b, (const void *)kernel, pipe_bytes(VARIANT), TGMM ? 0 : BM,
                             tiles_n, tiles_k * tiles_n, MERGE ? kTilesMerged : kTilesPlain,
                             stream, &smem, TGMM ? "tgmm (sm90)" : "gmm (sm90)");
  if (st != SL_STATUS_SUCCESS) return st;
  b.store_per_box = per_box;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (sm90): %zu bytes of shared memory: %s", smem,
                        cudaGetErrorString(err));
  /* tgmm's tiles (a grid no larger; gmm's grid is every SM) */
  const long long units = (long long)a.num_local_groups * tiles_k * tiles_n;
  long long grid = (!TGMM || units > num_sms) ? num_sms : units;
  if (grid < 1) grid = 1;
  kernel<<<(unsigned)grid, THREADS, smem, stream>>>(ma, mb, mc, ma2, mb2, mcf, b);
  err = cudaGetLastError();
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "gmm (sm90): launch failed: %s",
                        cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

template <typename T, int VARIANT>
static sl_status launch_v(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t s) {
  if constexpr (has_merge(VARIANT)) { /* gmm with an N-major B only (resolve_variant) */
    if (tgmm || a.transpose_rhs) return SL_STATUS_UNSUPPORTED;
    return launch<T, false, false, VARIANT>(a, num_sms, s);
  } else if constexpr (is_k32(VARIANT)) { /* N-major B only (resolve_variant) */
    if (!tgmm && a.transpose_rhs) return SL_STATUS_UNSUPPORTED;
    if (tgmm) return launch<T, true, false, VARIANT>(a, num_sms, s);
    return launch<T, false, false, VARIANT>(a, num_sms, s);
  } else {
    if (tgmm) return launch<T, true, false, VARIANT>(a, num_sms, s);
    return a.transpose_rhs ? launch<T, false, true, VARIANT>(a, num_sms, s)
                           : launch<T, false, false, VARIANT>(a, num_sms, s);
  }
}

/* The variant that runs: `variant` if given (-1: the default for these arguments), or
 * SL_STATUS_UNSUPPORTED's -2 when the given one cannot run them. */
/* The defaults for 16-bit outputs (dev/NOTES.md has the measurements behind them). V_TM's merged
 * tiles pay only over a long contraction: on the fine-grained experts' shapes (K 1024 and 256, 256
 * groups of ~512 rows) V_FB measured 1.00-1.08x of V_TM (session 18), so shorter K runs V_FB. */
constexpr int kDefaultGmm = V_TM, kDefaultTgmm = V_K32, kMergeMinK = 2048;

static int resolve_variant(const GmmArgs &a, bool tgmm, int variant) {
  if (variant < 0) {
    variant = tgmm ? kDefaultTgmm : a.k < kMergeMinK ? V_FB : kDefaultGmm;
    if (!tma_c_ok(a)) variant = V_BASE;
  }
  if (!is_variant(variant) || (has_tma_c(variant) && !tma_c_ok(a))) return -2;
  if (is_k32(variant) && !tgmm && a.transpose_rhs) variant = V_FB; /* K-major B: 128B rows */
  /* V_TM: gmm with an N-major B and a 16-bit output (its merged epilogue) */
  if (has_merge(variant) && tgmm) variant = kDefaultTgmm;
  if (has_merge(variant) && (a.transpose_rhs || a.out_dtype == SL_DTYPE_F32)) variant = V_FB;
  if (is_dyn(variant) && a.counter == nullptr) return V_AHS; /* no workspace for the counter */
  if (has_fused_boxes(variant) && (a.n % 64 || (tgmm && a.k % 64))) return V_DYN;
  return variant;
}

template <typename T>
static sl_status launch_t(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t s, int variant) {
  switch (variant) {
    case V_BASE: return launch_v<T, V_BASE>(a, tgmm, num_sms, s);
    case V_AHS: return launch_v<T, V_AHS>(a, tgmm, num_sms, s);
    case V_DYN: return launch_v<T, V_DYN>(a, tgmm, num_sms, s);
    case V_FB: return launch_v<T, V_FB>(a, tgmm, num_sms, s);
    case V_K32: return launch_v<T, V_K32>(a, tgmm, num_sms, s);
    case V_TM: return launch_v<T, V_TM>(a, tgmm, num_sms, s);
    default: return SL_STATUS_UNSUPPORTED; /* (resolve_variant returns only those above) */
  }
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
  variant = sm90::resolve_variant(a, tgmm, variant);
  if (variant < 0) return SL_STATUS_UNSUPPORTED;
  if (a.in_dtype == SL_DTYPE_BF16)
    return sm90::launch_t<__nv_bfloat16>(a, tgmm, num_sms, stream, variant);
  return sm90::launch_t<__half>(a, tgmm, num_sms, stream, variant);
}

} /* namespace sluice_cuda */
