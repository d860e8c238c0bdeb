/* Expert parallelism, internal: the communicator, the CPU rendezvous, and the transport table
 * through which the public entry points reach a transport (the CPU rendezvous of ep_cpu.c, or a
 * device transport of csrc/cuda/). Not installed. */
#ifndef SLUICE_EP_INTERNAL_H_
#define SLUICE_EP_INTERNAL_H_

#include <string.h>

#include "convert.h"
#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { EP_OP_DISPATCH = 1, EP_OP_COMBINE = 2, EP_OP_REDISPATCH = 3 };
enum { EP_MAX_PTRS = 6 };

/* What one rank publishes at an exchange. The pointers stay valid until that rank leaves it. */
typedef struct ep_post {
  int op;
  int64_t dims[6]; /* T, H, k, E, dtype, N (recv rows): every rank must agree */
  const void *p[EP_MAX_PTRS];
  sl_status status; /* a rank whose own arguments are bad still posts, with its error */
  char msg[384];
} ep_post;

typedef struct ep_exchange ep_exchange;
typedef struct ep_group ep_group;
typedef struct ep_transport ep_transport;

typedef struct sl_ep_comm {
  int64_t id;
  int num_groups, num_ranks, num_sms;
  double timeout_s;
  int broken;           /* 0, then 1 for good: read and written with __atomic builtins */
  int broken_claim;     /* the first failure claims broken_msg (an __atomic exchange) */
  char broken_msg[512]; /* written before broken is released */
  ep_group *groups;     /* [num_groups]: the CPU rendezvous, which every communicator has */
  const ep_transport *device; /* the device transport (use_cuda), or NULL */
  void *device_state;         /* its state, set by its attach */
} sl_ep_comm;

/* The communicator named by id, or NULL (with the last error set). */
sl_ep_comm *ep_comm_get(int64_t id, const char *op);

/* Joins the exchange of (group, tag, n-th call of this rank with this tag): publishes `mine`, waits
 * (bounded) until every rank of the group has published. On success *ex is the exchange; read the
 * peers' posts with ep_post_of until ep_leave. */
sl_status ep_meet(sl_ep_comm *c, int group, int rank, int64_t tag, const ep_post *mine,
                  const char *op, ep_exchange **ex);
const ep_post *ep_post_of(const ep_exchange *ex, int rank);
/* Marks this rank done reading its peers and waits (bounded) until every rank is. */
sl_status ep_leave(sl_ep_comm *c, int group, int rank, ep_exchange *ex, const char *op);

/* Where one op runs. The CPU transport: rank `rank` of group `group`, blocking on the caller's
 * thread. A device transport: the rank whose device is current, stream-ordered on `stream`. */
typedef struct ep_site {
  int group, rank;
  void *stream;
} ep_site;

/* A transport: what the public entry points (ep_comm.c) call once they have found the
 * communicator and checked (group, rank). Adding one = a file that defines its table and an entry
 * in ep_device_transports (with its sl_ep_transport value). The setup hooks are NULL where a
 * transport has no setup (the CPU rendezvous: its ranks share one process). */
struct ep_transport {
  const char *name; /* in messages: "CPU", "PEER", "IPC", "NCCL" */
  /* Allocates the communicator's device_state (its failure leaves whatever it set for detach). */
  sl_status (*attach)(sl_ep_comm *c, const sl_ep_comm_desc *desc);
  void (*detach)(sl_ep_comm *c); /* frees device_state; fine when attach failed half-way */
  /* The multi-process setup of include/sluice.h, (group, rank) checked by the caller; import is
   * called only for a rank that needs says is needed, with 1..SL_EP_BLOB_BYTES bytes. */
  sl_status (*export_blob)(sl_ep_comm *c, int group, int rank, void *blob, size_t *bytes);
  sl_status (*needs)(sl_ep_comm *c, int group, int rank, int *needed);
  sl_status (*import_blob)(sl_ep_comm *c, int group, int rank, const void *blob, size_t bytes);
  sl_status (*connect)(sl_ep_comm *c);
  sl_status (*disconnect)(sl_ep_comm *c);
  /* The ops, arrays as in include/sluice.h (host pointers for CPU, device pointers otherwise). */
  sl_status (*dispatch)(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, const void *x,
                        const int32_t *topk_idx, const float *topk_w, void *recv_x,
                        int32_t *recv_idx, float *recv_w, int32_t *num_recv, int32_t *counts,
                        int32_t *send_row, int32_t *recv_src);
  sl_status (*combine)(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, const void *y,
                       const float *y_w, const int32_t *send_row, void *out, float *out_w);
  sl_status (*redispatch)(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, const void *g,
                          const int32_t *recv_src, void *out);
};

/* The CPU rendezvous (ep_cpu.c). */
extern const ep_transport ep_transport_cpu;

/* The device transports by sl_ep_transport value; NULL where this build has none. Defined by the
 * CUDA build (csrc/cuda/ep_common.cu) or, built without CUDA, by csrc/core/cuda_stub.c. */
enum { EP_NUM_DEVICE_TRANSPORTS = SL_EP_TRANSPORT_NCCL + 1 };
extern const ep_transport *const ep_device_transports[EP_NUM_DEVICE_TRANSPORTS];

/* N of an exchange op: desc->recv_rows, or T*R where it is 0. */
static inline int64_t ep_recv_rows(const sl_ep_desc *d) {
  return d->recv_rows > 0 ? d->recv_rows : d->num_tokens * d->num_ranks;
}

/* fan_out on CUDA sorts in chunks of whole rows, at most 1024 slots each. */
static inline int64_t ep_fan_chunk_rows(int64_t k) { return k >= 1024 ? 1 : 1024 / k; }

/* Adds row i of a [*, H] array of dtype t to acc (f32). */
void ep_row_accumulate(sl_dtype t, const void *src, int64_t row, int64_t h, float scale,
                       float *acc);
/* Stores acc as row i of a [*, H] array of dtype t. */
void ep_row_store(sl_dtype t, const float *acc, int64_t h, void *dst, int64_t row);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_EP_INTERNAL_H_ */
