/* GPU tests of sl_gmm_fp8_cuda / sl_tgmm_fp8_cuda against a float64 reference of the dequantized
 * operands, and their speed beside the BF16 kernels on the same problems.
 *
 *   tests/gpu/run.sh runs it plain, under compute-sanitizer (--quick) and on 3 SMs.
 *   ./test_gmm_fp8 [--quick] [--sms N] [--bench [--f32]] [--no-test]
 *
 * Every case draws fresh random e4m3 operands (every finite value, NaN excluded) and f32 scales,
 * poisons the output with 0xFF bytes (NaN in bf16 and f32) so unwritten elements fail, and checks
 * ||out - ref|| / ||ref|| (< 1e-2 for a bf16 output, < 2e-3 for f32: the FP8 wgmma's own
 * accumulation inside a 128-long block is shorter than f32's), every element finite, and gmm's rows
 * outside the local groups exactly zero. The cases cover both tile widths (N <= 128 and wider),
 * both output types (tgmm's f32 on wide tiles is staged for TMA stores, elsewhere stored from
 * registers), ragged N, K not a multiple of 128, ragged group edges inside a tile and across tgmm's 128-row
 * scale blocks, empty groups, group_offset, skip_unused_rows and batch.
 *
 * --bench times gmm_fp8 and the BF16 gmm (sl_gmm_cuda) on DeepSeek-V3 expert shapes and DeepGEMM's
 * published grouped shapes, and tgmm_fp8 against the BF16 tgmm, in TFLOP/s (calls queued back to
 * back, CUDA events, median of 5 runs of 10 calls); bf16 outputs, or f32 with --f32. */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <vector>

#include "../../csrc/cuda/gmm_common.cuh"
#include "cuda_ok.h"
#include "sluice.h"

static std::mt19937_64 rng(4321);

static double e4m3(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}
static uint8_t rand_e4m3() {
  for (;;) {
    const uint8_t b = (uint8_t)(rng() & 0xFF);
    if ((b & 0x7F) != 0x7F) return b;
  }
}
static float rand_scale() {
  std::uniform_real_distribution<float> u(-12.f, -4.f);
  return ldexpf(1.f + (float)(rng() % 1000) / 1000.f, (int)u(rng));
}
static double out_at(const std::vector<uint8_t> &o, size_t i, sl_dtype t) {
  if (t == SL_DTYPE_F32) return ((const float *)o.data())[i];
  uint16_t u = ((const uint16_t *)o.data())[i];
  uint32_t w = (uint32_t)u << 16;
  float f;
  memcpy(&f, &w, 4);
  return f;
}

struct Case {
  const char *name;
  int tgmm, m, k, n, g, gl, off, batch;
  std::vector<int> sizes; /* per batch element, concatenated; empty: random */
  sl_dtype out;
  int skip;
};

static int failures = 0, passed = 0;

static void *dev_copy(const void *p, size_t bytes) {
  void *d = nullptr;
  CUDA_OK(cudaMalloc(&d, bytes ? bytes : 1));
  if (bytes) CUDA_OK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
  return d;
}

static void run_case(const Case &c) {
  const int B = c.batch, M = c.m, K = c.k, N = c.n, G = c.g, GL = c.gl;
  const int MB = (M + 127) / 128, KB = (K + 127) / 128, NB = (N + 127) / 128;
  std::vector<int> sizes = c.sizes;
  if (sizes.empty()) {
    for (int b = 0; b < B; ++b) {
      std::vector<int> cut(G - 1);
      const int used = M - (int)(rng() % (M / 8 + 1));
      for (auto &x : cut) x = (int)(rng() % (used + 1));
      std::sort(cut.begin(), cut.end());
      int prev = 0;
      for (int g = 0; g < G - 1; ++g) sizes.push_back(cut[g] - prev), prev = cut[g];
      sizes.push_back(used - prev);
    }
  }
  const size_t lhs_n = (size_t)M * K, rhs_n = c.tgmm ? (size_t)M * N : (size_t)GL * N * K;
  const size_t ls_n = c.tgmm ? (size_t)MB * K : (size_t)M * KB;
  const size_t rs_n = c.tgmm ? (size_t)MB * N : (size_t)GL * NB * KB;
  const size_t out_n = c.tgmm ? (size_t)GL * K * N : (size_t)M * N;
  const size_t es = c.out == SL_DTYPE_F32 ? 4 : 2;
  std::vector<uint8_t> lhs(B * lhs_n), rhs(B * rhs_n), out(B * out_n * es, 0xFF);
  std::vector<float> ls(B * ls_n), rs(B * rs_n);
  for (auto &x : lhs) x = rand_e4m3();
  for (auto &x : rhs) x = rand_e4m3();
  for (auto &x : ls) x = rand_scale();
  for (auto &x : rs) x = rand_scale();
  std::vector<int32_t> offs(B, c.off);
  void *dl = dev_copy(lhs.data(), lhs.size()), *dr = dev_copy(rhs.data(), rhs.size());
  void *dls = dev_copy(ls.data(), ls.size() * 4), *drs = dev_copy(rs.data(), rs.size() * 4);
  void *dgs = dev_copy(sizes.data(), sizes.size() * 4), *doff = dev_copy(offs.data(), B * 4);
  void *dout = dev_copy(out.data(), out.size());
  sl_gmm_desc d = sl_gmm_desc_default();
  d.batch = B, d.m = M, d.k = K, d.n = N, d.num_groups = G, d.num_local_groups = GL;
  d.lhs_dtype = d.rhs_dtype = SL_DTYPE_F8E4M3, d.out_dtype = c.out;
  d.transpose_rhs = !c.tgmm, d.skip_unused_rows = c.skip;
  void *ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, sl_gmm_cuda_workspace_size(&d)));
  const sl_status st =
      c.tgmm ? sl_tgmm_fp8_cuda(&d, dl, (const float *)dls, dr, (const float *)drs,
                                (const int32_t *)dgs, (const int32_t *)doff, dout, ws, 0)
             : sl_gmm_fp8_cuda(&d, dl, (const float *)dls, dr, (const float *)drs,
                               (const int32_t *)dgs, (const int32_t *)doff, dout, ws, 0);
  CUDA_OK(cudaDeviceSynchronize());
  if (st != SL_STATUS_SUCCESS) {
    printf("FAIL %s: status %s: %s\n", c.name, sl_status_string(st), sl_last_error());
    ++failures;
    return;
  }
  CUDA_OK(cudaMemcpy(out.data(), dout, out.size(), cudaMemcpyDeviceToHost));
  double err2 = 0, ref2 = 0;
  long bad_zero = 0, nonfinite = 0;
  for (int b = 0; b < B; ++b) {
    const uint8_t *L = lhs.data() + b * lhs_n, *R = rhs.data() + b * rhs_n;
    const float *LS = ls.data() + b * ls_n, *RS = rs.data() + b * rs_n;
    const int *sz = sizes.data() + (size_t)b * G;
    std::vector<long> start(G + 1, 0);
    for (int g = 0; g < G; ++g) start[g + 1] = start[g] + sz[g];
    std::vector<double> ref(out_n, 0.0);
    std::vector<char> inside(c.tgmm ? 0 : M, 0);
    /* the operands dequantized in float64 (as stored: gmm lhs [M, K], rhs [GL, N, K]; tgmm
     * lhs_t [K, M], rhs_t [N, M]) */
    std::vector<double> A(lhs_n), W(rhs_n);
    for (size_t i = 0; i < lhs_n; ++i) {
      const size_t r = c.tgmm ? i % M : i / K, k = c.tgmm ? i / M : i % K;
      A[i] = e4m3(L[i]) * (double)(c.tgmm ? LS[(r / 128) * K + k] : LS[r * KB + k / 128]);
    }
    for (size_t i = 0; i < rhs_n; ++i) {
      if (c.tgmm) {
        const size_t r = i % M, n = i / M;
        W[i] = e4m3(R[i]) * (double)RS[(r / 128) * N + n];
      } else {
        const size_t k = i % K, jn = i / K, n = jn % N, j = jn / N;
        W[i] = e4m3(R[i]) * (double)RS[(j * NB + n / 128) * KB + k / 128];
      }
    }
    for (int j = 0; j < GL; ++j) {
      const int g = c.off + j;
      for (long r = start[g]; r < start[g + 1]; ++r) {
        if (!c.tgmm) {
          inside[r] = 1;
          for (int n = 0; n < N; ++n) {
            const double *a = &A[(size_t)r * K], *w = &W[((size_t)j * N + n) * K];
            double acc = 0;
            for (int k = 0; k < K; ++k) acc += a[k] * w[k];
            ref[(size_t)r * N + n] = acc;
          }
        } else {
          for (int k = 0; k < K; ++k) {
            const double a = A[(size_t)k * M + r];
            double *o = &ref[((size_t)j * K + k) * N];
            for (int n = 0; n < N; ++n) o[n] += a * W[(size_t)n * M + r];
          }
        }
      }
    }
    for (size_t i = 0; i < out_n; ++i) {
      const double v = out_at(out, b * out_n + i, c.out);
      if (!c.tgmm && !inside[i / N]) {
        if (!c.skip && v != 0.0) ++bad_zero;
        continue;
      }
      if (!std::isfinite(v)) ++nonfinite;
      err2 += (v - ref[i]) * (v - ref[i]);
      ref2 += ref[i] * ref[i];
    }
  }
  const double rel = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
  const double tol = c.out == SL_DTYPE_F32 ? 2e-3 : 1e-2;
  const bool ok = rel < tol && bad_zero == 0 && nonfinite == 0;
  printf("%s %s: rel %.2e, nonzero outside %ld, non-finite %ld\n", ok ? "ok  " : "FAIL", c.name,
         rel, bad_zero, nonfinite);
  ok ? ++passed : ++failures;
  for (void *p : {dl, dr, dls, drs, dgs, doff, dout, ws}) cudaFree(p);
}

/* Times `calls` back-to-back calls of f (after a warm-up), median of 5 runs, in ms per call. */
template <class F>
static double time_ms(F f, int calls = 10) {
  f();
  CUDA_OK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> ms;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0);
    for (int i = 0; i < calls; ++i) f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float t;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t / calls);
  }
  std::sort(ms.begin(), ms.end());
  return ms[2];
}

static bool bench_f32 = false; /* --f32: outputs in f32 (an MoE layer's float32 weight gradients) */

static void bench(const char *name, int tgmm, int G, int rows, int K, int N, bool skew) {
  std::vector<int> sizes(G, rows);
  if (skew)
    for (int g = 0; g < G; ++g) sizes[g] = (int)(rows * (0.5 + (double)(rng() % 1000) / 1000.0));
  long M = 0;
  for (int s : sizes) M += s;
  const long Mp = (M + 127) / 128 * 128;
  const int KB = (K + 127) / 128, NB = (N + 127) / 128, MB = (int)(Mp / 128);
  sl_gmm_desc d = sl_gmm_desc_default();
  d.m = Mp, d.k = K, d.n = N, d.num_groups = G, d.num_local_groups = G;
  d.out_dtype = bench_f32 ? SL_DTYPE_F32 : SL_DTYPE_BF16;
  void *lhs, *rhs, *ls, *rs, *out, *gs, *ws, *lhs16, *rhs16;
  CUDA_OK(cudaMalloc(&lhs, (size_t)Mp * K));
  CUDA_OK(cudaMalloc(&rhs, tgmm ? (size_t)Mp * N : (size_t)G * N * K));
  CUDA_OK(cudaMalloc(&lhs16, (size_t)Mp * K * 2));
  CUDA_OK(cudaMalloc(&rhs16, tgmm ? (size_t)Mp * N * 2 : (size_t)G * N * K * 2));
  CUDA_OK(cudaMalloc(&ls, (size_t)Mp * KB * 4 + (size_t)MB * K * 4));
  CUDA_OK(cudaMalloc(&rs, (size_t)G * NB * KB * 4 + (size_t)MB * N * 4));
  CUDA_OK(cudaMalloc(&out, tgmm ? (size_t)G * K * N * 4 : (size_t)Mp * N * 4));
  CUDA_OK(cudaMemset(lhs, 0x38, (size_t)Mp * K)); /* 1.0 in e4m3 */
  CUDA_OK(cudaMemset(rhs, 0x38, tgmm ? (size_t)Mp * N : (size_t)G * N * K));
  CUDA_OK(cudaMemset(lhs16, 0x3F, (size_t)Mp * K * 2));
  CUDA_OK(cudaMemset(rhs16, 0x3F, tgmm ? (size_t)Mp * N * 2 : (size_t)G * N * K * 2));
  CUDA_OK(cudaMemset(ls, 0, (size_t)Mp * KB * 4 + (size_t)MB * K * 4));
  CUDA_OK(cudaMemset(rs, 0, (size_t)G * NB * KB * 4 + (size_t)MB * N * 4));
  gs = dev_copy(sizes.data(), G * 4);
  d.lhs_dtype = d.rhs_dtype = SL_DTYPE_F8E4M3;
  d.transpose_rhs = !tgmm;
  CUDA_OK(cudaMalloc(&ws, sl_gmm_cuda_workspace_size(&d)));
  sl_gmm_desc d16 = d;
  d16.lhs_dtype = d16.rhs_dtype = SL_DTYPE_BF16;
  d16.transpose_rhs = 0;
  const double ms8 = time_ms([&] {
    sl_status st = tgmm ? sl_tgmm_fp8_cuda(&d, lhs, (float *)ls, rhs, (float *)rs,
                                           (int32_t *)gs, nullptr, out, ws, 0)
                        : sl_gmm_fp8_cuda(&d, lhs, (float *)ls, rhs, (float *)rs, (int32_t *)gs,
                                          nullptr, out, ws, 0);
    if (st) printf("bench %s: %s\n", name, sl_last_error());
  });
  const double ms16 = time_ms([&] {
    sl_status st = tgmm ? sl_tgmm_cuda(&d16, lhs16, rhs16, (int32_t *)gs, nullptr, out, ws, 0)
                        : sl_gmm_cuda(&d16, lhs16, rhs16, (int32_t *)gs, nullptr, out, ws, 0);
    if (st) printf("bench %s: %s\n", name, sl_last_error());
  });
  const double flop = 2.0 * M * K * N;
  printf("bench %-5s %-22s G %3d rows %5d K %5d N %5d %s: fp8 %7.3f ms %6.0f TF/s | bf16 %7.3f ms "
         "%6.0f TF/s | %.2fx\n",
         tgmm ? "tgmm" : "gmm", name, G, rows, K, N, skew ? "skew" : "unif", ms8,
         flop / ms8 / 1e9, ms16, flop / ms16 / 1e9, ms16 / ms8);
  for (void *p : {lhs, rhs, lhs16, rhs16, ls, rs, out, gs, ws}) cudaFree(p);
}

int main(int argc, char **argv) {
  bool quick = false, do_bench = false, test = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--bench")) do_bench = true;
    if (!strcmp(argv[i], "--no-test")) test = false;
    if (!strcmp(argv[i], "--f32")) bench_f32 = true;
    if (!strcmp(argv[i], "--sms") && i + 1 < argc) sluice_cuda::gmm_set_grid_cap(atoi(argv[++i]));
  }
  const sl_dtype BF = SL_DTYPE_BF16, F32 = SL_DTYPE_F32;
  std::vector<Case> cases = {
      {"gmm N128 K256 1 group", 0, 128, 256, 128, 1, 1, 0, 1, {128}, BF, 0},
      {"gmm N256 K384 ragged", 0, 300, 384, 256, 3, 3, 0, 1, {}, BF, 0},
      {"gmm N384 K272 ragged", 0, 520, 272, 384, 5, 5, 0, 1, {}, BF, 0},
      {"gmm N136 K144 f32", 0, 333, 144, 136, 4, 4, 0, 1, {}, F32, 0},
      {"gmm N64 K1024 empty groups", 0, 400, 1024, 64, 6, 6, 0, 1, {0, 130, 0, 70, 200, 0}, BF, 0},
      {"gmm offset 2 of 6, 3 local", 0, 420, 256, 256, 6, 3, 2, 1, {}, BF, 0},
      {"gmm skip_unused", 0, 420, 256, 256, 6, 3, 1, 1, {}, BF, 1},
      {"gmm batch 2", 0, 260, 128, 192, 3, 3, 0, 2, {}, BF, 0},
      {"gmm N1024 K1024 small groups", 0, 1000, 1024, 1024, 16, 16, 0, 1, {}, BF, 0},
      {"tgmm K256 N128", 0 + 1, 256, 256, 128, 2, 2, 0, 1, {100, 156}, BF, 0},
      {"tgmm K384 N256 ragged", 1, 528, 384, 256, 5, 5, 0, 1, {}, BF, 0},
      {"tgmm K200 N136 f32", 1, 400, 200, 136, 3, 3, 0, 1, {}, F32, 0},
      {"tgmm empty groups", 1, 336, 128, 256, 5, 5, 0, 1, {0, 5, 0, 300, 0}, BF, 0},
      {"tgmm offset", 1, 512, 256, 128, 6, 2, 3, 1, {}, BF, 0},
      {"tgmm batch 2", 1, 272, 128, 128, 3, 3, 0, 2, {}, BF, 0},
      {"tgmm K384 N512 f32 staged", 1, 608, 384, 512, 4, 4, 0, 1, {}, F32, 0},
      {"tgmm K132 N264 f32 staged, offset", 1, 272, 132, 264, 3, 2, 1, 1, {}, F32, 0},
      {"tgmm f32 staged, batch 2", 1, 272, 256, 384, 3, 3, 0, 2, {}, F32, 0},
  };
  for (const Case &c : cases) {
    if (!test) break;
    if (quick && (c.m * (long)c.k * c.n > 100000000L)) continue;
    run_case(c);
  }
  if (test) printf("%d passed, %d failed\n", passed, failures);
  if (do_bench) {
    bench("dsv3-gateup", 0, 32, 1024, 7168, 4096, false);
    bench("dsv3-gateup", 0, 32, 1024, 7168, 4096, true);
    bench("dsv3-down", 0, 32, 1024, 2048, 7168, false);
    bench("qwen3-gateup", 0, 128, 256, 2048, 1536, false);
    bench("deepgemm-4x8192", 0, 4, 8192, 7168, 4096, false);
    bench("deepgemm-4x8192", 0, 4, 8192, 2048, 7168, false);
    bench("deepgemm-8x4096", 0, 8, 4096, 7168, 4096, false);
    bench("deepgemm-8x4096", 0, 8, 4096, 2048, 7168, false);
    bench("dsv3-gateup", 1, 32, 1024, 7168, 4096, false);
    bench("dsv3-down", 1, 32, 1024, 2048, 7168, false);
    bench("qwen3-gateup", 1, 128, 256, 2048, 1536, false);
    bench("dsv3-1gpu-gateup", 1, 64, 512, 7168, 4096, false);
    bench("dsv3-1gpu-down", 1, 64, 512, 2048, 7168, false);
    bench("deepgemm-4x8192", 1, 4, 8192, 7168, 4096, false);
  }
  return failures ? 1 : 0;
}
