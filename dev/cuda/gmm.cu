/* Grouped GEMM harness: gmm (or tgmm, see tgmm.cu) over every kernel version, on the benchmark
 * shapes.
 *
 * Build (tests/gpu/build.sh does this, into build-gpu/):
 *   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 \
 *        -Iinclude -Icsrc/core dev/cuda/gmm.cu build-gpu/status.o build-gpu/gmm_cpu.o -lgomp -o gmm
 * Versions (the numbers of removed ones, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 21 and 22, are
 * not reused; dev/NOTES.md has them all):
 *   1  portable: mma.sync m16n8k16, 128x256x32 tiles, 3-stage cp.async, 8 warps (sm80_gmm.cu)
 *   2  Hopper: wgmma m64n256k16 from TMA, 4-stage mbarrier pipeline, 1 producer + 2 consumer
 *      warpgroups, persistent, wait_group 0 per k-block, epilogue from registers (sm90 V_BASE)
 *  13  3 stages, one k-block of wgmma kept in flight (wait_group 1), epilogue staged in swizzled
 *      smem by stmatrix and written by TMA stores overlapping the next tile, ragged-edge work
 *      skipped (gmm tiles with <= 64 group rows leave the second consumer warpgroup idle; tgmm's
 *      last contraction block issues only the k16 steps that hold group rows), and less work
 *      between tiles: the next tile decoded while the last k-block drains, scale_d = 0 instead of
 *      zeroed accumulators (V_AHS; the default of both ops since session 4; 12, the same without
 *      stmatrix, was removed)
 *  16  as 13 with tiles claimed at run time (an atomic counter) instead of a fixed stride, so the
 *      CTAs that share an operand stay together and read it from L2 (V_DYN)
 *  20  as 16, B (and tgmm's A) loaded with one TMA copy of a 3-d/4-d box per k-block instead of
 *      one per 64-column box (V_FB; needs N, and for tgmm K, multiples of 64, else it runs 16)
 *  25  as 20 with k-blocks of 32 rows (tgmm: contraction rows; gmm: K columns, A's 64-byte rows
 *      64B-swizzled) in 6 stages of 24 KB (V_K32, the tgmm default since session 10; gmm since
 *      session 13, not its default: a little faster in turn, slower alone; transpose_rhs runs 20)
 *  35  (gmm) as 20, with a group's last 128 + r rows (r = 1..64) as two transposed "merged" tiles
 *      per 256 columns (the rows as the wgmma's N: 160 or 192) instead of a full tile and an
 *      edge tile (V_TM; transpose_rhs and f32 outputs run 20, tgmm 25)
 *      (since session 22 a merged tile's rows come in one 192-row TMA copy: 36, V_TM1, which
 *      loaded them that way beside 35's 128-row and one or two 32-row copies, was folded in)
 *  40  not a kernel: the library's default with tgmm's tiles handed out in group index order, as
 *      before session 18, instead of long groups first (build_group_table's order)
 *  41  not a kernel: the library's default with its group table built in a workspace by the
 *      table kernel, as calls with more than 256 local groups did before session 19
 *  42  not a kernel: the library's default with its staged output stored box by box (8 TMA
 *      stores a 16-bit tile), as before session 22, instead of one store per warpgroup half
 *  43  not a kernel: the library's default with every tile by a fixed stride (CTA c: c, c + grid)
 *  48  not a kernel: the library's default with every tile claimed in turn, gmm's order before
 *      session 43 (since then gmm claims only its last two waves' tiles: kClaimedWaves); 44-47
 *      were session 43's order experiments (bench/results/tile-order-h100-20261127/)
 *  49  not a kernel (tgmm): the library's default with a group's tiles in gmm's panels of 16 row
 *      tiles, tgmm's order before session 61
 * (7, the ping-pong V_PP (session 2; 3-11% slower, removed in session 12, in the history at
 *  f265b23), 17-19, session 6's V_NS, V_HA, V_EW, 23-24, session 8's V_RS, V_RS4, and again 23-24,
 *  session 9's V_3W (commit 43419fc) and V_FC (6add3a9), and 26-29, session 10's V_LG2,
 *  V_LG3 (1874ec4), V_K16 and V_KS (0943536), and 34, session 13's V_TL, were measured and
 *  removed: dev/NOTES.md; so were 4 and 6, V_TMA_C and V_TMA_CS (13's predecessors), and 21-22,
 *  V_MD and V_MD4 (20 on 2-CTA clusters with TMA multicast), in session 17, in the history at
 *  16d7722.)
 * (tgmm, all sm90 versions: rows past a group's end are zeroed by the producer warpgroup's spare
 *  warps, off the consumers' path.)
 *
 * Run: ./gmm [versions]   versions: "all", or a comma-separated list of versions to time (default
 * 35,20: 35 is the gmm default (tgmm's is 25), 20 the one before it; 1 and 2 are known slower,
 * dev/NOTES.md). HARNESS_OUT=f32 checks and times f32 outputs.
 * The timings interleave the versions, so they share one power state: a version that draws more
 * power per flop than another is not seen here; bench/clocks_gmm.py runs each alone (session 5).
 * Every version is checked for correctness whatever the list.
 *
 * First every version is checked against the CPU kernel (sl_gmm_cpu, f32 accumulation) on small
 * ragged problems (and transpose_rhs for gmm), then timed on the four shapes of BENCHMARKS.md with
 * three group-size patterns: "uniform" (M/G each, tile multiples), "ragged" (M/G +-6%, as a
 * multinomial draw gives) and "skewed" (Dirichlet(0.3) proportions). Each timed call of every
 * version takes its turn inside every repetition (CUDA events, median of 25 after warm-up), so
 * clock drift hits all versions alike. Napkin math: 2*M*K*N flops at ~790 TFLOP/s (the dense bf16
 * rate measured on H200); bytes (M*K + G*K*N + M*N)*2 at ~4.3 TB/s, far below: compute-bound.
 */
#include <algorithm>
#include <random>
#include <vector>

#include "../../csrc/cuda/gmm_launch.cu"
#include "../../csrc/cuda/sm80_gmm.cu"
#include "../../csrc/cuda/sm90_gmm.cu"
#include "../probe/probe.cuh" /* CK, fill_random */

#ifndef HARNESS_TGMM
#define HARNESS_TGMM 0
#endif

static const bool kTgmm = HARNESS_TGMM;
/* HARNESS_OUT=f32: time (and check) f32 outputs instead of bf16 ones */
static const bool kOutF32 = getenv("HARNESS_OUT") && !strcmp(getenv("HARNESS_OUT"), "f32");
static const size_t kOutBytes = kOutF32 ? 4 : 2;
static const int kVersions = 49;
/* Not kernel variants: the default one with tgmm's tiles handed out in group order instead of
 * long groups first (session 18's A/B of that order; gmm: the default as it is), and the
 * default one with its group table built by the table kernel in a workspace, as every call with
 * more than 256 local groups did before session 19 (place_table). */
static const int kIndexOrder = 40, kWsTable = 41, kStorePerBox = 42;
/* the default in another tile order (GmmArgs::tile_order): every tile by the stride, or claimed */
static const int kStride = 43, kClaimed = 48;
/* tgmm: the default with a group's tiles in gmm's panels of 16 row tiles, as before session 61 */
static const int kPanels = 49;
/* versions that exist: 1 (portable) and the sm90 variants (version = variant + 2; the numbers of
 * removed ones are not reused) */
static bool version_exists(int v) {
  return v == 1 || v == kIndexOrder || v == kWsTable || v == kStorePerBox || v == kStride ||
         v == kClaimed || v == kPanels || (v >= 2 && sluice_cuda::sm90::is_variant(v - 2));
}

static sl_status run_version(int v, const sluice_cuda::GmmArgs &a, int sms) {
  if (v == 1) return sluice_cuda::sm80_gmm_launch(a, kTgmm, sms, 0);
  if (v == kIndexOrder) { /* the library's default, tgmm tiles in group order */
    sluice_cuda::GmmArgs b = a;
    b.index_order = 1;
    return sluice_cuda::sm90_gmm_launch(b, kTgmm, sms, 0, -1);
  }
  if (v == kWsTable) { /* the library's default, its group table in the workspace (args_of's) */
    sluice_cuda::GmmArgs b = a;
    b.table_in_ws = 1;
    return sluice_cuda::sm90_gmm_launch(b, kTgmm, sms, 0, -1);
  }
  if (v == kStorePerBox) { /* the library's default, its output stored box by box */
    sluice_cuda::GmmArgs b = a;
    b.store_per_box = 1;
    return sluice_cuda::sm90_gmm_launch(b, kTgmm, sms, 0, -1);
  }
  if (v == kPanels) { /* the library's default, tgmm's tiles in panels */
    sluice_cuda::GmmArgs b = a;
    b.tgmm_panels = 1;
    return sluice_cuda::sm90_gmm_launch(b, kTgmm, sms, 0, -1);
  }
  if (v == kStride || v == kClaimed) { /* the library's default in another tile order */
    sluice_cuda::GmmArgs b = a;
    b.tile_order = v == kStride ? 2 : 1;
    return sluice_cuda::sm90_gmm_launch(b, kTgmm, sms, 0, -1);
  }
  return sluice_cuda::sm90_gmm_launch(a, kTgmm, sms, 0, v - 2);
}

static uint16_t bf16_bits(float f) {
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  uint16_t u;
  memcpy(&u, &b, 2);
  return u;
}
static float bf16_float(uint16_t u) {
  uint32_t w = (uint32_t)u << 16;
  float f;
  memcpy(&f, &w, 4);
  return f;
}

struct Problem {
  int m, g, k, n;
  std::vector<int> sizes;
  void *lhs, *rhs, *out;
  int32_t *d_sizes;
  std::vector<uint16_t> h_lhs, h_rhs;
};

/* host_data: random inputs made on the host and kept (for the CPU reference); otherwise made on
 * the device. */
static Problem make_problem(int m, int g, int k, int n, std::vector<int> sizes, bool host_data) {
  Problem p{m, g, k, n, sizes};
  const size_t lhs_n = (size_t)m * k, rhs_n = kTgmm ? (size_t)m * n : (size_t)g * k * n;
  const size_t out_n = kTgmm ? (size_t)g * k * n : (size_t)m * n;
  CK(cudaMalloc(&p.lhs, lhs_n * 2));
  CK(cudaMalloc(&p.rhs, rhs_n * 2));
  CK(cudaMalloc(&p.out, out_n * kOutBytes));
  CK(cudaMalloc(&p.d_sizes, g * 4));
  CK(cudaMemcpy(p.d_sizes, sizes.data(), g * 4, cudaMemcpyHostToDevice));
  if (host_data) {
    std::vector<uint16_t> hl(lhs_n), hr(rhs_n);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (auto &x : hl) x = bf16_bits(u(rng));
    for (auto &x : hr) x = bf16_bits(u(rng));
    CK(cudaMemcpy(p.lhs, hl.data(), lhs_n * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(p.rhs, hr.data(), rhs_n * 2, cudaMemcpyHostToDevice));
    p.h_lhs = hl, p.h_rhs = hr;
  } else {
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)p.lhs, lhs_n, 1u);
    fill_random<<<1024, 256>>>((__nv_bfloat16 *)p.rhs, rhs_n, 2u);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
  }
  return p;
}

static sluice_cuda::GmmArgs args_of(const Problem &p, int transpose = 0) {
  sluice_cuda::GmmArgs a;
  a.lhs = p.lhs, a.rhs = p.rhs, a.out = p.out, a.group_sizes = p.d_sizes, a.group_offset = nullptr;
  /* a workspace for the group table, as the library's callers pass one: used where the table
   * does not fit in shared memory beside a kernel's own (place_table) */
  static int *table = nullptr;
  static size_t table_bytes = 0;
  const size_t need = (size_t)sluice_cuda::table_ints(p.g) * sizeof(int);
  if (need > table_bytes) {
    if (table) CK(cudaFree(table));
    CK(cudaMalloc(&table, need));
    table_bytes = need;
  }
  a.table = table;
  static int *counter = nullptr; /* V_DYN's tile counter (the library keeps it in the workspace) */
  if (counter == nullptr) CK(cudaMalloc(&counter, sizeof(int)));
  a.counter = counter;
  a.m = p.m, a.k = p.k, a.n = p.n, a.num_groups = p.g, a.num_local_groups = p.g;
  a.in_dtype = SL_DTYPE_BF16, a.out_dtype = kOutF32 ? SL_DTYPE_F32 : SL_DTYPE_BF16;
  a.transpose_rhs = transpose;
  return a;
}

static void free_problem(Problem &p) {
  cudaFree(p.lhs), cudaFree(p.rhs), cudaFree(p.out), cudaFree(p.d_sizes);
}

#ifdef SLUICE_SM90_TRACE
/* One more launch of sm90 version v with the kernel's cycle counters on (dev build only): where
 * the first consumer warpgroup, the producer and the fixers spend their cycles, per tile and per
 * k-block, averaged over the CTAs. */
static void print_trace(int v, const sluice_cuda::GmmArgs &a, int sms) {
  using namespace sluice_cuda::sm90;
  static unsigned long long h[1024][TR_N];
  memset(h, 0, sizeof h);
  CK(cudaMemcpyToSymbol(g_sm90_trace, h, sizeof h));
  run_version(v, a, sms);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpyFromSymbol(h, g_sm90_trace, sizeof h));
  double sum[TR_N] = {0};
  for (int c = 0; c < sms; ++c)
    for (int i = 0; i < TR_N; ++i) sum[i] += (double)h[c][i];
  const double tiles = sum[TR_TILES], blocks = sum[TR_BLOCKS];
  if (tiles == 0) return;
  const double acct = sum[TR_HEAD] + sum[TR_FULL0] + sum[TR_FULL] + sum[TR_WAIT1] +
                      sum[TR_WAIT0] + sum[TR_EPI];
  printf("  trace v%d: %.1f blocks/tile; cycles per tile: consumer %.0f = head %.0f + first-full "
         "%.0f + full %.0f + wait1 %.0f + wait0 %.0f + epilogue %.0f + other %.0f; per block "
         "%.0f\n",
         v, blocks / tiles, sum[TR_CONS] / tiles, sum[TR_HEAD] / tiles, sum[TR_FULL0] / tiles,
         sum[TR_FULL] / tiles, sum[TR_WAIT1] / tiles, sum[TR_WAIT0] / tiles, sum[TR_EPI] / tiles,
         (sum[TR_CONS] - acct) / tiles, sum[TR_CONS] / blocks);
  printf("  trace v%d: producer per tile %.0f, empty-wait %.0f (first block %.0f), copies issued "
         "%.0f; fixers wait %.0f, work %.0f per tile\n",
         v, sum[TR_PROD] / tiles, sum[TR_P_EMPTY] / tiles, sum[TR_P_EMPTY0] / tiles,
         sum[TR_P_ISSUE] / tiles, sum[TR_FIX_WAIT] / tiles, sum[TR_FIX_WORK] / tiles);
  printf("  trace v%d: epilogue per tile: store-read wait %.0f, barriers %.0f, staging %.0f, "
         "fence %.0f\n",
         v, sum[TR_EPI_READ] / tiles, sum[TR_EPI_BAR] / tiles, sum[TR_EPI_STAGE] / tiles,
         sum[TR_EPI_FENCE] / tiles);
}
#endif

/* Group sizes summing to m: "uniform" m/g each; "ragged" m/g +-6%; "skewed" Dirichlet(0.3);
 * "halves" m/g + 64 and m/g - 64 in turn, so every group ends in a tile of 64 rows (the case the
 * gmm skips are for: half a tile of work). */
static std::vector<int> sizes_for(const char *mode, int m, int g) {
  std::vector<int> s(g, m / g);
  std::mt19937 rng(11);
  if (!strcmp(mode, "halves")) {
    for (int i = 0; i < g; ++i) s[i] += (i % 2 ? -64 : 64);
  } else if (!strcmp(mode, "ragged")) {
    std::uniform_real_distribution<double> u(-0.06, 0.06);
    for (int &x : s) x = (int)((double)(m / g) * (1.0 + u(rng)));
  } else if (!strcmp(mode, "skewed")) {
    std::gamma_distribution<double> gam(0.3, 1.0);
    std::vector<double> w(g);
    double tot = 0;
    for (double &x : w) tot += (x = gam(rng));
    for (int i = 0; i < g; ++i) s[i] = (int)(m * w[i] / tot);
  }
  long long sum = 0;
  for (int x : s) sum += x;
  int big = (int)(std::max_element(s.begin(), s.end()) - s.begin());
  s[big] += (int)(m - sum); /* rows that rounding left over */
  return s;
}

int main(int argc, char **argv) {
  bool want[kVersions + 1] = {false};
  std::vector<int> listed; /* in the order given: the first is what "vs first" compares with */
  if (argc > 1 && !strcmp(argv[1], "all")) {
    for (int v = 1; v <= kVersions; ++v) want[v] = true, listed.push_back(v);
  } else {
    const char *list = argc > 1 ? argv[1] : kTgmm ? "25,20" : "35,20";
    for (const char *c = list; *c;) {
      const int v = atoi(c);
      if (v >= 1 && v <= kVersions && !want[v]) want[v] = true, listed.push_back(v);
      while (*c && *c != ',') ++c;
      if (*c == ',') ++c;
    }
  }
  setvbuf(stdout, nullptr, _IOLBF, 0); /* every line out even if a timeout kills the run */
  bool skip[kVersions + 1] = {false};  /* HARNESS_SKIP=8,...: neither checked nor timed */
  for (const char *c = getenv("HARNESS_SKIP"); c && *c;) {
    const int v = atoi(c);
    if (v >= 1 && v <= kVersions) skip[v] = true;
    while (*c && *c != ',') ++c;
    if (*c == ',') ++c;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("%s on %s (%d SMs), %s output\n", kTgmm ? "tgmm" : "gmm", prop.name, sms,
         kOutF32 ? "f32" : "bf16");

  /* 1. correctness on ragged problems with empty groups, 1-row groups, a group that ends on a
   * multiple of 16 rows, last tiles of 1-64 and 65-127 rows, rows past sum(sizes), and K/N edges
   * that are not tile multiples; every version */
  int wrong = 0;
  bool bad[kVersions + 1] = {false};
  /* two problems: K and N off every tile size, then multiples of 64 (the shapes V_FB needs) */
  for (int pr = 0; pr < 2 * (kTgmm ? 1 : 2) && !getenv("HARNESS_NOCHECK"); ++pr) {
    const int tr = kTgmm ? 0 : pr % 2, aligned = kTgmm ? pr : pr / 2;
    /* (V_TM merges the last 128 + r rows of 300, 517, 129: 172, 133 and 129 rows; none of 200) */
    std::vector<int> sizes = {300, 0, 1, 517, 129, 0, 48, 200};
    /* K = 264: 3 row blocks of out[j] in tgmm (an odd count: written for the 2-CTA cluster
     * variants, since removed, whose pairs then had a dummy second tile) */
    /* aligned K = 384: an even number of k-blocks, 3 row blocks of out[j] as with 264 */
    const int G = (int)sizes.size(), M = 1200, K = aligned ? 384 : 264, N = aligned ? 576 : 520;
    Problem p = make_problem(M, G, K, N, sizes, true);
    const size_t out_n = kTgmm ? (size_t)G * K * N : (size_t)M * N;
    std::vector<float> ref(out_n);
    sl_gmm_desc d = sl_gmm_desc_default();
    d.m = p.m, d.k = p.k, d.n = p.n, d.num_groups = d.num_local_groups = p.g;
    d.lhs_dtype = d.rhs_dtype = SL_DTYPE_BF16, d.out_dtype = SL_DTYPE_F32;
    d.transpose_rhs = tr;
    sl_status st =
        kTgmm
            ? sl_tgmm_cpu(&d, p.h_lhs.data(), p.h_rhs.data(), sizes.data(), nullptr, ref.data(), 0)
            : sl_gmm_cpu(&d, p.h_lhs.data(), p.h_rhs.data(), sizes.data(), nullptr, ref.data(), 0);
    if (st != SL_STATUS_SUCCESS) printf("cpu reference failed: %s\n", sl_last_error());
    for (int v = 1; v <= kVersions; ++v) {
      if (skip[v] || !version_exists(v)) continue;
      CK(cudaMemset(p.out, 0xFF, out_n * kOutBytes));
      st = run_version(v, args_of(p, tr), sms);
      CK(cudaDeviceSynchronize());
      std::vector<uint16_t> out(out_n * kOutBytes / 2);
      CK(cudaMemcpy(out.data(), p.out, out_n * kOutBytes, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      size_t nan = 0;
      for (size_t i = 0; i < out_n; ++i) {
        float f32;
        if (kOutF32) memcpy(&f32, &out[2 * i], 4);
        const double o = kOutF32 ? (double)f32 : bf16_float(out[i]);
        if (o != o)
          ++nan;
        else
          num += (o - ref[i]) * (o - ref[i]);
        den += (double)ref[i] * ref[i];
      }
      const bool ok = st == SL_STATUS_SUCCESS && nan == 0 && sqrt(num / den) < 1e-2;
      wrong += !ok;
      bad[v] |= !ok;
      printf("version %d%s K %d N %d: %s, rel err %.2e, NaN %zu -> %s\n", v,
             tr ? " transpose_rhs" : "", K, N, sl_status_string(st), sqrt(num / den), nan,
             ok ? "OK" : "WRONG");
    }
    free_problem(p);
  }

  /* 2. timing on the benchmark shapes, the versions interleaved (only those that checked correct)
   */
  std::vector<int> versions;
  for (int v : listed)
    if (!bad[v] && !skip[v] && version_exists(v)) versions.push_back(v);
  struct Shape {
    const char *name;
    int m, g, k, n;
    bool named_only; /* timed only when HARNESS_SHAPES names it */
  };
  const Shape shapes[] = {{"dsv3-gateup-ep8", 32768, 32, 7168, 4096},
                          {"dsv3-down-ep8", 32768, 32, 2048, 7168},
                          {"mixtral-up", 16384, 8, 4096, 14336},
                          {"qwen3-30b-up", 65536, 128, 2048, 1536},
                          /* the dsv3-proxy MoE layer's expert matmuls (bench/shapes.py) */
                          {"dsv3proxy-gateup", 131072, 256, 1024, 512, true},
                          {"dsv3proxy-down", 131072, 256, 256, 1024, true},
                          /* the same with 512 experts (more than 256: see version 41) */
                          {"fine512-gateup", 131072, 512, 1024, 512, true},
                          {"fine512-down", 131072, 512, 256, 1024, true},
                          /* qwen3's neighbours: wider N, shorter K, fewer and larger groups
                           * (session 43's tile-order A/B) */
                          {"qwen3-n3072", 65536, 128, 2048, 3072, true},
                          {"qwen3-k1024", 65536, 128, 1024, 1536, true},
                          {"g32-n1536", 32768, 32, 2048, 1536, true},
                          /* dsv3-gateup's K and N with 256-4096 rows a group: tgmm's tile length
                           * (its contraction) swept at a fixed tile count (session 61) */
                          {"rows256-gateup", 8192, 32, 7168, 4096, true},
                          {"rows512-gateup", 16384, 32, 7168, 4096, true},
                          {"rows2048-gateup", 65536, 32, 7168, 4096, true},
                          {"rows4096-gateup", 131072, 32, 7168, 4096, true}};
  const char *modes[] = {"uniform", "ragged", "skewed", "halves"};
  /* HARNESS_SHAPES / HARNESS_MODES (substrings of the names) and HARNESS_REPS narrow the timing,
   * with HARNESS_NOCHECK=1 (no correctness pass) for a profiler: each version then runs 2 warm-up
   * + reps calls per case, in the listed order. */
  const char *only_shapes = getenv("HARNESS_SHAPES"), *only_modes = getenv("HARNESS_MODES");
  /* set but empty (bench/run_1gpu.sh's HARNESS spec without shapes): no filter */
  if (only_shapes && !*only_shapes) only_shapes = nullptr;
  if (only_modes && !*only_modes) only_modes = nullptr;
  const int reps = getenv("HARNESS_REPS") ? atoi(getenv("HARNESS_REPS")) : 25;
  printf("%-16s %-8s %7s %9s %8s %9s\n", "shape", "sizes", "version", "ms", "TFLOP/s", "vs first");
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Shape &sh : shapes) {
    if (only_shapes ? !strstr(only_shapes, sh.name) : sh.named_only) continue;
    for (const char *mode : modes) {
      if (only_modes && !strstr(only_modes, mode)) continue;
      std::vector<int> sizes = sizes_for(mode, sh.m, sh.g);
      Problem p = make_problem(sh.m, sh.g, sh.k, sh.n, sizes, false);
      const double flops = 2.0 * sh.m * sh.k * sh.n;
      for (int v : versions)
        for (int w = 0; w < 2; ++w) run_version(v, args_of(p), sms);
      std::vector<std::vector<float>> ms(versions.size());
      for (int r = 0; r < reps; ++r)
        for (size_t i = 0; i < versions.size(); ++i) {
          CK(cudaEventRecord(e0));
          const sl_status st = run_version(versions[i], args_of(p), sms);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          if (st != SL_STATUS_SUCCESS) {
            printf("version %d failed: %s (%s)\n", versions[i], sl_status_string(st), sl_last_error());
            exit(1);
          }
          float t;
          CK(cudaEventElapsedTime(&t, e0, e1));
          ms[i].push_back(t);
        }
      CK(cudaGetLastError());
      float first = 0;
      for (size_t i = 0; i < versions.size(); ++i) {
        std::sort(ms[i].begin(), ms[i].end());
        const float med = ms[i][ms[i].size() / 2];
        if (i == 0) first = med;
        printf("%-16s %-8s %7d %9.3f %8.1f %8.3fx\n", sh.name, mode, versions[i], med,
               flops / med / 1e9, first / med);
      }
#ifdef SLUICE_SM90_TRACE
      for (int v : versions)
        if (v >= 2) print_trace(v, args_of(p), sms);
#endif
      free_problem(p);
    }
  }
  printf("%s\n", getenv("HARNESS_NOCHECK") ? "(correctness not checked: HARNESS_NOCHECK)"
                 : wrong                      ? "CORRECTNESS FAILED"
                                              : "all versions correct");
  return wrong ? 1 : 0;
}
