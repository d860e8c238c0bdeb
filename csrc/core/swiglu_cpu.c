/* swiglu on the CPU: the reference of the CUDA kernels (include/sluice.h). */
#include <math.h>
#include <string.h>

#include "convert.h"
#include "internal.h"
#include "vexp.h"

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

/* Columns of a row converted at a time: its gate, up (and d act) chunks in f32 on the stack. */
#define SWIGLU_CHUNK 512

/* n elements from element i of an f32, bf16 or f16 array to f32, and back (convert.h's
 * rounding): the dtype switch once a chunk, not once an element, so the loops vectorise. */
static void load_chunk(sl_dtype t, const void *p, int64_t i, int n, float *out) {
  if (t == SL_DTYPE_F32) {
    memcpy(out, (const float *)p + i, sizeof(float) * (size_t)n);
    return;
  }
  const uint16_t *s = (const uint16_t *)p + i;
  if (t == SL_DTYPE_BF16) {
#pragma omp simd
    for (int k = 0; k < n; ++k) out[k] = sl_bf16_to_f32(s[k]);
  } else {
#pragma omp simd
    for (int k = 0; k < n; ++k) out[k] = sl_f16_to_f32(s[k]);
  }
}

static void store_chunk(sl_dtype t, void *p, int64_t i, int n, const float *in) {
  if (t == SL_DTYPE_F32) {
    memcpy((float *)p + i, in, sizeof(float) * (size_t)n);
    return;
  }
  uint16_t *s = (uint16_t *)p + i;
  if (t == SL_DTYPE_BF16) {
#pragma omp simd
    for (int k = 0; k < n; ++k) s[k] = sl_f32_to_bf16(in[k]);
  } else {
#pragma omp simd
    for (int k = 0; k < n; ++k) s[k] = sl_f32_to_f16(in[k]);
  }
}

/* n elements from element i set to +0, whose bits are all zero in f32, bf16 and f16. */
static void zero_elems(sl_dtype t, void *p, int64_t i, int64_t n) {
  const size_t es = sl_dtype_size(t);
  if (n > 0) memset((char *)p + (size_t)i * es, 0, (size_t)n * es);
}

sl_status sl_swiglu_fwd_cpu(const sl_swiglu_desc *d, const void *h, const float *w,
                            const int32_t *gs, void *act) {
  int64_t used = 0;
  sl_status st = sl_swiglu_desc_check(d, "swiglu");
  if (st || (st = used_rows(d, gs, "swiglu", &used))) return st;
  const int64_t F = d->ff;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < d->rows; ++r) {
    if (r >= used) {
      zero_elems(d->dtype, act, r * F, F);
      continue;
    }
    const float wr = w ? w[r] : 1.0f;
    _Alignas(64) float g[SWIGLU_CHUNK], u[SWIGLU_CHUNK];
    for (int64_t j0 = 0; j0 < F; j0 += SWIGLU_CHUNK) {
      const int n = (int)(F - j0 < SWIGLU_CHUNK ? F - j0 : SWIGLU_CHUNK);
      load_chunk(d->dtype, h, r * 2 * F + j0, n, g);
      load_chunk(d->dtype, h, r * 2 * F + F + j0, n, u);
#pragma omp simd
      for (int k = 0; k < n; ++k) g[k] = g[k] / (1.0f + sl_vexpf(-g[k])) * u[k] * wr;
      store_chunk(d->dtype, act, r * F + j0, n, g);
    }
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
    if (r >= used) {
      zero_elems(d->dtype, dh, r * 2 * F, 2 * F);
      if (w) dw[r] = 0.0f;
      continue;
    }
    const float wr = w ? w[r] : 1.0f;
    float dot = 0.0f;
    _Alignas(64) float g[SWIGLU_CHUNK], u[SWIGLU_CHUNK], da[SWIGLU_CHUNK];
    for (int64_t j0 = 0; j0 < F; j0 += SWIGLU_CHUNK) {
      const int n = (int)(F - j0 < SWIGLU_CHUNK ? F - j0 : SWIGLU_CHUNK);
      load_chunk(d->dtype, h, r * 2 * F + j0, n, g);
      load_chunk(d->dtype, h, r * 2 * F + F + j0, n, u);
      load_chunk(d->dtype, dact, r * F + j0, n, da);
      /* the row's sum in f32 over vector lanes (the CUDA kernel's is over a warp's) */
#pragma omp simd reduction(+ : dot)
      for (int k = 0; k < n; ++k) {
        const float gk = g[k], uk = u[k], s = 1.0f / (1.0f + sl_vexpf(-gk)),
                    daw = da[k] * wr; /* d act times the row's weight */
        dot += da[k] * (gk * s * uk);
        g[k] = daw * uk * (s * (1.0f + gk * (1.0f - s))); /* d gate */
        u[k] = daw * (gk * s);                            /* d up */
      }
      store_chunk(d->dtype, dh, r * 2 * F + j0, n, g);
      store_chunk(d->dtype, dh, r * 2 * F + F + j0, n, u);
    }
    if (w) dw[r] = dot;
  }
  return SL_STATUS_SUCCESS;
}
