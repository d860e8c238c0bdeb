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
  SL_DTYPE_F8E4M3 = 4, /* float8_e4m3fn (1 sign, 4 exponent, 3 mantissa bits; no inf): FP8 gmm */
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
  int skip_unused_rows;    /* gmm on CUDA: 1 = rows of out outside the local groups are left
                              unwritten (unspecified), for callers that never read them (an MoE
                              layer's worst-case-sized expert block); 0 = zeroed, as ragged_dot.
                              The CPU path zeroes them either way. */
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
 * the wgmma/TMA kernels, sm_80 and up the mma.sync kernel (gmm_launch.cu's table). `workspace` is
 * device memory of at least sl_gmm_cuda_workspace_size() bytes (O(batch * G): a group table and a
 * tile counter); it is required: NULL returns SL_STATUS_INVALID_ARGUMENT. The group table is built
 * in shared memory whenever it fits beside the kernel's pipeline, in the workspace otherwise.
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

/* ------------------------------------------------------------------------------------------------
 * FP8 grouped GEMM with DeepSeek-V3's fine-grained scaling (python/sluice/ops/fp8.py states the
 * quantization). Operands float8_e4m3fn (SL_DTYPE_F8E4M3), each with one f32 scale per block of 128
 * along the contraction; output BF16 or F32 (out_dtype); rhs_dtype = lhs_dtype = SL_DTYPE_F8E4M3.
 * Accumulation: the contraction runs in pieces of 128 (the scale blocks); a piece's sum of e4m3
 * products is multiplied by its two scales and added to an f32 total.
 *
 * gmm_fp8 (the forward and the input gradient), desc as gmm's with transpose_rhs = 1, the only
 * layout (the tensor cores read FP8 operands with the contraction contiguous):
 *     out[rows of g] = (lhs . lhs_scale)[rows of g] @ ((rhs . rhs_scale)[j])^T
 *     lhs [M, K], lhs_scale [M, ceil(K/128)]                            (1 x 128 blocks)
 *     rhs [G_local, N, K], rhs_scale [G_local, ceil(N/128), ceil(K/128)] (128 x 128 blocks)
 *   Rows of out outside the local groups: as gmm (zero, or unwritten with skip_unused_rows on CUDA).
 * tgmm_fp8 (the weight gradient), desc as tgmm's (m rows, out [G_local, K, N]); both operands
 *   transposed, the ragged rows contiguous:
 *     out[j] = (lhs_t . lhs_scale)[:, rows of g] @ ((rhs_t . rhs_scale)[:, rows of g])^T
 *     lhs_t [K, M], lhs_scale [ceil(M/128), K]; rhs_t [N, M], rhs_scale [ceil(M/128), N]
 *   The scales are those of x [M, K] and dy [M, N] in 128 x 1 blocks: absolute 128-row blocks, one
 *   scale per column, shared by the groups a block straddles. A local group with no rows gives 0.
 * (x . s: every element times the scale of its block.) Batch, group_sizes, group_offset, the
 * data-dependent values and the workspace (sl_gmm_cuda_workspace_size) as gmm and tgmm.
 * The CPU calls take any sizes. The CUDA calls need an sm_90 device and 16-byte rows: K % 16 == 0
 * (gmm_fp8), M % 16 == 0 and K % 4 == 0 (tgmm_fp8), N % 8 == 0, 16-byte aligned operands and
 * scales, and return SL_STATUS_UNSUPPORTED otherwise (zero padding changes no result: the Python
 * ops pad).
 * ----------------------------------------------------------------------------------------------*/
sl_status sl_gmm_fp8_cpu(const sl_gmm_desc *desc, const void *lhs, const float *lhs_scale,
                         const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                         const int32_t *group_offset, void *out, int num_threads);
sl_status sl_tgmm_fp8_cpu(const sl_gmm_desc *desc, const void *lhs_t, const float *lhs_scale,
                          const void *rhs_t, const float *rhs_scale, const int32_t *group_sizes,
                          const int32_t *group_offset, void *out, int num_threads);
sl_status sl_gmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs, const float *lhs_scale,
                          const void *rhs, const float *rhs_scale, const int32_t *group_sizes,
                          const int32_t *group_offset, void *out, void *workspace, void *stream);
sl_status sl_tgmm_fp8_cuda(const sl_gmm_desc *desc, const void *lhs_t, const float *lhs_scale,
                           const void *rhs_t, const float *rhs_scale, const int32_t *group_sizes,
                           const int32_t *group_offset, void *out, void *workspace, void *stream);

/* FP8 block quantization on the GPU, bit for bit python/sluice/ops/fp8.py's `quantize` (the CPU
 * runs that jnp code itself). x [batch, x_rows, cols] (F32, BF16 or F16) is read as
 * [batch, rows, cols] (rows >= x_rows); rows past x_rows, and rows outside [lo, hi) of
 * row_range[b] = (lo, hi) (device int32 [batch, 2], or NULL), read as zero. Blocks of
 * block_rows x block_cols: (1, 128), (128, 1) or (128, 128); power_of_two rounds each scale up to
 * a power of two. Writes q [batch, rows, cols] and/or its transpose q_t [batch, cols, rows]
 * (float8_e4m3fn; either may be NULL, not both) and the f32 scale: [batch, rows, ceil(cols/128)]
 * for (1, 128), [batch, ceil(rows/128), cols] for (128, 1), [batch, ceil(rows/128),
 * ceil(cols/128)] for (128, 128). Stream-ordered, no host sync. */
typedef struct sl_quantize_fp8_desc {
  size_t struct_size; /* sizeof(sl_quantize_fp8_desc) */
  int64_t batch, rows, cols, x_rows;
  sl_dtype dtype; /* of x */
  int block_rows, block_cols;
  int power_of_two;
  int64_t src_rows; /* sl_quantize_fp8_both_cuda with a gather: the rows of x (else unused) */
} sl_quantize_fp8_desc;
sl_status sl_quantize_fp8_cuda(const sl_quantize_fp8_desc *desc, const void *x,
                               const int32_t *row_range, void *q, void *q_t, float *scale,
                               void *stream);
/* Both layouts of an activation in one pass over x, bit for bit the two sl_quantize_fp8_cuda calls
 * they stand for (an FP8 matmul's lhs, and its weight gradient's operand):
 *   q [batch, x_rows, cols] with scale [batch, x_rows, ceil(cols/128)]: 1 x 128 blocks of every
 *   row of x (row_range does not apply);
 *   q_t [batch, cols, rows] with scale_t [batch, ceil(rows/128), cols]: 128 x 1 blocks of x read
 *   as [batch, rows, cols], rows past x_rows and outside row_range zero, written transposed.
 * gather (device int32 [batch, x_rows], or NULL) quantizes rows of x picked by index without
 * writing them out: row r of the activation is row gather[b, r] of x [batch, src_rows, cols], and
 * zero where that index is outside [0, src_rows) (fan-out's expert-sorted copies of token rows).
 * desc's block must be (1, 128). All four outputs are required. */
sl_status sl_quantize_fp8_both_cuda(const sl_quantize_fp8_desc *desc, const void *x,
                                    const int32_t *row_range, const int32_t *gather, void *q,
                                    float *scale, void *q_t, float *scale_t, void *stream);

/* The SwiGLU's activation, and its gradient, quantized in both layouts as they are computed (an
 * FP8 expert block's down projection and its gate/up projection's backward): bit for bit
 * sl_swiglu_fwd_cuda's act (sl_swiglu_bwd_cuda's dh) with the rows outside row_range zero, then
 * sl_quantize_fp8_both_cuda on it, without the 16-bit array written. desc describes the quantized
 * array as sl_quantize_fp8_both_cuda's does (block 1 x 128; dtype BF16 or F16, h's): the forward's
 * act [batch, x_rows, F] (cols = F, a multiple of 8), the backward's dh [batch, x_rows, 2F]
 * (cols = 2F). h is [batch, x_rows, 2F], dact [batch, x_rows, F], row_weights f32 [batch, x_rows]
 * or NULL (1); rows outside row_range [lo, hi) (device int32 [batch, 2], or NULL: all) are zero.
 * With row_weights the backward also writes drow_weight_parts f32 [batch, x_rows, ceil(F/128)]:
 * part j of row r is the sum of dact[r, c] * silu(gate[r, c]) * up[r, c] over the columns c of
 * [128 j, 128 j + 128) (0 outside row_range); d w[r] is the sum of its row. h, dact, q and q_t
 * 16-byte aligned. */
sl_status sl_swiglu_quantize_fp8_cuda(const sl_quantize_fp8_desc *desc, const void *h,
                                      const float *row_weights, const int32_t *row_range, void *q,
                                      float *scale, void *q_t, float *scale_t, void *stream);
sl_status sl_swiglu_bwd_quantize_fp8_cuda(const sl_quantize_fp8_desc *desc, const void *dact,
                                          const void *h, const float *row_weights,
                                          const int32_t *row_range, void *q, float *scale,
                                          void *q_t, float *scale_t, float *drow_weight_parts,
                                          void *stream);

/* 1 if the library was built with CUDA kernels, else 0. */
int sl_has_cuda(void);

/* ------------------------------------------------------------------------------------------------
 * swiglu: the SwiGLU activation of an expert block, over the groups' rows only, each row optionally
 * scaled by its own weight (the router weight of the token copy it holds).
 *   fwd: h [M, 2F] (each row [gate | up]) -> act [M, F], act = silu(gate) * up * w[r] (w = 1 when
 *        row_weights is NULL), in f32, rounded once.
 *   bwd: dact [M, F], h -> dh [M, 2F]: with a = silu(gate) * up, d gate = dact * w * up *
 *        silu'(gate), d up = dact * w * silu(gate); with row_weights also drow_weights f32 [M],
 *        d w[r] = sum_j dact[r, j] * a[r, j] in f32 (required then, ignored otherwise; 0 past U).
 * Only the first U = sum(group_sizes) rows are computed (the rows gmm writes for sorted groups);
 * rows past U are zero, or on CUDA with skip_unused_rows left unwritten. The CPU rejects negative
 * sizes and U > M (SL_STATUS_INVALID_VALUE); CUDA counts negative sizes as 0 and clamps U to M. One
 * dtype (f32, bf16 or f16) for h, act, dact and dh; row_weights f32 [M].
 * ----------------------------------------------------------------------------------------------*/
typedef struct sl_swiglu_desc {
  size_t struct_size; /* sizeof(sl_swiglu_desc) */
  int64_t rows;       /* M */
  int64_t ff;         /* F: h has 2F columns */
  int64_t num_groups; /* G >= 1: group_sizes [G] */
  sl_dtype dtype;
  int skip_unused_rows; /* CUDA: 1 = rows past sum(group_sizes) left unwritten */
} sl_swiglu_desc;

sl_swiglu_desc sl_swiglu_desc_default(void);
sl_status sl_swiglu_fwd_cpu(const sl_swiglu_desc *desc, const void *h, const float *row_weights,
                            const int32_t *group_sizes, void *act);
sl_status sl_swiglu_bwd_cpu(const sl_swiglu_desc *desc, const void *dact, const void *h,
                            const float *row_weights, const int32_t *group_sizes, void *dh,
                            float *drow_weights);
sl_status sl_swiglu_fwd_cuda(const sl_swiglu_desc *desc, const void *h, const float *row_weights,
                             const int32_t *group_sizes, void *act, void *stream);
sl_status sl_swiglu_bwd_cuda(const sl_swiglu_desc *desc, const void *dact, const void *h,
                             const float *row_weights, const int32_t *group_sizes, void *dh,
                             float *drow_weights, void *stream);


/* ================================================================================================
 * Expert parallelism: dispatch and combine
 *
 * R ranks form a group (one expert-parallel mesh axis); a communicator holds G independent groups
 * (the other mesh axes) of R ranks. E experts are split evenly: rank d owns experts
 * [d*L, (d+1)*L), L = E/R. Every rank holds T tokens with k expert slots each.
 *
 * dispatch (each rank, all ranks of a group together):
 *   a token goes ONCE to each rank that owns at least one of its experts (topk_idx -1: no expert).
 *   Rank d receives rows ordered by (source rank, source token) into static worst-case buffers of
 *   N = T*R rows: recv_x [N, H], recv_idx [N, k] (local expert id e - d*L where expert e is on d,
 *   else -1), recv_w [N, k] (the weight where local, else 0), num_recv (valid rows; rows past it
 *   are zero, -1 ids and 0 weights), counts [L] ((row, slot) pairs per local expert), and a layout
 *   for the way back: send_row [T, R] (the row of token t in rank d's buffer, -1 if not sent) and
 *   recv_src [N] (s*T + t for a row from token t of rank s, -1 past num_recv).
 * combine: out[t] = sum over d = 0..R-1 (in this order, in f32) of y_d[send_row[t, d]], rounded
 *   once to the output dtype: bitwise deterministic. A token sent nowhere gets zeros.
 * redispatch: combine's transpose: out_d[i] = g_s[t] for recv_src_d[i] = s*T + t, zero rows past it.
 * fan_out / fan_in: local, on the receiving rank (see below).
 *
 * Data-dependent values (expert ids): the CPU calls reject an id outside [-1, E) and an expert that
 * appears twice in one token's slots with SL_STATUS_INVALID_VALUE (on every rank of the group,
 * naming the rank, token and slot). The CUDA calls treat such a slot as -1 (not routed); with
 * SLUICE_DEBUG=1 they check on the host and return SL_STATUS_INVALID_VALUE.
 *
 * Exchanges. Ops of a group meet at a rendezvous keyed by (tag, n): the n-th call with a given tag on
 * one rank meets the n-th call with that tag on every other rank of its group, so independent ops may
 * run in any order on each rank. Every wait is bounded by the communicator's timeout and ends in
 * SL_STATUS_TIMEOUT naming the waiting rank, the exchange and the ranks it waited for; the
 * communicator is then broken and every later call on it fails at once (create a new one).
 * A rank whose own arguments are bad still joins the exchange, so every rank of the group returns
 * the same error instead of waiting for it.
 * ==============================================================================================*/

/* CUDA transports (sl_ep_comm_desc.transport). */
typedef enum sl_ep_transport {
  SL_EP_TRANSPORT_PEER = 0, /* GPUs of one process: peer memory over NVLink, rows straight between
                               the ranks' own buffers */
  SL_EP_TRANSPORT_IPC = 1,  /* GPUs of one host in one or several processes: each rank's buffer
                               (flags + a staging area of buffer_bytes) is exported with CUDA IPC;
                               rows are pushed into the peers' staging areas over NVLink */
  SL_EP_TRANSPORT_NCCL = 2  /* any GPUs (several hosts): NCCL send/recv of fixed worst-case blocks
                               (T rows per peer) through our own communicator */
} sl_ep_transport;

/* Describes a communicator. */
typedef struct sl_ep_comm_desc {
  size_t struct_size;         /* sizeof(sl_ep_comm_desc) */
  int num_groups;             /* G >= 1 */
  int num_ranks;              /* R >= 1 ranks per group */
  double timeout_s;           /* bound of every wait, > 0 (default 60) */
  int use_cuda;               /* 1: also set up a CUDA transport */
  const int *device_ordinals; /* CUDA: [G*R] device of (group g, rank r) at g*R + r, or -1 where
                                 another process owns that rank (IPC and NCCL only); else NULL */
  int num_sms;                /* CUDA: blocks of the data kernels (one per SM), 1..64; 0 = 64 */
  int transport;              /* CUDA: an sl_ep_transport (default PEER) */
  size_t buffer_bytes;        /* IPC / NCCL: staging bytes per rank; 0 = 256 MiB. An op needing more
                                 fails with SL_STATUS_INVALID_ARGUMENT naming the size it needs */
} sl_ep_comm_desc;

/* Defaults: one group, one rank, 60 s, no CUDA, struct_size set. */
sl_ep_comm_desc sl_ep_comm_desc_default(void);

/* Creates a communicator; *comm_id (> 0) names it in later calls (and in the FFI attributes).
 * Thread-safe. With use_cuda it allocates each local device's buffers and enables peer access
 * between the local devices of a group (requires peer access between them: SL_STATUS_UNSUPPORTED
 * otherwise). A communicator with ranks of other processes (device_ordinals -1) is usable once
 * every process has exchanged the blobs below and called sl_ep_comm_connect. */
sl_status sl_ep_comm_create(const sl_ep_comm_desc *desc, int64_t *comm_id);

/* Multi-process setup (IPC and NCCL), in this order on every process:
 *   1. for each local rank (g, r): sl_ep_comm_export -> a blob of *bytes <= SL_EP_BLOB_BYTES bytes
 *      (IPC: the rank's cudaIpcMemHandle_t; NCCL: the group's ncclUniqueId from rank 0, 0 bytes from
 *      other ranks); publish the non-empty ones (e.g. through jax.distributed's key-value store);
 *   2. for each rank (g, r) of another process that sl_ep_comm_needs says is needed: fetch its blob
 *      and sl_ep_comm_import it (IPC: maps the peer's buffer on every local device of group g);
 *   3. sl_ep_comm_connect: checks every needed blob arrived; NCCL: creates the communicators (a
 *      bounded wait for every rank of the group: SL_STATUS_TIMEOUT names the rank otherwise).
 * Teardown: sl_ep_comm_disconnect on every process (waits for this process's devices, unmaps the
 * peers, aborts NCCL), then a barrier between the processes, then sl_ep_comm_destroy. */
#define SL_EP_BLOB_BYTES 256
sl_status sl_ep_comm_export(int64_t comm_id, int group, int rank, void *blob, size_t *bytes);
/* *needed = 1 when this process must import rank (g, r)'s blob. */
sl_status sl_ep_comm_needs(int64_t comm_id, int group, int rank, int *needed);
sl_status sl_ep_comm_import(int64_t comm_id, int group, int rank, const void *blob, size_t bytes);
sl_status sl_ep_comm_connect(int64_t comm_id);
sl_status sl_ep_comm_disconnect(int64_t comm_id);

/* Frees a communicator. No call on it may be running or start afterwards. */
sl_status sl_ep_comm_destroy(int64_t comm_id);

/* Describes one op on one rank. Every rank of a group passes the same values. */
typedef struct sl_ep_desc {
  size_t struct_size;  /* sizeof(sl_ep_desc) */
  int64_t num_tokens;  /* T >= 0, tokens per rank */
  int64_t hidden;      /* H >= 0, elements per row of x / y */
  int64_t topk;        /* k >= 1 */
  int64_t num_experts; /* E >= 1, a multiple of the group's R */
  int64_t num_ranks;   /* R of the communicator (checked) */
  sl_dtype dtype;      /* of the rows: F32, BF16 or F16 */
  int64_t tag;         /* names the op instance in the program (see Exchanges) */
  /* N, the rows of the receiving side: dispatch's recv_x, recv_idx, recv_w and recv_src, combine's
   * y (and y_w), redispatch's out and recv_src; 0 = T*R, the worst case. dispatch: N <= T*R; a
   * routing that sends a rank more than N rows is the caller's to split (sluice.ep.bounded_moe
   * sends it in rounds): the CPU call fails on every rank with SL_STATUS_INVALID_VALUE naming the
   * rank and its rows, the CUDA calls leave the rows past N out (send_row -1; SLUICE_DEBUG=1: an
   * error). combine: send_row in [-1, N). redispatch: recv_src in [-1, T*R) (row t of rank s's
   * g [T, H] for s*T + t), any N >= 1: a gather of N rows from the peers. */
  int64_t recv_rows;
} sl_ep_desc;

sl_ep_desc sl_ep_desc_default(void);

/* Layout of one source rank, no communication: send_pos [T, R] is the position of token t within
 * the block of rows it sends to rank d (tokens in order), -1 if it sends none; send_counts [R] the
 * rows it sends to each rank; expert_counts [E] (optional, may be NULL) the slots per expert.
 * Rejects bad ids as above. */
sl_status sl_ep_layout_cpu(const sl_ep_desc *desc, const int32_t *topk_idx, int32_t *send_pos,
                           int32_t *send_counts, int32_t *expert_counts);

/* The same layout on the GPU (one block; what dispatch runs first), stream-ordered. expert_counts
 * must not be NULL here. Ids outside [-1, E) and repeats count as -1. For benchmarks and tests. */
sl_status sl_ep_layout_cuda(const sl_ep_desc *desc, const int32_t *topk_idx, int32_t *send_pos,
                            int32_t *send_counts, int32_t *expert_counts, void *stream);

/* CPU transport: every rank of a group calls these on its own thread (blocking) with host pointers;
 * (group, rank) says which. Arrays as above: x [T,H], topk_idx [T,k], topk_w [T,k] f32,
 * recv_x [N,H], recv_idx [N,k], recv_w [N,k] f32, num_recv [1], counts [L], send_row [T,R],
 * recv_src [N], y [N,H], out [T,H], g [T,H]. combine's optional second payload y_w [N, k] f32
 * (NULL: none) comes back summed the same way in out_w [T, k] f32 (the dispatch VJP's weight grad). */
sl_status sl_ep_dispatch_cpu(int64_t comm_id, int group, int rank, const sl_ep_desc *desc,
                             const void *x, const int32_t *topk_idx, const float *topk_w,
                             void *recv_x, int32_t *recv_idx, float *recv_w, int32_t *num_recv,
                             int32_t *counts, int32_t *send_row, int32_t *recv_src);
sl_status sl_ep_combine_cpu(int64_t comm_id, int group, int rank, const sl_ep_desc *desc,
                            const void *y, const float *y_w, const int32_t *send_row, void *out,
                            float *out_w);
sl_status sl_ep_redispatch_cpu(int64_t comm_id, int group, int rank, const sl_ep_desc *desc,
                               const void *g, const int32_t *recv_src, void *out);

/* CUDA transports (PEER, IPC, NCCL): the same ops, device pointers, stream-ordered on `stream`, no
 * host sync (unless SLUICE_DEBUG=1), so they may be captured in CUDA graphs. The rank is the one
 * whose device is current. A wait that runs out (a device-side wait on a peer's flag; for NCCL a
 * watchdog thread that aborts the NCCL communicator after timeout_s) sets an error that the next
 * call on the communicator (or the debug check) returns as SL_STATUS_TIMEOUT, naming the rank and
 * the call number. PEER moves rows straight between the ranks' buffers; IPC pushes them into the
 * receiver's staging area and copies them out locally (redispatch: the source stages its rows);
 * NCCL sends T rows per peer whatever the routing (no host sync needs a fixed size). Returns
 * SL_STATUS_UNSUPPORTED in a build without CUDA (or, for NCCL, without nccl.h at build time or
 * libnccl at run time). */
sl_status sl_ep_dispatch_cuda(int64_t comm_id, const sl_ep_desc *desc, const void *x,
                              const int32_t *topk_idx, const float *topk_w, void *recv_x,
                              int32_t *recv_idx, float *recv_w, int32_t *num_recv, int32_t *counts,
                              int32_t *send_row, int32_t *recv_src, void *stream);
sl_status sl_ep_combine_cuda(int64_t comm_id, const sl_ep_desc *desc, const void *y,
                             const float *y_w, const int32_t *send_row, void *out, float *out_w,
                             void *stream);
sl_status sl_ep_redispatch_cuda(int64_t comm_id, const sl_ep_desc *desc, const void *g,
                                const int32_t *recv_src, void *out, void *stream);

/* fan_out (local): rows of recv_x [N, H] into expert-sorted order for gmm. xs [M, H] with
 * M = N * min(k, L), or max_rows where that is smaller (> 0): the (row, slot) pairs with
 * recv_idx[row, slot] = e >= 0, grouped by e, within a group by (row, slot); rows past the pairs are
 * zero. Pairs that would land at row M or later are left out (pos -1, not in group_sizes): the caller
 * counts them as the valid ids minus sum(group_sizes). group_sizes [L]; pos [N, k] the row of xs of
 * each pair (-1 where recv_idx is -1). A counting sort: no comparison sort.
 * fan_in (local): out[i] = sum over slots j = 0..k-1 with pos[i,j] >= 0 of w[i,j] * ys[pos[i,j]], in
 * f32 in slot order, rounded once to out's dtype. fan_in_bwd: dys[pos[i,j]] = w[i,j] * dout[i] (rows
 * past sum(group_sizes), fan_out's, are zero), dw[i,j] = <dout[i], ys[pos[i,j]]> in f32 (0 where pos
 * is -1); ys and dw both NULL: dys only (for weights that need no gradient: ys is not read). On
 * CUDA, ids outside [-1, L) and repeats count as -1 (SLUICE_DEBUG=1: an error).
 * Shapes: desc->num_tokens is N here, desc->hidden H, desc->topk k, num_local_experts L; dtypes
 * x_dtype of recv_x/xs/ys/dys and out_dtype of out/dout. CPU rejects ids outside [-1, L) and a
 * repeated id in one row. */
typedef struct sl_ep_fan_desc {
  size_t struct_size;        /* sizeof(sl_ep_fan_desc) */
  int64_t num_rows;          /* N */
  int64_t hidden;            /* H */
  int64_t topk;              /* k */
  int64_t num_local_experts; /* L >= 1 */
  sl_dtype x_dtype;
  sl_dtype out_dtype;
  int64_t max_rows; /* 0: M = N * min(k, L); else M = min(that, max_rows) */
  /* CUDA: 1 = fan_out's xs rows past the pairs and fan_in_bwd's dys rows past sum(group_sizes) are
   * left unwritten (for callers that read only the groups' rows, as gmm does); the CPU zeroes them
   * anyway. 0 (default): zeroed. */
  int skip_unused_rows;
} sl_ep_fan_desc;

sl_ep_fan_desc sl_ep_fan_desc_default(void);
int64_t sl_ep_fan_rows(const sl_ep_fan_desc *desc); /* M (above) */
/* Device scratch of sl_ep_fan_out_cuda in bytes (O(N*k/1024 * L)); the CPU call needs none. */
size_t sl_ep_fan_workspace_size(const sl_ep_fan_desc *desc);

sl_status sl_ep_fan_out_cpu(const sl_ep_fan_desc *desc, const void *recv_x, const int32_t *recv_idx,
                            void *xs, int32_t *group_sizes, int32_t *pos);
sl_status sl_ep_fan_in_cpu(const sl_ep_fan_desc *desc, const void *ys, const float *w,
                           const int32_t *pos, void *out);
sl_status sl_ep_fan_in_bwd_cpu(const sl_ep_fan_desc *desc, const void *dout, const void *ys,
                               const float *w, const int32_t *pos, const int32_t *group_sizes,
                               void *dys, float *dw);
sl_status sl_ep_fan_out_cuda(const sl_ep_fan_desc *desc, const void *recv_x,
                             const int32_t *recv_idx, void *xs, int32_t *group_sizes, int32_t *pos,
                             void *workspace, void *stream);
sl_status sl_ep_fan_in_cuda(const sl_ep_fan_desc *desc, const void *ys, const float *w,
                            const int32_t *pos, void *out, void *stream);
sl_status sl_ep_fan_in_bwd_cuda(const sl_ep_fan_desc *desc, const void *dout, const void *ys,
                                const float *w, const int32_t *pos, const int32_t *group_sizes,
                                void *dys, float *dw, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_H_ */
