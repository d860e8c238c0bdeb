/*
 * Expert-parallel communicators and the CPU rendezvous.
 *
 * A communicator is G groups of R ranks. Every communicator has the CPU rendezvous; one created
 * with use_cuda also has a device transport (ep_device_transports[desc->transport]). The public
 * entry points below find the communicator, check what is common to every transport, and call
 * the transport's table (ep_internal.h).
 *
 * The CPU transport is a rendezvous in shared memory: each
 * rank's op (on its own thread) publishes pointers to its inputs, waits until every rank of its
 * group has, reads what it needs straight from the peers' arrays, then waits until every rank is
 * done reading before it returns (so no rank's inputs are freed while a peer still reads them).
 *
 * An exchange is keyed by (tag, n): the n-th call of a rank with a tag meets the n-th call of every
 * other rank with that tag. Ops with different tags may thus interleave differently on each rank.
 * One mutex and condition variable per group guard its exchanges; waits are pthread_cond_timedwait
 * on CLOCK_MONOTONIC, never spins (a CPU client can run more devices than there are cores). A
 * timeout breaks the communicator: the peers' counts no longer line up, so every later call fails.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ep_internal.h"

struct ep_exchange {
  int64_t tag, n;
  int arrived, finished, left;
  unsigned char *has_arrived, *has_finished; /* [R] */
  ep_post *posts;                            /* [R] */
  ep_exchange *next;
};

struct ep_group {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ep_exchange *list;
  /* calls so far per (tag, rank): tags[i], calls[i * R + rank] */
  int64_t *tags, *calls;
  int ntags, cap;
};

/* ---- registry ----------------------------------------------------------------------------- */
enum { EP_MAX_COMMS = 256 };
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static sl_ep_comm *registry[EP_MAX_COMMS];
static int64_t next_id = 1;

sl_ep_comm_desc sl_ep_comm_desc_default(void) {
  sl_ep_comm_desc d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.num_groups = 1;
  d.num_ranks = 1;
  d.timeout_s = 60.0;
  return d;
}

sl_ep_desc sl_ep_desc_default(void) {
  sl_ep_desc d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.topk = 1;
  d.num_experts = 1;
  d.num_ranks = 1;
  d.dtype = SL_DTYPE_F32;
  return d;
}

static void free_group(ep_group *g) {
  while (g->list) {
    ep_exchange *e = g->list;
    g->list = e->next;
    free(e->has_arrived);
    free(e->has_finished);
    free(e->posts);
    free(e);
  }
  free(g->tags);
  free(g->calls);
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
}

static void free_comm(sl_ep_comm *c) {
  if (c->device) c->device->detach(c);
  if (c->groups)
    for (int i = 0; i < c->num_groups; ++i) free_group(&c->groups[i]);
  free(c->groups);
  free(c);
}

sl_status sl_ep_comm_create(const sl_ep_comm_desc *desc, int64_t *comm_id) {
  if (desc == NULL || comm_id == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep_comm_create: desc and comm_id must not be NULL");
  if (desc->struct_size < sizeof(sl_ep_comm_desc))
    return sl_set_error(
        SL_STATUS_INVALID_ARGUMENT,
        "ep_comm_create: desc->struct_size is %zu, expected %zu (set it with sizeof)",
        desc->struct_size, sizeof(sl_ep_comm_desc));
  if (desc->num_groups < 1 || desc->num_ranks < 1 ||
      (int64_t)desc->num_groups * desc->num_ranks > 65536)
    return sl_set_error(
        SL_STATUS_INVALID_ARGUMENT,
        "ep_comm_create: num_groups=%d and num_ranks=%d must be >= 1 (at most 65536 "
        "ranks in all)",
        desc->num_groups, desc->num_ranks);
  if (!(desc->timeout_s > 0.0))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep_comm_create: timeout_s must be > 0, got %g",
                        desc->timeout_s);
  if (desc->num_sms < 0 || desc->num_sms > 64)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep_comm_create: num_sms must be in [0, 64], got %d", desc->num_sms);
  if (desc->transport < SL_EP_TRANSPORT_PEER || desc->transport > SL_EP_TRANSPORT_NCCL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep_comm_create: transport must be 0 (PEER), 1 (IPC) or 2 (NCCL), got %d",
                        desc->transport);
  if (desc->transport != SL_EP_TRANSPORT_PEER && !desc->use_cuda)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep_comm_create: transport %d (IPC or NCCL) needs use_cuda = 1",
                        desc->transport);
  sl_ep_comm *c = calloc(1, sizeof *c);
  if (!c) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep_comm_create: out of memory");
  c->num_groups = desc->num_groups;
  c->num_ranks = desc->num_ranks;
  c->num_sms = desc->num_sms ? desc->num_sms : 64;
  c->timeout_s = desc->timeout_s;
  c->groups = calloc((size_t)desc->num_groups, sizeof *c->groups);
  if (!c->groups) {
    free(c);
    return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep_comm_create: out of memory");
  }
  for (int i = 0; i < c->num_groups; ++i) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&c->groups[i].mu, NULL);
    pthread_cond_init(&c->groups[i].cv, &ca);
    pthread_condattr_destroy(&ca);
  }
  if (desc->use_cuda) {
    c->device = ep_device_transports[desc->transport];
    if (!c->device) {
      free_comm(c);
      return sl_set_error(SL_STATUS_UNSUPPORTED,
                          "ep_comm_create: libsluice was built without CUDA");
    }
    sl_status st = c->device->attach(c, desc);
    if (st != SL_STATUS_SUCCESS) {
      free_comm(c);
      return st;
    }
  }
  pthread_mutex_lock(&registry_mu);
  int slot = -1;
  for (int i = 0; i < EP_MAX_COMMS; ++i)
    if (registry[i] == NULL) {
      slot = i;
      break;
    }
  if (slot < 0) {
    pthread_mutex_unlock(&registry_mu);
    free_comm(c);
    return sl_set_error(SL_STATUS_OUT_OF_MEMORY,
                        "ep_comm_create: %d communicators exist already; destroy some first",
                        EP_MAX_COMMS);
  }
  c->id = next_id++;
  registry[slot] = c;
  pthread_mutex_unlock(&registry_mu);
  *comm_id = c->id;
  return SL_STATUS_SUCCESS;
}

sl_status sl_ep_comm_destroy(int64_t comm_id) {
  pthread_mutex_lock(&registry_mu);
  sl_ep_comm *c = NULL;
  for (int i = 0; i < EP_MAX_COMMS; ++i)
    if (registry[i] && registry[i]->id == comm_id) {
      c = registry[i];
      registry[i] = NULL;
      break;
    }
  pthread_mutex_unlock(&registry_mu);
  if (!c)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep_comm_destroy: no communicator %lld",
                        (long long)comm_id);
  free_comm(c);
  return SL_STATUS_SUCCESS;
}

/* ---- multi-process setup: argument checks, then the device transport ----------------------- */
static sl_status setup_args(int64_t comm_id, int group, int rank, const char *op,
                            sl_ep_comm **out) {
  sl_ep_comm *c = ep_comm_get(comm_id, op);
  if (!c) return SL_STATUS_INVALID_ARGUMENT;
  if (group < 0 || group >= c->num_groups || rank < 0 || rank >= c->num_ranks)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: (group %d, rank %d) is outside communicator %lld's %d groups of %d "
                        "ranks",
                        op, group, rank, (long long)comm_id, c->num_groups, c->num_ranks);
  if (!c->device)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: communicator %lld has no CUDA transport (CPU ranks share one "
                        "process: nothing to exchange)",
                        op, (long long)comm_id);
  *out = c;
  return SL_STATUS_SUCCESS;
}

sl_status sl_ep_comm_export(int64_t comm_id, int group, int rank, void *blob, size_t *bytes) {
  sl_ep_comm *c = NULL;
  sl_status st = setup_args(comm_id, group, rank, "comm_export", &c);
  if (st) return st;
  if (!blob || !bytes)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_export: blob and bytes must not be NULL (blob: %d bytes)",
                        SL_EP_BLOB_BYTES);
  return c->device->export_blob(c, group, rank, blob, bytes);
}

sl_status sl_ep_comm_needs(int64_t comm_id, int group, int rank, int *needed) {
  sl_ep_comm *c = NULL;
  sl_status st = setup_args(comm_id, group, rank, "comm_needs", &c);
  if (st) return st;
  if (!needed)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep comm_needs: needed must not be NULL");
  return c->device->needs(c, group, rank, needed);
}

sl_status sl_ep_comm_import(int64_t comm_id, int group, int rank, const void *blob, size_t bytes) {
  sl_ep_comm *c = NULL;
  sl_status st = setup_args(comm_id, group, rank, "comm_import", &c);
  if (st) return st;
  if (!blob || bytes == 0 || bytes > SL_EP_BLOB_BYTES)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_import: blob of (group %d, rank %d) has %zu bytes, expected 1..%d "
                        "(what sl_ep_comm_export gave on its process)",
                        group, rank, bytes, SL_EP_BLOB_BYTES);
  int needed = 0;
  c->device->needs(c, group, rank, &needed);
  if (!needed)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep comm_import: (group %d, rank %d) is not needed here (it is local, its "
                        "group has no rank in this process, or the %s transport does not use it)",
                        group, rank, c->device->name);
  return c->device->import_blob(c, group, rank, blob, bytes);
}

sl_status sl_ep_comm_connect(int64_t comm_id) {
  sl_ep_comm *c = NULL;
  sl_status st = setup_args(comm_id, 0, 0, "comm_connect", &c);
  if (st) return st;
  return c->device->connect(c);
}

sl_status sl_ep_comm_disconnect(int64_t comm_id) {
  sl_ep_comm *c = NULL;
  sl_status st = setup_args(comm_id, 0, 0, "comm_disconnect", &c);
  if (st) return st;
  return c->device->disconnect(c);
}

sl_ep_comm *ep_comm_get(int64_t id, const char *op) {
  sl_ep_comm *c = NULL;
  pthread_mutex_lock(&registry_mu);
  for (int i = 0; i < EP_MAX_COMMS; ++i)
    if (registry[i] && registry[i]->id == id) c = registry[i];
  pthread_mutex_unlock(&registry_mu);
  if (!c)
    sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                 "ep %s: no communicator %lld (call sluice.ep.setup first; was it torn down?)", op,
                 (long long)id);
  return c;
}

/* ---- the rendezvous ----------------------------------------------------------------------- */
static struct timespec deadline_after(double s) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  time_t whole = (time_t)s;
  long ns = (long)((s - (double)whole) * 1e9);
  t.tv_sec += whole;
  t.tv_nsec += ns;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec += 1;
    t.tv_nsec -= 1000000000L;
  }
  return t;
}

/* The call count of (tag, rank) before this call, incremented. -1 when out of memory. */
static int64_t next_call(ep_group *g, int R, int rank, int64_t tag) {
  int i = 0;
  while (i < g->ntags && g->tags[i] != tag) ++i;
  if (i == g->ntags) {
    if (g->ntags == g->cap) {
      int cap = g->cap ? 2 * g->cap : 16;
      int64_t *tags = realloc(g->tags, (size_t)cap * sizeof *tags);
      if (!tags) return -1;
      g->tags = tags;
      int64_t *calls = realloc(g->calls, (size_t)cap * R * sizeof *calls);
      if (!calls) return -1;
      g->calls = calls;
      g->cap = cap;
    }
    g->tags[i] = tag;
    memset(g->calls + (size_t)i * R, 0, (size_t)R * sizeof *g->calls);
    g->ntags++;
  }
  return g->calls[(size_t)i * R + rank]++;
}

static ep_exchange *find_or_make(ep_group *g, int R, int64_t tag, int64_t n) {
  for (ep_exchange *e = g->list; e; e = e->next)
    if (e->tag == tag && e->n == n) return e;
  ep_exchange *e = calloc(1, sizeof *e);
  if (!e) return NULL;
  e->has_arrived = calloc((size_t)R, 1);
  e->has_finished = calloc((size_t)R, 1);
  e->posts = calloc((size_t)R, sizeof *e->posts);
  if (!e->has_arrived || !e->has_finished || !e->posts) {
    free(e->has_arrived);
    free(e->has_finished);
    free(e->posts);
    free(e);
    return NULL;
  }
  e->tag = tag;
  e->n = n;
  e->next = g->list;
  g->list = e;
  return e;
}

static void unlink_exchange(ep_group *g, ep_exchange *x) {
  for (ep_exchange **p = &g->list; *p; p = &(*p)->next)
    if (*p == x) {
      *p = x->next;
      break;
    }
  free(x->has_arrived);
  free(x->has_finished);
  free(x->posts);
  free(x);
}

/* "1, 3 and 4" (at most a few, then "..."): the ranks whose flag is 0. */
static void missing_ranks(const unsigned char *flags, int R, char *buf, size_t len) {
  size_t used = 0;
  int shown = 0, total = 0;
  for (int r = 0; r < R; ++r) total += !flags[r];
  buf[0] = '\0';
  for (int r = 0; r < R && used + 16 < len; ++r) {
    if (flags[r]) continue;
    if (shown == 8) {
      snprintf(buf + used, len - used, " and %d more", total - shown);
      return;
    }
    used += (size_t)snprintf(buf + used, len - used, "%s%d", shown ? ", " : "", r);
    ++shown;
  }
}

static int is_broken(const sl_ep_comm *c) { return __atomic_load_n(&c->broken, __ATOMIC_ACQUIRE); }

/* The first failure writes the message; groups other than the failing one see the flag at their
 * next call or wake-up (it is monotone, so reading it without their lock is fine). */
static void mark_broken(sl_ep_comm *c) {
  if (__atomic_exchange_n(&c->broken_claim, 1, __ATOMIC_ACQ_REL) == 0) {
    snprintf(c->broken_msg, sizeof c->broken_msg, "%s", sl_last_error());
    __atomic_store_n(&c->broken, 1, __ATOMIC_RELEASE);
  }
}

static sl_status broken_error(const sl_ep_comm *c, const char *op) {
  return sl_set_error(
      SL_STATUS_TIMEOUT,
      "ep %s: communicator %lld is broken by an earlier failure (%s); create a new one "
      "(sluice.ep.setup)",
      op, (long long)c->id, c->broken_msg);
}

/* Waits on g->cv until *count reaches R, the deadline passes or the communicator breaks.
 * Returns 0 when reached, ETIMEDOUT, or -1 when broken. Called with g->mu held. */
static int wait_for(sl_ep_comm *c, ep_group *g, const int *count, int R,
                    const struct timespec *dl) {
  while (*count < R) {
    if (is_broken(c)) return -1;
    int rc = pthread_cond_timedwait(&g->cv, &g->mu, dl);
    if (rc == ETIMEDOUT && *count < R) return is_broken(c) ? -1 : ETIMEDOUT;
  }
  return 0;
}

static sl_status timed_out(sl_ep_comm *c, ep_group *g, int group, int rank, const ep_exchange *x,
                           const unsigned char *flags, const char *op, const char *what) {
  char who[128];
  missing_ranks(flags, c->num_ranks, who, sizeof who);
  sl_status st = sl_set_error(
      SL_STATUS_TIMEOUT,
      "ep %s: rank %d of group %d waited %.3g s at exchange (tag %lld, call #%lld) for rank(s) %s "
      "to %s; communicator %lld is now broken",
      op, rank, group, c->timeout_s, (long long)x->tag, (long long)x->n, who, what,
      (long long)c->id);
  mark_broken(c);
  pthread_cond_broadcast(&g->cv);
  return st;
}

/* Marks this rank in flags and *count, wakes the group, then waits (bounded) until *count reaches
 * R: the status, a timeout naming the ranks still unmarked and what they were waited for to do.
 * Called with g->mu held. */
static sl_status mark_and_wait(sl_ep_comm *c, ep_group *g, int group, int rank,
                               const ep_exchange *x, unsigned char *flags, int *count,
                               const char *op, const char *what) {
  flags[rank] = 1;
  (*count)++;
  pthread_cond_broadcast(&g->cv);
  const struct timespec dl = deadline_after(c->timeout_s);
  int rc = wait_for(c, g, count, c->num_ranks, &dl);
  if (rc == ETIMEDOUT) return timed_out(c, g, group, rank, x, flags, op, what);
  if (rc < 0) return broken_error(c, op);
  return SL_STATUS_SUCCESS;
}

sl_status ep_meet(sl_ep_comm *c, int group, int rank, int64_t tag, const ep_post *mine,
                  const char *op, ep_exchange **out) {
  if (group < 0 || group >= c->num_groups || rank < 0 || rank >= c->num_ranks)
    return sl_set_error(
        SL_STATUS_INVALID_ARGUMENT,
        "ep %s: (group %d, rank %d) is outside communicator %lld's %d groups of %d ranks", op,
        group, rank, (long long)c->id, c->num_groups, c->num_ranks);
  ep_group *g = &c->groups[group];
  const int R = c->num_ranks;
  pthread_mutex_lock(&g->mu);
  if (is_broken(c)) {
    pthread_mutex_unlock(&g->mu);
    return broken_error(c, op);
  }
  int64_t n = next_call(g, R, rank, tag);
  ep_exchange *x = n < 0 ? NULL : find_or_make(g, R, tag, n);
  if (!x) {
    pthread_mutex_unlock(&g->mu);
    return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep %s: out of memory", op);
  }
  x->posts[rank] = *mine;
  sl_status st = mark_and_wait(c, g, group, rank, x, x->has_arrived, &x->arrived, op, "arrive");
  pthread_mutex_unlock(&g->mu);
  *out = st == SL_STATUS_SUCCESS ? x : NULL;
  return st;
}

const ep_post *ep_post_of(const ep_exchange *ex, int rank) { return &ex->posts[rank]; }

sl_status ep_leave(sl_ep_comm *c, int group, int rank, ep_exchange *x, const char *op) {
  ep_group *g = &c->groups[group];
  const int R = c->num_ranks;
  pthread_mutex_lock(&g->mu);
  sl_status st =
      mark_and_wait(c, g, group, rank, x, x->has_finished, &x->finished, op, "finish reading");
  /* Freed by the last rank out; after a failure it stays until the communicator is destroyed. */
  if (st == SL_STATUS_SUCCESS && ++x->left == R) unlink_exchange(g, x);
  pthread_mutex_unlock(&g->mu);
  return st;
}

/* ---- ops: the CPU rendezvous, or the communicator's device transport ---------------------- */
sl_status sl_ep_dispatch_cpu(int64_t comm_id, int group, int rank, const sl_ep_desc *d,
                             const void *x, const int32_t *topk_idx, const float *topk_w,
                             void *recv_x, int32_t *recv_idx, float *recv_w, int32_t *num_recv,
                             int32_t *counts, int32_t *send_row, int32_t *recv_src) {
  sl_ep_comm *c = ep_comm_get(comm_id, "dispatch");
  if (!c) return SL_STATUS_INVALID_ARGUMENT;
  const ep_site at = {group, rank, NULL};
  return ep_transport_cpu.dispatch(c, at, d, x, topk_idx, topk_w, recv_x, recv_idx, recv_w,
                                   num_recv, counts, send_row, recv_src);
}

sl_status sl_ep_combine_cpu(int64_t comm_id, int group, int rank, const sl_ep_desc *d,
                            const void *y, const float *y_w, const int32_t *send_row, void *out,
                            float *out_w) {
  sl_ep_comm *c = ep_comm_get(comm_id, "combine");
  if (!c) return SL_STATUS_INVALID_ARGUMENT;
  const ep_site at = {group, rank, NULL};
  return ep_transport_cpu.combine(c, at, d, y, y_w, send_row, out, out_w);
}

sl_status sl_ep_redispatch_cpu(int64_t comm_id, int group, int rank, const sl_ep_desc *d,
                               const void *g, const int32_t *recv_src, void *out) {
  sl_ep_comm *c = ep_comm_get(comm_id, "redispatch");
  if (!c) return SL_STATUS_INVALID_ARGUMENT;
  const ep_site at = {group, rank, NULL};
  return ep_transport_cpu.redispatch(c, at, d, g, recv_src, out);
}

/* The communicator of a device op, with its device transport. */
static sl_status device_comm(int64_t comm_id, const char *op, sl_ep_comm **c) {
  if (!sl_has_cuda())
    return sl_set_error(SL_STATUS_UNSUPPORTED, "ep %s: libsluice was built without CUDA", op);
  *c = ep_comm_get(comm_id, op);
  if (!*c) return SL_STATUS_INVALID_ARGUMENT;
  if (!(*c)->device)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: communicator %lld was set up without CUDA (a CPU mesh?)", op,
                        (long long)comm_id);
  return SL_STATUS_SUCCESS;
}

sl_status sl_ep_dispatch_cuda(int64_t comm_id, const sl_ep_desc *d, const void *x,
                              const int32_t *topk_idx, const float *topk_w, void *recv_x,
                              int32_t *recv_idx, float *recv_w, int32_t *num_recv, int32_t *counts,
                              int32_t *send_row, int32_t *recv_src, void *stream) {
  sl_ep_comm *c = NULL;
  sl_status st = device_comm(comm_id, "dispatch", &c);
  if (st) return st;
  const ep_site at = {-1, -1, stream};
  return c->device->dispatch(c, at, d, x, topk_idx, topk_w, recv_x, recv_idx, recv_w, num_recv,
                             counts, send_row, recv_src);
}

sl_status sl_ep_combine_cuda(int64_t comm_id, const sl_ep_desc *d, const void *y,
                             const float *y_w, const int32_t *send_row, void *out, float *out_w,
                             void *stream) {
  sl_ep_comm *c = NULL;
  sl_status st = device_comm(comm_id, "combine", &c);
  if (st) return st;
  const ep_site at = {-1, -1, stream};
  return c->device->combine(c, at, d, y, y_w, send_row, out, out_w);
}

sl_status sl_ep_redispatch_cuda(int64_t comm_id, const sl_ep_desc *d, const void *g,
                                const int32_t *recv_src, void *out, void *stream) {
  sl_ep_comm *c = NULL;
  sl_status st = device_comm(comm_id, "redispatch", &c);
  if (st) return st;
  const ep_site at = {-1, -1, stream};
  return c->device->redispatch(c, at, d, g, recv_src, out);
}
