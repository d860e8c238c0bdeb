/* Hopper (sm_90a) forward grouped GEMM, out[rows of g] = lhs[rows of g] @ rhs[g], on the
 * persistent pipeline of sm90_gmm_pipeline.cuh.
 *
 * A tile is (group j, 128 rows of j, 256 columns), in k-blocks of 64 K columns, 3 stages of 48 KB;
 * narrow tiles (TILE_N 128, for problems of few tiles: gmm_launch.cu) take 128 columns in 4 stages
 * of 32 KB.
 * A = lhs rows (K-major, one 64x128 box); B = rhs[j], N-major through a 4-d view {64, K, N/64,
 * G_local} whose box {64, 64, 4, 1} lands as four 128B-swizzled 64x64 boxes in one TMA copy (needs
 * N % 64 == 0), or K-major ([G_local, N, K], transpose_rhs) as one 64x256 box. A tile may load rows
 * of the next group; the epilogue stores only this group's rows (a half that crosses the group's
 * end from registers, masked). K and M edges are zero-filled by TMA bounds. A tile with <= 64 rows
 * of its group leaves consumer warpgroup 2 idle: it only passes the stages back.
 *
 * Merged edge tiles (kernel kGmmMerged: N-major B, 16-bit output): a group whose last row tile has
 * r <= 64 rows, after a full one, takes its last 128 + r rows (129..192, merged_rows) as two
 * transposed tiles per 256 columns instead of a full tile and an edge tile: 128 output columns
 * each (one m64 half per warpgroup) by the rows as the wgmma's N (160 or 192: the rows rounded up
 * to 32), A = the weights' 64x64 boxes read MN-major, B = the lhs rows K-major. The edge tile
 * computes its few rows against a whole 256-column strip of the weights at ~0.9 of a full tile's
 * cost; a merged tile of 192 rows costs ~0.91 of a full tile, so the two do the work of 1.0-1.5
 * full tiles where the plain kernel spends ~1.9. It pays only over a long contraction: at K 1024
 * and 256 (256 groups of ~512 rows) the plain kernel measured 1.00-1.08x of it, hence
 * kMergeMinK (gmm_launch.cu). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "sm90_gmm_pipeline.cuh"

namespace sluice_cuda {
namespace sm90 {


#ifdef SLUICE_SM90A_DEVICE
/* Merged tiles: D[64 columns of the output, NT rows] += W^T (MN-major) * x^T (K-major), on the
 * first NT / 2 accumulators. */
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

/* A merged tile's accumulators (this warpgroup's 64 output columns x NT rows; thread holds
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

#endif /* SLUICE_SM90A_DEVICE */

/* The forward op of the persistent kernel: T the input type, TRANS_B a K-major rhs, MERGED the
 * merged edge tiles (N-major rhs, 16-bit output), TILE_N the tile's columns: 256, or 128 (narrow
 * tiles, each warpgroup m64n128; their 32 KB stages leave room for 4) where 256-wide tiles would
 * fill the GPU in too few waves (gmm_launch.cu). */
template <typename T, bool TRANS_B, bool MERGED, int TILE_N = BN>
struct GmmFwd : PipelineShape<64, TILE_N == BN ? 3 : 4, TILE_N> {
  using Shape = PipelineShape<64, TILE_N == BN ? 3 : 4, TILE_N>;
  using Shape::kBlockRows, Shape::kBN, Shape::kInBox, Shape::kStageBytes, Shape::kStages;
  static_assert(!MERGED || !TRANS_B, "merged tiles read an N-major rhs");
  static_assert(!MERGED || TILE_N == BN, "merged tiles are 256 columns wide");
  static constexpr bool kWgrad = false, kMerged = MERGED;
  static constexpr int kTableRows = BM, kTableLayout = MERGED ? kTilesMerged : kTilesPlain;

  /* gmm's tile order: every tile but those of the last kClaimedWaves waves goes by a fixed stride
   * (CTA c takes c, c + grid, ...) and only those are claimed in turn. Neighbouring CTAs then work
   * in step on neighbouring tiles (a column block's row tiles share the weights' strip, a group's
   * column blocks its rows), and the L2 serves their concurrent requests for the same lines once
   * (qwen3: L2 sectors requested by the SMs -38%, dsv3-down -27%; qwen3 +2.5..+5.5%). The claimed
   * last waves absorb tiles of unequal cost (ragged edges, merged tiles) and SMs that do not run at
   * one speed: the whole kernel by stride was 1-5% slower on ragged sizes. Two claimed waves are
   * as good as six. */
  static constexpr int kClaimedWaves = 2;
  /* ...except where K >= kClaimAllK: there every tile is claimed. On dsv3-gateup (K 7168) the stride
   * cost 1.3-4.9% on H100 and H200; at K 2048 and below it gained on both, mixtral (K 4096) level. */
  static constexpr int kClaimAllK = 4096;

  static __host__ __device__ int strided_tiles(const GmmArgs &a, int total_tiles, int ncl) {
    return a.k >= kClaimAllK ? 0 : ncl * max(0, total_tiles / ncl - kClaimedWaves);
  }
  static __device__ __forceinline__ bool needs_fix(int, int) { return false; }

#ifdef SLUICE_SM90A_DEVICE
  /* Unit u of the group (d.gs, d.ge set): row tiles in panels of 16 (panel_raster); with merged
   * edges, the last panel also holds the two merged tiles of each column block, after its row
   * tiles, so they share the weights' strip with them. */
  static __device__ __forceinline__ void place(const GmmArgs &a, int u, int tiles_n, int,
                                               Tile &d) {
    const int gs = d.gs, ge = d.ge;
    const int tm = (ge - gs + BM - 1) / BM; /* row tiles of the group */
    int mt, nt;
    d.tok = 0;
    if (MERGED && merged_rows(ge - gs)) {
      /* full row tiles tmn, in panels of 16; the last panel's height hl is 0..16 */
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
          d.m0 = gs + tmn * BM;
          d.n0 = nt * BN + (q - hl) * (BN / 2);
          d.nk = (a.k + kBlockRows - 1) / kBlockRows;
          d.tok = ge - d.m0;
          return;
        }
      }
    } else {
      panel_raster(u, tm, tiles_n, mt, nt);
    }
    d.m0 = gs + mt * BM;
    d.nk = (a.k + kBlockRows - 1) / kBlockRows;
    d.n0 = nt * kBN;
  }

  static __device__ __forceinline__ void load_block(const CUtensorMap &map_a,
                                                    const CUtensorMap &map_b, uint32_t sa,
                                                    uint32_t sb, const Tile &d, int kb,
                                                    uint32_t full) {
    const int k0 = kb * kBlockRows;
    tma_load_2d(sa, &map_a, k0, d.m0, full);
    if (TRANS_B)
      tma_load_3d(sb, &map_b, k0, d.n0, d.j, full);
    else
      tma_load_4d(sb, &map_b, 0, k0, d.n0 / 64, d.j, full);
  }

  /* A merged tile's stages: lhs rows [m0, m0 + 192) in one box (rows past the tile's 129..192 are
   * loaded, and their columns of the accumulator never stored; TMA zero-fills past M), the
   * weights' 128 columns [n0, n0 + 128) as two 64x64 boxes after the 32 KB that the rows may
   * take. */
  static __device__ __forceinline__ void load_merged(const CUtensorMap &map_a2,
                                                     const CUtensorMap &map_b2, const Pipe &p,
                                                     const Tile &d, int &s, uint32_t &phase) {
    constexpr int A_BYTES = BM * kBlockRows * 2;
    const uint32_t bytes = 192 * kBlockRows * 2 + A_BYTES;
    for (int kb = 0; kb < d.nk; ++kb) {
      const uint32_t full = p.full0 + 8 * s;
      mbar_wait(p.empty0 + 8 * s, phase ^ 1);
      mbar_expect_tx(full, bytes);
      const uint32_t sa = p.stage0 + s * kStageBytes;
      const int k0 = kb * kBlockRows;
      tma_load_2d(sa, &map_a2, k0, d.m0, full);
      tma_load_4d(sa + 2 * A_BYTES, &map_b2, 0, k0, d.n0 / 64, d.j, full);
      if (++s == kStages) s = 0, phase ^= 1;
    }
  }

  /* A merged tile: this warpgroup's 64 output columns [n0 + 64 cw, +64) of the rows
   * [m0, m0 + tok), tok rounded up to NT; one m64nNTk16 per k16 step, the choice made once per
   * tile (a wgmma on a conditional path inside the loop: C7515). Its epilogue stages the
   * transposed accumulators with stmatrix.trans, stores the whole 64-row boxes by TMA and the last
   * rows (which a TMA box would write past the group's end) with 16-byte stores. */
  template <int NT, class Next>
  static __device__ __forceinline__ void merged(const GmmArgs &a, const CUtensorMap &map_c,
                                                Consumer<GmmFwd> &c, const Tile &d,
                                                float (&acc)[128], Next &&next) {
    constexpr int A_BYTES = BM * kBlockRows * 2;
    const int cw = c.cw, lt = c.lt, m0 = d.m0, nk = d.nk, tok = d.tok;
    int sd = 0;
    for (int kb = 0; kb < nk; ++kb) {
      c.wait_full();
      const uint32_t sx = c.stage(), sw = sx + 2 * A_BYTES;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockRows / 16; ++kk) {
        const uint64_t da = make_desc(sw + cw * BOX_BYTES + kk * 2048, BOX_BYTES, 1024);
        const uint64_t db = make_desc(sx + kk * 32, 16, 1024);
        wgmma_tok<T, NT>(acc, da, db, kk == 0 ? sd : 1);
      }
      sd = 1;
      wgmma_commit();
      wgmma_wait1();
      fence_operands(acc);
      if (kb > 0) c.release_prev();
      c.advance();
    }
    next();
    wgmma_wait0();
    fence_operands(acc);
    c.release_prev();
    const uint32_t cbase = c.p.c_smem + cw * (C_BYTES / 2);
    if (lt == 0) bulk_wait_read0();
    named_bar(2 + cw, 128);
    if (a.out_dtype == SL_DTYPE_BF16)
      stage_tok_stsm<__nv_bfloat16, NT>(acc, cbase, c.warp, c.lane);
    else
      stage_tok_stsm<__half, NT>(acc, cbase, c.warp, c.lane);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_bar(2 + cw, 128);
    const int boxes = tok / 64, col = d.n0 + cw * 64;
    if (lt == 0) {
      for (int b = 0; b < boxes; ++b) tma_store_2d(&map_c, cbase + b * BOX_BYTES, col, m0 + 64 * b);
      bulk_commit();
    }
    if (col < a.n) {
      /* rows [64 boxes, tok): a TMA box would write past the group's end */
      for (int i = lt; i < (tok - 64 * boxes) * 8; i += 128) {
        const int r = 64 * boxes + (i >> 3), ch = i & 7;
        uint32_t v0, v1, v2, v3;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                     : "r"(cbase + r * 128 + ((ch ^ (r & 7)) << 4))
                     : "memory");
        uint4 *dst =
            reinterpret_cast<uint4 *>((char *)a.out + ((size_t)(m0 + r) * a.n + col + 8 * ch) * 2);
        *dst = make_uint4(v0, v1, v2, v3);
      }
    }
  }

  /* A tile's k-blocks, then the staged epilogue where one is left to run. */
  template <class Next, class Epilogue>
  static __device__ __forceinline__ void mainloop(const GmmArgs &a, const CUtensorMap &map_c,
                                                  Consumer<GmmFwd> &c, const Tile &d,
                                                  float (&acc)[128], Next &&next,
                                                  Epilogue &&epilogue) {
    const int cw = c.cw, nk = d.nk;
    if (cw == 1 && d.ge - d.m0 <= 64) {
      /* No row of this half is in the group: pass the stages back untouched. */
      for (int kb = 0; kb < nk; ++kb) {
        c.wait_full();
        c.release(c.s);
        c.advance();
      }
      next();
      return;
    }
    if constexpr (MERGED) {
      if (d.tok) {
        if (((d.tok + 31) & ~31) == 160) /* (tok 129..192: merged_rows) */
          merged<160>(a, map_c, c, d, acc, next);
        else
          merged<192>(a, map_c, c, d, acc, next);
        return;
      }
    }
    int sd0 = 0; /* the first k16 step of the tile ignores the accumulators' old values */
    for (int kb = 0; kb < nk; ++kb) {
      c.wait_full();
      const uint32_t sa = c.stage(), sb = sa + 2 * kInBox;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockRows / 16; ++kk) {
        const uint64_t da = make_desc(sa + cw * 64 * 128 + kk * 32, 16, 1024);
        const uint64_t db = TRANS_B ? make_desc(sb + kk * 32, 16, 1024)
                                    : make_desc(sb + kk * 2048, BOX_BYTES, 1024);
        wgmma_tile<T, 0, TRANS_B ? 0 : 1, kBN>(acc, da, db, kk == 0 ? sd0 : 1);
      }
      sd0 = 1;
      wgmma_commit();
      /* k-block kb stays in flight; kb-1 is done, so its stage goes back to the producer. */
      wgmma_wait1();
      fence_operands(acc);
      if (kb > 0) c.release_prev();
      c.advance();
    }
    drain(c, acc, nk, next);
    epilogue();
  }

  static __device__ __forceinline__ bool whole_half(const Tile &d, int cw) {
    return d.m0 + cw * 64 + 64 <= d.ge;
  }
  static __device__ __forceinline__ void store_box(const CUtensorMap &map_c, uint32_t src, int c0,
                                                   int row0, int) {
    tma_store_2d(&map_c, src, c0, row0);
  }
  static __device__ __forceinline__ void store_boxes(const CUtensorMap &map_cf, uint32_t src,
                                                     int cb, int row0, int) {
    tma_store_3d(&map_cf, src, 0, row0, cb);
  }
  static __device__ __forceinline__ void store_partial(const GmmArgs &a, const Tile &d,
                                                       const float (&acc)[128], int cw, int warp,
                                                       int lane) {
    const auto &an = *reinterpret_cast<const float(*)[kBN / 2]>(&acc[0]);
    store_half_regs(an, a.out, a.out_dtype, a.n, d.m0 + cw * 64, d.n0, d.ge, warp, lane);
  }
#endif /* SLUICE_SM90A_DEVICE */
};

template <typename T, bool TRANS_B, bool MERGED, int TILE_N = BN>
static sl_status launch_fwd(const GmmArgs &a, int num_sms, cudaStream_t stream) {
  using Op = GmmFwd<T, TRANS_B, MERGED, TILE_N>;
  /* maps: a, b, c (box by box), a2 and b2 (merged tiles: 192 rows of lhs, 128 columns of rhs;
   * otherwise copies of a and b), cf (a warpgroup's boxes in one store) */
  CUtensorMap m[6];
  const uint64_t M = a.m, K = a.k, N = a.n, GL = a.num_local_groups;
  const uint64_t da[2] = {K, M}, sa[1] = {K * 2};
  const uint32_t boxa[2] = {64, 128}, boxa192[2] = {64, 192};
  bool ok = make_map(&m[0], a.lhs, a.in_dtype, 2, da, sa, boxa);
  if (MERGED) ok = ok && make_map(&m[3], a.lhs, a.in_dtype, 2, da, sa, boxa192);
  if (TRANS_B) {
    const uint64_t db[3] = {K, N, GL}, sb[2] = {K * 2, N * K * 2};
    const uint32_t boxb[3] = {64, (uint32_t)TILE_N, 1};
    ok = ok && make_map(&m[1], a.rhs, a.in_dtype, 3, db, sb, boxb);
  } else {
    /* rhs [G, K, N] as {64, K, N/64, G} (N % 64 == 0: gmm_launch.cu) */
    const uint64_t db[4] = {64, K, N / 64, GL}, sb[3] = {N * 2, 128, K * N * 2};
    const uint32_t boxb[4] = {64, 64, TILE_N / 64, 1}, boxb2[4] = {64, 64, 2, 1};
    ok = ok && make_map(&m[1], a.rhs, a.in_dtype, 4, db, sb, boxb);
    if (MERGED) ok = ok && make_map(&m[4], a.rhs, a.in_dtype, 4, db, sb, boxb2);
  }
  bool per_box;
  ok = ok && make_out_maps(a, false, MERGED, TILE_N, &m[2], &m[5], &per_box);
  if (!ok) return SL_STATUS_UNSUPPORTED; /* the caller runs the portable kernel */
  if (!MERGED) m[3] = m[0], m[4] = m[1];
  return launch_persistent((const void *)gmm_persistent_kernel<Op>, Op::kPipeBytes, Op::kTableRows,
                           Op::kTableLayout, TILE_N, a, per_box, m, num_sms, stream, "gmm (sm90)");
}

template <typename T>
static sl_status launch_fwd_t(const GmmArgs &a, GmmTiles tiles, int num_sms, cudaStream_t stream) {
  if (tiles == kGmmTilesNarrow)
    return a.transpose_rhs ? launch_fwd<T, true, false, 128>(a, num_sms, stream)
                           : launch_fwd<T, false, false, 128>(a, num_sms, stream);
  if (a.transpose_rhs) return launch_fwd<T, true, false>(a, num_sms, stream);
  return tiles == kGmmTilesMerged ? launch_fwd<T, false, true>(a, num_sms, stream)
                                  : launch_fwd<T, false, false>(a, num_sms, stream);
}

} /* namespace sm90 */

sl_status sm90_gmm_fwd_launch(const GmmArgs &a, GmmTiles tiles, int num_sms,
                              cudaStream_t stream) {
  if (a.in_dtype == SL_DTYPE_BF16)
    return sm90::launch_fwd_t<__nv_bfloat16>(a, tiles, num_sms, stream);
  return sm90::launch_fwd_t<__half>(a, tiles, num_sms, stream);
}

} /* namespace sluice_cuda */
