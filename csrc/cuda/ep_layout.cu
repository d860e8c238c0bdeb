/*
 * The expert-parallel layout on the GPU: for each token, the ranks its experts live on and its
 * position within the block of rows it sends to each (send positions, [T, R], -1 where it sends
 * none), the rows it sends to each rank (send counts, [R]) and the slots per expert ([E]).
 * Tokens keep their order within a block, so dispatch's rows are ordered by (source, token).
 *
 * PEER and IPC dispatch start with their own tokens' layout (launch_layout); NCCL dispatch runs
 * every source's once the ids have arrived (launch_layout_multi); sl_ep_layout_cuda runs it alone.
 * One block handles any T in chunks of blockDim; 2..kMaxChunks chunks of 1024 tokens take two
 * multi-block launches instead.
 */
#include <stdint.h>

#include "ep_common.cuh"

namespace sluice_cuda {
namespace {

/* The ranks token t goes to (bit d: one of its slots' experts is on rank d); its valid slots are
 * counted per expert in hist (shared memory), the bad ones (out of range, or repeating an earlier
 * slot's expert) in *bad. */
__device__ __forceinline__ unsigned token_mask(const LayoutArgs &a, int t, int *hist) {
  unsigned mask = 0;
  if (t < a.T && a.k <= 8) {
    /* the usual case: the token's ids in registers, their loads all in flight at once */
    int ids[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) ids[j] = j < a.k ? __ldg(a.idx + (int64_t)t * a.k + j) : -1;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = ids[j];
      bool ok = e >= 0 && e < a.E;
#pragma unroll
      for (int i = 0; i < j; ++i) ok = ok && ids[i] != e;
      if (!ok) {
        if (e != -1 && a.bad) atomicAdd(a.bad, 1);
        continue;
      }
      atomicAdd(&hist[e], 1);
      mask |= 1u << (e / a.L);
    }
  } else if (t < a.T) {
    for (int j = 0; j < a.k; ++j) {
      int e = a.idx[(int64_t)t * a.k + j];
      bool ok = e >= 0 && e < a.E;
      for (int i = 0; i < j && ok; ++i) ok = a.idx[(int64_t)t * a.k + i] != e;
      if (!ok) {
        if (e != -1 && a.bad) atomicAdd(a.bad, 1);
        continue;
      }
      atomicAdd(&hist[e], 1);
      mask |= 1u << (e / a.L);
    }
  }
  return mask;
}

/* Block-wide exclusive scan of the tokens' masks, per rank: before[d] = the block's earlier tokens
 * (by thread) going to rank d; tot[d] = the block's tokens going to d. Every thread calls it. */
__device__ __forceinline__ void block_scan_masks(unsigned mask, int R, int *before, int *tot) {
  __shared__ int warp_tot[32][kMaxRanks];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x / 32;
  int incl[kMaxRanks];
  for (int d = 0; d < R; ++d) {
    int v = (mask >> d) & 1;
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += u;
    }
    incl[d] = v;
    if (lane == 31) warp_tot[warp][d] = v;
  }
  __syncthreads();
  if (warp == 0)
    for (int d = 0; d < R; ++d) {
      int v = lane < nw ? warp_tot[lane][d] : 0;
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += u;
      }
      if (lane < nw) warp_tot[lane][d] = v; /* inclusive over warps */
    }
  __syncthreads();
  for (int d = 0; d < R; ++d) {
    before[d] = (warp ? warp_tot[warp - 1][d] : 0) + incl[d] - (int)((mask >> d) & 1);
    tot[d] = warp_tot[nw - 1][d];
  }
  __syncthreads(); /* warp_tot is reused by the next call */
}

/* One block over all tokens, in chunks of blockDim (the NCCL transport's per-source layouts, and
 * token counts past the multi-block layout's chunk table). */
__device__ __forceinline__ void layout_body(const LayoutArgs &a) {
  __shared__ int hist[kMaxExperts];
  const int tid = threadIdx.x;
  for (int e = tid; e < a.E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  int carry[kMaxRanks];
  for (int d = 0; d < kMaxRanks; ++d) carry[d] = 0;
  for (int base = 0; base < a.T; base += blockDim.x) {
    const int t = base + tid;
    const unsigned mask = token_mask(a, t, hist);
    int before[kMaxRanks], tot[kMaxRanks];
    block_scan_masks(mask, a.R, before, tot);
    if (t < a.T)
      for (int d = 0; d < a.R; ++d)
        a.send_row[(int64_t)t * a.R + d] = ((mask >> d) & 1) ? carry[d] + before[d] : -1;
    for (int d = 0; d < a.R; ++d) carry[d] += tot[d];
  }
  if (tid < a.R) a.send_counts[tid] = carry[tid];
  __syncthreads();
  for (int e = tid; e < a.E; e += blockDim.x) a.expert_hist[e] = hist[e];
}

__global__ void __launch_bounds__(1024) layout_kernel(LayoutArgs a) { layout_body(a); }

/* The same layout over many blocks, in two launches (the one block above took 158 us for 32k
 * tokens, ahead of every dispatch). 1: a block per chunk of 1024 tokens: positions within the
 * chunk, the chunk's count per rank into chunk_cnt [chunks][R], its histogram added to expert_hist
 * (zeroed before). 2: each chunk's positions shifted by the earlier chunks' counts; send_counts. */

__global__ void __launch_bounds__(kLayoutChunk) layout_count_kernel(LayoutArgs a, int *chunk_cnt) {
  __shared__ int hist[kMaxExperts];
  const int tid = threadIdx.x, t = blockIdx.x * kLayoutChunk + tid;
  for (int e = tid; e < a.E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const unsigned mask = token_mask(a, t, hist);
  int before[kMaxRanks], tot[kMaxRanks];
  block_scan_masks(mask, a.R, before, tot);
  if (t < a.T)
    for (int d = 0; d < a.R; ++d)
      a.send_row[(int64_t)t * a.R + d] = ((mask >> d) & 1) ? before[d] : -1;
  if (tid < a.R) chunk_cnt[blockIdx.x * a.R + tid] = tot[tid];
  for (int e = tid; e < a.E; e += blockDim.x)
    if (hist[e]) atomicAdd(&a.expert_hist[e], hist[e]);
}

__global__ void __launch_bounds__(kLayoutChunk) layout_offset_kernel(LayoutArgs a,
                                                                     const int *chunk_cnt) {
  __shared__ int off[kMaxRanks];
  const int tid = threadIdx.x, t = blockIdx.x * kLayoutChunk + tid;
  const int lane = tid & 31, d = tid >> 5; /* warp d sums rank d's counts of the earlier chunks */
  if (d < a.R) {
    int o = 0;
    for (int c = lane; c < (int)blockIdx.x; c += 32) o += chunk_cnt[c * a.R + d];
    for (int m = 16; m; m >>= 1) o += __shfl_xor_sync(0xffffffffu, o, m);
    if (lane == 0) {
      off[d] = o;
      if (blockIdx.x == gridDim.x - 1) a.send_counts[d] = o + chunk_cnt[blockIdx.x * a.R + d];
    }
  }
  __syncthreads();
  if (t < a.T)
    for (int d = 0; d < a.R; ++d) {
      int *p = a.send_row + (int64_t)t * a.R + d;
      if (*p >= 0) *p += off[d];
    }
}

__global__ void __launch_bounds__(1024) layout_multi_kernel(LayoutMulti m) {
  layout_body(m.src[blockIdx.x]);
}

}  // namespace

cudaError_t launch_layout(const LayoutArgs &a, int *chunk_cnt, cudaStream_t s) {
  const int chunks = (a.T + kLayoutChunk - 1) / kLayoutChunk;
  if (!chunk_cnt || chunks <= 1 || chunks > kMaxChunks) {
    layout_kernel<<<1, 1024, 0, s>>>(a);
    return cudaGetLastError();
  }
  cudaError_t e = cudaMemsetAsync(a.expert_hist, 0, sizeof(int) * a.E, s);
  if (e != cudaSuccess) return e;
  layout_count_kernel<<<chunks, kLayoutChunk, 0, s>>>(a, chunk_cnt);
  layout_offset_kernel<<<chunks, kLayoutChunk, 0, s>>>(a, chunk_cnt);
  return cudaGetLastError();
}

/* NCCL: the layout of every source rank's tokens at once (block s: source s). */
void launch_layout_multi(const LayoutMulti &m, int R, cudaStream_t s) {
  layout_multi_kernel<<<R, 1024, 0, s>>>(m);
}

}  // namespace sluice_cuda
using namespace sluice_cuda;

extern "C" sl_status sl_ep_layout_cuda(const sl_ep_desc *d, const int32_t *topk_idx,
                                       int32_t *send_pos, int32_t *send_counts,
                                       int32_t *expert_counts, void *stream) {
  if (d == NULL || d->struct_size < sizeof(sl_ep_desc) || d->num_ranks < 1 ||
      d->num_ranks > kMaxRanks || d->num_tokens < 0 || d->topk < 1 || d->num_experts < 1 ||
      d->num_experts % d->num_ranks || d->num_experts > kMaxExperts || expert_counts == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep layout (CUDA): bad descriptor or arguments");
  static int
      *bad_of[64]; /* throw-away counters, one per device: this entry does not report bad ids */
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return sl_set_error(SL_STATUS_UNSUPPORTED, "ep layout: device %d", dev);
  static int *chunk_of[64]; /* the multi-block layout's chunk table, one per device */
  if (!bad_of[dev] && cudaMalloc(&bad_of[dev], sizeof(int)) != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "ep layout: cudaMalloc");
  if (!chunk_of[dev] &&
      cudaMalloc(&chunk_of[dev], sizeof(int) * kMaxChunks * kMaxRanks) != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "ep layout: cudaMalloc");
  int *bad = bad_of[dev];
  LayoutArgs la = {topk_idx,
                   send_pos,
                   send_counts,
                   expert_counts,
                   bad,
                   (int)d->num_tokens,
                   (int)d->topk,
                   (int)d->num_experts,
                   (int)(d->num_experts / d->num_ranks),
                   (int)d->num_ranks};
  cudaError_t e = launch_layout(la, chunk_of[dev], (cudaStream_t)stream);
  return e == cudaSuccess ? SL_STATUS_SUCCESS : cuda_fail(e, "layout", "kernel launch");
}
