/* A vectorisable f32 exp for the CPU kernels: branch-free and libm-free, so a loop that calls it
 * vectorises (expf does not); within 1 ulp of exp, 2 of expf (tests/c/test_gmm.c sweeps it). */
#ifndef SLUICE_VEXP_H_
#define SLUICE_VEXP_H_

#include <math.h>
#include <stdint.h>

#include "convert.h"

/* e^x = 2^n e^r, n = round(x / ln2), |r| <= ln2/2, e^r = 1 + r + r^2 P(r) (Cephes' expf
 * polynomial). n comes from the bits of x / ln2 + 1.5 * 2^23, not a float -> int conversion (UB
 * for NaN or huge x), and 2^n is applied as two normal powers of two, so a subnormal or overflowing
 * result is rounded once, as expf's is. Past [-104, 89] (n garbage there) the result is 0 or inf,
 * chosen at the end, where comparisons leave NaN to the arithmetic, which keeps it NaN. */
static inline float sl_vexpf(float x) {
  const float shift = 0x1.8p23f, t = x * 1.44269504088896341f + shift, n = t - shift;
  /* n in two halves */
  const int32_t k = (int32_t)(sl_f32_bits(t) - 0x4b400000u), k1 = k >> 1, k2 = k - k1;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* Cody-Waite ln2: n hi exact */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = (p * (r * r) + r) + 1.0f;
  const float y =
      er * sl_bits_f32((uint32_t)(k1 + 127) << 23) * sl_bits_f32((uint32_t)(k2 + 127) << 23);
  return x < -104.0f ? 0.0f : x > 89.0f ? INFINITY : y;
}

#endif /* SLUICE_VEXP_H_ */
