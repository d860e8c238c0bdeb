/* The public CUDA grouped GEMM entry points (sluice.h): check the descriptor, pick a kernel from
 * the table below (kRoutes: the device's compute capability, the dtypes, the op and the shape),
 * loop over the batch, and (SLUICE_DEBUG=1 only) check the device-side sizes on the host after
 * the kernels. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "../core/internal.h"
#include "gmm_common.cuh"
#include "sluice.h"

using sluice_cuda::GmmArgs;

namespace {

struct DeviceInfo {
  int major = 0, minor = 0, sms = 0;
  bool valid = false;
};

constexpr int kMaxDevices = 64;
DeviceInfo g_devices[kMaxDevices]; /* filled once per device; a racing refill writes the same */

sl_status current_device(DeviceInfo *info, const char *op) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: cudaGetDevice: %s", op, cudaGetErrorString(err));
  if (dev >= 0 && dev < kMaxDevices && g_devices[dev].valid) {
    *info = g_devices[dev];
    return SL_STATUS_SUCCESS;
  }
  DeviceInfo d;
  err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: device attributes: %s", op,
                        cudaGetErrorString(err));
  if (d.major < 8)
    return sl_set_error(
        SL_STATUS_UNSUPPORTED,
        "%s: the CUDA kernels need compute capability 8.0 or newer (device %d is %d.%d)", op, dev,
        d.major, d.minor);
  d.valid = true;
  if (dev >= 0 && dev < kMaxDevices) g_devices[dev] = d;
  *info = d;
  return SL_STATUS_SUCCESS;
}

/* gmm_set_grid_cap's cap (0: every SM). */
int g_grid_cap = 0;
/* gmm_set_tile_n's width (0: the wave model's choice). */
int g_tile_n = 0;
int grid_sms(const DeviceInfo &dev) {
  return g_grid_cap > 0 && g_grid_cap < dev.sms ? g_grid_cap : dev.sms;
}

/* ---- Which kernel runs a problem ---------------------------------------------------------- */

enum GmmKernel {
  kNaive,          /* sm80_gmm.cu's naive_kernel: f32 operands */
  kPortable,       /* sm80_gmm.cu: mma.sync from cp.async, any sm_80+ device */
  kSm90GmmPlain,   /* sm90_gmm_fwd.cu: 128x256 tiles, either rhs layout */
  kSm90GmmNarrow,  /* sm90_gmm_fwd.cu: 128x128 tiles, either rhs layout */
  kSm90GmmMerged,  /* sm90_gmm_fwd.cu: plain tiles, and each group's edge as merged tiles */
  kSm90Tgmm,       /* sm90_gmm_wgrad.cu */
};

/* The sm90 kernels' operands: 16-bit inputs, no empty dimension, and TMA's rule that every row
 * stride and base is a multiple of 16 bytes. */
bool sm90_operands_ok(const GmmArgs &a, bool tgmm) {
  if (a.in_dtype != SL_DTYPE_BF16 && a.in_dtype != SL_DTYPE_F16) return false;
  if (a.k <= 0 || a.n <= 0 || a.m <= 0 || a.num_local_groups <= 0) return false;
  if (((uintptr_t)a.lhs & 15) || ((uintptr_t)a.rhs & 15)) return false;
  return a.k % 8 == 0 && (a.transpose_rhs && !tgmm ? true : a.n % 8 == 0);
}
/* Their epilogue stages the output in shared memory for TMA stores: every output row a multiple
 * of 16 bytes, the output 16-byte aligned. */
bool sm90_staged_store_ok(const GmmArgs &a) {
  const bool half = a.out_dtype == SL_DTYPE_BF16 || a.out_dtype == SL_DTYPE_F16;
  const bool f32 = a.out_dtype == SL_DTYPE_F32;
  return ((half && a.n % 8 == 0) || (f32 && a.n % 4 == 0)) && ((uintptr_t)a.out & 15) == 0;
}
bool sm90_ok(const GmmArgs &a, bool tgmm, int major) {
  return major == 9 && sm90_operands_ok(a, tgmm) && sm90_staged_store_ok(a);
}
/* gmm's merged edge tiles pay only over a long contraction: at K 1024 and 256 (256 groups of ~512
 * rows) the plain tiles measured 1.00-1.08x of them. */
constexpr int kMergeMinK = 2048;

/* gmm's 128 x 128 tiles against 128 x 256 ones: narrow tiles where the wide ones would make fewer
 * than kNarrowMaxWaves waves on the GPU's SMs, counted from the static shape (M / 128 row tiles
 * plus half an edge tile per group; the true rows are on the device), and the contraction is at
 * most kNarrowMaxK long. Measured on the small-groups sweep (H200, 196 cases of 16-1024 rows per
 * group, each width forced on every case, a cold L2 before every call): narrow tiles ran
 * 1.05-1.3x the wide ones on short contractions (K 256-1024) in few waves, and 0.8-0.97x at K
 * 2048-7168 at any wave count, where the wide tile's twice-as-long reuse of each A row pays;
 * rule-picked gmm/torch on cases of 32+ rows: median 1.19x, 5 below 1.0x (wide tiles throughout:
 * 1.16x, 8 below; few waves at any K: 1.19x, 10 below). */
constexpr double kNarrowMaxWaves = 4.0;
constexpr int kNarrowMaxK = 1024;
bool narrow_tiles_pay(const GmmArgs &a, int sms) {
  if (g_tile_n != 0) return g_tile_n == 128;
  const double row_tiles = a.m / 128.0 + 0.5 * a.num_local_groups;
  return a.k <= kNarrowMaxK && row_tiles * ((a.n + 255) / 256) < kNarrowMaxWaves * sms;
}

struct Route {
  GmmKernel kernel;
  bool (*applies)(const GmmArgs &a, bool tgmm, int major, int sms);
  const char *why;
};
/* The first row that applies runs the problem. */
const Route kRoutes[] = {
    {kNaive, [](const GmmArgs &a, bool, int, int) { return a.in_dtype == SL_DTYPE_F32; },
     "f32 operands: no tensor-core path, a plain f32 loop"},
    {kSm90Tgmm,
     [](const GmmArgs &a, bool tgmm, int major, int) {
       return tgmm && sm90_ok(a, tgmm, major) && a.k % 64 == 0 && a.n % 64 == 0;
     },
     "sm_90 tgmm: TMA copies of 64-wide column blocks of lhs and rhs (K, N % 64)"},
    {kSm90GmmNarrow,
     [](const GmmArgs &a, bool tgmm, int major, int sms) {
       return !tgmm && sm90_ok(a, tgmm, major) && (a.transpose_rhs || a.n % 64 == 0) &&
              narrow_tiles_pay(a, sms);
     },
     "sm_90 gmm, K <= 1024, whose 128x256 tiles fill the GPU in too few waves: 128x128 tiles"},
    {kSm90GmmMerged,
     [](const GmmArgs &a, bool tgmm, int major, int) {
       return !tgmm && sm90_ok(a, tgmm, major) && !a.transpose_rhs && a.n % 64 == 0 &&
              a.out_dtype != SL_DTYPE_F32 && a.k >= kMergeMinK;
     },
     "sm_90 gmm, N-major rhs, 16-bit out, K >= 2048: merged edge tiles (+0.3..+1.9%)"},
    {kSm90GmmPlain,
     [](const GmmArgs &a, bool tgmm, int major, int) {
       return !tgmm && sm90_ok(a, tgmm, major) && (a.transpose_rhs || a.n % 64 == 0);
     },
     "sm_90 gmm: an N-major rhs loads as one TMA copy of 64-wide column blocks (N % 64)"},
    {kPortable, [](const GmmArgs &, bool, int, int) { return true; },
     "everything else (sm_80+, ragged N or K, outputs TMA cannot store): mma.sync"},
};

GmmKernel route(const GmmArgs &a, bool tgmm, int major, int sms) {
  for (const Route &r : kRoutes)
    if (r.applies(a, tgmm, major, sms)) return r.kernel;
  return kPortable;
}

sl_status launch(const GmmArgs &a, bool tgmm, int major, int sms, cudaStream_t stream) {
  sl_status st = SL_STATUS_UNSUPPORTED;
  switch (route(a, tgmm, major, sms)) {
    case kNaive: return sluice_cuda::naive_gmm_launch(a, tgmm, sms, stream);
    case kSm90Tgmm: st = sluice_cuda::sm90_gmm_wgrad_launch(a, sms, stream); break;
    case kSm90GmmNarrow:
      st = sluice_cuda::sm90_gmm_fwd_launch(a, sluice_cuda::kGmmTilesNarrow, sms, stream);
      break;
    case kSm90GmmMerged:
      st = sluice_cuda::sm90_gmm_fwd_launch(a, sluice_cuda::kGmmTilesMerged, sms, stream);
      break;
    case kSm90GmmPlain:
      st = sluice_cuda::sm90_gmm_fwd_launch(a, sluice_cuda::kGmmTilesPlain, sms, stream);
      break;
    case kPortable: break;
  }
  /* (an sm90 kernel whose tensor maps could not be encoded: the portable one) */
  if (st == SL_STATUS_UNSUPPORTED) st = sluice_cuda::sm80_gmm_launch(a, tgmm, sms, stream);
  return st;
}

constexpr size_t kCounterBytes = 16; /* the workspace's tail: GmmArgs::counter */

size_t table_bytes(const sl_gmm_desc *d) {
  size_t b = (size_t)sluice_cuda::table_ints((int)d->num_local_groups) * sizeof(int);
  return (b + 255) & ~(size_t)255;
}

/* SLUICE_DEBUG=1: after the kernels, read the sizes back and report what the kernels clamped. */
sl_status debug_check(const char *op, const sl_gmm_desc *d, const int32_t *group_sizes,
                      const int32_t *group_offset, cudaStream_t stream) {
  cudaError_t err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess)
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: kernel failed: %s", op, cudaGetErrorString(err));
  const size_t G = (size_t)d->num_groups, B = (size_t)d->batch;
  int32_t *sizes = (int32_t *)malloc((G * B + B) * sizeof(int32_t) + 1);
  if (sizes == NULL)
    return sl_set_error(SL_STATUS_OUT_OF_MEMORY, "%s: debug check: out of host memory", op);
  int32_t *offs = sizes + G * B;
  err = cudaMemcpy(sizes, group_sizes, G * B * sizeof(int32_t), cudaMemcpyDeviceToHost);
  if (err == cudaSuccess && group_offset)
    err = cudaMemcpy(offs, group_offset, B * sizeof(int32_t), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    free(sizes);
    return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: debug check: %s", op, cudaGetErrorString(err));
  }
  sl_status st = SL_STATUS_SUCCESS;
  for (size_t b = 0; b < B && st == SL_STATUS_SUCCESS; ++b) {
    long long off = group_offset ? offs[b] : 0, sum = 0;
    if (off < 0 || off > d->num_groups - d->num_local_groups)
      st = sl_set_error(SL_STATUS_INVALID_VALUE,
                        "%s: group_offset[%zu] = %lld is outside [0, %lld] (SLUICE_DEBUG)", op, b,
                        off, (long long)(d->num_groups - d->num_local_groups));
    for (size_t g = 0; g < G && st == SL_STATUS_SUCCESS; ++g) {
      const int32_t s = sizes[b * G + g];
      if (s < 0)
        st = sl_set_error(SL_STATUS_INVALID_VALUE,
                          "%s: group_sizes[%zu][%zu] = %d is negative (SLUICE_DEBUG)", op, b, g, s);
      sum += s;
    }
    if (st == SL_STATUS_SUCCESS && sum > d->m)
      st = sl_set_error(SL_STATUS_INVALID_VALUE,
                        "%s: sum(group_sizes[%zu]) = %lld exceeds m = %lld (SLUICE_DEBUG)", op, b,
                        sum, (long long)d->m);
  }
  free(sizes);
  return st;
}

sl_status run(const char *op, bool tgmm, const sl_gmm_desc *d, const void *lhs, const void *rhs,
              const int32_t *group_sizes, const int32_t *group_offset, void *out, void *workspace,
              void *stream_ptr) {
  sl_status st = sl_gmm_desc_check(d, tgmm ? 1 : 0);
  if (st != SL_STATUS_SUCCESS) return st;
  if (d->num_groups > INT32_MAX)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: num_groups (%lld) must fit in int32", op,
                        (long long)d->num_groups);
  const size_t B = (size_t)d->batch, M = (size_t)d->m, K = (size_t)d->k, N = (size_t)d->n;
  const size_t G = (size_t)d->num_groups, GL = (size_t)d->num_local_groups;
  const size_t out_elems = tgmm ? GL * K * N : M * N;
  if ((M * K > 0 && lhs == NULL) || (rhs == NULL && (tgmm ? M * N : GL * K * N) > 0) ||
      (out == NULL && out_elems > 0) || (group_sizes == NULL && G > 0))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: a required pointer is NULL", op);
  if (out_elems == 0) return SL_STATUS_SUCCESS;
  if (workspace == NULL)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: workspace is NULL; pass sl_gmm_cuda_workspace_size() bytes of device "
                        "memory (the group table and the tile counter)",
                        op);
  if (tgmm && M == 0) {
    /* No rows: every local group is empty. */
    cudaError_t err = cudaMemsetAsync(
        out, 0, B * out_elems * sluice_cuda::dtype_bytes(d->out_dtype), (cudaStream_t)stream_ptr);
    if (err != cudaSuccess)
      return sl_set_error(SL_STATUS_CUDA_ERROR, "%s: %s", op, cudaGetErrorString(err));
    return SL_STATUS_SUCCESS;
  }
  DeviceInfo dev;
  st = current_device(&dev, op);
  if (st != SL_STATUS_SUCCESS) return st;
  cudaStream_t stream = (cudaStream_t)stream_ptr;
  const size_t in_bytes = sluice_cuda::dtype_bytes(d->lhs_dtype);
  const size_t out_bytes = sluice_cuda::dtype_bytes(d->out_dtype);
  const size_t lhs_stride = M * K * in_bytes;
  const size_t rhs_stride = (tgmm ? M * N : GL * K * N) * in_bytes;
  const size_t out_stride = out_elems * out_bytes;

  const int sms = grid_sms(dev);
  for (size_t b = 0; b < B; ++b) {
    GmmArgs a;
    a.lhs = (const char *)lhs + b * lhs_stride;
    a.rhs = (const char *)rhs + b * rhs_stride;
    a.out = (char *)out + b * out_stride;
    a.group_sizes = group_sizes + b * G;
    a.group_offset = group_offset ? group_offset + b : NULL;
    /* the group table's place if it does not fit in shared memory (the launchers decide) */
    a.table = (int *)workspace;
    /* after the table: the sm90 kernels' tile counter (zeroed by their launchers before each use) */
    a.counter = (int *)((char *)workspace + table_bytes(d));
    a.m = (int)M, a.k = (int)K, a.n = (int)N;
    a.num_groups = (int)G, a.num_local_groups = (int)GL;
    a.in_dtype = d->lhs_dtype, a.out_dtype = d->out_dtype;
    a.transpose_rhs = tgmm ? 0 : (d->transpose_rhs != 0);
    a.skip_unused = tgmm ? 0 : (d->skip_unused_rows != 0);
    st = launch(a, tgmm, dev.major, sms, stream);
    if (st != SL_STATUS_SUCCESS) return st;
  }
  if (sl_debug_enabled()) return debug_check(op, d, group_sizes, group_offset, stream);
  return SL_STATUS_SUCCESS;
}

} /* namespace */

namespace sluice_cuda {
void gmm_set_grid_cap(int sms) { g_grid_cap = sms > 0 ? sms : 0; }
void gmm_set_tile_n(int tile_n) { g_tile_n = tile_n == 128 || tile_n == 256 ? tile_n : 0; }
sl_status gmm_device(const char *op, int *major, int *sms) {
  DeviceInfo dev;
  sl_status st = current_device(&dev, op);
  if (st != SL_STATUS_SUCCESS) return st;
  *major = dev.major, *sms = grid_sms(dev);
  return SL_STATUS_SUCCESS;
}
sl_status gmm_debug_check(const char *op, const sl_gmm_desc *d, const int32_t *group_sizes,
                          const int32_t *group_offset, cudaStream_t stream) {
  return sl_debug_enabled() ? debug_check(op, d, group_sizes, group_offset, stream)
                            : SL_STATUS_SUCCESS;
}
} /* namespace sluice_cuda */

extern "C" {

int sl_has_cuda(void) { return 1; }

size_t sl_gmm_cuda_workspace_size(const sl_gmm_desc *desc) {
  if (desc == NULL || desc->struct_size < sizeof(sl_gmm_desc) || desc->num_local_groups < 0 ||
      desc->num_local_groups > INT32_MAX / 4)
    return 0;
  return table_bytes(desc) + kCounterBytes;
}

sl_status sl_gmm_cuda(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                      const int32_t *group_sizes, const int32_t *group_offset, void *out,
                      void *workspace, void *stream) {
  return run("gmm", false, desc, lhs, rhs, group_sizes, group_offset, out, workspace, stream);
}

sl_status sl_tgmm_cuda(const sl_gmm_desc *desc, const void *lhs, const void *rhs,
                       const int32_t *group_sizes, const int32_t *group_offset, void *out,
                       void *workspace, void *stream) {
  return run("tgmm", true, desc, lhs, rhs, group_sizes, group_offset, out, workspace, stream);
}

} /* extern "C" */
