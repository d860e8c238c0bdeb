/*
 * What the CUDA transports of expert parallelism share: ep_nvlink.cu (PEER: peer memory in one
 * process; IPC: CUDA IPC across processes), ep_nccl.cu (NCCL), and the kernels they both use,
 * ep_layout.cu (send positions and counts) and ep_pull.cu (combine, redispatch). Here: the limits,
 * every rank's buffers and state, the mailbox protocol's bounded waits, the row copies, the
 * argument structs that cross files, and the host side common to every op (ep_common.cu).
 *
 * Each rank owns one registered buffer, an EpBuf (cudaMalloc at setup; the peers map it through
 * peer access or CUDA IPC): mail[s]  what source s wrote to me for the current call: its row counts
 * to every rank, up to four addresses, then a release flag `seq`; done  a monotonic counter every
 * block of every rank bumps once per call (system atomics); hist[s]  source s's (row, slot) counts
 * for each of my local experts (dispatch only). IPC: the staging area of stage_bytes follows at
 * kHdr.
 *
 * Waits spin on globaltimer and stop after the communicator's timeout: the first block to give up
 * records (rank, whom it waited for, phase) in host-mapped memory (EpErr); the host reports it at
 * the next call (or at once with SLUICE_DEBUG=1) and the communicator is broken from then on.
 *
 * Bounded work: `num_sms` blocks of 512 threads (default 64). Requires R <= 8, k <= 32, E <= 8192,
 * E/R <= 4096.
 */
#ifndef SLUICE_EP_COMMON_CUH_
#define SLUICE_EP_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../core/ep_internal.h"
#include "ep_nccl_comm.h"

/* The device transports' tables (ep_internal.h), listed in ep_device_transports (ep_common.cu). */
extern "C" {
extern const ep_transport ep_transport_peer; /* ep_nvlink.cu */
extern const ep_transport ep_transport_ipc;  /* ep_nvlink.cu */
extern const ep_transport ep_transport_nccl; /* ep_nccl.cu */
}

/* Kernels are named sluice_cuda::(anonymous namespace)::..., as the gmm kernels sluice_cuda::sm90::...:
 * a profile (sluice-profile) counts them as sluice's. */
namespace sluice_cuda {

constexpr int kMaxRanks = 8;
constexpr int kMaxLocal = 4096;
constexpr int kMaxExperts = 8192;
constexpr int kMaxTopk = 32;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
/* The multi-block layout (ep_layout.cu): chunks of 1024 tokens, up to 262,144 tokens, else one
 * block. */
constexpr int kLayoutChunk = 1024, kMaxChunks = 256;

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
  int bad_ids;   /* slots treated as -1 (out of range or repeated): reported with SLUICE_DEBUG=1 */
  int lost_rows; /* dispatch rows past the receiver's recv_rows, not delivered (SLUICE_DEBUG=1) */
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

struct Ctl { /* what every kernel needs to meet and leave */
  EpBuf *bufs[kMaxRanks];
  EpErr *err;
  int rank, R, blocks;
  unsigned long long seq;
  long long timeout_ns;
};

/* ---- device helpers ---------------------------------------------------------------------------- */
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

static __device__ void record_timeout(const Ctl &c, int waited_for, int phase) {
  if (atomicCAS(&c.err->code, 0, 1) == 0) {
    c.err->rank = c.rank;
    c.err->waited_for = waited_for;
    c.err->phase = phase;
    c.err->seq = c.seq;
    __threadfence_system();
  }
}

/* Step 2: every block waits for all peers' mail of this call. Returns false on timeout. */
static __device__ bool meet(const Ctl &c) {
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
static __device__ void publish(const Ctl &c) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x < c.R) st_release(&c.bufs[threadIdx.x]->mail[c.rank].seq, c.seq);
}

/* Step 4. Every thread fenced its stores; then one bump per peer per block; block 0 waits. */
static __device__ void leave(const Ctl &c, bool ok) {
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

/* ---- kernel arguments used by more than one file ----------------------------------------------- */
struct LayoutArgs {
  const int *idx;
  int *send_row;    /* [T, R]: position within the destination's block, -1 */
  int *send_counts; /* [R] */
  int *expert_hist; /* [E] */
  int *bad;
  int T, k, E, L, R;
};

/* NCCL: the layout of every source rank's tokens at once (block s: source s). */
struct LayoutMulti {
  LayoutArgs src[kMaxRanks];
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

struct RedispatchArgs {
  Ctl c;
  const char *g;
  const int *recv_src;
  char *out;
  int T, vec;
  int64_t row_bytes;
  int64_t N; /* rows of out and recv_src (sl_ep_desc.recv_rows); recv_src reads rows of T*R */
  /* mode 0: pull from the peers' g (PEER); 1: from srcs (IPC staging areas), meeting the peers;
   * 2: from srcs, local (NCCL, after the exchange) */
  int mode;
  const char *srcs[kMaxRanks];
};

/* ---- host side -------------------------------------------------------------------------------- */
inline int vec_of(int64_t row_bytes) {
  return row_bytes % 16 == 0 ? 16 : row_bytes % 4 == 0 ? 4 : 2;
}

inline int64_t align16(int64_t v) { return (v + 15) & ~(int64_t)15; }

/* Staging offsets (bytes): rows [n rows], idx [n*k], w [n*k], src [n] from `at` on (IPC: n = N;
 * NCCL dispatch: the received blocks, followed by its layout scratch). */
struct Areas {
  int64_t rows, idx, w, src, total;
};
inline Areas areas(int64_t n, int64_t row_bytes, int64_t k, int64_t at) {
  Areas a;
  a.rows = at;
  a.idx = align16(a.rows + n * row_bytes);
  a.w = align16(a.idx + n * k * 4);
  a.src = align16(a.w + n * k * 4);
  a.total = align16(a.src + n * 4);
  return a;
}

inline State *state_of(sl_ep_comm *c) { return (State *)c->device_state; }

inline int group_has_local(const State *st, int g) {
  for (int r = 0; r < st->R; ++r)
    if (st->ranks[g * st->R + r].local) return 1;
  return 0;
}

/* 1: (group, rank) belongs to another process, and this one drives a rank of its group. */
inline int is_remote_peer(const State *st, int group, int rank) {
  return !st->ranks[group * st->R + rank].local && group_has_local(st, group);
}

/* ep_common.cu */
sl_status cuda_fail(cudaError_t e, const char *op, const char *what);
/* An op's prologue: the rank whose device is current, the desc against the communicator, and the
 * previous calls' device-side failures. */
sl_status begin_op(sl_ep_comm *c, const sl_ep_desc *d, const char *op, State **st, Rank **rk);
/* An op's epilogue, after the launches: the launch status, and with SLUICE_DEBUG=1 a
 * synchronisation and the checks. */
sl_status finish_op(sl_ep_comm *c, State *st, Rank *rk, cudaStream_t s, const char *op);
/* SL_STATUS_SUCCESS when the staging area holds `bytes`, else an error naming the size needed. */
sl_status need_stage(const State *st, int64_t bytes, const char *op);
/* comm_export's rank: *rk, or an error when another process drives it; *bytes = 0. */
sl_status local_rank_of(State *st, int group, int rank, Rank **rk, size_t *bytes);
/* The table hooks every device transport shares. */
sl_status dev_attach(sl_ep_comm *c, const sl_ep_comm_desc *desc);
void dev_detach(sl_ep_comm *c);
sl_status dev_disconnect(sl_ep_comm *c);

/* An op's name in messages (EP_OP_DISPATCH, EP_OP_COMBINE, EP_OP_REDISPATCH). */
constexpr const char *op_name(int op) {
  return op == EP_OP_DISPATCH ? "dispatch" : op == EP_OP_COMBINE ? "combine" : "redispatch";
}

/* A device op as the transport tables hold it (DeviceOp<EP_OP_..., body>::run): begin_op, then the
 * body's launches (st, rk: the rank whose device is current; s: the site's stream; op: its name;
 * then the op's arrays), then finish_op. A body that fails returns its error, and finish_op is
 * skipped. */
template <int Op, auto Body>
struct DeviceOp;
template <int Op, typename... A,
          sl_status (*Body)(State *, Rank *, const sl_ep_desc *, cudaStream_t, const char *, A...)>
struct DeviceOp<Op, Body> {
  static sl_status run(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, A... args) {
    const char *op = op_name(Op);
    State *st;
    Rank *rk;
    sl_status r = begin_op(c, d, op, &st, &rk);
    if (r) return r;
    const cudaStream_t s = (cudaStream_t)at.stream;
    if ((r = Body(st, rk, d, s, op, args...))) return r;
    return finish_op(c, st, rk, s, op);
  }
};

/* A device transport's table: the shared attach, detach and disconnect (above), its setup hooks,
 * and its op bodies, each wrapped by DeviceOp. */
template <auto Dispatch, auto Combine, auto Redispatch>
constexpr ep_transport device_transport(const char *name, decltype(ep_transport::export_blob) exp,
                                        decltype(ep_transport::needs) needs,
                                        decltype(ep_transport::import_blob) imp,
                                        decltype(ep_transport::connect) connect) {
  return {name,
          dev_attach,
          dev_detach,
          exp,
          needs,
          imp,
          connect,
          dev_disconnect,
          DeviceOp<EP_OP_DISPATCH, Dispatch>::run,
          DeviceOp<EP_OP_COMBINE, Combine>::run,
          DeviceOp<EP_OP_REDISPATCH, Redispatch>::run};
}

/* ep_layout.cu: one rank's layout (chunk_cnt: kMaxChunks * kMaxRanks ints of scratch, or null for
 * one block), and every source's at once (NCCL). */
cudaError_t launch_layout(const LayoutArgs &a, int *chunk_cnt, cudaStream_t s);
void launch_layout_multi(const LayoutMulti &m, int R, cudaStream_t s);

/* ep_pull.cu: combine (local: from src/cnt_all, no meeting) and redispatch, rows of dtype t. */
void launch_combine(sl_dtype t, bool local, int blocks, cudaStream_t s, const CombineArgs &a);
void launch_redispatch(int blocks, cudaStream_t s, const RedispatchArgs &a);

}  // namespace sluice_cuda

#endif /* SLUICE_EP_COMMON_CUH_ */
