/* FP8 grouped GEMM entry points (sluice.h: sl_gmm_fp8_cuda, sl_tgmm_fp8_cuda). */
#include <cuda_runtime.h>

#include "../core/internal.h"
#include "sluice.h"

extern "C" {

sl_status sl_gmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs, const float *lhs_scale,
                          const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                          const int32_t *group_offset, void *out, void *workspace, void *stream) {
  (void)desc, (void)lhs, (void)lhs_scale, (void)rhs, (void)rhs_scale, (void)group_sizes;
  (void)group_offset, (void)out, (void)workspace, (void)stream;
  return sl_set_error(SL_STATUS_UNSUPPORTED, "gmm_fp8: no CUDA kernel in this build");
}

sl_status sl_tgmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs_t, const float *lhs_scale,
                           const void *rhs_t, const float *rhs_scale, const int32_t *group_sizes,
                           const int32_t *group_offset, void *out, void *workspace, void *stream) {
  (void)desc, (void)lhs_t, (void)lhs_scale, (void)rhs_t, (void)rhs_scale, (void)group_sizes;
  (void)group_offset, (void)out, (void)workspace, (void)stream;
  return sl_set_error(SL_STATUS_UNSUPPORTED, "tgmm_fp8: no CUDA kernel in this build");
}

} /* extern "C" */
