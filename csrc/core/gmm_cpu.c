/*
 * CPU grouped GEMM: gmm (ragged rows) and tgmm (ragged contraction), see include/sluice.h.
 *
 * One blocked kernel serves both. Each task computes one MB x NB tile of an output: it packs
 * KB-deep panels of A (MB x KB) and B (KB x NB) into f32 (this is where bf16/f16 are widened and
 * where the transposes of tgmm and transpose_rhs happen), then runs a register-blocked
 * micro-kernel over them. Tasks are independent and spread over OpenMP threads.
 *   gmm:  tile = (group, MB rows of the group, NB columns);     contraction over K.
 *   tgmm: tile = (group, MB rows of K,         NB columns);     contraction over the group's rows.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "internal.h"

/* MR x NR: the block of C the micro-kernel keeps in registers, MR rows of NR = 16 floats: 16 zmm
 * accumulators with AVX-512 (32 registers), 16 ymm with AVX2 or less (16 registers): enough
 * independent FMA chains to cover their latency on two FMA ports. Against 4 x 16 (8 or 4 vectors
 * of accumulators) 1.6-2x faster on a 2-core AVX-512 Xeon (bench/results/gmm-cpu.md). */
#if defined(__AVX512F__)
enum { MR = 16 };
#else
enum { MR = 8 };
#endif
enum { MB = 64, NB = 128, KB = 256, NR = 16 };

/* dst[r * ld + c] = src[r * rs + c * cs] for r < rows, c < cols, widened to f32. The dtype switch
 * is outside the loops so each copy loop is plain. */
static void pack(sl_dtype t, const void *src, int64_t rs, int64_t cs, int rows, int cols, float *dst,
                 int ld) {
  for (int r = 0; r < rows; ++r) {
    float *d = dst + (size_t)r * ld;
    if (t == SL_DTYPE_F32) {
      const float *s = (const float *)src + r * rs;
      for (int c = 0; c < cols; ++c) d[c] = s[c * cs];
    } else if (t == SL_DTYPE_BF16) {
      const uint16_t *s = (const uint16_t *)src + r * rs;
      for (int c = 0; c < cols; ++c) d[c] = sl_bf16_to_f32(s[c * cs]);
    } else {
      const uint16_t *s = (const uint16_t *)src + r * rs;
      for (int c = 0; c < cols; ++c) d[c] = sl_f16_to_f32(s[c * cs]);
    }
  }
}

/* C[MB x NB] += A[mb x kb] (row stride KB) @ B[kb x NB] (row stride NB). B is zero-padded to NB
 * columns so every inner loop has a constant trip count and vectorises; an MR x NR block of C lives
 * in registers across the whole kb loop. */
static void micro_kernel(int mb, int kb, const float *restrict A, const float *restrict B,
                         float *restrict C) {
  int i = 0;
  for (; i + MR <= mb; i += MR) {
    for (int jb = 0; jb < NB; jb += NR) {
      float acc[MR][NR];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) acc[r][c] = C[(i + r) * NB + jb + c];
      for (int p = 0; p < kb; ++p) {
        const float *b = B + (size_t)p * NB + jb;
        for (int r = 0; r < MR; ++r) {
          const float a = A[(i + r) * KB + p];
          for (int c = 0; c < NR; ++c) acc[r][c] += a * b[c];
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) C[(i + r) * NB + jb + c] = acc[r][c];
    }
  }
  for (; i < mb; ++i) {
    for (int p = 0; p < kb; ++p) {
      const float a = A[i * KB + p];
      const float *b = B + (size_t)p * NB;
      for (int c = 0; c < NB; ++c) C[i * NB + c] += a * b[c];
    }
  }
}

/* ---- checks shared by every entry point ---- */
sl_gmm_desc sl_gmm_desc_default(void) {
  sl_gmm_desc d;
  memset(&d, 0, sizeof d);
  d.struct_size = sizeof d;
  d.batch = 1;
  return d;
}

static int is_float(sl_dtype t) {
  return t == SL_DTYPE_F32 || t == SL_DTYPE_BF16 || t == SL_DTYPE_F16;
}

sl_status sl_gmm_shape_check(const sl_gmm_desc *d, const char *op) {
  if (d == NULL) return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: desc is NULL", op);
  if (d->struct_size < sizeof(sl_gmm_desc))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: desc.struct_size is %zu, expected at least %zu (set it with sizeof)",
                        op, d->struct_size, sizeof(sl_gmm_desc));
  if (d->batch < 1 || d->m < 0 || d->k < 0 || d->n < 0 || d->num_groups < 0 ||
      d->num_local_groups < 0)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: sizes must be non-negative and batch >= 1 (batch=%lld m=%lld k=%lld "
                        "n=%lld num_groups=%lld num_local_groups=%lld)",
                        op, (long long)d->batch, (long long)d->m, (long long)d->k, (long long)d->n,
                        (long long)d->num_groups, (long long)d->num_local_groups);
  if (d->num_local_groups > d->num_groups)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: num_local_groups (%lld) exceeds num_groups (%lld)", op,
                        (long long)d->num_local_groups, (long long)d->num_groups);
  if (d->m > INT32_MAX || d->k > INT32_MAX || d->n > INT32_MAX)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: m, k and n must each fit in int32", op);
  return SL_STATUS_SUCCESS;
}

sl_status sl_gmm_desc_check(const sl_gmm_desc *d, int is_tgmm) {
  const char *op = is_tgmm ? "tgmm" : "gmm";
  sl_status st = sl_gmm_shape_check(d, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if (!is_float(d->lhs_dtype) || !is_float(d->rhs_dtype) || !is_float(d->out_dtype))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: dtypes must be F32, BF16 or F16 (lhs=%d rhs=%d out=%d)", op,
                        (int)d->lhs_dtype, (int)d->rhs_dtype, (int)d->out_dtype);
  if (d->lhs_dtype != d->rhs_dtype)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: lhs dtype (%d) differs from rhs dtype (%d)",
                        op, (int)d->lhs_dtype, (int)d->rhs_dtype);
  if (is_tgmm && d->transpose_rhs)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "tgmm: transpose_rhs is not supported");
  return SL_STATUS_SUCCESS;
}

sl_status sl_gmm_local_rows(const char *op, const sl_gmm_desc *d, const int32_t *gs,
                            const int32_t *goff, int64_t b, int64_t *starts) {
  int64_t off = goff ? goff[0] : 0;
  if (off < 0 || off > d->num_groups - d->num_local_groups)
    return sl_set_error(SL_STATUS_INVALID_VALUE,
                        "%s: group_offset[%lld] = %lld is outside [0, %lld] (num_groups %lld, "
                        "local groups %lld)",
                        op, (long long)b, (long long)off,
                        (long long)(d->num_groups - d->num_local_groups), (long long)d->num_groups,
                        (long long)d->num_local_groups);
  int64_t row = 0;
  for (int64_t g = 0; g < d->num_groups; ++g) {
    if (gs[g] < 0)
      return sl_set_error(SL_STATUS_INVALID_VALUE, "%s: group_sizes[%lld] = %d is negative", op,
                          (long long)g, gs[g]);
    if (g >= off && g < off + d->num_local_groups) starts[g - off] = row;
    row += gs[g];
    if (g == off + d->num_local_groups - 1) starts[d->num_local_groups] = row;
  }
  if (d->num_local_groups == 0) starts[0] = 0;
  if (row > d->m)
    return sl_set_error(SL_STATUS_INVALID_VALUE,
                        "%s: sum(group_sizes) = %lld exceeds the %lld rows of lhs", op,
                        (long long)row, (long long)d->m);
  return SL_STATUS_SUCCESS;
}

typedef sl_gmm_task task;

typedef struct {
  const sl_gmm_desc *d;
  int is_tgmm;
  const char *lhs, *rhs;
  char *out;
  const int64_t *starts; /* [batch][G_local + 1] */
} problem;

static void run_task(const problem *P, const task *t, float *A, float *B, float *C) {
  const sl_gmm_desc *d = P->d;
  const size_t in_es = sl_dtype_size(d->lhs_dtype), out_es = sl_dtype_size(d->out_dtype);
  const int64_t M = d->m, K = d->k, N = d->n, GL = d->num_local_groups;
  const int64_t *st = P->starts + t->b * (GL + 1);
  const int64_t s = st[t->g], e = st[t->g + 1];
  const int nb = (int)(N - t->c0 < NB ? N - t->c0 : NB);
  memset(C, 0, sizeof(float) * MB * NB);
  memset(B, 0, sizeof(float) * KB * NB); /* columns past nb stay zero */
  if (!P->is_tgmm) {
    const int mb = (int)(e - t->r0 < MB ? e - t->r0 : MB);
    const char *lhs = P->lhs + (size_t)(t->b * M + t->r0) * K * in_es;
    const char *rhs = P->rhs + (size_t)((t->b * GL + t->g) * K * N) * in_es;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int kb = (int)(K - k0 < KB ? K - k0 : KB);
      pack(d->lhs_dtype, lhs + (size_t)k0 * in_es, K, 1, mb, kb, A, KB);
      if (d->transpose_rhs) /* rhs[g] is [N, K]: B[p][c] = rhs[c0 + c][k0 + p] */
        pack(d->rhs_dtype, rhs + (size_t)(t->c0 * K + k0) * in_es, 1, K, kb, nb, B, NB);
      else
        pack(d->rhs_dtype, rhs + (size_t)(k0 * N + t->c0) * in_es, N, 1, kb, nb, B, NB);
      micro_kernel(mb, kb, A, B, C);
    }
    sl_store_tile(d->out_dtype, C, NB, mb, nb, P->out + (size_t)((t->b * M + t->r0) * N + t->c0) * out_es,
               N);
  } else {
    const int mb = (int)(K - t->r0 < MB ? K - t->r0 : MB); /* tile rows are rows of K */
    const char *lhs = P->lhs + (size_t)(t->b * M) * K * in_es;
    const char *rhs = P->rhs + (size_t)(t->b * M) * N * in_es;
    for (int64_t r = s; r < e; r += KB) {
      const int kb = (int)(e - r < KB ? e - r : KB);
      /* A[i][p] = lhs[r + p][r0 + i]: the transpose of the group's rows */
      pack(d->lhs_dtype, lhs + (size_t)(r * K + t->r0) * in_es, 1, K, mb, kb, A, KB);
      pack(d->rhs_dtype, rhs + (size_t)(r * N + t->c0) * in_es, N, 1, kb, nb, B, NB);
      micro_kernel(mb, kb, A, B, C);
    }
    sl_store_tile(d->out_dtype, C, NB, mb, nb,
               P->out + (size_t)(((t->b * GL + t->g) * K + t->r0) * N + t->c0) * out_es, N);
  }
}

sl_status sl_gmm_plan(const char *op, const sl_gmm_desc *d, int is_tgmm, const int32_t *group_sizes,
                      const int32_t *group_offset, void *out, int64_t mb, int64_t nb,
                      int64_t **starts_out, sl_gmm_task **tasks_out, int64_t *ntasks_out) {
  const int64_t B = d->batch, M = d->m, K = d->k, N = d->n, G = d->num_groups,
                GL = d->num_local_groups;
  int64_t *starts = malloc(sizeof(int64_t) * (size_t)(B * (GL + 1)));
  if (!starts) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  for (int64_t b = 0; b < B; ++b) {
    sl_status st = sl_gmm_local_rows(op, d, group_sizes + b * G,
                                     group_offset ? group_offset + b : NULL, b,
                                     starts + b * (GL + 1));
    if (st != SL_STATUS_SUCCESS) {
      free(starts);
      return st;
    }
  }
  /* Enumerate the tiles; zero what no tile writes (gmm: rows outside the local groups). */
  const size_t out_es = sl_dtype_size(d->out_dtype);
  const int64_t col_tiles = (N + nb - 1) / nb;
  int64_t ntasks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t *s = starts + b * (GL + 1);
    if (!is_tgmm) {
      char *o = (char *)out + (size_t)(b * M * N) * out_es;
      memset(o, 0, (size_t)(s[0] * N) * out_es);
      memset(o + (size_t)(s[GL] * N) * out_es, 0, (size_t)((M - s[GL]) * N) * out_es);
      for (int64_t g = 0; g < GL; ++g) ntasks += (s[g + 1] - s[g] + mb - 1) / mb * col_tiles;
    } else {
      ntasks += GL * ((K + mb - 1) / mb) * col_tiles;
    }
  }
  sl_gmm_task *tasks = malloc(sizeof(sl_gmm_task) * (size_t)(ntasks > 0 ? ntasks : 1));
  if (!tasks) {
    free(starts);
    return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  }
  int64_t n = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t *s = starts + b * (GL + 1);
    for (int64_t g = 0; g < GL; ++g) {
      const int64_t r_begin = is_tgmm ? 0 : s[g], r_end = is_tgmm ? K : s[g + 1];
      for (int64_t r = r_begin; r < r_end; r += mb)
        for (int64_t c = 0; c < N; c += nb) tasks[n++] = (sl_gmm_task){b, g, r, c};
    }
  }
  *starts_out = starts, *tasks_out = tasks, *ntasks_out = ntasks;
  return SL_STATUS_SUCCESS;
}

static sl_status run(int is_tgmm, const sl_gmm_desc *d, const void *lhs, const void *rhs,
                     const int32_t *group_sizes, const int32_t *group_offset, void *out,
                     int num_threads) {
  const char *op = is_tgmm ? "tgmm" : "gmm";
  sl_status st = sl_gmm_desc_check(d, is_tgmm);
  if (st != SL_STATUS_SUCCESS) return st;
  const int64_t B = d->batch, M = d->m, K = d->k, N = d->n, G = d->num_groups,
                GL = d->num_local_groups;
  const int64_t out_elems = is_tgmm ? B * GL * K * N : B * M * N;
  if (out_elems > 0 && out == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: out is NULL", op);
  if (out_elems == 0) return SL_STATUS_SUCCESS;
  if ((B * M * K > 0 && lhs == NULL) || (G > 0 && group_sizes == NULL) ||
      ((is_tgmm ? B * M * N : B * GL * K * N) > 0 && rhs == NULL))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: lhs, rhs or group_sizes is NULL", op);

  int64_t *starts, ntasks;
  task *tasks;
  st = sl_gmm_plan(op, d, is_tgmm, group_sizes, group_offset, out, MB, NB, &starts, &tasks, &ntasks);
  if (st != SL_STATUS_SUCCESS) return st;

  problem P = {d, is_tgmm, (const char *)lhs, (const char *)rhs, (char *)out, starts};
  int failed = 0;
#ifdef _OPENMP
  const int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(nt) if (ntasks > 1) reduction(| : failed)
#endif
  {
    float *A = malloc(sizeof(float) * MB * KB), *Bp = malloc(sizeof(float) * KB * NB),
          *C = malloc(sizeof(float) * MB * NB);
    if (!A || !Bp || !C) failed = 1;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < ntasks; ++i)
      if (A && Bp && C) run_task(&P, &tasks[i], A, Bp, C);
    free(A);
    free(Bp);
    free(C);
  }
  (void)num_threads;
  free(tasks);
  free(starts);
  if (failed) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  return SL_STATUS_SUCCESS;
}

sl_status sl_gmm_cpu(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                     const int32_t *group_sizes, const int32_t *group_offset, void *out,
                     int num_threads) {
  return run(0, desc, lhs, rhs, group_sizes, group_offset, out, num_threads);
}

sl_status sl_tgmm_cpu(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                      const int32_t *group_sizes, const int32_t *group_offset, void *out,
                      int num_threads) {
  return run(1, desc, lhs, rhs, group_sizes, group_offset, out, num_threads);
}
