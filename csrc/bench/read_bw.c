// The machine's read bandwidth from DRAM, for the decode roofline: T threads, each streaming its own
// contiguous share of a buffer of at least 4x the last-level cache with 32-byte loads and one integer
// add per load (the light vector work a weight-streaming kernel does), the best of REPS passes.
// Prints "<GB/s>". torch's sum() measured 20-30 % under this on Zen 4: its reduction is the bottleneck.
// Not part of inferd: benchmarks/common.py builds and runs it.
// Build: cc -O2 -fopenmp read_bw.c -o read_bw; run: read_bw THREADS BYTES [REPS]
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// four independent chains, so the adds never limit the loads
__attribute__((target("avx2"))) static int64_t sum_avx2(const uint8_t* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    a0 = _mm256_add_epi32(a0, _mm256_load_si256((const __m256i*)(p + i)));
    a1 = _mm256_add_epi32(a1, _mm256_load_si256((const __m256i*)(p + i + 32)));
    a2 = _mm256_add_epi32(a2, _mm256_load_si256((const __m256i*)(p + i + 64)));
    a3 = _mm256_add_epi32(a3, _mm256_load_si256((const __m256i*)(p + i + 96)));
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3));
  int32_t out[8];
  _mm256_storeu_si256((__m256i*)out, s);
  return (int64_t)out[0] + out[7];
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: read_bw THREADS BYTES [REPS]\n");
    return 2;
  }
  const int threads = atoi(argv[1]), reps = argc > 3 ? atoi(argv[3]) : 5;
  const size_t bytes = (size_t)atoll(argv[2]) / (128 * (size_t)threads) * 128 * threads;
  uint8_t* buf = aligned_alloc(4096, bytes);
  if (!buf) return 1;
  omp_set_num_threads(threads);
  const size_t share = bytes / threads;
#pragma omp parallel
  memset(buf + omp_get_thread_num() * share, 1, share);  // each thread faults in its own share's pages
  double best = 1e30;
  volatile int64_t sink = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
#pragma omp parallel reduction(+ : sink)
    sink += sum_avx2(buf + omp_get_thread_num() * share, share);
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  printf("%.2f\n", bytes / best / 1e9);
  free(buf);
  return sink == 42 ? 3 : 0;
}
