/* CPU gmm/tgmm timing harness: includes the real kernel (csrc/core/gmm_cpu.c), times it on one
 * shape, prints GFLOP/s. Build (from the repo root):
 *   gcc -O3 -march=native -fopenmp -Iinclude -Icsrc/core dev/cpu/gmm_bench.c csrc/core/status.c \
 *       csrc/core/cuda_stub.c -lm -o /tmp/gmm_bench && /tmp/gmm_bench 2048 512 768 16 1
 * args: M K N G threads. Napkin: 2*M*K*N flops; one AVX-512 core peaks near 2 FMA x 16 lanes x 2
 * flops per cycle. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "../../csrc/core/gmm_cpu.c"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  int M = argc > 1 ? atoi(argv[1]) : 2048, K = argc > 2 ? atoi(argv[2]) : 512,
      N = argc > 3 ? atoi(argv[3]) : 768, G = argc > 4 ? atoi(argv[4]) : 16,
      T = argc > 5 ? atoi(argv[5]) : 1;
  sl_gmm_desc d = sl_gmm_desc_default();
  d.m = M, d.k = K, d.n = N, d.num_groups = d.num_local_groups = G;
  d.lhs_dtype = d.rhs_dtype = SL_DTYPE_BF16;
  d.out_dtype = SL_DTYPE_F32;
  uint16_t *lhs = malloc(2ull * M * K), *rhs = malloc(2ull * G * K * N), *rt = malloc(2ull * M * N);
  float *out = malloc(4ull * M * N), *tout = malloc(4ull * G * K * N);
  for (size_t i = 0; i < (size_t)M * K; ++i) lhs[i] = f32_to_bf16((float)rand() / RAND_MAX - 0.5f);
  for (size_t i = 0; i < (size_t)G * K * N; ++i) rhs[i] = f32_to_bf16((float)rand() / RAND_MAX - 0.5f);
  for (size_t i = 0; i < (size_t)M * N; ++i) rt[i] = f32_to_bf16((float)rand() / RAND_MAX - 0.5f);
  int32_t *gs = calloc(G, 4);
  for (int r = 0; r < M; ++r) gs[rand() % G]++;
  double best = 1e30, tbest = 1e30;
  for (int it = 0; it < 5; ++it) {
    double t0 = now();
    if (sl_gmm_cpu(&d, lhs, rhs, gs, NULL, out, T)) return printf("%s\n", sl_last_error()), 1;
    double t1 = now();
    if (sl_tgmm_cpu(&d, lhs, rt, gs, NULL, tout, T)) return printf("%s\n", sl_last_error()), 1;
    double t2 = now();
    best = t1 - t0 < best ? t1 - t0 : best;
    tbest = t2 - t1 < tbest ? t2 - t1 : tbest;
  }
  double fl = 2.0 * M * K * N;
  printf("M=%d K=%d N=%d G=%d threads=%d  gmm %.2f ms %.1f GFLOP/s  tgmm %.2f ms %.1f GFLOP/s\n", M,
         K, N, G, T, best * 1e3, fl / best / 1e9, tbest * 1e3, fl / tbest / 1e9);
  return 0;
}
