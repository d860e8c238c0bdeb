/* GPU tests of sl_gmm_cuda / sl_tgmm_cuda against a float64 CPU reference.
 *
 *   tests/gpu/run.sh            builds this and runs it plain, under compute-sanitizer, on 3 SMs
 *                               and with SLUICE_DEBUG=1.
 *   ./test_gmm [--quick] [--debug] [--sms N] [--tile-n 128|256]
 *
 * --sms N caps the kernels' grid at N SMs (gmm_set_grid_cap, an internal hook), so that every
 * case spans many waves of tiles: gmm's strided tiles and its claimed last waves, tgmm's claims.
 * --tile-n gives every sm_90 gmm case tiles of that width (gmm_set_tile_n; by default the wave
 * model picks 128 for few-wave problems only), so either width meets every case.
 * The cases cover each kernel of gmm_launch.cu's table on sm_90 (gmm plain with either rhs
 * layout, gmm merged at K >= 2048, tgmm) and each problem it sends to the portable kernel
 * (N % 64 != 0, tgmm K % 64 != 0, outputs the staged TMA store cannot take, K or N not a multiple
 * of 8).
 *
 * Every case draws fresh random inputs, poisons the output with 0xFF bytes (NaN in every float
 * type) so unwritten elements fail, and checks ||out - ref|| / ||ref|| (< 1e-2 for 16-bit outputs,
 * < 1e-4 for f32) plus "rows outside local groups are exactly zero" and "no NaN anywhere".
 * Each case runs through the public API (the sm_90 kernel on Hopper) and through the portable
 * mma.sync kernel directly, so both paths are tested on one GPU. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <random>
#include <string>
#include <vector>

#include "../../csrc/cuda/gmm_common.cuh"
#include "cuda_ok.h"
#include "sluice.h"

static std::mt19937_64 rng(1234);

static uint16_t to_bits(float v, sl_dtype t) {
  if (t == SL_DTYPE_BF16) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    uint16_t u;
    memcpy(&u, &b, 2);
    return u;
  }
  __half h = __float2half_rn(v);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
static double from_bits(const void *p, size_t i, sl_dtype t) {
  if (t == SL_DTYPE_F32) return ((const float *)p)[i];
  uint16_t u = ((const uint16_t *)p)[i];
  if (t == SL_DTYPE_BF16) {
    uint32_t w = (uint32_t)u << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
  }
  __half h;
  memcpy(&h, &u, 2);
  return __half2float(h);
}

/* Random tensor in dtype t; returns the host bytes and the exact values as doubles. */
static void random_tensor(size_t n, sl_dtype t, std::vector<uint8_t> &bytes,
                          std::vector<double> &vals) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const size_t es = t == SL_DTYPE_F32 ? 4 : 2;
  bytes.resize(n * es);
  vals.resize(n);
  for (size_t i = 0; i < n; ++i) {
    float v = u(rng);
    if (t == SL_DTYPE_F32)
      memcpy(&bytes[i * 4], &v, 4);
    else {
      uint16_t b = to_bits(v, t);
      memcpy(&bytes[i * 2], &b, 2);
    }
    vals[i] = from_bits(bytes.data(), i, t);
  }
}

struct Case {
  std::string name;
  bool tgmm = false;
  int batch = 1, m = 0, k = 0, n = 0, g = 1, gl = 1;
  std::vector<std::vector<int>> sizes; /* per batch, length g */
  std::vector<int> offsets;            /* per batch; empty = NULL pointer */
  sl_dtype in = SL_DTYPE_BF16, out = SL_DTYPE_BF16;
  int transpose = 0;
  int skip = 0; /* gmm: skip_unused_rows (the rows outside the local groups must stay poisoned) */
};

/* The clamped semantics of sluice.h: negative sizes are 0, rows clamp to [0, M), offset to [0,
 * G-GL]. */
static void clamped_ranges(const Case &c, int b, std::vector<long long> &start,
                           std::vector<long long> &end, int &off) {
  off = c.offsets.empty() ? 0 : c.offsets[b];
  off = off < 0 ? 0 : (off > c.g - c.gl ? c.g - c.gl : off);
  start.assign(c.g, 0);
  end.assign(c.g, 0);
  long long p = 0;
  for (int g = 0; g < c.g; ++g) {
    long long s = c.sizes[b][g] < 0 ? 0 : c.sizes[b][g];
    start[g] = p < c.m ? p : c.m;
    end[g] = p + s < c.m ? p + s : c.m;
    p += s;
  }
}

static int g_failures = 0, g_cases = 0;

enum Path { PATH_API, PATH_SM80 };

static bool run_case(const Case &c, Path path, void *workspace, size_t ws_bytes) {
  ++g_cases;
  const size_t B = c.batch, M = c.m, K = c.k, N = c.n, G = c.g, GL = c.gl;
  const size_t lhs_n = B * M * K, rhs_n = c.tgmm ? B * M * N : B * GL * K * N;
  const size_t out_n = c.tgmm ? B * GL * K * N : B * M * N;
  std::vector<uint8_t> lhs_b, rhs_b;
  std::vector<double> lhs, rhs;
  random_tensor(lhs_n, c.in, lhs_b, lhs);
  random_tensor(rhs_n, c.in, rhs_b, rhs);
  std::vector<int32_t> sizes(B * G), offs(B);
  for (size_t b = 0; b < B; ++b) {
    for (size_t g = 0; g < G; ++g) sizes[b * G + g] = c.sizes[b][g];
    offs[b] = c.offsets.empty() ? 0 : c.offsets[b];
  }
  const size_t out_es = sluice_cuda::dtype_bytes(c.out);
  void *d_lhs, *d_rhs, *d_out;
  int32_t *d_sizes, *d_offs = nullptr;
  CUDA_OK(cudaMalloc(&d_lhs, lhs_b.size() + 16));
  CUDA_OK(cudaMalloc(&d_rhs, rhs_b.size() + 16));
  CUDA_OK(cudaMalloc(&d_out, out_n * out_es + 16));
  CUDA_OK(cudaMalloc(&d_sizes, sizes.size() * 4 + 4));
  CUDA_OK(cudaMemcpy(d_lhs, lhs_b.data(), lhs_b.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_rhs, rhs_b.data(), rhs_b.size(), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_sizes, sizes.data(), sizes.size() * 4, cudaMemcpyHostToDevice));
  if (!c.offsets.empty()) {
    CUDA_OK(cudaMalloc(&d_offs, B * 4));
    CUDA_OK(cudaMemcpy(d_offs, offs.data(), B * 4, cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaMemset(d_out, 0xFF, out_n * out_es)); /* poison: NaN */

  sl_gmm_desc d = sl_gmm_desc_default();
  d.batch = B, d.m = M, d.k = K, d.n = N, d.num_groups = G, d.num_local_groups = GL;
  d.lhs_dtype = d.rhs_dtype = c.in;
  d.out_dtype = c.out;
  d.transpose_rhs = c.transpose;
  d.skip_unused_rows = c.skip;
  sl_status st = SL_STATUS_SUCCESS;
  if (path == PATH_API) {
    st = c.tgmm ? sl_tgmm_cuda(&d, d_lhs, d_rhs, d_sizes, d_offs, d_out, workspace, nullptr)
                : sl_gmm_cuda(&d, d_lhs, d_rhs, d_sizes, d_offs, d_out, workspace, nullptr);
  } else {
    const size_t es = sluice_cuda::dtype_bytes(c.in);
    int sms = 0;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (size_t b = 0; b < B && st == SL_STATUS_SUCCESS; ++b) {
      sluice_cuda::GmmArgs a;
      a.lhs = (char *)d_lhs + b * M * K * es;
      a.rhs = (char *)d_rhs + b * (c.tgmm ? M * N : GL * K * N) * es;
      a.out = (char *)d_out + b * (c.tgmm ? GL * K * N : M * N) * out_es;
      a.group_sizes = d_sizes + b * G;
      a.group_offset = d_offs ? d_offs + b : nullptr;
      a.table = (int *)workspace; /* used if the table does not fit in shared memory */
      a.counter = nullptr; /* the portable kernel has no tile counter */
      a.m = M, a.k = K, a.n = N, a.num_groups = G, a.num_local_groups = GL;
      a.in_dtype = c.in, a.out_dtype = c.out, a.transpose_rhs = c.transpose;
      a.skip_unused = c.tgmm ? 0 : c.skip;
      st = sluice_cuda::sm80_gmm_launch(a, c.tgmm, sms, nullptr);
    }
  }
  cudaError_t err = cudaDeviceSynchronize();
  std::vector<uint8_t> out(out_n * out_es);
  CUDA_OK(cudaMemcpy(out.data(), d_out, out.size(), cudaMemcpyDeviceToHost));
  cudaFree(d_lhs), cudaFree(d_rhs), cudaFree(d_out), cudaFree(d_sizes);
  if (d_offs) cudaFree(d_offs);
  const char *pname = path == PATH_SM80 ? "sm80" : workspace ? "api" : "api, no workspace";
  if (st != SL_STATUS_SUCCESS || err != cudaSuccess) {
    printf("FAIL %-40s [%s] status %s (%s) cuda %s\n", c.name.c_str(), pname, sl_status_string(st),
           sl_last_error(), cudaGetErrorString(err));
    ++g_failures;
    if (err != cudaSuccess) exit(1); /* the context is gone */
    return false;
  }

  /* float64 reference with the clamped semantics, compared batch by batch. */
  double num = 0, den = 0;
  size_t nan_count = 0, nonzero_outside = 0;
  for (size_t b = 0; b < B; ++b) {
    std::vector<long long> start, end;
    int off;
    clamped_ranges(c, (int)b, start, end, off);
    const double *L = &lhs[b * M * K];
    const double *R = &rhs[b * (c.tgmm ? M * N : GL * K * N)];
    const size_t ob = b * (c.tgmm ? GL * K * N : M * N);
    std::vector<double> ref(c.tgmm ? GL * K * N : M * N, 0.0);
    std::vector<char> inside(M, 0);
    for (size_t j = 0; j < GL; ++j) {
      const long long s = start[off + j], e = end[off + j];
      if (c.tgmm) {
        for (long long r = s; r < e; ++r)
          for (size_t kk = 0; kk < K; ++kk) {
            const double l = L[r * K + kk];
            double *o = &ref[(j * K + kk) * N];
            const double *rr = &R[r * N];
            for (size_t nn = 0; nn < N; ++nn) o[nn] += l * rr[nn];
          }
      } else {
        const double *W = &R[j * K * N];
        for (long long r = s; r < e; ++r) {
          inside[r] = 1;
          double *o = &ref[r * N];
          for (size_t kk = 0; kk < K; ++kk) {
            const double l = L[r * K + kk];
            if (c.transpose)
              for (size_t nn = 0; nn < N; ++nn) o[nn] += l * W[nn * K + kk];
            else
              for (size_t nn = 0; nn < N; ++nn) o[nn] += l * W[kk * N + nn];
          }
        }
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      const double v = from_bits(out.data(), ob + i, c.out);
      if (c.skip && !c.tgmm && !inside[i / N]) { /* left unwritten: still the poison (NaN) */
        if (v == v) ++nonzero_outside;
        continue;
      }
      if (v != v) {
        ++nan_count;
        continue;
      }
      num += (v - ref[i]) * (v - ref[i]);
      den += ref[i] * ref[i];
      if (!c.tgmm && !inside[i / N] && v != 0.0) ++nonzero_outside;
    }
  }
  const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
  const double tol = c.out == SL_DTYPE_F32 && c.in == SL_DTYPE_F32 ? 1e-4 : 1e-2;
  const bool ok = nan_count == 0 && nonzero_outside == 0 && rel < tol;
  printf("%s %-40s [%s] rel %.2e nan %zu nonzero-outside %zu\n", ok ? "ok  " : "FAIL",
         c.name.c_str(), pname, rel, nan_count, nonzero_outside);
  if (!ok) ++g_failures;
  return ok;
}

/* Group sizes that sum to `total`, drawn uniformly (multinomial-like). */
static std::vector<int> random_sizes(int g, int total) {
  std::vector<int> s(g, 0);
  std::uniform_int_distribution<int> pick(0, g - 1);
  for (int i = 0; i < total; ++i) s[pick(rng)]++;
  return s;
}

static Case make(const std::string &name, bool tgmm, int m, int k, int n, std::vector<int> sizes,
                 int gl = -1, int off = -1) {
  Case c;
  c.name = name;
  c.tgmm = tgmm;
  c.m = m, c.k = k, c.n = n;
  c.g = (int)sizes.size();
  c.gl = gl < 0 ? c.g : gl;
  c.sizes = {sizes};
  if (off >= 0) c.offsets = {off};
  return c;
}

int main(int argc, char **argv) {
  bool quick = false, debug = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    if (!strcmp(argv[i], "--debug")) debug = true;
    if (!strcmp(argv[i], "--sms") && i + 1 < argc) sluice_cuda::gmm_set_grid_cap(atoi(argv[++i]));
    if (!strcmp(argv[i], "--tile-n") && i + 1 < argc) sluice_cuda::gmm_set_tile_n(atoi(argv[++i]));
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
         prop.multiProcessorCount);
  if (!sl_has_cuda()) {
    printf("FAIL sl_has_cuda() == 0\n");
    return 1;
  }
  void *ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, 1 << 20));
  /* poisoned: the group table and the sm90 tile counter must be written by the launches */
  CUDA_OK(cudaMemset(ws, 0xff, 1 << 20));

  if (debug) {
    /* SLUICE_DEBUG=1: bad device sizes are reported as SL_STATUS_INVALID_VALUE after the kernel. */
    int bad = 0;
    for (int tg = 0; tg < 2; ++tg) {
      for (int which = 0; which < 3; ++which) {
        Case c = make("debug", tg, 256, 64, 64, {100, which == 0 ? -5 : 100, which == 1 ? 500 : 20},
                      2, which == 2 ? 7 : 0);
        std::vector<uint8_t> lb, rb;
        std::vector<double> lv, rv;
        random_tensor(256 * 64, SL_DTYPE_BF16, lb, lv);
        void *dl, *dr, *dout;
        int32_t *ds, *doff;
        CUDA_OK(cudaMalloc(&dl, 256 * 64 * 2));
        CUDA_OK(cudaMalloc(&dr, 3 * 256 * 64 * 2));
        CUDA_OK(cudaMalloc(&dout, 3 * 256 * 64 * 4));
        CUDA_OK(cudaMalloc(&ds, 12));
        CUDA_OK(cudaMalloc(&doff, 4));
        CUDA_OK(cudaMemcpy(ds, c.sizes[0].data(), 12, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(doff, &c.offsets[0], 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(dl, 0, 256 * 64 * 2));
        CUDA_OK(cudaMemset(dr, 0, 3 * 256 * 64 * 2));
        sl_gmm_desc d = sl_gmm_desc_default();
        d.m = 256, d.k = 64, d.n = 64, d.num_groups = 3, d.num_local_groups = 2;
        d.lhs_dtype = d.rhs_dtype = d.out_dtype = SL_DTYPE_BF16;
        sl_status st = tg ? sl_tgmm_cuda(&d, dl, dr, ds, doff, dout, ws, nullptr)
                          : sl_gmm_cuda(&d, dl, dr, ds, doff, dout, ws, nullptr);
        const bool ok = st == SL_STATUS_INVALID_VALUE;
        printf("%s debug %s case %d: %s (%s)\n", ok ? "ok  " : "FAIL", tg ? "tgmm" : "gmm", which,
               sl_status_string(st), sl_last_error());
        bad += !ok;
        cudaFree(dl), cudaFree(dr), cudaFree(dout), cudaFree(ds), cudaFree(doff);
      }
    }
    printf("%s: %d debug failures\n", bad ? "FAILED" : "PASSED", bad);
    return bad ? 1 : 0;
  }

  std::vector<Case> cases;
  for (int tg = 0; tg < 2; ++tg) {
    const char *op = tg ? "tgmm" : "gmm";
    auto nm = [&](const char *s) { return std::string(op) + " " + s; };
    cases.push_back(make(nm("one group, tile multiples"), tg, 256, 256, 512, {256}));
    cases.push_back(make(nm("odd edges M/K/N"), tg, 777, 200, 328, random_sizes(5, 777)));
    cases.push_back(make(nm("one-row groups"), tg, 64, 136, 264, std::vector<int>(64, 1)));
    cases.push_back(make(nm("empty first/middle/last"), tg, 900, 192, 256, {0, 300, 0, 0, 600, 0}));
    cases.push_back(make(nm("sum < M"), tg, 1000, 128, 256, {100, 200, 300}));
    if (!tg) { /* the rows outside the local groups left unwritten: they must keep the poison */
      Case s = make(nm("sum < M, unused rows skipped"), tg, 1000, 128, 256, {100, 200, 300});
      s.skip = 1;
      cases.push_back(s);
      s = make(nm("G_local slice, unused rows skipped"), tg, 700, 136, 264, {90, 200, 0, 150, 170},
               2, 1);
      s.skip = 1;
      cases.push_back(s);
    }
    /* N a multiple of 64 (sm90 gmm) with K off every k-block size: gmm's last k-block is partly
     * past K (tgmm: K % 64 != 0, the portable kernel) */
    cases.push_back(make(nm("K % 32 = 8, N % 64 = 0"), tg, 600, 200, 320, random_sizes(4, 600)));
    /* groups that end on a multiple of 16 rows: sm90 tgmm's last block then needs no zeroing and
     * issues 1 k16 step */
    cases.push_back(make(nm("16-row group ends"), tg, 400, 136, 264, {48, 96, 16, 200, 32}));
    cases.push_back(make(nm("G=256 random"), tg, 3000, 128, 136, random_sizes(256, 2900)));
    {
      /* sizes rising to the longest group last: sm90 tgmm hands out the tiles of groups of more
       * than twice the mean rows first, longest first (build_group_table's order; here groups
       * 32-39, in four size classes), then the rest in index order */
      std::vector<int> sz(40);
      int tot = 0;
      for (int g = 0; g < 40; ++g) tot += sz[g] = g < 39 ? (g < 30 ? 3 * g : 120 * (g - 29)) : 1500;
      cases.push_back(make(nm("sizes rising, longest last"), tg, tot + 11, 136, 264, sz));
    }
    {
      /* the same order over more groups (every 37th long, the rest small), built in shared
       * memory on sm_90 (room for ~1000 groups beside the pipeline) */
      std::vector<int> sz = random_sizes(300, 1500);
      int tot = 1500;
      for (int g = 5; g < 300; g += 37) tot += (sz[g] += 40 + 3 * g);
      cases.push_back(make(nm("G_local=300 long groups"), tg, tot, 64, 136, sz));
      /* and by the table kernel in the workspace: 9000 groups' table (144 KB) fits in no
       * device's shared memory beside a pipeline */
      std::vector<int> big = random_sizes(9000, 12000);
      tot = 12000;
      for (int g = 11; g < 9000; g += 997) tot += (big[g] += 200 + g / 50);
      cases.push_back(make(nm("G_local=9000 long groups (workspace table)"), tg, tot, 64, 64, big));
    }
    /* sm90 gmm's merged edges: last 128 + r rows of 129..192 (wgmma N 160, 192), one group
     * with full row tiles before them (552), one whose edge of 96 rows is not merged (224), the
     * second column block's second half past N = 320, K off the k-block size, and the last
     * group ending at M; at K 264 the plain kernel runs these sizes */
    cases.push_back(make(nm("merged edge rows"), tg, 1554, 264, 320,
                         {129, 160, 161, 192, 0, 224, 552, 136}));
    /* the same at K >= 2048, where the merged kernel runs them */
    cases.push_back(
        make(nm("merged edge rows, K 2056"), tg, 760, 2056, 320, {129, 0, 160, 192, 219}));
    cases.push_back(
        make(nm("group_offset 3 of 8, 4 local"), tg, 1200, 64, 256, random_sizes(8, 1100), 4, 3));
    cases.push_back(
        make(nm("negative + sum > M (clamped)"), tg, 700, 64, 264, {300, -40, 250, 400, 100}));
    cases.push_back(
        make(nm("offset out of range (clamped)"), tg, 600, 64, 128, random_sizes(6, 600), 2, 99));
    cases.push_back(
        make(nm("K,N not multiple of 8 (slow path)"), tg, 333, 77, 101, random_sizes(4, 330)));
    cases.push_back(make(nm("G_local=300"), tg, 2000, 64, 128, random_sizes(300, 2000)));
    {
      Case c = make(nm("f16 in, f32 out"), tg, 1000, 320, 384, random_sizes(7, 1000));
      c.in = SL_DTYPE_F16, c.out = SL_DTYPE_F32;
      cases.push_back(c);
    }
    {
      /* f32 outputs through the staged TMA epilogue (sm90: twice the passes of a 16-bit one) */
      Case c = make(nm("bf16 in, f32 out, odd edges"), tg, 777, 200, 328, random_sizes(5, 777));
      c.out = SL_DTYPE_F32;
      cases.push_back(c);
      Case c2 = make(nm("bf16 in, f32 out, 64-multiples"), tg, 1000, 256, 512,
                     {300, 0, 1, 517, 129, 0, 48});
      c2.out = SL_DTYPE_F32;
      cases.push_back(c2);
    }
    {
      /* an f32 output on the sm90 kernels at K >= 2048 (gmm: the plain kernel, not the merged) */
      Case c = make(nm("bf16 in, f32 out, K 2048"), tg, 700, 2048, 256, {129, 0, 300, 200});
      c.out = SL_DTYPE_F32;
      cases.push_back(c);
    }
    {
      Case c = make(nm("bf16 in, f16 out"), tg, 500, 128, 256, random_sizes(3, 480));
      c.out = SL_DTYPE_F16;
      cases.push_back(c);
    }
    {
      Case c = make(nm("f32 in/out (naive)"), tg, 300, 40, 72, random_sizes(3, 290));
      c.in = c.out = SL_DTYPE_F32;
      cases.push_back(c);
    }
    {
      Case c = make(nm("batch 3 with offsets"), tg, 500, 128, 256, random_sizes(6, 500), 3, 0);
      c.batch = 3;
      c.sizes = {random_sizes(6, 500), random_sizes(6, 450), {0, 0, 500, 0, 0, 0}};
      c.offsets = {0, 2, 3};
      cases.push_back(c);
    }
    {
      Case c = make(nm("K=0"), tg, 128, 0, 64, {64, 64});
      if (!tg) cases.push_back(c);
    }
    if (!tg) {
      Case c = make("gmm transpose_rhs", false, 1000, 264, 384, random_sizes(5, 990));
      c.transpose = 1;
      cases.push_back(c);
      Case c2 = make("gmm transpose_rhs odd edges", false, 517, 136, 300, random_sizes(9, 517));
      c2.transpose = 1;
      cases.push_back(c2);
      /* an even number of 64-wide k-blocks, N % 64 == 0 and a K-major B, with edge tiles of
       * <= 64 group rows */
      Case ce = make("gmm transpose_rhs even k-blocks", false, 1000, 256, 384, {300, 1, 0, 517, 172});
      ce.transpose = 1;
      cases.push_back(ce);
      Case cf = make("gmm transpose_rhs f32 out", false, 1000, 264, 384, random_sizes(5, 990));
      cf.transpose = 1, cf.out = SL_DTYPE_F32;
      cases.push_back(cf);
      /* an f32 output whose rows are not a multiple of 16 bytes: the portable kernel */
      Case cg = make("gmm transpose_rhs f32 out, N % 4 = 2", false, 600, 136, 302,
                     random_sizes(5, 600));
      cg.transpose = 1, cg.out = SL_DTYPE_F32;
      cases.push_back(cg);
      Case c3 =
          make("gmm transpose_rhs K odd (slow path)", false, 200, 99, 130, random_sizes(3, 200));
      c3.transpose = 1;
      cases.push_back(c3);
    }
    if (!quick) {
      cases.push_back(make(nm("larger skew"), tg, 4096, 512, 768, {3000, 0, 10, 1, 1085}));
      /* more tiles than SMs: every CTA takes several */
      cases.push_back(make(nm("more tiles than SMs"), tg, 8192, 128, 1024, random_sizes(8, 8100)));
      std::vector<int> sz(16);
      for (int g = 0; g < 16; ++g) sz[g] = (g % 3 == 0) ? 0 : 97 * g;
      int tot = 0;
      for (int v : sz) tot += v;
      cases.push_back(make(nm("16 groups mixed"), tg, tot + 37, 384, 512, sz));
    }
  }
  if (quick) { /* the sanitizers are slow: a few cases that cover every kernel branch */
    std::vector<Case> keep;
    for (const Case &c : cases)
      if (c.name.find("odd edges") != std::string::npos ||
          c.name.find("empty first") != std::string::npos ||
          c.name.find("merged edge") != std::string::npos ||
          c.name.find("16-row group ends") != std::string::npos ||
          c.name.find("sum < M") != std::string::npos ||
          c.name.find("skipped") != std::string::npos ||
          c.name.find("even k-blocks") != std::string::npos ||
          c.name.find("f32 out, ") != std::string::npos ||
          c.name.find("K % 32") != std::string::npos ||
          c.name.find("G_local") != std::string::npos ||
          c.name.find("longest last") != std::string::npos)
        keep.push_back(c);
    cases = keep;
  }
  for (const Case &c : cases) {
    run_case(c, PATH_API, ws, 1 << 20);
    if (c.in != SL_DTYPE_F32) run_case(c, PATH_SM80, ws, 1 << 20);
  }
  for (int groups : {3, 9000}) { /* no workspace: a clear error, no launch */
    sl_gmm_desc d = sl_gmm_desc_default();
    d.m = 64, d.k = 64, d.n = 64, d.num_groups = d.num_local_groups = groups;
    d.lhs_dtype = d.rhs_dtype = d.out_dtype = SL_DTYPE_BF16;
    /* x, y: [64, 64] (gmm's lhs and out, tgmm's lhs and rhs); w: [9000, 64, 64] (gmm's rhs,
     * tgmm's out) */
    void *x, *y, *w;
    int32_t *ds;
    CUDA_OK(cudaMalloc(&x, 64 * 64 * 2));
    CUDA_OK(cudaMalloc(&y, 64 * 64 * 2));
    CUDA_OK(cudaMalloc(&w, (size_t)9000 * 64 * 64 * 2));
    CUDA_OK(cudaMalloc(&ds, 9000 * 4));
    CUDA_OK(cudaMemset(ds, 0, 9000 * 4));
    for (int tg = 0; tg < 2; ++tg) {
      sl_status st = tg ? sl_tgmm_cuda(&d, x, y, ds, nullptr, w, nullptr, nullptr)
                        : sl_gmm_cuda(&d, x, w, ds, nullptr, y, nullptr, nullptr);
      const bool ok = st == SL_STATUS_INVALID_ARGUMENT && strstr(sl_last_error(), "workspace");
      printf("%s %s %d groups, no workspace: %s (%s)\n", ok ? "ok  " : "FAIL",
             tg ? "tgmm" : "gmm", groups, sl_status_string(st), sl_last_error());
      ++g_cases, g_failures += !ok;
    }
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(x), cudaFree(y), cudaFree(w), cudaFree(ds);
  }
  cudaFree(ws);
  printf("%s: %d of %d checks failed\n", g_failures ? "FAILED" : "PASSED", g_failures, g_cases);
  return g_failures ? 1 : 0;
}
