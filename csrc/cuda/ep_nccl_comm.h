/* The NCCL plumbing of the expert-parallel NCCL transport (ep_nccl_comm.cu): libnccl is loaded at
 * run time (dlopen), so libsluice loads and runs its other transports where NCCL is absent; a build
 * without nccl.h gets stubs that return SL_STATUS_UNSUPPORTED. The kernels and the op sequences
 * live in ep_nccl.cu. Not installed. */
#ifndef SLUICE_EP_NCCL_COMM_H_
#define SLUICE_EP_NCCL_COMM_H_

#include <cuda_runtime.h>
#include <stddef.h>

#include "../core/ep_internal.h"

#define EP_NCCL_ID_BYTES 128

typedef struct ep_nccl ep_nccl; /* one local rank's communicator and its watchdog */

typedef struct ep_xfer {
  void *buf;
  size_t bytes;
  int peer;
} ep_xfer;

/* SL_STATUS_SUCCESS when libnccl could be loaded (SL_STATUS_UNSUPPORTED with the reason otherwise).
 */
sl_status ep_nccl_load(const char *op);
/* A fresh ncclUniqueId (on the process that holds rank 0 of a group). */
sl_status ep_nccl_unique_id(unsigned char id[EP_NCCL_ID_BYTES]);
/* Creates the communicators of n local ranks: rank ranks[i] of group groups[i] (R ranks) on device
 * ordinals[i], with ids + 128*i its group's id. Non-blocking NCCL communicators; the wait for the
 * other ranks to join is bounded by timeout_s (SL_STATUS_TIMEOUT naming the rank). */
sl_status ep_nccl_init(int n, const int *ordinals, const int *ranks, const int *groups, int R,
                       const unsigned char *ids, double timeout_s, ep_nccl **out);
/* One grouped exchange on `stream` (sends and receives of bytes, NCCL's int8), then a watchdog
 * event: if it has not completed timeout_s after it could start, the watchdog aborts the
 * communicator and records which rank and call it was. Zero-byte transfers are skipped (both sides
 * skip alike). */
sl_status ep_nccl_exchange(ep_nccl *h, cudaStream_t stream, const ep_xfer *send, int nsend,
                           const ep_xfer *recv, int nrecv, const char *op, unsigned long long call);
/* recv[r * bytes ...] = rank r's send (bytes each), watched the same way; point-to-point (sends and
 * receives with every peer, a local copy for the own slot), so no collective connection is needed.
 */
sl_status ep_nccl_allgather(ep_nccl *h, cudaStream_t stream, const void *send, void *recv,
                            size_t bytes, const char *op, unsigned long long call);
/* 1 (and the message) once the watchdog or a failed call has broken this communicator. */
int ep_nccl_failed(ep_nccl *h, char *msg, size_t len);
/* Stops the watchdog and destroys (or, if broken, aborts) the communicator. NULL is fine. */
void ep_nccl_destroy(ep_nccl *h);

#endif /* SLUICE_EP_NCCL_COMM_H_ */
