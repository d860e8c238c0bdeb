/* swiglu on the CPU: the reference of the CUDA kernels (include/sluice.h). */
#include <math.h>
#include <string.h>

#include "convert.h"
#include "internal.h"

sl_swiglu_desc sl_swiglu_desc_default(void) {
  sl_swiglu_desc d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.num_groups = 1;
  d.dtype = SL_DTYPE_F32;
  return d;
}

/* Shared by the CPU and CUDA entry points: the shapes and the dtype. */
sl_status sl_swiglu_desc_check(const sl_swiglu_desc *d, const char *op) {
  if (d == NULL) return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: desc is NULL", op);
  if (d->struct_size < sizeof(sl_swiglu_desc))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: desc->struct_size is %zu, expected %zu (set it with sizeof)", op,
                        d->struct_size, sizeof(sl_swiglu_desc));
  if (d->rows < 0 || d->ff < 0 || d->num_groups < 1)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: need rows >= 0, ff >= 0 and num_groups >= 1, got %lld, %lld, %lld", op,
                        (long long)d->rows, (long long)d->ff, (long long)d->num_groups);
  if (d->dtype != SL_DTYPE_F32 && d->dtype != SL_DTYPE_BF16 && d->dtype != SL_DTYPE_F16)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: dtype must be f32, bf16 or f16", op);
  return SL_STATUS_SUCCESS;
}

/* U, the rows the groups cover; an error for a negative size or U > M. */
static sl_status used_rows(const sl_swiglu_desc *d, const int32_t *gs, const char *op,
                           int64_t *used) {
  if (gs == NULL) return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: group_sizes is NULL", op);
  int64_t u = 0;
  for (int64_t g = 0; g < d->num_groups; ++g) {
    if (gs[g] < 0)
      return sl_set_error(SL_STATUS_INVALID_VALUE, "%s: group_sizes[%lld] = %d is negative", op,
                          (long long)g, gs[g]);
    u += gs[g];
  }
  if (u > d->rows)
    return sl_set_error(SL_STATUS_INVALID_VALUE,
                        "%s: sum(group_sizes) = %lld exceeds the %lld rows", op, (long long)u,
                        (long long)d->rows);
  *used = u;
  return SL_STATUS_SUCCESS;
}

sl_status sl_swiglu_fwd_cpu(const sl_swiglu_desc *d, const void *h, const float *w,
                            const int32_t *gs, void *act) {
  int64_t used = 0;
  sl_status st = sl_swiglu_desc_check(d, "swiglu");
  if (st || (st = used_rows(d, gs, "swiglu", &used))) return st;
  const int64_t F = d->ff;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d->rows; ++r)
    for (int64_t j = 0; j < F; ++j) {
      float a = 0.0f;
      if (r < used) {
        const float g = sl_load_f32(d->dtype, h, r * 2 * F + j),
                    u = sl_load_f32(d->dtype, h, r * 2 * F + F + j);
        a = g / (1.0f + expf(-g)) * u * (w ? w[r] : 1.0f);
      }
      sl_store_f32(d->dtype, act, r * F + j, a);
    }
  return SL_STATUS_SUCCESS;
}

sl_status sl_swiglu_bwd_cpu(const sl_swiglu_desc *d, const void *dact, const void *h,
                            const float *w, const int32_t *gs, void *dh, float *dw) {
  int64_t used = 0;
  sl_status st = sl_swiglu_desc_check(d, "swiglu_bwd");
  if (st || (st = used_rows(d, gs, "swiglu_bwd", &used))) return st;
  if (w && !dw)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "swiglu_bwd: row_weights given but drow_weights is NULL");
  const int64_t F = d->ff;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d->rows; ++r) {
    const float wr = w && r < used ? w[r] : 1.0f;
    float dot = 0.0f;
    for (int64_t j = 0; j < F; ++j) {
      float dg = 0.0f, du = 0.0f;
      if (r < used) {
        const float g = sl_load_f32(d->dtype, h, r * 2 * F + j),
                    u = sl_load_f32(d->dtype, h, r * 2 * F + F + j),
                    da = sl_load_f32(d->dtype, dact, r * F + j), s = 1.0f / (1.0f + expf(-g)),
                    daw = da * wr; /* d act times the row's weight */
        dot += da * (g * s * u);
        dg = daw * u * (s * (1.0f + g * (1.0f - s)));
        du = daw * (g * s);
      }
      sl_store_f32(d->dtype, dh, r * 2 * F + j, dg);
      sl_store_f32(d->dtype, dh, r * 2 * F + F + j, du);
    }
    if (w) dw[r] = dot;
  }
  return SL_STATUS_SUCCESS;
}
