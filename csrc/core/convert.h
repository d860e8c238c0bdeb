/* f32 <-> bf16 / f16 element conversions of the C core (round to nearest even, NaN stays NaN). */
#ifndef SLUICE_CONVERT_H_
#define SLUICE_CONVERT_H_

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sluice.h"

/* An f32's bits as a uint32, and a uint32's bits as an f32. */
static inline uint32_t sl_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float sl_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float sl_bf16_to_f32(uint16_t h) { return sl_bits_f32((uint32_t)h << 16); }

static inline uint16_t sl_f32_to_bf16(float f) {
  uint32_t u = sl_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Masks for the subnormal and inf/NaN cases, no branches and no ldexpf, so a loop of it
 * vectorises (the CPU swiglu's); subnormals are scaled in f32 arithmetic, not read as subnormal
 * f32 (DAZ-safe). */
static inline float sl_f16_to_f32(uint16_t h) {
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  const uint32_t inf = 0u - (e == 31u), sub = 0u - (e == 0u); /* all ones where true */
  const float fs = (float)(int32_t)m * 0x1p-24f;
  const uint32_t us = sl_f32_bits(fs), u = ((e + 112u) << 23 | (inf & (255u << 23))) | (m << 13);
  return sl_bits_f32((sub & us) | (~sub & u) | (uint32_t)(h & 0x8000u) << 16);
}

static inline uint16_t sl_f32_to_f16(float f) {
  uint32_t u = sl_f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;  /* NaN */
  if (u >= 0x477ff000u) return sign | 0x7c00u; /* rounds to infinity */
  if (u < 0x38800000u) {                       /* f16 subnormal or zero: exact scaling, RNE */
    return sign | (uint16_t)nearbyintf(sl_bits_f32(u) * 16777216.0f);
  }
  u += 0xfffu + ((u >> 13) & 1u);
  return sign | (uint16_t)((u - (112u << 23)) >> 13);
}

/* Element i of an f32, bf16 or f16 array as f32, and f32 back into one (bf16/f16: nearest even). */
static inline float sl_load_f32(sl_dtype t, const void *p, int64_t i) {
  switch (t) {
    case SL_DTYPE_BF16: return sl_bf16_to_f32(((const uint16_t *)p)[i]);
    case SL_DTYPE_F16: return sl_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

static inline void sl_store_f32(sl_dtype t, void *p, int64_t i, float v) {
  switch (t) {
    case SL_DTYPE_BF16: ((uint16_t *)p)[i] = sl_f32_to_bf16(v); break;
    case SL_DTYPE_F16: ((uint16_t *)p)[i] = sl_f32_to_f16(v); break;
    default: ((float *)p)[i] = v;
  }
}

/* rows x cols of c (row stride c_ld) into dst (row stride ld) as t: memcpy for f32, rounded to
 * nearest even for bf16/f16. The CPU kernels' tile stores. */
static inline void sl_store_tile(sl_dtype t, const float *c, int64_t c_ld, int rows, int cols,
                                 void *dst, int64_t ld) {
  for (int r = 0; r < rows; ++r) {
    const float *s = c + (size_t)r * (size_t)c_ld;
    if (t == SL_DTYPE_F32) {
      memcpy((float *)dst + r * ld, s, sizeof(float) * (size_t)cols);
    } else {
      uint16_t *o = (uint16_t *)dst + r * ld;
      if (t == SL_DTYPE_BF16)
        for (int j = 0; j < cols; ++j) o[j] = sl_f32_to_bf16(s[j]);
      else
        for (int j = 0; j < cols; ++j) o[j] = sl_f32_to_f16(s[j]);
    }
  }
}

#endif /* SLUICE_CONVERT_H_ */
