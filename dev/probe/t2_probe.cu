/* A 256x128-tile gmm with a split drain, against the library's gmm on equal-size groups (session 26).
 *
 * cuBLAS's batched kernel on dsv3-down (nvjet_..._256x128_64x4_1x2) keeps the tensor pipe 93% busy
 * where our 128x256 kernel reaches 89.5% (dev/NOTES.md, session 26). The probe asks whether the
 * 256x128 tile's own schedule explains it, before any work on the library: per consumer warpgroup two
 * m64n128 accumulators (its 128 rows), interleaved per k16 step; the tile's last k-block committed
 * as two groups, so the first 64 rows are staged while the second half's wgmmas drain; otherwise the
 * library kernel's roles (one producer thread with TMA copies into 3 stages of 48 KB behind mbarriers,
 * two consumer warpgroups, wait_group 1, the output staged in 64 KB of 128B-swizzled boxes and TMA-
 * stored, the store's read waited for before the next staging). Groups must be multiples of 256 rows
 * (no ragged edge: that is what the probe leaves out); tiles go to CTAs by a fixed stride, the 4 row
 * tiles of a column block of one group next to each other.
 *
 * Checked against the library's output on the same inputs (max |diff| / max |ref|), then both timed
 * in turn, 25 each, for each shape (dsv3-down and dsv3-gateup, 32 groups of 1,024 rows; mixtral, 8
 * of 2,048).
 *
 * Build (the harness's objects): B=build-probe; mkdir -p $B; for f in status gmm_cpu; do
 *   gcc -O2 -fPIC -fopenmp -Iinclude -Icsrc/core -c csrc/core/$f.c -o $B/$f.o; done
 *   nvcc -O3 -std=c++17 -lineinfo -gencode=arch=compute_90a,code=sm_90a -Iinclude -Icsrc/core \
 *     dev/probe/t2_probe.cu $B/status.o $B/gmm_cpu.o -lgomp -lcuda -o $B/t2_probe */

#include <algorithm>
#include <vector>

#include "../../csrc/cuda/gmm_launch.cu"
#include "../../csrc/cuda/sm80_gmm.cu"
#include "../../csrc/cuda/sm90_gmm.cu"
#include "probe.cuh"


using namespace sluice_cuda;
using namespace sluice_cuda::sm90;

namespace t2 {
constexpr int TM = 256, TN = 128, KB = 64;
constexpr int A_BYTES2 = TM * KB * 2, SB = A_BYTES2 + TN * KB * 2; /* 32 + 16 KB a stage */
/* 3 stages: the whole 256x128 output tile staged (64 KB); 4 stages: each warpgroup stages its
 * 128 rows in two 64-row passes through 16 KB (32 KB in all), the second after the first's store
 * has read the buffer */
__host__ __device__ constexpr int cb_of(int stg) { return stg == 3 ? TM * TN * 2 : TM * TN; }
constexpr size_t smem_of(int stg) { return 1024 + (size_t)stg * SB + cb_of(stg) + 2 * stg * 8; }


/* rows: every group's (a multiple of TM); tiles: G x (rows / TM) x (N / TN), row tiles innermost */
template <int STG>
__global__ void __launch_bounds__(384, 1)
    t2_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
              const __grid_constant__ CUtensorMap map_c, int rows, int k, int n, int groups) {
#ifdef SLUICE_SM90A_DEVICE
  extern __shared__ unsigned char smem_raw[];
  unsigned char *base = (unsigned char *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  constexpr int CB = cb_of(STG);
  const uint32_t stage0 = smem_u32(base), c_smem = stage0 + STG * SB;
  const uint32_t full0 = c_smem + CB, empty0 = full0 + STG * 8;
  const int mt_n = rows / TM, nt_n = n / TN, nk = k / KB;
  const int tiles = groups * mt_n * nt_n;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STG; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, 8);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  auto decode = [&](int t, int &m0, int &n0, int &g) {
    g = t / (mt_n * nt_n);
    const int u = t - g * mt_n * nt_n;
    m0 = g * rows + (u % mt_n) * TM, n0 = (u / mt_n) * TN;
  };
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int s = 0;
      uint32_t phase = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0, g;
        decode(t, m0, n0, g);
        for (int kb = 0; kb < nk; ++kb) {
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          const uint32_t full = full0 + 8 * s, sa = stage0 + s * SB;
          mbar_expect_tx(full, SB);
          tma_load_2d(sa, &map_a, kb * KB, m0, full);
          tma_load_4d(sa + A_BYTES2, &map_b, 0, kb * KB, n0 / 64, g, full);
          if (++s == STG) s = 0, phase ^= 1;
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int cw = wg - 1, lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  float acc0[64], acc1[64];
  int s = 0;
  uint32_t phase = 0;
  auto release = [&](int st) {
    if (lane == 0) mbar_arrive(empty0 + 8 * st);
  };
  /* A: 256 rows of 128 bytes (8 KB a 64-row slice); B: two 64x64 boxes (N-major) */
  auto da_of = [&](uint32_t sa, int slice, int kk) {
    return make_desc(sa + slice * 64 * 128 + kk * 32, 16, 1024);
  };
  auto db_of = [&](uint32_t sa, int kk) {
    return make_desc(sa + A_BYTES2 + kk * 2048, BOX_BYTES, 1024);
  };
  const uint32_t cbase = c_smem + cw * (CB / 2); /* this warpgroup's 128 rows: two 16 KB halves */
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int m0, n0, g;
    decode(t, m0, n0, g);
    int sd = 0;
    for (int kb = 0; kb < nk - 1; ++kb) {
      mbar_wait(full0 + 8 * s, phase);
      const uint32_t sa = stage0 + s * SB;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint64_t db = db_of(sa, kk);
        wgmma_m64n128k16_bf16<0, 1>(acc0, da_of(sa, 2 * cw, kk), db, kk == 0 ? sd : 1);
        wgmma_m64n128k16_bf16<0, 1>(acc1, da_of(sa, 2 * cw + 1, kk), db, kk == 0 ? sd : 1);
      }
      sd = 1;
      wgmma_commit();
      wgmma_wait1();
      fence64(acc0);
      fence64(acc1);
      if (kb > 0) release(s == 0 ? STG - 1 : s - 1);
      if (++s == STG) s = 0, phase ^= 1;
    }
    /* the last k-block: rows 0-63 of the warpgroup first, then 64-127, two commit groups */
    mbar_wait(full0 + 8 * s, phase);
    const uint32_t sa = stage0 + s * SB;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n128k16_bf16<0, 1>(acc0, da_of(sa, 2 * cw, kk), db_of(sa, kk), kk == 0 ? sd : 1);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n128k16_bf16<0, 1>(acc1, da_of(sa, 2 * cw + 1, kk), db_of(sa, kk),
                                  kk == 0 ? sd : 1);
    wgmma_commit();
    wgmma_wait1(); /* the block before and the first half of this one are done */
    fence64(acc0);
    if (nk > 1) release(s == 0 ? STG - 1 : s - 1);
    if (lt == 0) bulk_wait_read0(); /* the last tile's store has read the staging buffer */
    named_bar(2 + cw, 128);
    stage_half_stsm<__nv_bfloat16>(acc0, cbase, warp, lane);
    if constexpr (STG == 4) { /* the first 64 rows leave before the second half is staged */
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      named_bar(2 + cw, 128);
      if (lt == 0) {
        for (int b = 0; b < 2; ++b)
          tma_store_2d(&map_c, cbase + b * BOX_BYTES, n0 + 64 * b, m0 + cw * 128);
        bulk_commit();
      }
    }
    wgmma_wait0();
    fence64(acc1);
    release(s);
    if (++s == STG) s = 0, phase ^= 1;
    const uint32_t c1 = STG == 4 ? cbase : cbase + CB / 4;
    if (STG == 4) {
      if (lt == 0) bulk_wait_read0();
      named_bar(2 + cw, 128);
    }
    stage_half_stsm<__nv_bfloat16>(acc1, c1, warp, lane);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    named_bar(2 + cw, 128);
    if (lt == 0) {
#pragma unroll
      for (int h = STG == 4 ? 1 : 0; h < 2; ++h)
#pragma unroll
        for (int b = 0; b < 2; ++b)
          tma_store_2d(&map_c, (h ? c1 : cbase) + b * BOX_BYTES, n0 + 64 * b,
                       m0 + cw * 128 + 64 * h);
      bulk_commit();
    }
  }
  if (lt == 0) bulk_wait0();
#endif
}
} /* namespace t2 */

/* max |a - b| / max |b| over n bf16 */
__global__ void max_diff(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n, float *res) {
  float d = 0.f, r = 0.f;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d = fmaxf(d, isnan(x) ? INFINITY : fabsf(x - y));
    r = fmaxf(r, fabsf(y));
  }
  atomicMax(reinterpret_cast<int *>(&res[0]), __float_as_int(d));
  atomicMax(reinterpret_cast<int *>(&res[1]), __float_as_int(r));
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Sh {
    const char *name;
    int g, rows, k, n;
  } shapes[] = {{"dsv3-down-ep8", 32, 1024, 2048, 7168},
                {"dsv3-gateup-ep8", 32, 1024, 7168, 4096},
                {"mixtral-up", 8, 2048, 4096, 14336}};
  CK(cudaFuncSetAttribute(t2::t2_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(3)));
  CK(cudaFuncSetAttribute(t2::t2_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          (int)t2::smem_of(4)));
  /* T2_STAGES=3|4, T2_SHAPE=<substring>, T2_REPS=n narrow a run (for a profiler) */
  const int only_stg = getenv("T2_STAGES") ? atoi(getenv("T2_STAGES")) : 0;
  const char *only_shape = getenv("T2_SHAPE");
  const int reps = getenv("T2_REPS") ? atoi(getenv("T2_REPS")) : 25;
  for (int stg = 3; stg <= 4; ++stg) {
  if (only_stg && stg != only_stg) continue;
  printf("%d stages (%zu bytes of shared memory)\n", stg, t2::smem_of(stg));
  printf("%-16s %10s %10s %9s %9s %7s %10s\n", "shape", "lib ms", "t2 ms", "lib TF/s", "t2 TF/s",
         "t2/lib", "rel diff");
  for (const Sh &sh : shapes) {
    if (only_shape && !strstr(sh.name, only_shape)) continue;
    const int m = sh.g * sh.rows;
    __nv_bfloat16 *x, *w, *o_lib, *o_t2;
    int32_t *sizes;
    int *counter;
    float *res;
    CK(cudaMalloc(&x, (size_t)m * sh.k * 2));
    CK(cudaMalloc(&w, (size_t)sh.g * sh.k * sh.n * 2));
    CK(cudaMalloc(&o_lib, (size_t)m * sh.n * 2));
    CK(cudaMalloc(&o_t2, (size_t)m * sh.n * 2));
    CK(cudaMalloc(&sizes, sh.g * 4));
    CK(cudaMalloc(&counter, 4));
    CK(cudaMalloc(&res, 8));
    std::vector<int32_t> hs(sh.g, sh.rows);
    CK(cudaMemcpy(sizes, hs.data(), sh.g * 4, cudaMemcpyHostToDevice));
    fill_random<<<1024, 256>>>(x, (size_t)m * sh.k, 1u);
    fill_random<<<1024, 256>>>(w, (size_t)sh.g * sh.k * sh.n, 2u);
    CK(cudaMemset(o_t2, 0xff, (size_t)m * sh.n * 2)); /* poisoned: NaN */
    GmmArgs a;
    a.lhs = x, a.rhs = w, a.out = o_lib, a.group_sizes = sizes, a.group_offset = nullptr;
    a.table = nullptr, a.counter = counter;
    a.m = m, a.k = sh.k, a.n = sh.n, a.num_groups = sh.g, a.num_local_groups = sh.g;
    a.in_dtype = SL_DTYPE_BF16, a.out_dtype = SL_DTYPE_BF16, a.transpose_rhs = 0;
    CUtensorMap ma, mb, mc;
    const uint64_t da[2] = {(uint64_t)sh.k, (uint64_t)m}, sa[1] = {(uint64_t)sh.k * 2};
    const uint32_t boxa[2] = {64, 256};
    const uint64_t db[4] = {64, (uint64_t)sh.k, (uint64_t)sh.n / 64, (uint64_t)sh.g};
    const uint64_t sb[3] = {(uint64_t)sh.n * 2, 128, (uint64_t)sh.k * sh.n * 2};
    const uint32_t boxb[4] = {64, 64, 2, 1};
    const uint64_t dc[2] = {(uint64_t)sh.n, (uint64_t)m}, sc[1] = {(uint64_t)sh.n * 2};
    const uint32_t boxc[2] = {64, 64};
    if (!make_map(&ma, x, SL_DTYPE_BF16, 2, da, sa, boxa) ||
        !make_map(&mb, w, SL_DTYPE_BF16, 4, db, sb, boxb) ||
        !make_map(&mc, o_t2, SL_DTYPE_BF16, 2, dc, sc, boxc)) {
      fprintf(stderr, "tensor maps failed\n");
      return 1;
    }
    auto run_lib = [&]() {
      if (sm90_gmm_launch(a, false, sms, 0, -1) != SL_STATUS_SUCCESS) {
        fprintf(stderr, "library gmm failed\n");
        exit(1);
      }
    };
    auto run_t2 = [&]() {
      if (stg == 3)
        t2::t2_kernel<3><<<sms, 384, t2::smem_of(3)>>>(ma, mb, mc, sh.rows, sh.k, sh.n, sh.g);
      else
        t2::t2_kernel<4><<<sms, 384, t2::smem_of(4)>>>(ma, mb, mc, sh.rows, sh.k, sh.n, sh.g);
    };
    run_lib();
    run_t2();
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    CK(cudaMemset(res, 0, 8));
    max_diff<<<1024, 256>>>(o_t2, o_lib, (size_t)m * sh.n, res);
    float hr[2];
    CK(cudaMemcpy(hr, res, 8, cudaMemcpyDeviceToHost));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<float> tl, tt;
    for (int r = 0; r < reps + 2; ++r)
      for (int v = 0; v < 2; ++v) {
        const bool lib = (r + v) % 2 == 0; /* alternate which goes first */
        CK(cudaEventRecord(e0));
        lib ? run_lib() : run_t2();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2) (lib ? tl : tt).push_back(ms);
      }
    std::sort(tl.begin(), tl.end());
    std::sort(tt.begin(), tt.end());
    const float ml = tl[tl.size() / 2], mt = tt[tt.size() / 2];
    const double fl = 2.0 * m * sh.k * sh.n;
    printf("%-16s %10.3f %10.3f %9.1f %9.1f %6.3fx %10.2e\n", sh.name, ml, mt, fl / ml / 1e9,
           fl / mt / 1e9, ml / mt, hr[0] / hr[1]);
    cudaFree(x), cudaFree(w), cudaFree(o_lib), cudaFree(o_t2), cudaFree(sizes), cudaFree(counter),
        cudaFree(res);
  }
  }
  return 0;
}
