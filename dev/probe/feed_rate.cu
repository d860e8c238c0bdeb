/* How fast TMA fills an SM's pipeline stages from L2, alone and under the wgmmas that consume
 * them: is gmm's mainloop (48 KB a k-block for 1024 pipe cycles) or V_TM's merged tile (40 KB for
 * 768) bound by the feed? (dev/NOTES.md, session 22; dev/probe/wgmma_rate.cu measured the pipe
 * alone at its peak for every N and layout.)
 *
 * One CTA per SM, sm90_gmm.cu's roles: thread 0 issues TMA copies (boxes of 32-256 rows x 128 B,
 * 128B-swizzled, as the case lists them) of an L2-resident bf16 buffer into STAGES stages, guarded by
 * full/empty mbarriers;
 * two consumer warpgroups wait for each stage and either hand it straight back (feed only) or
 * issue the kernel's 4 k16 wgmmas per warpgroup on it (wait_group 1, the stage before handed back).
 * `share` CTAs read the same boxes at about the same time (a gmm weight strip is shared by the
 * ~8-16 CTAs on one group's row tiles); share 1: every CTA its own.
 *
 * Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Icsrc/core \
 *          dev/probe/feed_rate.cu -o feed_rate
 * Run:   ./feed_rate [k-blocks per CTA, default 4000] */
#include <cuda.h>
#include <cudaTypedefs.h>

#include "probe.cuh"

constexpr int BOX = 64 * 64 * 2; /* one 8 KB box: the kernel's 64x64 tile of 16-bit elements */

/* what the consumers do with a stage */
enum Mode { FEED, FULL256, MERGED192 };

constexpr int NMAPS = 5; /* boxes of 32, 64, 128, 192, 256 rows of 128 B */
__host__ __device__ constexpr int map_rows(int i) {
  return i == 0 ? 32 : i == 1 ? 64 : i == 2 ? 128 : i == 3 ? 192 : 256;
}

/* A stage: nbox TMA copies, copy b of map (code >> 4b) & 15, one after another in shared memory. */
template <int STAGES, int MODE>
__global__ void __launch_bounds__(384, 1)
    feed_kernel(const __grid_constant__ CUtensorMap m0, const __grid_constant__ CUtensorMap m1,
                const __grid_constant__ CUtensorMap m2, const __grid_constant__ CUtensorMap m3,
                const __grid_constant__ CUtensorMap m4, int nbox, uint32_t code, int blocks,
                int share, int rows, float *sink, long long *cycles) {
#ifdef SLUICE_SM90A_DEVICE
  extern __shared__ unsigned char smem_raw[];
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t stage0 = smem_u32(base);
  uint32_t sbytes = 0;
  for (int b = 0; b < nbox; ++b) sbytes += map_rows((code >> (4 * b)) & 15) * 128;
  const uint32_t sstride = (sbytes + 1023) & ~1023u;
  const uint32_t full0 = stage0 + STAGES * sstride, empty0 = full0 + STAGES * 8;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 8); /* lane 0 of each consumer warp */
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    if (threadIdx.x == 0) {
      const int grp = blockIdx.x / share;
      /* the buffer is [rows, 4096] bf16 (8 KB rows, as a weight's N-major rows): a box is 64
       * columns (128 B) of box-many rows 8 KB apart, as the kernel's loads are */
      const int nrow_slots = rows / 256; /* every box starts on a 256-row boundary */
      int s = 0;
      uint32_t phase = 0;
      for (int kb = 0; kb < blocks; ++kb) {
        mbar_wait(empty0 + 8 * s, phase ^ 1);
        mbar_expect_tx(full0 + 8 * s, sbytes);
        uint32_t off = 0;
        for (int b = 0; b < nbox; ++b) {
          const int mi = (code >> (4 * b)) & 15;
          const long long u = (long long)grp * 1237 + (long long)kb * 8 + b;
          /* the map's address straight from the parameter, as the kernel takes it */
          const CUtensorMap *mp = mi == 0 ? &m0 : mi == 1 ? &m1 : mi == 2 ? &m2 : mi == 3 ? &m3 : &m4;
          tma_load_2d(stage0 + s * sstride + off, mp, (int)(u % 64) * 64,
                      (int)((u / 64) % nrow_slots) * 256, full0 + 8 * s);
          off += map_rows(mi) * 128;
        }
        if (++s == STAGES) s = 0, phase ^= 1;
      }
    }
    return;
  }
  const int cw = wg - 1, lane = threadIdx.x % 32;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  int s = 0;
  uint32_t phase = 0;
  auto release = [&](int st) {
    if (lane == 0) mbar_arrive(empty0 + 8 * st);
  };
  const long long t0 = clock64();
  for (int kb = 0; kb < blocks; ++kb) {
    mbar_wait(full0 + 8 * s, phase);
    const uint32_t st = stage0 + s * sstride;
    if constexpr (MODE == FEED) {
      release(s);
    } else {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if constexpr (MODE == FULL256) { /* A: 128 rows K-major (16 KB), B: 4 N-major boxes */
          const uint64_t da = make_desc(st + cw * 64 * 128 + kk * 32, 16, 1024);
          const uint64_t db = make_desc(st + 2 * BOX + kk * 2048, BOX, 1024);
          wgmma_m64n256k16_bf16<0, 1>(acc, da, db, 1);
        } else { /* merged: 192 rows K-major as B (24 KB), the weights' 2 boxes MN-major as A */
          const uint64_t da = make_desc(st + 3 * BOX + cw * BOX + kk * 2048, BOX, 1024); /* x: 24 KB */
          const uint64_t db = make_desc(st + kk * 32, 16, 1024);
          float(&d)[96] = *reinterpret_cast<float(*)[96]>(&acc[0]);
          wgmma_m64n192k16_bf16<1, 0>(d, da, db, 1);
        }
      }
      wgmma_commit();
      wgmma_wait1();
      fence_operands(acc);
      if (kb > 0) release(s == 0 ? STAGES - 1 : s - 1);
    }
    if (++s == STAGES) s = 0, phase ^= 1;
  }
  if constexpr (MODE != FEED) {
    wgmma_wait0();
    fence_operands(acc);
    release(s == 0 ? STAGES - 1 : s - 1);
  }
  const long long t1 = clock64();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  sink[blockIdx.x * 256 + threadIdx.x - 128] = sum;
  if (threadIdx.x == 128) cycles[blockIdx.x] = t1 - t0;
#endif
}

__global__ void fill(uint16_t *p, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u;
    x ^= x >> 16, x *= 0x7feb352du, x ^= x >> 15, x *= 0x846ca68bu, x ^= x >> 16;
    p[i] = (uint16_t)(0x3f00u | (x & 0xffu) | ((x >> 8) & 1u) << 15); /* +-[0.5, 1) */
  }
}

typedef void (*KernelFn)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, int,
                         uint32_t, int, int, int, float *, long long *);

struct Case {
  const char *what;
  KernelFn fn;
  int stages, mode, share;
  const char *boxes; /* the copies of a stage, by map: '0'..'4' = 32, 64, 128, 192, 256 rows */
};

int main(int argc, char **argv) {
  const int blocks = argc > 1 ? atoi(argv[1]) : 4000;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  const int rows = 2048; /* [2048, 4096] bf16, 16 MB: L2-resident (50 MB on an H200) */
  uint16_t *buf;
  CK(cudaMalloc(&buf, (size_t)rows * 8192));
  fill<<<1024, 256>>>(buf, (size_t)rows * 4096);
  CK(cudaDeviceSynchronize());
  void *p = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
  auto encode = (PFN_cuTensorMapEncodeTiled_v12000)p;
  CUtensorMap maps[NMAPS];
  for (int i = 0; i < NMAPS; ++i) {
    cuuint64_t dims[2] = {4096, (cuuint64_t)rows}, strides[1] = {8192};
    cuuint32_t box[2] = {64, (cuuint32_t)map_rows(i)}, es[2] = {1, 1};
    if (encode(&maps[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buf, dims, strides, box, es,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      fprintf(stderr, "tensor map encode failed\n");
      return 1;
    }
  }
  float *sink;
  long long *cyc;
  CK(cudaMalloc(&sink, (size_t)sms * 256 * sizeof(float)));
  CK(cudaMalloc(&cyc, sms * sizeof(long long)));
  const Case cases[] = {
      {"feed: 48 KB as 6 x 8 KB", feed_kernel<3, FEED>, 3, FEED, 8, "111111"},
      {"feed: 48 KB as 3 x 16 KB", feed_kernel<3, FEED>, 3, FEED, 8, "222"},
      {"feed: 48 KB as 16 + 32 KB (gmm V_FB/V_TM full tile)", feed_kernel<3, FEED>, 3, FEED, 8, "24"},
      {"feed: 40 KB as 16 + 4 + 4 + 16 KB (V_TM merged, 192 rows)", feed_kernel<3, FEED>, 3, FEED, 8, "2002"},
      {"feed: 40 KB as 24 + 16 KB (merged, 2 copies)", feed_kernel<3, FEED>, 3, FEED, 8, "32"},
      {"feed: 32 KB as 1 x 32 KB", feed_kernel<3, FEED>, 3, FEED, 8, "4"},
      {"feed: 48 KB as 16 + 32 KB, share 132", feed_kernel<3, FEED>, 3, FEED, 132, "24"},
      {"full tile m64n256: 16 + 32 KB (as V_FB)", feed_kernel<3, FULL256>, 3, FULL256, 8, "24"},
      {"full tile m64n256: 6 x 8 KB", feed_kernel<3, FULL256>, 3, FULL256, 8, "111111"},
      {"full tile m64n256: 16 + 4 x 8 KB (as V_DYN)", feed_kernel<3, FULL256>, 3, FULL256, 8, "21111"},
      {"merged m64n192: 16 + 4 + 4 + 16 KB (as V_TM)", feed_kernel<3, MERGED192>, 3, MERGED192, 8, "2002"},
      {"merged m64n192: 24 + 16 KB", feed_kernel<3, MERGED192>, 3, MERGED192, 8, "32"},
      {"merged m64n192: 24 + 16 KB, 4 stages", feed_kernel<4, MERGED192>, 4, MERGED192, 8, "32"},
  };
  const int ncases = sizeof(cases) / sizeof(cases[0]);
  for (const Case &c : cases) /* the opt-in limit: cases share instances with different stages */
    CK(cudaFuncSetAttribute(c.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)prop.sharedMemPerBlockOptin));
  printf("%s, %d SMs; %d k-blocks per CTA, one CTA per SM, `share` CTAs reading the same boxes (8 "
         "unless said); a 16 MB L2-resident buffer\n",
         prop.name, sms, blocks);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 5;
  std::vector<std::vector<float>> ms(ncases);
  std::vector<std::vector<double>> cpb(ncases); /* cycles per k-block, mean over CTAs */
  std::vector<int> sbytes(ncases);
  for (int i = 0; i < ncases; ++i) {
    int b = 0;
    for (const char *x = cases[i].boxes; *x; ++x) b += map_rows(*x - '0') * 128;
    sbytes[i] = b;
  }
  for (int r = 0; r < reps + 1; ++r)
    for (int i = 0; i < ncases; ++i) {
      const Case &c = cases[i];
      uint32_t code = 0;
      int nbox = 0;
      for (const char *x = c.boxes; *x; ++x, ++nbox) code |= (uint32_t)(*x - '0') << (4 * nbox);
      const int sstride = (sbytes[i] + 1023) & ~1023;
      /* the consumers read 48 KB (full) or 40 KB (merged) from each stage's start */
      const int need = c.mode == FULL256 ? 6 * BOX : c.mode == MERGED192 ? 5 * BOX : 0;
      const int smem = c.stages * sstride + 2 * c.stages * 8 + 1024 +
                       (need > sstride ? need - sstride : 0);
      CK(cudaEventRecord(e0));
      c.fn<<<sms, 384, smem>>>(maps[0], maps[1], maps[2], maps[3], maps[4], nbox, code, blocks,
                               c.share, rows, sink, cyc);
      CK(cudaEventRecord(e1));
      double mean;
      const float t = probe_finish(e0, e1, cyc, sms, &mean);
      if (r == 0) continue;
      ms[i].push_back(t);
      cpb[i].push_back(mean / blocks);
    }
  printf("%-58s %7s %10s %9s %7s %11s %8s %5s\n", "case", "ms", "cyc/block", "B/cyc/SM", "TB/s",
         "flop/cyc/SM", "of peak", "GHz");
  for (int i = 0; i < ncases; ++i) {
    const Case &c = cases[i];
    std::sort(ms[i].begin(), ms[i].end());
    std::sort(cpb[i].begin(), cpb[i].end());
    const float t = ms[i][reps / 2];
    const double cb = cpb[i][reps / 2];
    const double bytes = sbytes[i];
    const double flop_block = c.mode == FEED ? 0 : c.mode == FULL256 ? 2.0 * 128 * 256 * 64
                                                                     : 2.0 * 128 * 192 * 64;
    printf("%-58s %7.3f %10.1f %9.1f %7.2f %11.0f %7.1f%% %5.2f\n", c.what, t, cb, bytes / cb,
           bytes * blocks * sms / (t * 1e-3) / 1e12, flop_block / cb, 100.0 * flop_block / cb / 4096,
           cb * blocks / (t * 1e-3) / 1e9);
  }
  printf("(B/cyc/SM: stage bytes per consumer cycle per SM; TB/s: all SMs by wall time; the pipe's "
         "peak is 4096 flop/cycle/SM: a full tile needs 1024 cycles a block, a merged 192-row one 768;\n"
         " GHz: the consumers' cycles over the wall time, about the SM clock)\n");
  return 0;
}
