/* Plain-C helpers for XLA FFI handlers: the metadata handshake, argument and attribute access, and
 * turning an sl_status into an XLA_FFI_Error. No arithmetic lives here. */
#ifndef SLUICE_FFI_UTIL_H_
#define SLUICE_FFI_UTIL_H_

#include <stdint.h>

#include "sluice.h"
#include "xla/ffi/api/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* If `frame` is XLA's metadata query, answers it (API version, `traits`) and returns 1. */
int sl_ffi_answer_metadata(XLA_FFI_CallFrame *frame, uint32_t traits);

/* The traits of a handler whose CUDA work is the same device work on every call (sizes stay on the
 * device): XLA may record it into a command buffer (a CUDA graph) and replay it without calling
 * the handler. Not on the CPU, and not under SLUICE_DEBUG, whose checks copy device values to the
 * host and synchronise, which a graph capture forbids. */
uint32_t sl_ffi_graph_traits(int on_cuda);

/* A new XLA_FFI_Error with a printf-style message. */
XLA_FFI_Error *sl_ffi_error(const XLA_FFI_CallFrame *frame, XLA_FFI_Error_Code code, const char *fmt,
                            ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* An XLA_FFI_Error for a failed sluice call: "<op>: <sl_last_error()> (<status name>)". */
XLA_FFI_Error *sl_ffi_status_error(const XLA_FFI_CallFrame *frame, const char *op, sl_status st);

/* Checks stage EXECUTE and the argument/result counts; all must be buffers. NULL when fine. */
XLA_FFI_Error *sl_ffi_check_frame(const XLA_FFI_CallFrame *frame, const char *op, int64_t nargs,
                                  int64_t nrets);

static inline XLA_FFI_Buffer *sl_ffi_arg(const XLA_FFI_CallFrame *f, int i) {
  return (XLA_FFI_Buffer *)f->args.args[i];
}
static inline XLA_FFI_Buffer *sl_ffi_ret(const XLA_FFI_CallFrame *f, int i) {
  return (XLA_FFI_Buffer *)f->rets.rets[i];
}

/* The integer scalar attribute `name` (any integer or PRED dtype) in *out. Missing or of another
 * kind: an error naming the op and the attribute. */
XLA_FFI_Error *sl_ffi_int_attr(const XLA_FFI_CallFrame *frame, const char *op, const char *name,
                               int64_t *out);

/* XLA dtype -> sluice dtype; returns 0 when there is no match. */
int sl_ffi_dtype(XLA_FFI_DataType t, sl_dtype *out);

/* A short name for a dtype in messages ("bf16"). */
const char *sl_ffi_dtype_name(XLA_FFI_DataType t);

/* The CUDA stream of this call (NULL on error, with *err set). */
void *sl_ffi_stream(const XLA_FFI_CallFrame *frame, XLA_FFI_Error **err);

/* Result i as a device workspace of at least `need` bytes: its data, or NULL with *err set (an
 * error naming `op` and both sizes). */
void *sl_ffi_workspace(const XLA_FFI_CallFrame *frame, int i, size_t need, const char *op,
                       XLA_FFI_Error **err);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_FFI_UTIL_H_ */
