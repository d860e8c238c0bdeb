/*
 * XLA FFI handlers for expert parallelism (CPU and CUDA): dispatch, combine, redispatch, fan_out,
 * fan_in, fan_in_bwd. Shapes and dtypes are checked here; the C API does the rest.
 *
 * Exchange ops (attributes comm_id, num_ranks, num_experts, tag; `where` is int32 [2] = (group,
 * rank), read on the CPU only: on a GPU the rank is the device's place in the communicator;
 * N: the receiving side's rows, read from the buffers' shapes (sl_ep_desc.recv_rows): T*R at
 * most for dispatch (the worst case), any N >= 1 for redispatch, 0 only where T*R is 0;
 * L = E/R):
 * - dispatch: x [T,H], topk_idx s32 [T,k], topk_weights f32 [T,k], where -> recv_x [N,H],
 *   recv_idx s32 [N,k], recv_w f32 [N,k], num_recv s32 [1], counts s32 [L], send_row s32 [T,R],
 *   recv_src s32 [N]
 * - combine: y [N,H], (y_w f32 [N,k],) send_row [T,R], where -> out [T,H] (, out_w f32 [T,k])
 * - redispatch: g [T,H], recv_src [N] (s*T + t), where -> out [N,H]
 * Local ops (attributes num_local_experts, max_rows, skip_unused_rows; sl_ep_fan_desc):
 * - fan_out: recv_x [N,H], recv_idx [N,k] -> xs [M,H], group_sizes s32 [L], pos s32 [N,k],
 *   workspace u8 [sl_ep_fan_workspace_size] (CUDA scratch)
 * - fan_in: ys [M,H], w f32 [N,k], pos [N,k] -> out [N,H]
 * - fan_in_bwd (attribute with_dw): dout [N,H], (ys [M,H],) w [N,k], pos [N,k], group_sizes [L]
 *   -> dys [M,H] (, dw f32 [N,k])
 */
#include <string.h>

#include "ffi_util.h"

typedef struct {
  const XLA_FFI_CallFrame *f;
  const char *op;
} ctx;

/* Checks buffer `b` (named `what`) has the given rank, dims (-1: any) and, if dtype >= 0, dtype. */
static XLA_FFI_Error *expect(ctx c, const XLA_FFI_Buffer *b, const char *what, int rank,
                             const int64_t *dims, int dtype) {
  if (b->rank != rank)
    return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep %s: %s has rank %lld, expected %d", c.op, what,
                        (long long)b->rank, rank);
  for (int i = 0; i < rank; ++i)
    if (dims[i] >= 0 && b->dims[i] != dims[i])
      return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "sluice ep %s: %s has dim %d = %lld, expected %lld", c.op, what, i,
                          (long long)b->dims[i], (long long)dims[i]);
  if (dtype >= 0 && b->dtype != (XLA_FFI_DataType)dtype)
    return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep %s: %s must be %s, got %s", c.op, what,
                        sl_ffi_dtype_name((XLA_FFI_DataType)dtype), sl_ffi_dtype_name(b->dtype));
  return NULL;
}

static XLA_FFI_Error *float_dtype(ctx c, const XLA_FFI_Buffer *b, const char *what, sl_dtype *out) {
  if (!sl_ffi_dtype(b->dtype, out) || *out == SL_DTYPE_I32)
    return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep %s: %s must be float32, bfloat16 or float16, got %s", c.op, what,
                        sl_ffi_dtype_name(b->dtype));
  return NULL;
}

#define TRY(e)                 \
  do {                         \
    XLA_FFI_Error *err_ = (e); \
    if (err_) return err_;     \
  } while (0)

enum { S32 = XLA_FFI_DataType_S32, F32 = XLA_FFI_DataType_F32 };

/* The exchange ops' prologue: the frame's counts, then the attributes into a desc, plus the comm
 * id. */
static XLA_FFI_Error *exchange_attrs(ctx c, int64_t nargs, int64_t nrets, sl_ep_desc *d,
                                     int64_t *comm) {
  TRY(sl_ffi_check_frame(c.f, c.op, nargs, nrets));
  *d = sl_ep_desc_default();
  TRY(sl_ffi_int_attr(c.f, c.op, "comm_id", comm));
  TRY(sl_ffi_int_attr(c.f, c.op, "num_ranks", &d->num_ranks));
  TRY(sl_ffi_int_attr(c.f, c.op, "num_experts", &d->num_experts));
  TRY(sl_ffi_int_attr(c.f, c.op, "tag", &d->tag));
  if (d->num_ranks < 1 || d->num_experts < 1 || d->num_experts % d->num_ranks)
    return sl_ffi_error(
        c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
        "sluice ep %s: num_experts=%lld must be a positive multiple of num_ranks=%lld", c.op,
        (long long)d->num_experts, (long long)d->num_ranks);
  return NULL;
}

/* (group, rank) from the `where` operand (CPU only: host memory). */
static XLA_FFI_Error *where_of(ctx c, const XLA_FFI_Buffer *b, int *group, int *rank) {
  const int64_t two[1] = {2};
  TRY(expect(c, b, "where (group, rank)", 1, two, S32));
  *group = ((const int32_t *)b->data)[0];
  *rank = ((const int32_t *)b->data)[1];
  return NULL;
}

/* The [rows, H] float operand of an exchange op (x, y or g): its dtype and H into the desc. */
static XLA_FFI_Error *float_rows(ctx c, const XLA_FFI_Buffer *b, const char *what, sl_ep_desc *d) {
  if (b->rank != 2) return expect(c, b, what, 2, (int64_t[]){-1, -1}, -1);
  TRY(float_dtype(c, b, what, &d->dtype));
  d->hidden = b->dims[1];
  return NULL;
}

/* N, the receiving side's rows of a call whose worst case is T*R: into desc->recv_rows. */
static XLA_FFI_Error *recv_rows(ctx c, int64_t n, int64_t most, sl_ep_desc *d) {
  const int64_t worst = d->num_tokens * d->num_ranks;
  if (n < 0 || (n == 0 && worst > 0))
    return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep %s: the receiving side has %lld rows; need at least 1", c.op,
                        (long long)n);
  if (most > 0 && n > most)
    return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep %s: %lld receiving rows is more than T*R = %lld, the worst case",
                        c.op, (long long)n, (long long)most);
  d->recv_rows = n;
  return NULL;
}

static XLA_FFI_Error *stream_of(ctx c, void **stream) {
  XLA_FFI_Error *err = NULL;
  *stream = sl_ffi_stream(c.f, &err);
  return err;
}

static XLA_FFI_Error *status(ctx c, sl_status st) {
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(c.f, c.op, st);
}

/* ---- dispatch ---- */
static XLA_FFI_Error *dispatch(XLA_FFI_CallFrame *f, int on_cuda) {
  if (sl_ffi_answer_metadata(f, 0)) return NULL;
  ctx c = {f, "dispatch"};
  sl_ep_desc d;
  int64_t comm;
  TRY(exchange_attrs(c, 4, 7, &d, &comm));
  const XLA_FFI_Buffer *x = sl_ffi_arg(f, 0), *idx = sl_ffi_arg(f, 1), *w = sl_ffi_arg(f, 2);
  TRY(float_rows(c, x, "x", &d));
  d.num_tokens = x->dims[0];
  if (idx->rank != 2) return expect(c, idx, "topk_idx", 2, (int64_t[]){-1, -1}, S32);
  d.topk = idx->dims[1];
  const int64_t T = d.num_tokens, H = d.hidden, k = d.topk, R = d.num_ranks, L = d.num_experts / R;
  XLA_FFI_Buffer *rx0 = sl_ffi_ret(f, 0);
  if (rx0->rank != 2) return expect(c, rx0, "recv_x", 2, (int64_t[]){-1, H}, x->dtype);
  const int64_t N = rx0->dims[0];
  TRY(recv_rows(c, N, T * R, &d));
  TRY(expect(c, idx, "topk_idx", 2, (int64_t[]){T, k}, S32));
  TRY(expect(c, w, "topk_weights", 2, (int64_t[]){T, k}, F32));
  XLA_FFI_Buffer *rx = sl_ffi_ret(f, 0), *ri = sl_ffi_ret(f, 1), *rw = sl_ffi_ret(f, 2),
                 *nr = sl_ffi_ret(f, 3), *cn = sl_ffi_ret(f, 4), *sr = sl_ffi_ret(f, 5),
                 *rs = sl_ffi_ret(f, 6);
  TRY(expect(c, rx, "recv_x", 2, (int64_t[]){N, H}, x->dtype));
  TRY(expect(c, ri, "recv_idx", 2, (int64_t[]){N, k}, S32));
  TRY(expect(c, rw, "recv_weights", 2, (int64_t[]){N, k}, F32));
  TRY(expect(c, nr, "num_recv", 1, (int64_t[]){1}, S32));
  TRY(expect(c, cn, "counts", 1, (int64_t[]){L}, S32));
  TRY(expect(c, sr, "send_row", 2, (int64_t[]){T, R}, S32));
  TRY(expect(c, rs, "recv_src", 1, (int64_t[]){N}, S32));
  if (!on_cuda) {
    int group, rank;
    TRY(where_of(c, sl_ffi_arg(f, 3), &group, &rank));
    return status(c,
                  sl_ep_dispatch_cpu(comm, group, rank, &d, x->data, idx->data, w->data, rx->data,
                                     ri->data, rw->data, nr->data, cn->data, sr->data, rs->data));
  }
  void *stream;
  TRY(stream_of(c, &stream));
  return status(c, sl_ep_dispatch_cuda(comm, &d, x->data, idx->data, w->data, rx->data, ri->data,
                                       rw->data, nr->data, cn->data, sr->data, rs->data, stream));
}

/* ---- combine ---- */
static XLA_FFI_Error *combine(XLA_FFI_CallFrame *f, int on_cuda) {
  if (sl_ffi_answer_metadata(f, 0)) return NULL;
  ctx c = {f, "combine"};
  const int with_w = f->args.size == 4;
  sl_ep_desc d;
  int64_t comm;
  TRY(exchange_attrs(c, with_w ? 4 : 3, with_w ? 2 : 1, &d, &comm));
  const XLA_FFI_Buffer *y = sl_ffi_arg(f, 0), *yw = with_w ? sl_ffi_arg(f, 1) : NULL,
                       *sr = sl_ffi_arg(f, with_w ? 2 : 1), *wh = sl_ffi_arg(f, with_w ? 3 : 2);
  XLA_FFI_Buffer *out = sl_ffi_ret(f, 0), *ow = with_w ? sl_ffi_ret(f, 1) : NULL;
  const int64_t R = d.num_ranks;
  if (sr->rank != 2) return expect(c, sr, "send_row", 2, (int64_t[]){-1, R}, S32);
  const int64_t T = sr->dims[0];
  TRY(float_rows(c, y, "y", &d));
  d.num_tokens = T;
  const int64_t N = y->dims[0];
  TRY(recv_rows(c, N, 0, &d));
  TRY(expect(c, sr, "send_row", 2, (int64_t[]){T, R}, S32));
  TRY(expect(c, y, "y", 2, (int64_t[]){N, d.hidden}, -1));
  TRY(expect(c, out, "out", 2, (int64_t[]){T, d.hidden}, y->dtype));
  if (with_w) {
    if (yw->rank != 2) return expect(c, yw, "y_weights", 2, (int64_t[]){N, -1}, F32);
    d.topk = yw->dims[1];
    TRY(expect(c, yw, "y_weights", 2, (int64_t[]){N, d.topk}, F32));
    TRY(expect(c, ow, "out_weights", 2, (int64_t[]){T, d.topk}, F32));
  }
  if (!on_cuda) {
    int group, rank;
    TRY(where_of(c, wh, &group, &rank));
    return status(c, sl_ep_combine_cpu(comm, group, rank, &d, y->data, yw ? yw->data : NULL,
                                       sr->data, out->data, ow ? ow->data : NULL));
  }
  void *stream;
  TRY(stream_of(c, &stream));
  return status(c, sl_ep_combine_cuda(comm, &d, y->data, yw ? yw->data : NULL, sr->data, out->data,
                                      ow ? ow->data : NULL, stream));
}

/* ---- redispatch ---- */
static XLA_FFI_Error *redispatch(XLA_FFI_CallFrame *f, int on_cuda) {
  if (sl_ffi_answer_metadata(f, 0)) return NULL;
  ctx c = {f, "redispatch"};
  sl_ep_desc d;
  int64_t comm;
  TRY(exchange_attrs(c, 3, 1, &d, &comm));
  const XLA_FFI_Buffer *g = sl_ffi_arg(f, 0), *rs = sl_ffi_arg(f, 1), *wh = sl_ffi_arg(f, 2);
  XLA_FFI_Buffer *out = sl_ffi_ret(f, 0);
  TRY(float_rows(c, g, "g", &d));
  d.num_tokens = g->dims[0];
  if (rs->rank != 1) return expect(c, rs, "recv_src", 1, (int64_t[]){-1}, S32);
  const int64_t N = rs->dims[0];
  TRY(recv_rows(c, N, 0, &d));
  TRY(expect(c, rs, "recv_src", 1, (int64_t[]){N}, S32));
  TRY(expect(c, out, "out", 2, (int64_t[]){N, d.hidden}, g->dtype));
  if (!on_cuda) {
    int group, rank;
    TRY(where_of(c, wh, &group, &rank));
    return status(c, sl_ep_redispatch_cpu(comm, group, rank, &d, g->data, rs->data, out->data));
  }
  void *stream;
  TRY(stream_of(c, &stream));
  return status(c, sl_ep_redispatch_cuda(comm, &d, g->data, rs->data, out->data, stream));
}

/* ---- fan_out / fan_in ---- */
static XLA_FFI_Error *fan_attrs(ctx c, sl_ep_fan_desc *d) {
  *d = sl_ep_fan_desc_default();
  TRY(sl_ffi_int_attr(c.f, c.op, "num_local_experts", &d->num_local_experts));
  TRY(sl_ffi_int_attr(c.f, c.op, "max_rows", &d->max_rows));
  int64_t skip = 0;
  TRY(sl_ffi_int_attr(c.f, c.op, "skip_unused_rows", &skip));
  d->skip_unused_rows = skip != 0;
  if (d->num_local_experts < 1 || d->max_rows < 0)
    return sl_ffi_error(c.f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep %s: need num_local_experts >= 1 and max_rows >= 0", c.op);
  return NULL;
}

static XLA_FFI_Error *fan_out(XLA_FFI_CallFrame *f, int on_cuda) {
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda))) return NULL;
  ctx c = {f, "fan_out"};
  TRY(sl_ffi_check_frame(f, c.op, 2, 4));
  sl_ep_fan_desc d;
  TRY(fan_attrs(c, &d));
  const XLA_FFI_Buffer *rx = sl_ffi_arg(f, 0), *ri = sl_ffi_arg(f, 1);
  XLA_FFI_Buffer *xs = sl_ffi_ret(f, 0), *gs = sl_ffi_ret(f, 1), *pos = sl_ffi_ret(f, 2);
  if (rx->rank != 2) return expect(c, rx, "x", 2, (int64_t[]){-1, -1}, -1);
  if (ri->rank != 2) return expect(c, ri, "topk_idx", 2, (int64_t[]){-1, -1}, S32);
  TRY(float_dtype(c, rx, "x", &d.x_dtype));
  d.out_dtype = d.x_dtype;
  d.num_rows = rx->dims[0];
  d.hidden = rx->dims[1];
  d.topk = ri->dims[1];
  const int64_t N = d.num_rows, k = d.topk;
  TRY(expect(c, ri, "topk_idx", 2, (int64_t[]){N, k}, S32));
  TRY(expect(c, xs, "xs", 2, (int64_t[]){sl_ep_fan_rows(&d), d.hidden}, rx->dtype));
  TRY(expect(c, gs, "group_sizes", 1, (int64_t[]){d.num_local_experts}, S32));
  TRY(expect(c, pos, "pos", 2, (int64_t[]){N, k}, S32));
  if (!on_cuda)
    return status(c, sl_ep_fan_out_cpu(&d, rx->data, ri->data, xs->data, gs->data, pos->data));
  const XLA_FFI_Buffer *ws = sl_ffi_ret(f, 3);
  if (ws->rank != 1 || (size_t)ws->dims[0] < sl_ep_fan_workspace_size(&d))
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice ep fan_out: workspace must be 1-D with at least %zu bytes",
                        sl_ep_fan_workspace_size(&d));
  void *stream;
  TRY(stream_of(c, &stream));
  return status(c, sl_ep_fan_out_cuda(&d, rx->data, ri->data, xs->data, gs->data, pos->data,
                                      ws->data, stream));
}

/* fan_in and fan_in_bwd share their operands' checks: the expert rows (ys, or dys where the
 * backward reads no ys) [M, H], w, pos, and the token rows (out or dout) [N, H]. */
static XLA_FFI_Error *fan_in_common(ctx c, const XLA_FFI_Buffer *ys, const XLA_FFI_Buffer *w,
                                    const XLA_FFI_Buffer *pos, const XLA_FFI_Buffer *o_rows,
                                    const char *ys_name, const char *o_name, sl_ep_fan_desc *d) {
  TRY(fan_attrs(c, d));
  if (pos->rank != 2) return expect(c, pos, "pos", 2, (int64_t[]){-1, -1}, S32);
  d->num_rows = pos->dims[0];
  d->topk = pos->dims[1];
  if (ys->rank != 2) return expect(c, ys, ys_name, 2, (int64_t[]){-1, -1}, -1);
  TRY(float_dtype(c, ys, ys_name, &d->x_dtype));
  d->hidden = ys->dims[1];
  const int64_t N = d->num_rows, k = d->topk, M = sl_ep_fan_rows(d);
  TRY(expect(c, ys, ys_name, 2, (int64_t[]){M, d->hidden}, -1));
  TRY(expect(c, w, "weights", 2, (int64_t[]){N, k}, F32));
  TRY(expect(c, pos, "pos", 2, (int64_t[]){N, k}, S32));
  TRY(float_dtype(c, o_rows, o_name, &d->out_dtype));
  TRY(expect(c, o_rows, o_name, 2, (int64_t[]){N, d->hidden}, -1));
  return NULL;
}

static XLA_FFI_Error *fan_in(XLA_FFI_CallFrame *f, int on_cuda) {
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda))) return NULL;
  ctx c = {f, "fan_in"};
  TRY(sl_ffi_check_frame(f, c.op, 3, 1));
  sl_ep_fan_desc d;
  TRY(fan_in_common(c, sl_ffi_arg(f, 0), sl_ffi_arg(f, 1), sl_ffi_arg(f, 2), sl_ffi_ret(f, 0), "ys",
                    "out", &d));
  const void *ys = sl_ffi_arg(f, 0)->data, *w = sl_ffi_arg(f, 1)->data,
             *pos = sl_ffi_arg(f, 2)->data;
  void *out = sl_ffi_ret(f, 0)->data;
  if (!on_cuda) return status(c, sl_ep_fan_in_cpu(&d, ys, w, pos, out));
  void *stream;
  TRY(stream_of(c, &stream));
  return status(c, sl_ep_fan_in_cuda(&d, ys, w, pos, out, stream));
}

/* Attribute with_dw: 1 = operands dout, ys, w, pos, group_sizes -> dys, dw; 0 = dout, w, pos,
 * group_sizes -> dys (weights that need no gradient; ys not read). */
static XLA_FFI_Error *fan_in_bwd(XLA_FFI_CallFrame *f, int on_cuda) {
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda))) return NULL;
  ctx c = {f, "fan_in_bwd"};
  int64_t with_dw = 1;
  TRY(sl_ffi_int_attr(f, c.op, "with_dw", &with_dw));
  with_dw = with_dw != 0;
  TRY(sl_ffi_check_frame(f, c.op, 4 + with_dw, 1 + with_dw));
  const int o = (int)with_dw; /* ys's slot shifts the rest */
  const XLA_FFI_Buffer *dout = sl_ffi_arg(f, 0), *ys = with_dw ? sl_ffi_arg(f, 1) : NULL,
                       *w = sl_ffi_arg(f, 1 + o), *pos = sl_ffi_arg(f, 2 + o),
                       *gs = sl_ffi_arg(f, 3 + o);
  XLA_FFI_Buffer *dys = sl_ffi_ret(f, 0), *dw = with_dw ? sl_ffi_ret(f, 1) : NULL;
  sl_ep_fan_desc d;
  TRY(fan_in_common(c, ys ? ys : dys, w, pos, dout, ys ? "ys" : "dys", "dout", &d));
  TRY(expect(c, gs, "group_sizes", 1, (int64_t[]){d.num_local_experts}, S32));
  if (ys) TRY(expect(c, dys, "dys", 2, (int64_t[]){sl_ep_fan_rows(&d), d.hidden}, ys->dtype));
  if (dw) TRY(expect(c, dw, "dw", 2, (int64_t[]){d.num_rows, d.topk}, F32));
  const void *ysp = ys ? ys->data : NULL;
  float *dwp = dw ? (float *)dw->data : NULL;
  if (!on_cuda)
    return status(
        c, sl_ep_fan_in_bwd_cpu(&d, dout->data, ysp, w->data, pos->data, gs->data, dys->data, dwp));
  void *stream;
  TRY(stream_of(c, &stream));
  return status(c, sl_ep_fan_in_bwd_cuda(&d, dout->data, ysp, w->data, pos->data, gs->data,
                                         dys->data, dwp, stream));
}

#define HANDLERS(name)                                                               \
  XLA_FFI_Error *sl_ffi_ep_##name##_cpu(XLA_FFI_CallFrame *f) { return name(f, 0); } \
  XLA_FFI_Error *sl_ffi_ep_##name##_cuda(XLA_FFI_CallFrame *f) { return name(f, 1); }

HANDLERS(dispatch)
HANDLERS(combine)
HANDLERS(redispatch)
HANDLERS(fan_out)
HANDLERS(fan_in)
HANDLERS(fan_in_bwd)
