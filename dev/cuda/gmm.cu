/* Grouped GEMM harness: gmm (or tgmm, see tgmm.cu) on the benchmark shapes, through the real
 * kernels (this file includes their sources).
 *
 * Build (tests/gpu/build.sh does this, into build-gpu/):
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
 *        -Iinclude -Icsrc/core dev/cuda/gmm.cu build-gpu/status.o build-gpu/gmm_cpu.o -lgomp -o gmm
 * Versions:
 *   1  portable: mma.sync m16n8k16, 128x256x32 tiles, 3-stage cp.async, 8 warps (sm80_gmm.cu)
 *   2  what the library runs (gmm_launch.cu's table): on sm_90, wgmma m64n256k16 fed by TMA
 *      through an mbarrier pipeline, 1 producer + 2 consumer warpgroups, persistent, tiles handed
 *      out through a ring, epilogue staged for TMA stores (sm90_gmm_pipeline.cuh); gmm with
 *      merged edge tiles at K >= 2048 (sm90_gmm_fwd.cu), tgmm in 32-row k-blocks with the
 *      producer's spare warps zeroing rows past a group's end (sm90_gmm_wgrad.cu)
 *
 * Run: ./gmm [versions]   versions: a comma-separated list to time (default 2,1: "vs first"
 * compares with 2). HARNESS_OUT=f32 checks and times f32 outputs.
 * The timings interleave the versions, so they share one power state.
 *
 * First every version is checked against the CPU kernel (sl_gmm_cpu, f32 accumulation) on small
 * ragged problems (and transpose_rhs for gmm), then timed on the shapes of bench/ with four
 * group-size patterns: "uniform" (M/G each, tile multiples), "ragged" (M/G +-6%, as a
 * multinomial draw gives), "skewed" (Dirichlet(0.3) proportions) and "halves" (every group ends
 * in a 64-row tile). Each timed call of every version takes its turn inside every repetition (CUDA
 * events, median of 25 after warm-up), so clock drift hits all versions alike. Napkin math:
 * 2*M*K*N flops at ~790 TFLOP/s (the dense bf16 rate measured on H200); bytes
 * (M*K + G*K*N + M*N)*2 at ~4.3 TB/s, far below: compute-bound.
 */
#include <algorithm>
#include <random>
#include <vector>

#include "../../csrc/cuda/gmm_launch.cu"
#include "../../csrc/cuda/sm80_gmm.cu"
#include "../../csrc/cuda/sm90_gmm_fwd.cu"
#include "../../csrc/cuda/sm90_gmm_wgrad.cu"
#include "../../tests/gpu/cuda_ok.h"

/* Uniform bf16 values in [-1, 1) from a hash of the index. */
__global__ void fill_random(__nv_bfloat16 *p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed * 0x9e3779b9u;
    h ^= h >> 16, h *= 0x85ebca6bu, h ^= h >> 13;
    p[i] = __float2bfloat16((float)(h & 0xffffff) / 8388608.f - 1.f);
  }
}

#ifndef HARNESS_TGMM
#define HARNESS_TGMM 0
#endif

static const bool kTgmm = HARNESS_TGMM;
/* HARNESS_OUT=f32: time (and check) f32 outputs instead of bf16 ones */
static const bool kOutF32 = getenv("HARNESS_OUT") && !strcmp(getenv("HARNESS_OUT"), "f32");
static const size_t kOutBytes = kOutF32 ? 4 : 2;
static const int kVersions = 2;
static int g_major = 0; /* the device's compute capability */

static bool version_exists(int v) { return v == 1 || v == 2; }

static sl_status run_version(int v, const sluice_cuda::GmmArgs &a, int sms) {
  if (v == 1) return sluice_cuda::sm80_gmm_launch(a, kTgmm, sms, 0);
  return launch(a, kTgmm, g_major, sms, 0); /* gmm_launch.cu's table */
}

static uint16_t bf16_bits(float f) {
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}
static float bf16_float(uint16_t u) {
  uint32_t w = (uint32_t)u << 16;
  float f;
  memcpy(&f, &w, 4);
  return f;
}

struct Problem {
  int m, g, k, n;
  std::vector<int> sizes;
  void *lhs, *rhs, *out;
  int32_t *d_sizes;
  std::vector<uint16_t> h_lhs, h_rhs;
};

/* host_data: random inputs made on the host and kept (for the CPU reference); otherwise made on
 * the device. */
static Problem make_problem(int m, int g, int k, int n, std::vector<int> sizes, bool host_data) {
  Problem p{m, g, k, n, sizes};
  const size_t lhs_n = (size_t)m * k, rhs_n = kTgmm ? (size_t)m * n : (size_t)g * k * n;
  const size_t out_n = kTgmm ? (size_t)g * k * n : (size_t)m * n;
  CUDA_OK(cudaMalloc(&p.lhs, lhs_n * 2));
  CUDA_OK(cudaMalloc(&p.rhs, rhs_n * 2));
  CUDA_OK(cudaMalloc(&p.out, out_n * kOutBytes));
  CUDA_OK(cudaMalloc(&p.d_sizes, g * 4));
  CUDA_OK(cudaMemcpy(p.d_sizes, sizes.data(), g * 4, cudaMemcpyHostToDevice));
  if (host_data) {
    std::vector<uint16_t> hl(lhs_n), hr(rhs_n);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto &x : hl) x = bf16_bits(u(rng));
    for (auto &x : hr) x = bf16_bits(u(rng));
    CUDA_OK(cudaMemcpy(p.lhs, hl.data(), lhs_n * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(p.rhs, hr.data(), rhs_n * 2, cudaMemcpyHostToDevice));
    p.h_lhs = hl, p.h_rhs = hr;
  } else {
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)p.lhs, lhs_n, 1u);
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)p.rhs, rhs_n, 2u);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaDeviceSynchronize());
  }
  return p;
}

static sluice_cuda::GmmArgs args_of(const Problem &p, int transpose = 0) {
  sluice_cuda::GmmArgs a;
  a.lhs = p.lhs, a.rhs = p.rhs, a.out = p.out, a.group_sizes = p.d_sizes, a.group_offset = nullptr;
  /* a workspace for the group table, as the library's callers pass one: used where the table
   * does not fit in shared memory beside a kernel's own (place_table) */
  static int *table = nullptr;
  static size_t table_bytes = 0;
  const size_t need = (size_t)sluice_cuda::table_ints(p.g) * sizeof(int);
  if (need > table_bytes) {
    if (table) CUDA_OK(cudaFree(table));
    CUDA_OK(cudaMalloc(&table, need));
    table_bytes = need;
  }
  a.table = table;
  static int *counter = nullptr; /* the sm90 tile counter (the library keeps it in the workspace) */
  if (counter == nullptr) CUDA_OK(cudaMalloc(&counter, sizeof(int)));
  a.counter = counter;
  a.m = p.m, a.k = p.k, a.n = p.n, a.num_groups = p.g, a.num_local_groups = p.g;
  a.in_dtype = SL_DTYPE_BF16, a.out_dtype = kOutF32 ? SL_DTYPE_F32 : SL_DTYPE_BF16;
  a.transpose_rhs = transpose;
  return a;
}

static void free_problem(Problem &p) {
  cudaFree(p.lhs), cudaFree(p.rhs), cudaFree(p.out), cudaFree(p.d_sizes);
}

/* Group sizes summing to m: "uniform" m/g each; "ragged" m/g +-6%; "skewed" Dirichlet(0.3);
 * "halves" m/g + 64 and m/g - 64 in turn, so every group ends in a tile of 64 rows (half a tile
 * of work: gmm's second consumer warpgroup idle, or its merged tiles). */
static std::vector<int> sizes_for(const char *mode, int m, int g) {
  std::vector<int> s(g, m / g);
  std::mt19937 rng(11);
  if (!strcmp(mode, "halves")) {
    for (int i = 0; i < g; ++i) s[i] += (i % 2 ? -64 : 64);
  } else if (!strcmp(mode, "ragged")) {
    std::uniform_real_distribution<double> u(-0.06, 0.06);
    for (int &x : s) x = (int)((double)(m / g) * (1.0 + u(rng)));
  } else if (!strcmp(mode, "skewed")) {
    std::gamma_distribution<double> gam(0.3, 1.0);
    std::vector<double> w(g);
    double tot = 0;
    for (double &x : w) tot += (x = gam(rng));
    for (int i = 0; i < g; ++i) s[i] = (int)(m * w[i] / tot);
  }
  long long sum = 0;
  for (int x : s) sum += x;
  int big = (int)(std::max_element(s.begin(), s.end()) - s.begin());
  s[big] += (int)(m - sum); /* rows that rounding left over */
  return s;
}

int main(int argc, char **argv) {
  bool want[kVersions + 1] = {false};
  std::vector<int> listed; /* in the order given: the first is what "vs first" compares with */
  {
    const char *list = argc > 1 ? argv[1] : "2,1";
    for (const char *c = list; *c;) {
      const int v = atoi(c);
      if (v >= 1 && v <= kVersions && !want[v]) want[v] = true, listed.push_back(v);
      while (*c && *c != ',') ++c;
      if (*c == ',') ++c;
    }
  }
  setvbuf(stdout, nullptr, _IOLBF, 0); /* every line out even if a timeout kills the run */
  bool skip[kVersions + 1] = {false};  /* HARNESS_SKIP=8,...: neither checked nor timed */
  for (const char *c = getenv("HARNESS_SKIP"); c && *c;) {
    const int v = atoi(c);
    if (v >= 1 && v <= kVersions) skip[v] = true;
    while (*c && *c != ',') ++c;
    if (*c == ',') ++c;
  }
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  g_major = prop.major;
  printf("%s on %s (%d SMs), %s output\n", kTgmm ? "tgmm" : "gmm", prop.name, sms,
         kOutF32 ? "f32" : "bf16");

  /* 1. correctness on ragged problems with empty groups, 1-row groups, a group that ends on a
   * multiple of 16 rows, last tiles of 1-64 and 65-127 rows, rows past sum(sizes), and K/N edges
   * that are not tile multiples; every version */
  int wrong = 0;
  bool bad[kVersions + 1] = {false};
  /* two problems: K and N off every tile size, then multiples of 64 (what the sm90 kernels need) */
  for (int pr = 0; pr < 2 * (kTgmm ? 1 : 2) && !getenv("HARNESS_NOCHECK"); ++pr) {
    const int tr = kTgmm ? 0 : pr % 2, aligned = kTgmm ? pr : pr / 2;
    /* (gmm's merged tiles, at K >= 2048, would take the last 128 + r rows of 300, 517, 129) */
    std::vector<int> sizes = {300, 0, 1, 517, 129, 0, 48, 200};
    /* K = 264: 3 row blocks of out[j] in tgmm; aligned K = 384: an even number of k-blocks */
    const int G = (int)sizes.size(), M = 1200, K = aligned ? 384 : 264, N = aligned ? 576 : 520;
    Problem p = make_problem(M, G, K, N, sizes, true);
    const size_t out_n = kTgmm ? (size_t)G * K * N : (size_t)M * N;
    std::vector<float> ref(out_n);
    sl_gmm_desc d = sl_gmm_desc_default();
    d.m = p.m, d.k = p.k, d.n = p.n, d.num_groups = d.num_local_groups = p.g;
    d.lhs_dtype = d.rhs_dtype = SL_DTYPE_BF16, d.out_dtype = SL_DTYPE_F32;
    d.transpose_rhs = tr;
    sl_status st =
        kTgmm
            ? sl_tgmm_cpu(&d, p.h_lhs.data(), p.h_rhs.data(), sizes.data(), nullptr, ref.data(), 0)
            : sl_gmm_cpu(&d, p.h_lhs.data(), p.h_rhs.data(), sizes.data(), nullptr, ref.data(), 0);
    if (st != SL_STATUS_SUCCESS) printf("cpu reference failed: %s\n", sl_last_error());
    for (int v = 1; v <= kVersions; ++v) {
      if (skip[v] || !version_exists(v)) continue;
      CUDA_OK(cudaMemset(p.out, 0xFF, out_n * kOutBytes));
      st = run_version(v, args_of(p, tr), sms);
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint16_t> out(out_n * kOutBytes / 2);
      CUDA_OK(cudaMemcpy(out.data(), p.out, out_n * kOutBytes, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      size_t nan = 0;
      for (size_t i = 0; i < out_n; ++i) {
        float f32;
        if (kOutF32) memcpy(&f32, &out[2 * i], 4);
        const double o = kOutF32 ? (double)f32 : bf16_float(out[i]);
        if (o != o)
          ++nan;
        else
          num += (o - ref[i]) * (o - ref[i]);
        den += (double)ref[i] * ref[i];
      }
      const bool ok = st == SL_STATUS_SUCCESS && nan == 0 && sqrt(num / den) < 1e-2;
      wrong += !ok;
      bad[v] |= !ok;
      printf("version %d%s K %d N %d: %s, rel err %.2e, NaN %zu -> %s\n", v,
             tr ? " transpose_rhs" : "", K, N, sl_status_string(st), sqrt(num / den), nan,
             ok ? "OK" : "WRONG");
    }
    free_problem(p);
  }

  /* 2. timing on the benchmark shapes, the versions interleaved (only those that checked correct)
   */
  std::vector<int> versions;
  for (int v : listed)
    if (!bad[v] && !skip[v] && version_exists(v)) versions.push_back(v);
  struct Shape {
    const char *name;
    int m, g, k, n;
    bool named_only; /* timed only when HARNESS_SHAPES names it */
  };
  const Shape shapes[] = {{"dsv3-gateup-ep8", 32768, 32, 7168, 4096},
                          {"dsv3-down-ep8", 32768, 32, 2048, 7168},
                          {"mixtral-up", 16384, 8, 4096, 14336},
                          {"qwen3-30b-up", 65536, 128, 2048, 1536},
                          /* the dsv3-proxy MoE layer's expert matmuls (tests/shapes.py) */
                          {"dsv3proxy-gateup", 131072, 256, 1024, 512, true},
                          {"dsv3proxy-down", 131072, 256, 256, 1024, true},
                          /* the same with 512 experts */
                          {"fine512-gateup", 131072, 512, 1024, 512, true},
                          {"fine512-down", 131072, 512, 256, 1024, true},
                          /* qwen3's neighbours: wider N, shorter K, fewer and larger groups */
                          {"qwen3-n3072", 65536, 128, 2048, 3072, true},
                          {"qwen3-k1024", 65536, 128, 1024, 1536, true},
                          {"g32-n1536", 32768, 32, 2048, 1536, true},
                          /* dsv3-gateup's K and N with 256-4096 rows a group: tgmm's tile length
                           * (its contraction) swept at a fixed tile count */
                          {"rows256-gateup", 8192, 32, 7168, 4096, true},
                          {"rows512-gateup", 16384, 32, 7168, 4096, true},
                          {"rows2048-gateup", 65536, 32, 7168, 4096, true},
                          {"rows4096-gateup", 131072, 32, 7168, 4096, true}};
  const char *modes[] = {"uniform", "ragged", "skewed", "halves"};
  /* HARNESS_SHAPES / HARNESS_MODES (substrings of the names) and HARNESS_REPS narrow the timing,
   * with HARNESS_NOCHECK=1 (no correctness pass) for a profiler: each version then runs 2 warm-up
   * + reps calls per case, in the listed order. */
  const char *only_shapes = getenv("HARNESS_SHAPES"), *only_modes = getenv("HARNESS_MODES");
  /* set but empty (HARNESS_SHAPES= or HARNESS_MODES= with nothing named): no filter */
  if (only_shapes && !*only_shapes) only_shapes = nullptr;
  if (only_modes && !*only_modes) only_modes = nullptr;
  const int reps = getenv("HARNESS_REPS") ? atoi(getenv("HARNESS_REPS")) : 25;
  printf("%-16s %-8s %7s %9s %8s %9s\n", "shape", "sizes", "version", "ms", "TFLOP/s", "vs first");
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  for (const Shape &sh : shapes) {
    if (only_shapes ? !strstr(only_shapes, sh.name) : sh.named_only) continue;
    for (const char *mode : modes) {
      if (only_modes && !strstr(only_modes, mode)) continue;
      std::vector<int> sizes = sizes_for(mode, sh.m, sh.g);
      Problem p = make_problem(sh.m, sh.g, sh.k, sh.n, sizes, false);
      const double flops = 2.0 * sh.m * sh.k * sh.n;
      for (int v : versions)
        for (int w = 0; w < 2; ++w) run_version(v, args_of(p), sms);
      std::vector<std::vector<float>> ms(versions.size());
      for (int r = 0; r < reps; ++r)
        for (size_t i = 0; i < versions.size(); ++i) {
          CUDA_OK(cudaEventRecord(e0));
          const sl_status st = run_version(versions[i], args_of(p), sms);
          CUDA_OK(cudaEventRecord(e1));
          CUDA_OK(cudaEventSynchronize(e1));
          if (st != SL_STATUS_SUCCESS) {
            printf("version %d failed: %s (%s)\n", versions[i], sl_status_string(st), sl_last_error());
            exit(1);
          }
          float t;
          CUDA_OK(cudaEventElapsedTime(&t, e0, e1));
          ms[i].push_back(t);
        }
      CUDA_OK(cudaGetLastError());
      float first = 0;
      for (size_t i = 0; i < versions.size(); ++i) {
        std::sort(ms[i].begin(), ms[i].end());
        const float med = ms[i][ms[i].size() / 2];
        if (i == 0) first = med;
        printf("%-16s %-8s %7d %9.3f %8.1f %8.3fx\n", sh.name, mode, versions[i], med,
               flops / med / 1e9, first / med);
      }
      free_problem(p);
    }
  }
  printf("%s\n", getenv("HARNESS_NOCHECK") ? "(correctness not checked: HARNESS_NOCHECK)"
                 : wrong                      ? "CORRECTNESS FAILED"
                                              : "all versions correct");
  return wrong ? 1 : 0;
}
