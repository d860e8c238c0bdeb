/* Expert parallelism, internal: the communicator, the CPU rendezvous, and the hooks through which
 * the CUDA transport attaches its state to a communicator. Not installed. */
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
  int64_t dims[5]; /* T, H, k, E, dtype: every rank must agree */
  const void *p[EP_MAX_PTRS];
  sl_status status; /* a rank whose own arguments are bad still posts, with its error */
  char msg[384];
} ep_post;

typedef struct ep_exchange ep_exchange;
typedef struct ep_group ep_group;

typedef struct sl_ep_comm {
  int64_t id;
  int num_groups, num_ranks, num_sms;
  double timeout_s;
  int broken;           /* 0, then 1 for good: read and written with __atomic builtins */
  int broken_claim;     /* the first failure claims broken_msg (an __atomic exchange) */
  char broken_msg[512]; /* written before broken is released */
  ep_group *groups;     /* [num_groups] */
  void *cuda;           /* the CUDA transport's state, or NULL */
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

/* CUDA transport hooks (weak stubs in CPU-only builds: csrc/core/ep_comm.c). The public
 * export/needs/import entry points check the communicator, group and rank, then call these. */
sl_status ep_cuda_attach(sl_ep_comm *c, const sl_ep_comm_desc *desc);
void ep_cuda_detach(sl_ep_comm *c);
sl_status ep_cuda_export(sl_ep_comm *c, int group, int rank, void *blob, size_t *bytes);
sl_status ep_cuda_needs(sl_ep_comm *c, int group, int rank, int *needed);
sl_status ep_cuda_import(sl_ep_comm *c, int group, int rank, const void *blob, size_t bytes);
sl_status ep_cuda_connect(sl_ep_comm *c);
sl_status ep_cuda_disconnect(sl_ep_comm *c);

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
