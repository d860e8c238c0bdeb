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

/* The shape rules of every grouped GEMM descriptor (gmm_cpu.c): desc not NULL, struct_size,
 * batch >= 1, sizes non-negative, G_local <= G, m, k and n within int32. `op` names the call in
 * the message. sl_gmm_desc_check adds the 16/32-bit ops' dtype rules, sl_gmm_fp8_check FP8's. */
sl_status sl_gmm_shape_check(const sl_gmm_desc *desc, const char *op);

/* The data-dependent checks of one batch entry `b` of a CPU grouped GEMM (gmm_cpu.c): a negative
 * size, sum(group_sizes) > m or an offset outside [0, G - G_local] is SL_STATUS_INVALID_VALUE with
 * a message naming the value. On success starts[0..G_local] holds the local groups' row boundaries
 * (local group j spans rows [starts[j], starts[j + 1])). group_offset may be NULL (0). */
sl_status sl_gmm_local_rows(const char *op, const sl_gmm_desc *desc, const int32_t *group_sizes,
                            const int32_t *group_offset, int64_t b, int64_t *starts);

/* The CPU grouped GEMMs' plan (gmm_cpu.c, gmm_fp8_cpu.c): the local groups' row ranges
 * (sl_gmm_local_rows, which rejects bad values) into *starts [batch][G_local + 1]; gmm's rows of
 * out outside the local groups zeroed; and the tiles, per problem and local group blocks of mb rows
 * (gmm: the group's rows; tgmm: out[g]'s K rows) by nb columns, into *tasks (*ntasks of them).
 * Both arrays are malloc'ed; the caller frees them. */
typedef struct {
  int64_t b, g, r0, c0; /* batch, local group, first tile row, first tile column */
} sl_gmm_task;
sl_status sl_gmm_plan(const char *op, const sl_gmm_desc *desc, int is_tgmm,
                      const int32_t *group_sizes, const int32_t *group_offset, void *out,
                      int64_t mb, int64_t nb, int64_t **starts, sl_gmm_task **tasks,
                      int64_t *ntasks);

/* Checks an FP8 grouped GEMM descriptor (gmm_fp8 / tgmm_fp8, sluice.h): what sl_gmm_desc_check
 * checks, plus lhs and rhs SL_DTYPE_F8E4M3, out BF16 or F32, and transpose_rhs = 1 for gmm_fp8.
 * `op` names the call in the message. CPU and CUDA entry points both call it. */
sl_status sl_gmm_fp8_check(const sl_gmm_desc *desc, int is_tgmm, const char *op);

/* Checks an FP8 quantization descriptor (sluice.h: sl_quantize_fp8_cuda), naming `op`. */
sl_status sl_quantize_fp8_check(const sl_quantize_fp8_desc *desc, const char *op);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_INTERNAL_H_ */
