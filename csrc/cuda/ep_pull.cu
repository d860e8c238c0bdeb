/*
 * The kernels that pull rows into place, shared by every CUDA transport.
 *
 * combine: warp per token; rank d's row of the token (send_row[t, d], -1 if none) is read from d's
 * y and summed in f32 in fixed rank order, rounded once to the output dtype. PEER reads the peers'
 * y straight from their memory (it meets the peers through the mailbox first); the local form
 * reads rows that IPC pushed into this rank's staging area, or that NCCL received.
 *
 * redispatch (combine's transpose): row i of out [N] takes row t of source s's g [T], for
 * recv_src[i] = s*T + t (zeros for -1). PEER reads the peers' g, IPC their staging areas (meeting
 * the peers), NCCL the blocks it received (local).
 */
#include <stdint.h>

#include "ep_common.cuh"
#include "half_pack.cuh"

namespace sluice_cuda {
namespace {

/* ---- combine: pull rows from the peers' y, sum in rank order -------------------------------- */
template <typename T> /* bf16, f16 */
struct Elems {
  static constexpr int n = 8;
  __device__ static void add(float *acc, int4 v) {
    float f[8];
    unpack8<T>(v, f);
    for (int i = 0; i < 8; ++i) acc[i] += f[i];
  }
  __device__ static int4 pack(const float *acc) { return pack8<T>(acc); }
  __device__ static float get(const void *p, int64_t i) { return to_f32(((const T *)p)[i]); }
  __device__ static void put(void *p, int64_t i, float v) { ((T *)p)[i] = HalfPair<T>::one(v); }
};
template <>
struct Elems<float> {
  static constexpr int n = 4;
  __device__ static void add(float *acc, int4 v) {
    acc[0] += __int_as_float(v.x), acc[1] += __int_as_float(v.y);
    acc[2] += __int_as_float(v.z), acc[3] += __int_as_float(v.w);
  }
  __device__ static int4 pack(const float *acc) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                     __float_as_int(acc[3]));
  }
  __device__ static float get(const void *p, int64_t i) { return ((const float *)p)[i]; }
  __device__ static void put(void *p, int64_t i, float v) { ((float *)p)[i] = v; }
};

template <typename T, bool Local>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineArgs a) {
  const Ctl &c = a.c;
  const int R = c.R, me = c.rank, lane = threadIdx.x & 31;
  __shared__ const char *src[kMaxRanks];
  __shared__ const float *src_w[kMaxRanks];
  bool ok = true;
  if (!Local) {
    if (blockIdx.x == 0) {
      if (threadIdx.x < R) {
        Mail &m = c.bufs[threadIdx.x]->mail[me];
        m.ptr[0] = (unsigned long long)a.y;
        m.ptr[1] = (unsigned long long)a.y_w;
      }
      publish(c);
    }
    ok = meet(c);
    if (ok && threadIdx.x < R) {
      const volatile Mail *mail = c.bufs[me]->mail;
      src[threadIdx.x] = (const char *)mail[threadIdx.x].ptr[0];
      src_w[threadIdx.x] = (const float *)mail[threadIdx.x].ptr[1];
    }
  } else if (threadIdx.x < R) {
    /* shift each peer's pointer back by its base: row r of d's numbering is at src[d] + r */
    const int d = threadIdx.x;
    int64_t base = 0;
    if (d != me)
      for (int s = 0; s < me; ++s) base += a.cnt_all[s * R + d];
    const int64_t rb = (int64_t)a.H * sizeof(T);
    src[d] = a.src[d] - base * rb;
    src_w[d] = a.src_w[d] ? a.src_w[d] - base * a.k : nullptr;
  }
  __syncthreads();
  if (ok) {
    using E = Elems<T>;
    constexpr int U = 4; /* 16-byte loads in flight per lane per peer */
    const int64_t row_bytes = (int64_t)a.H * sizeof(T), nv = row_bytes / 16;
    const int gw = blockIdx.x * kWarps + (threadIdx.x >> 5), nw = gridDim.x * kWarps;
    for (int t = gw; t < a.T; t += nw) {
      const int myrow = lane < R ? a.send_row[(int64_t)t * R + lane] : -1;
      int4 *o = (int4 *)(a.out + (int64_t)t * row_bytes);
      if (a.vec16) {
        for (int64_t base = 0; base < nv; base += 32 * U) {
          float acc[U][E::n];
          for (int u = 0; u < U; ++u)
            for (int i = 0; i < E::n; ++i) acc[u][i] = 0.0f;
          /* peers two at a time: both peers' loads are in flight before the (ordered) sums */
          for (int d = 0; d < R; d += 2) {
            const int r0 = __shfl_sync(0xffffffffu, myrow, d);
            const int r1 = __shfl_sync(0xffffffffu, myrow, d + 1 < R ? d + 1 : d);
            const bool has1 = d + 1 < R && r1 >= 0;
            const int4 *s0 = (const int4 *)(src[d] + (int64_t)r0 * row_bytes);
            const int4 *s1 = has1 ? (const int4 *)(src[d + 1] + (int64_t)r1 * row_bytes) : s0;
            int4 v0[U], v1[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
              const int64_t i = base + u * 32 + lane;
              v0[u] = (r0 >= 0 && i < nv) ? ld_nc(s0 + i) : make_int4(0, 0, 0, 0);
              v1[u] = (has1 && i < nv) ? ld_nc(s1 + i) : make_int4(0, 0, 0, 0);
            }
            if (r0 >= 0)
#pragma unroll
              for (int u = 0; u < U; ++u) E::add(acc[u], v0[u]);
            if (has1)
#pragma unroll
              for (int u = 0; u < U; ++u) E::add(acc[u], v1[u]);
          }
          for (int u = 0; u < U; ++u) {
            const int64_t i = base + u * 32 + lane;
            if (i < nv) o[i] = E::pack(acc[u]);
          }
        }
      } else {
        int rows[kMaxRanks];
        for (int d = 0; d < kMaxRanks; ++d)
          rows[d] = __shfl_sync(0xffffffffu, myrow, d < R ? d : 0);
        for (int64_t h = lane; h < a.H; h += 32) {
          float acc = 0.0f;
          for (int d = 0; d < R; ++d)
            if (rows[d] >= 0) acc += E::get(src[d], (int64_t)rows[d] * a.H + h);
          E::put(a.out, (int64_t)t * a.H + h, acc);
        }
      }
      if (a.out_w) {
        float acc = 0.0f;
        for (int d = 0; d < R; ++d) {
          const int r = __shfl_sync(0xffffffffu, myrow, d);
          if (r >= 0 && lane < a.k) acc += src_w[d][(int64_t)r * a.k + lane];
        }
        if (lane < a.k) a.out_w[(int64_t)t * a.k + lane] = acc;
      }
    }
  }
  if (!Local) leave(c, ok);
}

/* ---- redispatch: pull the g rows of the tokens we received (combine's transpose) ------------- */
/* The first index in [0, n) whose key is >= target, n if none, by one warp (32 probes a round:
 * 3 rounds for 32k rows). key = v[i], or "infinite" where v[i] < 0. Whatever v holds, the result
 * is in [0, n] and only v[0..n) is read. */
__device__ int64_t warp_lower_bound(const int *v, int64_t n, int64_t target, int lane) {
  int64_t lo = 0, hi = n; /* the answer is in [lo, hi]; hi is n or an index whose key is >= target */
  while (lo < hi) {
    const int64_t step = (hi - lo + 31) / 32, p = lo + (int64_t)(lane + 1) * step - 1;
    const bool ge = p >= hi || v[p] < 0 || v[p] >= target;
    const unsigned m = __ballot_sync(0xffffffffu, ge);
    if (!m) return hi;
    const int f = __ffs(m) - 1;
    const int64_t pf = lo + (int64_t)(f + 1) * step - 1;
    if (pf < hi) hi = pf;
    if (f > 0) lo += (int64_t)f * step;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads) redispatch_kernel(RedispatchArgs a) {
  const Ctl &c = a.c;
  const int R = c.R, me = c.rank, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t N = a.N, rows_in = (int64_t)a.T * R;
  if (blockIdx.x == 0 && a.mode < 2) {
    if (threadIdx.x < R) c.bufs[threadIdx.x]->mail[me].ptr[0] = (unsigned long long)a.g;
    publish(c);
  }
  /* My rows are in (source, token) order, the unused ones (-1) last: warp s finds where source
   * s's rows start (warp R: the unused ones), while the peers arrive. A gather in any other order
   * (sluice.ep's bounded rounds pull rows back to their tokens) still writes each row once. */
  __shared__ int64_t bound[kMaxRanks + 1];
  if (threadIdx.x == 0) bound[0] = 0;
  if (warp >= 1 && warp <= R) {
    const int64_t b = warp_lower_bound(a.recv_src, N, (int64_t)warp * a.T, lane);
    if (lane == 0) bound[warp] = b;
  }
  bool ok = true;
  if (a.mode < 2)
    ok = meet(c);
  else
    __syncthreads();
  __shared__ const char *src[kMaxRanks];
  if (ok && threadIdx.x < R)
    src[threadIdx.x] =
        a.mode == 0 ? (const char *)((const volatile Mail *)c.bufs[me]->mail)[threadIdx.x].ptr[0]
                    : a.srcs[threadIdx.x];
  if (threadIdx.x == 0) /* monotone and in [0, N], whatever recv_src held */
    for (int s = 1; s <= R; ++s)
      bound[s] = bound[s] < bound[s - 1] ? bound[s - 1] : bound[s] > N ? N : bound[s];
  __syncthreads();
  if (ok) {
    const int gw = blockIdx.x * kWarps + warp, nw = gridDim.x * kWarps;
    auto pull = [&](int64_t r) {
      const int from = a.recv_src[r];
      char *o = a.out + r * a.row_bytes;
      if (from < 0 || from >= rows_in) {
        zero_row(o, a.row_bytes, a.vec, lane);
      } else {
        const int s = from / a.T, t = from % a.T;
        any_copy_row(o, src[s] + (int64_t)t * a.row_bytes, a.row_bytes, a.vec, lane);
      }
    };
    /* The sources' rows interleaved (row q of source me+1, of me+2, ..., then row q+1): every
     * source serves every rank at every moment. In row order all ranks would read source 0 first
     * and share its egress while the other links idle. Any bounds (monotone, clamped to [0, N])
     * give a permutation of [0, N): each row is written once. */
    const int64_t *lo = bound;
    int64_t most = 0;
    for (int s = 0; s < R; ++s)
      if (lo[s + 1] - lo[s] > most) most = lo[s + 1] - lo[s];
    for (int64_t j = gw; j < most * R; j += nw) {
      const int s = (me + 1 + (int)(j % R)) % R;
      const int64_t q = j / R;
      if (q < lo[s + 1] - lo[s]) pull(lo[s] + q);
    }
    for (int64_t r = lo[R] + gw; r < N; r += nw) pull(r); /* the unused rows: zeros */
  }
  if (a.mode < 2) leave(c, ok);
}

template <bool Local>
void launch_combine_as(sl_dtype t, int blocks, cudaStream_t s, const CombineArgs &a) {
  if (t == SL_DTYPE_BF16)
    combine_kernel<__nv_bfloat16, Local><<<blocks, kThreads, 0, s>>>(a);
  else if (t == SL_DTYPE_F16)
    combine_kernel<__half, Local><<<blocks, kThreads, 0, s>>>(a);
  else
    combine_kernel<float, Local><<<blocks, kThreads, 0, s>>>(a);
}

}  // namespace

void launch_combine(sl_dtype t, bool local, int blocks, cudaStream_t s, const CombineArgs &a) {
  if (local)
    launch_combine_as<true>(t, blocks, s, a);
  else
    launch_combine_as<false>(t, blocks, s, a);
}

void launch_redispatch(int blocks, cudaStream_t s, const RedispatchArgs &a) {
  redispatch_kernel<<<blocks, kThreads, 0, s>>>(a);
}

}  // namespace sluice_cuda
