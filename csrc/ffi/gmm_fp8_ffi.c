/*
 * XLA FFI handlers for the FP8 grouped GEMMs gmm_fp8 and tgmm_fp8 (CPU and CUDA; include/sluice.h).
 *
 * Operands: lhs, lhs_scale, rhs, rhs_scale, group_sizes (int32), group_offset (int32 [..., 1]).
 * Results:  out, workspace (uint8, device scratch of sl_gmm_cuda_workspace_size bytes; unused on
 * CPU). Attribute (integer scalar, gmm_fp8 only): skip_unused_rows (1: the rows of out outside the
 * local groups are left unwritten on CUDA). Any number of leading batch dimensions, the same on
 * every operand (this is how vmap arrives). lhs and rhs are float8_e4m3fn, the scales float32, out
 * bfloat16 or float32. With c = ceil(./128): gmm_fp8:  lhs [..., M, K], lhs_scale [..., M, c(K)],
 * rhs [..., G_local, N, K], rhs_scale [..., G_local, c(N), c(K)]                        -> out
 * [..., M, N] tgmm_fp8: lhs_t [..., K, M], lhs_scale [..., c(M), K], rhs_t [..., N, M], rhs_scale
 * [..., c(M), N]                                    -> out [..., G_local, K, N]
 */
#include <stdio.h>
#include <string.h>

#include "ffi_util.h"

/* "float32[2, 70, 3]" into buf. */
static const char *describe(const XLA_FFI_Buffer *b, char *buf, size_t size) {
  int n = snprintf(buf, size, "%s[", sl_ffi_dtype_name(b->dtype));
  for (int64_t i = 0; i < b->rank && n > 0 && (size_t)n < size; ++i)
    n += snprintf(buf + n, size - (size_t)n, "%s%lld", i ? ", " : "", (long long)b->dims[i]);
  if (n > 0 && (size_t)n < size) snprintf(buf + n, size - (size_t)n, "]");
  return buf;
}

/* Checks that `b` has dtype `t` (or either of t and t2) and shape [batch of ref..., dims[0..n)];
 * `layout` spells the expected shape in the message. */
static XLA_FFI_Error *expect(const XLA_FFI_CallFrame *f, const char *op, const char *name,
                             const XLA_FFI_Buffer *b, const XLA_FFI_Buffer *ref, int nb,
                             XLA_FFI_DataType t, XLA_FFI_DataType t2, const char *layout, int n,
                             const int64_t *dims) {
  int ok = (b->dtype == t || b->dtype == t2) && b->rank == nb + n;
  for (int i = 0; ok && i < nb; ++i) ok = b->dims[i] == ref->dims[i];
  for (int i = 0; ok && i < n; ++i) ok = b->dims[nb + i] == dims[i];
  if (ok) return NULL;
  char want[160] = "", got[160];
  int w = n > 0 ? snprintf(want, sizeof want, " = [") : 0;
  for (int i = 0; i < n && w > 0 && (size_t)w < sizeof want; ++i)
    w += snprintf(want + w, sizeof want - (size_t)w, "%s%lld", i ? ", " : "", (long long)dims[i]);
  if (w > 0 && (size_t)w < sizeof want) snprintf(want + w, sizeof want - (size_t)w, "]");
  return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "sluice %s: %s must be %s%s%s %s%s%s, got %s", op, name, sl_ffi_dtype_name(t),
                      t2 != t ? " or " : "", t2 != t ? sl_ffi_dtype_name(t2) : "", layout, want,
                      nb > 0 ? " with lhs's batch dims" : "", describe(b, got, sizeof got));
}

static int64_t blocks(int64_t x) { return (x + 127) / 128; }

/* Reads and checks the frame into a descriptor. */
static XLA_FFI_Error *parse(const XLA_FFI_CallFrame *f, int is_tgmm, sl_gmm_desc *d) {
  const char *op = is_tgmm ? "tgmm_fp8" : "gmm_fp8";
  XLA_FFI_Error *err = sl_ffi_check_frame(f, op, 6, 2);
  if (err) return err;
  const XLA_FFI_Buffer *lhs = sl_ffi_arg(f, 0), *ls = sl_ffi_arg(f, 1), *rhs = sl_ffi_arg(f, 2),
                       *rs = sl_ffi_arg(f, 3), *gs = sl_ffi_arg(f, 4), *off = sl_ffi_arg(f, 5),
                       *out = sl_ffi_ret(f, 0);
  int64_t skip = 0;
  if (!is_tgmm && (err = sl_ffi_int_attr(f, op, "skip_unused_rows", &skip))) return err;
  const XLA_FFI_DataType F8 = XLA_FFI_DataType_F8E4M3FN, F32 = XLA_FFI_DataType_F32,
                         BF16 = XLA_FFI_DataType_BF16, S32 = XLA_FFI_DataType_S32;
  if (lhs->rank < 2 || lhs->dtype != F8) {
    char got[160];
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: lhs must be float8_e4m3fn of rank >= 2 (%s), got %s", op,
                        is_tgmm ? "[..., K, M]" : "[..., M, K]", describe(lhs, got, sizeof got));
  }
  const int nb = (int)lhs->rank - 2;
  *d = sl_gmm_desc_default();
  for (int i = 0; i < nb; ++i) d->batch *= lhs->dims[i];
  d->lhs_dtype = d->rhs_dtype = SL_DTYPE_F8E4M3;
  d->out_dtype = out->dtype == BF16 ? SL_DTYPE_BF16 : SL_DTYPE_F32;
  d->transpose_rhs = !is_tgmm;
  d->skip_unused_rows = (int)(skip != 0);
  if (gs->rank != nb + 1 || gs->dtype != S32)
    return expect(f, op, "group_sizes", gs, lhs, nb, S32, S32, "[..., G]", 0, NULL);
  for (int i = 0; i < nb; ++i)
    if (gs->dims[i] != lhs->dims[i])
      return expect(f, op, "group_sizes", gs, lhs, nb, S32, S32, "[..., G]", 1, &gs->dims[nb]);
  d->num_groups = gs->dims[nb];
  const int64_t one = 1;
  if ((err = expect(f, op, "group_offset", off, lhs, nb, S32, S32, "[..., 1]", 1, &one)))
    return err;

  if (!is_tgmm) {
    d->m = lhs->dims[nb], d->k = lhs->dims[nb + 1];
    if (rhs->rank != nb + 3)
      return expect(f, op, "rhs", rhs, lhs, nb, F8, F8, "[..., G_local, N, K]", 0, NULL);
    d->num_local_groups = rhs->dims[nb], d->n = rhs->dims[nb + 1];
    const int64_t want_ls[2] = {d->m, blocks(d->k)},
                  want_rhs[3] = {d->num_local_groups, d->n, d->k},
                  want_rs[3] = {d->num_local_groups, blocks(d->n), blocks(d->k)},
                  want_out[2] = {d->m, d->n};
    if ((err = expect(f, op, "lhs_scale", ls, lhs, nb, F32, F32, "[..., M, ceil(K/128)]", 2,
                      want_ls)) ||
        (err = expect(f, op, "rhs", rhs, lhs, nb, F8, F8, "[..., G_local, N, K]", 3, want_rhs)) ||
        (err = expect(f, op, "rhs_scale", rs, lhs, nb, F32, F32,
                      "[..., G_local, ceil(N/128), ceil(K/128)]", 3, want_rs)) ||
        (err = expect(f, op, "out", out, lhs, nb, BF16, F32, "[..., M, N]", 2, want_out)))
      return err;
  } else {
    d->k = lhs->dims[nb], d->m = lhs->dims[nb + 1];
    if (rhs->rank != nb + 2)
      return expect(f, op, "rhs_t", rhs, lhs, nb, F8, F8, "[..., N, M]", 0, NULL);
    d->n = rhs->dims[nb];
    if (out->rank != nb + 3)
      return expect(f, op, "out", out, lhs, nb, BF16, F32, "[..., G_local, K, N]", 0, NULL);
    d->num_local_groups = out->dims[nb];
    const int64_t want_ls[2] = {blocks(d->m), d->k}, want_rhs[2] = {d->n, d->m},
                  want_rs[2] = {blocks(d->m), d->n},
                  want_out[3] = {d->num_local_groups, d->k, d->n};
    if ((err = expect(f, op, "lhs_scale", ls, lhs, nb, F32, F32, "[..., ceil(M/128), K]", 2,
                      want_ls)) ||
        (err = expect(f, op, "rhs_t", rhs, lhs, nb, F8, F8, "[..., N, M]", 2, want_rhs)) ||
        (err = expect(f, op, "rhs_scale", rs, lhs, nb, F32, F32, "[..., ceil(M/128), N]", 2,
                      want_rs)) ||
        (err = expect(f, op, "out", out, lhs, nb, BF16, F32, "[..., G_local, K, N]", 3, want_out)))
      return err;
  }
  if (d->num_local_groups > d->num_groups)
    return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: %lld local groups but group_sizes has only %lld", op,
                        (long long)d->num_local_groups, (long long)d->num_groups);
  return NULL;
}

static XLA_FFI_Error *handle(XLA_FFI_CallFrame *f, int is_tgmm, int on_cuda) {
  const char *op = is_tgmm ? "tgmm_fp8" : "gmm_fp8";
  if (sl_ffi_answer_metadata(f, sl_ffi_graph_traits(on_cuda)))
    return NULL;
  sl_gmm_desc d;
  XLA_FFI_Error *err = parse(f, is_tgmm, &d);
  if (err) return err;
  const void *lhs = sl_ffi_arg(f, 0)->data, *rhs = sl_ffi_arg(f, 2)->data;
  const float *ls = sl_ffi_arg(f, 1)->data, *rs = sl_ffi_arg(f, 3)->data;
  const int32_t *gs = sl_ffi_arg(f, 4)->data, *off = sl_ffi_arg(f, 5)->data;
  void *out = sl_ffi_ret(f, 0)->data;
  sl_status st;
  if (!on_cuda) {
    st = is_tgmm ? sl_tgmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, off, out, 0)
                 : sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, off, out, 0);
  } else {
    void *ws = sl_ffi_workspace(f, 1, sl_gmm_cuda_workspace_size(&d), op, &err);
    if (err) return err;
    void *stream = sl_ffi_stream(f, &err);
    if (err) return err;
    st = is_tgmm ? sl_tgmm_fp8_cuda(&d, lhs, ls, rhs, rs, gs, off, out, ws, stream)
                 : sl_gmm_fp8_cuda(&d, lhs, ls, rhs, rs, gs, off, out, ws, stream);
  }
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

XLA_FFI_Error *sl_ffi_gmm_fp8_cpu(XLA_FFI_CallFrame *f) { return handle(f, 0, 0); }
XLA_FFI_Error *sl_ffi_tgmm_fp8_cpu(XLA_FFI_CallFrame *f) { return handle(f, 1, 0); }
XLA_FFI_Error *sl_ffi_gmm_fp8_cuda(XLA_FFI_CallFrame *f) { return handle(f, 0, 1); }
XLA_FFI_Error *sl_ffi_tgmm_fp8_cuda(XLA_FFI_CallFrame *f) { return handle(f, 1, 1); }
