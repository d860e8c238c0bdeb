/* Hopper (sm_90a) building blocks of the grouped GEMM kernels (sm90_gmm_pipeline.cuh): mbarriers,
 * TMA loads and stores, wgmma descriptors, the wgmma instructions and the stmatrix staging of an
 * accumulator for a TMA store. Device code here is only compiled for sm_90a. */
#ifndef SLUICE_CUDA_SM90_GMM_CUH_
#define SLUICE_CUDA_SM90_GMM_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "gmm_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define SLUICE_SM90A_DEVICE 1
#endif

namespace sluice_cuda {
namespace sm90 {

#ifdef SLUICE_SM90A_DEVICE
__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* Bounded waits, a test build option for debugging a hang (off by default). Built with
 * -DSLUICE_SM90_WAIT_LIMIT_NS=<ns> (at most ~4.2 s; e.g. WAIT_LIMIT_NS=4000000000 tests/gpu/build.sh),
 * a barrier still incomplete that long after its first 256 failed polls traps, so a stuck pipeline
 * shows as a failed launch instead of a hang, and compute-sanitizer or cuda-gdb name the wait's
 * source line (tests/gpu/test_wait_bound.cu checks both directions). Off because it costs
 * 0.4-0.5% of gmm and tgmm throughput, whether the clock is read after every failed poll or every
 * 256th. The clock is the low 32 bits of %globaltimer (one register; differences are
 * right below 2^32 ns, hence the static_assert). No printf: a call in the kernel makes ptxas
 * serialize every wgmma (C7510) and ignore setmaxnreg (C7507). */
#ifndef SLUICE_SM90_WAIT_LIMIT_NS
#define SLUICE_SM90_WAIT_LIMIT_NS 0u
#endif
static_assert(SLUICE_SM90_WAIT_LIMIT_NS < 4200000000u, "the wait limit must stay below 2^32 ns");
__device__ __forceinline__ uint32_t globaltimer_lo_ns() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%globaltimer_lo;\n" : "=r"(t));
  return t;
}
/* One poll of a parity wait. */
__device__ __forceinline__ uint32_t mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if constexpr (SLUICE_SM90_WAIT_LIMIT_NS == 0) {
    while (!mbar_try_wait(bar, parity)) {
    }
  } else {
    uint32_t polls = 0, t0 = 0;
    while (!mbar_try_wait(bar, parity)) {
      if ((++polls & 255) != 0) continue;
      const uint32_t t = globaltimer_lo_ns();
      if (polls == 256)
        t0 = t;
      else if (t - t0 > (uint32_t)SLUICE_SM90_WAIT_LIMIT_NS)
        asm volatile("trap;\n");
    }
  }
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void *map, int c0, int c1,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], "
      "[%4];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void *map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, "
      "%4}], [%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void *map, int c0, int c1, int c2,
                                            int c3, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

/* Shared-memory matrix descriptor, 128-byte swizzle (SW64: 64-byte). K-major: rows of 128 (64)
 * bytes, 8-row groups SBO apart (LBO unused). MN-major: 64-element MN blocks LBO apart, 8-row K
 * groups SBO apart. */
template <bool SW64 = false>
__device__ __forceinline__ uint64_t make_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= (uint64_t)((saddr & 0x3FFFF) >> 4);
  d |= (uint64_t)((lbo >> 4) & 0x3FFF) << 16;
  d |= (uint64_t)((sbo >> 4) & 0x3FFF) << 32;
  d |= (uint64_t)(SW64 ? 2 : 1) << 62; /* layout type: 1 = 128B swizzle, 2 = 64B */
  return d;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
/* Bulk tensor stores from shared memory (the epilogue), tracked per issuing thread. */
__device__ __forceinline__ void tma_store_2d(const void *map, uint32_t src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(map),
      "r"(c0), "r"(c1), "r"(src)
      : "memory");
}
__device__ __forceinline__ void tma_store_3d(const void *map, uint32_t src, int c0, int c1,
                                             int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
          map),
      "r"(c0), "r"(c1), "r"(c2), "r"(src)
      : "memory");
}
__device__ __forceinline__ void tma_store_4d(const void *map, uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          map),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read0() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait0() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
}
__device__ __forceinline__ void named_bar(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void fence_operands(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* The accumulator operands of the wgmma asm below, written once: the register list %0..%127 of
 * the instruction and the matching "+f" bindings of d[0..127], in halves of 64. */
#define SL_WGMMA_REGS_LO \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define SL_WGMMA_REGS_HI \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
  "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
  "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
  "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define SL_WGMMA_REGS128 "{" SL_WGMMA_REGS_LO "," SL_WGMMA_REGS_HI "}"
#define SL_WGMMA_ACC_LO(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define SL_WGMMA_ACC_HI(d) \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define SL_WGMMA_ACC128(d) SL_WGMMA_ACC_LO(d), SL_WGMMA_ACC_HI(d)

/* Around the register list: the scale_d predicate before, the descriptors, transposes and scale
 * operands after (%N = da, %N+1 = db, %N+2 = TA, %N+3 = TB, %N+4 = scale_d for N accumulators). */
#define SL_WGMMA_PRE128 "{\n.reg .pred p;\nsetp.ne.b32 p, %132, 0;\n"
#define SL_WGMMA_POST128 ", %128, %129, p, 1, 1, %130, %131;\n}\n"

/* D (f32) += A * B for one k16 step, A and B in shared memory (descriptors da, db; TA/TB 1: the
 * operand is MN-major); scale_d = 0 ignores D's old value. NACC accumulators per thread (N / 2). */
#define SL_WGMMA_FN(NAME, SHAPE, TYPE, NACC)                                                     \
  template <int TA, int TB>                                                                     \
  __device__ __forceinline__ void NAME(float(&d)[NACC], uint64_t da, uint64_t db, int scale_d) { \
    asm volatile(SL_WGMMA_PRE##NACC "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE  \
                                    " " SL_WGMMA_REGS##NACC SL_WGMMA_POST##NACC                 \
                 : SL_WGMMA_ACC##NACC(d)                                                        \
                 : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(scale_d));                           \
  }
SL_WGMMA_FN(wgmma_m64n256k16_bf16, "m64n256k16", "bf16", 128)
SL_WGMMA_FN(wgmma_m64n256k16_f16, "m64n256k16", "f16", 128)

/* gmm's narrow tiles: m64n128k16, the first 64 registers of the list. */
#define SL_WGMMA_REGS64 "{" SL_WGMMA_REGS_LO "}"
#define SL_WGMMA_ACC64(d) SL_WGMMA_ACC_LO(d)
#define SL_WGMMA_PRE64 "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
#define SL_WGMMA_POST64 ", %64, %65, p, 1, 1, %66, %67;\n}\n"
SL_WGMMA_FN(wgmma_m64n128k16_bf16, "m64n128k16", "bf16", 64)
SL_WGMMA_FN(wgmma_m64n128k16_f16, "m64n128k16", "f16", 64)

/* The narrower accumulators of gmm's merged tiles (m64nNk16, N = 160, 192: N / 2
 * registers): the 128-register lists cut at 80 and 96. */
#define SL_WGMMA_REGS_64_80 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79"
#define SL_WGMMA_REGS_80_96 "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95"
#define SL_WGMMA_ACC_64_80(d) \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define SL_WGMMA_ACC_80_96(d) \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define SL_WGMMA_REGS80 "{" SL_WGMMA_REGS_LO "," SL_WGMMA_REGS_64_80 "}"
#define SL_WGMMA_REGS96 "{" SL_WGMMA_REGS_LO "," SL_WGMMA_REGS_64_80 "," SL_WGMMA_REGS_80_96 "}"
#define SL_WGMMA_ACC80(d) SL_WGMMA_ACC_LO(d), SL_WGMMA_ACC_64_80(d)
#define SL_WGMMA_ACC96(d) SL_WGMMA_ACC_LO(d), SL_WGMMA_ACC_64_80(d), SL_WGMMA_ACC_80_96(d)
#define SL_WGMMA_PRE80 "{\n.reg .pred p;\nsetp.ne.b32 p, %84, 0;\n"
#define SL_WGMMA_POST80 ", %80, %81, p, 1, 1, %82, %83;\n}\n"
#define SL_WGMMA_PRE96 "{\n.reg .pred p;\nsetp.ne.b32 p, %100, 0;\n"
#define SL_WGMMA_POST96 ", %96, %97, p, 1, 1, %98, %99;\n}\n"
SL_WGMMA_FN(wgmma_m64n160k16_bf16, "m64n160k16", "bf16", 80)
SL_WGMMA_FN(wgmma_m64n160k16_f16, "m64n160k16", "f16", 80)
SL_WGMMA_FN(wgmma_m64n192k16_bf16, "m64n192k16", "bf16", 96)
SL_WGMMA_FN(wgmma_m64n192k16_f16, "m64n192k16", "f16", 96)

/* D (f32) += A * B, m64nNk16 in the input type T, N = 256 (all 128 accumulators) or 128 (the
 * first 64). */
template <typename T, int TA, int TB, int N = 256>
__device__ __forceinline__ void wgmma_tile(float (&acc)[128], uint64_t da, uint64_t db,
                                           int scale_d = 1) {
  constexpr bool BF = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 256) {
    if constexpr (BF) wgmma_m64n256k16_bf16<TA, TB>(acc, da, db, scale_d);
    else wgmma_m64n256k16_f16<TA, TB>(acc, da, db, scale_d);
  } else {
    static_assert(N == 128, "wgmma_tile: N is 256 or 128");
    float(&d)[64] = *reinterpret_cast<float(*)[64]>(&acc[0]);
    if constexpr (BF) wgmma_m64n128k16_bf16<TA, TB>(d, da, db, scale_d);
    else wgmma_m64n128k16_f16<TA, TB>(d, da, db, scale_d);
  }
}

/* The four 8x8 fragments of an stmatrix.x4 from column groups i, i+1 of an accumulator: matrix m
 * is rows +8*(m%2) of group i + m/2, each register two adjacent columns as OT. */
template <typename OT, int NREG>
__device__ __forceinline__ void pack_x4(const float (&acc)[NREG], int i, uint32_t (&p)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float lo = acc[4 * (i + (m >> 1)) + 2 * (m & 1)],
                hi = acc[4 * (i + (m >> 1)) + 2 * (m & 1) + 1];
    if constexpr (std::is_same<OT, __nv_bfloat16>::value) {
      __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      p[m] = *reinterpret_cast<uint32_t *>(&v);
    } else {
      __half2 v = __floats2half2_rn(lo, hi);
      p[m] = *reinterpret_cast<uint32_t *>(&v);
    }
  }
}

/* One 64-row accumulator half (NREG/4 column groups of 8) into 128B-swizzled 64x64 boxes (box_bytes
 * apart) at cbase, by stmatrix, the output type OT fixed: thread holds rows warp*16 + lane/4 (+8),
 * columns 8i + 2*(lane%4) (+1); per pair of 8-column groups one stmatrix.x4 of the four 8x8
 * matrices (rows 0-7 / 8-15 of the warp's 16) x (groups i, i+1); lane l gives the address of row
 * l%8 of matrix l/8. */
template <typename OT, int NREG, int BOX_BYTES>
__device__ __forceinline__ void stage_half_stsm(const float (&acc)[NREG], uint32_t cbase, int warp,
                                                int lane) {
  const int q = lane >> 3;                            /* the matrix this lane addresses */
  const int r = warp * 16 + (q & 1) * 8 + (lane & 7); /* its row in the 64-row half */
  const uint32_t row_base = cbase + r * 128;
#pragma unroll
  for (int i = 0; i < NREG / 4; i += 2) {
    const int c = i + (q >> 1); /* 8-column group (16-byte chunk) of this lane's matrix */
    const uint32_t addr = row_base + (c >> 3) * BOX_BYTES + (((c & 7) ^ (r & 7)) << 4);
    uint32_t p[4];
    pack_x4<OT>(acc, i, p);
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3])
                 : "memory");
  }
}

/* An f32 output's 8-column groups [C0, C1) of one 64-row accumulator half, staged for the TMA
 * store from cbase on: boxes of 64 rows x 32 columns (128 bytes a row, BOX_BYTES), 128B-swizzled
 * like the 16-bit ones (16-byte chunk c of row r at chunk c ^ (r % 8)). One 8-byte store per pair
 * of columns: a warp's 32 stores cover two chunks of each of 8 rows, which the swizzle spreads
 * over all 32 banks (two wavefronts for 256 bytes, the minimum). */
template <int C0, int C1, int BOX_BYTES>
__device__ __forceinline__ void stage_f32(const float (&acc)[128], uint32_t cbase, int warp,
                                          int lane) {
#pragma unroll
  for (int i = C0; i < C1; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + (lane >> 2) + h * 8;
      const int c = 8 * (i - C0) + 2 * (lane & 3); /* column from the pass's first */
      const uint32_t addr = cbase + (c >> 5) * BOX_BYTES + r * 128 +
                            ((((c & 31) >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc[4 * i + 2 * h]),
                   "f"(acc[4 * i + 2 * h + 1])
                   : "memory");
    }
}

/* Masked stores of one 64-row accumulator half straight from registers: rows from row0, only
 * rows < row_limit and columns < n. */
template <int NREG>
__device__ __forceinline__ void store_half_regs(const float (&acc)[NREG], void *out,
                                                sl_dtype out_dtype, int n, int row0, int n0,
                                                int row_limit, int warp, int lane) {
  const bool pair_ok = (n % 2) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + warp * 16 + (lane >> 2) + h * 8;
    if (row < row_limit) {
#pragma unroll
      for (int i = 0; i < NREG / 4; ++i) {
        const int col = n0 + i * 8 + (lane & 3) * 2;
        const size_t idx = (size_t)row * n + col;
        const float v0 = acc[4 * i + 2 * h], v1 = acc[4 * i + 2 * h + 1];
        if (pair_ok && col + 1 < n)
          store_out2(out, out_dtype, idx, v0, v1);
        else {
          if (col < n) store_out(out, out_dtype, idx, v0);
          if (col + 1 < n) store_out(out, out_dtype, idx + 1, v1);
        }
      }
    }
  }
}
#endif /* SLUICE_SM90A_DEVICE */

} /* namespace sm90 */
} /* namespace sluice_cuda */

#endif /* SLUICE_CUDA_SM90_GMM_CUH_ */
