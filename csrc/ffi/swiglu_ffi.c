/*
 * XLA FFI handlers for swiglu (CPU and CUDA); see include/sluice.h.
 *   swiglu:     h [M, 2F], group_sizes s32 [G] (, w f32 [M])             -> act [M, F]
 *   swiglu_bwd: dact [M, F], h [M, 2F], group_sizes s32 [G] (, w f32 [M])
 *               -> dh [M, 2F] (, dw f32 [M])
 * Attributes skip_unused_rows (1: the rows past sum(group_sizes) are left unwritten on CUDA)
 * and weighted (1: the row weights w are the last operand; the backward returns their gradient).
 * One float dtype for h, act, dact and dh.
 */
#include "ffi_util.h"

static XLA_FFI_Error *bad(const XLA_FFI_CallFrame *f, const char *op, const char *what) {
  return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, "sluice %s: %s", op, what);
}

static XLA_FFI_Error *handle(XLA_FFI_CallFrame *f, int is_bwd, int on_cuda) {
  const char *op = is_bwd ? "swiglu_bwd" : "swiglu";
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda)))
    return NULL;
  int64_t skip = 0, weighted = 0;
  XLA_FFI_Error *err = sl_ffi_int_attr(f, op, "weighted", &weighted);
  if (err) return err;
  weighted = weighted != 0;
  if ((err = sl_ffi_check_frame(f, op, (is_bwd ? 3 : 2) + weighted, 1 + (is_bwd && weighted))))
    return err;
  if ((err = sl_ffi_int_attr(f, op, "skip_unused_rows", &skip))) return err;
  const XLA_FFI_Buffer *dact = is_bwd ? sl_ffi_arg(f, 0) : NULL, *h = sl_ffi_arg(f, is_bwd),
                       *gs = sl_ffi_arg(f, is_bwd + 1), *out = sl_ffi_ret(f, 0);
  sl_swiglu_desc d = sl_swiglu_desc_default();
  if (h->rank != 2 || h->dims[1] % 2) return bad(f, op, "h must be [M, 2F]");
  d.rows = h->dims[0], d.ff = h->dims[1] / 2, d.skip_unused_rows = skip != 0;
  if (!sl_ffi_dtype(h->dtype, &d.dtype) || d.dtype == SL_DTYPE_I32)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: h must be float32, bfloat16 or float16, got %s", op,
                        sl_ffi_dtype_name(h->dtype));
  if (gs->rank != 1 || gs->dims[0] < 1 || gs->dtype != XLA_FFI_DataType_S32)
    return bad(f, op, "group_sizes must be int32 [G], G >= 1");
  d.num_groups = gs->dims[0];
  if (dact && (dact->rank != 2 || dact->dims[0] != d.rows || dact->dims[1] != d.ff ||
               dact->dtype != h->dtype))
    return bad(f, op, "dact must be [M, F] in h's dtype");
  const XLA_FFI_Buffer *w = weighted ? sl_ffi_arg(f, is_bwd + 2) : NULL,
                       *dw = is_bwd && weighted ? sl_ffi_ret(f, 1) : NULL;
  if (w && (w->rank != 1 || w->dims[0] != d.rows || w->dtype != XLA_FFI_DataType_F32))
    return bad(f, op, "row weights must be float32 [M]");
  if (dw && (dw->rank != 1 || dw->dims[0] != d.rows || dw->dtype != XLA_FFI_DataType_F32))
    return bad(f, op, "the row weights' gradient must be float32 [M]");
  const float *wp = w ? (const float *)w->data : NULL;
  float *dwp = dw ? (float *)dw->data : NULL;
  if (out->rank != 2 || out->dims[0] != d.rows || out->dims[1] != (is_bwd ? 2 : 1) * d.ff ||
      out->dtype != h->dtype)
    return bad(f, op,
               is_bwd ? "dh must be [M, 2F] in h's dtype" : "act must be [M, F] in h's dtype");
  sl_status st;
  if (!on_cuda) {
    st = is_bwd ? sl_swiglu_bwd_cpu(&d, dact->data, h->data, wp, gs->data, out->data, dwp)
                : sl_swiglu_fwd_cpu(&d, h->data, wp, gs->data, out->data);
  } else {
    void *stream = sl_ffi_stream(f, &err);
    if (err) return err;
    st = is_bwd ? sl_swiglu_bwd_cuda(&d, dact->data, h->data, wp, gs->data, out->data, dwp, stream)
                : sl_swiglu_fwd_cuda(&d, h->data, wp, gs->data, out->data, stream);
  }
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

XLA_FFI_Error *sl_ffi_swiglu_cpu(XLA_FFI_CallFrame *f) { return handle(f, 0, 0); }
XLA_FFI_Error *sl_ffi_swiglu_bwd_cpu(XLA_FFI_CallFrame *f) { return handle(f, 1, 0); }
XLA_FFI_Error *sl_ffi_swiglu_cuda(XLA_FFI_CallFrame *f) { return handle(f, 0, 1); }
XLA_FFI_Error *sl_ffi_swiglu_bwd_cuda(XLA_FFI_CallFrame *f) { return handle(f, 1, 1); }
