/* Internal helpers shared by the C core, the CUDA launchers and the FFI layer. Not installed. */
#ifndef SLUICE_INTERNAL_H_
#define SLUICE_INTERNAL_H_

#include "sluice.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Records `fmt` as this thread's last error and returns `status`. Use as
 *   return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "gmm: lhs has %d dims, expected 2", rank); */
sl_status sl_set_error(sl_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Clears this thread's last error. */
void sl_clear_error(void);

/* 1 when SLUICE_DEBUG=1 is set in the environment (read once). */
int sl_debug_enabled(void);

/* swiglu's shape and dtype checks (swiglu_cpu.c), for the CPU and CUDA entry points alike. */
sl_status sl_swiglu_desc_check(const sl_swiglu_desc *desc, const char *op);

/* Checks an FP8 grouped GEMM descriptor (gmm_fp8 / tgmm_fp8, sluice.h): what sl_gmm_desc_check
 * checks, plus lhs and rhs SL_DTYPE_F8E4M3, out BF16 or F32, and transpose_rhs = 1 for gmm_fp8.
 * `op` names the call in the message. CPU and CUDA entry points both call it. */
sl_status sl_gmm_fp8_check(const sl_gmm_desc *desc, int is_tgmm, const char *op);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_INTERNAL_H_ */
