/* Helpers shared by the C tests: a seeded xorshift generator, a thread-safe CHECK that counts and
 * reports failures, and bf16 rounding for building inputs. Header-only: each test is one program. */
#ifndef SLUICE_TEST_UTIL_H_
#define SLUICE_TEST_UTIL_H_

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static int failures = 0, checks = 0;
static pthread_mutex_t check_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng(void) { /* xorshift64*; only the main thread draws */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 0x2545F4914F6CDD1Dull;
}
static inline int rand_int(int lo, int hi) { return lo + (int)(rng() % (uint64_t)(hi - lo + 1)); }
static inline float rand_float(void) {
  return (float)((rng() >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
}

#define CHECK(cond, ...)                                   \
  do {                                                     \
    pthread_mutex_lock(&check_mu);                         \
    ++checks;                                              \
    if (!(cond)) {                                         \
      ++failures;                                          \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
    }                                                      \
    pthread_mutex_unlock(&check_mu);                       \
  } while (0)

static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#endif /* SLUICE_TEST_UTIL_H_ */
