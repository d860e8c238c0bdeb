/*
 * Expert-parallel dispatch / combine / redispatch between the GPUs of one host over NVLink: the
 * PEER transport (GPUs of one process: peer memory) and the IPC transport (one or several
 * processes: each rank's buffer exported with CUDA IPC). The buffers, waits and limits are in
 * ep_common.cuh; combine and redispatch's kernels in ep_pull.cu.
 *
 * PEER moves the data straight between XLA's buffers: dispatch pushes rows into the peers' output
 * buffers, combine and redispatch pull rows from the peers' y and g. No staging copy. IPC pushes
 * rows into the receiver's staging area and copies them out locally (redispatch: the source
 * stages its g, the receivers pull from there).
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
 */
#include <stdint.h>
#include <string.h>

#include "ep_common.cuh"

namespace sluice_cuda {
namespace {

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
  int64_t N;      /* every rank's receive rows (sl_ep_desc.recv_rows): rows past it are left out */
  int *lost_rows; /* counts them (SLUICE_DEBUG=1 reports them) */
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
  const int64_t N = a.N;
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
      mine_total = tot < N ? tot : (int)N;
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
      int pos = lane < R ? a.send_row[(int64_t)t * R + lane] : -1;
      /* a row past the receiver's N is not delivered (the caller sends it in another call) */
      if (pos >= 0 && off[lane] + (int64_t)pos >= N) {
        atomicAdd(a.lost_rows, 1);
        pos = -1;
      }
      mask &= __ballot_sync(0xffffffffu, lane >= R || pos >= 0);
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
  int64_t N; /* receive rows: the rows past it were not delivered */
};

__global__ void __launch_bounds__(kThreads) copy_out_kernel(CopyOutArgs a) {
  __shared__ int lo[kMaxRanks + 1];
  if (threadIdx.x == 0) {
    int o = 0;
    for (int s = 0; s < a.R; ++s) {
      lo[s] = o;
      o += a.cnt_all[s * a.R + a.me];
    }
    lo[a.R] = o < a.N ? o : (int)a.N;
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

/* combine's and redispatch's arguments (CombineArgs, RedispatchArgs): this call's Ctl, zeroes
 * elsewhere. */
template <typename Args>
Args pull_args(const State *st, Rank *rk) {
  Args a;
  memset(&a, 0, sizeof a);
  a.c = make_ctl(st, rk);
  return a;
}

/* ---- multi-process setup (IPC): a rank's buffer travels as its cudaIpcMemHandle_t ------------ */
sl_status nvlink_export(sl_ep_comm *c, int group, int rank, void *blob, size_t *bytes) {
  State *st = state_of(c);
  Rank *rk = NULL;
  sl_status not_local = local_rank_of(st, group, rank, &rk, bytes);
  if (not_local) return not_local;
  if (st->transport == SL_EP_TRANSPORT_PEER)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_export: the PEER transport has nothing to export (one process)");
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

/* Every remote rank of a group with a local rank: its buffer is mapped on the local devices. */
sl_status nvlink_needs(sl_ep_comm *c, int group, int rank, int *needed) {
  const State *st = state_of(c);
  *needed = st->transport == SL_EP_TRANSPORT_IPC && is_remote_peer(st, group, rank);
  return SL_STATUS_SUCCESS;
}

/* Maps rank (group, rank)'s buffer on every local device of its group. */
sl_status nvlink_import(sl_ep_comm *c, int group, int rank, const void *blob, size_t bytes) {
  State *st = state_of(c);
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

sl_status nvlink_connect(sl_ep_comm *c) {
  State *st = state_of(c);
  if (st->connected) return SL_STATUS_SUCCESS;
  const int n = st->G * st->R;
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

/* ---- the ops -------------------------------------------------------------------------------- */
sl_status nvlink_dispatch(State *st, Rank *rk, const sl_ep_desc *d, cudaStream_t s, const char *op,
                          const void *x, const int32_t *topk_idx, const float *topk_w, void *recv_x,
                          int32_t *recv_idx, float *recv_w, int32_t *num_recv, int32_t *counts,
                          int32_t *send_row, int32_t *recv_src) {
  sl_status r;
  const int L = (int)(d->num_experts / d->num_ranks);
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  const int64_t N = ep_recv_rows(d);
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
  a.N = N;
  a.lost_rows = &rk->err_dev->lost_rows;
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
    co.row_bytes = rb, co.vec = vec_of(rb);
    co.R = st->R, co.me = rk->rank, co.T = (int)d->num_tokens, co.k = (int)d->topk;
    co.N = N;
    copy_out_kernel<<<rk->local_blocks, kThreads, 0, s>>>(co);
  }
  return SL_STATUS_SUCCESS;
}

sl_status nvlink_combine(State *st, Rank *rk, const sl_ep_desc *d, cudaStream_t s, const char *op,
                         const void *y, const float *y_w, const int32_t *send_row, void *out,
                         float *out_w) {
  sl_status r;
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  CombineArgs a = pull_args<CombineArgs>(st, rk);
  a.y = (const char *)y, a.y_w = y_w, a.send_row = send_row, a.out = (char *)out, a.out_w = out_w;
  a.T = (int)d->num_tokens, a.k = y_w ? (int)d->topk : 0, a.H = (int)d->hidden;
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
    launch_combine(d->dtype, true, rk->local_blocks, s, a);
    return SL_STATUS_SUCCESS;
  }
  launch_combine(d->dtype, false, st->blocks, s, a);
  return SL_STATUS_SUCCESS;
}

sl_status nvlink_redispatch(State *st, Rank *rk, const sl_ep_desc *d, cudaStream_t s,
                            const char *op, const void *g, const int32_t *recv_src, void *out) {
  sl_status r;
  const int64_t rb = d->hidden * (int64_t)sl_dtype_size(d->dtype);
  RedispatchArgs a = pull_args<RedispatchArgs>(st, rk);
  a.g = (const char *)g, a.recv_src = recv_src, a.out = (char *)out;
  a.T = (int)d->num_tokens, a.row_bytes = rb, a.vec = vec_of(rb), a.N = ep_recv_rows(d);
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
  launch_redispatch(st->blocks, s, a);
  return SL_STATUS_SUCCESS;
}

}  // namespace
}  // namespace sluice_cuda
using namespace sluice_cuda;

/* One table serves both: the ops branch on the State's transport where IPC stages. */
constexpr ep_transport nvlink_transport(const char *name) {
  return device_transport<nvlink_dispatch, nvlink_combine, nvlink_redispatch>(
      name, nvlink_export, nvlink_needs, nvlink_import, nvlink_connect);
}
extern "C" const ep_transport ep_transport_peer = nvlink_transport("PEER");
extern "C" const ep_transport ep_transport_ipc = nvlink_transport("IPC");
