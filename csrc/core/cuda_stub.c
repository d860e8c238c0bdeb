/* The CUDA entry points of a library built without CUDA (CMakeLists.txt builds this file instead of
 * csrc/cuda/, and the C tests link it): gmm, gmm_fp8, swiglu and the expert-parallel layout and fan
 * ops return SL_STATUS_UNSUPPORTED, and there is no device transport (sl_ep_comm_create with
 * use_cuda, and the *_cuda exchange ops in ep_comm.c, say so). */
#include "ep_internal.h"

const ep_transport *const ep_device_transports[EP_NUM_DEVICE_TRANSPORTS] = {NULL};

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

sl_status sl_gmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs, const float *lhs_scale,
                          const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                          const int32_t *group_offset, void *out, void *workspace, void *stream) {
  (void)desc, (void)lhs, (void)lhs_scale, (void)rhs, (void)rhs_scale, (void)group_sizes;
  (void)group_offset, (void)out, (void)workspace, (void)stream;
  return not_built("gmm_fp8");
}

sl_status sl_tgmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs_t, const float *lhs_scale,
                           const void *rhs_t, const float *rhs_scale, const int32_t *group_sizes,
                           const int32_t *group_offset, void *out, void *workspace, void *stream) {
  (void)desc, (void)lhs_t, (void)lhs_scale, (void)rhs_t, (void)rhs_scale, (void)group_sizes;
  (void)group_offset, (void)out, (void)workspace, (void)stream;
  return not_built("tgmm_fp8");
}

sl_status sl_quantize_fp8_cuda(const sl_quantize_fp8_desc *desc, const void *x,
                               const int32_t *row_range, void *q, void *q_t, float *scale,
                               void *stream) {
  (void)desc, (void)x, (void)row_range, (void)q, (void)q_t, (void)scale, (void)stream;
  return not_built("quantize_fp8");
}

sl_status sl_quantize_fp8_both_cuda(const sl_quantize_fp8_desc *desc, const void *x,
                                    const int32_t *row_range, const int32_t *gather, void *q,
                                    float *scale, void *q_t, float *scale_t, void *stream) {
  (void)desc, (void)x, (void)row_range, (void)gather, (void)q, (void)scale, (void)q_t;
  (void)scale_t;
  (void)stream;
  return not_built("quantize_fp8_both");
}

sl_status sl_swiglu_quantize_fp8_cuda(const sl_quantize_fp8_desc *desc, const void *h,
                                      const float *row_weights, const int32_t *row_range, void *q,
                                      float *scale, void *q_t, float *scale_t, void *stream) {
  (void)desc, (void)h, (void)row_weights, (void)row_range, (void)q, (void)scale, (void)q_t;
  (void)scale_t, (void)stream;
  return not_built("swiglu_quantize_fp8");
}

sl_status sl_swiglu_bwd_quantize_fp8_cuda(const sl_quantize_fp8_desc *desc, const void *dact,
                                          const void *h, const float *row_weights,
                                          const int32_t *row_range, void *q, float *scale,
                                          void *q_t, float *scale_t, float *drow_weight_parts,
                                          void *stream) {
  (void)desc, (void)dact, (void)h, (void)row_weights, (void)row_range, (void)q, (void)scale;
  (void)q_t, (void)scale_t, (void)drow_weight_parts, (void)stream;
  return not_built("swiglu_bwd_quantize_fp8");
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

sl_status sl_ep_layout_cuda(const sl_ep_desc *desc, const int32_t *topk_idx, int32_t *send_pos,
                            int32_t *send_counts, int32_t *expert_counts, void *stream) {
  (void)desc, (void)topk_idx, (void)send_pos, (void)send_counts, (void)expert_counts, (void)stream;
  return not_built("ep layout");
}

sl_status sl_ep_fan_out_cuda(const sl_ep_fan_desc *desc, const void *recv_x,
                             const int32_t *recv_idx, void *xs, int32_t *group_sizes, int32_t *pos,
                             void *workspace, void *stream) {
  (void)desc, (void)recv_x, (void)recv_idx, (void)xs, (void)group_sizes, (void)pos;
  (void)workspace, (void)stream;
  return not_built("ep fan_out");
}

sl_status sl_ep_fan_in_cuda(const sl_ep_fan_desc *desc, const void *ys, const float *w,
                            const int32_t *pos, void *out, void *stream) {
  (void)desc, (void)ys, (void)w, (void)pos, (void)out, (void)stream;
  return not_built("ep fan_in");
}

sl_status sl_ep_fan_in_bwd_cuda(const sl_ep_fan_desc *desc, const void *dout, const void *ys,
                                const float *w, const int32_t *pos, const int32_t *group_sizes,
                                void *dys, float *dw, void *stream) {
  (void)desc, (void)dout, (void)ys, (void)w, (void)pos, (void)group_sizes, (void)dys, (void)dw;
  (void)stream;
  return not_built("ep fan_in_bwd");
}
