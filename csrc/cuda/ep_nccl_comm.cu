/*
 * NCCL plumbing of the expert-parallel NCCL transport: loading libnccl (dlopen: libsluice must load
 * where NCCL is absent), communicators created non-blocking with a bounded wait, grouped send/recv
 * on the caller's stream, and a watchdog thread per communicator that aborts it when an exchange
 * has not completed timeout_s after it could start (a peer that never arrives), recording the rank
 * and call. Without nccl.h at build time (SLUICE_HAVE_NCCL undefined) every entry returns
 * UNSUPPORTED.
 */
#include <stdio.h>
#include <string.h>

#include "ep_nccl_comm.h"

#ifndef SLUICE_HAVE_NCCL

sl_status ep_nccl_load(const char *op) {
  return sl_set_error(SL_STATUS_UNSUPPORTED,
                      "ep %s: libsluice was built without nccl.h (the NCCL transport is not "
                      "built; CMake looks in NCCL_HOME, the CUDA toolkit and the nvidia-nccl "
                      "Python wheel)",
                      op);
}
sl_status ep_nccl_unique_id(unsigned char *id) { return ep_nccl_load("comm_export"); }
sl_status ep_nccl_init(int n, const int *ordinals, const int *ranks, const int *groups, int R,
                       const unsigned char *ids, double timeout_s, ep_nccl **out) {
  return ep_nccl_load("comm_connect");
}
sl_status ep_nccl_exchange(ep_nccl *h, cudaStream_t stream, const ep_xfer *send, int nsend,
                           const ep_xfer *recv, int nrecv, const char *op,
                           unsigned long long call) {
  return ep_nccl_load(op);
}
sl_status ep_nccl_allgather(ep_nccl *h, cudaStream_t stream, const void *send, void *recv,
                            size_t bytes, const char *op, unsigned long long call) {
  return ep_nccl_load(op);
}
int ep_nccl_failed(ep_nccl *h, char *msg, size_t len) { return 0; }
void ep_nccl_destroy(ep_nccl *h) {}

#else

#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

namespace {

struct Api {
  decltype(&ncclGetUniqueId) getUniqueId;
  decltype(&ncclCommInitRankConfig) initRankConfig;
  decltype(&ncclCommGetAsyncError) getAsyncError;
  decltype(&ncclCommAbort) abort;
  decltype(&ncclCommDestroy) destroy;
  decltype(&ncclGroupStart) groupStart;
  decltype(&ncclGroupEnd) groupEnd;
  decltype(&ncclSend) send;
  decltype(&ncclRecv) recv;
  decltype(&ncclGetErrorString) errStr;
};

Api api;
int api_state = 0; /* 0 not tried, 1 loaded, -1 failed */
char api_why[512];
pthread_mutex_t api_mu = PTHREAD_MUTEX_INITIALIZER;

double now_s() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int load_locked() {
  if (api_state) return api_state;
  const char *cands[4] = {getenv("SLUICE_NCCL_LIBRARY"), "libnccl.so.2",
#ifdef SLUICE_NCCL_PATH
                          SLUICE_NCCL_PATH,
#else
                          NULL,
#endif
                          "libnccl.so"};
  void *so = NULL;
  for (int i = 0; i < 4 && !so; ++i)
    if (cands[i] && *cands[i]) so = dlopen(cands[i], RTLD_NOW | RTLD_GLOBAL);
  if (!so) {
    snprintf(api_why, sizeof api_why,
             "libnccl could not be loaded (tried $SLUICE_NCCL_LIBRARY, libnccl.so.2, the build's "
             "libnccl): %s",
             dlerror());
    return api_state = -1;
  }
#define SYM(field, name)                                                                  \
  do {                                                                                    \
    *(void **)&api.field = dlsym(so, name);                                               \
    if (!api.field) {                                                                     \
      snprintf(api_why, sizeof api_why, "libnccl has no %s (NCCL >= 2.14 needed)", name); \
      return api_state = -1;                                                              \
    }                                                                                     \
  } while (0)
  SYM(getUniqueId, "ncclGetUniqueId");
  SYM(initRankConfig, "ncclCommInitRankConfig");
  SYM(getAsyncError, "ncclCommGetAsyncError");
  SYM(abort, "ncclCommAbort");
  SYM(destroy, "ncclCommDestroy");
  SYM(groupStart, "ncclGroupStart");
  SYM(groupEnd, "ncclGroupEnd");
  SYM(send, "ncclSend");
  SYM(recv, "ncclRecv");
  SYM(errStr, "ncclGetErrorString");
#undef SYM
  return api_state = 1;
}

constexpr int kRing = 256;

struct Pending {
  cudaEvent_t ev;
  double t0;
  unsigned long long call;
  char op[24];
};

}  // namespace

struct ep_nccl {
  ncclComm_t comm;
  int ordinal, rank, group, R;
  double timeout_s;
  pthread_mutex_t mu;
  pthread_t thread;
  int thread_started, stop;
  int failed;
  char msg[512];
  Pending ring[kRing];
  int head, tail;   /* ring[tail..head) pending, in stream order */
  double last_done; /* when the watchdog last saw an exchange complete */
};

namespace {

/* Called with h->mu held: aborts the communicator and records why (first failure only). */
void fail_locked(ep_nccl *h, const char *fmt, const char *op, unsigned long long call, double s) {
  if (h->failed) return;
  h->failed = 1;
  snprintf(h->msg, sizeof h->msg, fmt, op, h->rank, h->group, h->ordinal, s, call);
  if (h->comm) api.abort(h->comm);
  h->comm = NULL;
}

void *watchdog(void *arg) {
  ep_nccl *h = (ep_nccl *)arg;
  cudaSetDevice(h->ordinal);
  for (;;) {
    usleep(20000);
    pthread_mutex_lock(&h->mu);
    if (h->stop) {
      pthread_mutex_unlock(&h->mu);
      break;
    }
    while (h->tail != h->head && !h->failed) {
      Pending *p = &h->ring[h->tail % kRing];
      cudaError_t q = cudaEventQuery(p->ev);
      if (q == cudaErrorNotReady) {
        const double start = p->t0 > h->last_done ? p->t0 : h->last_done;
        if (now_s() - start > h->timeout_s)
          fail_locked(h,
                      "ep %s (NCCL): rank %d of group %d (device %d) waited %.3g s at call #%llu "
                      "for its peers' sends and receives (a peer that never arrived?); the NCCL "
                      "communicator was aborted (set it up again)",
                      p->op, p->call, h->timeout_s);
        break;
      }
      if (q != cudaSuccess) cudaGetLastError();
      h->last_done = now_s();
      h->tail++;
    }
    pthread_mutex_unlock(&h->mu);
  }
  return NULL;
}

sl_status nccl_error(ep_nccl *h, ncclResult_t r, const char *op, const char *what) {
  return sl_set_error(SL_STATUS_INTERNAL, "ep %s (NCCL): rank %d of group %d: %s: %s", op,
                      h ? h->rank : -1, h ? h->group : -1, what, api.errStr(r));
}

/* Waits (bounded) until a non-blocking communicator is no longer in progress. Every op waits here
 * for NCCL's enqueue (its background thread) before our next kernel may go on the stream, so spin
 * first: sleeping 200 us per poll makes the host, not the link, the bound of the NCCL transport
 * (combine took 655 us in two processes, two waits per call). */
ncclResult_t wait_ready(ncclComm_t comm, double deadline) {
  ncclResult_t st = ncclInProgress;
  const double spin_until = now_s() + 5e-3;
  for (;;) {
    ncclResult_t r = api.getAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    const double t = now_s();
    if (t > deadline) return ncclInProgress;
    if (t > spin_until) usleep(50);
  }
}

/* After enqueuing: the watchdog's event (none while the stream is being captured into a graph). */
void watch(ep_nccl *h, cudaStream_t s, const char *op, unsigned long long call) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return;
  }
  if (h->head - h->tail >= kRing) return; /* too many in flight to watch: skip this one */
  Pending *p = &h->ring[h->head % kRing];
  if (cudaEventRecord(p->ev, s) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  p->t0 = now_s();
  p->call = call;
  snprintf(p->op, sizeof p->op, "%s", op);
  h->head++;
}

}  // namespace

sl_status ep_nccl_load(const char *op) {
  pthread_mutex_lock(&api_mu);
  const int st = load_locked();
  pthread_mutex_unlock(&api_mu);
  if (st > 0) return SL_STATUS_SUCCESS;
  return sl_set_error(SL_STATUS_UNSUPPORTED, "ep %s: the NCCL transport is unavailable: %s", op,
                      api_why);
}

sl_status ep_nccl_unique_id(unsigned char id[EP_NCCL_ID_BYTES]) {
  sl_status st = ep_nccl_load("comm_export");
  if (st) return st;
  static_assert(sizeof(ncclUniqueId) == EP_NCCL_ID_BYTES, "ncclUniqueId size");
  ncclUniqueId u;
  ncclResult_t r = api.getUniqueId(&u);
  if (r != ncclSuccess)
    return sl_set_error(SL_STATUS_INTERNAL, "ep comm_export (NCCL): ncclGetUniqueId: %s",
                        api.errStr(r));
  memcpy(id, &u, EP_NCCL_ID_BYTES);
  return SL_STATUS_SUCCESS;
}

sl_status ep_nccl_init(int n, const int *ordinals, const int *ranks, const int *groups, int R,
                       const unsigned char *ids, double timeout_s, ep_nccl **out) {
  sl_status st = ep_nccl_load("comm_connect");
  if (st) return st;
  int prev = 0;
  cudaGetDevice(&prev);
  for (int i = 0; i < n; ++i) out[i] = NULL;
  for (int i = 0; i < n; ++i) {
    ep_nccl *h = (ep_nccl *)calloc(1, sizeof(ep_nccl));
    if (!h) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep comm_connect: out of memory");
    h->ordinal = ordinals[i];
    h->rank = ranks[i];
    h->group = groups[i];
    h->R = R;
    h->timeout_s = timeout_s;
    pthread_mutex_init(&h->mu, NULL);
    out[i] = h;
  }
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclResult_t r = api.groupStart();
  sl_status result = SL_STATUS_SUCCESS;
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    ncclUniqueId u;
    memcpy(&u, ids + (size_t)EP_NCCL_ID_BYTES * i, EP_NCCL_ID_BYTES);
    cudaSetDevice(ordinals[i]);
    r = api.initRankConfig(&out[i]->comm, R, u, ranks[i], &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
      result = nccl_error(out[i], r, "comm_connect", "ncclCommInitRankConfig");
  }
  r = api.groupEnd();
  if (result == SL_STATUS_SUCCESS && r != ncclSuccess && r != ncclInProgress)
    result = nccl_error(out[0], r, "comm_connect", "ncclGroupEnd");
  const double deadline = now_s() + timeout_s;
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    r = wait_ready(out[i]->comm, deadline);
    if (r == ncclInProgress)
      result = sl_set_error(
          SL_STATUS_TIMEOUT,
          "ep comm_connect (NCCL): rank %d of group %d (device %d) waited %.3g s for the other "
          "%d rank(s) of its group to create the communicator (did every process call "
          "sluice.ep.setup with the same mesh?)",
          ranks[i], groups[i], ordinals[i], timeout_s, R - 1);
    else if (r != ncclSuccess)
      result = nccl_error(out[i], r, "comm_connect", "creating the communicator");
  }
  /* Warm-up: one exchange with every peer, all local ranks in one group, so the connections exist
   * before the first op (one thread may drive several ranks; the first op is not slower). */
  const size_t W = (size_t)1 << 20;
  char *wbuf[64] = {0};
  cudaStream_t wst[64] = {0};
  if (n > 64 && result == SL_STATUS_SUCCESS)
    result = sl_set_error(SL_STATUS_UNSUPPORTED, "ep comm_connect: at most 64 local ranks");
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    cudaSetDevice(ordinals[i]);
    if (cudaMalloc(&wbuf[i], 2 * W * (size_t)R) != cudaSuccess ||
        cudaStreamCreateWithFlags(&wst[i], cudaStreamNonBlocking) != cudaSuccess)
      result = sl_set_error(SL_STATUS_CUDA_ERROR, "ep comm_connect: warm-up buffers");
  }
  if (result == SL_STATUS_SUCCESS) {
    r = api.groupStart();
    for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); ++i)
      for (int p = 0; p < R && (r == ncclSuccess || r == ncclInProgress); ++p) {
        if (p == ranks[i]) continue;
        r = api.send(wbuf[i] + W * p, W, ncclInt8, p, out[i]->comm, wst[i]);
        if (r == ncclSuccess || r == ncclInProgress)
          r = api.recv(wbuf[i] + W * (R + p), W, ncclInt8, p, out[i]->comm, wst[i]);
      }
    ncclResult_t e = api.groupEnd();
    if (r == ncclSuccess || r == ncclInProgress) r = e;
    if (r != ncclSuccess && r != ncclInProgress)
      result = nccl_error(out[0], r, "comm_connect", "warm-up exchange");
    for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
      r = wait_ready(out[i]->comm, deadline + timeout_s);
      if (r != ncclSuccess)
        result = sl_set_error(SL_STATUS_TIMEOUT,
                              "ep comm_connect (NCCL): rank %d of group %d: the warm-up exchange "
                              "with its peers did not start in %.3g s (%s)",
                              ranks[i], groups[i], timeout_s,
                              r == ncclInProgress ? "still in progress" : api.errStr(r));
    }
    for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
      cudaSetDevice(ordinals[i]);
      cudaError_t q;
      const double dl = now_s() + timeout_s;
      while ((q = cudaStreamQuery(wst[i])) == cudaErrorNotReady && now_s() < dl) usleep(200);
      if (q != cudaSuccess)
        result = sl_set_error(
            SL_STATUS_TIMEOUT,
            "ep comm_connect (NCCL): rank %d of group %d (device %d): the warm-up exchange with "
            "its peers did not finish in %.3g s (%s)",
            ranks[i], groups[i], ordinals[i], timeout_s,
            q == cudaErrorNotReady ? "a peer never took part" : cudaGetErrorString(q));
    }
  }
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(ordinals[i]);
    if (result == SL_STATUS_SUCCESS || !out[i] || !out[i]->comm) {
      if (wst[i]) cudaStreamDestroy(wst[i]);
      if (wbuf[i]) cudaFree(wbuf[i]);
    } /* else: the stream may still hold NCCL work that the abort below ends; leak the scratch */
  }
  cudaGetLastError();
  for (int i = 0; i < n && result == SL_STATUS_SUCCESS; ++i) {
    ep_nccl *h = out[i];
    cudaSetDevice(h->ordinal);
    for (int j = 0; j < kRing && result == SL_STATUS_SUCCESS; ++j)
      if (cudaEventCreateWithFlags(&h->ring[j].ev, cudaEventDisableTiming) != cudaSuccess)
        result = sl_set_error(SL_STATUS_CUDA_ERROR, "ep comm_connect: cudaEventCreate failed");
    if (result == SL_STATUS_SUCCESS) {
      if (pthread_create(&h->thread, NULL, watchdog, h) != 0)
        result = sl_set_error(SL_STATUS_INTERNAL, "ep comm_connect: starting the watchdog failed");
      else
        h->thread_started = 1;
    }
  }
  cudaSetDevice(prev);
  if (result != SL_STATUS_SUCCESS) {
    for (int i = 0; i < n; ++i) {
      if (out[i] && out[i]->comm) {
        api.abort(out[i]->comm);
        out[i]->comm = NULL;
      }
      ep_nccl_destroy(out[i]);
      out[i] = NULL;
    }
  }
  return result;
}

static sl_status begin_call(ep_nccl *h, const char *op) {
  if (h->failed || !h->comm)
    return sl_set_error(SL_STATUS_TIMEOUT, "%s",
                        h->failed ? h->msg : "ep (NCCL): the communicator is closed");
  return SL_STATUS_SUCCESS;
}

static sl_status end_group(ep_nccl *h, ncclResult_t r, const char *op, unsigned long long call) {
  if (r == ncclInProgress) r = wait_ready(h->comm, now_s() + h->timeout_s);
  if (r == ncclInProgress) {
    fail_locked(h,
                "ep %s (NCCL): rank %d of group %d (device %d): enqueuing call #%llu did not "
                "finish in %.3g s; the communicator was aborted",
                op, call, h->timeout_s);
    return sl_set_error(SL_STATUS_TIMEOUT, "%s", h->msg);
  }
  if (r != ncclSuccess) {
    sl_status st = nccl_error(h, r, op, "ncclGroupEnd");
    snprintf(h->msg, sizeof h->msg, "%s", sl_last_error());
    h->failed = 1;
    return st;
  }
  return SL_STATUS_SUCCESS;
}

sl_status ep_nccl_exchange(ep_nccl *h, cudaStream_t stream, const ep_xfer *send, int nsend,
                           const ep_xfer *recv, int nrecv, const char *op,
                           unsigned long long call) {
  pthread_mutex_lock(&h->mu);
  sl_status st = begin_call(h, op);
  if (st) {
    pthread_mutex_unlock(&h->mu);
    return st;
  }
  ncclResult_t r = api.groupStart();
  for (int i = 0; i < nsend && r == ncclSuccess; ++i)
    if (send[i].bytes)
      r = api.send(send[i].buf, send[i].bytes, ncclInt8, send[i].peer, h->comm, stream);
  for (int i = 0; i < nrecv && (r == ncclSuccess || r == ncclInProgress); ++i)
    if (recv[i].bytes)
      r = api.recv(recv[i].buf, recv[i].bytes, ncclInt8, recv[i].peer, h->comm, stream);
  ncclResult_t e = api.groupEnd();
  if (r == ncclSuccess || r == ncclInProgress) r = e;
  st = end_group(h, r, op, call);
  if (st == SL_STATUS_SUCCESS) watch(h, stream, op, call);
  pthread_mutex_unlock(&h->mu);
  return st;
}

/* Point-to-point, not ncclAllGather: a collective's first call sets up its own connections, which
 * needs every rank inside NCCL at once; one thread driving several ranks in turn (the C API, a
 * single-threaded host) then waits on itself. The p2p connections were made at connect time. */
sl_status ep_nccl_allgather(ep_nccl *h, cudaStream_t stream, const void *send, void *recv,
                            size_t bytes, const char *op, unsigned long long call) {
  ep_xfer sends[64], recvs[64];
  int n = 0;
  if (h->R > 64) return sl_set_error(SL_STATUS_UNSUPPORTED, "ep %s (NCCL): at most 64 ranks", op);
  for (int p = 0; p < h->R; ++p) {
    if (p == h->rank) continue;
    sends[n] = {(void *)send, bytes, p};
    recvs[n] = {(char *)recv + bytes * (size_t)p, bytes, p};
    ++n;
  }
  cudaError_t e = cudaMemcpyAsync((char *)recv + bytes * (size_t)h->rank, send, bytes,
                                  cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "ep %s (NCCL): cudaMemcpyAsync: %s", op,
                        cudaGetErrorString(e));
  return ep_nccl_exchange(h, stream, sends, n, recvs, n, op, call);
}

int ep_nccl_failed(ep_nccl *h, char *msg, size_t len) {
  if (!h) return 0;
  pthread_mutex_lock(&h->mu);
  const int f = h->failed;
  if (f && msg) snprintf(msg, len, "%s", h->msg);
  pthread_mutex_unlock(&h->mu);
  return f;
}

void ep_nccl_destroy(ep_nccl *h) {
  if (!h) return;
  if (h->thread_started) {
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->thread, NULL);
  }
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(h->ordinal);
  /* The caller has synchronized this device, so none of our NCCL work is queued any more; abort
   * frees the communicator without waiting on the peers (which may have gone already). */
  if (h->comm) api.abort(h->comm);
  for (int j = 0; j < kRing; ++j)
    if (h->ring[j].ev) cudaEventDestroy(h->ring[j].ev);
  cudaSetDevice(prev);
  pthread_mutex_destroy(&h->mu);
  free(h);
}

#endif /* SLUICE_HAVE_NCCL */
