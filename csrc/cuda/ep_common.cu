/*
 * The host side that every CUDA transport of expert parallelism shares (ep_common.cuh): attaching
 * a communicator's device state (each local rank's buffers, peer access) and freeing it, ending a
 * connection, each op's prologue (the rank of the current device, the desc, earlier device-side
 * failures) and epilogue (the launch status; SLUICE_DEBUG=1: a synchronisation and the checks),
 * and the list of device transports that the C core picks from.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_common.cuh"

extern "C" const ep_transport *const ep_device_transports[EP_NUM_DEVICE_TRANSPORTS] = {
    &ep_transport_peer, /* SL_EP_TRANSPORT_PEER */
    &ep_transport_ipc,  /* SL_EP_TRANSPORT_IPC */
    &ep_transport_nccl, /* SL_EP_TRANSPORT_NCCL */
};

namespace sluice_cuda {
namespace {

const char *transport_name(int t) { return ep_device_transports[t]->name; }

/* The rank whose device is current. */
sl_status find_rank(sl_ep_comm *c, const char *op, State **st, Rank **rk) {
  *st = state_of(c);
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
  if (d->recv_rows < 0 || d->recv_rows > INT32_MAX)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: recv_rows=%lld must be in [0, INT32_MAX] (0: T*R)", op,
                        (long long)d->recv_rows);
  return SL_STATUS_SUCCESS;
}

/* Calls f(rk) for every local rank, its device current and idle (a device that cannot be made
 * current is skipped); then clears the CUDA error and makes the previous device current again. */
template <typename F>
void on_idle_local_devices(State *st, F f) {
  int prev = 0;
  cudaGetDevice(&prev);
  for (int i = 0; i < st->G * st->R; ++i) {
    Rank *rk = &st->ranks[i];
    if (!rk->local || cudaSetDevice(rk->ordinal) != cudaSuccess) continue;
    cudaDeviceSynchronize();
    f(rk);
  }
  cudaGetLastError();
  cudaSetDevice(prev);
}

/* Unmaps the peers, ends NCCL, after this process's devices are idle. */
void disconnect(State *st) {
  on_idle_local_devices(st, [st](Rank *rk) {
    for (int r = 0; r < st->R; ++r)
      if (rk->imported[r]) {
        cudaIpcCloseMemHandle(rk->peer[r]);
        rk->imported[r] = 0;
        rk->peer[r] = NULL;
      }
    ep_nccl_destroy(rk->nccl);
    rk->nccl = NULL;
  });
  st->connected = 0;
}

}  // namespace

sl_status cuda_fail(cudaError_t e, const char *op, const char *what) {
  return sl_set_error(SL_STATUS_CUDA_ERROR, "ep %s: %s: %s", op, what, cudaGetErrorString(e));
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

sl_status finish_op(sl_ep_comm *c, State *st, Rank *rk, cudaStream_t s, const char *op) {
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
  if (rk->err_host->lost_rows) {
    const int n = rk->err_host->lost_rows;
    rk->err_host->lost_rows = 0;
    return sl_set_error(SL_STATUS_INVALID_VALUE,
                        "ep %s: rank %d: %d of its rows would land past a receiver's recv_rows "
                        "(not delivered; send them in several calls, as sluice.ep.bounded_moe "
                        "does)",
                        op, rk->rank, n);
  }
  return SL_STATUS_SUCCESS;
}

sl_status begin_op(sl_ep_comm *c, const sl_ep_desc *d, const char *op, State **st, Rank **rk) {
  sl_status r = find_rank(c, op, st, rk);
  if (r) return r;
  if ((r = check_cuda_desc(*st, d, op))) return r;
  return check_device_error(c, *st, *rk, op);
}

sl_status local_rank_of(State *st, int group, int rank, Rank **rk, size_t *bytes) {
  *rk = &st->ranks[group * st->R + rank];
  *bytes = 0;
  if (!(*rk)->local)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_export: (group %d, rank %d) belongs to another process", group,
                        rank);
  return SL_STATUS_SUCCESS;
}

/* ---- attach / detach (sl_ep_comm_create / destroy) -------------------------------------------- */
sl_status dev_attach(sl_ep_comm *c, const sl_ep_comm_desc *desc) {
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
  c->device_state = st;
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
  return result; /* on failure the caller frees through dev_detach */
}

void dev_detach(sl_ep_comm *c) {
  State *st = state_of(c);
  if (!st) return;
  disconnect(st);
  on_idle_local_devices(st, [st](Rank *rk) {
    cudaFree(rk->buf);
    if (st->transport == SL_EP_TRANSPORT_NCCL) cudaFree(rk->stage);
    cudaFree(rk->send_counts);
    cudaFree(rk->expert_hist);
    cudaFree(rk->chunk_cnt);
    cudaFree(rk->cnt_all);
    if (rk->err_host) cudaFreeHost(rk->err_host);
  });
  free(st->ranks);
  free(st);
  c->device_state = NULL;
}

sl_status dev_disconnect(sl_ep_comm *c) {
  disconnect(state_of(c));
  return SL_STATUS_SUCCESS;
}

}  // namespace sluice_cuda
