/* Hopper (sm_90a) weight gradient, out[g] = lhs[rows of g]^T @ rhs[rows of g], on the persistent
 * pipeline of sm90_gmm_pipeline.cuh.
 *
 * A tile is (group j, 128 rows of out[j] = the K dimension, 256 columns), the contraction over the
 * group's rows in k-blocks of 32 rows, 6 stages of 24 KB: A = lhs^T (M-major) and B = rhs rows
 * (N-major), each tensor viewed as {64, M, cols/64} so that one TMA copy lands a stage's A (2
 * boxes) or B (4 boxes) as 128B-swizzled 64-wide boxes (needs K, N % 64 == 0). Against k-blocks of
 * 64 rows in 3 stages of 48 KB: the two consumer warpgroups still hold the last two blocks, now 64
 * rows instead of 128, so the producer looks 4 blocks of 32 ahead rather than one of 64, and a
 * group's last, partial block loads and waits for 32 rows rather than 64 (1.00-1.03x, ragged
 * sizes most).
 *
 * The last block of a group's contraction holds rows of the next group (or TMA zeros past M),
 * which would join the sum: warps 1-3 of the producer warpgroup zero them in shared memory as soon
 * as the block lands, off the consumers' path, and the consumers wait for a per-stage "fixed"
 * barrier on those blocks only. That block issues only the k16 steps that hold rows of the group,
 * ceil(rows/16) of 2, so only rows up to the next multiple of 16 need zeroing, none when the group
 * ends on one. An empty group's tiles store zeros.
 *
 * Tiles: a column block's row tiles one after another, so the CTAs at work together share one
 * strip of rhs and lhs's column blocks in turn (against gmm's panels: +0.1..+2.2%); every tile is
 * claimed in turn, groups of more than twice the mean rows first (build_group_table's order), since
 * a tile's cost grows with its group's rows (a stride lost 9-13% on skewed sizes). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "sm90_gmm_pipeline.cuh"

namespace sluice_cuda {
namespace sm90 {

template <typename T>
struct GmmWgrad : PipelineShape<32, 6> {
  static constexpr bool kWgrad = true, kMerged = false;
  static constexpr int kTableRows = 0 /* every group has tiles_k x tiles_n tiles */,
                       kTableLayout = kTilesPlain;

  static __host__ __device__ int strided_tiles(const GmmArgs &, int, int) { return 0; }
  /* the last block of a tile with nk blocks over `rows` rows holds rv valid rows; rows
   * [rv, ceil16(rv)) need zeroing before the wgmma reads them */
  static __host__ __device__ int fix_end(int rv) { return (rv + 15) & ~15; }
  static __device__ __forceinline__ bool needs_fix(int nk, int rows) {
    const int rv = rows - (nk - 1) * kBlockRows;
    return nk > 0 && rv < fix_end(rv);
  }

#ifdef SLUICE_SM90A_DEVICE
  static __device__ __forceinline__ void place(const GmmArgs &, int u, int, int tiles_k, Tile &d) {
    d.tok = 0;
    const int mt = u % tiles_k, nt = u / tiles_k;
    d.m0 = mt * BM;
    d.nk = (d.ge - d.gs + kBlockRows - 1) / kBlockRows;
    d.n0 = nt * BN;
  }

  static __device__ __forceinline__ void load_block(const CUtensorMap &map_a,
                                                    const CUtensorMap &map_b, uint32_t sa,
                                                    uint32_t sb, const Tile &d, int kb,
                                                    uint32_t full) {
    const int r0 = d.gs + kb * kBlockRows;
    tma_load_3d(sa, &map_a, 0, r0, d.m0 / 64, full);
    tma_load_3d(sb, &map_b, 0, r0, d.n0 / 64, full);
  }

  /* Warps 1-3 of the producer warpgroup (96 threads), over the same tiles as the consumers. */
  template <class Next>
  static __device__ __forceinline__ void zero_rows_past_groups(const Pipe &p, int total_tiles,
                                                               Next &&ring_get) {
    const int ft = threadIdx.x - 32;
    long long blk = 0;         /* k-blocks issued so far, as the producer counts them */
    uint32_t issued_phase = 0; /* bit s: parity of stage s's next "issued" phase */
    for (Tile d = ring_get(); d.t < total_tiles; d = ring_get()) {
      const int nk = d.nk, gs = d.gs, ge = d.ge;
      if (needs_fix(nk, ge - gs)) {
        const int rv = ge - gs - (nk - 1) * kBlockRows; /* valid rows of the last block */
        const int fe = fix_end(rv);
        const long long b = blk + nk - 1;
        const int s = (int)(b % kStages);
        /* Wait until the producer has issued block b: only then is stage s's current full phase
         * b's own (a parity wait further ahead could match an older phase). Neither barrier can
         * lap the fixers: stage s is not refilled until the consumers saw this block fixed. */
        mbar_wait(p.issued0 + 8 * s, (issued_phase >> s) & 1);
        issued_phase ^= 1u << s;
        mbar_wait(p.full0 + 8 * s, (uint32_t)((b / kStages) & 1));
        const uint32_t sa = p.stage0 + s * kStageBytes, sb = sa + 2 * kInBox;
        constexpr int PER_ROW = (2 + BN / 64) * 8; /* (2 A + 4 B boxes) x 16-byte chunks */
        const int chunks = (fe - rv) * PER_ROW;
        for (int c = ft; c < chunks; c += 96) {
          const int row = rv + c / PER_ROW, box = (c % PER_ROW) / 8, ch = c % 8;
          const uint32_t addr =
              (box < 2 ? sa + box * kInBox : sb + (box - 2) * kInBox) + row * 128 + ch * 16;
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0)
                       : "memory");
        }
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        named_bar(4, 96);
        if (ft == 0) mbar_arrive(p.fixed0 + 8 * s);
      }
      blk += nk;
    }
  }

  /* A tile's k-blocks. The last block issues only the k16 steps that hold rows of the group: the
   * count is a template argument chosen once per tile, and the fix-up wait is a select, because a
   * wgmma or a wgmma wait on a conditional path makes ptxas serialize them (C7517-C7520). */
  template <class Next, class Epilogue>
  static __device__ __forceinline__ void mainloop(const GmmArgs &, const CUtensorMap &,
                                                  Consumer<GmmWgrad> &c, const Tile &d,
                                                  float (&acc)[128], Next &&next,
                                                  Epilogue &&epilogue) {
    const int cw = c.cw, nk = d.nk, rows = d.ge - d.gs;
    const bool fix = needs_fix(nk, rows);
    int sd0 = 0; /* the first k16 step of the tile ignores the accumulators' old values */
    auto kblock = [&](auto nkk_c, auto last_c) {
      constexpr int NKK = decltype(nkk_c)::value;
      c.wait_full();
      if constexpr (decltype(last_c)::value) {
        const int s = c.s;
        mbar_wait(fix ? c.p.fixed0 + 8 * s : c.p.full0 + 8 * s,
                  fix ? (c.fixed_phase >> s) & 1 : c.phase);
        c.fixed_phase ^= (fix ? 1u : 0u) << s;
      }
      const uint32_t sa = c.stage(), sb = sa + 2 * kInBox;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < NKK; ++kk) {
        const uint64_t da = make_desc(sa + cw * kInBox + kk * 2048, kInBox, 1024);
        const uint64_t db = make_desc(sb + kk * 2048, kInBox, 1024);
        wgmma_tile<T, 1, 1>(acc, da, db, kk == 0 ? sd0 : 1);
      }
      sd0 = 1;
      wgmma_commit();
      wgmma_wait1();
      fence_operands(acc);
    };
    auto release_prev = [&](int kb) {
      if (kb > 0) c.release_prev();
      c.advance();
    };
    auto blocks = [&](auto nkl_c) {
      int kb = 0;
      for (; kb < nk - 1; ++kb) {
        kblock(std::integral_constant<int, kBlockRows / 16>{}, std::false_type{});
        release_prev(kb);
      }
      kblock(nkl_c, std::true_type{});
      release_prev(kb);
    };
    static_assert(kBlockRows == 32, "a last block of 1 or 2 k16 steps");
    if (nk > 0) {
      const int nkl = (rows - (nk - 1) * kBlockRows + 15) / 16; /* 1 or 2 */
      if (nkl == 1)
        blocks(std::integral_constant<int, 1>{});
      else
        blocks(std::integral_constant<int, 2>{});
    }
    drain(c, acc, nk, next);
    if (nk == 0) { /* an empty group: no wgmma defined this tile's zeros */
      /* (the volatile asm keeps this a branch: as plain stores the compiler turns it into 128
       * selects that every tile runs after its last wgmma, ~1% of a 1,024-row tile) */
#pragma unroll
      for (int i = 0; i < 128; ++i) asm volatile("mov.b32 %0, 0;\n" : "=f"(acc[i]));
    }
    epilogue();
  }

  static __device__ __forceinline__ bool whole_half(const Tile &, int) { return true; }
  static __device__ __forceinline__ void store_box(const CUtensorMap &map_c, uint32_t src, int c0,
                                                   int row0, int j) {
    tma_store_3d(&map_c, src, c0, row0, j);
  }
  static __device__ __forceinline__ void store_boxes(const CUtensorMap &map_cf, uint32_t src,
                                                     int cb, int row0, int j) {
    tma_store_4d(&map_cf, src, 0, row0, cb, j);
  }
  /* (never called: every half of a weight-gradient tile is whole) */
  static __device__ __forceinline__ void store_partial(const GmmArgs &, const Tile &,
                                                       const float (&)[128], int, int, int) {}
#endif /* SLUICE_SM90A_DEVICE */
};

template <typename T>
static sl_status launch_wgrad(const GmmArgs &a, int num_sms, cudaStream_t stream) {
  using Op = GmmWgrad<T>;
  /* maps: a, b, c (box by box), a2 and b2 (copies of a and b: the merged tiles' maps in gmm), cf
   * (a warpgroup's boxes in one store) */
  CUtensorMap m[6];
  const uint64_t M = a.m, K = a.k, N = a.n;
  /* lhs [M, K] as {64, M, K/64}, rhs [M, N] as {64, M, N/64} (K, N % 64 == 0: gmm_launch.cu) */
  const uint64_t da[3] = {64, M, K / 64}, sa[2] = {K * 2, 128};
  const uint64_t db[3] = {64, M, N / 64}, sb[2] = {N * 2, 128};
  const uint32_t box_a[3] = {64, Op::kBlockRows, 2}, box_b[3] = {64, Op::kBlockRows, 4};
  bool per_box;
  const bool ok = make_map(&m[0], a.lhs, a.in_dtype, 3, da, sa, box_a) &&
                  make_map(&m[1], a.rhs, a.in_dtype, 3, db, sb, box_b) &&
                  make_out_maps(a, true, false, Op::kBN, &m[2], &m[5], &per_box);
  if (!ok) return SL_STATUS_UNSUPPORTED; /* the caller runs the portable kernel */
  m[3] = m[0], m[4] = m[1];
  /* a grid no larger than the tiles */
  const long long units = (long long)a.num_local_groups * ((a.k + BM - 1) / BM) * ((a.n + BN - 1) / BN);
  return launch_persistent((const void *)gmm_persistent_kernel<Op>, Op::kPipeBytes, Op::kTableRows,
                           Op::kTableLayout, Op::kBN, a, per_box, m,
                           units > num_sms ? num_sms : units,
                           stream, "tgmm (sm90)");
}

} /* namespace sm90 */

sl_status sm90_gmm_wgrad_launch(const GmmArgs &a, int num_sms, cudaStream_t stream) {
  if (a.in_dtype == SL_DTYPE_BF16) return sm90::launch_wgrad<__nv_bfloat16>(a, num_sms, stream);
  return sm90::launch_wgrad<__half>(a, num_sms, stream);
}

} /* namespace sluice_cuda */
