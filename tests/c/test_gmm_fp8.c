/*
 * gmm_fp8 / tgmm_fp8 CPU kernels against a float64 reference of the dequantized inputs, on random
 * sizes (K and M not multiples of 128, groups straddling the 128-row scale blocks, empty groups,
 * group_offset, batch), random e4m3 bytes (every finite value, subnormals included) and random
 * scales; the e4m3 decoding bit by bit; NaN inputs; bad descriptors and bad device values.
 * Runs under AddressSanitizer and UndefinedBehaviorSanitizer (see CMakeLists.txt). Every output is
 * poisoned (NaN) before each run, so an element the kernel forgets fails.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sluice.h"
#include "test_util.h"

enum { BLK = 128 };

/* e4m3fn decoded independently of the kernel's table: (-1)^s * 2^(e-7) * (1 + m/8), exponent 0
 * the subnormals 2^-6 * m/8, 0x7f / 0xff NaN. */
static double e4m3(uint8_t v) {
  const int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return NAN;
  const double mag = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}
static uint8_t rand_e4m3(void) { /* any finite value */
  uint8_t v;
  do v = (uint8_t)rng();
  while ((v & 0x7f) == 0x7f);
  return v;
}
static float rand_scale(void) { /* positive, 2^-10 .. 2^10 */
  return ldexpf(0.5f + 0.5f * (rand_float() + 1.0f) / 2.0f, rand_int(-10, 10));
}
static uint8_t *alloc_e4m3(size_t n) {
  uint8_t *p = malloc(n ? n : 1);
  for (size_t i = 0; i < n; ++i) p[i] = rand_e4m3();
  return p;
}
static float *alloc_scales(size_t n) {
  float *p = malloc(sizeof(float) * (n ? n : 1));
  for (size_t i = 0; i < n; ++i) p[i] = rand_scale();
  return p;
}
static double out_get(sl_dtype t, const void *p, size_t i) {
  return t == SL_DTYPE_F32 ? ((const float *)p)[i] : from_bf16(((const uint16_t *)p)[i]);
}
static size_t out_size(sl_dtype t) { return t == SL_DTYPE_F32 ? 4 : 2; }

/* Random group sizes summing to `total`, some groups empty. */
static void random_groups(int32_t *gs, int G, int total) {
  memset(gs, 0, sizeof(int32_t) * (size_t)G);
  for (int r = 0; r < total; ++r) {
    int g = rand_int(0, G - 1);
    if (G > 2 && (g % 3) == 1 && rand_int(0, 3) != 0) g = 0;
    gs[g]++;
  }
}

/* |out - ref| within the bound of f32 pieces and an f32 total: each piece's sum and each scaled
 * addition round once per term (at most 2^-24 of the running magnitude, bounded by `abs_sum`, the
 * sum of |products|), so error <= (terms + pieces + 2) 2^-24 abs_sum; plus bf16's rounding of the
 * result (2^-8 relative, nearest even). A NaN output fails. */
static int close_enough(sl_dtype t, double out, double ref, double abs_sum, int terms) {
  double tol = (terms + 8.0) * 0x1p-24 * abs_sum;
  if (t == SL_DTYPE_BF16) tol += 0x1p-8 * fabs(ref);
  return !isnan(out) && fabs(out - ref) <= tol;
}

static sl_gmm_desc fp8_desc(int batch, int M, int K, int N, int G, int GL, sl_dtype out, int t) {
  sl_gmm_desc d = sl_gmm_desc_default();
  d.batch = batch, d.m = M, d.k = K, d.n = N, d.num_groups = G, d.num_local_groups = GL;
  d.lhs_dtype = d.rhs_dtype = SL_DTYPE_F8E4M3;
  d.out_dtype = out;
  d.transpose_rhs = t;
  return d;
}

/* gmm_fp8: lhs [B][M][K], lhs_scale [B][M][nk]; rhs [B][GL][N][K], rhs_scale [B][GL][nn][nk]. */
static void test_gmm(const char *name, sl_dtype outt, int batch, int M, int K, int N, int G, int GL,
                     int used_rows) {
  const int nk = (K + BLK - 1) / BLK, nn = (N + BLK - 1) / BLK;
  sl_gmm_desc d = fp8_desc(batch, M, K, N, G, GL, outt, 1);
  int32_t *gs = malloc(sizeof(int32_t) * (size_t)(batch * G)),
          *off = malloc(sizeof(int32_t) * batch);
  for (int b = 0; b < batch; ++b)
    random_groups(gs + b * G, G, used_rows), off[b] = rand_int(0, G - GL);
  uint8_t *lhs = alloc_e4m3((size_t)batch * M * K), *rhs = alloc_e4m3((size_t)batch * GL * N * K);
  float *ls = alloc_scales((size_t)batch * M * nk),
        *rs = alloc_scales((size_t)batch * GL * nn * nk);
  const size_t n_out = (size_t)batch * M * N;
  void *out = malloc(out_size(outt) * (n_out ? n_out : 1));
  memset(out, 0xff, out_size(outt) * n_out);
  sl_status st = sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, off, out, 0);
  CHECK(st == SL_STATUS_SUCCESS, "%s gmm_fp8: %s %s", name, sl_status_string(st), sl_last_error());
  int bad = 0;
  for (int b = 0; b < batch && !bad; ++b) {
    int start = 0;
    for (int g = 0; g < G; ++g) { /* rows of local groups */
      const int size = gs[b * G + g], j = g - off[b];
      for (int r = start; r < start + size && j >= 0 && j < GL && !bad; ++r)
        for (int c = 0; c < N && !bad; ++c) {
          double ref = 0, abs_sum = 0;
          for (int k = 0; k < K; ++k) {
            const size_t li = ((size_t)b * M + r) * K + k,
                         ri = (((size_t)b * GL + j) * N + c) * K + k;
            const double p = e4m3(lhs[li]) * ls[((size_t)b * M + r) * nk + k / BLK] *
                             e4m3(rhs[ri]) *
                             rs[(((size_t)b * GL + j) * nn + c / BLK) * nk + k / BLK];
            ref += p, abs_sum += fabs(p);
          }
          const double o = out_get(outt, out, ((size_t)b * M + r) * N + c);
          if (!close_enough(outt, o, ref, abs_sum, BLK + nk)) {
            CHECK(0, "%s gmm_fp8 [%d][%d][%d]: %.9g vs %.9g (abs sum %.3g)", name, b, r, c, o, ref,
                  abs_sum);
            bad = 1;
          }
        }
      if (j < 0 || j >= GL) /* rows of other groups: zero */
        for (int r = start; r < start + size && !bad; ++r)
          for (int c = 0; c < N; ++c) bad |= out_get(outt, out, ((size_t)b * M + r) * N + c) != 0.0;
      start += size;
    }
    for (int r = start; r < M && !bad; ++r) /* rows past the groups: zero */
      for (int c = 0; c < N; ++c) bad |= out_get(outt, out, ((size_t)b * M + r) * N + c) != 0.0;
  }
  CHECK(!bad, "%s gmm_fp8: a wrong element (above) or a nonzero row outside the local groups",
        name);
  free(gs), free(off), free(lhs), free(rhs), free(ls), free(rs), free(out);
}

/* tgmm_fp8: lhs_t [B][K][M], lhs_scale [B][nm][K]; rhs_t [B][N][M], rhs_scale [B][nm][N]. */
static void test_tgmm(const char *name, sl_dtype outt, int batch, int M, int K, int N, int G,
                      int GL, int used_rows) {
  const int nm = (M + BLK - 1) / BLK;
  sl_gmm_desc d = fp8_desc(batch, M, K, N, G, GL, outt, 0);
  int32_t *gs = malloc(sizeof(int32_t) * (size_t)(batch * G)),
          *off = malloc(sizeof(int32_t) * batch);
  for (int b = 0; b < batch; ++b)
    random_groups(gs + b * G, G, used_rows), off[b] = rand_int(0, G - GL);
  uint8_t *lhs = alloc_e4m3((size_t)batch * K * M), *rhs = alloc_e4m3((size_t)batch * N * M);
  float *ls = alloc_scales((size_t)batch * nm * K), *rs = alloc_scales((size_t)batch * nm * N);
  const size_t n_out = (size_t)batch * GL * K * N;
  void *out = malloc(out_size(outt) * (n_out ? n_out : 1));
  memset(out, 0xff, out_size(outt) * n_out);
  sl_status st = sl_tgmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, off, out, 0);
  CHECK(st == SL_STATUS_SUCCESS, "%s tgmm_fp8: %s %s", name, sl_status_string(st), sl_last_error());
  int bad = 0;
  for (int b = 0; b < batch && !bad; ++b) {
    int start = 0;
    for (int g = 0; g < G; ++g) {
      const int size = gs[b * G + g], j = g - off[b];
      for (int k = 0; k < K && j >= 0 && j < GL && !bad; ++k)
        for (int c = 0; c < N && !bad; ++c) {
          double ref = 0, abs_sum = 0;
          for (int r = start; r < start + size; ++r) {
            const double p =
                e4m3(lhs[((size_t)b * K + k) * M + r]) * ls[((size_t)b * nm + r / BLK) * K + k] *
                e4m3(rhs[((size_t)b * N + c) * M + r]) * rs[((size_t)b * nm + r / BLK) * N + c];
            ref += p, abs_sum += fabs(p);
          }
          const double o = out_get(outt, out, (((size_t)b * GL + j) * K + k) * N + c);
          if (!close_enough(outt, o, ref, abs_sum, BLK + nm) || (size == 0 && o != 0.0)) {
            CHECK(0, "%s tgmm_fp8 [%d][%d][%d][%d] (group of %d rows from %d): %.9g vs %.9g", name,
                  b, j, k, c, size, start, o, ref);
            bad = 1;
          }
        }
      start += size;
    }
  }
  free(gs), free(off), free(lhs), free(rhs), free(ls), free(rs), free(out);
}

/* Every byte through gmm_fp8 with K = N = 1, rhs 1.0 (0x38) and unit scales, f32 out: out[r] is the
 * decoded byte r exactly (NaN for 0x7f and 0xff). */
static void test_decoding(void) {
  sl_gmm_desc d = fp8_desc(1, 256, 1, 1, 1, 1, SL_DTYPE_F32, 1);
  uint8_t lhs[256], rhs[1] = {0x38};
  float ls[256], rs[1] = {1.0f}, out[256];
  int32_t gs[1] = {256};
  for (int i = 0; i < 256; ++i) lhs[i] = (uint8_t)i, ls[i] = 1.0f;
  CHECK(sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, NULL, out, 1) == SL_STATUS_SUCCESS, "decode: %s",
        sl_last_error());
  int bad = 0;
  for (int i = 0; i < 256; ++i) {
    const double want = e4m3((uint8_t)i);
    if (isnan(want) ? !isnan(out[i]) : out[i] != want) {
      CHECK(0, "decode 0x%02x: %.9g, expected %.9g", i, out[i], want);
      bad = 1;
    }
  }
  CHECK(!bad && e4m3(0x7e) == 448.0 && e4m3(0x01) == 0x1p-9, "e4m3 table");
  CHECK(sl_dtype_size(SL_DTYPE_F8E4M3) == 1, "sl_dtype_size(F8E4M3)");
}

/* A NaN (e4m3 0x7f, or a NaN scale: what quantize gives a block holding inf or NaN) reaches the
 * outputs that contract over it and no others. */
static void test_nan(void) {
  enum { M = 40, K = 300, N = 20, G = 2 };
  const int nk = 3;
  sl_gmm_desc d = fp8_desc(1, M, K, N, G, G, SL_DTYPE_BF16, 1);
  int32_t gs[G] = {15, 20}; /* rows 35.. past the groups */
  uint8_t *lhs = alloc_e4m3(M * K), *rhs = alloc_e4m3(G * N * K);
  float *ls = alloc_scales(M * nk), *rs = alloc_scales(G * nk);
  uint16_t out[M * N];
  lhs[3 * K + 200] = 0x7f; /* row 3 of group 0 */
  rs[1 * nk + 0] = NAN;    /* group 1's scale block of K [0, 128) */
  lhs[37 * K + 5] = 0xff;  /* a row past the groups: never read */
  CHECK(sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, NULL, out, 0) == SL_STATUS_SUCCESS, "nan gmm: %s",
        sl_last_error());
  int bad = 0;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) {
      const int want_nan = r == 3 || (r >= 15 && r < 35);
      bad |= isnan(from_bf16(out[r * N + c])) != want_nan;
    }
  CHECK(!bad, "gmm_fp8: NaN in the wrong outputs");
  free(lhs), free(rhs), free(ls), free(rs);

  /* tgmm: a NaN in lhs_t[k = 2][row 130] (group 1) gives NaN in out[1][2][:] only */
  enum { TM = 200, TK = 4, TN = 6 };
  sl_gmm_desc t = fp8_desc(1, TM, TK, TN, 2, 2, SL_DTYPE_F32, 0);
  int32_t tgs[2] = {100, 90};
  uint8_t *tl = alloc_e4m3(TK * TM), *tr = alloc_e4m3(TN * TM);
  float *tls = alloc_scales(2 * TK), *trs = alloc_scales(2 * TN), tout[2 * TK * TN];
  tl[2 * TM + 130] = 0x7f;
  CHECK(sl_tgmm_fp8_cpu(&t, tl, tls, tr, trs, tgs, NULL, tout, 0) == SL_STATUS_SUCCESS,
        "nan tgmm: %s", sl_last_error());
  bad = 0;
  for (int i = 0; i < 2 * TK * TN; ++i) bad |= isnan(tout[i]) != (i / TN == 1 * TK + 2);
  CHECK(!bad, "tgmm_fp8: NaN in the wrong outputs");
  free(tl), free(tr), free(tls), free(trs);
}

typedef struct {
  sl_gmm_desc d;
  const char *msg; /* what the error message must hold */
} bad_desc;

static void test_bad_inputs(void) {
  uint8_t lhs[4 * 3] = {0}, rhs[2 * 5 * 3] = {0};
  float ls[4] = {1, 1, 1, 1}, rs[2] = {1, 1}, out[4 * 5];
  int32_t gs[2] = {2, 2}, off[1] = {0};
  sl_gmm_desc d = fp8_desc(1, 4, 3, 5, 2, 2, SL_DTYPE_F32, 1);
  CHECK(sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, off, out, 1) == SL_STATUS_SUCCESS,
        "valid call failed: %s", sl_last_error());

  /* device values: an error, and out not written */
  struct {
    int32_t gs[2], off;
    const char *msg;
  } cases[] = {{{-1, 3}, 0, "group_sizes[0] = -1 is negative"},
               {{3, 2}, 0, "sum(group_sizes) = 5 exceeds the 4 rows"},
               {{2, 2}, 1, "group_offset[0] = 1 is outside [0, 0]"}};
  for (int i = 0; i < 3; ++i) {
    memset(out, 0x5a, sizeof out);
    const sl_status st = sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, cases[i].gs, &cases[i].off, out, 1);
    CHECK(st == SL_STATUS_INVALID_VALUE && strstr(sl_last_error(), "gmm_fp8: ") &&
              strstr(sl_last_error(), cases[i].msg),
          "gmm_fp8 bad value %d: %s %s", i, sl_status_string(st), sl_last_error());
    int touched = 0;
    for (size_t k = 0; k < sizeof out; ++k) touched |= ((uint8_t *)out)[k] != 0x5a;
    CHECK(!touched, "gmm_fp8 wrote out on a bad value %d", i);
    sl_gmm_desc t = fp8_desc(1, 4, 3, 5, 2, 2, SL_DTYPE_F32, 0);
    CHECK(sl_tgmm_fp8_cpu(&t, lhs, ls, lhs, ls, cases[i].gs, &cases[i].off, out, 1) ==
                  SL_STATUS_INVALID_VALUE &&
              strstr(sl_last_error(), "tgmm_fp8: ") && strstr(sl_last_error(), cases[i].msg),
          "tgmm_fp8 bad value %d: %s", i, sl_last_error());
  }

  /* descriptors */
  bad_desc descs[8];
  int n = 0;
  descs[n] = (bad_desc){d, "lhs_dtype and rhs_dtype must be SL_DTYPE_F8E4M3"};
  descs[n++].d.lhs_dtype = SL_DTYPE_BF16;
  descs[n] = (bad_desc){d, "lhs_dtype and rhs_dtype must be SL_DTYPE_F8E4M3"};
  descs[n++].d.rhs_dtype = SL_DTYPE_F32;
  descs[n] = (bad_desc){d, "out_dtype must be SL_DTYPE_BF16"};
  descs[n++].d.out_dtype = SL_DTYPE_F16;
  descs[n] = (bad_desc){d, "transpose_rhs must be 1"};
  descs[n++].d.transpose_rhs = 0;
  descs[n] = (bad_desc){d, "num_local_groups (3) exceeds num_groups (2)"};
  descs[n++].d.num_local_groups = 3;
  descs[n] = (bad_desc){d, "struct_size"};
  descs[n++].d.struct_size = 8;
  descs[n] = (bad_desc){d, "sizes must be non-negative"};
  descs[n++].d.k = -1;
  descs[n] = (bad_desc){d, "must each fit in int32"};
  descs[n++].d.n = (int64_t)1 << 32;
  for (int i = 0; i < n; ++i) {
    const sl_status st = sl_gmm_fp8_cpu(&descs[i].d, lhs, ls, rhs, rs, gs, off, out, 1);
    CHECK(st == SL_STATUS_INVALID_ARGUMENT && strstr(sl_last_error(), "gmm_fp8: ") &&
              strstr(sl_last_error(), descs[i].msg),
          "desc %d: %s %s", i, sl_status_string(st), sl_last_error());
  }
  sl_gmm_desc t = fp8_desc(1, 4, 3, 5, 2, 2, SL_DTYPE_BF16, 1);
  CHECK(sl_tgmm_fp8_cpu(&t, lhs, ls, lhs, ls, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "tgmm_fp8: transpose_rhs must be 0"),
        "tgmm transpose: %s", sl_last_error());
  CHECK(sl_gmm_fp8_cpu(NULL, lhs, ls, rhs, rs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "gmm_fp8: desc is NULL"),
        "NULL desc: %s", sl_last_error());
  CHECK(sl_gmm_fp8_cpu(&d, lhs, NULL, rhs, rs, gs, off, out, 1) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "is NULL"),
        "NULL scale: %s", sl_last_error());
  CHECK(sl_gmm_fp8_cpu(&d, lhs, ls, rhs, rs, gs, off, NULL, 1) == SL_STATUS_INVALID_ARGUMENT,
        "NULL out");
  CHECK(sl_gmm_fp8_cuda(&d, lhs, ls, rhs, rs, gs, off, out, NULL, NULL) == SL_STATUS_UNSUPPORTED ||
            sl_has_cuda(),
        "cuda stub");
  CHECK(sl_tgmm_fp8_cuda(&t, lhs, ls, lhs, ls, gs, off, out, NULL, NULL) == SL_STATUS_UNSUPPORTED ||
            sl_has_cuda(),
        "cuda stub");
}

int main(void) {
  const sl_dtype outs[2] = {SL_DTYPE_F32, SL_DTYPE_BF16};
  test_decoding();
  /* fixed edge cases: one piece, several pieces with a short last one, empty, no local groups */
  test_gmm("one piece", SL_DTYPE_F32, 1, 37, 100, 23, 1, 1, 37);
  test_gmm("K=300", SL_DTYPE_BF16, 1, 70, 300, 130, 4, 4, 66);
  test_gmm("K=256 N=256", SL_DTYPE_F32, 1, 20, 256, 256, 3, 2, 20);
  test_gmm("K=0", SL_DTYPE_F32, 1, 9, 0, 8, 3, 3, 9);
  test_gmm("no rows", SL_DTYPE_BF16, 1, 16, 8, 8, 4, 4, 0);
  test_gmm("M=0", SL_DTYPE_F32, 1, 0, 8, 8, 3, 3, 0);
  test_gmm("no local groups", SL_DTYPE_F32, 1, 9, 5, 8, 3, 0, 9);
  test_gmm("batch", SL_DTYPE_BF16, 3, 41, 150, 29, 6, 4, 35);
  test_tgmm("blocks straddled", SL_DTYPE_F32, 1, 400, 30, 20, 5, 5, 390);
  test_tgmm("M=0", SL_DTYPE_BF16, 1, 0, 8, 8, 3, 3, 0);
  test_tgmm("K=0", SL_DTYPE_F32, 1, 20, 0, 8, 3, 3, 20);
  test_tgmm("wide", SL_DTYPE_BF16, 1, 150, 70, 140, 3, 2, 140);
  test_tgmm("batch", SL_DTYPE_F32, 2, 260, 9, 11, 7, 3, 200);
  for (int it = 0; it < 40; ++it) {
    const int M = rand_int(0, 300), K = rand_int(1, 300), N = rand_int(1, 150), G = rand_int(1, 10);
    const int GL = rand_int(0, G), B = rand_int(1, 2);
    const sl_dtype out = outs[rand_int(0, 1)];
    char name[96];
    snprintf(name, sizeof name, "random#%d B=%d M=%d K=%d N=%d G=%d GL=%d out=%d", it, B, M, K, N,
             G, GL, (int)out);
    if (it % 2)
      test_gmm(name, out, B, M / 2, K, N, G, GL, rand_int(0, M / 2));
    else
      test_tgmm(name, out, B, M, K / 4 + 1, N, G, GL, rand_int(0, M));
  }
  test_nan();
  test_bad_inputs();
  printf("test_gmm_fp8: %d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
