/*
 * The NCCL transport of expert parallelism: any GPUs, several hosts included. NCCL send/recv of
 * fixed worst-case blocks (T rows per peer, whatever the routing: without a host sync the sizes
 * must be fixed) through our own communicator (ep_nccl_comm.cu: libnccl loaded at run time, a
 * watchdog per communicator); each rank's staging area holds what it receives.
 *
 * dispatch: every rank sends its whole x, topk_idx and topk_weights to every peer; each rank then
 * computes every source's layout (launch_layout_multi) and gathers the rows routed to it.
 * combine: counts per destination, an all-gather of them, the rows of each source packed into
 * T-row blocks, the exchange, then the local combine (ep_pull.cu). redispatch: every rank sends its
 * whole g, then the local redispatch.
 * Setup: rank 0 of each group makes the group's ncclUniqueId; the other processes import it; connect
 * creates the communicators (a bounded wait for every rank of the group).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ep_common.cuh"

namespace sluice_cuda {
namespace {

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
  int64_t N;      /* receive rows (sl_ep_desc.recv_rows): rows past it are left out */
  int *lost_rows; /* counts my rows that a receiver left out */
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
    lo[R] = o < a.N ? o : (int)a.N;
    for (int d = 0; d < R; ++d) {
      int b = 0;
      for (int s = 0; s < me; ++s) b += a.cnt[s * R + d];
      at_peer[d] = b; /* where my block starts in d's buffer */
    }
  }
  __syncthreads();
  const int64_t N = (int64_t)a.T * R; /* every source's tokens */
  const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
  for (int64_t i = gw; i < N; i += nw) {
    const int s = (int)(i / a.T), t = (int)(i % a.T);
    const int p = a.pos[(int64_t)s * N + (int64_t)t * R + me];
    if (p < 0) continue;
    const int64_t row = lo[s] + p;
    if (row >= a.N) continue; /* past my receive rows: not delivered */
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
  for (int64_t r = lo[R] + gw; r < a.N; r += nw) {
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
    const int64_t row = p >= 0 ? at_peer[i % R] + (int64_t)p : -1;
    if (row >= a.N) atomicAdd(a.lost_rows, 1);
    a.send_row[i] = row >= 0 && row < a.N ? (int)row : -1;
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

/* ---- setup: the group's ncclUniqueId, made by rank 0's process ------------------------------- */
sl_status nccl_export(sl_ep_comm *c, int group, int rank, void *blob, size_t *bytes) {
  State *st = state_of(c);
  Rank *rk = NULL;
  sl_status not_local = local_rank_of(st, group, rank, &rk, bytes);
  if (not_local) return not_local;
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

/* Rank 0 of every group with a local rank, when it is remote: its id. */
sl_status nccl_needs(sl_ep_comm *c, int group, int rank, int *needed) {
  *needed = rank == 0 && is_remote_peer(state_of(c), group, rank);
  return SL_STATUS_SUCCESS;
}

sl_status nccl_import(sl_ep_comm *c, int group, int rank, const void *blob, size_t bytes) {
  State *st = state_of(c);
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

sl_status nccl_connect(sl_ep_comm *c) {
  State *st = state_of(c);
  if (st->connected) return SL_STATUS_SUCCESS;
  const int n = st->G * st->R;
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

/* ---- the ops -------------------------------------------------------------------------------- */
sl_status nccl_dispatch(State *st, Rank *rk, const sl_ep_desc *d, cudaStream_t s, const char *op,
                        const void *x, const int32_t *topk_idx, const float *topk_w, void *recv_x,
                        int32_t *recv_idx, float *recv_w, int32_t *num_recv, int32_t *counts,
                        int32_t *send_row, int32_t *recv_src) {
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
  launch_layout_multi(lm, R, s);
  g.pos = (const int *)(b + pos_at);
  g.cnt = (const int *)(b + cnt_at);
  g.hist = (const int *)(b + hist_at);
  g.recv_x = (char *)recv_x, g.recv_idx = recv_idx, g.recv_src = recv_src;
  g.num_recv = num_recv, g.counts = counts, g.send_row = send_row, g.recv_w = recv_w;
  g.R = R, g.me = me, g.T = (int)T, g.k = (int)k, g.E = (int)E, g.L = (int)L;
  g.row_bytes = rb, g.vec = vec_of(rb);
  g.N = ep_recv_rows(d), g.lost_rows = &rk->err_dev->lost_rows;
  nccl_gather_kernel<<<rk->local_blocks, kThreads, 0, s>>>(g);
  return SL_STATUS_SUCCESS;
}

sl_status nccl_combine(State *st, Rank *rk, const sl_ep_desc *d, cudaStream_t s, const char *op,
                       const void *y, const float *y_w, const int32_t *send_row, void *out,
                       float *out_w) {
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
  launch_combine(d->dtype, true, rk->local_blocks, s, a);
  return SL_STATUS_SUCCESS;
}

sl_status nccl_redispatch(State *st, Rank *rk, const sl_ep_desc *d, cudaStream_t s, const char *op,
                          const void *g, const int32_t *recv_src, void *out) {
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
  a.T = (int)T, a.row_bytes = rb, a.vec = vec_of(rb), a.mode = 2, a.N = ep_recv_rows(d);
  for (int p = 0; p < R; ++p) a.srcs[p] = p == me ? (const char *)g : b + p * T * rb;
  launch_redispatch(rk->local_blocks, s, a);
  return SL_STATUS_SUCCESS;
}

}  // namespace
}  // namespace sluice_cuda
using namespace sluice_cuda;

extern "C" const ep_transport ep_transport_nccl =
    device_transport<nccl_dispatch, nccl_combine, nccl_redispatch>("NCCL", nccl_export, nccl_needs,
                                                                   nccl_import, nccl_connect);
