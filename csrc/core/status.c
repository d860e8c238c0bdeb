/* Status strings, the thread-local last error, dtype sizes and the debug switch. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Thread_local char last_error[1024];

const char *sl_status_string(sl_status status) {
  switch (status) {
    case SL_STATUS_SUCCESS: return "SL_STATUS_SUCCESS";
    case SL_STATUS_INVALID_ARGUMENT: return "SL_STATUS_INVALID_ARGUMENT";
    case SL_STATUS_INVALID_VALUE: return "SL_STATUS_INVALID_VALUE";
    case SL_STATUS_UNSUPPORTED: return "SL_STATUS_UNSUPPORTED";
    case SL_STATUS_OUT_OF_MEMORY: return "SL_STATUS_OUT_OF_MEMORY";
    case SL_STATUS_CUDA_ERROR: return "SL_STATUS_CUDA_ERROR";
    case SL_STATUS_TIMEOUT: return "SL_STATUS_TIMEOUT";
    case SL_STATUS_INTERNAL: return "SL_STATUS_INTERNAL";
  }
  return "SL_STATUS_UNKNOWN";
}

const char *sl_last_error(void) { return last_error; }

void sl_clear_error(void) { last_error[0] = '\0'; }

sl_status sl_set_error(sl_status status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

size_t sl_dtype_size(sl_dtype dtype) {
  switch (dtype) {
    case SL_DTYPE_F32: return 4;
    case SL_DTYPE_BF16: return 2;
    case SL_DTYPE_F16: return 2;
    case SL_DTYPE_I32: return 4;
    case SL_DTYPE_F8E4M3: return 1;
  }
  return 0;
}

int sl_version(void) {
  return SLUICE_VERSION_MAJOR * 10000 + SLUICE_VERSION_MINOR * 100 + SLUICE_VERSION_PATCH;
}

int sl_debug_enabled(void) {
  /* Racy first read is benign: every thread computes the same value. */
  static int cached = -1;
  if (cached < 0) {
    const char *v = getenv("SLUICE_DEBUG");
    cached = (v != NULL && strcmp(v, "0") != 0 && v[0] != '\0') ? 1 : 0;
  }
  return cached;
}
