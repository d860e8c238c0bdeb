/*
 * XLA FFI handler for FP8 block quantization on the GPU (sl_quantize_fp8_cuda, include/sluice.h).
 *
 * Operands: x [..., X_R, C] (float32, bfloat16 or float16), row_range int32 [..., 2] (lo, hi: the
 *           rows read from x, one range per problem).
 * Results:  q [..., R, C] and q_t [..., C, R] (float8_e4m3fn; a result whose write_* attribute is 0
 *           is not written and may have any shape, e.g. [0]), scale float32 (the block's layout).
 * Attributes (integer scalars): rows (R >= X_R; rows past X_R read as zero), block_rows,
 * block_cols, power_of_two, write_q, write_qt. Any number of leading batch dimensions.
 * The CPU quantizes in jnp (python/sluice/ops/fp8.py); its handler here only reports that.
 */
#include "ffi_util.h"

static XLA_FFI_Error *bad(const XLA_FFI_CallFrame *f, const char *what) {
  return sl_ffi_error(f, XLA_FFI_Error_Code_INVALID_ARGUMENT, "sluice quantize_fp8: %s", what);
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
  const XLA_FFI_Buffer *x = sl_ffi_arg(f, 0), *vr = sl_ffi_arg(f, 1);
  XLA_FFI_Buffer *q = sl_ffi_ret(f, 0), *qt = sl_ffi_ret(f, 1), *sc = sl_ffi_ret(f, 2);
  if (x->rank < 2) return bad(f, "x must have rank >= 2 ([..., rows, cols])");
  const int nb = (int)x->rank - 2;
  sl_quantize_fp8_desc d = {sizeof(sl_quantize_fp8_desc), 1, rows, x->dims[nb + 1], x->dims[nb],
                            SL_DTYPE_F32, (int)br, (int)bc, (int)(pow2 != 0)};
  for (int i = 0; i < nb; ++i) d.batch *= x->dims[i];
  if (!sl_ffi_dtype(x->dtype, &d.dtype) || d.dtype == SL_DTYPE_I32 || d.dtype == SL_DTYPE_F8E4M3)
    return bad(f, "x must be float32, bfloat16 or float16");
  if (vr->dtype != XLA_FFI_DataType_S32 || vr->rank != nb + 1 || vr->dims[nb] != 2)
    return bad(f, "row_range must be int32 [..., 2] with x's batch dims");
  int64_t want_scale = d.batch * (br == 1 ? rows : (rows + 127) / 128) *
                       (bc == 1 ? d.cols : (d.cols + 127) / 128);
  int64_t n = 1;
  for (int64_t i = 0; i < sc->rank; ++i) n *= sc->dims[i];
  if (sc->dtype != XLA_FFI_DataType_F32 || n != want_scale)
    return bad(f, "scale must be float32 with the block layout's element count");
  const int64_t want_q = d.batch * rows * d.cols;
  int64_t nq = 1, nqt = 1;
  for (int64_t i = 0; i < q->rank; ++i) nq *= q->dims[i];
  for (int64_t i = 0; i < qt->rank; ++i) nqt *= qt->dims[i];
  if ((wq && (q->dtype != XLA_FFI_DataType_F8E4M3FN || nq != want_q)) ||
      (wqt && (qt->dtype != XLA_FFI_DataType_F8E4M3FN || nqt != want_q)))
    return bad(f, "q and q_t must be float8_e4m3fn [..., rows, cols] and [..., cols, rows]");
  void *stream = sl_ffi_stream(f, &err);
  if (err) return err;
  sl_status st = sl_quantize_fp8_cuda(&d, x->data, vr->data, wq ? q->data : NULL,
                                      wqt ? qt->data : NULL, sc->data, stream);
  return st == SL_STATUS_SUCCESS ? NULL : sl_ffi_status_error(f, op, st);
}

XLA_FFI_Error *sl_ffi_quantize_fp8_cpu(XLA_FFI_CallFrame *f) { return handle(f, 0); }
XLA_FFI_Error *sl_ffi_quantize_fp8_cuda(XLA_FFI_CallFrame *f) { return handle(f, 1); }
