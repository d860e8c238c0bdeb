/*
 * XLA FFI handlers for FP8 block quantization on the GPU (sl_quantize_fp8_cuda and
 * sl_quantize_fp8_both_cuda, include/sluice.h).
 *
 * sluice_quantize_fp8:
 * Operands: x [..., X_R, C] (float32, bfloat16 or float16), row_range int32 [..., 2] (lo, hi: the
 *           rows read from x, one range per problem).
 * Results:  q [..., R, C] and q_t [..., C, R] (float8_e4m3fn; a result whose write_* attribute is 0
 *           is not written and may have any shape, e.g. [0]), scale float32 (the block's layout).
 * Attributes (integer scalars): rows (R >= X_R; rows past X_R read as zero), block_rows,
 * block_cols, power_of_two, write_q, write_qt. Any number of leading batch dimensions.
 * sluice_quantize_fp8_both: the same operands and gather int32 [..., X_R] (with the attribute
 * gathered = 1: row r reads row gather[r] of x, zero where that is outside x's rows; else any
 * shape, unread, and X_R is x's rows); results q [..., X_R, C] and scale [..., X_R, ceil(C/128)]
 * (1x128 blocks of every row), q_t [..., C, R] and scale_t [..., ceil(R/128), C] (128x1 blocks of
 * the rows in row_range); attributes rows, power_of_two, gathered.
 * sluice_swiglu_quantize_fp8 (sl_swiglu_quantize_fp8_cuda): operands h [..., X_R, 2F] (bf16 or
 * f16), row_range int32 [..., 2], row_weights float32 [..., X_R] (with weighted = 1; else any
 * shape, unread); results q [..., X_R, F], scale [..., X_R, ceil(F/128)], q_t [..., F, R] and
 * scale_t [..., ceil(R/128), F]; attributes rows (R), power_of_two, weighted.
 * sluice_swiglu_bwd_quantize_fp8 (sl_swiglu_bwd_quantize_fp8_cuda): operands dact [..., X_R, F]
 * and then the forward's three; results q, scale, q_t, scale_t of dh [..., X_R, 2F] and
 * drow_weight_parts float32 [..., X_R, ceil(F/128)] (with weighted = 1; else any shape, unwritten);
 * the same attributes.
 * The CPU quantizes in jnp (python/sluice/ops/fp8.py); its handlers here only report that.
 */
#include "ffi_util.h"

static XLA_FFI_Error *bad(const XLA_FFI_CallFrame *f, const char *op, const char *what) {
  return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, "sluice %s: %s", op, what);
}

static int64_t elements(const XLA_FFI_Buffer *b) {
  int64_t n = 1;
  for (int64_t i = 0; i < b->rank; ++i) n *= b->dims[i];
  return n;
}
static int is_f32(const XLA_FFI_Buffer *b, int64_t n) {
  return b->dtype == XLA_FFI_DataType_F32 && elements(b) == n;
}
static int is_e4m3(const XLA_FFI_Buffer *b, int64_t n) {
  return b->dtype == XLA_FFI_DataType_F8E4M3FN && elements(b) == n;
}

/* x [..., X_R, C] and row_range int32 [..., 2] (arguments 0 and 1) as a descriptor. */
static XLA_FFI_Error *read_x(XLA_FFI_CallFrame *f, const char *op, int64_t rows, int br, int bc,
                             int64_t pow2, sl_quantize_fp8_desc *d) {
  const XLA_FFI_Buffer *x = sl_ffi_arg(f, 0), *vr = sl_ffi_arg(f, 1);
  if (x->rank < 2) return bad(f, op, "x must have rank >= 2 ([..., rows, cols])");
  const int nb = (int)x->rank - 2;
  *d = (sl_quantize_fp8_desc){sizeof(sl_quantize_fp8_desc), 1, rows, x->dims[nb + 1], x->dims[nb],
                              SL_DTYPE_F32, br, bc, (int)(pow2 != 0), 0};
  for (int i = 0; i < nb; ++i) d->batch *= x->dims[i];
  if (!sl_ffi_dtype(x->dtype, &d->dtype) || d->dtype == SL_DTYPE_I32 ||
      d->dtype == SL_DTYPE_F8E4M3)
    return bad(f, op, "x must be float32, bfloat16 or float16");
  if (vr->dtype != XLA_FFI_DataType_S32 || vr->rank != nb + 1 || vr->dims[nb] != 2)
    return bad(f, op, "row_range must be int32 [..., 2] with x's batch dims");
  return NULL;
}

static XLA_FFI_Error *handle(XLA_FFI_CallFrame *f, int on_cuda) {
  const char *op = "quantize_fp8";
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda)))
    return NULL;
  if (!on_cuda)
    return sl_ffi_error(f, XLA_FFI_Error_Code_UNIMPLEMENTED,
                        "sluice quantize_fp8: the CPU quantizes in jnp (sluice.fp8.quantize)");
  XLA_FFI_Error *err = sl_ffi_check_frame(f, op, 2, 3);
  if (err) return err;
  int64_t rows, br, bc, pow2, wq, wqt;
  if ((err = sl_ffi_int_attr(f, op, "rows", &rows)) ||
      (err = sl_ffi_int_attr(f, op, "block_rows", &br)) ||
      (err = sl_ffi_int_attr(f, op, "block_cols", &bc)) ||
      (err = sl_ffi_int_attr(f, op, "power_of_two", &pow2)) ||
      (err = sl_ffi_int_attr(f, op, "write_q", &wq)) ||
      (err = sl_ffi_int_attr(f, op, "write_qt", &wqt)))
    return err;
  sl_quantize_fp8_desc d;
  if ((err = read_x(f, op, rows, (int)br, (int)bc, pow2, &d))) return err;
  XLA_FFI_Buffer *q = sl_ffi_ret(f, 0), *qt = sl_ffi_ret(f, 1), *sc = sl_ffi_ret(f, 2);
  if (!is_f32(sc, d.batch * (br == 1 ? rows : (rows + 127) / 128) *
                      (bc == 1 ? d.cols : (d.cols + 127) / 128)))
    return bad(f, op, "scale must be float32 with the block layout's element count");
  const int64_t want_q = d.batch * rows * d.cols;
  if ((wq && !is_e4m3(q, want_q)) || (wqt && !is_e4m3(qt, want_q)))
    return bad(f, op, "q and q_t must be float8_e4m3fn [..., rows, cols] and [..., cols, rows]");
  void *stream = sl_ffi_stream(f, &err);
  if (err) return err;
  sl_status st = sl_quantize_fp8_cuda(&d, sl_ffi_arg(f, 0)->data, sl_ffi_arg(f, 1)->data,
                                      wq ? q->data : NULL, wqt ? qt->data : NULL, sc->data, stream);
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

static XLA_FFI_Error *handle_both(XLA_FFI_CallFrame *f, int on_cuda) {
  const char *op = "quantize_fp8_both";
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda)))
    return NULL;
  if (!on_cuda)
    return sl_ffi_error(f, XLA_FFI_Error_Code_UNIMPLEMENTED,
                        "sluice quantize_fp8_both: the CPU quantizes in jnp "
                        "(sluice.fp8.quantize_both)");
  XLA_FFI_Error *err = sl_ffi_check_frame(f, op, 3, 4);
  if (err) return err;
  int64_t rows, pow2, gathered;
  if ((err = sl_ffi_int_attr(f, op, "rows", &rows)) ||
      (err = sl_ffi_int_attr(f, op, "power_of_two", &pow2)) ||
      (err = sl_ffi_int_attr(f, op, "gathered", &gathered)))
    return err;
  sl_quantize_fp8_desc d;
  if ((err = read_x(f, op, rows, 1, 128, pow2, &d))) return err;
  const XLA_FFI_Buffer *x = sl_ffi_arg(f, 0), *g = sl_ffi_arg(f, 2);
  const int32_t *gather = NULL;
  if (gathered) {
    const int nb = (int)x->rank - 2;
    int same = g->dtype == XLA_FFI_DataType_S32 && g->rank == nb + 1;
    for (int i = 0; same && i < nb; ++i) same = g->dims[i] == x->dims[i];
    if (!same) return bad(f, op, "gather must be int32 [..., rows] with x's batch dims");
    d.src_rows = d.x_rows, d.x_rows = g->dims[nb], gather = g->data;
  }
  XLA_FFI_Buffer *q = sl_ffi_ret(f, 0), *sc = sl_ffi_ret(f, 1);
  XLA_FFI_Buffer *qt = sl_ffi_ret(f, 2), *sct = sl_ffi_ret(f, 3);
  if (!is_e4m3(q, d.batch * d.x_rows * d.cols) || !is_e4m3(qt, d.batch * rows * d.cols))
    return bad(f, op, "q and q_t must be float8_e4m3fn [..., x rows, cols] and [..., cols, rows]");
  if (!is_f32(sc, d.batch * d.x_rows * ((d.cols + 127) / 128)) ||
      !is_f32(sct, d.batch * ((rows + 127) / 128) * d.cols))
    return bad(f, op, "scale and scale_t must be float32 of the 1x128 and 128x1 layouts");
  void *stream = sl_ffi_stream(f, &err);
  if (err) return err;
  sl_status st = sl_quantize_fp8_both_cuda(&d, x->data, sl_ffi_arg(f, 1)->data, gather, q->data,
                                           sc->data, qt->data, sct->data, stream);
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

/* sluice_swiglu_quantize_fp8 and its backward (bwd = 1: dact is operand 0, the rest follow). */
static XLA_FFI_Error *handle_swiglu(XLA_FFI_CallFrame *f, int on_cuda, int bwd) {
  const char *op = bwd ? "swiglu_bwd_quantize_fp8" : "swiglu_quantize_fp8";
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda)))
    return NULL;
  if (!on_cuda)
    return sl_ffi_error(f, XLA_FFI_Error_Code_UNIMPLEMENTED,
                        "sluice %s: the CPU computes it in jnp (sluice.fp8.swiglu_quantize)", op);
  XLA_FFI_Error *err = sl_ffi_check_frame(f, op, 3 + bwd, 4 + bwd);
  if (err) return err;
  int64_t rows, pow2, weighted;
  if ((err = sl_ffi_int_attr(f, op, "rows", &rows)) ||
      (err = sl_ffi_int_attr(f, op, "power_of_two", &pow2)) ||
      (err = sl_ffi_int_attr(f, op, "weighted", &weighted)))
    return err;
  const XLA_FFI_Buffer *h = sl_ffi_arg(f, bwd), *rr = sl_ffi_arg(f, bwd + 1);
  const XLA_FFI_Buffer *w = sl_ffi_arg(f, bwd + 2);
  if (h->rank < 2 || h->dims[h->rank - 1] % 2 != 0)
    return bad(f, op, "h must be [..., rows, 2F]");
  const int nb = (int)h->rank - 2;
  const int64_t xr = h->dims[nb], ff = h->dims[nb + 1] / 2, cols = bwd ? 2 * ff : ff;
  sl_quantize_fp8_desc d = {sizeof(sl_quantize_fp8_desc), 1, rows, cols, xr, SL_DTYPE_F32, 1,
                            128, (int)(pow2 != 0), 0};
  for (int i = 0; i < nb; ++i) d.batch *= h->dims[i];
  if (!sl_ffi_dtype(h->dtype, &d.dtype) || (d.dtype != SL_DTYPE_BF16 && d.dtype != SL_DTYPE_F16))
    return bad(f, op, "h must be bfloat16 or float16");
  if (rr->dtype != XLA_FFI_DataType_S32 || elements(rr) != 2 * d.batch)
    return bad(f, op, "row_range must be int32 [..., 2] with h's batch dims");
  if (weighted && !is_f32(w, d.batch * xr))
    return bad(f, op, "row_weights must be float32 [..., rows] with h's batch dims");
  if (bwd) {
    const XLA_FFI_Buffer *da = sl_ffi_arg(f, 0);
    if (da->dtype != h->dtype || elements(da) != d.batch * xr * ff)
      return bad(f, op, "dact must be [..., rows, F] of h's dtype");
  }
  XLA_FFI_Buffer *q = sl_ffi_ret(f, 0), *sc = sl_ffi_ret(f, 1);
  XLA_FFI_Buffer *qt = sl_ffi_ret(f, 2), *sct = sl_ffi_ret(f, 3);
  if (!is_e4m3(q, d.batch * xr * cols) || !is_e4m3(qt, d.batch * rows * cols))
    return bad(f, op, "q and q_t must be float8_e4m3fn [..., x rows, cols] and [..., cols, rows]");
  if (!is_f32(sc, d.batch * xr * ((cols + 127) / 128)) ||
      !is_f32(sct, d.batch * ((rows + 127) / 128) * cols))
    return bad(f, op, "scale and scale_t must be float32 of the 1x128 and 128x1 layouts");
  float *parts = NULL;
  if (bwd && weighted) {
    XLA_FFI_Buffer *p = sl_ffi_ret(f, 4);
    if (!is_f32(p, d.batch * xr * ((ff + 127) / 128)))
      return bad(f, op, "drow_weight_parts must be float32 [..., rows, ceil(F/128)]");
    parts = p->data;
  }
  void *stream = sl_ffi_stream(f, &err);
  if (err) return err;
  const float *wp = weighted ? w->data : NULL;
  sl_status st =
      bwd ? sl_swiglu_bwd_quantize_fp8_cuda(&d, sl_ffi_arg(f, 0)->data, h->data, wp, rr->data,
                                            q->data, sc->data, qt->data, sct->data, parts, stream)
          : sl_swiglu_quantize_fp8_cuda(&d, h->data, wp, rr->data, q->data, sc->data, qt->data,
                                        sct->data, stream);
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

XLA_FFI_Error *sl_ffi_quantize_fp8_cpu(XLA_FFI_CallFrame *f) { return handle(f, 0); }
XLA_FFI_Error *sl_ffi_quantize_fp8_cuda(XLA_FFI_CallFrame *f) { return handle(f, 1); }
XLA_FFI_Error *sl_ffi_quantize_fp8_both_cpu(XLA_FFI_CallFrame *f) { return handle_both(f, 0); }
XLA_FFI_Error *sl_ffi_quantize_fp8_both_cuda(XLA_FFI_CallFrame *f) { return handle_both(f, 1); }
XLA_FFI_Error *sl_ffi_swiglu_quantize_fp8_cpu(XLA_FFI_CallFrame *f) {
  return handle_swiglu(f, 0, 0);
}
XLA_FFI_Error *sl_ffi_swiglu_quantize_fp8_cuda(XLA_FFI_CallFrame *f) {
  return handle_swiglu(f, 1, 0);
}
XLA_FFI_Error *sl_ffi_swiglu_bwd_quantize_fp8_cpu(XLA_FFI_CallFrame *f) {
  return handle_swiglu(f, 0, 1);
}
XLA_FFI_Error *sl_ffi_swiglu_bwd_quantize_fp8_cuda(XLA_FFI_CallFrame *f) {
  return handle_swiglu(f, 1, 1);
}
