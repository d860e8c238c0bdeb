/*
 * Expert parallelism on the CPU: the layout (which rank each token goes to, and where), dispatch,
 * combine and redispatch over the shared-memory rendezvous of ep_comm.c (the CPU transport's table,
 * ep_transport_cpu), and the local fan_out / fan_in. See include/sluice.h for the contract.
 *
 * The transport pulls: after the rendezvous each rank reads the peers' arrays it needs (rows of x
 * for dispatch, rows of y for combine) straight from their memory, so each row is copied exactly
 * once.
 *
 * dispatch, on rank d, for source s = 0..R-1 in order:
 *     rows [off_s, off_s + n[s->d]) of recv_x hold the tokens of s that have an expert on d, in
 * token order; off_s = sum of n[s'->d] over s' < s. A token's position within its block is
 * send_pos, computed by its own rank before the exchange (sl_ep_layout_cpu), so the receiver reads
 * it. Each rank turns its send_pos into absolute rows (send_row) after everyone has left.
 */
#include <stdio.h>
#include <stdlib.h>

#include "ep_internal.h"

void ep_row_accumulate(sl_dtype t, const void *src, int64_t row, int64_t h, float scale,
                       float *acc) {
  if (t == SL_DTYPE_F32) {
    const float *s = (const float *)src + row * h;
    for (int64_t i = 0; i < h; ++i) acc[i] += scale * s[i];
  } else if (t == SL_DTYPE_BF16) {
    const uint16_t *s = (const uint16_t *)src + row * h;
    for (int64_t i = 0; i < h; ++i) acc[i] += scale * sl_bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = (const uint16_t *)src + row * h;
    for (int64_t i = 0; i < h; ++i) acc[i] += scale * sl_f16_to_f32(s[i]);
  }
}

void ep_row_store(sl_dtype t, const float *acc, int64_t h, void *dst, int64_t row) {
  if (t == SL_DTYPE_F32) {
    memcpy((float *)dst + row * h, acc, (size_t)h * sizeof(float));
  } else if (t == SL_DTYPE_BF16) {
    uint16_t *d = (uint16_t *)dst + row * h;
    for (int64_t i = 0; i < h; ++i) d[i] = sl_f32_to_bf16(acc[i]);
  } else {
    uint16_t *d = (uint16_t *)dst + row * h;
    for (int64_t i = 0; i < h; ++i) d[i] = sl_f32_to_f16(acc[i]);
  }
}

static int is_float_dtype(sl_dtype t) {
  return t == SL_DTYPE_F32 || t == SL_DTYPE_BF16 || t == SL_DTYPE_F16;
}

/* ---- descriptor checks ---- */
static sl_status check_desc(const sl_ep_desc *d, const char *op) {
  if (d == NULL) return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: desc is NULL", op);
  if (d->struct_size < sizeof(sl_ep_desc))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: desc->struct_size is %zu, expected %zu (set it with sizeof)", op,
                        d->struct_size, sizeof(sl_ep_desc));
  if (d->num_tokens < 0 || d->hidden < 0 || d->topk < 1 || d->num_experts < 1 || d->num_ranks < 1)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: need num_tokens >= 0, hidden >= 0, topk >= 1, num_experts >= 1, "
                        "num_ranks >= 1; got T=%lld H=%lld k=%lld E=%lld R=%lld",
                        op, (long long)d->num_tokens, (long long)d->hidden, (long long)d->topk,
                        (long long)d->num_experts, (long long)d->num_ranks);
  if (d->num_experts % d->num_ranks != 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: num_experts=%lld is not a multiple of the %lld ranks", op,
                        (long long)d->num_experts, (long long)d->num_ranks);
  if (!is_float_dtype(d->dtype))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: rows must be f32, bf16 or f16 (dtype %d)", op, (int)d->dtype);
  if (d->num_tokens > 0 && d->num_ranks > INT32_MAX / d->num_tokens)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: T*R = %lld*%lld does not fit in int32",
                        op, (long long)d->num_tokens, (long long)d->num_ranks);
  if (d->recv_rows < 0 || d->recv_rows > INT32_MAX)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: recv_rows=%lld must be in [0, INT32_MAX] (0: T*R)", op,
                        (long long)d->recv_rows);
  return SL_STATUS_SUCCESS;
}

/* ids [rows, k]: each in [-1, n) (-1: none), no id twice in a row. */
static sl_status check_ids(const int32_t *ids, int64_t rows, int64_t k, int64_t n, const char *op,
                           const char *row_word, const char *id_word) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = ids[r * k + j];
      if (e < -1 || e >= n)
        return sl_set_error(SL_STATUS_INVALID_VALUE,
                            "ep %s: topk_idx[%lld, %lld] = %d is outside [-1, %lld)", op,
                            (long long)r, (long long)j, e, (long long)n);
      for (int64_t i = 0; e >= 0 && i < j; ++i)
        if (ids[r * k + i] == e)
          return sl_set_error(SL_STATUS_INVALID_VALUE,
                              "ep %s: %s %lld lists %s %d twice (slots %lld and %lld)", op,
                              row_word, (long long)r, id_word, e, (long long)i, (long long)j);
    }
  return SL_STATUS_SUCCESS;
}

/* ---- layout ---- */
sl_status sl_ep_layout_cpu(const sl_ep_desc *d, const int32_t *topk_idx, int32_t *send_pos,
                           int32_t *send_counts, int32_t *expert_counts) {
  sl_status st = check_desc(d, "layout");
  if (st) return st;
  const int64_t T = d->num_tokens, k = d->topk, E = d->num_experts, R = d->num_ranks, L = E / R;
  /* Validate everything first so outputs are untouched on error. */
  st = check_ids(topk_idx, T, k, E, "layout", "token", "expert");
  if (st) return st;
  for (int64_t r = 0; r < R; ++r) send_counts[r] = 0;
  if (expert_counts)
    for (int64_t e = 0; e < E; ++e) expert_counts[e] = 0;
  for (int64_t t = 0; t < T; ++t) {
    int32_t *pos = send_pos + t * R;
    for (int64_t r = 0; r < R; ++r) pos[r] = -1;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = topk_idx[t * k + j];
      if (e < 0) continue;
      if (expert_counts) expert_counts[e]++;
      const int64_t r = e / L;
      if (pos[r] < 0) pos[r] = send_counts[r]++;
    }
  }
  return SL_STATUS_SUCCESS;
}

/* ---- the exchanges ---- */
static void post_init(ep_post *p, int op, const sl_ep_desc *d) {
  memset(p, 0, sizeof *p);
  p->op = op;
  p->dims[0] = d->num_tokens;
  p->dims[1] = d->hidden;
  p->dims[2] = d->topk;
  p->dims[3] = d->num_experts;
  p->dims[4] = d->dtype;
  p->dims[5] = ep_recv_rows(d);
}

static void post_fail(ep_post *p, sl_status st) {
  p->status = st;
  snprintf(p->msg, sizeof p->msg, "%s", sl_last_error());
}

/* After the meeting: every rank's post must be fine and agree with ours. */
static sl_status check_posts(const ep_exchange *x, int R, int group, const ep_post *mine,
                             const char *op) {
  for (int r = 0; r < R; ++r) {
    const ep_post *p = ep_post_of(x, r);
    if (p->status != SL_STATUS_SUCCESS)
      return sl_set_error(p->status, "ep %s: rank %d of group %d failed: %s", op, r, group, p->msg);
  }
  for (int r = 0; r < R; ++r) {
    const ep_post *p = ep_post_of(x, r);
    if (p->op != mine->op)
      return sl_set_error(
          SL_STATUS_INVALID_ARGUMENT,
          "ep %s: ranks of group %d met in different ops (rank %d runs op %d); every "
          "rank must run the same ops in the same order",
          op, group, r, p->op);
    if (memcmp(p->dims, mine->dims, sizeof p->dims) != 0)
      return sl_set_error(
          SL_STATUS_INVALID_ARGUMENT,
          "ep %s: rank %d of group %d has (T, H, k, E, dtype, N) = (%lld, %lld, %lld, %lld, "
          "%lld, %lld), this rank (%lld, %lld, %lld, %lld, %lld, %lld)",
          op, r, group, (long long)p->dims[0], (long long)p->dims[1], (long long)p->dims[2],
          (long long)p->dims[3], (long long)p->dims[4], (long long)p->dims[5],
          (long long)mine->dims[0], (long long)mine->dims[1], (long long)mine->dims[2],
          (long long)mine->dims[3], (long long)mine->dims[4], (long long)mine->dims[5]);
  }
  return SL_STATUS_SUCCESS;
}

/* Common prologue: the desc against the communicator. */
static sl_status open_op(const sl_ep_comm *c, const sl_ep_desc *d, const char *op) {
  sl_status st = check_desc(d, op);
  if (st) return st;
  if (d->num_ranks != c->num_ranks)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: desc->num_ranks=%lld but communicator %lld has %d ranks per group",
                        op, (long long)d->num_ranks, (long long)c->id, c->num_ranks);
  return SL_STATUS_SUCCESS;
}

/* Meets, checks the posts, and on a failure after meeting still leaves (so peers are not stranded).
 */
static sl_status meet_checked(sl_ep_comm *c, int group, int rank, const sl_ep_desc *d,
                              const ep_post *mine, const char *op, ep_exchange **x) {
  sl_status st = ep_meet(c, group, rank, d->tag, mine, op, x);
  if (st) return st;
  st = check_posts(*x, c->num_ranks, group, mine, op);
  if (st) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", sl_last_error());
    sl_status st2 = ep_leave(c, group, rank, *x, op);
    if (st2) return st2;
    return sl_set_error(st, "%s", msg);
  }
  return SL_STATUS_SUCCESS;
}

static sl_status cpu_dispatch(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, const void *x,
                              const int32_t *topk_idx, const float *topk_w, void *recv_x,
                              int32_t *recv_idx, float *recv_w, int32_t *num_recv,
                              int32_t *counts, int32_t *send_row, int32_t *recv_src) {
  const char *op = "dispatch";
  const int group = at.group, rank = at.rank;
  sl_status st = open_op(c, d, op);
  if (st) return st;
  const int64_t R = c->num_ranks, T = d->num_tokens, H = d->hidden, k = d->topk;
  const int64_t L = d->num_experts / R, N = ep_recv_rows(d);
  const size_t row_bytes = (size_t)H * sl_dtype_size(d->dtype);

  int32_t *send_counts = calloc((size_t)R, sizeof *send_counts);
  if (!send_counts) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep dispatch: out of memory");
  ep_post mine;
  post_init(&mine, EP_OP_DISPATCH, d);
  /* Our own layout first: positions within each destination's block, into send_row for now. */
  st = sl_ep_layout_cpu(d, topk_idx, send_row, send_counts, NULL);
  if (st) post_fail(&mine, st);
  if (!st && N > T * R)
    post_fail(&mine, sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                                  "recv_rows=%lld is more than T*R = %lld (the worst case)",
                                  (long long)N, (long long)(T * R)));
  mine.p[0] = x;
  mine.p[1] = topk_idx;
  mine.p[2] = topk_w;
  mine.p[3] = send_row;
  mine.p[4] = send_counts;
  ep_exchange *ex;
  st = meet_checked(c, group, rank, d, &mine, op, &ex);
  if (st) {
    free(send_counts);
    return st;
  }
  /* Every rank checks every receiver's rows against N, so all return the same error. */
  for (int64_t r = 0; r < R; ++r) {
    int64_t rows = 0;
    for (int64_t s = 0; s < R; ++s) rows += ((const int32_t *)ep_post_of(ex, (int)s)->p[4])[r];
    if (rows > N) {
      sl_status st2 = ep_leave(c, group, rank, ex, op); /* the peers read send_counts until then */
      free(send_counts);
      if (st2) return st2;
      return sl_set_error(SL_STATUS_INVALID_VALUE,
                          "ep dispatch: rank %lld of group %d would receive %lld rows, more than "
                          "recv_rows=%lld (send it its rows in several calls)",
                          (long long)r, group, (long long)rows, (long long)N);
    }
  }

  /* Gather: source by source, token by token. */
  int64_t row = 0;
  for (int64_t e = 0; e < L; ++e) counts[e] = 0;
  int64_t my_offset[64], *off = R <= 64 ? my_offset : malloc((size_t)R * sizeof *off);
  for (int64_t r = 0; r < R; ++r) off[r] = 0;
  for (int64_t s = 0; s < R; ++s) {
    const ep_post *p = ep_post_of(ex, (int)s);
    const char *xs = p->p[0];
    const int32_t *idx_s = p->p[1], *pos_s = p->p[3], *cnt_s = p->p[4];
    const float *w_s = p->p[2];
    if (s < rank)
      for (int64_t r = 0; r < R; ++r) off[r] += cnt_s[r];
    for (int64_t t = 0; t < T; ++t) {
      const int32_t q = pos_s[t * R + rank];
      if (q < 0) continue;
      const int64_t i = row + q;
      memcpy((char *)recv_x + i * row_bytes, xs + t * row_bytes, row_bytes);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = idx_s[t * k + j];
        const int local = e >= 0 && e / L == rank;
        recv_idx[i * k + j] = local ? (int32_t)(e - rank * L) : -1;
        recv_w[i * k + j] = local ? w_s[t * k + j] : 0.0f;
        if (local) counts[e - rank * L]++;
      }
      recv_src[i] = (int32_t)(s * T + t);
    }
    row += cnt_s[rank];
  }
  *num_recv = (int32_t)row;
  if (row < N) {
    memset((char *)recv_x + row * row_bytes, 0, (size_t)(N - row) * row_bytes);
    for (int64_t i = row; i < N; ++i) {
      recv_src[i] = -1;
      for (int64_t j = 0; j < k; ++j) {
        recv_idx[i * k + j] = -1;
        recv_w[i * k + j] = 0.0f;
      }
    }
  }
  st = ep_leave(c, group, rank, ex, op);
  /* Nobody reads our send_pos any more: make it absolute. */
  if (st == SL_STATUS_SUCCESS)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = 0; r < R; ++r)
        if (send_row[t * R + r] >= 0) send_row[t * R + r] += (int32_t)off[r];
  if (off != my_offset) free(off);
  free(send_counts);
  return st;
}

static sl_status cpu_combine(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, const void *y,
                             const float *y_w, const int32_t *send_row, void *out, float *out_w) {
  const char *op = "combine";
  const int group = at.group, rank = at.rank;
  sl_status st = open_op(c, d, op);
  if (st) return st;
  const int64_t R = c->num_ranks, T = d->num_tokens, H = d->hidden, k = d->topk;
  const int64_t N = ep_recv_rows(d);
  ep_post mine;
  post_init(&mine, EP_OP_COMBINE, d);
  mine.dims[2] = y_w ? k : 0; /* every rank must agree on carrying weights or not */
  for (int64_t i = 0; i < T * R && mine.status == SL_STATUS_SUCCESS; ++i)
    if (send_row[i] < -1 || send_row[i] >= N) {
      sl_set_error(SL_STATUS_INVALID_VALUE,
                   "send_row[%lld, %lld] = %d is outside [-1, %lld) (not a handle from "
                   "dispatch?)",
                   (long long)(i / R), (long long)(i % R), send_row[i], (long long)N);
      post_fail(&mine, SL_STATUS_INVALID_VALUE);
    }
  float *acc = malloc(((size_t)H + 1) * sizeof *acc);
  if (!acc) {
    sl_set_error(SL_STATUS_OUT_OF_MEMORY, "out of memory");
    post_fail(&mine, SL_STATUS_OUT_OF_MEMORY);
  }
  mine.p[0] = y;
  mine.p[1] = y_w;
  ep_exchange *ex;
  st = meet_checked(c, group, rank, d, &mine, op, &ex);
  if (st) {
    free(acc);
    return st;
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) acc[i] = 0.0f;
    for (int64_t r = 0; r < R; ++r) {
      const int32_t row = send_row[t * R + r];
      if (row >= 0) ep_row_accumulate(d->dtype, ep_post_of(ex, (int)r)->p[0], row, H, 1.0f, acc);
    }
    ep_row_store(d->dtype, acc, H, out, t);
    if (y_w)
      for (int64_t j = 0; j < k; ++j) {
        float a = 0.0f;
        for (int64_t r = 0; r < R; ++r) {
          const int32_t row = send_row[t * R + r];
          if (row >= 0) a += ((const float *)ep_post_of(ex, (int)r)->p[1])[row * k + j];
        }
        out_w[t * k + j] = a;
      }
  }
  free(acc);
  return ep_leave(c, group, rank, ex, op);
}

static sl_status cpu_redispatch(sl_ep_comm *c, ep_site at, const sl_ep_desc *d, const void *g,
                                const int32_t *recv_src, void *out) {
  const char *op = "redispatch";
  const int group = at.group, rank = at.rank;
  sl_status st = open_op(c, d, op);
  if (st) return st;
  const int64_t R = c->num_ranks, T = d->num_tokens, H = d->hidden, N = ep_recv_rows(d);
  const size_t row_bytes = (size_t)H * sl_dtype_size(d->dtype);
  ep_post mine;
  post_init(&mine, EP_OP_REDISPATCH, d);
  mine.dims[2] = 0; /* k plays no part */
  for (int64_t i = 0; i < N && mine.status == SL_STATUS_SUCCESS; ++i)
    if (recv_src[i] < -1 || recv_src[i] >= T * R) {
      sl_set_error(SL_STATUS_INVALID_VALUE,
                   "recv_src[%lld] = %d is outside [-1, %lld) (not a handle from dispatch?)",
                   (long long)i, recv_src[i], (long long)(T * R));
      post_fail(&mine, SL_STATUS_INVALID_VALUE);
    }
  mine.p[0] = g;
  ep_exchange *ex;
  st = meet_checked(c, group, rank, d, &mine, op, &ex);
  if (st) return st;
  for (int64_t i = 0; i < N; ++i) {
    char *dst = (char *)out + i * row_bytes;
    const int32_t src = recv_src[i];
    if (src < 0) {
      memset(dst, 0, row_bytes);
    } else {
      const char *gs = ep_post_of(ex, (int)(src / T))->p[0];
      memcpy(dst, gs + (src % T) * row_bytes, row_bytes);
    }
  }
  return ep_leave(c, group, rank, ex, op);
}

/* Every communicator has it; the ranks share one process, so there is no setup. */
const ep_transport ep_transport_cpu = {
    "CPU", NULL, NULL, NULL, NULL, NULL, NULL, NULL, cpu_dispatch, cpu_combine, cpu_redispatch,
};

/* ---- fan_out / fan_in ---- */
sl_ep_fan_desc sl_ep_fan_desc_default(void) {
  sl_ep_fan_desc d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.topk = 1;
  d.num_local_experts = 1;
  d.x_dtype = SL_DTYPE_F32;
  d.out_dtype = SL_DTYPE_F32;
  return d;
}

int64_t sl_ep_fan_rows(const sl_ep_fan_desc *d) {
  const int64_t m = d->topk < d->num_local_experts ? d->topk : d->num_local_experts;
  const int64_t worst = d->num_rows * m;
  return d->max_rows > 0 && d->max_rows < worst ? d->max_rows : worst;
}

size_t sl_ep_fan_workspace_size(const sl_ep_fan_desc *d) {
  if (d == NULL || d->topk < 1 || d->num_rows < 0 || d->num_local_experts < 1) return 0;
  const int64_t per = ep_fan_chunk_rows(d->topk), chunks = (d->num_rows + per - 1) / per;
  return (size_t)(4 * (chunks * d->num_local_experts + d->num_local_experts + 32));
}

static sl_status check_fan(const sl_ep_fan_desc *d, const char *op) {
  if (d == NULL) return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: desc is NULL", op);
  if (d->struct_size < sizeof(sl_ep_fan_desc))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep %s: desc->struct_size is %zu, expected %zu (set it with sizeof)", op,
                        d->struct_size, sizeof(sl_ep_fan_desc));
  if (d->num_rows < 0 || d->hidden < 0 || d->topk < 1 || d->num_local_experts < 1 ||
      d->max_rows < 0)
    return sl_set_error(
        SL_STATUS_INVALID_ARGUMENT,
        "ep %s: need num_rows >= 0, hidden >= 0, topk >= 1, num_local_experts >= 1, "
        "max_rows >= 0; got N=%lld H=%lld k=%lld L=%lld max_rows=%lld",
        op, (long long)d->num_rows, (long long)d->hidden, (long long)d->topk,
        (long long)d->num_local_experts, (long long)d->max_rows);
  if (!is_float_dtype(d->x_dtype) || !is_float_dtype(d->out_dtype))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: rows must be f32, bf16 or f16", op);
  if (sl_ep_fan_rows(d) > INT32_MAX)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "ep %s: N*min(k, L) does not fit in int32", op);
  return SL_STATUS_SUCCESS;
}

sl_status sl_ep_fan_out_cpu(const sl_ep_fan_desc *d, const void *recv_x, const int32_t *recv_idx,
                            void *xs, int32_t *group_sizes, int32_t *pos) {
  sl_status st = check_fan(d, "fan_out");
  if (st) return st;
  const int64_t N = d->num_rows, H = d->hidden, k = d->topk, L = d->num_local_experts;
  const int64_t M = sl_ep_fan_rows(d);
  const size_t row_bytes = (size_t)H * sl_dtype_size(d->x_dtype);
  st = check_ids(recv_idx, N, k, L, "fan_out", "row", "local expert");
  if (st) return st;
  /* Counting sort: sizes, exclusive starts, then a stable placement in (row, slot) order. */
  int64_t *start = malloc((size_t)L * sizeof *start);
  if (!start) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep fan_out: out of memory");
  for (int64_t e = 0; e < L; ++e) group_sizes[e] = 0;
  for (int64_t i = 0; i < N * k; ++i)
    if (recv_idx[i] >= 0) group_sizes[recv_idx[i]]++;
  int64_t total = 0;
  for (int64_t e = 0; e < L; ++e) {
    start[e] = total;
    total += group_sizes[e];
    /* the pairs of e that land below M (all of them unless max_rows cuts) */
    const int64_t lo = start[e] < M ? start[e] : M, hi = total < M ? total : M;
    group_sizes[e] = (int32_t)(hi - lo);
  }
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = recv_idx[i * k + j];
      if (e < 0) {
        pos[i * k + j] = -1;
        continue;
      }
      const int64_t p = start[e]++;
      if (p >= M) { /* past max_rows: left out */
        pos[i * k + j] = -1;
        continue;
      }
      pos[i * k + j] = (int32_t)p;
      memcpy((char *)xs + p * row_bytes, (const char *)recv_x + i * row_bytes, row_bytes);
    }
  if (total < M) memset((char *)xs + total * row_bytes, 0, (size_t)(M - total) * row_bytes);
  free(start);
  return SL_STATUS_SUCCESS;
}

static sl_status check_pos(const sl_ep_fan_desc *d, const int32_t *pos, const char *op) {
  const int64_t M = sl_ep_fan_rows(d);
  for (int64_t i = 0; i < d->num_rows * d->topk; ++i)
    if (pos[i] < -1 || pos[i] >= M)
      return sl_set_error(SL_STATUS_INVALID_VALUE,
                          "ep %s: pos[%lld, %lld] = %d is outside [-1, %lld) (not from fan_out?)",
                          op, (long long)(i / d->topk), (long long)(i % d->topk), pos[i],
                          (long long)M);
  return SL_STATUS_SUCCESS;
}

sl_status sl_ep_fan_in_cpu(const sl_ep_fan_desc *d, const void *ys, const float *w,
                           const int32_t *pos, void *out) {
  sl_status st = check_fan(d, "fan_in");
  if (st || (st = check_pos(d, pos, "fan_in"))) return st;
  const int64_t N = d->num_rows, H = d->hidden, k = d->topk;
  float *acc = malloc(((size_t)H + 1) * sizeof *acc);
  if (!acc) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep fan_in: out of memory");
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t h = 0; h < H; ++h) acc[h] = 0.0f;
    for (int64_t j = 0; j < k; ++j)
      if (pos[i * k + j] >= 0)
        ep_row_accumulate(d->x_dtype, ys, pos[i * k + j], H, w[i * k + j], acc);
    ep_row_store(d->out_dtype, acc, H, out, i);
  }
  free(acc);
  return SL_STATUS_SUCCESS;
}

sl_status sl_ep_fan_in_bwd_cpu(const sl_ep_fan_desc *d, const void *dout, const void *ys,
                               const float *w, const int32_t *pos, const int32_t *group_sizes,
                               void *dys, float *dw) {
  (void)group_sizes; /* every row is written here: the named ones below, the rest zeroed first */
  sl_status st = check_fan(d, "fan_in_bwd");
  if (st || (st = check_pos(d, pos, "fan_in_bwd"))) return st;
  if ((ys == NULL) != (dw == NULL))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "ep fan_in_bwd: ys and dw must be both given or both NULL (no dw)");
  const int64_t N = d->num_rows, H = d->hidden, k = d->topk, M = sl_ep_fan_rows(d);
  float *g = malloc(((size_t)H + 1) * sizeof *g), *yrow = malloc(((size_t)H + 1) * sizeof *yrow);
  if (!g || !yrow) {
    free(g);
    free(yrow);
    return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "ep fan_in_bwd: out of memory");
  }
  /* Rows no pair names stay zero. */
  memset(dys, 0, (size_t)M * (size_t)H * sl_dtype_size(d->x_dtype));
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t h = 0; h < H; ++h) g[h] = 0.0f;
    ep_row_accumulate(d->out_dtype, dout, i, H, 1.0f, g);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t p = pos[i * k + j];
      if (p < 0) {
        if (dw) dw[i * k + j] = 0.0f;
        continue;
      }
      if (dw) {
        for (int64_t h = 0; h < H; ++h) yrow[h] = 0.0f;
        ep_row_accumulate(d->x_dtype, ys, p, H, 1.0f, yrow);
        float dot = 0.0f;
        for (int64_t h = 0; h < H; ++h) dot += g[h] * yrow[h];
        dw[i * k + j] = dot;
      }
      for (int64_t h = 0; h < H; ++h) yrow[h] = w[i * k + j] * g[h];
      ep_row_store(d->x_dtype, yrow, H, dys, p);
    }
  }
  free(g);
  free(yrow);
  return SL_STATUS_SUCCESS;
}
