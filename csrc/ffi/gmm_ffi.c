/*
 * XLA FFI handlers for gmm and tgmm (CPU and CUDA).
 *
 * Operands: lhs, rhs, group_sizes (int32), group_offset (int32 [..., 1]).
 * Results:  out, workspace (uint8, device scratch of sl_gmm_cuda_workspace_size bytes; unused on CPU).
 * Attributes (integer scalars, gmm only): transpose_rhs; skip_unused_rows (1: the rows of out outside
 * the local groups are left unwritten on CUDA).
 * Any number of leading batch dimensions, the same on every operand (this is how vmap arrives).
 *   gmm:  lhs [..., M, K], rhs [..., G_local, K, N] or [..., G_local, N, K], out [..., M, N]
 *   tgmm: lhs [..., M, K], rhs [..., M, N],                             out [..., G_local, K, N]
 */
#include <string.h>

#include "ffi_util.h"

static int same_batch(const XLA_FFI_Buffer *a, const XLA_FFI_Buffer *b, int nb) {
  for (int i = 0; i < nb; ++i)
    if (a->dims[i] != b->dims[i]) return 0;
  return 1;
}

static XLA_FFI_Error *bad(const XLA_FFI_CallFrame *f, const char *op, const char *what) {
  return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, "sluice %s: %s", op, what);
}

/* Reads and checks the frame into a descriptor. */
static XLA_FFI_Error *parse(const XLA_FFI_CallFrame *f, int is_tgmm, sl_gmm_desc *d) {
  const char *op = is_tgmm ? "tgmm" : "gmm";
  XLA_FFI_Error *err = sl_ffi_check_frame(f, op, 4, 2);
  if (err) return err;
  const XLA_FFI_Buffer *lhs = sl_ffi_arg(f, 0), *rhs = sl_ffi_arg(f, 1), *gs = sl_ffi_arg(f, 2),
                       *off = sl_ffi_arg(f, 3), *out = sl_ffi_ret(f, 0);
  int64_t transpose = 0, skip = 0;
  if (!is_tgmm && (err = sl_ffi_int_attr(f, op, "transpose_rhs", &transpose))) return err;
  if (!is_tgmm && (err = sl_ffi_int_attr(f, op, "skip_unused_rows", &skip))) return err;

  if (lhs->rank < 2) return bad(f, op, "lhs must have rank >= 2 ([..., M, K])");
  const int nb = (int)lhs->rank - 2;
  *d = sl_gmm_desc_default();
  for (int i = 0; i < nb; ++i) d->batch *= lhs->dims[i];
  d->m = lhs->dims[nb];
  d->k = lhs->dims[nb + 1];
  d->transpose_rhs = (int)(transpose != 0);
  d->skip_unused_rows = (int)(skip != 0);
  if (gs->rank != nb + 1 || !same_batch(gs, lhs, nb))
    return bad(f, op, "group_sizes must be [..., G] with lhs's batch dims");
  if (gs->dtype != XLA_FFI_DataType_S32)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: group_sizes must be int32, got %s", op,
                        sl_ffi_dtype_name(gs->dtype));
  if (off->rank != nb + 1 || !same_batch(off, lhs, nb) || off->dims[nb] != 1 ||
      off->dtype != XLA_FFI_DataType_S32)
    return bad(f, op, "group_offset must be int32 [..., 1] with lhs's batch dims");
  d->num_groups = gs->dims[nb];

  if (!is_tgmm) {
    if (rhs->rank != nb + 3 || !same_batch(rhs, lhs, nb))
      return bad(f, op, "rhs must be [..., G_local, K, N] with lhs's batch dims");
    d->num_local_groups = rhs->dims[nb];
    const int64_t rk = rhs->dims[nb + (d->transpose_rhs ? 2 : 1)];
    d->n = rhs->dims[nb + (d->transpose_rhs ? 1 : 2)];
    if (rk != d->k)
      return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "sluice gmm: contraction dims differ: lhs has K=%lld, rhs has K=%lld "
                          "(transpose_rhs=%d)",
                          (long long)d->k, (long long)rk, d->transpose_rhs);
    if (out->rank != nb + 2 || !same_batch(out, lhs, nb) || out->dims[nb] != d->m ||
        out->dims[nb + 1] != d->n)
      return bad(f, op, "out must be [..., M, N]");
  } else {
    if (rhs->rank != nb + 2 || !same_batch(rhs, lhs, nb) || rhs->dims[nb] != d->m)
      return bad(f, op, "rhs must be [..., M, N] with the rows and batch dims of lhs");
    d->n = rhs->dims[nb + 1];
    if (out->rank != nb + 3 || !same_batch(out, lhs, nb) || out->dims[nb + 1] != d->k ||
        out->dims[nb + 2] != d->n)
      return bad(f, op, "out must be [..., G_local, K, N]");
    d->num_local_groups = out->dims[nb];
  }
  if (d->num_local_groups > d->num_groups)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: %lld local groups but group_sizes has only %lld", op,
                        (long long)d->num_local_groups, (long long)d->num_groups);
  if (!sl_ffi_dtype(lhs->dtype, &d->lhs_dtype) || d->lhs_dtype == SL_DTYPE_I32)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: lhs must be float32, bfloat16 or float16, got %s", op,
                        sl_ffi_dtype_name(lhs->dtype));
  if (!sl_ffi_dtype(rhs->dtype, &d->rhs_dtype) || d->rhs_dtype != d->lhs_dtype)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: rhs dtype %s differs from lhs dtype %s", op,
                        sl_ffi_dtype_name(rhs->dtype), sl_ffi_dtype_name(lhs->dtype));
  if (!sl_ffi_dtype(out->dtype, &d->out_dtype) || d->out_dtype == SL_DTYPE_I32)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: out must be float32, bfloat16 or float16, got %s", op,
                        sl_ffi_dtype_name(out->dtype));
  return NULL;
}

static XLA_FFI_Error *handle(XLA_FFI_CallFrame *f, int is_tgmm, int on_cuda) {
  const char *op = is_tgmm ? "tgmm" : "gmm";
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda)))
    return NULL;
  sl_gmm_desc d;
  XLA_FFI_Error *err = parse(f, is_tgmm, &d);
  if (err) return err;
  const void *lhs = sl_ffi_arg(f, 0)->data, *rhs = sl_ffi_arg(f, 1)->data;
  const int32_t *gs = sl_ffi_arg(f, 2)->data, *off = sl_ffi_arg(f, 3)->data;
  void *out = sl_ffi_ret(f, 0)->data;
  sl_status st;
  if (!on_cuda) {
    st = is_tgmm ? sl_tgmm_cpu(&d, lhs, rhs, gs, off, out, 0)
                 : sl_gmm_cpu(&d, lhs, rhs, gs, off, out, 0);
  } else {
    void *ws = sl_ffi_workspace(f, 1, sl_gmm_cuda_workspace_size(&d), op, &err);
    if (err) return err;
    void *stream = sl_ffi_stream(f, &err);
    if (err) return err;
    st = is_tgmm ? sl_tgmm_cuda(&d, lhs, rhs, gs, off, out, ws, stream)
                 : sl_gmm_cuda(&d, lhs, rhs, gs, off, out, ws, stream);
  }
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

XLA_FFI_Error *sl_ffi_gmm_cpu(XLA_FFI_CallFrame *f) { return handle(f, 0, 0); }
XLA_FFI_Error *sl_ffi_tgmm_cpu(XLA_FFI_CallFrame *f) { return handle(f, 1, 0); }
XLA_FFI_Error *sl_ffi_gmm_cuda(XLA_FFI_CallFrame *f) { return handle(f, 0, 1); }
XLA_FFI_Error *sl_ffi_tgmm_cuda(XLA_FFI_CallFrame *f) { return handle(f, 1, 1); }
