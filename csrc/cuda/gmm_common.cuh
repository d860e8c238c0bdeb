/* Shared pieces of the CUDA grouped GEMM kernels: the argument block every launcher takes, and the
 * device-side group table (group starts, ends and a prefix of tile counts) that each kernel builds
 * from the device's group_sizes with no host synchronisation.
 *
 * Clamping (sluice.h): negative sizes count as 0, row ranges are clamped to [0, M), the offset is
 * clamped to [0, G - G_local]. Every kernel reads group rows only through this table, so no device
 * value can make it touch memory out of bounds. */
#ifndef SLUICE_CUDA_GMM_COMMON_CUH_
#define SLUICE_CUDA_GMM_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sluice.h"

namespace sluice_cuda {

/* One problem of a batch, as the launchers see it. */
struct GmmArgs {
  const void *lhs;
  const void *rhs;
  void *out;
  const int32_t *group_sizes;  /* device int32 [num_groups] */
  const int32_t *group_offset; /* device int32 [1] or NULL */
  int *table;                  /* the group table in global memory (the workspace), or NULL: each
                                * CTA builds it in shared memory (launchers: place_table) */
  int *counter;                /* device int in the workspace: the sm90 kernels' tile counter */
  int m, k, n;
  int num_groups, num_local_groups;
  sl_dtype in_dtype, out_dtype;
  int transpose_rhs;     /* gmm only */
  int skip_unused = 0;   /* gmm: leave the rows outside the local groups unwritten */
  int store_per_box = 0; /* sm90: the staged output leaves in one TMA store per 64-row x 128-byte
                          * box instead of one per warpgroup's 64-row half (set by the launcher
                          * where n is not a multiple of the box's columns) */
};

/* Group table layout, in ints: [lo, hi, total_tiles, pad, start[GL], end[GL], tile_prefix[GL+1],
 * order[GL]]. Rows [lo, hi) of lhs belong to local groups; gmm zeroes every other row of out.
 * order (tgmm only): the local groups in the order in which sm90 hands out their tiles, those
 * of more than twice the mean rows first (build_group_table). */
constexpr int kTableHeader = 4;
__host__ __device__ inline int table_ints(int num_local_groups) {
  return kTableHeader + 4 * num_local_groups + 1;
}

/* sm90 gmm's merged edge tiles (sm90_gmm_fwd.cu): a group of s rows whose last row tile is partial
 * with at most 64 rows, and that has a full tile before it, takes its last 128 + s % 128 rows
 * (129..192) as merged tiles, two per 256-column block (128 output columns each, the rows as the
 * wgmma's N); 0 if it does not. (Merging 65..96 rows too, as 224-row tiles, measured no better.) */
__host__ __device__ inline int merged_rows(long long s) {
  const int r = (int)(s % 128);
  return s > 128 && r > 0 && r <= 64 ? 128 + r : 0;
}
/* Units of work of a gmm group of s rows with merged edge tiles: its full row tiles but the last
 * one, then the two merged tiles of each column block; other groups as plain tiles. */
__host__ __device__ inline long long merged_units(long long s, long long tiles_n) {
  return merged_rows(s) ? (s / 128 + 1) * tiles_n : (s + 127) / 128 * tiles_n;
}

/* How build_group_table counts a gmm group's units: tiles, or tiles with merged edges (bm 128). */
enum TableLayout { kTilesPlain = 0, kTilesMerged = 2 };

#ifdef __CUDACC__
/* Block-wide inclusive scan of one int64 per thread (blockDim.x a multiple of 32, <= 1024). */
__device__ inline long long block_inclusive_scan(long long v, long long *warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    long long t = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += t;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      long long t = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += t;
    }
    if (lane < nwarps) warp_sums[lane] = w;
  }
  __syncthreads();
  if (warp > 0) v += warp_sums[warp - 1];
  __syncthreads(); /* warp_sums is reused by the next call */
  return v;
}

/* Builds the group table in `tab` (smem or global), called by every thread of a block.
 * gmm: a local group of s rows has ceil(s / bm) * tiles_n tiles (merged: merged_units); tgmm
 * (bm == 0): every local group has tiles_per_group tiles (an empty group still writes its zero
 * tile). */
__device__ inline void build_group_table(const GmmArgs &a, int *tab, int bm, int tiles_n,
                                         int tiles_per_group, int layout = kTilesPlain) {
  __shared__ long long warp_sums[32];
  const int G = a.num_groups, GL = a.num_local_groups;
  const long long M = a.m;
  int off = a.group_offset ? a.group_offset[0] : 0;
  off = min(max(off, 0), G - GL);
  int *start = tab + kTableHeader, *end = start + GL, *tile_prefix = end + GL;

  /* Exclusive prefix of the clamped sizes over all G groups, in chunks of blockDim.x. */
  long long carry = 0;
  for (int base = 0; base < G; base += blockDim.x) {
    const int g = base + threadIdx.x;
    long long s = 0;
    if (g < G) s = max(a.group_sizes[g], 0);
    long long incl = block_inclusive_scan(s, warp_sums) + carry;
    long long excl = incl - s;
    if (g < G && g >= off && g < off + GL) {
      start[g - off] = (int)min(excl, M);
      end[g - off] = (int)min(incl, M);
    }
    if (g == off) tab[0] = (int)min(excl, M);
    if (g == off + GL - 1) tab[1] = (int)min(incl, M);
    if ((threadIdx.x & 31) == 31) warp_sums[threadIdx.x >> 5] = incl;
    __syncthreads();
    carry = warp_sums[(blockDim.x >> 5) - 1];
    __syncthreads();
  }
  if (GL == 0 && threadIdx.x == 0) {
    /* No local group: every row is outside. */
    tab[0] = 0;
    tab[1] = 0;
  }
  __syncthreads();

  /* Prefix of tile counts over local groups. */
  carry = 0;
  for (int base = 0; base < GL; base += blockDim.x) {
    const int j = base + threadIdx.x;
    long long t = 0;
    if (j < GL)
      t = bm <= 0                   ? (long long)tiles_per_group
          : layout == kTilesMerged ? merged_units(end[j] - start[j], tiles_n)
                                   : (long long)((end[j] - start[j] + bm - 1) / bm) * tiles_n;
    long long incl = block_inclusive_scan(t, warp_sums) + carry;
    if (j < GL) tile_prefix[j + 1] = (int)min(incl, (long long)INT32_MAX);
    if ((threadIdx.x & 31) == 31) warp_sums[threadIdx.x >> 5] = incl;
    __syncthreads();
    carry = warp_sums[(blockDim.x >> 5) - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    tile_prefix[0] = 0;
    tab[2] = (int)min(carry, (long long)INT32_MAX);
  }

  /* tgmm: a tile's cost grows with its group's rows, and tiles are handed out in table order, so a
   * long group late in the order leaves a few SMs working alone at the end (measured: 0.74x on
   * skewed sizes with 256 groups of ~512 rows). order[] puts the groups of more than twice the mean
   * rows first, longest first by size class (2 classes per power of two: sizes within 1.5x share
   * one), then all the others in index order: reordering groups of similar sizes measured ~1-2%
   * slower on 256 groups, so they keep the order of their rows. Every
   * CTA that builds the table in its own shared memory must get the same order: a stable counting
   * sort (class counts, the classes' first positions by a block scan, then warp 0 places the
   * long groups 32 at a time in index order; skipped when there is none). */
  if (bm <= 0) {
    constexpr int kClasses = 64; /* class 0: the groups of at most twice the mean */
    __shared__ int class_next[kClasses];
    int *order = tile_prefix + GL + 1;
    const long long local_rows = (long long)tab[1] - tab[0];
    const unsigned long long limit = GL > 0 ? (unsigned long long)(2 * local_rows / GL) : 0;
    auto size_class = [&](int j) { /* 0 up to the limit, else 1..61: longer, higher */
      const unsigned r = (unsigned)(end[j] - start[j]);
      if (r <= limit) return 0;
      const int b = 31 - __clz(r); /* 0..30; r > limit >= 0, so r >= 1 */
      return b == 0 ? 1 : 2 * b + (int)((r >> (b - 1)) & 1);
    };
    for (int c = threadIdx.x; c < kClasses; c += blockDim.x) class_next[c] = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < GL; j += blockDim.x) {
      const int c = size_class(j);
      if (c > 0) atomicAdd(&class_next[c], 1);
    }
    __syncthreads();
    { /* first position of each class, the longest class first (thread t: class 63 - t; every
       * caller has at least 64 threads); class 0 starts after every long group */
      const int c = kClasses - 1 - (int)threadIdx.x;
      const long long n = c >= 0 ? class_next[c] : 0;
      const long long excl = block_inclusive_scan(n, warp_sums) - n; /* (syncs: reads first) */
      if (c >= 0) class_next[c] = (int)excl;
    }
    __syncthreads();
    const int long_groups = class_next[0]; /* where class 0 starts */
    __syncthreads(); /* (warp 0 moves class_next[0] on below) */
    if (long_groups == 0) { /* no long group: index order */
      for (int j = threadIdx.x; j < GL; j += blockDim.x) order[j] = j;
    } else if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      for (int base = 0; base < GL; base += 32) {
        const int j = base + lane;
        const bool valid = j < GL;
        const int c = valid ? size_class(j) : -1 - lane; /* (a lane past GL matches no other) */
        const unsigned peers = __match_any_sync(0xffffffffu, c);
        const int rank = __popc(peers & ((1u << lane) - 1)); /* earlier lanes of its class */
        const int pos = valid ? class_next[c] + rank : 0;
        __syncwarp();
        if (valid && rank == 0) class_next[c] += __popc(peers);
        __syncwarp();
        if (valid) order[pos] = j;
      }
    }
  }
  __syncthreads();
}

/* The local group that owns tile t: the last j with tile_prefix[j] <= t (empty groups skipped). */
__device__ inline int find_group(const int *tile_prefix, int num_local_groups, int t) {
  int lo = 0, hi = num_local_groups; /* answer in [lo, hi) */
  while (hi - lo > 1) {
    int mid = (lo + hi) >> 1;
    if (tile_prefix[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

/* Tile u of a tiles_m x tiles_n grid, in panels of 16 m-tiles: inside a panel n advances after
 * every m-tile of the panel. CTAs running at the same time then share 16 row blocks and ~8 column
 * blocks (gmm: A and B slabs; tgmm: both operands' column slabs) instead of every row block of a
 * tall group. */
__host__ __device__ inline void panel_raster(int u, int tiles_m, int tiles_n, int &mt, int &nt) {
  constexpr int P = 16;
  const int panel = u / (P * tiles_n);
  const int rem = u - panel * P * tiles_n;
  const int height = min(P, tiles_m - panel * P);
  nt = rem / height;
  mt = panel * P + rem % height;
}

__host__ __device__ inline size_t dtype_bytes(sl_dtype dt) {
  return dt == SL_DTYPE_F32 || dt == SL_DTYPE_I32 ? 4 : 2;
}

__device__ inline void store_out(void *out, sl_dtype dt, size_t idx, float v) {
  if (dt == SL_DTYPE_F32)
    reinterpret_cast<float *>(out)[idx] = v;
  else if (dt == SL_DTYPE_BF16)
    reinterpret_cast<__nv_bfloat16 *>(out)[idx] = __float2bfloat16_rn(v);
  else
    reinterpret_cast<__half *>(out)[idx] = __float2half_rn(v);
}

/* Two adjacent outputs (idx even-aligned for 16-bit types, 8-byte aligned for f32). */
__device__ inline void store_out2(void *out, sl_dtype dt, size_t idx, float v0, float v1) {
  if (dt == SL_DTYPE_F32) {
    *reinterpret_cast<float2 *>(reinterpret_cast<float *>(out) + idx) = make_float2(v0, v1);
  } else if (dt == SL_DTYPE_BF16) {
    *reinterpret_cast<__nv_bfloat162 *>(reinterpret_cast<__nv_bfloat16 *>(out) + idx) =
        __floats2bfloat162_rn(v0, v1);
  } else {
    *reinterpret_cast<__half2 *>(reinterpret_cast<__half *>(out) + idx) = __floats2half2_rn(v0, v1);
  }
}

/* gmm: zero rows [0, lo) and [hi, M) of out, spread over the whole grid. */
__device__ inline void zero_outside_rows(const GmmArgs &a, int lo, int hi) {
  const size_t n = (size_t)a.n;
  const size_t below = (size_t)lo * n, above = (size_t)(a.m - hi) * n;
  const size_t total = below + above;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    size_t idx = i < below ? i : (size_t)hi * n + (i - below);
    store_out(a.out, a.out_dtype, idx, 0.f);
  }
}
#endif /* __CUDACC__ */

/* Launchers. Each returns SL_STATUS_SUCCESS or a status with sl_set_error called. */
sl_status sm80_gmm_launch(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t stream);
sl_status naive_gmm_launch(const GmmArgs &a, bool tgmm, int num_sms, cudaStream_t stream);
/* Where a launch's group table goes. In shared memory, after the kernel's `pipe_bytes`, when
 * the device's per-block limit (less the kernel's static shared memory) leaves room for it: then
 * b->table = NULL and *smem = pipe_bytes + the table. Otherwise in the workspace a.table, where
 * table_kernel builds it now (bm, tiles_n, tiles_per_group, layout: build_group_table's), and
 * *smem = pipe_bytes; with no workspace, an error naming `who`. b = a, then the choice. The
 * kernel is allowed the device's whole opt-in shared memory once per device (cached). */
sl_status place_table(const GmmArgs &a, GmmArgs *b, const void *kernel, size_t pipe_bytes, int bm,
                      int tiles_n, int tiles_per_group, int layout, cudaStream_t stream,
                      size_t *smem, const char *who);
/* gmm's sm90 tiles: 128 x 256 (plain), the same with each group's edge as merged tiles (N-major
 * rhs, 16-bit output), or 128 x 128 (narrow). */
enum GmmTiles { kGmmTilesPlain, kGmmTilesMerged, kGmmTilesNarrow };
/* The sm90 kernels (sm90_gmm_fwd.cu, sm90_gmm_wgrad.cu), for the problems gmm_launch.cu's table
 * gives them: SL_STATUS_UNSUPPORTED (no error set) where a tensor map cannot be encoded, and the
 * caller runs the portable kernel. */
sl_status sm90_gmm_fwd_launch(const GmmArgs &a, GmmTiles tiles, int num_sms, cudaStream_t stream);
sl_status sm90_gmm_wgrad_launch(const GmmArgs &a, int num_sms, cudaStream_t stream);

/* Tests only (tests/gpu/test_gmm.cu): caps the persistent kernels' grid of the public calls at
 * `sms` SMs (0: every SM), so that small problems span many waves of tiles. Not thread-safe. */
void gmm_set_grid_cap(int sms);
/* Tests and benchmarks only: gmm's sm90 tile width, 256 or 128 for every problem the sm90 gmm
 * kernels take (0: gmm_launch.cu's wave model chooses). Not thread-safe. */
void gmm_set_tile_n(int tile_n);
/* The current device's compute capability (major) and the SMs a persistent grid takes there (all,
 * or the cap above); found once per device. Compute capability below 8.0 is UNSUPPORTED. */
sl_status gmm_device(const char *op, int *major, int *sms);
/* With SLUICE_DEBUG=1: synchronises and checks the device's group sizes and offsets on the host,
 * INVALID_VALUE naming what the kernels clamped (sluice.h); otherwise SUCCESS at once. */
sl_status gmm_debug_check(const char *op, const sl_gmm_desc *d, const int32_t *group_sizes,
                          const int32_t *group_offset, cudaStream_t stream);

} /* namespace sluice_cuda */

#endif /* SLUICE_CUDA_GMM_COMMON_CUH_ */
