#include "ffi_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../core/internal.h"

uint32_t sl_ffi_graph_traits(int on_cuda) {
  return on_cuda && !sl_debug_enabled() ? XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE : 0;
}

int sl_ffi_answer_metadata(XLA_FFI_CallFrame *frame, uint32_t traits) {
  /* XLA_FFI_Extension_Base in jax <= 0.10, XLA_FFI_InternalExtension from 0.11: same leading fields. */
  __typeof__(frame->extension_start) ext = frame->extension_start;
  for (; ext != NULL; ext = ext->next) {
    if (ext->type != XLA_FFI_Extension_Metadata) continue;
    XLA_FFI_Metadata *md = ((XLA_FFI_Metadata_Extension *)ext)->metadata;
    md->api_version.major_version = XLA_FFI_API_MAJOR;
    md->api_version.minor_version = XLA_FFI_API_MINOR;
    md->traits = traits;
    return 1;
  }
  return 0;
}

static XLA_FFI_Error *make_error(const XLA_FFI_CallFrame *frame, XLA_FFI_Error_Code code,
                                 const char *msg) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = msg;
  args.errc = code;
  return frame->api->XLA_FFI_Error_Create(&args);
}

XLA_FFI_Error *sl_ffi_error(const XLA_FFI_CallFrame *frame, XLA_FFI_Error_Code code, const char *fmt,
                            ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return make_error(frame, code, msg);
}

XLA_FFI_Error *sl_ffi_status_error(const XLA_FFI_CallFrame *frame, const char *op, sl_status st) {
  XLA_FFI_Error_Code code = XLA_FFI_Error_Code_INTERNAL;
  switch (st) {
    case SL_STATUS_INVALID_ARGUMENT:
    case SL_STATUS_INVALID_VALUE: code = XLA_FFI_Error_Code_INVALID_ARGUMENT; break;
    case SL_STATUS_UNSUPPORTED: code = XLA_FFI_Error_Code_UNIMPLEMENTED; break;
    case SL_STATUS_OUT_OF_MEMORY: code = XLA_FFI_Error_Code_RESOURCE_EXHAUSTED; break;
    case SL_STATUS_TIMEOUT: code = XLA_FFI_Error_Code_DEADLINE_EXCEEDED; break;
    default: break;
  }
  const char *msg = sl_last_error();
  if (msg[0] == '\0') return sl_ffi_error(frame, code, "sluice %s: failed (%s)", op, sl_status_string(st));
  return sl_ffi_error(frame, code, "sluice %s (%s)", msg, sl_status_string(st));
}

XLA_FFI_Error *sl_ffi_check_frame(const XLA_FFI_CallFrame *frame, const char *op, int64_t nargs,
                                  int64_t nrets) {
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE)
    return sl_ffi_error(frame, XLA_FFI_Error_Code_FAILED_PRECONDITION,
                        "sluice %s: called at stage %d, only EXECUTE is supported", op,
                        (int)frame->stage);
  if (frame->args.size != nargs || frame->rets.size != nrets)
    return sl_ffi_error(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                        "sluice %s: expected %lld operands and %lld results, got %lld and %lld", op,
                        (long long)nargs, (long long)nrets, (long long)frame->args.size,
                        (long long)frame->rets.size);
  for (int64_t i = 0; i < nargs; ++i)
    if (frame->args.types[i] != XLA_FFI_ArgType_BUFFER)
      return sl_ffi_error(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "sluice %s: operand %lld is not a buffer", op, (long long)i);
  for (int64_t i = 0; i < nrets; ++i)
    if (frame->rets.types[i] != XLA_FFI_RetType_BUFFER)
      return sl_ffi_error(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                          "sluice %s: result %lld is not a buffer", op, (long long)i);
  return NULL;
}

XLA_FFI_Error *sl_ffi_int_attr(const XLA_FFI_CallFrame *frame, const char *op, const char *name,
                               int64_t *out) {
  const size_t len = strlen(name);
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan *n = frame->attrs.names[i];
    if (n->len != len || memcmp(n->ptr, name, len) != 0) continue;
    if (frame->attrs.types[i] != XLA_FFI_AttrType_SCALAR) break;
    const XLA_FFI_Scalar *s = (const XLA_FFI_Scalar *)frame->attrs.attrs[i];
    switch (s->dtype) {
      case XLA_FFI_DataType_PRED: *out = *(const uint8_t *)s->value != 0; return NULL;
      case XLA_FFI_DataType_S8: *out = *(const int8_t *)s->value; return NULL;
      case XLA_FFI_DataType_S16: *out = *(const int16_t *)s->value; return NULL;
      case XLA_FFI_DataType_S32: *out = *(const int32_t *)s->value; return NULL;
      case XLA_FFI_DataType_S64: *out = *(const int64_t *)s->value; return NULL;
      case XLA_FFI_DataType_U8: *out = *(const uint8_t *)s->value; return NULL;
      case XLA_FFI_DataType_U32: *out = *(const uint32_t *)s->value; return NULL;
      default: break;
    }
    break;
  }
  return sl_ffi_error(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                      "sluice %s: attribute '%s' is missing or not an integer scalar", op, name);
}

int sl_ffi_dtype(XLA_FFI_DataType t, sl_dtype *out) {
  switch (t) {
    case XLA_FFI_DataType_F32: *out = SL_DTYPE_F32; return 1;
    case XLA_FFI_DataType_BF16: *out = SL_DTYPE_BF16; return 1;
    case XLA_FFI_DataType_F16: *out = SL_DTYPE_F16; return 1;
    case XLA_FFI_DataType_S32: *out = SL_DTYPE_I32; return 1;
    case XLA_FFI_DataType_F8E4M3FN: *out = SL_DTYPE_F8E4M3; return 1;
    default: return 0;
  }
}

const char *sl_ffi_dtype_name(XLA_FFI_DataType t) {
  switch (t) {
    case XLA_FFI_DataType_PRED: return "bool";
    case XLA_FFI_DataType_S8: return "int8";
    case XLA_FFI_DataType_S16: return "int16";
    case XLA_FFI_DataType_S32: return "int32";
    case XLA_FFI_DataType_S64: return "int64";
    case XLA_FFI_DataType_U8: return "uint8";
    case XLA_FFI_DataType_U32: return "uint32";
    case XLA_FFI_DataType_F16: return "float16";
    case XLA_FFI_DataType_F32: return "float32";
    case XLA_FFI_DataType_F64: return "float64";
    case XLA_FFI_DataType_BF16: return "bfloat16";
    case XLA_FFI_DataType_F8E4M3FN: return "float8_e4m3fn";
    default: return "other";
  }
}

void *sl_ffi_stream(const XLA_FFI_CallFrame *frame, XLA_FFI_Error **err) {
  XLA_FFI_Stream_Get_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Stream_Get_Args_STRUCT_SIZE;
  args.ctx = frame->ctx;
  *err = frame->api->XLA_FFI_Stream_Get(&args);
  return *err ? NULL : args.stream;
}

void *sl_ffi_workspace(const XLA_FFI_CallFrame *frame, int i, size_t need, const char *op,
                       XLA_FFI_Error **err) {
  const XLA_FFI_Buffer *ws = sl_ffi_ret(frame, i);
  int64_t bytes = 1;
  for (int64_t d = 0; d < ws->rank; ++d) bytes *= ws->dims[d];
  *err = (size_t)bytes < need ? sl_ffi_error(frame, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                                             "sluice %s: workspace has %lld bytes, needs %zu", op,
                                             (long long)bytes, need)
                              : NULL;
  return *err ? NULL : ws->data;
}
