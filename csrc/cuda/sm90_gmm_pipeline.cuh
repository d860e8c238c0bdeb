/* The persistent Hopper (sm_90a) grouped GEMM kernel that gmm (sm90_gmm_fwd.cu) and tgmm
 * (sm90_gmm_wgrad.cu) share: wgmma fed by TMA through an mbarrier pipeline. Each op is a struct of
 * static device functions and constants (an "Op") that this kernel template calls for what differs:
 * how a tile is placed in its group, which TMA copies fill a stage, how the consumers run a tile's
 * k-blocks, and where the output boxes go.
 *
 * One persistent CTA per SM, 3 warpgroups: warpgroup 0 produces (one thread issues the TMA loads;
 * in tgmm, warps 1-3 zero rows past a group's end), warpgroups 1 and 2 consume. Every CTA builds
 * the group table from the device's group_sizes at entry (gmm_common.cuh), so no tile mixes groups.
 * The consumers share each 128 x Op::kBN tile cooperatively (kBN 256, or 128 for gmm's narrow
 * tiles), 64 rows each (m64n256k16 or m64n128k16), keep one k-block
 * of wgmmas in flight (wait_group 1: a stage goes back one block later), and stage the epilogue in
 * shared memory (128B-swizzled, by stmatrix) for TMA bulk stores that overlap the next tile's
 * mainloop.
 *
 * Tiles are handed out at run time: the producer thread decodes each tile once and passes it to
 * the consumers (and fixers) through a small ring in shared memory guarded by mbarriers; the tiles
 * after a CTA's first are taken by a fixed stride up to Op::strided_tiles() and then claimed with
 * an atomic add on a counter in the workspace (zeroed by the launcher), so the tiles in flight stay
 * about one grid's worth of neighbours, and the CTAs that share an operand read it while it is in
 * L2 (with strides alone the CTAs drift apart and read operands from DRAM again: 6.0 GB of DRAM
 * reads where the inputs are 2.35 GB on dsv3-gateup gmm; claimed, 3.0 GB and +5%).
 *
 * Between tiles both consumer warpgroups leave the tensor pipe idle together, so the next tile is
 * taken from the ring while the last k-block drains, and a tile's first wgmma runs with
 * scale_d = 0 instead of on zeroed accumulators.
 *
 * Shared memory: Op::kStages stages of A (2 boxes of 64 x kBlockRows) and B (kBN / 64 such boxes),
 * 128B-swizzled and 1024-byte aligned; the 128x256 16-bit output tile for the TMA store (64 KB);
 * the barriers; the ring; then the group table when it fits (place_table). */
#ifndef SLUICE_CUDA_SM90_GMM_PIPELINE_CUH_
#define SLUICE_CUDA_SM90_GMM_PIPELINE_CUH_

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "../core/internal.h"
#include "gmm_common.cuh"
#include "sm90_gmm.cuh"

namespace sluice_cuda {
namespace sm90 {

constexpr int BM = 128, BN = 256, THREADS = 384; /* BN: the widest tile (an Op's kBN may be less) */
constexpr int BOX_BYTES = 64 * 64 * 2; /* one 64x64 swizzled 16-bit box */
constexpr int C_BYTES = BM * BN * 2;   /* the 16-bit output tile staged for the TMA store */
constexpr int RING = 4;                /* decoded tiles in flight from the producer to the others */

/* The pipeline's shape: k-blocks of BLOCK_ROWS (gmm: K columns; tgmm: contraction rows) in STAGES
 * stages, tiles of BM x TILE_N (256, or 128 for gmm's narrow tiles). */
template <int BLOCK_ROWS, int STAGES, int TILE_N = BN>
struct PipelineShape {
  static_assert(TILE_N == 256 || TILE_N == 128, "tiles are 256 or 128 columns wide");
  static constexpr int kBlockRows = BLOCK_ROWS, kStages = STAGES, kBN = TILE_N;
  static constexpr int kInBox = 64 * BLOCK_ROWS * 2; /* one 64-wide input box */
  /* 2 A boxes, kBN / 64 B boxes */
  static constexpr int kStageBytes = (BM + TILE_N) * BLOCK_ROWS * 2;
  static constexpr size_t kPipeBytes = 1024 /* alignment slack */ + (size_t)STAGES * kStageBytes +
                                       C_BYTES + 4 * STAGES * 8 +
                                       RING * (8 + 8 + 32) /* two barriers, a Tile a slot */;
};

/* A decoded tile: index, group, first row and column, k-blocks, the group's rows [gs, ge), and
 * gmm's merged rows (0 for a plain tile). A ring slot holds one. */
struct Tile {
  int t, j, m0, n0, nk, gs, ge, tok;
};

/* Shared-memory addresses of the pipeline: the first stage, the staged output, and per stage the
 * barriers full (TMA landed), empty (consumers done), fixed (tgmm: rows past the group zeroed) and
 * issued (tgmm: the producer issued a block that needs zeroing). */
struct Pipe {
  uint32_t stage0, c_smem, full0, empty0, fixed0, issued0;
};

#ifdef SLUICE_SM90A_DEVICE
/* A consumer warpgroup's place in the stage ring. */
template <class Op>
struct Consumer {
  Pipe p;
  int cw, lt, warp, lane; /* the tile's 64-row half, thread, warp and lane in the warpgroup */
  int s = 0;
  uint32_t phase = 0, fixed_phase = 0; /* fixed_phase bit s: stage s's next "fixed" parity */
  __device__ __forceinline__ uint32_t stage() const { return p.stage0 + s * Op::kStageBytes; }
  __device__ __forceinline__ void wait_full() const { mbar_wait(p.full0 + 8 * s, phase); }
  /* Hands stage st back to the producer. */
  __device__ __forceinline__ void release(int st) const {
    if (lane == 0) mbar_arrive(p.empty0 + 8 * st);
  }
  __device__ __forceinline__ void release_prev() const {
    release(s == 0 ? Op::kStages - 1 : s - 1);
  }
  __device__ __forceinline__ void advance() {
    if (++s == Op::kStages) s = 0, phase ^= 1;
  }
};

/* The end of a tile's mainloop, once its last k-block is issued: take the next tile while the
 * block drains, then wait for it (unconditionally, since the accumulators carry over to the next
 * tile: a wait on a conditional path before their next wgmma makes ptxas serialize, C7518) and
 * hand its stage back. */
template <class Op, class Next>
__device__ __forceinline__ void drain(Consumer<Op> &c, float (&acc)[128], int nk, Next &&next) {
  next();
  wgmma_wait0();
  fence_operands(acc);
  if (nk > 0) c.release_prev();
}
#endif

template <class Op>
__global__ void __launch_bounds__(THREADS, 1)
    gmm_persistent_kernel(const __grid_constant__ CUtensorMap map_a,
                          const __grid_constant__ CUtensorMap map_b,
                          const __grid_constant__ CUtensorMap map_c,
                          const __grid_constant__ CUtensorMap map_a2,
                          const __grid_constant__ CUtensorMap map_b2,
                          const __grid_constant__ CUtensorMap map_cf, GmmArgs a) {
#ifdef SLUICE_SM90A_DEVICE
  constexpr int STAGES = Op::kStages, SBYTES = Op::kStageBytes, A_B = 2 * Op::kInBox;
  constexpr bool TGMM = Op::kWgrad;
  const int cid = blockIdx.x, ncl = gridDim.x; /* this CTA's first tile, the CTA count */
  extern __shared__ __align__(1024) unsigned char smem_sm90[];
  unsigned char *smem_raw = smem_sm90;
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  Pipe pipe;
  pipe.stage0 = smem_u32(base);
  pipe.c_smem = pipe.stage0 + STAGES * SBYTES;
  uint64_t *bars = reinterpret_cast<uint64_t *>(base + STAGES * SBYTES + C_BYTES);
  pipe.full0 = smem_u32(bars), pipe.empty0 = pipe.full0 + STAGES * 8;
  pipe.fixed0 = pipe.empty0 + STAGES * 8, pipe.issued0 = pipe.fixed0 + STAGES * 8;
  const uint32_t full0 = pipe.full0, empty0 = pipe.empty0, issued0 = pipe.issued0;
  /* the ring: slot r holds a decoded tile (ring0 + 32r, a Tile), filled (tfull0 + 8r, the
   * producer arrives) and read by every consumer and fixer thread (tempty0 + 8r, each arrives) */
  const uint32_t tfull0 = issued0 + STAGES * 8, tempty0 = tfull0 + RING * 8, ring0 = tempty0 + RING * 8;

  /* units of work per group: tiles (tgmm: tiles_k x tiles_n of out[j] each) */
  const int tiles_n = (a.n + Op::kBN - 1) / Op::kBN, tiles_k = (a.k + BM - 1) / BM;
  int *tab = a.table;
  if (tab == nullptr) {
    tab = reinterpret_cast<int *>(smem_raw + Op::kPipeBytes);
    build_group_table(a, tab, Op::kTableRows, tiles_n, tiles_n * tiles_k, Op::kTableLayout);
  }
  const int GL = a.num_local_groups;
  const int *start = tab + kTableHeader, *end = start + GL, *tile_prefix = end + GL;
  /* tgmm: the groups in the order their tiles go out, long groups first (build_group_table) */
  const int *order = tab + (kTableHeader + 1 + 3 * (long long)GL);
  const int total_tiles = tab[2];
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8);       /* lane 0 of each consumer warp (both warpgroups) */
      mbar_init(pipe.fixed0 + 8 * s, 1);  /* tgmm: the fixer warps zeroed the rows past the group */
      mbar_init(issued0 + 8 * s, 1);      /* tgmm: the producer issued such a block into stage s */
    }
    for (int r = 0; r < RING; ++r) {
      mbar_init(tfull0 + 8 * r, 1);
      mbar_init(tempty0 + 8 * r, 32 * (8 + (TGMM ? 3 : 0))); /* consumer, fixer threads */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (!TGMM && !a.skip_unused) zero_outside_rows(a, tab[0], tab[1]);
  __syncthreads();

  /* The group of the tile decoded last: its tiles [g_lo, g_hi), index g_j and rows [g_gs, g_ge).
   * A CTA's tiles come mostly from one group after another, so most decodes need none of
   * find_group's dependent shared-memory loads, which the mainloop's wgmma reads and TMA writes
   * keep slow (tgmm's fixed cycles a tile 2,414 -> 1,972 on dsv3-gateup's K and N). */
  int g_lo = 0, g_hi = 0, g_j = 0, g_gs = 0, g_ge = 0;
  /* Tile t decoded (t >= total_tiles: the end, nothing else set). */
  auto decode_tile = [&](int t) {
    Tile d{t, 0, 0, 0, 0, 0, 0, 0};
    if (t < total_tiles) {
      if (t < g_lo || t >= g_hi) {
        const int r = find_group(tile_prefix, GL, t); /* tgmm: the r-th group of order[] */
        g_lo = tile_prefix[r], g_hi = tile_prefix[r + 1];
        g_j = TGMM ? order[r] : r;
        g_gs = start[g_j], g_ge = end[g_j];
      }
      d.j = g_j;
      d.gs = g_gs;
      d.ge = g_ge;
      Op::place(a, t - g_lo, tiles_n, tiles_k, d);
    }
    return d;
  };
  /* The next tile from the ring, as the producer decoded it (called by every consumer and fixer
   * thread, in tile order; t >= total_tiles ends the CTA's work). Each thread hands the slot back
   * itself after its read, so no read can meet the producer's next write to the slot. */
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
      /* publish a decoded tile into the ring; the tile after next is claimed early, so the
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
      int *const counter = a.counter; /* the tile counter, in the workspace */
      /* the tiles below `stat` go by the stride, the rest are claimed from `base` on (a claim past
       * the last tile ends the CTA's work) */
      const int stat = Op::strided_tiles(a, total_tiles, ncl);
      const int base = max(stat, ncl);
      auto after = [&](int t) { return t + ncl < stat ? t + ncl : base + atomicAdd(counter, 1); };
      Tile cur; /* the tile being loaded, decoded */
      auto next_tile = [&](int t) {
        t = claim;
        cur = decode_tile(t);
        ring_put(cur);
        if (t < total_tiles) claim = after(t);
        return t;
      };
      cur = decode_tile(cid);
      claim = after(cid);
      ring_put(cur);
      for (int t = cid; t < total_tiles; t = next_tile(t)) {
        const int nk = cur.nk;
        const bool fix = Op::needs_fix(nk, cur.ge - cur.gs);
        if constexpr (Op::kMerged) {
          if (cur.tok) {
            Op::load_merged(map_a2, map_b2, pipe, cur, s, phase);
            continue;
          }
        }
        for (int kb = 0; kb < nk; ++kb) {
          const uint32_t full = full0 + 8 * s;
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          mbar_expect_tx(full, SBYTES);
          const uint32_t sa = pipe.stage0 + s * SBYTES;
          Op::load_block(map_a, map_b, sa, sa + A_B, cur, kb, full);
          if (fix && kb == nk - 1) mbar_arrive(issued0 + 8 * s);
          if (++s == STAGES) s = 0, phase ^= 1;
        }
      }
    } else if constexpr (TGMM) {
      if (threadIdx.x >= 32) Op::zero_rows_past_groups(pipe, total_tiles, ring_get);
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    Consumer<Op> c;
    c.p = pipe;
    c.cw = wg - 1; /* which 64 rows of the tile */
    c.lt = threadIdx.x & 127, c.warp = c.lt >> 5, c.lane = c.lt & 31;
    const int cw = c.cw, lt = c.lt;
    float acc[128];
    /* the next tile; the accumulators are defined once here and then left to scale_d = 0 on a
     * tile's first wgmma */
    Tile nx = ring_get();
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
    for (int t = nx.t; t < total_tiles; t = nx.t) {
      const Tile d = nx;
      /* every path through a tile calls this once, while its last k-block drains */
      auto next = [&]() { nx = ring_get(); };
      /* Epilogue, called by Op::mainloop unless the tile is stored already or has nothing to
       * store (a path without it then goes straight to the next tile; a returned flag instead
       * merges the paths first, and every tile pays ~10 instructions for it). This warpgroup's
       * 64x256 half as 4 boxes of 64x64, 128B-swizzled like the TMA map, staged by stmatrix in
       * one pass and stored by TMA. An f32 output is twice the bytes: two passes of boxes of 64
       * rows x 32 columns, the second after the first's store has read the buffer. (A gmm half
       * that crosses its group's end: Op::store_partial.) */
      auto epilogue = [&]() {
        const int m0 = d.m0, n0 = d.n0, j = d.j;
        if (Op::whole_half(d, cw)) {
          const uint32_t cbase = pipe.c_smem + cw * (C_BYTES / 2);
          auto pass = [&](auto p_c, auto f32_c) {
            constexpr int P = decltype(p_c)::value;
            constexpr bool F32 = decltype(f32_c)::value;
            constexpr int NP = F32 ? 2 : 1; /* passes */
            constexpr int PCOLS = Op::kBN / NP, BOXC = F32 ? 32 : 64, NBOX = PCOLS / BOXC;
            constexpr int C0 = P * PCOLS / 8; /* the pass's first 8-column group */
            if (lt == 0) bulk_wait_read0(); /* the previous store has read the staging buffer */
            named_bar(2 + cw, 128);
            if constexpr (F32) {
              stage_f32<C0, C0 + PCOLS / 8, BOX_BYTES>(acc, cbase, c.warp, c.lane);
            } else {
              /* a kBN-wide tile's accumulators: the first kBN / 2 */
              const auto &an = *reinterpret_cast<const float(*)[Op::kBN / 2]>(&acc[0]);
              if (a.out_dtype == SL_DTYPE_BF16)
                stage_half_stsm<__nv_bfloat16, Op::kBN / 2, BOX_BYTES>(an, cbase, c.warp, c.lane);
              else
                stage_half_stsm<__half, Op::kBN / 2, BOX_BYTES>(an, cbase, c.warp, c.lane);
            }
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            named_bar(2 + cw, 128);
            if (lt == 0) {
              if (a.store_per_box) {
  #pragma unroll
                for (int b = 0; b < NBOX; ++b)
                  Op::store_box(map_c, cbase + b * BOX_BYTES, n0 + P * PCOLS + BOXC * b,
                                m0 + cw * 64, j);
              } else {
                /* the half's NBOX boxes in one store: the output viewed with its columns split
                 * into BOXC-wide blocks ({BOXC, rows, N/BOXC[, G]}, the launcher's map), so the box
                 * {BOXC, 64, NBOX} is the staged boxes as they lie, one after another */
                Op::store_boxes(map_cf, cbase, (n0 + P * PCOLS) / BOXC, m0 + cw * 64, j);
              }
              bulk_commit();
            }
          };
          using I0 = std::integral_constant<int, 0>;
          using I1 = std::integral_constant<int, 1>;
          /* (f32 only where the staged store can take it: sm90_gmm_staged_store_ok) */
          if (a.out_dtype == SL_DTYPE_F32) {
            pass(I0{}, std::true_type{});
            pass(I1{}, std::true_type{});
          } else {
            pass(I0{}, std::false_type{});
          }
        } else {
          Op::store_partial(a, d, acc, cw, c.warp, c.lane);
        }
      };
      Op::mainloop(a, map_c, c, d, acc, next, epilogue);
    }
    if (lt == 0) bulk_wait0(); /* stores done before the CTA's shared memory goes away */
  }
#else
  (void)map_a, (void)map_b, (void)map_c, (void)map_a2, (void)map_b2, (void)map_cf, (void)a;
#endif
}

/* cuTensorMapEncodeTiled through the runtime, so libsluice does not link libcuda. */
inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
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

/* A tensor map with 128B swizzle and zero fill out of bounds; dims[0] is the contiguous one.
 * False if it cannot be encoded (the caller then runs the portable kernel). */
inline bool make_map(CUtensorMap *map, const void *ptr, sl_dtype dt, int rank, const uint64_t *dims,
                     const uint64_t *strides_bytes, const uint32_t *box) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = encode_fn();
  if (encode == nullptr) return false;
  cuuint64_t d[4], st[3];
  cuuint32_t b[4], es[4] = {1, 1, 1, 1};
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) st[i] = strides_bytes[i];
  CUresult r = encode(map,
                      dt == SL_DTYPE_BF16     ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                      : dt == SL_DTYPE_F32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                      : dt == SL_DTYPE_F8E4M3 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                              : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                      (cuuint32_t)rank, const_cast<void *>(ptr), d, st, b, es,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

/* The staged output's maps: boxes of 128 bytes x 64 rows (64 16-bit or 32 f32 columns), stored
 * box by box through *box_map, or a warpgroup's tile_n / 64 boxes in one store through *fused_map, the
 * output viewed with its columns split into blocks of a box's width ({BOXC, rows, N/BOXC[, G]}),
 * which needs N to be a multiple of that width (*per_box says which one the kernel uses). tgmm's
 * maps have the group as one more dimension; gmm's merged tiles always store box by box
 * (need_box). */
inline bool make_out_maps(const GmmArgs &a, bool tgmm, bool need_box, int tile_n,
                          CUtensorMap *box_map, CUtensorMap *fused_map, bool *per_box) {
  memset(box_map, 0, sizeof *box_map);
  memset(fused_map, 0, sizeof *fused_map);
  const uint64_t M = a.m, K = a.k, N = a.n, GL = a.num_local_groups;
  const uint64_t ob = dtype_bytes(a.out_dtype), boxc = 128 / ob;
  const uint32_t box_c[3] = {(uint32_t)boxc, 64, 1}, box_cf[4] = {(uint32_t)boxc, 64, (uint32_t)tile_n / 64, 1};
  *per_box = N % boxc != 0;
  bool ok = true;
  if (tgmm) {
    const uint64_t dc[3] = {N, K, GL}, sc[2] = {N * ob, K * N * ob};
    const uint64_t dcf[4] = {boxc, K, N / boxc, GL}, scf[3] = {N * ob, boxc * ob, K * N * ob};
    ok = *per_box ? make_map(box_map, a.out, a.out_dtype, 3, dc, sc, box_c)
                  : make_map(fused_map, a.out, a.out_dtype, 4, dcf, scf, box_cf);
  } else {
    const uint64_t dc[2] = {N, M}, sc[1] = {N * ob};
    const uint64_t dcf[3] = {boxc, M, N / boxc}, scf[2] = {N * ob, boxc * ob};
    if (*per_box || need_box) ok = make_map(box_map, a.out, a.out_dtype, 2, dc, sc, box_c);
    if (!*per_box) ok = ok && make_map(fused_map, a.out, a.out_dtype, 3, dcf, scf, box_cf);
  }
  return ok;
}

/* Zeroes the tile counter (it starts at 0 in every launch), places the group table (place_table:
 * table_rows and layout as build_group_table's), and launches `kernel` (a gmm_persistent_kernel)
 * on `grid` CTAs with the six maps (a, b, c, a2, b2, cf). */
inline sl_status launch_persistent(const void *kernel, size_t pipe_bytes, int table_rows,
                                   int layout, int tile_n, const GmmArgs &a, bool per_box,
                                   const CUtensorMap (&maps)[6], long long grid,
                                   cudaStream_t stream, const char *who) {
  cudaError_t err = cudaMemsetAsync(a.counter, 0, sizeof(int), stream);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: tile counter: %s", who,
                        cudaGetErrorString(err));
  const int tiles_n = (a.n + tile_n - 1) / tile_n, tiles_k = (a.k + BM - 1) / BM;
  GmmArgs b;
  size_t smem;
  sl_status st = place_table(a, &b, kernel, pipe_bytes, table_rows, tiles_n, tiles_k * tiles_n,
                             layout, stream, &smem, who);
  if (st != SL_STATUS_SUCCESS) return st;
  b.store_per_box = per_box;
  if (grid < 1) grid = 1;
  void *args[7] = {(void *)&maps[0], (void *)&maps[1], (void *)&maps[2], (void *)&maps[3],
                   (void *)&maps[4], (void *)&maps[5], (void *)&b};
  err = cudaLaunchKernel(kernel, dim3((unsigned)grid), dim3(THREADS), args, smem, stream);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: launch failed: %s", who,
                        cudaGetErrorString(err));
  return SL_STATUS_SUCCESS;
}

} /* namespace sm90 */
} /* namespace sluice_cuda */

#endif /* SLUICE_CUDA_SM90_GMM_PIPELINE_CUH_ */
