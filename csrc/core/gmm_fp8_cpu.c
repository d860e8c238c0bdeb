/*
 * CPU FP8 grouped GEMM: gmm_fp8 and tgmm_fp8 (include/sluice.h), with DeepSeek-V3's fine-grained
 * scaling, the reference the CUDA kernels are tested against.
 *
 * The contraction runs in pieces that each lie in one 128-long scale block. A piece's sum of e4m3
 * products is taken in f32 (each product is exact in f32: 4 x 4 significant bits), then multiplied
 * by the product of its two scales and added to the f32 total:
 *     total += piece * (scale_a * scale_b)
 * which is the structure of the GPU kernels (their tensor cores sum a piece, the f32 promotion
 * scales it). The output is rounded once, to bf16 (nearest even) or kept f32.
 *
 * Work is split as in gmm_cpu.c: each task computes one MB x NB tile of an output, decodes each
 * piece's panels of A (MB x piece) and B (piece x NB) from e4m3 to f32 through a 256-entry table,
 * and runs a register-blocked micro-kernel over them; tasks are spread over OpenMP threads.
 *   gmm_fp8:  tile = (group, MB rows of the group, NB columns); pieces = the 128-blocks of K.
 *             NB = 128, so a tile's columns share one rhs scale block per piece.
 *   tgmm_fp8: tile = (group, MB rows of K, NB columns of N); pieces = the group's rows cut at the
 *             absolute 128-row block edges (its first and last piece may be partial), each with
 *             one scale per output row (lhs) and per output column (rhs): an outer product.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "convert.h"
#include "internal.h"

/* MR x NR: the block of a piece's sums the micro-kernel keeps in registers (see gmm_cpu.c). */
#if defined(__AVX512F__)
enum { MR = 16 };
#else
enum { MR = 8 };
#endif
enum { MB = 64, NB = 128, PK = 128, NR = 16 }; /* PK: the scale block along the contraction */

/* float8_e4m3fn -> f32, exactly: 1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 holds
 * the subnormals m * 2^-9; 0x7f and 0xff are NaN; there is no infinity. */
static float e4m3_to_f32(uint8_t v) {
  const uint32_t sign = (uint32_t)(v & 0x80u) << 24, e = (v >> 3) & 0xfu, m = v & 0x7u;
  if (e == 15u && m == 7u) return sl_bits_f32(sign | 0x7fc00000u);
  if (e == 0u) return sl_bits_f32(sign | sl_f32_bits((float)m * 0x1p-9f));
  return sl_bits_f32(sign | (e + 120u) << 23 | m << 20);
}

/* ---- descriptor checks ---- */
sl_status sl_gmm_fp8_check(const sl_gmm_desc *d, int is_tgmm, const char *op) {
  sl_status st = sl_gmm_shape_check(d, op);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->lhs_dtype != SL_DTYPE_F8E4M3 || d->rhs_dtype != SL_DTYPE_F8E4M3)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: lhs_dtype and rhs_dtype must be SL_DTYPE_F8E4M3 (%d), got lhs=%d "
                        "rhs=%d",
                        op, (int)SL_DTYPE_F8E4M3, (int)d->lhs_dtype, (int)d->rhs_dtype);
  if (d->out_dtype != SL_DTYPE_BF16 && d->out_dtype != SL_DTYPE_F32)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: out_dtype must be SL_DTYPE_BF16 (%d) or SL_DTYPE_F32 (%d), got %d", op,
                        (int)SL_DTYPE_BF16, (int)SL_DTYPE_F32, (int)d->out_dtype);
  if (!is_tgmm && !d->transpose_rhs)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: transpose_rhs must be 1 (rhs [G_local, N, K], the contraction "
                        "contiguous: the only FP8 layout)",
                        op);
  if (is_tgmm && d->transpose_rhs)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: transpose_rhs must be 0 (the operands are lhs_t [K, M] and rhs_t "
                        "[N, M])",
                        op);
  return SL_STATUS_SUCCESS;
}

/* ---- the kernel ---- */
typedef struct {
  const sl_gmm_desc *d;
  int is_tgmm;
  const uint8_t *lhs,
      *rhs; /* gmm: lhs [B][M][K], rhs [B][GL][N][K]; tgmm: lhs_t [B][K][M], rhs_t [B][N][M] */
  const float *lhs_scale, *rhs_scale;
  char *out;
  const int64_t *starts; /* [batch][G_local + 1] */
  const float *lut;      /* e4m3 byte -> f32 */
} problem;

typedef sl_gmm_task task;

/* C[i][c] += (sum_p A[i][p] B[p][c]) * (srow[i] * scol[c]) for i < mb, c < NB: one piece (kb <= PK
 * long) of the contraction, summed in f32 and scaled once. A has row stride PK, B row stride NB
 * (zero past the tile's columns); an MR x NR block of the piece's sums stays in registers. */
static void piece_kernel(int mb, int kb, const float *restrict A, const float *restrict B,
                         const float *restrict srow, const float *restrict scol,
                         float *restrict C) {
  int i = 0;
  for (; i + MR <= mb; i += MR) {
    for (int jb = 0; jb < NB; jb += NR) {
      float acc[MR][NR];
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) acc[r][c] = 0.0f;
      for (int p = 0; p < kb; ++p) {
        const float *b = B + (size_t)p * NB + jb;
        for (int r = 0; r < MR; ++r) {
          const float a = A[(i + r) * PK + p];
          for (int c = 0; c < NR; ++c) acc[r][c] += a * b[c];
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c)
          C[(i + r) * NB + jb + c] += acc[r][c] * (srow[i + r] * scol[jb + c]);
    }
  }
  for (; i < mb; ++i) {
    float acc[NB];
    for (int c = 0; c < NB; ++c) acc[c] = 0.0f;
    for (int p = 0; p < kb; ++p) {
      const float a = A[i * PK + p];
      const float *b = B + (size_t)p * NB;
      for (int c = 0; c < NB; ++c) acc[c] += a * b[c];
    }
    for (int c = 0; c < NB; ++c) C[i * NB + c] += acc[c] * (srow[i] * scol[c]);
  }
}

/* dst[r * PK + p] = lut[src[r * ld + p]] for r < rows, p < kb: rows whose piece is contiguous. */
static void decode_rows(const float *lut, const uint8_t *src, int64_t ld, int rows, int kb,
                        float *dst) {
  for (int r = 0; r < rows; ++r) {
    const uint8_t *s = src + r * ld;
    float *o = dst + (size_t)r * PK;
    for (int p = 0; p < kb; ++p) o[p] = lut[s[p]];
  }
}

/* dst[p * NB + c] = lut[src[c * ld + p]] for c < cols, p < kb: the transpose of `cols` rows whose
 * piece is contiguous (B's columns are rows of rhs). Columns past cols stay as they are (zero). */
static void decode_cols(const float *lut, const uint8_t *src, int64_t ld, int cols, int kb,
                        float *dst) {
  for (int c = 0; c < cols; ++c) {
    const uint8_t *s = src + c * ld;
    for (int p = 0; p < kb; ++p) dst[(size_t)p * NB + c] = lut[s[p]];
  }
}

static void run_task(const problem *P, const task *t, float *A, float *Bp, float *C, float *srow,
                     float *scol) {
  const sl_gmm_desc *d = P->d;
  const int64_t M = d->m, K = d->k, N = d->n, GL = d->num_local_groups;
  const int64_t *st = P->starts + t->b * (GL + 1);
  const int64_t s = st[t->g], e = st[t->g + 1];
  const int nb = (int)(N - t->c0 < NB ? N - t->c0 : NB);
  const size_t out_es = sl_dtype_size(d->out_dtype);
  memset(C, 0, sizeof(float) * MB * NB);
  memset(Bp, 0, sizeof(float) * PK * NB); /* columns past nb stay zero */
  for (int c = nb; c < NB; ++c) scol[c] = 0.0f;
  if (!P->is_tgmm) {
    const int64_t nkb = (K + PK - 1) / PK, nnb = (N + NB - 1) / NB;
    const int mb = (int)(e - t->r0 < MB ? e - t->r0 : MB);
    const uint8_t *lhs = P->lhs + (t->b * M + t->r0) * K;
    const uint8_t *rhs = P->rhs + ((t->b * GL + t->g) * N + t->c0) * K;
    const float *ls = P->lhs_scale + (t->b * M + t->r0) * nkb;
    const float *rs = P->rhs_scale + ((t->b * GL + t->g) * nnb + t->c0 / NB) * nkb;
    for (int64_t kp = 0; kp < nkb; ++kp) {
      const int kb = (int)(K - kp * PK < PK ? K - kp * PK : PK);
      decode_rows(P->lut, lhs + kp * PK, K, mb, kb, A);
      decode_cols(P->lut, rhs + kp * PK, K, nb, kb, Bp); /* B[p][c] = rhs[g][c0 + c][k0 + p] */
      for (int i = 0; i < mb; ++i) srow[i] = ls[i * nkb + kp];
      for (int c = 0; c < nb; ++c) scol[c] = rs[kp];
      piece_kernel(mb, kb, A, Bp, srow, scol, C);
    }
    sl_store_tile(d->out_dtype, C, NB, mb, nb, P->out + (size_t)((t->b * M + t->r0) * N + t->c0) * out_es,
               N);
  } else {
    const int64_t nmb = (M + PK - 1) / PK;
    const int mb = (int)(K - t->r0 < MB ? K - t->r0 : MB); /* tile rows are rows of K */
    const uint8_t *lhs = P->lhs + (t->b * K + t->r0) * M;  /* lhs_t[r0 + i][row] */
    const uint8_t *rhs = P->rhs + (t->b * N + t->c0) * M;  /* rhs_t[c0 + c][row] */
    const float *ls = P->lhs_scale + t->b * nmb * K, *rs = P->rhs_scale + t->b * nmb * N;
    for (int64_t p0 = s; p0 < e;) {
      const int64_t blk = p0 / PK, p1 = (blk + 1) * PK < e ? (blk + 1) * PK : e;
      const int kb = (int)(p1 - p0);
      decode_rows(P->lut, lhs + p0, M, mb, kb, A);
      decode_cols(P->lut, rhs + p0, M, nb, kb, Bp);
      for (int i = 0; i < mb; ++i) srow[i] = ls[blk * K + t->r0 + i];
      for (int c = 0; c < nb; ++c) scol[c] = rs[blk * N + t->c0 + c];
      piece_kernel(mb, kb, A, Bp, srow, scol, C);
      p0 = p1;
    }
    sl_store_tile(d->out_dtype, C, NB, mb, nb,
               P->out + (size_t)(((t->b * GL + t->g) * K + t->r0) * N + t->c0) * out_es, N);
  }
}

static sl_status run(int is_tgmm, const sl_gmm_desc *d, const void *lhs, const float *lhs_scale,
                     const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                     const int32_t *group_offset, void *out, int num_threads) {
  const char *op = is_tgmm ? "tgmm_fp8" : "gmm_fp8";
  sl_status st = sl_gmm_fp8_check(d, is_tgmm, op);
  if (st != SL_STATUS_SUCCESS) return st;
  const int64_t B = d->batch, M = d->m, K = d->k, N = d->n, G = d->num_groups,
                GL = d->num_local_groups;
  const int64_t out_elems = is_tgmm ? B * GL * K * N : B * M * N;
  if (out_elems > 0 && out == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: out is NULL", op);
  if (out_elems == 0) return SL_STATUS_SUCCESS;
  /* Element counts of the operands; each pointer may be NULL only where its count is 0. */
  const int64_t nk = (K + PK - 1) / PK, nn = (N + NB - 1) / NB, nm = (M + PK - 1) / PK;
  const int64_t lhs_n = B * M * K, rhs_n = is_tgmm ? B * M * N : B * GL * N * K;
  const int64_t ls_n = is_tgmm ? B * nm * K : B * M * nk,
                rs_n = is_tgmm ? B * nm * N : B * GL * nn * nk;
  if ((lhs_n > 0 && lhs == NULL) || (rhs_n > 0 && rhs == NULL) || (ls_n > 0 && lhs_scale == NULL) ||
      (rs_n > 0 && rhs_scale == NULL) || (G > 0 && group_sizes == NULL))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: lhs, lhs_scale, rhs, rhs_scale or group_sizes is NULL", op);

  int64_t *starts, ntasks;
  task *tasks;
  st = sl_gmm_plan(op, d, is_tgmm, group_sizes, group_offset, out, MB, NB, &starts, &tasks, &ntasks);
  if (st != SL_STATUS_SUCCESS) return st;

  float lut[256];
  for (int v = 0; v < 256; ++v) lut[v] = e4m3_to_f32((uint8_t)v);
  problem P = {d,         is_tgmm,   (const uint8_t *)lhs, (const uint8_t *)rhs,
               lhs_scale, rhs_scale, (char *)out,          starts,
               lut};
  int failed = 0;
#ifdef _OPENMP
  const int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(nt) if (ntasks > 1) reduction(| : failed)
#endif
  {
    float *A = malloc(sizeof(float) * MB * PK), *Bp = malloc(sizeof(float) * PK * NB),
          *C = malloc(sizeof(float) * MB * NB), *srow = malloc(sizeof(float) * MB),
          *scol = malloc(sizeof(float) * NB);
    const int ok = A && Bp && C && srow && scol;
    if (!ok) failed = 1;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (int64_t i = 0; i < ntasks; ++i)
      if (ok) run_task(&P, &tasks[i], A, Bp, C, srow, scol);
    free(A);
    free(Bp);
    free(C);
    free(srow);
    free(scol);
  }
  (void)num_threads;
  free(tasks);
  free(starts);
  if (failed) return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "%s: out of host memory", op);
  return SL_STATUS_SUCCESS;
}

sl_status sl_gmm_fp8_cpu(const sl_gmm_desc *desc, const void *lhs, const float *lhs_scale,
                         const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                         const int32_t *group_offset, void *out, int num_threads) {
  return run(0, desc, lhs, lhs_scale, rhs, rhs_scale, group_sizes, group_offset, out, num_threads);
}

sl_status sl_tgmm_fp8_cpu(const sl_gmm_desc *desc, const void *lhs_t, const float *lhs_scale,
                          const void *rhs_t, const float *rhs_scale, const int32_t *group_sizes,
                          const int32_t *group_offset, void *out, int num_threads) {
  return run(1, desc, lhs_t, lhs_scale, rhs_t, rhs_scale, group_sizes, group_offset, out,
             num_threads);
}
