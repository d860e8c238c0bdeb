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
