/*
 * Expert-parallel dispatch / combine / redispatch between the GPUs of one process over NVLink.
 *
 * Each rank owns one registered buffer (cudaMalloc at setup; every peer maps it through peer
 * access): mail[s]  what source s wrote to me for the current call: its row counts to every rank,
 * the addresses of its outputs (dispatch: where I push rows) or inputs (combine, redispatch: where
 * I pull rows from), then a release flag `seq`; hist[s]  source s's (row, slot) counts for each of
 * my local experts (dispatch only); done     a monotonic counter every block of every rank bumps
 * once per call (system atomics). The data moves straight between XLA's buffers: dispatch pushes
 * rows into the peers' output buffers, combine and redispatch pull rows from the peers' y and g.
 * No staging copy.
 *
 * One call on rank r, after the layout (dispatch only: send positions and counts, a block per chunk
 * of 1024 tokens):
 *   1. publish: block 0 writes mail/hist into every peer, fence, then the flag (st.release.sys);
 *   2. meet: every block waits (acquire) until all peers' flags show this call's seq;
 *   3. move: warp per token (redispatch and the IPC combine: per row, the peers' rows interleaved,
 *      so that no GPU's links carry every rank's traffic at once), 16-byte vectors; f32 sums in
 *      fixed rank order for combine;
 *   4. leave: each block bumps every peer's `done`; block 0 waits until its own reaches
 *      seq * R * blocks, i.e. every block of every peer has finished touching our buffers.
 * A peer's next call can only overwrite our mail after step 4 of this call, which needs all our
 * blocks past step 2: the mailbox needs no double buffering.
 *
 * Waits spin on globaltimer and stop after the communicator's timeout: the first block to give up
 * records (rank, whom it waited for, phase) in host-mapped memory; the host reports it at the next
 * call (or at once with SLUICE_DEBUG=1) and the communicator is broken from then on.
 *
 * Bounded work: `num_sms` blocks of 512 threads (default 64). Requires R <= 8, k <= 32, E <= 8192,
 * E/R <= 4096.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/ep_internal.h"
#include "ep_nccl.h"
#include "half_pack.cuh"

/* Kernels named sluice_cuda::(anonymous namespace)::..., as the gmm kernels sluice_cuda::sm90::...:
 * a profile (sluice-profile) counts them as sluice's. */
namespace sluice_cuda {
namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxLocal = 4096;
constexpr int kMaxExperts = 8192;
constexpr int kMaxTopk = 32;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

struct __align__(128) Mail {
  unsigned long long ptr[4];
  int counts[kMaxRanks];
  unsigned long long seq; /* written last, with release */
};

struct EpBuf {
  Mail mail[kMaxRanks];
  __align__(128) unsigned long long done;
  __align__(128) int hist[kMaxRanks][kMaxLocal];
};

struct EpErr {                 /* host-mapped; written by the device once, read by the host */
  int code;                    /* 0 fine, 1 timed out */
  int rank, waited_for, phase; /* phase 1: arrive, 2: finish */
  unsigned long long seq;
  int bad_ids; /* slots treated as -1 (out of range or repeated): reported with SLUICE_DEBUG=1 */
};

/* IPC: a rank's buffer is the EpBuf, then (at kHdr) its staging area of stage_bytes. */
constexpr size_t kHdr = (sizeof(EpBuf) + 4095) & ~(size_t)4095;

struct Rank {
  int ordinal, group, rank;
  int local;               /* 1: this process drives it (ordinal >= 0) */
  EpBuf *buf;              /* this rank's registered buffer (PEER, IPC) */
  EpBuf *peer[kMaxRanks];  /* this rank's view of every buffer of its group (its own included) */
  int imported[kMaxRanks]; /* 1: peer[r] was mapped with cudaIpcOpenMemHandle */
  EpErr *err_host, *err_dev;
  int *send_counts; /* [R] this rank's rows to each rank (layout scratch) */
  int *expert_hist; /* [E max] this rank's slots per global expert (layout scratch) */
  int *chunk_cnt;   /* [kMaxChunks][R max] the multi-block layout's counts per chunk (scratch) */
  int *cnt_all;     /* [R*R] device: rows s -> d of the last exchange (IPC) */
  char *stage;      /* IPC: buf + kHdr; NCCL: its own buffer of stage_bytes */
  unsigned long long seq;
  ep_nccl *nccl;
  unsigned char id[EP_NCCL_ID_BYTES]; /* NCCL: the group's ncclUniqueId */
  int have_id;
  int local_blocks; /* blocks of the purely local kernels (IPC copy-out and reduce, NCCL gather,
                       pack and reduce): every SM of the device, at least num_sms */
};

struct State {
  int G, R, blocks, transport, multi, connected;
  long long timeout_ns;
  double timeout_s;
  size_t stage_bytes;
  Rank *ranks; /* [G*R] */
};

/* ---- device helpers ----------------------------------------------------------------------------
 */
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(unsigned long long *p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int4 ld_nc(const int4 *p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

struct Ctl { /* what every kernel needs to meet and leave */
  EpBuf *bufs[kMaxRanks];
  EpErr *err;
  int rank, R, blocks;
  unsigned long long seq;
  long long timeout_ns;
};

__device__ void record_timeout(const Ctl &c, int waited_for, int phase) {
  if (atomicCAS(&c.err->code, 0, 1) == 0) {
    c.err->rank = c.rank;
    c.err->waited_for = waited_for;
    c.err->phase = phase;
    c.err->seq = c.seq;
    __threadfence_system();
  }
}

/* Step 2: every block waits for all peers' mail of this call. Returns false on timeout. */
__device__ bool meet(const Ctl &c) {
  __shared__ int ok;
  if (threadIdx.x == 0) ok = 1;
  __syncthreads();
  if (threadIdx.x < c.R) {
    const unsigned long long *flag = &c.bufs[c.rank]->mail[threadIdx.x].seq;
    const unsigned long long t0 = now_ns();
    while (ld_acquire(flag) < c.seq) {
      if ((long long)(now_ns() - t0) > c.timeout_ns) {
        record_timeout(c, threadIdx.x, 1);
        ok = 0;
        break;
      }
    }
  }
  __syncthreads();
  return ok;
}

/* Step 1 (block 0): the flag after the mail contents. Threads wrote the contents before calling. */
__device__ void publish(const Ctl &c) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.R) st_release(&c.bufs[threadIdx.x]->mail[c.rank].seq, c.seq);
}

/* Step 4. Every thread fenced its stores; then one bump per peer per block; block 0 waits. */
__device__ void leave(const Ctl &c, bool ok) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.R) atomicAdd_system(&c.bufs[threadIdx.x]->done, 1ull);
  if (blockIdx.x == 0 && threadIdx.x == 0 && ok) {
    const unsigned long long target = c.seq * (unsigned long long)c.R * c.blocks;
    const unsigned long long t0 = now_ns();
    while (ld_acquire(&c.bufs[c.rank]->done) < target) {
      if ((long long)(now_ns() - t0) > c.timeout_ns) {
        record_timeout(c, -1, 2);
        break;
      }
    }
    __threadfence_system();
  }
}

/* Sanitised expert of one slot: out of range or repeated earlier in the row -> -1. Lanes < k hold
 * slots; every lane of the warp must call it. */
__device__ __forceinline__ int clean_expert(int e, int lane, int k, int E, int *bad) {
  if (lane >= k) e = -1;
  int valid = e >= -1 && e < E;
  if (!valid) e = -1;
  for (int j = 0; j < k; ++j) {
    const int ej = __shfl_sync(0xffffffffu, e, j);
    if (j < lane && e >= 0 && ej == e) {
      e = -1;
      valid = 0;
    }
  }
  if (bad && !valid && lane < k) atomicAdd(bad, 1);
  return e;
}

/* ---- row copies: 16-byte vectors when rows allow, else 4 or 2 bytes ---------------------------
 */
template <typename V>
__device__ __forceinline__ void copy_row(char *dst, const char *src, int64_t bytes, int lane) {
  const int64_t n = bytes / (int64_t)sizeof(V);
  V *d = (V *)dst;
  const V *s = (const V *)src;
  int64_t i = lane;
  for (; i + 96 < n; i += 128) { /* four loads in flight before the stores */
    V a = s[i], b = s[i + 32], cc = s[i + 64], e = s[i + 96];
    d[i] = a, d[i + 32] = b, d[i + 64] = cc, d[i + 96] = e;
  }
  for (; i < n; i += 32) d[i] = s[i];
}
template <>
__device__ __forceinline__ void copy_row<int4>(char *dst, const char *src, int64_t bytes,
                                               int lane) {
  const int64_t n = bytes / 16;
  int4 *d = (int4 *)dst;
  const int4 *s = (const int4 *)src;
  int64_t i = lane;
  for (; i + 96 < n; i += 128) {
    int4 a = ld_nc(s + i), b = ld_nc(s + i + 32), cc = ld_nc(s + i + 64), e = ld_nc(s + i + 96);
    d[i] = a, d[i + 32] = b, d[i + 64] = cc, d[i + 96] = e;
  }
  for (; i < n; i += 32) d[i] = ld_nc(s + i);
}

__device__ __forceinline__ void any_copy_row(char *dst, const char *src, int64_t bytes, int vec,
                                             int lane) {
  if (vec == 16)
    copy_row<int4>(dst, src, bytes, lane);
  else if (vec == 4)
    copy_row<int>(dst, src, bytes, lane);
  else
    copy_row<short>(dst, src, bytes, lane);
}

__device__ __forceinline__ void zero_row(char *dst, int64_t bytes, int vec, int lane) {
  if (vec == 16) {
    for (int64_t i = lane; i < bytes / 16; i += 32) ((int4 *)dst)[i] = make_int4(0, 0, 0, 0);
  } else if (vec == 4) {
    for (int64_t i = lane; i < bytes / 4; i += 32) ((int *)dst)[i] = 0;
  } else {
    for (int64_t i = lane; i < bytes / 2; i += 32) ((short *)dst)[i] = 0;
  }
}

/* ---- layout: one block, tokens in order -------------------------------------------------------
 */
struct LayoutArgs {
  const int *idx;
  int *send_row;    /* [T, R]: position within the destination's block, -1 */
  int *send_counts; /* [R] */
  int *expert_hist; /* [E] */
  int *bad;
  int T, k, E, L, R;
};

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
constexpr int kLayoutChunk = 1024, kMaxChunks = 256; /* up to 262,144 tokens, else one block */

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

/* The layout of one rank's tokens; chunk_cnt: scratch of kMaxChunks * kMaxRanks ints, or null
 * (one block). */
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
struct LayoutMulti {
  LayoutArgs src[kMaxRanks];
};
__global__ void __launch_bounds__(1024) layout_multi_kernel(LayoutMulti m) {
  layout_body(m.src[blockIdx.x]);
}

/* ---- dispatch -------------------------------------------------------------------------------- */
struct DispatchArgs {
  Ctl c;
  const char *x;
  const int *idx;
  const float *w;
  int *send_row; /* in: positions (layout); out: rows in each destination */
  const int *send_counts, *expert_hist;
  char *recv_x; /* this rank's outputs: published for the peers to push into */
  int *recv_idx, *recv_src, *num_recv, *counts;
  float *recv_w;
  int *bad;
  int T, k, E, L, vec;
  int64_t row_bytes;
  /* IPC: rows for a peer go into its staging area (rows, then idx, w, src at these offsets); the
   * rows s -> d of this call go to cnt_all for the copy-out kernel */
  int staged;
  char *stage[kMaxRanks];
  int64_t st_idx, st_w, st_src;
  int *cnt_all;
};

__global__ void __launch_bounds__(kThreads) dispatch_kernel(DispatchArgs a) {
  const Ctl &c = a.c;
  const int R = c.R, me = c.rank, lane = threadIdx.x & 31;
  const int64_t N = (int64_t)a.T * R;
  /* 1. publish: my counts to every rank, my output addresses, my slots per expert of each rank */
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < R * R; i += blockDim.x) {
      const int d = i / R, r = i % R;
      c.bufs[d]->mail[me].counts[r] = a.send_counts[r];
    }
    for (int i = threadIdx.x; i < R * a.L; i += blockDim.x) {
      const int d = i / a.L, e = i % a.L;
      c.bufs[d]->hist[me][e] = a.expert_hist[d * a.L + e];
    }
    if (threadIdx.x < R) {
      Mail &m = c.bufs[threadIdx.x]->mail[me];
      m.ptr[0] = (unsigned long long)a.recv_x;
      m.ptr[1] = (unsigned long long)a.recv_idx;
      m.ptr[2] = (unsigned long long)a.recv_w;
      m.ptr[3] = (unsigned long long)a.recv_src;
    }
    publish(c);
  }
  /* 2. meet */
  const bool ok = meet(c);
  __shared__ int off[kMaxRanks], mine_total;
  __shared__ unsigned long long dst[kMaxRanks][4];
  if (ok) {
    if (threadIdx.x < R) {
      const int d = threadIdx.x;
      /* volatile: past the acquire in meet(), read the peers' writes from memory, not L1 */
      const volatile Mail *mail = c.bufs[me]->mail;
      int o = 0;
      for (int s = 0; s < me; ++s) o += mail[s].counts[d];
      off[d] = o;
      if (!a.staged) {
        for (int p = 0; p < 4; ++p) dst[d][p] = mail[d].ptr[p]; /* d's outputs */
      } else if (d == me) {
        dst[d][0] = (unsigned long long)a.recv_x, dst[d][1] = (unsigned long long)a.recv_idx;
        dst[d][2] = (unsigned long long)a.recv_w, dst[d][3] = (unsigned long long)a.recv_src;
      } else {
        const unsigned long long b = (unsigned long long)a.stage[d];
        dst[d][0] = b, dst[d][1] = b + a.st_idx, dst[d][2] = b + a.st_w, dst[d][3] = b + a.st_src;
      }
    }
    if (threadIdx.x == 0) {
      const volatile Mail *mail = c.bufs[me]->mail;
      int tot = 0;
      for (int s = 0; s < R; ++s) tot += mail[s].counts[me];
      mine_total = tot;
    }
  }
  __syncthreads();
  if (ok) {
    /* 3. move: warp per token */
    const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
    for (int t = gw; t < a.T; t += nw) {
      int e = lane < a.k ? a.idx[(int64_t)t * a.k + lane] : -1;
      const float wt = lane < a.k ? a.w[(int64_t)t * a.k + lane] : 0.0f;
      e = clean_expert(e, lane, a.k, a.E, nullptr); /* the layout kernel counted the bad ones */
      const int dest = e >= 0 ? e / a.L : -1;
      unsigned mask = __reduce_or_sync(0xffffffffu, dest >= 0 ? 1u << dest : 0u);
      const int pos = lane < R ? a.send_row[(int64_t)t * R + lane] : -1;
      if (a.vec == 16) {
        /* the row is read once and stored to every destination */
        constexpr int U = 8;
        const int4 *src = (const int4 *)(a.x + (int64_t)t * a.row_bytes);
        const int64_t nv = a.row_bytes / 16;
        for (int64_t base = 0; base < nv; base += 32 * U) {
          int4 v[U];
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int64_t i = base + u * 32 + lane;
            if (i < nv) v[u] = ld_nc(src + i);
          }
          for (unsigned m = mask; m; m &= m - 1) {
            const int d = __ffs(m) - 1;
            const int64_t row = off[d] + __shfl_sync(0xffffffffu, pos, d);
            int4 *o = (int4 *)((char *)dst[d][0] + row * a.row_bytes);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t i = base + u * 32 + lane;
              if (i < nv) o[i] = v[u];
            }
          }
        }
      }
      for (unsigned m = mask; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        const int64_t row = off[d] + __shfl_sync(0xffffffffu, pos, d);
        char *rx = (char *)dst[d][0];
        if (a.vec != 16)
          any_copy_row(rx + row * a.row_bytes, a.x + (int64_t)t * a.row_bytes, a.row_bytes, a.vec,
                       lane);
        if (lane < a.k) {
          ((int *)dst[d][1])[row * a.k + lane] = dest == d ? e - d * a.L : -1;
          ((float *)dst[d][2])[row * a.k + lane] = dest == d ? wt : 0.0f;
        }
        if (lane == 0) ((int *)dst[d][3])[row] = me * a.T + t;
      }
      if (lane < R) a.send_row[(int64_t)t * R + lane] = pos >= 0 ? off[lane] + pos : -1;
    }
    /* my own rows past the valid ones: zero, -1, 0 */
    for (int64_t r = mine_total + gw; r < N; r += nw) {
      zero_row(a.recv_x + r * a.row_bytes, a.row_bytes, a.vec, lane);
      if (lane < a.k) {
        a.recv_idx[r * a.k + lane] = -1;
        a.recv_w[r * a.k + lane] = 0.0f;
      }
      if (lane == 0) a.recv_src[r] = -1;
    }
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < a.L; e += blockDim.x) {
        int s = 0;
        for (int r = 0; r < R; ++r) s += ((volatile int *)c.bufs[me]->hist[r])[e];
        a.counts[e] = s;
      }
      if (threadIdx.x == 0) *a.num_recv = mine_total;
      if (a.staged)
        for (int i = threadIdx.x; i < R * R; i += blockDim.x)
          a.cnt_all[i] = ((const volatile Mail *)c.bufs[me]->mail)[i / R].counts[i % R];
    }
  }
  /* 4. leave */
  leave(c, ok);
}

/* ---- IPC dispatch, after the exchange: the peers' rows from my staging area into my outputs ----
 */
struct CopyOutArgs {
  const char *stage;
  int64_t st_idx, st_w, st_src;
  const int *cnt_all; /* [R*R] */
  char *recv_x;
  int *recv_idx, *recv_src;
  float *recv_w;
  int R, me, T, k, vec;
  int64_t row_bytes;
};

__global__ void __launch_bounds__(kThreads) copy_out_kernel(CopyOutArgs a) {
  __shared__ int lo[kMaxRanks + 1];
  if (threadIdx.x == 0) {
    int o = 0;
    for (int s = 0; s < a.R; ++s) {
      lo[s] = o;
      o += a.cnt_all[s * a.R + a.me];
    }
    lo[a.R] = o;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  for (int64_t r = gw; r < lo[a.R]; r += nw) {
    int s = 0;
    while (s + 1 < a.R && r >= lo[s + 1]) ++s;
    if (s == a.me) continue; /* my own rows went straight to my outputs */
    any_copy_row(a.recv_x + r * a.row_bytes, a.stage + r * a.row_bytes, a.row_bytes, a.vec, lane);
    if (lane < a.k) {
      a.recv_idx[r * a.k + lane] = ((const int *)(a.stage + a.st_idx))[r * a.k + lane];
      a.recv_w[r * a.k + lane] = ((const float *)(a.stage + a.st_w))[r * a.k + lane];
    }
    if (lane == 0) a.recv_src[r] = ((const int *)(a.stage + a.st_src))[r];
  }
}

/* ---- IPC combine, step 1: push my rows of each source into its staging area ------------------
 * Every rank publishes its rows per destination (counted from send_row), so a rank holding y knows
 * where each source's block starts; source s's staging area receives rank d's block at rows d*T. */
struct PushArgs {
  Ctl c;
  const char *y;
  const float *y_w;
  const int *send_row;
  char *stage[kMaxRanks];
  int64_t st_w;
  int *cnt_all; /* out: [R*R] rows s -> d, for the reduce */
  int T, k, vec;
  int64_t row_bytes;
};

__global__ void __launch_bounds__(kThreads) combine_push_kernel(PushArgs a) {
  const Ctl &c = a.c;
  const int R = c.R, me = c.rank, lane = threadIdx.x & 31;
  __shared__ int cnt[kMaxRanks], lo[kMaxRanks], num[kMaxRanks];
  if (blockIdx.x == 0) {
    if (threadIdx.x < R) cnt[threadIdx.x] = 0;
    __syncthreads();
    int mine[kMaxRanks];
    for (int d = 0; d < kMaxRanks; ++d) mine[d] = 0;
    for (int64_t i = threadIdx.x; i < (int64_t)a.T * R; i += blockDim.x)
      if (a.send_row[i] >= 0) mine[i % R]++;
    for (int d = 0; d < R; ++d)
      if (mine[d]) atomicAdd(&cnt[d], mine[d]);
    __syncthreads();
    for (int i = threadIdx.x; i < R * R; i += blockDim.x)
      c.bufs[i / R]->mail[me].counts[i % R] = cnt[i % R];
    publish(c);
  }
  const bool ok = meet(c);
  if (ok && threadIdx.x == 0) {
    const volatile Mail *mail = c.bufs[me]->mail;
    int o = 0;
    for (int s = 0; s < R; ++s) {
      lo[s] = o;
      num[s] = mail[s].counts[me];
      o += num[s];
    }
  }
  __syncthreads();
  if (ok) {
    /* The peers' rows interleaved (row q of peer me+1, of me+2, ..., then row q+1): every peer's
     * link takes a share at every moment. Peer by peer, all ranks would push to rank 0 first and
     * share its ingress while the other links idle (4 ranks: 1.9x the time of the NVLink combine). */
    const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
    int most = 0;
    for (int s = 0; s < R; ++s)
      if (s != me && num[s] > most) most = num[s];
    const int64_t span = R > 1 ? (int64_t)most * (R - 1) : 0;
    for (int64_t j = gw; j < span; j += nw) {
      const int s = (me + 1 + (int)(j % (R - 1))) % R, i = (int)(j / (R - 1));
      if (i >= num[s]) continue;
      const int64_t from = lo[s] + i, to = (int64_t)me * a.T + i;
      any_copy_row(a.stage[s] + to * a.row_bytes, a.y + from * a.row_bytes, a.row_bytes, a.vec,
                   lane);
      if (a.y_w && lane < a.k)
        ((float *)(a.stage[s] + a.st_w))[to * a.k + lane] = a.y_w[from * a.k + lane];
    }
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < R * R; i += blockDim.x)
        a.cnt_all[i] = ((const volatile Mail *)c.bufs[me]->mail)[i / R].counts[i % R];
  }
  leave(c, ok);
}

/* ---- combine: pull rows from the peers' y, sum in rank order -------------------------------- */
template <typename T> /* bf16, f16 */
struct Elems {
  static constexpr int n = 8;
  __device__ static void add(float *acc, int4 v) {
    float f[8];
    unpack8<T>(v, f);
    for (int i = 0; i < 8; ++i) acc[i] += f[i];
  }
  __device__ static int4 pack(const float *acc) { return pack8<T>(acc); }
  __device__ static float get(const void *p, int64_t i) { return to_f32(((const T *)p)[i]); }
  __device__ static void put(void *p, int64_t i, float v) { ((T *)p)[i] = HalfPair<T>::one(v); }
};
template <>
struct Elems<float> {
  static constexpr int n = 4;
  __device__ static void add(float *acc, int4 v) {
    acc[0] += __int_as_float(v.x), acc[1] += __int_as_float(v.y);
    acc[2] += __int_as_float(v.z), acc[3] += __int_as_float(v.w);
  }
  __device__ static int4 pack(const float *acc) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                     __float_as_int(acc[3]));
  }
  __device__ static float get(const void *p, int64_t i) { return ((const float *)p)[i]; }
  __device__ static void put(void *p, int64_t i, float v) { ((float *)p)[i] = v; }
};

struct CombineArgs {
  Ctl c;
  const char *y;
  const float *y_w;
  const int *send_row;
  char *out;
  float *out_w;
  int T, k, H, vec16; /* vec16: rows are whole 16-byte vectors */
  /* Local (IPC after the push, NCCL after the exchange): rank d's rows for me are at src[d] from
   * row base[d] on, base[d] = rows of ranks before me to d (from cnt_all [R*R]); src[me] = y. */
  const char *src[kMaxRanks];
  const float *src_w[kMaxRanks];
  const int *cnt_all;
};

template <typename T, bool Local>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineArgs a) {
  const Ctl &c = a.c;
  const int R = c.R, me = c.rank, lane = threadIdx.x & 31;
  __shared__ const char *src[kMaxRanks];
  __shared__ const float *src_w[kMaxRanks];
  bool ok = true;
  if (!Local) {
    if (blockIdx.x == 0) {
      if (threadIdx.x < R) {
        Mail &m = c.bufs[threadIdx.x]->mail[me];
        m.ptr[0] = (unsigned long long)a.y;
        m.ptr[1] = (unsigned long long)a.y_w;
      }
      publish(c);
    }
    ok = meet(c);
    if (ok && threadIdx.x < R) {
      const volatile Mail *mail = c.bufs[me]->mail;
      src[threadIdx.x] = (const char *)mail[threadIdx.x].ptr[0];
      src_w[threadIdx.x] = (const float *)mail[threadIdx.x].ptr[1];
    }
  } else if (threadIdx.x < R) {
    /* shift each peer's pointer back by its base: row r of d's numbering is at src[d] + r */
    const int d = threadIdx.x;
    int64_t base = 0;
    if (d != me)
      for (int s = 0; s < me; ++s) base += a.cnt_all[s * R + d];
    const int64_t rb = (int64_t)a.H * sizeof(T);
    src[d] = a.src[d] - base * rb;
    src_w[d] = a.src_w[d] ? a.src_w[d] - base * a.k : nullptr;
  }
  __syncthreads();
  if (ok) {
    using E = Elems<T>;
    constexpr int U = 4; /* 16-byte loads in flight per lane per peer */
    const int64_t row_bytes = (int64_t)a.H * sizeof(T), nv = row_bytes / 16;
    const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
    for (int t = gw; t < a.T; t += nw) {
      const int myrow = lane < R ? a.send_row[(int64_t)t * R + lane] : -1;
      int4 *o = (int4 *)(a.out + (int64_t)t * row_bytes);
      if (a.vec16) {
        for (int64_t base = 0; base < nv; base += 32 * U) {
          float acc[U][E::n];
          for (int u = 0; u < U; ++u)
            for (int i = 0; i < E::n; ++i) acc[u][i] = 0.0f;
          /* peers two at a time: both peers' loads are in flight before the (ordered) sums */
          for (int d = 0; d < R; d += 2) {
            const int r0 = __shfl_sync(0xffffffffu, myrow, d);
            const int r1 = __shfl_sync(0xffffffffu, myrow, d + 1 < R ? d + 1 : d);
            const bool has1 = d + 1 < R && r1 >= 0;
            const int4 *s0 = (const int4 *)(src[d] + (int64_t)r0 * row_bytes);
            const int4 *s1 = has1 ? (const int4 *)(src[d + 1] + (int64_t)r1 * row_bytes) : s0;
            int4 v0[U], v1[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t i = base + u * 32 + lane;
              v0[u] = (r0 >= 0 && i < nv) ? ld_nc(s0 + i) : make_int4(0, 0, 0, 0);
              v1[u] = (has1 && i < nv) ? ld_nc(s1 + i) : make_int4(0, 0, 0, 0);
            }
            if (r0 >= 0)
#pragma unroll
              for (int u = 0; u < U; ++u) E::add(acc[u], v0[u]);
            if (has1)
#pragma unroll
              for (int u = 0; u < U; ++u) E::add(acc[u], v1[u]);
          }
          for (int u = 0; u < U; ++u) {
            const int64_t i = base + u * 32 + lane;
            if (i < nv) o[i] = E::pack(acc[u]);
          }
        }
      } else {
        int rows[kMaxRanks];
        for (int d = 0; d < kMaxRanks; ++d)
          rows[d] = __shfl_sync(0xffffffffu, myrow, d < R ? d : 0);
        for (int64_t h = lane; h < a.H; h += 32) {
          float acc = 0.0f;
          for (int d = 0; d < R; ++d)
            if (rows[d] >= 0) acc += E::get(src[d], (int64_t)rows[d] * a.H + h);
          E::put(a.out, (int64_t)t * a.H + h, acc);
        }
      }
      if (a.out_w) {
        float acc = 0.0f;
        for (int d = 0; d < R; ++d) {
          const int r = __shfl_sync(0xffffffffu, myrow, d);
          if (r >= 0 && lane < a.k) acc += src_w[d][(int64_t)r * a.k + lane];
        }
        if (lane < a.k) a.out_w[(int64_t)t * a.k + lane] = acc;
      }
    }
  }
  if (!Local) leave(c, ok);
}

/* ---- redispatch: pull the g rows of the tokens we received (combine's transpose) ------------- */
struct RedispatchArgs {
  Ctl c;
  const char *g;
  const int *recv_src;
  char *out;
  int T, vec;
  int64_t row_bytes;
  /* mode 0: pull from the peers' g (PEER); 1: from srcs (IPC staging areas), meeting the peers;
   * 2: from srcs, local (NCCL, after the exchange) */
  int mode;
  const char *srcs[kMaxRanks];
};

/* The first index in [0, n) whose key is >= target, n if none, by one warp (32 probes a round:
 * 3 rounds for 32k rows). key = v[i], or "infinite" where v[i] < 0. Whatever v holds, the result
 * is in [0, n] and only v[0..n) is read. */
__device__ int64_t warp_lower_bound(const int *v, int64_t n, int64_t target, int lane) {
  int64_t lo = 0, hi = n; /* the answer is in [lo, hi]; hi is n or an index whose key is >= target */
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32, p = lo + (int64_t)(lane + 1) * step - 1;
    const bool ge = p >= hi || v[p] < 0 || v[p] >= target;
    const unsigned m = __ballot_sync(0xffffffffu, ge);
    if (!m) return hi;
    const int f = __ffs(m) - 1;
    const int64_t pf = lo + (int64_t)(f + 1) * step - 1;
    if (pf < hi) hi = pf;
    if (f > 0) lo += (int64_t)f * step;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) redispatch_kernel(RedispatchArgs a) {
  const Ctl &c = a.c;
  const int R = c.R, me = c.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t N = (int64_t)a.T * R;
  if (blockIdx.x == 0 && a.mode < 2) {
    if (threadIdx.x < R) c.bufs[threadIdx.x]->mail[me].ptr[0] = (unsigned long long)a.g;
    publish(c);
  }
  /* My rows are in (source, token) order, the unused ones (-1) last: warp s finds where source
   * s's rows start (warp R: the unused ones), while the peers arrive. */
  __shared__ int64_t bound[kMaxRanks + 1];
  if (threadIdx.x == 0) bound[0] = 0;
  if (warp >= 1 && warp <= R) {
    const int64_t b = warp_lower_bound(a.recv_src, N, (int64_t)warp * a.T, lane);
    if (lane == 0) bound[warp] = b;
  }
  bool ok = true;
  if (a.mode < 2)
    ok = meet(c);
  else
    __syncthreads();
  __shared__ const char *src[kMaxRanks];
  if (ok && threadIdx.x < R)
    src[threadIdx.x] =
        a.mode == 0 ? (const char *)((const volatile Mail *)c.bufs[me]->mail)[threadIdx.x].ptr[0]
                    : a.srcs[threadIdx.x];
  if (threadIdx.x == 0) /* monotone and in [0, N], whatever recv_src held */
    for (int s = 1; s <= R; ++s)
      bound[s] = bound[s] < bound[s - 1] ? bound[s - 1] : bound[s] > N ? N : bound[s];
  __syncthreads();
  if (ok) {
    const int gw = blockIdx.x * kWarps + warp, nw = gridDim.x * kWarps;
    auto pull = [&](int64_t r) {
      const int from = a.recv_src[r];
      char *o = a.out + r * a.row_bytes;
      if (from < 0 || from >= N) {
        zero_row(o, a.row_bytes, a.vec, lane);
      } else {
        const int s = from / a.T, t = from % a.T;
        any_copy_row(o, src[s] + (int64_t)t * a.row_bytes, a.row_bytes, a.vec, lane);
      }
    };
    /* The sources' rows interleaved (row q of source me+1, of me+2, ..., then row q+1): every
     * source serves every rank at every moment. In row order all ranks would read source 0 first
     * and share its egress while the other links idle. Any bounds (monotone, clamped to [0, N])
     * give a permutation of [0, N): each row is written once. */
    const int64_t *lo = bound;
    int64_t most = 0;
    for (int s = 0; s < R; ++s)
      if (lo[s + 1] - lo[s] > most) most = lo[s + 1] - lo[s];
    for (int64_t j = gw; j < most * R; j += nw) {
      const int s = (me + 1 + (int)(j % R)) % R;
      const int64_t q = j / R;
      if (q < lo[s + 1] - lo[s]) pull(lo[s] + q);
    }
    for (int64_t r = lo[R] + gw; r < N; r += nw) pull(r); /* the unused rows: zeros */
  }
  if (a.mode < 2) leave(c, ok);
}

/* ---- NCCL transport kernels -------------------------------------------------------------------
 * dispatch: every rank sends its whole x, topk_idx and topk_weights (T rows: the fixed worst case)
 * to every peer; each rank then computes every source's layout (layout_multi_kernel) and gathers
 * the rows routed to it. combine: counts per destination, an all-gather of them, the rows of each
 * source packed into T-row blocks, the exchange, then combine_kernel<Local>. */
struct GatherArgs {
  const char *xs[kMaxRanks]; /* source s's x, topk_idx, topk_weights (mine for s == me) */
  const int *idxs[kMaxRanks];
  const float *ws[kMaxRanks];
  const int *pos;  /* [R][T*R] every source's positions (layout_multi_kernel) */
  const int *cnt;  /* [R][R] rows s -> d */
  const int *hist; /* [R][E] slots per expert of every source */
  char *recv_x;
  int *recv_idx, *recv_src, *num_recv, *counts, *send_row;
  float *recv_w;
  int R, me, T, k, E, L, vec;
  int64_t row_bytes;
};

__global__ void __launch_bounds__(kThreads) nccl_gather_kernel(GatherArgs a) {
  __shared__ int lo[kMaxRanks + 1], at_peer[kMaxRanks];
  const int R = a.R, me = a.me, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    int o = 0;
    for (int s = 0; s < R; ++s) {
      lo[s] = o;
      o += a.cnt[s * R + me];
    }
    lo[R] = o;
    for (int d = 0; d < R; ++d) {
      int b = 0;
      for (int s = 0; s < me; ++s) b += a.cnt[s * R + d];
      at_peer[d] = b; /* where my block starts in d's buffer */
    }
  }
  __syncthreads();
  const int64_t N = (int64_t)a.T * R;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  for (int64_t i = gw; i < N; i += nw) {
    const int s = (int)(i / a.T), t = (int)(i % a.T);
    const int p = a.pos[(int64_t)s * N + (int64_t)t * R + me];
    if (p < 0) continue;
    const int64_t row = lo[s] + p;
    any_copy_row(a.recv_x + row * a.row_bytes, a.xs[s] + (int64_t)t * a.row_bytes, a.row_bytes,
                 a.vec, lane);
    int e = lane < a.k ? a.idxs[s][(int64_t)t * a.k + lane] : -1;
    const float wt = lane < a.k ? a.ws[s][(int64_t)t * a.k + lane] : 0.0f;
    e = clean_expert(e, lane, a.k, a.E, nullptr);
    const bool mine = e >= 0 && e / a.L == me;
    if (lane < a.k) {
      a.recv_idx[row * a.k + lane] = mine ? e - me * a.L : -1;
      a.recv_w[row * a.k + lane] = mine ? wt : 0.0f;
    }
    if (lane == 0) a.recv_src[row] = s * a.T + t;
  }
  for (int64_t r = lo[R] + gw; r < N; r += nw) {
    zero_row(a.recv_x + r * a.row_bytes, a.row_bytes, a.vec, lane);
    if (lane < a.k) {
      a.recv_idx[r * a.k + lane] = -1;
      a.recv_w[r * a.k + lane] = 0.0f;
    }
    if (lane == 0) a.recv_src[r] = -1;
  }
  const int tid = blockIdx.x * blockDim.x + threadIdx.x, nt = gridDim.x * blockDim.x;
  for (int64_t i = tid; i < (int64_t)a.T * R; i += nt) {
    const int p = a.pos[(int64_t)me * N + i];
    a.send_row[i] = p >= 0 ? at_peer[i % R] + p : -1;
  }
  for (int e = tid; e < a.L; e += nt) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += a.hist[(int64_t)s * a.E + me * a.L + e];
    a.counts[e] = sum;
  }
  if (tid == 0) *a.num_recv = lo[R];
}

/* combine, NCCL: my rows per destination from send_row (one block). */
__global__ void __launch_bounds__(kThreads)
    count_rows_kernel(const int *send_row, int T, int R, int *out) {
  __shared__ int cnt[kMaxRanks];
  if (threadIdx.x < R) cnt[threadIdx.x] = 0;
  __syncthreads();
  int mine[kMaxRanks];
  for (int d = 0; d < kMaxRanks; ++d) mine[d] = 0;
  for (int64_t i = threadIdx.x; i < (int64_t)T * R; i += blockDim.x)
    if (send_row[i] >= 0) mine[i % R]++;
  for (int d = 0; d < R; ++d)
    if (mine[d]) atomicAdd(&cnt[d], mine[d]);
  __syncthreads();
  if (threadIdx.x < R) out[threadIdx.x] = cnt[threadIdx.x];
}

/* combine, NCCL: source s's rows of y (and y_w) into block s of the send area (T rows each). */
struct PackArgs {
  const char *y;
  const float *y_w;
  const int *cnt_all; /* [R*R] */
  char *send;         /* [R][T rows] */
  float *send_w;      /* [R][T*k] */
  int R, me, T, k, vec;
  int64_t row_bytes;
};

__global__ void __launch_bounds__(kThreads) pack_kernel(PackArgs a) {
  __shared__ int lo[kMaxRanks], num[kMaxRanks];
  if (threadIdx.x == 0) {
    int o = 0;
    for (int s = 0; s < a.R; ++s) {
      lo[s] = o;
      num[s] = a.cnt_all[s * a.R + a.me];
      o += num[s];
    }
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  for (int s = 0; s < a.R; ++s) {
    if (s == a.me) continue;
    for (int i = gw; i < num[s]; i += nw) {
      const int64_t from = lo[s] + i, to = (int64_t)s * a.T + i;
      any_copy_row(a.send + to * a.row_bytes, a.y + from * a.row_bytes, a.row_bytes, a.vec, lane);
      if (a.y_w && lane < a.k) a.send_w[to * a.k + lane] = a.y_w[from * a.k + lane];
    }
  }
}

/* ---- host side ------------------------------------------------------------------------------- */
sl_status cuda_fail(cudaError_t e, const char *op, const char *what) {
  return sl_set_error(SL_STATUS_CUDA_ERROR, "ep %s: %s: %s", op, what, cudaGetErrorString(e));
}

const char *transport_name(int t) {
  return t == SL_EP_TRANSPORT_IPC ? "IPC" : t == SL_EP_TRANSPORT_NCCL ? "NCCL" : "PEER";
}

/* The rank whose device is current. */
sl_status find_rank(sl_ep_comm *c, const char *op, State **st, Rank **rk) {
  *st = (State *)c->cuda;
  if (!*st)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: communicator %lld was set up without CUDA (a CPU mesh?)", op,
                        (long long)c->id);
  if (!(*st)->connected)
    return sl_set_error(
        SL_STATUS_INVALID_ARGUMENT,
        "ep %s: communicator %lld spans processes and is not connected (call "
        "sl_ep_comm_connect after the blob exchange: sluice.ep.setup does this), or "
        "it was disconnected",
        op, (long long)c->id);
  int dev = -1;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cuda_fail(e, op, "cudaGetDevice");
  for (int i = 0; i < (*st)->G * (*st)->R; ++i)
    if ((*st)->ranks[i].local && (*st)->ranks[i].ordinal == dev) {
      *rk = &(*st)->ranks[i];
      return SL_STATUS_SUCCESS;
    }
  return sl_set_error(
      SL_STATUS_INVALID_ARGUMENT,
      "ep %s: device %d is not part of communicator %lld in this process (set up for another "
      "mesh?)",
      op, dev, (long long)c->id);
}

/* The previous calls' device-side (or NCCL watchdog) failures, seen from the host. */
sl_status check_device_error(sl_ep_comm *c, State *st, Rank *rk, const char *op) {
  for (int i = 0; i < st->G * st->R; ++i) {
    const Rank *q = &st->ranks[i];
    if (!q->local) continue;
    char msg[512];
    if (q->nccl && ep_nccl_failed(q->nccl, msg, sizeof msg))
      return sl_set_error(SL_STATUS_TIMEOUT, "%s (seen at ep %s on communicator %lld)", msg, op,
                          (long long)c->id);
    const volatile EpErr *e = q->err_host;
    if (e->code == 0) continue;
    const char *what = e->phase == 1 ? "to arrive" : "to finish with its buffers";
    char who[32];
    if (e->waited_for >= 0)
      snprintf(who, sizeof who, "rank %d", e->waited_for);
    else
      snprintf(who, sizeof who, "every peer");
    return sl_set_error(
        SL_STATUS_TIMEOUT,
        "ep %s: rank %d of group %d (device %d) waited %.3g s at call #%llu for %s %s; "
        "communicator %lld is broken (set it up again)",
        op, e->rank, q->group, q->ordinal, (double)st->timeout_ns * 1e-9,
        (unsigned long long)e->seq, who, what, (long long)c->id);
  }
  (void)rk;
  return SL_STATUS_SUCCESS;
}

sl_status check_cuda_desc(const State *st, const sl_ep_desc *d, const char *op) {
  if (d == NULL || d->struct_size < sizeof(sl_ep_desc))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: bad desc (struct_size)", op);
  if (d->num_ranks != st->R)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: desc->num_ranks=%lld, communicator has %d", op,
                        (long long)d->num_ranks, st->R);
  if (d->num_tokens < 0 || d->hidden < 0 || d->topk < 1 || d->topk > kMaxTopk ||
      d->num_experts < 1 || d->num_experts % d->num_ranks || d->num_experts > kMaxExperts ||
      d->num_experts / d->num_ranks > kMaxLocal || d->num_tokens * d->num_ranks > INT32_MAX)
    return sl_set_error(SL_STATUS_UNSUPPORTED,
                        "ep %s: the CUDA transport needs 1 <= k <= %d, E <= %d a multiple of R, "
                        "E/R <= %d; got T=%lld H=%lld k=%lld E=%lld R=%lld",
                        op, kMaxTopk, kMaxExperts, kMaxLocal, (long long)d->num_tokens,
                        (long long)d->hidden, (long long)d->topk, (long long)d->num_experts,
                        (long long)d->num_ranks);
  if (d->dtype != SL_DTYPE_F32 && d->dtype != SL_DTYPE_BF16 && d->dtype != SL_DTYPE_F16)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: rows must be f32, bf16 or f16", op);
  return SL_STATUS_SUCCESS;
}

Ctl make_ctl(const State *st, Rank *rk) {
  Ctl c;
  memset(&c, 0, sizeof c);
  for (int r = 0; r < st->R; ++r) c.bufs[r] = rk->peer[r];
  c.err = rk->err_dev;
  c.rank = rk->rank;
  c.R = st->R;
  c.blocks = st->blocks;
  c.seq = ++rk->seq;
  c.timeout_ns = st->timeout_ns;
  return c;
}

int vec_of(int64_t row_bytes) { return row_bytes % 16 == 0 ? 16 : row_bytes % 4 == 0 ? 4 : 2; }

int64_t align16(int64_t v) { return (v + 15) & ~(int64_t)15; }

/* Staging offsets (bytes). IPC: rows [n rows], idx [n*k], w [n*k], src [n] with n = N; NCCL adds
 * a second set of areas (send side) and the layout scratch, see nccl_areas. */
struct Areas {
  int64_t rows, idx, w, src, total;
};
Areas areas(int64_t n, int64_t row_bytes, int64_t k, int64_t at) {
  Areas a;
  a.rows = at;
  a.idx = align16(a.rows + n * row_bytes);
  a.w = align16(a.idx + n * k * 4);
  a.src = align16(a.w + n * k * 4);
  a.total = align16(a.src + n * 4);
  return a;
}

sl_status need_stage(const State *st, int64_t bytes, const char *op) {
  if ((uint64_t)bytes <= st->stage_bytes) return SL_STATUS_SUCCESS;
  return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                      "ep %s: the %s transport needs %lld bytes of staging per rank for these "
                      "shapes; the communicator has %zu (sluice.ep.setup(..., buffer_bytes=%lld) "
                      "or more)",
                      op, transport_name(st->transport), (long long)bytes, st->stage_bytes,
                      (long long)bytes);
}

/* After the launches: the launch status, and with SLUICE_DEBUG=1 a synchronisation and the checks.
 */
sl_status finish(sl_ep_comm *c, State *st, Rank *rk, cudaStream_t s, const char *op) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_fail(e, op, "kernel launch");
  if (!sl_debug_enabled()) return SL_STATUS_SUCCESS;
  e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) return cuda_fail(e, op, "cudaStreamSynchronize (SLUICE_DEBUG)");
  sl_status r = check_device_error(c, st, rk, op);
  if (r) return r;
  if (rk->err_host->bad_ids) {
    const int n = rk->err_host->bad_ids;
    rk->err_host->bad_ids = 0;
    return sl_set_error(
        SL_STATUS_INVALID_VALUE,
        "ep %s: rank %d: %d topk_idx slot(s) outside [-1, E) or repeating an expert of "
        "the same token (treated as -1; SLUICE_DEBUG=1 reports them)",
        op, rk->rank, n);
  }
  return SL_STATUS_SUCCESS;
}

sl_status begin(int64_t comm_id, const sl_ep_desc *d, const char *op, sl_ep_comm **c, State **st,
                Rank **rk) {
  *c = ep_comm_get(comm_id, op);
  if (!*c) return SL_STATUS_INVALID_ARGUMENT;
  sl_status r = find_rank(*c, op, st, rk);
  if (r) return r;
  if ((r = check_cuda_desc(*st, d, op))) return r;
  return check_device_error(*c, *st, *rk, op);
}

State *state_of(sl_ep_comm *c) { return (State *)c->cuda; }

/* Unmaps the peers, ends NCCL, after this process's devices are idle. */
void disconnect(State *st) {
  int prev = 0;
  cudaGetDevice(&prev);
  for (int i = 0; i < st->G * st->R; ++i) {
    Rank *rk = &st->ranks[i];
    if (!rk->local || cudaSetDevice(rk->ordinal) != cudaSuccess) continue;
    cudaDeviceSynchronize();
    for (int r = 0; r < st->R; ++r)
      if (rk->imported[r]) {
        cudaIpcCloseMemHandle(rk->peer[r]);
        rk->imported[r] = 0;
        rk->peer[r] = NULL;
      }
    ep_nccl_destroy(rk->nccl);
    rk->nccl = NULL;
  }
  cudaGetLastError();
  cudaSetDevice(prev);
  st->connected = 0;
}

}  // namespace
}  // namespace sluice_cuda
using namespace sluice_cuda;

/* ---- attach / detach (called by sl_ep_comm_create / destroy) -----------------------------------
 */
extern "C" sl_status ep_cuda_attach(sl_ep_comm *c, const sl_ep_comm_desc *desc) {
  if (desc->num_ranks > kMaxRanks)
    return sl_set_error(
        SL_STATUS_UNSUPPORTED,
        "ep_comm_create: the CUDA transports support up to %d ranks per group, got %d", kMaxRanks,
        desc->num_ranks);
  if (!desc->device_ordinals)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep_comm_create: use_cuda needs device_ordinals");
  const int n = desc->num_groups * desc->num_ranks;
  int multi = 0, nlocal = 0;
  for (int i = 0; i < n; ++i) {
    if (desc->device_ordinals[i] < 0)
      multi = 1;
    else
      ++nlocal;
    for (int j = 0; j < i; ++j)
      if (desc->device_ordinals[i] >= 0 && desc->device_ordinals[i] == desc->device_ordinals[j])
        return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                            "ep_comm_create: device %d holds two ranks (%d and %d); one rank per "
                            "device",
                            desc->device_ordinals[i], j, i);
  }
  if (nlocal == 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep_comm_create: no rank on this process (every device_ordinal is -1)");
  if (multi && desc->transport == SL_EP_TRANSPORT_PEER)
    return sl_set_error(
        SL_STATUS_INVALID_ARGUMENT,
        "ep_comm_create: ranks of other processes (device_ordinals -1) need the IPC "
        "or the NCCL transport, not PEER");
  if (desc->transport == SL_EP_TRANSPORT_NCCL) {
    sl_status ld = ep_nccl_load("comm_create");
    if (ld) return ld;
  }
  int prev = 0;
  cudaGetDevice(&prev);
  State *st = (State *)calloc(1, sizeof(State));
  st->G = desc->num_groups;
  st->R = desc->num_ranks;
  st->blocks = c->num_sms;
  st->transport = desc->transport;
  st->multi = multi;
  st->timeout_s = desc->timeout_s;
  st->timeout_ns = (long long)(desc->timeout_s * 1e9);
  st->stage_bytes = desc->transport == SL_EP_TRANSPORT_PEER ? 0
                    : desc->buffer_bytes                    ? desc->buffer_bytes
                                                            : ((size_t)256 << 20);
  st->ranks = (Rank *)calloc((size_t)n, sizeof(Rank));
  c->cuda = st;
  sl_status result = SL_STATUS_SUCCESS;
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    Rank *rk = &st->ranks[i];
    rk->ordinal = desc->device_ordinals[i];
    rk->group = i / st->R;
    rk->rank = i % st->R;
    rk->local = rk->ordinal >= 0;
    if (!rk->local) continue;
    cudaError_t e = cudaSetDevice(rk->ordinal);
    const size_t own =
        st->transport == SL_EP_TRANSPORT_IPC ? kHdr + st->stage_bytes : sizeof(EpBuf);
    if (e == cudaSuccess) e = cudaMalloc(&rk->buf, own);
    if (e == cudaSuccess) e = cudaMemset(rk->buf, 0, sizeof(EpBuf));
    if (e == cudaSuccess && st->transport == SL_EP_TRANSPORT_IPC)
      rk->stage = (char *)rk->buf + kHdr;
    if (e == cudaSuccess && st->transport == SL_EP_TRANSPORT_NCCL)
      e = cudaMalloc(&rk->stage, st->stage_bytes);
    if (e == cudaSuccess) e = cudaMalloc(&rk->send_counts, sizeof(int) * kMaxRanks);
    if (e == cudaSuccess) e = cudaMalloc(&rk->expert_hist, sizeof(int) * kMaxExperts);
    if (e == cudaSuccess) e = cudaMalloc(&rk->chunk_cnt, sizeof(int) * kMaxChunks * kMaxRanks);
    if (e == cudaSuccess) e = cudaMalloc(&rk->cnt_all, sizeof(int) * kMaxRanks * kMaxRanks);
    int sms = 0;
    if (e == cudaSuccess)
      e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, rk->ordinal);
    rk->local_blocks = sms > st->blocks ? sms : st->blocks;
    if (e == cudaSuccess)
      e = cudaHostAlloc(&rk->err_host, sizeof(EpErr), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e == cudaSuccess) {
      memset(rk->err_host, 0, sizeof(EpErr));
      e = cudaHostGetDevicePointer(&rk->err_dev, rk->err_host, 0);
    }
    if (e != cudaSuccess)
      result = sl_set_error(SL_STATUS_CUDA_ERROR,
                            "ep comm_create: allocating device %d's buffers (%zu bytes of staging "
                            "for the %s transport): %s",
                            rk->ordinal, st->stage_bytes, transport_name(st->transport),
                            cudaGetErrorString(e));
  }
  /* Peer access between every pair of local devices of a group (both directions), and the views of
   * the local buffers. */
  for (int g = 0; g < st->G && result == SL_STATUS_SUCCESS; ++g)
    for (int a = 0; a < st->R && result == SL_STATUS_SUCCESS; ++a)
      for (int b = 0; b < st->R && result == SL_STATUS_SUCCESS; ++b) {
        Rank *ra = &st->ranks[g * st->R + a], *rb = &st->ranks[g * st->R + b];
        if (!ra->local || !rb->local) continue;
        ra->peer[b] = rb->buf;
        const int da = ra->ordinal, db = rb->ordinal;
        if (da == db || st->transport == SL_EP_TRANSPORT_NCCL) continue;
        int can = 0;
        cudaDeviceCanAccessPeer(&can, da, db);
        if (!can) {
          result =
              sl_set_error(SL_STATUS_UNSUPPORTED,
                           "ep_comm_create: device %d cannot access device %d's memory (no peer "
                           "access: the %s transport needs it; try NCCL)",
                           da, db, transport_name(st->transport));
          break;
        }
        cudaSetDevice(da);
        cudaError_t e = cudaDeviceEnablePeerAccess(db, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
          e = cudaSuccess;
        }
        if (e != cudaSuccess) result = cuda_fail(e, "comm_create", "cudaDeviceEnablePeerAccess");
      }
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    if (!st->ranks[i].local) continue;
    cudaSetDevice(st->ranks[i].ordinal);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) result = cuda_fail(e, "comm_create", "cudaDeviceSynchronize");
  }
  cudaSetDevice(prev);
  /* One process, PEER or IPC: nothing to exchange. IPC and NCCL across processes (and NCCL in one
   * process) connect after the blob exchange. */
  st->connected = !multi && st->transport != SL_EP_TRANSPORT_NCCL;
  return result; /* on failure the caller frees through ep_cuda_detach */
}

extern "C" void ep_cuda_detach(sl_ep_comm *c) {
  State *st = (State *)c->cuda;
  if (!st) return;
  disconnect(st);
  int prev = 0;
  cudaGetDevice(&prev);
  for (int i = 0; i < st->G * st->R; ++i) {
    Rank *rk = &st->ranks[i];
    if (!rk->local || cudaSetDevice(rk->ordinal) != cudaSuccess) continue;
    cudaDeviceSynchronize();
    cudaFree(rk->buf);
    if (st->transport == SL_EP_TRANSPORT_NCCL) cudaFree(rk->stage);
    cudaFree(rk->send_counts);
    cudaFree(rk->expert_hist);
    cudaFree(rk->chunk_cnt);
    cudaFree(rk->cnt_all);
    if (rk->err_host) cudaFreeHost(rk->err_host);
  }
  cudaGetLastError();
  cudaSetDevice(prev);
  free(st->ranks);
  free(st);
  c->cuda = NULL;
}

/* ---- multi-process setup ------------------------------------------------------------------------
 */
static int group_has_local(const State *st, int g) {
  for (int r = 0; r < st->R; ++r)
    if (st->ranks[g * st->R + r].local) return 1;
  return 0;
}

extern "C" sl_status ep_cuda_export(sl_ep_comm *c, int group, int rank, void *blob, size_t *bytes) {
  State *st = state_of(c);
  Rank *rk = &st->ranks[group * st->R + rank];
  *bytes = 0;
  if (!rk->local)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_export: (group %d, rank %d) belongs to another process", group,
                        rank);
  if (st->transport == SL_EP_TRANSPORT_PEER)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_export: the PEER transport has nothing to export (one process)");
  if (st->transport == SL_EP_TRANSPORT_IPC) {
    static_assert(sizeof(cudaIpcMemHandle_t) <= SL_EP_BLOB_BYTES, "blob size");
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(rk->ordinal);
    cudaIpcMemHandle_t h;
    cudaError_t e = cudaIpcGetMemHandle(&h, rk->buf);
    cudaSetDevice(prev);
    if (e != cudaSuccess) return cuda_fail(e, "comm_export", "cudaIpcGetMemHandle");
    memcpy(blob, &h, sizeof h);
    *bytes = sizeof h;
    return SL_STATUS_SUCCESS;
  }
  if (rank != 0) return SL_STATUS_SUCCESS; /* NCCL: rank 0 of each group makes the id */
  if (!rk->have_id) {
    sl_status s = ep_nccl_unique_id(rk->id);
    if (s) return s;
    rk->have_id = 1;
    for (int r = 1; r < st->R; ++r) { /* the other local ranks of the group share it */
      Rank *q = &st->ranks[group * st->R + r];
      memcpy(q->id, rk->id, EP_NCCL_ID_BYTES);
      q->have_id = 1;
    }
  }
  memcpy(blob, rk->id, EP_NCCL_ID_BYTES);
  *bytes = EP_NCCL_ID_BYTES;
  return SL_STATUS_SUCCESS;
}

extern "C" sl_status ep_cuda_needs(sl_ep_comm *c, int group, int rank, int *needed) {
  State *st = state_of(c);
  const Rank *rk = &st->ranks[group * st->R + rank];
  *needed = 0;
  if (rk->local || !group_has_local(st, group)) return SL_STATUS_SUCCESS;
  if (st->transport == SL_EP_TRANSPORT_IPC) *needed = 1;
  if (st->transport == SL_EP_TRANSPORT_NCCL) *needed = rank == 0;
  return SL_STATUS_SUCCESS;
}

extern "C" sl_status ep_cuda_import(sl_ep_comm *c, int group, int rank, const void *blob,
                                    size_t bytes) {
  State *st = state_of(c);
  int needed = 0;
  ep_cuda_needs(c, group, rank, &needed);
  if (!needed)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_import: (group %d, rank %d) is not needed here (it is local, its "
                        "group has no rank in this process, or the %s transport does not use it)",
                        group, rank, transport_name(st->transport));
  if (st->transport == SL_EP_TRANSPORT_NCCL) {
    if (bytes != EP_NCCL_ID_BYTES)
      return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                          "ep comm_import: an NCCL id has %d bytes, got %zu", EP_NCCL_ID_BYTES,
                          bytes);
    for (int r = 0; r < st->R; ++r) {
      Rank *q = &st->ranks[group * st->R + r];
      memcpy(q->id, blob, EP_NCCL_ID_BYTES);
      q->have_id = 1;
    }
    return SL_STATUS_SUCCESS;
  }
  if (bytes != sizeof(cudaIpcMemHandle_t))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_import: a CUDA IPC handle has %zu bytes, got %zu",
                        sizeof(cudaIpcMemHandle_t), bytes);
  cudaIpcMemHandle_t h;
  memcpy(&h, blob, sizeof h);
  int prev = 0;
  cudaGetDevice(&prev);
  sl_status result = SL_STATUS_SUCCESS;
  for (int a = 0; a < st->R && result == SL_STATUS_SUCCESS; ++a) {
    Rank *q = &st->ranks[group * st->R + a];
    if (!q->local || q->imported[rank]) continue;
    cudaSetDevice(q->ordinal);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      result = sl_set_error(SL_STATUS_CUDA_ERROR,
                            "ep comm_import: mapping the buffer of (group %d, rank %d) on device "
                            "%d: cudaIpcOpenMemHandle: %s (are both GPUs on this host, with peer "
                            "access? else use the NCCL transport)",
                            group, rank, q->ordinal, cudaGetErrorString(e));
      cudaGetLastError();
      break;
    }
    q->peer[rank] = (EpBuf *)p;
    q->imported[rank] = 1;
  }
  cudaSetDevice(prev);
  return result;
}

extern "C" sl_status ep_cuda_connect(sl_ep_comm *c) {
  State *st = state_of(c);
  if (st->connected) return SL_STATUS_SUCCESS;
  const int n = st->G * st->R;
  if (st->transport == SL_EP_TRANSPORT_IPC) {
    for (int i = 0; i < n; ++i) {
      const Rank *rk = &st->ranks[i];
      if (!rk->local) continue;
      for (int r = 0; r < st->R; ++r)
        if (!rk->peer[r])
          return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                              "ep comm_connect: the buffer of (group %d, rank %d) was never "
                              "imported (sl_ep_comm_import)",
                              rk->group, r);
    }
    st->connected = 1;
    return SL_STATUS_SUCCESS;
  }
  int *ord = (int *)calloc((size_t)n, sizeof(int)), *rks = (int *)calloc((size_t)n, sizeof(int)),
      *grp = (int *)calloc((size_t)n, sizeof(int));
  unsigned char *ids = (unsigned char *)calloc((size_t)n, EP_NCCL_ID_BYTES);
  ep_nccl **hs = (ep_nccl **)calloc((size_t)n, sizeof(ep_nccl *));
  int m = 0;
  sl_status result = SL_STATUS_SUCCESS;
  if (!ord || !rks || !grp || !ids || !hs)
    result = sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep comm_connect: out of memory");
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    const Rank *rk = &st->ranks[i];
    if (!rk->local) continue;
    if (!rk->have_id) {
      result = sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                            "ep comm_connect: group %d has no NCCL id yet (export it from the "
                            "process of its rank 0 and import it here)",
                            rk->group);
      break;
    }
    ord[m] = rk->ordinal, rks[m] = rk->rank, grp[m] = rk->group;
    memcpy(ids + (size_t)m * EP_NCCL_ID_BYTES, rk->id, EP_NCCL_ID_BYTES);
    ++m;
  }
  if (result == SL_STATUS_SUCCESS)
    result = ep_nccl_init(m, ord, rks, grp, st->R, ids, st->timeout_s, hs);
  if (result == SL_STATUS_SUCCESS) {
    m = 0;
    for (int i = 0; i < n; ++i)
      if (st->ranks[i].local) st->ranks[i].nccl = hs[m++];
    st->connected = 1;
  }
  free(ord), free(rks), free(grp), free(ids), free(hs);
  return result;
}

extern "C" sl_status ep_cuda_disconnect(sl_ep_comm *c) {
  disconnect(state_of(c));
  return SL_STATUS_SUCCESS;
}

/* ---- the NCCL transport's ops ------------------------------------------------------------------
 */
namespace {

sl_status nccl_dispatch(State *st, Rank *rk, const sl_ep_desc *d, const void *x,
                        const int32_t *topk_idx, const float *topk_w, void *recv_x,
                        int32_t *recv_idx, float *recv_w, int32_t *num_recv, int32_t *counts,
                        int32_t *send_row, int32_t *recv_src, cudaStream_t s) {
  const char *op = "dispatch";
  const int R = st->R, me = rk->rank;
  const int64_t T = d->num_tokens, k = d->topk, E = d->num_experts, L = E / R;
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  /* recv: [R][T rows], [R][T*k] idx, [R][T*k] w; layout: pos [R][T*R], cnt [R][R], hist [R][E] */
  const Areas in = areas(R * T, rb, k, 0);
  const int64_t pos_at = in.total, cnt_at = align16(pos_at + (int64_t)R * T * R * 4),
                hist_at = align16(cnt_at + (int64_t)R * R * 4),
                total = align16(hist_at + (int64_t)R * E * 4);
  sl_status r = need_stage(st, total, op);
  if (r) return r;
  char *b = rk->stage;
  const unsigned long long call = ++rk->seq;
  ep_xfer sends[3 * kMaxRanks], recvs[3 * kMaxRanks];
  int ns = 0, nr = 0;
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    sends[ns++] = {(void *)x, (size_t)(T * rb), p};
    sends[ns++] = {(void *)topk_idx, (size_t)(T * k * 4), p};
    sends[ns++] = {(void *)topk_w, (size_t)(T * k * 4), p};
    recvs[nr++] = {b + in.rows + p * T * rb, (size_t)(T * rb), p};
    recvs[nr++] = {b + in.idx + p * T * k * 4, (size_t)(T * k * 4), p};
    recvs[nr++] = {b + in.w + p * T * k * 4, (size_t)(T * k * 4), p};
  }
  if ((r = ep_nccl_exchange(rk->nccl, s, sends, ns, recvs, nr, op, call))) return r;
  LayoutMulti lm;
  memset(&lm, 0, sizeof lm);
  GatherArgs g;
  memset(&g, 0, sizeof g);
  for (int src = 0; src < R; ++src) {
    LayoutArgs &la = lm.src[src];
    la.idx = src == me ? topk_idx : (const int *)(b + in.idx + src * T * k * 4);
    la.send_row = (int *)(b + pos_at) + (int64_t)src * T * R;
    la.send_counts = (int *)(b + cnt_at) + src * R;
    la.expert_hist = (int *)(b + hist_at) + (int64_t)src * E;
    la.bad = src == me ? &rk->err_dev->bad_ids : nullptr;
    la.T = (int)T, la.k = (int)k, la.E = (int)E, la.L = (int)L, la.R = R;
    g.xs[src] = src == me ? (const char *)x : b + in.rows + src * T * rb;
    g.idxs[src] = la.idx;
    g.ws[src] = src == me ? topk_w : (const float *)(b + in.w + src * T * k * 4);
  }
  layout_multi_kernel<<<R, 1024, 0, s>>>(lm);
  g.pos = (const int *)(b + pos_at);
  g.cnt = (const int *)(b + cnt_at);
  g.hist = (const int *)(b + hist_at);
  g.recv_x = (char *)recv_x, g.recv_idx = recv_idx, g.recv_src = recv_src;
  g.num_recv = num_recv, g.counts = counts, g.send_row = send_row, g.recv_w = recv_w;
  g.R = R, g.me = me, g.T = (int)T, g.k = (int)k, g.E = (int)E, g.L = (int)L;
  g.row_bytes = rb, g.vec = vec_of(rb);
  nccl_gather_kernel<<<rk->local_blocks, kThreads, 0, s>>>(g);
  return SL_STATUS_SUCCESS;
}

template <typename T>
void launch_local_combine(int blocks, cudaStream_t s, const CombineArgs &a) {
  combine_kernel<T, true><<<blocks, kThreads, 0, s>>>(a);
}

void local_combine(sl_dtype t, int blocks, cudaStream_t s, const CombineArgs &a) {
  if (t == SL_DTYPE_BF16)
    launch_local_combine<__nv_bfloat16>(blocks, s, a);
  else if (t == SL_DTYPE_F16)
    launch_local_combine<__half>(blocks, s, a);
  else
    launch_local_combine<float>(blocks, s, a);
}

sl_status nccl_combine(State *st, Rank *rk, const sl_ep_desc *d, const void *y, const float *y_w,
                       const int32_t *send_row, void *out, float *out_w, cudaStream_t s) {
  const char *op = "combine";
  const int R = st->R, me = rk->rank;
  const int64_t T = d->num_tokens, k = y_w ? d->topk : 0;
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  /* send: [R][T rows], [R][T*k] w; recv the same; then my counts [R] and everyone's [R][R] */
  const int64_t snd = 0, snd_w = align16(snd + R * T * rb), rcv = align16(snd_w + R * T * k * 4),
                rcv_w = align16(rcv + R * T * rb), mine_at = align16(rcv_w + R * T * k * 4),
                all_at = align16(mine_at + R * 4), total = align16(all_at + R * R * 4);
  sl_status r = need_stage(st, total, op);
  if (r) return r;
  char *b = rk->stage;
  const unsigned long long call = ++rk->seq;
  int *mine = (int *)(b + mine_at), *all = (int *)(b + all_at);
  count_rows_kernel<<<1, kThreads, 0, s>>>(send_row, (int)T, R, mine);
  if ((r = ep_nccl_allgather(rk->nccl, s, mine, all, (size_t)R * 4, op, call))) return r;
  PackArgs pa;
  memset(&pa, 0, sizeof pa);
  pa.y = (const char *)y, pa.y_w = y_w, pa.cnt_all = all;
  pa.send = b + snd, pa.send_w = (float *)(b + snd_w);
  pa.R = R, pa.me = me, pa.T = (int)T, pa.k = (int)k, pa.row_bytes = rb, pa.vec = vec_of(rb);
  pack_kernel<<<rk->local_blocks, kThreads, 0, s>>>(pa);
  ep_xfer sends[2 * kMaxRanks], recvs[2 * kMaxRanks];
  int ns = 0, nr = 0;
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    sends[ns++] = {b + snd + p * T * rb, (size_t)(T * rb), p};
    recvs[nr++] = {b + rcv + p * T * rb, (size_t)(T * rb), p};
    if (y_w) {
      sends[ns++] = {b + snd_w + p * T * k * 4, (size_t)(T * k * 4), p};
      recvs[nr++] = {b + rcv_w + p * T * k * 4, (size_t)(T * k * 4), p};
    }
  }
  if ((r = ep_nccl_exchange(rk->nccl, s, sends, ns, recvs, nr, op, call))) return r;
  CombineArgs a;
  memset(&a, 0, sizeof a);
  a.c.rank = me, a.c.R = R;
  a.y = (const char *)y, a.y_w = y_w, a.send_row = send_row, a.out = (char *)out, a.out_w = out_w;
  a.T = (int)T, a.k = (int)k, a.H = (int)d->hidden, a.vec16 = rb % 16 == 0;
  for (int p = 0; p < R; ++p) {
    a.src[p] = p == me ? (const char *)y : b + rcv + p * T * rb;
    a.src_w[p] = !y_w ? nullptr : p == me ? y_w : (const float *)(b + rcv_w + p * T * k * 4);
  }
  a.cnt_all = all;
  local_combine(d->dtype, rk->local_blocks, s, a);
  return SL_STATUS_SUCCESS;
}

sl_status nccl_redispatch(State *st, Rank *rk, const sl_ep_desc *d, const void *g,
                          const int32_t *recv_src, void *out, cudaStream_t s) {
  const char *op = "redispatch";
  const int R = st->R, me = rk->rank;
  const int64_t T = d->num_tokens, rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  sl_status r = need_stage(st, R * T * rb, op);
  if (r) return r;
  char *b = rk->stage;
  const unsigned long long call = ++rk->seq;
  ep_xfer sends[kMaxRanks], recvs[kMaxRanks];
  int ns = 0, nr = 0;
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    sends[ns++] = {(void *)g, (size_t)(T * rb), p};
    recvs[nr++] = {b + p * T * rb, (size_t)(T * rb), p};
  }
  if ((r = ep_nccl_exchange(rk->nccl, s, sends, ns, recvs, nr, op, call))) return r;
  RedispatchArgs a;
  memset(&a, 0, sizeof a);
  a.c.rank = me, a.c.R = R;
  a.g = (const char *)g, a.recv_src = recv_src, a.out = (char *)out;
  a.T = (int)T, a.row_bytes = rb, a.vec = vec_of(rb), a.mode = 2;
  for (int p = 0; p < R; ++p) a.srcs[p] = p == me ? (const char *)g : b + p * T * rb;
  redispatch_kernel<<<rk->local_blocks, kThreads, 0, s>>>(a);
  return SL_STATUS_SUCCESS;
}

}  // namespace

/* ---- public entry points ----------------------------------------------------------------------
 */
extern "C" sl_status sl_ep_dispatch_cuda(int64_t comm_id, const sl_ep_desc *d, const void *x,
                                         const int32_t *topk_idx, const float *topk_w, void *recv_x,
                                         int32_t *recv_idx, float *recv_w, int32_t *num_recv,
                                         int32_t *counts, int32_t *send_row, int32_t *recv_src,
                                         void *stream) {
  const char *op = "dispatch";
  sl_ep_comm *c;
  State *st;
  Rank *rk;
  sl_status r = begin(comm_id, d, op, &c, &st, &rk);
  if (r) return r;
  cudaStream_t s = (cudaStream_t)stream;
  const int L = (int)(d->num_experts / d->num_ranks);
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  if (st->transport == SL_EP_TRANSPORT_NCCL) {
    r = nccl_dispatch(st, rk, d, x, topk_idx, topk_w, recv_x, recv_idx, recv_w, num_recv, counts,
                      send_row, recv_src, s);
    return r ? r : finish(c, st, rk, s, op);
  }
  const int64_t N = d->num_tokens * st->R;
  const Areas ar = areas(N, rb, d->topk, 0);
  if (st->transport == SL_EP_TRANSPORT_IPC && (r = need_stage(st, ar.total, op))) return r;
  LayoutArgs la = {topk_idx,
                   send_row,
                   rk->send_counts,
                   rk->expert_hist,
                   &rk->err_dev->bad_ids,
                   (int)d->num_tokens,
                   (int)d->topk,
                   (int)d->num_experts,
                   L,
                   st->R};
  cudaError_t le = launch_layout(la, rk->chunk_cnt, s);
  if (le != cudaSuccess) return cuda_fail(le, op, "layout launch");
  DispatchArgs a;
  memset(&a, 0, sizeof a);
  a.c = make_ctl(st, rk);
  a.x = (const char *)x;
  a.idx = topk_idx;
  a.w = topk_w;
  a.send_row = send_row;
  a.send_counts = rk->send_counts;
  a.expert_hist = rk->expert_hist;
  a.recv_x = (char *)recv_x;
  a.recv_idx = recv_idx;
  a.recv_w = recv_w;
  a.recv_src = recv_src;
  a.num_recv = num_recv;
  a.counts = counts;
  a.T = (int)d->num_tokens;
  a.k = (int)d->topk;
  a.E = (int)d->num_experts;
  a.L = L;
  a.row_bytes = rb;
  a.vec = vec_of(a.row_bytes);
  if (st->transport == SL_EP_TRANSPORT_IPC) {
    a.staged = 1;
    for (int p = 0; p < st->R; ++p) a.stage[p] = (char *)rk->peer[p] + kHdr;
    a.st_idx = ar.idx, a.st_w = ar.w, a.st_src = ar.src;
    a.cnt_all = rk->cnt_all;
  }
  dispatch_kernel<<<st->blocks, kThreads, 0, s>>>(a);
  if (st->transport == SL_EP_TRANSPORT_IPC) {
    CopyOutArgs co;
    memset(&co, 0, sizeof co);
    co.stage = rk->stage;
    co.st_idx = ar.idx, co.st_w = ar.w, co.st_src = ar.src;
    co.cnt_all = rk->cnt_all;
    co.recv_x = (char *)recv_x, co.recv_idx = recv_idx, co.recv_src = recv_src, co.recv_w = recv_w;
    co.R = st->R, co.me = rk->rank, co.T = (int)d->num_tokens, co.k = (int)d->topk;
    co.row_bytes = rb, co.vec = vec_of(rb);
    copy_out_kernel<<<rk->local_blocks, kThreads, 0, s>>>(co);
  }
  return finish(c, st, rk, s, op);
}

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

extern "C" sl_status sl_ep_combine_cuda(int64_t comm_id, const sl_ep_desc *d, const void *y,
                                        const float *y_w, const int32_t *send_row, void *out,
                                        float *out_w, void *stream) {
  const char *op = "combine";
  sl_ep_comm *c;
  State *st;
  Rank *rk;
  sl_status r = begin(comm_id, d, op, &c, &st, &rk);
  if (r) return r;
  cudaStream_t s = (cudaStream_t)stream;
  if (st->transport == SL_EP_TRANSPORT_NCCL) {
    r = nccl_combine(st, rk, d, y, y_w, send_row, out, out_w, s);
    return r ? r : finish(c, st, rk, s, op);
  }
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  CombineArgs a;
  memset(&a, 0, sizeof a);
  a.c = make_ctl(st, rk);
  a.y = (const char *)y;
  a.y_w = y_w;
  a.send_row = send_row;
  a.out = (char *)out;
  a.out_w = out_w;
  a.T = (int)d->num_tokens;
  a.k = y_w ? (int)d->topk : 0;
  a.H = (int)d->hidden;
  a.vec16 = rb % 16 == 0;
  if (st->transport == SL_EP_TRANSPORT_IPC) {
    const int64_t N = d->num_tokens * st->R;
    const Areas ar = areas(N, rb, a.k, 0);
    if ((r = need_stage(st, ar.total, op))) return r;
    PushArgs pa;
    memset(&pa, 0, sizeof pa);
    pa.c = a.c;
    pa.y = (const char *)y, pa.y_w = y_w, pa.send_row = send_row;
    for (int p = 0; p < st->R; ++p) pa.stage[p] = (char *)rk->peer[p] + kHdr;
    pa.st_w = ar.w, pa.cnt_all = rk->cnt_all;
    pa.T = (int)d->num_tokens, pa.k = a.k, pa.row_bytes = rb, pa.vec = vec_of(rb);
    combine_push_kernel<<<st->blocks, kThreads, 0, s>>>(pa);
    for (int p = 0; p < st->R; ++p) {
      a.src[p] = p == rk->rank ? (const char *)y : rk->stage + p * d->num_tokens * rb;
      a.src_w[p] = !y_w            ? nullptr
                   : p == rk->rank ? y_w
                                   : (const float *)(rk->stage + ar.w) + p * d->num_tokens * a.k;
    }
    a.cnt_all = rk->cnt_all;
    local_combine(d->dtype, rk->local_blocks, s, a);
    return finish(c, st, rk, s, op);
  }
  if (d->dtype == SL_DTYPE_BF16)
    combine_kernel<__nv_bfloat16, false><<<st->blocks, kThreads, 0, s>>>(a);
  else if (d->dtype == SL_DTYPE_F16)
    combine_kernel<__half, false><<<st->blocks, kThreads, 0, s>>>(a);
  else
    combine_kernel<float, false><<<st->blocks, kThreads, 0, s>>>(a);
  return finish(c, st, rk, s, op);
}

extern "C" sl_status sl_ep_redispatch_cuda(int64_t comm_id, const sl_ep_desc *d, const void *g,
                                           const int32_t *recv_src, void *out, void *stream) {
  const char *op = "redispatch";
  sl_ep_comm *c;
  State *st;
  Rank *rk;
  sl_status r = begin(comm_id, d, op, &c, &st, &rk);
  if (r) return r;
  cudaStream_t s = (cudaStream_t)stream;
  if (st->transport == SL_EP_TRANSPORT_NCCL) {
    r = nccl_redispatch(st, rk, d, g, recv_src, out, s);
    return r ? r : finish(c, st, rk, s, op);
  }
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  RedispatchArgs a;
  memset(&a, 0, sizeof a);
  a.c = make_ctl(st, rk);
  a.g = (const char *)g;
  a.recv_src = recv_src;
  a.out = (char *)out;
  a.T = (int)d->num_tokens;
  a.row_bytes = rb;
  a.vec = vec_of(a.row_bytes);
  if (st->transport == SL_EP_TRANSPORT_IPC) {
    /* the peers read my g from my staging area: stage it first (stream-ordered; the previous call
     * on this stream waited for every peer to finish with my buffers) */
    if ((r = need_stage(st, d->num_tokens * rb, op))) return r;
    if (d->num_tokens * rb > 0) {
      cudaError_t e =
          cudaMemcpyAsync(rk->stage, g, (size_t)(d->num_tokens * rb), cudaMemcpyDeviceToDevice, s);
      if (e != cudaSuccess) return cuda_fail(e, op, "staging g (cudaMemcpyAsync)");
    }
    a.mode = 1;
    for (int p = 0; p < st->R; ++p)
      a.srcs[p] = p == rk->rank ? (const char *)g : (const char *)rk->peer[p] + kHdr;
  }
  redispatch_kernel<<<st->blocks, kThreads, 0, s>>>(a);
  return finish(c, st, rk, s, op);
}
