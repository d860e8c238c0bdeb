/* wgmma issue rate by shape and operand layout, with no loads: is a narrow N (V_TM's merged tiles,
 * m64n192k16 / m64n160k16) or the transposed operands (weights MN-major as A, rows K-major as B)
 * slower per flop than gmm's m64n256k16? (dev/NOTES.md, sessions 14, 17 and 22.)
 *
 * One CTA per SM, two consumer warpgroups, as sm90_gmm.cu's mainloop: per k-block 4 k16 wgmmas
 * from one of 3 rotating 48 KB "stages" of random bf16 in shared memory, the descriptors built as
 * the kernel builds them, commit, wait_group 1. No TMA, no mbarriers: the tensor pipe's own rate.
 *
 * Session 26 added the 256x128 tile's consumer (cuBLAS's nvjet_..._256x128_64x4_1x2 on dsv3-down): per
 * warpgroup two m64n128k16 on two separate 64-register accumulators (its 128 rows), in a 384-thread CTA
 * whose first warpgroup only lowers its registers, as the kernel's producer does (168 registers at
 * entry, the consumers raised to 232), the last k-block's two halves committed apart and the first
 * read while the second drains ("split drain"). Does ptxas keep the wgmmas asynchronous there (no
 * C75xx remark), and do they issue at the pipe's rate?
 *
 * Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iinclude -Icsrc/core \
 *          dev/probe/wgmma_rate.cu -o wgmma_rate
 * Run:   ./wgmma_rate [k-blocks per warpgroup, default 20000] */

#include "probe.cuh"

constexpr int STAGES = 3, SBYTES = 48 * 1024, SMEM = STAGES * SBYTES + 1024;

/* modes: what one k16 step issues per warpgroup */
enum Mode { PLAIN256, PLAIN192, TRANS256, TRANS192, TRANS160, TWO128, NMODES };
static const char *kNames[NMODES] = {
    "plain m64n256k16 (gmm: A K-major, B N-major)", "plain m64n192k16 (same layouts)",
    "transposed m64n256k16 (A = weights MN-major, B = rows K-major)",
    "transposed m64n192k16 (V_TM merged tile, 129..192 rows)",
    "transposed m64n160k16 (V_TM merged tile, 129..160 rows)",
    "2 x m64n128k16 per warpgroup (256x128 tile, 384 threads)"};
/* a warpgroup's k16 step as 64 rows x kN columns (TWO128: two m64n128, the flops of one n256) */
static const int kN[NMODES] = {256, 192, 256, 192, 160, 256};
static const int kThreads[NMODES] = {256, 256, 256, 256, 256, 384};

#ifdef SLUICE_SM90A_DEVICE
/* The dynamic shared memory, 1 KB-aligned, its stages filled with random bf16 and fenced for the
 * async proxy (wgmma reads it), by the whole CTA. */
__device__ __forceinline__ unsigned char *random_stages() {
  extern __shared__ unsigned char smem_raw[];
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  fill_smem_random(base, STAGES * SBYTES);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  return base;
}
#endif

template <int MODE>
__global__ void __launch_bounds__(256, 1) rate_kernel(int blocks, float *sink, long long *cycles) {
#ifdef SLUICE_SM90A_DEVICE
  unsigned char *base = random_stages();
  const int cw = threadIdx.x / 128;
  const uint32_t stage0 = smem_u32(base);
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  constexpr int BOX = 64 * 64 * 2;
  const long long t0 = clock64();
  int s = 0;
  for (int kb = 0; kb < blocks; ++kb) {
    const uint32_t st = stage0 + s * SBYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      if constexpr (MODE == PLAIN256 || MODE == PLAIN192) {
        const uint64_t da = make_desc(st + cw * 64 * 128 + kk * 32, 16, 1024);
        const uint64_t db = make_desc(st + 16384 + kk * 2048, BOX, 1024);
        if constexpr (MODE == PLAIN256) {
          wgmma_m64n256k16_bf16<0, 1>(acc, da, db, 1);
        } else {
          float(&d)[96] = *reinterpret_cast<float(*)[96]>(&acc[0]);
          wgmma_m64n192k16_bf16<0, 1>(d, da, db, 1);
        }
      } else {
        const uint64_t da = make_desc(st + 32768 + cw * BOX + kk * 2048, BOX, 1024);
        const uint64_t db = make_desc(st + kk * 32, 16, 1024);
        if constexpr (MODE == TRANS256) {
          wgmma_m64n256k16_bf16<1, 0>(acc, da, db, 1);
        } else if constexpr (MODE == TRANS192) {
          float(&d)[96] = *reinterpret_cast<float(*)[96]>(&acc[0]);
          wgmma_m64n192k16_bf16<1, 0>(d, da, db, 1);
        } else {
          float(&d)[80] = *reinterpret_cast<float(*)[80]>(&acc[0]);
          wgmma_m64n160k16_bf16<1, 0>(d, da, db, 1);
        }
      }
    }
    wgmma_commit();
    wgmma_wait1();
    fence_operands(acc);
    if (++s == STAGES) s = 0;
  }
  wgmma_wait0();
  fence_operands(acc);
  const long long t1 = clock64();
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum; /* keeps every wgmma alive */
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
#endif
}


/* The 256x128 tile's consumers (see the header): 384 threads, warpgroups 1-2 compute. */
__global__ void __launch_bounds__(384, 1) two_acc_kernel(int blocks, float *sink, long long *cycles) {
#ifdef SLUICE_SM90A_DEVICE
  unsigned char *base = random_stages();
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = threadIdx.x / 128 - 1, lt = threadIdx.x & 127;
  const uint32_t stage0 = smem_u32(base);
  constexpr int BOX = 64 * 64 * 2;
  float acc0[64], acc1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;
  const long long t0 = clock64();
  int s = 0;
  /* a stage: A 256 rows x 64 (32 KB, 8 KB a 64-row slice), B 64 x 128 (two 64x64 boxes, 16 KB) */
  auto issue = [&](float(&d)[64], int slice, uint32_t st) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t da = make_desc(st + slice * 64 * 128 + kk * 32, 16, 1024);
      const uint64_t db = make_desc(st + 32768 + kk * 2048, BOX, 1024);
      wgmma_m64n128k16_bf16<0, 1>(d, da, db, 1);
    }
  };
  for (int kb = 0; kb < blocks - 1; ++kb) {
    const uint32_t st = stage0 + s * SBYTES;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) { /* the two halves per k16 step, as a tiled MMA would */
      const uint64_t db = make_desc(st + 32768 + kk * 2048, BOX, 1024);
      wgmma_m64n128k16_bf16<0, 1>(acc0, make_desc(st + (2 * cw) * 64 * 128 + kk * 32, 16, 1024),
                                  db, 1);
      wgmma_m64n128k16_bf16<0, 1>(acc1,
                                  make_desc(st + (2 * cw + 1) * 64 * 128 + kk * 32, 16, 1024), db, 1);
    }
    wgmma_commit();
    wgmma_wait1();
    fence64(acc0);
    fence64(acc1);
    if (++s == STAGES) s = 0;
  }
  /* the last k-block: the halves committed apart, the first read while the second drains */
  const uint32_t st = stage0 + s * SBYTES;
  wgmma_fence();
  issue(acc0, 2 * cw, st);
  wgmma_commit();
  issue(acc1, 2 * cw + 1, st);
  wgmma_commit();
  wgmma_wait1();
  fence64(acc0);
  float sum0 = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) sum0 += acc0[i];
  wgmma_wait0();
  fence64(acc1);
  const long long t1 = clock64();
  float sum1 = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) sum1 += acc1[i];
  sink[blockIdx.x * 256 + cw * 128 + lt] = sum0 + sum1;
  if (threadIdx.x == 128) cycles[blockIdx.x] = t1 - t0;
#endif
}

typedef void (*KernelFn)(int, float *, long long *);
static const KernelFn kKernels[NMODES] = {rate_kernel<PLAIN256>, rate_kernel<PLAIN192>,
                                          rate_kernel<TRANS256>, rate_kernel<TRANS192>,
                                          rate_kernel<TRANS160>, two_acc_kernel};

int main(int argc, char **argv) {
  const int blocks = argc > 1 ? atoi(argv[1]) : 20000;
  int dev = 0, sms = 0, clock_khz = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("%s, %d SMs; %d k-blocks (4 k16 wgmmas) per warpgroup, 2 warpgroups per SM, 3 stages\n",
         prop.name, sms, blocks);
  float *sink;
  long long *cyc;
  CK(cudaMalloc(&sink, (size_t)sms * 256 * sizeof(float)));
  CK(cudaMalloc(&cyc, sms * sizeof(long long)));
  for (int m = 0; m < NMODES; ++m)
    CK(cudaFuncSetAttribute(kKernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int reps = 7;
  std::vector<float> ms[NMODES];
  std::vector<double> cpw[NMODES]; /* mean cycles per k16 wgmma per SM (both warpgroups) */
  for (int r = 0; r < reps + 1; ++r)
    for (int m = 0; m < NMODES; ++m) {
      CK(cudaEventRecord(e0));
      kKernels[m]<<<sms, kThreads[m], SMEM>>>(blocks, sink, cyc);
      CK(cudaEventRecord(e1));
      double mean;
      const float t = probe_finish(e0, e1, cyc, sms, &mean);
      if (r == 0) continue; /* warm-up */
      ms[m].push_back(t);
      cpw[m].push_back(mean / (2.0 * 4.0 * blocks));
    }
  printf("%-64s %8s %9s %11s %13s %9s\n", "mode", "ms", "TFLOP/s", "cyc/wgmma", "flop/cyc/SM",
         "vs n256");
  double per_cyc256 = 0;
  for (int m = 0; m < NMODES; ++m) {
    std::sort(ms[m].begin(), ms[m].end());
    std::sort(cpw[m].begin(), cpw[m].end());
    const float t = ms[m][reps / 2];
    const double c = cpw[m][reps / 2];
    const double flop_wgmma = 2.0 * 64 * kN[m] * 16;
    const double flops = flop_wgmma * 4.0 * blocks * 2.0 * sms;
    const double per_cyc = flop_wgmma / c;
    if (m == 0) per_cyc256 = per_cyc;
    printf("%-64s %8.3f %9.1f %11.1f %13.0f %8.3fx\n", kNames[m], t, flops / t / 1e9, c, per_cyc,
           per_cyc / per_cyc256);
  }
  printf("(flop/cyc/SM: per SM cycle, both warpgroups; the dense bf16 peak is 4096 = 989 TFLOP/s at "
         "1830 MHz on 132 SMs; clocks left alone; cyc/wgmma of the last row: per k16 step of two)\n");
  return 0;
}
