/*
 * Expert parallelism on the CPU: the layout, the shared-memory transport with one thread per rank
 * (dispatch, combine, redispatch against a naive single-threaded model of all ranks), error
 * agreement across ranks, a rank that never arrives (bounded wait, then a broken communicator), and
 * fan_out / fan_in / fan_in_bwd. Runs under AddressSanitizer and UndefinedBehaviorSanitizer;
 * outputs are poisoned (0xFF bytes: NaN floats, -1 ints) before every call so an unwritten element
 * fails.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sluice.h"
#include "test_util.h"

static void *poisoned(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  memset(p, 0xFF, bytes ? bytes : 1);
  return p;
}

/* Random routing: distinct experts per token, some slots -1. mode 1: all on rank 0; 2: none. */
static void make_routing(int32_t *idx, int64_t T, int64_t k, int64_t E, int64_t L, int mode) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pool = mode == 1 ? L : E;
    for (int64_t j = 0; j < k; ++j) {
      int32_t e;
      int again;
      do {
        e = (int32_t)rand_int(0, (int)pool - 1);
        again = 0;
        for (int64_t i = 0; i < j; ++i) again |= idx[t * k + i] == e;
      } while (again && j < pool);
      idx[t * k + j] = (j >= pool || mode == 2 || rand_int(0, 4) == 0) ? -1 : e;
    }
  }
}

/* ---- layout ------------------------------------------------------------------------------ */
static void test_layout(void) {
  for (int it = 0; it < 40; ++it) {
    sl_ep_desc d = sl_ep_desc_default();
    d.num_ranks = rand_int(1, 6);
    d.num_experts = d.num_ranks * rand_int(1, 5);
    d.topk = rand_int(1, 8);
    d.num_tokens = rand_int(0, 40);
    const int64_t T = d.num_tokens, k = d.topk, R = d.num_ranks, E = d.num_experts, L = E / R;
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(T * k + 1));
    make_routing(idx, T, k, E, L, it % 7 == 0);
    int32_t *pos = poisoned(sizeof(int32_t) * (size_t)(T * R)),
            *cnt = poisoned(sizeof(int32_t) * R), *ecnt = poisoned(sizeof(int32_t) * E);
    sl_status st = sl_ep_layout_cpu(&d, idx, pos, cnt, ecnt);
    CHECK(st == SL_STATUS_SUCCESS, "layout: %s", sl_last_error());
    int64_t *want_cnt = calloc((size_t)R, sizeof(int64_t)),
            *want_e = calloc((size_t)E, sizeof(int64_t));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t r = 0; r < R; ++r) {
        int goes = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = idx[t * k + j];
          goes |= e >= 0 && e / L == r;
        }
        const int32_t want = goes ? (int32_t)want_cnt[r]++ : -1;
        CHECK(pos[t * R + r] == want, "layout: send_pos[%lld,%lld] = %d, want %d", (long long)t,
              (long long)r, pos[t * R + r], want);
      }
    for (int64_t t = 0; t < T * k; ++t)
      if (idx[t] >= 0) want_e[idx[t]]++;
    for (int64_t r = 0; r < R; ++r)
      CHECK(cnt[r] == want_cnt[r], "layout: send_counts[%lld]", (long long)r);
    for (int64_t e = 0; e < E; ++e)
      CHECK(ecnt[e] == want_e[e], "layout: expert_counts[%lld]", (long long)e);
    /* Bad ids: rejected, outputs untouched. */
    if (T > 0) {
      const int32_t keep = idx[0];
      idx[0] = (int32_t)E;
      memset(cnt, 0x5A, sizeof(int32_t) * R);
      st = sl_ep_layout_cpu(&d, idx, pos, cnt, NULL);
      CHECK(st == SL_STATUS_INVALID_VALUE && strstr(sl_last_error(), "outside") &&
                ((unsigned char *)cnt)[0] == 0x5A,
            "layout: id E not rejected (%s)", sl_last_error());
      idx[0] = -3;
      CHECK(sl_ep_layout_cpu(&d, idx, pos, cnt, NULL) == SL_STATUS_INVALID_VALUE, "layout: id -3");
      idx[0] = keep;
      if (k >= 2) {
        const int32_t a = idx[0], b = idx[1];
        idx[0] = idx[1] = 0;
        st = sl_ep_layout_cpu(&d, idx, pos, cnt, NULL);
        CHECK(st == SL_STATUS_INVALID_VALUE && strstr(sl_last_error(), "twice"),
              "layout: duplicate not rejected (%s)", sl_last_error());
        idx[0] = a, idx[1] = b;
      }
    }
    free(idx), free(pos), free(cnt), free(ecnt), free(want_cnt), free(want_e);
  }
  sl_ep_desc d = sl_ep_desc_default();
  d.num_ranks = 3;
  d.num_experts = 4;
  CHECK(sl_ep_layout_cpu(&d, NULL, NULL, NULL, NULL) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "not a multiple"),
        "layout: E %% R != 0 (%s)", sl_last_error());
}

/* ---- the transport: one thread per rank ------------------------------------------------- */
typedef struct world {
  int64_t comm;
  int R, G;
  sl_ep_desc d;
  float **x;     /* [G*R][T*H] f32 rows */
  int32_t **idx; /* [G*R][T*k] */
  float **w;     /* [G*R][T*k] */
  /* outputs per (group, rank) */
  float **rx, **rw, **y, **out, **g, **rd;
  int32_t **ri, **nr, **cn, **sr, **rs;
  float **yw, **ow;
  sl_status st[3][64];
  char msg[3][64][512];
  int skip_rank; /* this rank never arrives (-1: all arrive) */
} world;

typedef struct arg {
  world *w;
  int group, rank;
} arg;

static void *rank_main(void *p) {
  arg *a = p;
  world *w = a->w;
  const int i = a->group * w->R + a->rank;
  if (a->rank == w->skip_rank) return NULL;
  sl_ep_desc d = w->d;
  d.tag = 7;
  w->st[0][i] =
      sl_ep_dispatch_cpu(w->comm, a->group, a->rank, &d, w->x[i], w->idx[i], w->w[i], w->rx[i],
                         w->ri[i], w->rw[i], w->nr[i], w->cn[i], w->sr[i], w->rs[i]);
  snprintf(w->msg[0][i], 512, "%s", sl_last_error());
  if (w->st[0][i]) return NULL;
  /* y = recv_x * (1 + row/8): a different value per received row. */
  const int64_t N = d.num_tokens * w->R, H = d.hidden, k = d.topk;
  for (int64_t r = 0; r < N; ++r)
    for (int64_t h = 0; h < H; ++h)
      w->y[i][r * H + h] = w->rx[i][r * H + h] * (1.0f + (float)r / 8);
  for (int64_t r = 0; r < N * k; ++r) w->yw[i][r] = w->rw[i][r] * 3.0f;
  d.tag = 8;
  w->st[1][i] = sl_ep_combine_cpu(w->comm, a->group, a->rank, &d, w->y[i], w->yw[i], w->sr[i],
                                  w->out[i], w->ow[i]);
  snprintf(w->msg[1][i], 512, "%s", sl_last_error());
  d.tag = 9;
  w->st[2][i] = sl_ep_redispatch_cpu(w->comm, a->group, a->rank, &d, w->g[i], w->rs[i], w->rd[i]);
  snprintf(w->msg[2][i], 512, "%s", sl_last_error());
  return NULL;
}

static void run_world(world *w) {
  const int n = w->G * w->R;
  pthread_t th[64];
  arg args[64];
  for (int i = 0; i < n; ++i) {
    args[i] = (arg){w, i / w->R, i % w->R};
    pthread_create(&th[i], NULL, rank_main, &args[i]);
  }
  for (int i = 0; i < n; ++i) pthread_join(th[i], NULL);
}

static float **alloc_all(int n, size_t bytes) {
  float **p = malloc(sizeof(float *) * (size_t)n);
  for (int i = 0; i < n; ++i) p[i] = poisoned(bytes);
  return p;
}
static void free_all(void *pp, int n) {
  void **p = pp;
  for (int i = 0; i < n; ++i) free(p[i]);
  free(p);
}

static void world_init(world *w, int G, int R, int64_t T, int64_t H, int64_t k, int64_t E,
                       int mode) {
  memset(w, 0, sizeof *w);
  w->G = G, w->R = R, w->skip_rank = -1;
  w->d = sl_ep_desc_default();
  w->d.num_tokens = T, w->d.hidden = H, w->d.topk = k, w->d.num_experts = E, w->d.num_ranks = R;
  const int n = G * R;
  const int64_t N = T * R, L = E / R;
  w->x = alloc_all(n, sizeof(float) * (size_t)(T * H));
  w->idx = (int32_t **)alloc_all(n, sizeof(int32_t) * (size_t)(T * k));
  w->w = alloc_all(n, sizeof(float) * (size_t)(T * k));
  w->g = alloc_all(n, sizeof(float) * (size_t)(T * H));
  for (int i = 0; i < n; ++i) {
    for (int64_t j = 0; j < T * H; ++j) w->x[i][j] = rand_float(), w->g[i][j] = rand_float();
    make_routing(w->idx[i], T, k, E, L, mode);
    for (int64_t j = 0; j < T * k; ++j) w->w[i][j] = rand_float();
  }
  w->rx = alloc_all(n, sizeof(float) * (size_t)(N * H));
  w->y = alloc_all(n, sizeof(float) * (size_t)(N * H));
  w->rd = alloc_all(n, sizeof(float) * (size_t)(N * H));
  w->out = alloc_all(n, sizeof(float) * (size_t)(T * H));
  w->rw = alloc_all(n, sizeof(float) * (size_t)(N * k));
  w->yw = alloc_all(n, sizeof(float) * (size_t)(N * k));
  w->ow = alloc_all(n, sizeof(float) * (size_t)(T * k));
  w->ri = (int32_t **)alloc_all(n, sizeof(int32_t) * (size_t)(N * k));
  w->nr = (int32_t **)alloc_all(n, sizeof(int32_t));
  w->cn = (int32_t **)alloc_all(n, sizeof(int32_t) * (size_t)L);
  w->sr = (int32_t **)alloc_all(n, sizeof(int32_t) * (size_t)(T * R));
  w->rs = (int32_t **)alloc_all(n, sizeof(int32_t) * (size_t)N);
}

static void world_free(world *w) {
  const int n = w->G * w->R;
  free_all(w->x, n), free_all(w->idx, n), free_all(w->w, n), free_all(w->g, n);
  free_all(w->rx, n), free_all(w->y, n), free_all(w->rd, n), free_all(w->out, n);
  free_all(w->rw, n), free_all(w->yw, n), free_all(w->ow, n), free_all(w->ri, n);
  free_all(w->nr, n), free_all(w->cn, n), free_all(w->sr, n), free_all(w->rs, n);
}

/* Checks every output against a naive model of the whole group. */
static void check_world(world *w, int group) {
  const int R = w->R;
  const int64_t T = w->d.num_tokens, H = w->d.hidden, k = w->d.topk, E = w->d.num_experts,
                L = E / R, N = T * R;
  for (int d = 0; d < R; ++d) {
    const int i = group * R + d;
    int64_t row = 0;
    int64_t *cnt = calloc((size_t)L, sizeof(int64_t));
    for (int s = 0; s < R; ++s) {
      const int si = group * R + s;
      for (int64_t t = 0; t < T; ++t) {
        int goes = 0;
        for (int64_t j = 0; j < k; ++j)
          goes |= w->idx[si][t * k + j] >= 0 && w->idx[si][t * k + j] / L == d;
        if (!goes) continue;
        CHECK(w->rs[i][row] == s * T + t, "recv_src[%d][%lld]", d, (long long)row);
        CHECK(memcmp(&w->rx[i][row * H], &w->x[si][t * H], sizeof(float) * (size_t)H) == 0,
              "recv_x[%d] row %lld", d, (long long)row);
        CHECK(w->sr[si][t * R + d] == row, "send_row[%d][%lld,%d] = %d, want %lld", s, (long long)t,
              d, w->sr[si][t * R + d], (long long)row);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = w->idx[si][t * k + j];
          const int local = e >= 0 && e / L == d;
          CHECK(w->ri[i][row * k + j] == (local ? e - d * L : -1), "recv_idx");
          CHECK(w->rw[i][row * k + j] == (local ? w->w[si][t * k + j] : 0.0f), "recv_w");
          if (local) cnt[e - d * L]++;
        }
        /* redispatch brings g of the same token */
        CHECK(memcmp(&w->rd[i][row * H], &w->g[si][t * H], sizeof(float) * (size_t)H) == 0,
              "redispatch row %lld", (long long)row);
        ++row;
      }
      for (int64_t t = 0; t < T; ++t) {
        int goes = 0;
        for (int64_t j = 0; j < k; ++j)
          goes |= w->idx[si][t * k + j] >= 0 && w->idx[si][t * k + j] / L == d;
        if (!goes) CHECK(w->sr[si][t * R + d] == -1, "send_row not -1");
      }
    }
    CHECK(*w->nr[i] == row, "num_recv[%d] = %d, want %lld", d, *w->nr[i], (long long)row);
    for (int64_t e = 0; e < L; ++e)
      CHECK(w->cn[i][e] == cnt[e], "counts[%d][%lld]", d, (long long)e);
    for (int64_t r = row; r < N; ++r) {
      CHECK(w->rs[i][r] == -1, "recv_src past num_recv");
      for (int64_t h = 0; h < H; ++h) CHECK(w->rx[i][r * H + h] == 0.0f, "recv_x past num_recv");
      for (int64_t h = 0; h < H; ++h)
        CHECK(w->rd[i][r * H + h] == 0.0f, "redispatch past num_recv");
      for (int64_t j = 0; j < k; ++j)
        CHECK(w->ri[i][r * k + j] == -1 && w->rw[i][r * k + j] == 0.0f, "tail ids");
    }
    free(cnt);
  }
  /* combine: out[s][t] = sum over d in order of y_d[send_row] (f32, same order: equal bits). */
  for (int s = 0; s < R; ++s) {
    const int si = group * R + s;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int d = 0; d < R; ++d) {
          const int32_t r = w->sr[si][t * R + d];
          if (r >= 0) acc += w->y[group * R + d][r * H + h];
        }
        CHECK(w->out[si][t * H + h] == acc, "combine[%d][%lld,%lld] = %g, want %g", s, (long long)t,
              (long long)h, w->out[si][t * H + h], acc);
      }
      for (int64_t j = 0; j < k; ++j) {
        /* only the owner rank of slot j has a non-zero weight */
        const int32_t e = w->idx[si][t * k + j];
        const float want = e >= 0 ? w->w[si][t * k + j] * 3.0f : 0.0f;
        CHECK(w->ow[si][t * k + j] == want, "combine weights[%d][%lld,%lld]", s, (long long)t,
              (long long)j);
      }
    }
  }
}

static void test_transport(void) {
  const int shapes[][7] = {
      /* G, R, T, H, k, E, mode */
      {1, 1, 5, 3, 2, 4, 0},  {1, 2, 7, 5, 2, 4, 0},  {1, 3, 11, 4, 3, 9, 0},
      {2, 4, 6, 8, 8, 32, 0}, {1, 5, 3, 2, 4, 10, 1}, {1, 8, 4, 3, 8, 64, 0},
      {1, 4, 5, 2, 3, 8, 2},  {1, 4, 0, 2, 3, 8, 0},  {3, 2, 9, 1, 1, 2, 0},
  };
  for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; ++c) {
    const int *s = shapes[c];
    sl_ep_comm_desc cd = sl_ep_comm_desc_default();
    cd.num_groups = s[0], cd.num_ranks = s[1], cd.timeout_s = 20.0;
    world w;
    world_init(&w, s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
    CHECK(sl_ep_comm_create(&cd, &w.comm) == SL_STATUS_SUCCESS, "comm_create: %s", sl_last_error());
    for (int round = 0; round < 2; ++round) { /* a second round reuses the tags: call #1 */
      run_world(&w);
      for (int i = 0; i < s[0] * s[1]; ++i)
        for (int op = 0; op < 3; ++op)
          CHECK(w.st[op][i] == SL_STATUS_SUCCESS, "case %zu op %d rank %d: %s", c, op, i,
                w.msg[op][i]);
      for (int g = 0; g < s[0]; ++g) check_world(&w, g);
    }
    CHECK(sl_ep_comm_destroy(w.comm) == SL_STATUS_SUCCESS, "destroy");
    world_free(&w);
  }
}

/* A bad id on one rank: every rank of the group returns the same error; the communicator survives.
 */
static void test_error_agreement(void) {
  sl_ep_comm_desc cd = sl_ep_comm_desc_default();
  cd.num_ranks = 4;
  cd.timeout_s = 20.0;
  world w;
  world_init(&w, 1, 4, 6, 3, 2, 8, 0);
  sl_ep_comm_create(&cd, &w.comm);
  const int32_t keep = w.idx[2][5];
  w.idx[2][5] = 99;
  run_world(&w);
  for (int r = 0; r < 4; ++r)
    CHECK(w.st[0][r] == SL_STATUS_INVALID_VALUE &&
              strstr(w.msg[0][r], "rank 2 of group 0 failed") &&
              strstr(w.msg[0][r], "topk_idx[2, 1] = 99"),
          "error agreement, rank %d: %s", r, w.msg[0][r]);
  w.idx[2][5] = keep;
  run_world(&w);
  for (int r = 0; r < 4; ++r)
    CHECK(w.st[0][r] == SL_STATUS_SUCCESS, "after error: %s", w.msg[0][r]);
  check_world(&w, 0);
  sl_ep_comm_destroy(w.comm);
  world_free(&w);
}

/* Rank 2 never arrives: the others fail within the timeout, naming it; later calls fail at once. */
static void test_timeout(void) {
  sl_ep_comm_desc cd = sl_ep_comm_desc_default();
  cd.num_ranks = 3;
  cd.timeout_s = 0.3;
  world w;
  world_init(&w, 1, 3, 4, 2, 2, 6, 0);
  sl_ep_comm_create(&cd, &w.comm);
  w.skip_rank = 2;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  run_world(&w);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  for (int r = 0; r < 2; ++r)
    CHECK(w.st[0][r] == SL_STATUS_TIMEOUT && strstr(w.msg[0][r], "for rank(s) 2 to arrive") &&
              strstr(w.msg[0][r], "waited"),
          "timeout, rank %d: status %d, %s", r, w.st[0][r], w.msg[0][r]);
  CHECK(secs < 5.0, "timeout took %.2f s", secs);
  /* The communicator is broken now: every call fails at once. */
  w.skip_rank = -1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  run_world(&w);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  for (int r = 0; r < 3; ++r)
    CHECK(w.st[0][r] == SL_STATUS_TIMEOUT && strstr(w.msg[0][r], "broken"), "broken: %s",
          w.msg[0][r]);
  CHECK((double)(t1.tv_sec - t0.tv_sec) < 2.0, "broken calls were not immediate");
  sl_ep_comm_destroy(w.comm);
  world_free(&w);
  /* A bad communicator id and bad descriptors. */
  sl_ep_desc d = sl_ep_desc_default();
  CHECK(sl_ep_dispatch_cpu(123456, 0, 0, &d, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                           NULL) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "no communicator"),
        "bad comm id: %s", sl_last_error());
  cd.timeout_s = 0;
  int64_t id;
  CHECK(sl_ep_comm_create(&cd, &id) == SL_STATUS_INVALID_ARGUMENT, "timeout 0 accepted");
  cd = sl_ep_comm_desc_default();
  cd.use_cuda = 1;
  CHECK(sl_ep_comm_create(&cd, &id) == SL_STATUS_UNSUPPORTED, "use_cuda without CUDA");
  /* Transports: a bad one, IPC/NCCL without CUDA; the multi-process entry points on a CPU comm. */
  cd = sl_ep_comm_desc_default();
  cd.transport = 7;
  CHECK(sl_ep_comm_create(&cd, &id) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "transport"),
        "transport 7: %s", sl_last_error());
  cd.transport = SL_EP_TRANSPORT_NCCL;
  CHECK(sl_ep_comm_create(&cd, &id) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "use_cuda"),
        "NCCL without use_cuda: %s", sl_last_error());
  cd.use_cuda = 1;
  CHECK(sl_ep_comm_create(&cd, &id) == SL_STATUS_UNSUPPORTED, "NCCL without CUDA: %s",
        sl_last_error());
  cd = sl_ep_comm_desc_default();
  cd.num_ranks = 2;
  CHECK(sl_ep_comm_create(&cd, &id) == SL_STATUS_SUCCESS, "cpu comm: %s", sl_last_error());
  unsigned char blob[SL_EP_BLOB_BYTES];
  size_t nb = 0;
  int need = 0;
  CHECK(sl_ep_comm_export(id, 0, 0, blob, &nb) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "no CUDA transport"),
        "export on a CPU comm: %s", sl_last_error());
  CHECK(sl_ep_comm_export(id, 0, 5, blob, &nb) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "rank 5"),
        "export of rank 5: %s", sl_last_error());
  CHECK(sl_ep_comm_needs(id, 0, 0, &need) == SL_STATUS_INVALID_ARGUMENT, "needs on a CPU comm");
  CHECK(sl_ep_comm_import(id, 0, 1, blob, 0) == SL_STATUS_INVALID_ARGUMENT, "import on a CPU comm");
  CHECK(sl_ep_comm_connect(id) == SL_STATUS_INVALID_ARGUMENT, "connect on a CPU comm");
  CHECK(sl_ep_comm_connect(999999) == SL_STATUS_INVALID_ARGUMENT &&
            strstr(sl_last_error(), "no communicator"),
        "connect of a bad id: %s", sl_last_error());
  sl_ep_comm_destroy(id);
}

/* ---- fan_out / fan_in --------------------------------------------------------------------- */
static void test_fan(void) {
  for (int it = 0; it < 30; ++it) {
    sl_ep_fan_desc d = sl_ep_fan_desc_default();
    d.num_rows = rand_int(0, 30);
    d.hidden = rand_int(1, 9);
    d.topk = rand_int(1, 6);
    d.num_local_experts = rand_int(1, 7);
    /* every other case bounds the rows (max_rows): pairs past it are left out */
    const int64_t worst = d.num_rows * (d.topk < d.num_local_experts ? d.topk : d.num_local_experts);
    if (it % 2 && worst > 0) d.max_rows = rand_int(1, (int)worst);
    d.skip_unused_rows = it % 3 == 0; /* the CPU zeroes the rows past the pairs all the same */
    const int64_t N = d.num_rows, H = d.hidden, k = d.topk, L = d.num_local_experts,
                  M = sl_ep_fan_rows(&d);
    CHECK(M == (d.max_rows > 0 && d.max_rows < worst ? d.max_rows : worst), "fan rows");
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(N * k + 1));
    make_routing(idx, N, k, L, L, 0);
    float *x = malloc(sizeof(float) * (size_t)(N * H + 1)),
          *w = malloc(sizeof(float) * (size_t)(N * k + 1));
    for (int64_t i = 0; i < N * H; ++i) x[i] = rand_float();
    for (int64_t i = 0; i < N * k; ++i) w[i] = rand_float();
    float *xs = poisoned(sizeof(float) * (size_t)(M * H));
    int32_t *gs = poisoned(sizeof(int32_t) * (size_t)L),
            *pos = poisoned(sizeof(int32_t) * (size_t)(N * k));
    CHECK(sl_ep_fan_out_cpu(&d, x, idx, xs, gs, pos) == SL_STATUS_SUCCESS, "fan_out: %s",
          sl_last_error());
    /* Model: groups in expert order, within a group (row, slot) order; rows from M on left out. */
    int64_t p = 0;
    for (int64_t e = 0; e < L; ++e) {
      int64_t n = 0;
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < k; ++j)
          if (idx[i * k + j] == e) {
            if (p < M) {
              CHECK(pos[i * k + j] == p, "fan_out pos");
              CHECK(memcmp(&xs[p * H], &x[i * H], sizeof(float) * (size_t)H) == 0, "fan_out row");
              ++n;
            } else {
              CHECK(pos[i * k + j] == -1, "fan_out pos past max_rows");
            }
            ++p;
          }
      CHECK(gs[e] == n, "group_sizes[%lld]", (long long)e);
    }
    if (p > M) p = M; /* the rows filled */
    for (int64_t i = 0; i < N * k; ++i)
      if (idx[i] < 0) CHECK(pos[i] == -1, "pos of a masked slot");
    for (int64_t i = p * H; i < M * H; ++i) CHECK(xs[i] == 0.0f, "fan_out padding");
    /* fan_in and its backward on ys = random */
    float *ys = malloc(sizeof(float) * (size_t)(M * H + 1)),
          *out = poisoned(sizeof(float) * (size_t)(N * H));
    for (int64_t i = 0; i < M * H; ++i) ys[i] = rand_float();
    CHECK(sl_ep_fan_in_cpu(&d, ys, w, pos, out) == SL_STATUS_SUCCESS, "fan_in: %s",
          sl_last_error());
    float *dys = poisoned(sizeof(float) * (size_t)(M * H)),
          *dw = poisoned(sizeof(float) * (size_t)(N * k));
    CHECK(sl_ep_fan_in_bwd_cpu(&d, x, ys, w, pos, gs, dys, dw) == SL_STATUS_SUCCESS,
          "fan_in_bwd: %s", sl_last_error());
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        double acc = 0;
        for (int64_t j = 0; j < k; ++j)
          if (pos[i * k + j] >= 0) acc += (double)w[i * k + j] * ys[pos[i * k + j] * H + h];
        CHECK(fabs(out[i * H + h] - acc) < 1e-5, "fan_in[%lld,%lld]", (long long)i, (long long)h);
      }
      for (int64_t j = 0; j < k; ++j) {
        const int32_t q = pos[i * k + j];
        double dot = 0;
        for (int64_t h = 0; h < H && q >= 0; ++h) dot += (double)x[i * H + h] * ys[q * H + h];
        CHECK(fabs(dw[i * k + j] - dot) < 1e-5, "fan_in_bwd dw");
        for (int64_t h = 0; h < H && q >= 0; ++h)
          CHECK(fabsf(dys[q * H + h] - w[i * k + j] * x[i * H + h]) < 1e-6f, "fan_in_bwd dys");
      }
    }
    for (int64_t i = p * H; i < M * H; ++i) CHECK(dys[i] == 0.0f, "fan_in_bwd padding");
    /* without the weights' gradient (ys and dw NULL): the same dys, ys unread */
    float *dys2 = poisoned(sizeof(float) * (size_t)(M * H));
    CHECK(sl_ep_fan_in_bwd_cpu(&d, x, NULL, w, pos, gs, dys2, NULL) == SL_STATUS_SUCCESS,
          "fan_in_bwd without dw: %s", sl_last_error());
    CHECK(memcmp(dys, dys2, sizeof(float) * (size_t)(M * H)) == 0, "fan_in_bwd without dw: dys");
    CHECK(sl_ep_fan_in_bwd_cpu(&d, x, ys, w, pos, gs, dys2, NULL) == SL_STATUS_INVALID_ARGUMENT,
          "fan_in_bwd ys without dw");
    free(dys2);
    /* bad ids and positions */
    if (N > 0) {
      const int32_t keep = idx[0];
      idx[0] = (int32_t)L;
      CHECK(sl_ep_fan_out_cpu(&d, x, idx, xs, gs, pos) == SL_STATUS_INVALID_VALUE, "fan_out id L");
      idx[0] = keep;
      pos[0] = (int32_t)M;
      CHECK(sl_ep_fan_in_cpu(&d, ys, w, pos, out) == SL_STATUS_INVALID_VALUE, "fan_in pos M");
    }
    free(idx), free(x), free(w), free(xs), free(gs), free(pos), free(ys), free(out), free(dys),
        free(dw);
  }
}

/* recv_rows: dispatch into N < T*R rows (the unbounded rows, when they fit), a rank that would
 * receive more fails on every rank, and redispatch as a gather of any N rows from the peers. */
typedef struct bounded_arg {
  world *w;
  int rank;
  int64_t n;     /* dispatch's recv_rows */
  int64_t m;     /* the gather's rows */
  int32_t *gsrc; /* [m] s*T + t, into the peers' x */
  float *gout;   /* [m, H] */
  sl_status st[2];
  char msg[512];
} bounded_arg;

static void *bounded_main(void *p) {
  bounded_arg *a = p;
  world *w = a->w;
  const int i = a->rank;
  sl_ep_desc d = w->d;
  d.tag = 21;
  d.recv_rows = a->n;
  a->st[0] = sl_ep_dispatch_cpu(w->comm, 0, i, &d, w->x[i], w->idx[i], w->w[i], w->rx[i], w->ri[i],
                                w->rw[i], w->nr[i], w->cn[i], w->sr[i], w->rs[i]);
  snprintf(a->msg, sizeof a->msg, "%s", sl_last_error());
  d.tag = 22;
  d.recv_rows = a->m;
  a->st[1] = sl_ep_redispatch_cpu(w->comm, 0, i, &d, w->x[i], a->gsrc, a->gout);
  return NULL;
}

static void test_recv_rows(void) {
  const int R = 3;
  const int64_t T = 7, H = 4, k = 2, E = 6;
  sl_ep_comm_desc cd = sl_ep_comm_desc_default();
  cd.num_ranks = R, cd.timeout_s = 20.0;
  world w;
  world_init(&w, 1, R, T, H, k, E, 0);
  CHECK(sl_ep_comm_create(&cd, &w.comm) == SL_STATUS_SUCCESS, "comm_create");
  run_world(&w); /* the unbounded reference */
  for (int r = 0; r < R; ++r) CHECK(w.st[0][r] == SL_STATUS_SUCCESS, "reference: %s", w.msg[0][r]);
  int64_t most = 1;
  float *ref_rx[3];
  int32_t *ref_rs[3], ref_nr[3];
  for (int r = 0; r < R; ++r) {
    most = *w.nr[r] > most ? *w.nr[r] : most;
    ref_rx[r] = malloc(sizeof(float) * (size_t)(T * R * H));
    ref_rs[r] = malloc(sizeof(int32_t) * (size_t)(T * R));
    memcpy(ref_rx[r], w.rx[r], sizeof(float) * (size_t)(T * R * H));
    memcpy(ref_rs[r], w.rs[r], sizeof(int32_t) * (size_t)(T * R));
    ref_nr[r] = *w.nr[r];
  }
  for (int pass = 0; pass < 2; ++pass) { /* 0: N = the most rows a rank gets; 1: one fewer */
    const int64_t n = pass == 0 ? most : most - 1, m = 5;
    bounded_arg a[3];
    pthread_t th[3];
    for (int r = 0; r < R; ++r) {
      a[r] = (bounded_arg){
          &w, r, n, m, malloc(sizeof(int32_t) * m), poisoned(sizeof(float) * m * H), {0, 0}, ""};
      for (int64_t j = 0; j < m; ++j) a[r].gsrc[j] = j == 2 ? -1 : rand_int(0, (int)(T * R) - 1);
      memset(w.rx[r], 0xFF, sizeof(float) * (size_t)(T * R * H));
      memset(w.rs[r], 0xFF, sizeof(int32_t) * (size_t)(T * R));
    }
    for (int r = 0; r < R; ++r) pthread_create(&th[r], NULL, bounded_main, &a[r]);
    for (int r = 0; r < R; ++r) pthread_join(th[r], NULL);
    for (int r = 0; r < R; ++r) {
      if (pass == 0) {
        CHECK(a[r].st[0] == SL_STATUS_SUCCESS, "recv_rows %lld: %s", (long long)n, a[r].msg);
        CHECK(*w.nr[r] == ref_nr[r], "recv_rows: num_recv");
        CHECK(memcmp(w.rx[r], ref_rx[r], sizeof(float) * (size_t)(n * H)) == 0,
              "recv_rows: rows differ from the unbounded ones");
        CHECK(memcmp(w.rs[r], ref_rs[r], sizeof(int32_t) * (size_t)n) == 0, "recv_rows: recv_src");
        const unsigned char *past = (const unsigned char *)(w.rx[r] + n * H);
        int untouched = 1;
        for (int64_t b = 0; n < T * R && b < (int64_t)sizeof(float) * H; ++b)
          untouched &= past[b] == 0xFF;
        CHECK(untouched, "recv_rows: a row past N was written");
      } else {
        CHECK(a[r].st[0] == SL_STATUS_INVALID_VALUE && strstr(a[r].msg, "would receive") &&
                  strstr(a[r].msg, "recv_rows"),
              "overflow, rank %d: %s", r, a[r].msg);
      }
      CHECK(a[r].st[1] == SL_STATUS_SUCCESS, "gather of %lld rows", (long long)m);
      for (int64_t j = 0; j < m; ++j) {
        const int32_t src = a[r].gsrc[j];
        for (int64_t h = 0; h < H; ++h) {
          const float want = src < 0 ? 0.0f : w.x[src / T][(src % T) * H + h];
          CHECK(a[r].gout[j * H + h] == want, "gather row %lld", (long long)j);
        }
      }
      free(a[r].gsrc), free(a[r].gout);
    }
  }
  for (int r = 0; r < R; ++r) free(ref_rx[r]), free(ref_rs[r]);
  sl_ep_comm_destroy(w.comm);
  world_free(&w);
}

/* bf16 rows through dispatch and combine: the sums round once. */
typedef struct bf16_arg {
  int64_t comm;
  int rank;
  sl_ep_desc d;
  uint16_t *y;
  int32_t *send_row;
  uint16_t *out;
  sl_status st;
} bf16_arg;

static void *bf16_main(void *p) {
  bf16_arg *a = p;
  a->st = sl_ep_combine_cpu(a->comm, 0, a->rank, &a->d, a->y, NULL, a->send_row, a->out, NULL);
  return NULL;
}

static void test_combine_bf16(void) {
  const int R = 3, T = 4, H = 5;
  sl_ep_comm_desc cd = sl_ep_comm_desc_default();
  cd.num_ranks = R;
  int64_t comm;
  sl_ep_comm_create(&cd, &comm);
  bf16_arg a[3];
  pthread_t th[3];
  for (int r = 0; r < R; ++r) {
    a[r].comm = comm, a[r].rank = r;
    a[r].d = sl_ep_desc_default();
    a[r].d.num_tokens = T, a[r].d.hidden = H, a[r].d.num_ranks = R, a[r].d.num_experts = R;
    a[r].d.dtype = SL_DTYPE_BF16;
    a[r].y = malloc(sizeof(uint16_t) * T * R * H);
    for (int i = 0; i < T * R * H; ++i) a[r].y[i] = to_bf16(rand_float());
    a[r].send_row = malloc(sizeof(int32_t) * T * R);
    for (int i = 0; i < T * R; ++i) a[r].send_row[i] = rand_int(-1, T * R - 1);
    a[r].out = poisoned(sizeof(uint16_t) * T * H);
  }
  for (int r = 0; r < R; ++r) pthread_create(&th[r], NULL, bf16_main, &a[r]);
  for (int r = 0; r < R; ++r) pthread_join(th[r], NULL);
  for (int r = 0; r < R; ++r) {
    CHECK(a[r].st == SL_STATUS_SUCCESS, "bf16 combine");
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int d = 0; d < R; ++d) {
          const int32_t row = a[r].send_row[t * R + d];
          if (row >= 0) acc += from_bf16(a[d].y[row * H + h]);
        }
        CHECK(a[r].out[t * H + h] == to_bf16(acc), "bf16 combine value");
      }
  }
  for (int r = 0; r < R; ++r) free(a[r].y), free(a[r].send_row), free(a[r].out);
  sl_ep_comm_destroy(comm);
}

int main(void) {
  test_layout();
  test_transport();
  test_error_agreement();
  test_timeout();
  test_fan();
  test_combine_bf16();
  test_recv_rows();
  printf("test_ep: %d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
