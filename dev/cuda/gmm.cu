/* Grouped GEMM harness: gmm (or tgmm, see tgmm.cu) over every kernel version, on the benchmark
 * shapes.
 *
 * Build (tests/gpu/build.sh does this, into build-gpu/):
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
 *        -Iinclude -Icsrc/core dev/cuda/gmm.cu build-gpu/status.o build-gpu/gmm_cpu.o -lgomp -o gmm
 * Run: ./gmm [version]     (no argument: every version)
 *
 * Versions:
 *   1  portable: mma.sync m16n8k16, 128x256x32 tiles, 3-stage cp.async, 8 warps (sm80_gmm.cu)
 *   2  Hopper: wgmma m64n256k16 from TMA, 4-stage mbarrier pipeline, 1 producer + 2 consumer
 *      warpgroups, persistent, wait_group 0 per k-block, epilogue from registers (sm90 V_BASE)
 *   3  as 2, one k-block of wgmma kept in flight (wait_group 1) (V_WAIT1)
 *   4  as 3, epilogue staged in swizzled smem and written by TMA stores overlapping the next
 *      tile; 3 stages (V_TMA_C)
 *   5  as 4 with wait_group 0 (V_TMA_C0; the default for 16-bit outputs)
 * (tgmm, all sm90 versions: rows past a group's end are zeroed by the producer warpgroup's spare
 *  warps, off the consumers' path.)
 *
 * First every version is checked against the CPU kernel (sl_gmm_cpu, f32 accumulation) on a small
 * ragged problem, then timed (CUDA events, median of 20 after warm-up) on the four shapes of
 * BENCHMARKS.md with uniform group sizes. Napkin math: 2*M*K*N flops at ~790 TFLOP/s (the dense
 * bf16 rate measured on H200); bytes (M*K + G*K*N + M*N)*2 at ~4.3 TB/s, far below: compute-bound.
 */
#include <algorithm>
#include <random>
#include <vector>

#include "../../csrc/cuda/gmm_launch.cu"
#include "../../csrc/cuda/sm80_gmm.cu"
#include "../../csrc/cuda/sm90_gmm.cu"

#ifndef HARNESS_TGMM
#define HARNESS_TGMM 0
#endif

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

static const bool kTgmm = HARNESS_TGMM;
static const int kVersions = 5;

static sl_status run_version(int v, const sluice_cuda::GmmArgs &a, int sms) {
  if (v == 1) return sluice_cuda::sm80_gmm_launch(a, kTgmm, sms, 0);
  return sluice_cuda::sm90_gmm_launch(a, kTgmm, sms, 0, v - 2);
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

static Problem make_problem(int m, int g, int k, int n, std::vector<int> sizes, bool keep_host) {
  Problem p{m, g, k, n, sizes};
  const size_t lhs_n = (size_t)m * k, rhs_n = kTgmm ? (size_t)m * n : (size_t)g * k * n;
  const size_t out_n = kTgmm ? (size_t)g * k * n : (size_t)m * n;
  std::vector<uint16_t> hl(lhs_n), hr(rhs_n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (auto &x : hl) x = bf16_bits(u(rng));
  for (auto &x : hr) x = bf16_bits(u(rng));
  CK(cudaMalloc(&p.lhs, lhs_n * 2));
  CK(cudaMalloc(&p.rhs, rhs_n * 2));
  CK(cudaMalloc(&p.out, out_n * 2));
  CK(cudaMalloc(&p.d_sizes, g * 4));
  CK(cudaMemcpy(p.lhs, hl.data(), lhs_n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(p.rhs, hr.data(), rhs_n * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(p.d_sizes, sizes.data(), g * 4, cudaMemcpyHostToDevice));
  if (keep_host) p.h_lhs = hl, p.h_rhs = hr;
  return p;
}

static sluice_cuda::GmmArgs args_of(const Problem &p) {
  sluice_cuda::GmmArgs a;
  a.lhs = p.lhs, a.rhs = p.rhs, a.out = p.out, a.group_sizes = p.d_sizes, a.group_offset = nullptr;
  a.table = nullptr;
  a.m = p.m, a.k = p.k, a.n = p.n, a.num_groups = p.g, a.num_local_groups = p.g;
  a.in_dtype = SL_DTYPE_BF16, a.out_dtype = SL_DTYPE_BF16, a.transpose_rhs = 0;
  return a;
}

static void free_problem(Problem &p) {
  cudaFree(p.lhs), cudaFree(p.rhs), cudaFree(p.out), cudaFree(p.d_sizes);
}

int main(int argc, char **argv) {
  const int only = argc > 1 ? atoi(argv[1]) : 0;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("%s on %s (%d SMs)\n", kTgmm ? "tgmm" : "gmm", prop.name, sms);

  /* 1. correctness on a ragged problem with an empty group and odd edges */
  {
    std::vector<int> sizes = {300, 0, 1, 517, 129, 0};
    Problem p = make_problem(1000, 6, 392, 520, sizes, true);
    const size_t out_n = kTgmm ? (size_t)6 * 392 * 520 : (size_t)1000 * 520;
    std::vector<float> ref(out_n);
    sl_gmm_desc d = sl_gmm_desc_default();
    d.m = p.m, d.k = p.k, d.n = p.n, d.num_groups = d.num_local_groups = p.g;
    d.lhs_dtype = d.rhs_dtype = SL_DTYPE_BF16, d.out_dtype = SL_DTYPE_F32;
    sl_status st =
        kTgmm
            ? sl_tgmm_cpu(&d, p.h_lhs.data(), p.h_rhs.data(), sizes.data(), nullptr, ref.data(), 0)
            : sl_gmm_cpu(&d, p.h_lhs.data(), p.h_rhs.data(), sizes.data(), nullptr, ref.data(), 0);
    if (st != SL_STATUS_SUCCESS) printf("cpu reference failed: %s\n", sl_last_error());
    for (int v = 1; v <= kVersions; ++v) {
      if (only && v != only) continue;
      CK(cudaMemset(p.out, 0xFF, out_n * 2));
      st = run_version(v, args_of(p), sms);
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> out(out_n);
      CK(cudaMemcpy(out.data(), p.out, out_n * 2, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      size_t nan = 0;
      for (size_t i = 0; i < out_n; ++i) {
        const double o = bf16_float(out[i]);
        if (o != o)
          ++nan;
        else
          num += (o - ref[i]) * (o - ref[i]);
        den += (double)ref[i] * ref[i];
      }
      printf("version %d: %s, rel err %.2e, NaN %zu -> %s\n", v, sl_status_string(st),
             sqrt(num / den), nan,
             st == SL_STATUS_SUCCESS && nan == 0 && sqrt(num / den) < 1e-2 ? "OK" : "WRONG");
    }
    free_problem(p);
  }

  /* 2. timing on the benchmark shapes, uniform group sizes */
  struct Shape {
    const char *name;
    int m, g, k, n;
  };
  const Shape shapes[] = {{"dsv3-gateup-ep8", 32768, 32, 7168, 4096},
                          {"dsv3-down-ep8", 32768, 32, 2048, 7168},
                          {"mixtral-up", 16384, 8, 4096, 14336},
                          {"qwen3-30b-up", 65536, 128, 2048, 1536}};
  printf("%-18s %8s %10s %10s\n", "shape", "version", "ms", "TFLOP/s");
  for (const Shape &s : shapes) {
    std::vector<int> sizes(s.g, s.m / s.g);
    Problem p = make_problem(s.m, s.g, s.k, s.n, sizes, false);
    const double flops = 2.0 * s.m * s.k * s.n;
    for (int v = 1; v <= kVersions; ++v) {
      if (only && v != only) continue;
      cudaEvent_t e0, e1;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      for (int w = 0; w < 3; ++w) run_version(v, args_of(p), sms);
      std::vector<float> ms;
      for (int r = 0; r < 20; ++r) {
        CK(cudaEventRecord(e0));
        run_version(v, args_of(p), sms);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      CK(cudaGetLastError());
      std::sort(ms.begin(), ms.end());
      const float med = ms[ms.size() / 2];
      printf("%-18s %8d %10.3f %10.1f\n", s.name, v, med, flops / med / 1e9);
    }
    free_problem(p);
  }
  return 0;
}
