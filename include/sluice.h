/*
 * sluice: dropless Mixture-of-Experts primitives.
 *
 * The public C API. This is the only header a user includes.
 *
 * Conventions (NCCL's):
 *  - every call returns an sl_status; sl_status_string() names it and sl_last_error() gives the
 *    detail of the last failure on the calling thread (thread-local, valid until the next failing
 *    call on that thread);
 *  - descriptor structs start with their own size (set it with sizeof) so they can grow;
 *  - calls that touch a GPU take a cudaStream_t (passed as void*) last and are stream-ordered: they
 *    enqueue work and return without synchronising;
 *  - sizes that only the device knows (group sizes, group offsets, expert ids) are never trusted:
 *    kernels clamp them (see each call) so no input makes them read or write out of bounds. CPU
 *    calls can see them and reject bad values with SL_STATUS_INVALID_VALUE.
 */
#ifndef SLUICE_H_
#define SLUICE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SLUICE_VERSION_MAJOR 0
#define SLUICE_VERSION_MINOR 1
#define SLUICE_VERSION_PATCH 0

typedef enum sl_status {
  SL_STATUS_SUCCESS = 0,
  SL_STATUS_INVALID_ARGUMENT = 1, /* a shape, dtype or attribute the host can check is wrong */
  SL_STATUS_INVALID_VALUE = 2,    /* a data-dependent value (a group size, an expert id) is wrong */
  SL_STATUS_UNSUPPORTED = 3,      /* valid, but not built or not implemented for this device */
  SL_STATUS_OUT_OF_MEMORY = 4,
  SL_STATUS_CUDA_ERROR = 5,
  SL_STATUS_TIMEOUT = 6, /* a bounded wait for a peer ran out */
  SL_STATUS_INTERNAL = 7,
} sl_status;

typedef enum sl_dtype {
  SL_DTYPE_F32 = 0,
  SL_DTYPE_BF16 = 1,
  SL_DTYPE_F16 = 2,
  SL_DTYPE_I32 = 3,
} sl_dtype;

/* The name of a status ("SL_STATUS_INVALID_ARGUMENT"). Never NULL. Thread-safe. */
const char *sl_status_string(sl_status status);

/* The message of the last failing call on this thread, or "" if none. Thread-safe (thread-local). */
const char *sl_last_error(void);

/* Bytes per element of a dtype, 0 for an unknown value. */
size_t sl_dtype_size(sl_dtype dtype);

/* The library's version as MAJOR*10000 + MINOR*100 + PATCH. */
int sl_version(void);

/* ------------------------------------------------------------------------------------------------
 * Grouped GEMM
 *
 * gmm (ragged rows):  for each local group j in [0, num_local_groups), global group g = offset + j,
 *   rows [start_g, start_g + size_g) of lhs, where start_g = sum(group_sizes[0:g]):
 *     out[rows of g] = lhs[rows of g] @ rhs[j]          rhs [G_local, K, N]
 *     out[rows of g] = lhs[rows of g] @ rhs[j]^T        rhs [G_local, N, K] (transpose_rhs)
 *   Every other row of out (rows of non-local groups, rows past the last group) is zero.
 *   lhs [M, K], out [M, N], all row-major and dense.
 *
 * tgmm (ragged contraction, the weight gradient):
 *     out[j] = lhs[rows of g]^T @ rhs[rows of g]        lhs [M, K], rhs [M, N], out [G_local, K, N]
 *   A local group with no rows gives zeros.
 *
 * Both take an optional leading batch dimension (batch >= 1): every operand is then `batch`
 * independent problems laid out one after the other (lhs [B,M,K], rhs [B,G_local,...],
 * group_sizes [B,G], group_offset [B], out [B,...]). This is how vmap reaches the kernels.
 *
 * group_sizes is int32 [num_groups] (num_groups = G, the global count), group_offset is int32 [1]
 * or NULL (then 0). Both live where the data lives (host memory for the CPU calls, device memory for
 * the CUDA calls).
 *
 * Data-dependent values:
 *   CPU: a negative size, sum(group_sizes) > M, or offset outside [0, G - G_local] returns
 *        SL_STATUS_INVALID_VALUE with a message naming the value, and out is not written.
 *   CUDA: negative sizes count as 0, row ranges are clamped to [0, M), the offset is clamped to
 *        [0, G - G_local]. Nothing is read or written out of bounds; the result is then that of the
 *        clamped sizes. With SLUICE_DEBUG=1 in the environment, the CUDA launchers check on the host
 *        after the kernel (a synchronisation: debugging only) and return SL_STATUS_INVALID_VALUE.
 * ----------------------------------------------------------------------------------------------*/
typedef struct sl_gmm_desc {
  size_t struct_size;      /* sizeof(sl_gmm_desc) */
  int64_t batch;           /* independent problems, >= 1 */
  int64_t m;               /* rows of lhs (gmm, tgmm) */
  int64_t k;               /* contraction dim of gmm; rows of each out[g] for tgmm */
  int64_t n;               /* columns of out */
  int64_t num_groups;      /* G: length of group_sizes */
  int64_t num_local_groups;/* G_local: groups in rhs (gmm) or out (tgmm); <= num_groups */
  sl_dtype lhs_dtype;      /* F32, BF16 or F16 */
  sl_dtype rhs_dtype;      /* must equal lhs_dtype */
  sl_dtype out_dtype;      /* F32, BF16 or F16 */
  int transpose_rhs;       /* gmm only: rhs is [G_local, N, K] */
} sl_gmm_desc;

/* A descriptor filled with defaults (batch 1, struct_size set, everything else 0 / F32). */
sl_gmm_desc sl_gmm_desc_default(void);

/* Checks a descriptor (sizes non-negative, dtypes supported, G_local <= G). is_tgmm picks the op the
 * message names. Used by every entry point; callable on its own. */
sl_status sl_gmm_desc_check(const sl_gmm_desc *desc, int is_tgmm);

/* CPU grouped GEMM. Host pointers. Blocking; uses up to `num_threads` threads (<= 0: OpenMP's
 * default). Thread-safe for distinct outputs. f32 accumulation, round-to-nearest-even output. */
sl_status sl_gmm_cpu(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                     const int32_t *group_sizes, const int32_t *group_offset, void *out,
                     int num_threads);

/* CPU weight-gradient grouped GEMM (see above). */
sl_status sl_tgmm_cpu(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                      const int32_t *group_sizes, const int32_t *group_offset, void *out,
                      int num_threads);

/* CUDA grouped GEMM. Device pointers, stream-ordered on `stream` (a cudaStream_t), no host sync
 * (unless SLUICE_DEBUG=1). Picks the kernel by the current device's compute capability: sm_90 gets
 * the wgmma/TMA kernel, sm_80 and up the mma.sync kernel. `workspace` is device memory of at least
 * sl_gmm_cuda_workspace_size() bytes (O(batch * G)), or NULL to let the call use none where it can.
 * The size is linear in desc->batch (batch * the size for batch 1), so a caller that sizes it for
 * one problem and then batches (vmap) stays correct.
 * Returns SL_STATUS_UNSUPPORTED when the library was built without CUDA. */
size_t sl_gmm_cuda_workspace_size(const sl_gmm_desc *desc);
sl_status sl_gmm_cuda(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                      const int32_t *group_sizes, const int32_t *group_offset, void *out,
                      void *workspace, void *stream);
sl_status sl_tgmm_cuda(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                       const int32_t *group_sizes, const int32_t *group_offset, void *out,
                       void *workspace, void *stream);

/* 1 if the library was built with CUDA kernels, else 0. */
int sl_has_cuda(void);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_H_ */
