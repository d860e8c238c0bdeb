/* Stand-ins for the CUDA entry points when the library is built without CUDA. */
#include "internal.h"

int sl_has_cuda(void) { return 0; }

size_t sl_gmm_cuda_workspace_size(const sl_gmm_desc *desc) {
  (void)desc;
  return 0;
}

static sl_status not_built(const char *op) {
  return sl_set_error(SL_STATUS_UNSUPPORTED, "%s: libsluice was built without CUDA", op);
}

sl_status sl_gmm_cuda(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                      const int32_t *group_sizes, const int32_t *group_offset, void *out,
                      void *workspace, void *stream) {
  (void)desc, (void)lhs, (void)rhs, (void)group_sizes, (void)group_offset, (void)out;
  (void)workspace, (void)stream;
  return not_built("gmm");
}

sl_status sl_tgmm_cuda(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                       const int32_t *group_sizes, const int32_t *group_offset, void *out,
                       void *workspace, void *stream) {
  (void)desc, (void)lhs, (void)rhs, (void)group_sizes, (void)group_offset, (void)out;
  (void)workspace, (void)stream;
  return not_built("tgmm");
}

sl_status sl_swiglu_fwd_cuda(const sl_swiglu_desc *desc, const void *h, const float *row_weights,
                             const int32_t *group_sizes, void *act, void *stream) {
  (void)desc, (void)h, (void)row_weights, (void)group_sizes, (void)act, (void)stream;
  return not_built("swiglu");
}

sl_status sl_swiglu_bwd_cuda(const sl_swiglu_desc *desc, const void *dact, const void *h,
                             const float *row_weights, const int32_t *group_sizes, void *dh,
                             float *drow_weights, void *stream) {
  (void)desc, (void)dact, (void)h, (void)row_weights, (void)group_sizes, (void)dh;
  (void)drow_weights, (void)stream;
  return not_built("swiglu_bwd");
}
