/*
 * gmm / tgmm CPU kernels against a naive float64 reference, on random sizes and random data.
 * Runs under AddressSanitizer and UndefinedBehaviorSanitizer (see CMakeLists.txt).
 * Every output is poisoned (NaN) before each run, so an element the kernel forgets fails.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sluice.h"
#include "test_util.h"
#include "vexp.h"

/* Storage helpers: values are generated in f32, rounded to the storage dtype, and the reference
 * reads the rounded values back so it sees exactly what the kernel sees (bf16 in test_util.h).
 * f16 for values in (-2, 2): normal range only, which is all the tests generate. */
static uint16_t to_f16(float f) {
  if (f == 0.0f) return 0;
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u < 0x38800000u) return sign; /* flush tiny values to zero: the test never relies on them */
  u += 0xfffu + ((u >> 13) & 1u);
  return sign | (uint16_t)((u - (112u << 23)) >> 13);
}
static float from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0 && man == 0) return sign ? -0.0f : 0.0f;
  uint32_t u = sign | ((exp + 112u) << 23) | (man << 13);
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static void put(sl_dtype t, void *p, size_t i, float v) { /* v rounded to t */
  if (t == SL_DTYPE_F32)
    ((float *)p)[i] = v;
  else
    ((uint16_t *)p)[i] = t == SL_DTYPE_BF16 ? to_bf16(v) : to_f16(v);
}
static void *alloc_random(sl_dtype t, size_t n) {
  void *p = malloc(sl_dtype_size(t) * (n ? n : 1));
  for (size_t i = 0; i < n; ++i) put(t, p, i, rand_float());
  return p;
}
static double get(sl_dtype t, const void *p, size_t i) {
  if (t == SL_DTYPE_F32) return ((const float *)p)[i];
  if (t == SL_DTYPE_BF16) return from_bf16(((const uint16_t *)p)[i]);
  return from_f16(((const uint16_t *)p)[i]);
}
static void poison(sl_dtype t, void *p, size_t n) {
  /* 0xFF.. is a NaN in f32, bf16 and f16 alike */
  memset(p, 0xFF, sl_dtype_size(t) * n);
}

/* Random group sizes summing to `total` (some groups empty). */
static void random_groups(int32_t *gs, int G, int total) {
  memset(gs, 0, sizeof(int32_t) * (size_t)G);
  for (int r = 0; r < total; ++r) {
    int g = rand_int(0, G - 1);
    if (G > 2 && (g % 3) == 1 && rand_int(0, 3) != 0) g = 0; /* leave some groups empty */
    gs[g]++;
  }
}

static double tolerance(sl_dtype in, sl_dtype out) {
  if (in == SL_DTYPE_F32 && out == SL_DTYPE_F32) return 1e-5;
  return 1e-2;
}

/* ||out - ref|| / ||ref|| over the whole output (ref all-zero: max abs error). NaN fails. */
static double rel_error(sl_dtype t, const void *out, const double *ref, size_t n, int *nan_seen) {
  double num = 0, den = 0;
  *nan_seen = 0;
  for (size_t i = 0; i < n; ++i) {
    double o = get(t, out, i);
    if (isnan(o)) *nan_seen = 1;
    num += (o - ref[i]) * (o - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void test_case(const char *name, sl_dtype in, sl_dtype outt, int batch, int M, int K, int N,
                      int G, int GL, int transpose, int used_rows) {
  sl_gmm_desc d = sl_gmm_desc_default();
  d.batch = batch;
  d.m = M, d.k = K, d.n = N, d.num_groups = G, d.num_local_groups = GL;
  d.lhs_dtype = d.rhs_dtype = in;
  d.out_dtype = outt;
  d.transpose_rhs = transpose;

  int32_t *gs = malloc(sizeof(int32_t) * (size_t)(batch * G));
  int32_t *off = malloc(sizeof(int32_t) * (size_t)batch);
  for (int b = 0; b < batch; ++b) {
    random_groups(gs + b * G, G, used_rows);
    off[b] = rand_int(0, G - GL);
  }
  void *lhs = alloc_random(in, (size_t)batch * M * K);
  void *rhs = alloc_random(in, (size_t)batch * GL * K * N);
  void *rhs_t = alloc_random(in, (size_t)batch * M * N); /* tgmm's rhs */

  /* ---- gmm ---- */
  size_t n_out = (size_t)batch * M * N;
  void *out = malloc(sl_dtype_size(outt) * (n_out ? n_out : 1));
  double *ref = calloc(n_out ? n_out : 1, sizeof(double));
  for (int b = 0; b < batch; ++b) {
    int start = 0;
    for (int g = 0; g < G; ++g) {
      int size = gs[b * G + g], j = g - off[b];
      if (j >= 0 && j < GL) {
        for (int r = start; r < start + size; ++r)
          for (int c = 0; c < N; ++c) {
            double acc = 0;
            for (int k = 0; k < K; ++k) {
              size_t ri = transpose ? (((size_t)b * GL + j) * N + c) * K + k
                                    : (((size_t)b * GL + j) * K + k) * N + c;
              acc += get(in, lhs, ((size_t)b * M + r) * K + k) * get(in, rhs, ri);
            }
            ref[((size_t)b * M + r) * N + c] = acc;
          }
      }
      start += size;
    }
  }
  poison(outt, out, n_out);
  sl_status st = sl_gmm_cpu(&d, lhs, rhs, gs, off, out, 0);
  CHECK(st == SL_STATUS_SUCCESS, "%s gmm: %s %s", name, sl_status_string(st), sl_last_error());
  int nan_seen;
  double err = rel_error(outt, out, ref, n_out, &nan_seen);
  CHECK(!nan_seen && err < tolerance(in, outt), "%s gmm: rel error %.3g nan=%d", name, err,
        nan_seen);

  /* ---- tgmm (no transpose) ---- */
  if (!transpose) {
    size_t n_t = (size_t)batch * GL * K * N;
    void *tout = malloc(sl_dtype_size(outt) * (n_t ? n_t : 1));
    double *tref = calloc(n_t ? n_t : 1, sizeof(double));
    for (int b = 0; b < batch; ++b) {
      int start = 0;
      for (int g = 0; g < G; ++g) {
        int size = gs[b * G + g], j = g - off[b];
        if (j >= 0 && j < GL)
          for (int k = 0; k < K; ++k)
            for (int c = 0; c < N; ++c) {
              double acc = 0;
              for (int r = start; r < start + size; ++r)
                acc += get(in, lhs, ((size_t)b * M + r) * K + k) *
                       get(in, rhs_t, ((size_t)b * M + r) * N + c);
              tref[(((size_t)b * GL + j) * K + k) * N + c] = acc;
            }
        start += size;
      }
    }
    poison(outt, tout, n_t);
    st = sl_tgmm_cpu(&d, lhs, rhs_t, gs, off, tout, 0);
    CHECK(st == SL_STATUS_SUCCESS, "%s tgmm: %s %s", name, sl_status_string(st), sl_last_error());
    err = rel_error(outt, tout, tref, n_t, &nan_seen);
    CHECK(!nan_seen && err < tolerance(in, outt), "%s tgmm: rel error %.3g nan=%d", name, err,
          nan_seen);
    free(tout);
    free(tref);
  }
  free(gs), free(off), free(lhs), free(rhs), free(rhs_t), free(out), free(ref);
}

static void test_bad_inputs(void) {
  float lhs[4 * 3] = {0}, rhs[2 * 3 * 5] = {0}, out[4 * 5];
  int32_t gs[2] = {2, 2}, off[1] = {0};
  sl_gmm_desc d = sl_gmm_desc_default();
  d.m = 4, d.k = 3, d.n = 5, d.num_groups = 2, d.num_local_groups = 2;
  d.lhs_dtype = d.rhs_dtype = d.out_dtype = SL_DTYPE_F32;

  CHECK(sl_gmm_cpu(&d, lhs, rhs, gs, off, out, 1) == SL_STATUS_SUCCESS, "valid call failed: %s",
        sl_last_error());

  int32_t neg[2] = {-1, 3};
  CHECK(sl_gmm_cpu(&d, lhs, rhs, neg, off, out, 1) == SL_STATUS_INVALID_VALUE &&
            strstr(sl_last_error(), "group_sizes[0] = -1 is negative"),
        "negative size: %s", sl_last_error());
  int32_t big[2] = {3, 2};
  CHECK(sl_gmm_cpu(&d, lhs, rhs, big, off, out, 1) == SL_STATUS_INVALID_VALUE &&
            strstr(sl_last_error(), "sum(group_sizes) = 5 exceeds the 4 rows"),
        "too large: %s", sl_last_error());
  int32_t bad_off[1] = {1};
  CHECK(sl_tgmm_cpu(&d, lhs, lhs, gs, bad_off, out, 1) == SL_STATUS_INVALID_ARGUMENT ||
            sl_tgmm_cpu(&d, lhs, lhs, gs, bad_off, out, 1) == SL_STATUS_INVALID_VALUE,
        "bad offset: %s", sl_last_error());
  CHECK(sl_gmm_cpu(&d, lhs, rhs, gs, bad_off, out, 1) == SL_STATUS_INVALID_VALUE &&
            strstr(sl_last_error(), "group_offset"),
        "bad offset: %s", sl_last_error());

  sl_gmm_desc e = d;
  e.rhs_dtype = SL_DTYPE_BF16;
  CHECK(sl_gmm_cpu(&e, lhs, rhs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "differs"),
        "mixed dtypes: %s", sl_last_error());
  e = d;
  e.out_dtype = SL_DTYPE_I32;
  CHECK(sl_gmm_cpu(&e, lhs, rhs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT,
        "int output accepted");
  e = d;
  e.num_local_groups = 3;
  CHECK(sl_gmm_cpu(&e, lhs, rhs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "num_local_groups"),
        "G_local > G: %s", sl_last_error());
  e = d;
  e.struct_size = 8;
  CHECK(sl_gmm_cpu(&e, lhs, rhs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "struct_size"),
        "struct_size: %s", sl_last_error());
  CHECK(sl_gmm_cpu(NULL, lhs, rhs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT, "NULL desc");
  CHECK(sl_gmm_cpu(&d, lhs, rhs, gs, off, NULL, 1) == SL_STATUS_INVALID_ARGUMENT, "NULL out");
  e = d;
  e.transpose_rhs = 1;
  CHECK(sl_tgmm_cpu(&e, lhs, lhs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT, "tgmm transpose");
  CHECK(strcmp(sl_status_string(SL_STATUS_TIMEOUT), "SL_STATUS_TIMEOUT") == 0, "status string");
  CHECK(
      sl_gmm_cuda(&d, lhs, rhs, gs, off, out, NULL, NULL) == SL_STATUS_UNSUPPORTED || sl_has_cuda(),
      "cuda stub");
}

/* sl_vexpf (vexp.h: the CPU swiglu's exp) against exp in double: within 1.5 ulp of the exact value
 * (so within 2 ulp of expf, itself within 0.5) on a dense sweep of [-88, 88] and on random bit
 * patterns (tiny, subnormal and huge values, infinities and NaN), inf = 2^128 when measuring; the
 * sigmoid swiglu builds of it at the extremes. */
static double ulp_f32(double e) { /* the f32 spacing at e >= 0 */
  int ex;
  if (e < 0x1p-126) return 0x1p-149;
  frexp(e, &ex);
  return ldexp(1.0, ex - 24);
}
static void test_vexp(void) {
  const int n = 1000000;
  double worst = 0.0;
  float worst_x = 0.0f;
  for (int i = 0; i <= 2 * n; ++i) {
    float x = -88.0f + 176.0f * (float)((double)i / n);
    if (i > n) {
      const uint32_t bits = (uint32_t)rng();
      memcpy(&x, &bits, 4);
    }
    const float y = sl_vexpf(x);
    const double e = exp((double)x), yd = isinf(y) ? 0x1p128 : (double)y;
    if (isnan(x) || e >= 0x1p128) { /* past FLT_MAX + ulp/2 (2^128 - 2^103): inf */
      CHECK(isnan(x) ? isnan(y) : y == INFINITY, "vexp(%g) = %g", x, y);
      continue;
    }
    const double err = isnan(y) ? INFINITY : fabs(yd - e) / ulp_f32(e);
    if (err > worst) worst = err, worst_x = x;
  }
  CHECK(worst <= 1.5, "vexp: %g ulp from exp at x = %.9g", worst, worst_x);
  printf("test_gmm: vexp within %.3f ulp of exp\n", worst);
  const float gs[6] = {-INFINITY, -1000.0f, -90.0f, 90.0f, 1000.0f, INFINITY},
              want[6] = {0, 0, 0, 1, 1, 1};
  for (int i = 0; i < 6; ++i) {
    const float s = 1.0f / (1.0f + sl_vexpf(-gs[i]));
    CHECK(s == want[i], "sigmoid(%g) = %g", gs[i], s);
  }
  CHECK(isnan(1.0f / (1.0f + sl_vexpf(-NAN))), "sigmoid(NaN)");
  CHECK(sl_vexpf(0.0f) == 1.0f && sl_vexpf(-0.0f) == 1.0f && sl_vexpf(-104.5f) == 0.0f,
        "vexp(0), vexp(-0), vexp(-104.5)");
}

/* swiglu in f32, bf16 and f16 against the formula in double on the rounded inputs, unweighted and
 * with row weights (then also their gradient), some rows longer than the kernel's chunk of columns:
 * the groups' rows computed, the rest zero whatever skip_unused_rows says (the CPU zeroes them),
 * outputs poisoned first; and its errors. */
static void test_swiglu(void) {
  const sl_dtype types[3] = {SL_DTYPE_F32, SL_DTYPE_BF16, SL_DTYPE_F16};
  for (int it = 0; it < 60; ++it) {
    sl_swiglu_desc d = sl_swiglu_desc_default();
    d.rows = rand_int(0, 40), d.ff = it % 4 == 3 ? rand_int(500, 1100) : rand_int(0, 13);
    d.num_groups = rand_int(1, 5), d.skip_unused_rows = it % 2, d.dtype = types[it % 3];
    const int weighted = (it / 2) % 2;
    const sl_dtype t = d.dtype;
    const double tol = t == SL_DTYPE_F32 ? 1e-5 : t == SL_DTYPE_BF16 ? 4e-3 : 1e-3;
    const int64_t M = d.rows, F = d.ff;
    int32_t gs[5];
    int64_t used = 0;
    for (int g = 0; g < d.num_groups; ++g) {
      gs[g] = used < M ? rand_int(0, (int)(M - used)) : 0;
      used += gs[g];
    }
    const size_t es = sl_dtype_size(t);
    void *h = malloc(es * (size_t)(2 * M * F + 1)), *da = malloc(es * (size_t)(M * F + 1)),
         *act = malloc(es * (size_t)(M * F + 1)), *dh = malloc(es * (size_t)(2 * M * F + 1));
    float *w = malloc(sizeof(float) * (size_t)(M + 1)),
          *dw = malloc(sizeof(float) * (size_t)(M + 1));
    for (int64_t i = 0; i < 2 * M * F; ++i) put(t, h, (size_t)i, 4.0f * rand_float());
    for (int64_t i = 0; i < M * F; ++i) put(t, da, (size_t)i, rand_float());
    for (int64_t r = 0; r < M; ++r) w[r] = rand_float(), dw[r] = NAN;
    poison(t, act, (size_t)(M * F)), poison(t, dh, (size_t)(2 * M * F));
    const float *wp = weighted ? w : NULL;
    CHECK(sl_swiglu_fwd_cpu(&d, h, wp, gs, act) == SL_STATUS_SUCCESS, "swiglu: %s",
          sl_last_error());
    CHECK(sl_swiglu_bwd_cpu(&d, da, h, wp, gs, dh, weighted ? dw : NULL) == SL_STATUS_SUCCESS,
          "swiglu_bwd: %s", sl_last_error());
    int bad = 0; /* one failure reported per case, not one per element */
    for (int64_t r = 0; r < M; ++r) {
      const double wr = weighted ? w[r] : 1.0, on = r < used;
      double wdw = 0.0;
      for (int64_t j = 0; j < F; ++j) {
        const size_t ig = (size_t)(r * 2 * F + j), iu = ig + (size_t)F, ia = (size_t)(r * F + j);
        const double g = get(t, h, ig), u = get(t, h, iu), a = get(t, da, ia);
        const double s = 1.0 / (1.0 + exp(-g));
        const double want = on * g * s * u * wr, wdg = on * a * wr * u * s * (1.0 + g * (1.0 - s)),
                     wdu = on * a * wr * g * s, o = get(t, act, ia), odg = get(t, dh, ig),
                     odu = get(t, dh, iu);
        wdw += on * a * g * s * u;
        if (!bad && !(fabs(o - want) <= tol * (1.0 + fabs(want)) &&
                      fabs(odg - wdg) <= tol * (1.0 + fabs(wdg)) &&
                      fabs(odu - wdu) <= tol * (1.0 + fabs(wdu)))) {
          CHECK(0,
                "swiglu dtype %d [%lld,%lld] of [%lld,%lld]: act %g vs %g, dgate %g vs %g, dup %g "
                "vs %g",
                (int)t, (long long)r, (long long)j, (long long)M, (long long)F, o, want, odg, wdg,
                odu, wdu);
          bad = 1;
        }
      }
      if (weighted)
        CHECK(fabs(dw[r] - wdw) <= 1e-5 * (1.0 + fabs(wdw)) * (1.0 + (double)F),
              "swiglu_bwd drow_weights[%lld]: %g vs %g", (long long)r, dw[r], wdw);
    }
    free(h), free(da), free(act), free(dh), free(w), free(dw);
  }
  /* Every bf16 and f16 bit pattern as up, gate 32 (silu(32) = 32 in f32) and row weight 1/32: act
   * = up exactly (but bf16 up >= 2^123: 32 up is inf), so this checks the kernel's conversions
   * (subnormals, infinities, NaN) bit by bit. */
  for (int k = 1; k < 3; ++k) {
    sl_swiglu_desc d = sl_swiglu_desc_default();
    d.rows = 256, d.ff = 256, d.dtype = types[k];
    uint16_t *h = malloc(sizeof(uint16_t) * 2 * 65536), *act = malloc(sizeof(uint16_t) * 65536);
    float *w = malloc(sizeof(float) * 256);
    for (int i = 0; i < 65536; ++i) {
      put(d.dtype, h, (size_t)(i / 256 * 512 + i % 256), 32.0f);
      h[i / 256 * 512 + 256 + i % 256] = (uint16_t)i;
    }
    for (int r = 0; r < 256; ++r) w[r] = 1.0f / 32.0f;
    int32_t all = 256, bad = 0;
    poison(d.dtype, act, 65536);
    CHECK(sl_swiglu_fwd_cpu(&d, h, w, &all, act) == SL_STATUS_SUCCESS, "swiglu: %s",
          sl_last_error());
    for (int i = 0; i < 65536; ++i) {
      const int nan = k == 1 ? (i & 0x7fff) > 0x7f80 : (i & 0x7fff) > 0x7c00;
      const int nan_out = k == 1 ? (act[i] & 0x7fff) > 0x7f80 : (act[i] & 0x7fff) > 0x7c00;
      const int big = k == 1 && (i & 0x7f80) >= 250 << 7; /* 32 up overflows to inf */
      if (nan ? !nan_out : act[i] != (big ? (i & 0x8000) | 0x7f80 : i)) bad++;
    }
    CHECK(bad == 0, "swiglu dtype %d: %d of the 65536 patterns changed", (int)d.dtype, bad);
    free(h), free(act), free(w);
  }
  sl_swiglu_desc d = sl_swiglu_desc_default();
  d.rows = 4, d.ff = 2, d.num_groups = 2;
  float h[16] = {0}, act[8], dh[16], w[4] = {1, 1, 1, 1};
  int32_t neg[2] = {3, -1}, over[2] = {3, 2}, ok[2] = {1, 2};
  CHECK(sl_swiglu_fwd_cpu(&d, h, NULL, neg, act) == SL_STATUS_INVALID_VALUE,
        "swiglu negative size");
  CHECK(strstr(sl_last_error(), "group_sizes[1] = -1") != NULL, "message: %s", sl_last_error());
  CHECK(sl_swiglu_bwd_cpu(&d, act, h, NULL, over, dh, NULL) == SL_STATUS_INVALID_VALUE,
        "swiglu sum > M");
  CHECK(sl_swiglu_fwd_cpu(&d, h, NULL, NULL, act) == SL_STATUS_INVALID_ARGUMENT,
        "swiglu NULL sizes");
  CHECK(sl_swiglu_bwd_cpu(&d, act, h, w, ok, dh, NULL) == SL_STATUS_INVALID_ARGUMENT,
        "swiglu weights without their gradient");
  CHECK(strstr(sl_last_error(), "drow_weights") != NULL, "message: %s", sl_last_error());
  d.struct_size = 8;
  CHECK(sl_swiglu_fwd_cpu(&d, h, NULL, ok, act) == SL_STATUS_INVALID_ARGUMENT,
        "swiglu struct_size");
  d = sl_swiglu_desc_default();
  d.rows = 4, d.ff = 2, d.num_groups = 2, d.dtype = SL_DTYPE_I32;
  CHECK(sl_swiglu_fwd_cpu(&d, h, NULL, ok, act) == SL_STATUS_INVALID_ARGUMENT, "swiglu i32");
}

int main(void) {
  const sl_dtype types[3] = {SL_DTYPE_F32, SL_DTYPE_BF16, SL_DTYPE_F16};
  /* fixed edge cases */
  test_case("G=1", SL_DTYPE_F32, SL_DTYPE_F32, 1, 37, 19, 23, 1, 1, 0, 37);
  test_case("G=1 partial", SL_DTYPE_F32, SL_DTYPE_F32, 1, 37, 19, 23, 1, 1, 1, 20);
  test_case("no rows used", SL_DTYPE_BF16, SL_DTYPE_F32, 1, 16, 8, 8, 4, 4, 0, 0);
  test_case("M=0", SL_DTYPE_F32, SL_DTYPE_F32, 1, 0, 8, 8, 3, 3, 0, 0);
  test_case("K=0", SL_DTYPE_F32, SL_DTYPE_F32, 1, 9, 0, 8, 3, 3, 0, 9);
  test_case("no local groups", SL_DTYPE_F32, SL_DTYPE_F32, 1, 9, 5, 8, 3, 0, 0, 9);
  test_case("one-row groups", SL_DTYPE_F32, SL_DTYPE_F32, 1, 8, 33, 130, 8, 8, 0, 8);
  test_case("big tiles", SL_DTYPE_BF16, SL_DTYPE_BF16, 1, 300, 530, 270, 5, 3, 0, 290);
  test_case("big tiles T", SL_DTYPE_F16, SL_DTYPE_F32, 1, 300, 530, 270, 5, 5, 1, 300);
  test_case("batch", SL_DTYPE_F32, SL_DTYPE_BF16, 3, 41, 17, 29, 6, 4, 0, 35);
  /* random */
  for (int it = 0; it < 60; ++it) {
    int M = rand_int(0, 150), K = rand_int(1, 140), N = rand_int(1, 150), G = rand_int(1, 12);
    int GL = rand_int(0, G);
    sl_dtype in = types[rand_int(0, 2)], out = types[rand_int(0, 2)];
    char name[96];
    snprintf(name, sizeof name, "random#%d M=%d K=%d N=%d G=%d GL=%d in=%d out=%d", it, M, K, N, G,
             GL, (int)in, (int)out);
    test_case(name, in, out, rand_int(1, 2), M, K, N, G, GL, rand_int(0, 1), rand_int(0, M));
  }
  test_bad_inputs();
  test_vexp();
  test_swiglu();
  printf("test_gmm: %d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
