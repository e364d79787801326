// The machine's int8 dot-product peak, for the benchmarks' roofline: on T threads, each thread runs
// 8 independent accumulator chains of the instruction an int8 GEMM is built from on this CPU, with
// no memory traffic. Prints "<isa> <GOP/s>", GOP = 2 x int8 multiply-adds.
//   avx512_vnni  vpdpbusd zmm           (64 multiply-adds, accumulated in int32)
//   avx512       vpmaddubsw + vpaddw zmm (64; the pair a GEMM needs without VNNI)
//   avx2         vpmaddubsw + vpaddw ymm (32)
// Where oneDNN has no int8 kernel for the CPU (torch._int_mm ran at 2-5 GOP/s on an AVX2 EPYC), a
// library GEMM is no ceiling; this is. Not part of inferd: benchmarks/common.py builds and runs it.
// Build: cc -O2 -fopenmp int8_peak.c -o int8_peak; run: int8_peak THREADS [SECONDS]
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// keeps the compiler from hoisting or merging the chains' identical products
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))

#define CHAINS(STEP) STEP(s0) STEP(s1) STEP(s2) STEP(s3) STEP(s4) STEP(s5) STEP(s6) STEP(s7)

__attribute__((target("avx2"))) static long long run_avx2(long n) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5);
  __m256i s0 = a, s1 = a, s2 = a, s3 = a, s4 = a, s5 = a, s6 = a, s7 = a;
#define STEP2(s) OPAQUE(a); s = _mm256_add_epi16(s, _mm256_maddubs_epi16(a, b));
  for (long i = 0; i < n; ++i) { CHAINS(STEP2) }
  __m256i r = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(s0, s1), _mm256_add_epi16(s2, s3)),
                               _mm256_add_epi16(_mm256_add_epi16(s4, s5), _mm256_add_epi16(s6, s7)));
  return _mm256_extract_epi16(r, 0);
}

__attribute__((target("avx512f,avx512bw"))) static long long run_avx512(long n) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  __m512i s0 = a, s1 = a, s2 = a, s3 = a, s4 = a, s5 = a, s6 = a, s7 = a;
#define STEP5(s) OPAQUE(a); s = _mm512_add_epi16(s, _mm512_maddubs_epi16(a, b));
  for (long i = 0; i < n; ++i) { CHAINS(STEP5) }
  __m512i r = _mm512_add_epi16(_mm512_add_epi16(_mm512_add_epi16(s0, s1), _mm512_add_epi16(s2, s3)),
                               _mm512_add_epi16(_mm512_add_epi16(s4, s5), _mm512_add_epi16(s6, s7)));
  return _mm512_reduce_add_epi32(r);
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static long long run_vnni(long n) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  __m512i s0 = a, s1 = a, s2 = a, s3 = a, s4 = a, s5 = a, s6 = a, s7 = a;
#define STEPV(s) OPAQUE(a); s = _mm512_dpbusd_epi32(s, a, b);
  for (long i = 0; i < n; ++i) { CHAINS(STEPV) }
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)),
                               _mm512_add_epi32(_mm512_add_epi32(s4, s5), _mm512_add_epi32(s6, s7)));
  return _mm512_reduce_add_epi32(r);
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const double seconds = argc > 2 ? atof(argv[2]) : 0.5;
  __builtin_cpu_init();
  const char* isa;
  long long (*run)(long);
  int macs;  // multiply-adds per instruction
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) isa = "avx512_vnni", run = run_vnni, macs = 64;
  else if (__builtin_cpu_supports("avx512bw")) isa = "avx512", run = run_avx512, macs = 64;
  else if (__builtin_cpu_supports("avx2")) isa = "avx2", run = run_avx2, macs = 32;
  else { printf("none 0\n"); return 0; }
  // calibrate on one thread, then every thread runs the same count at once
  long n = 1 << 20;
  for (;;) {
    const double t0 = now();
    run(n);
    if (now() - t0 > seconds / 4 || n > (1L << 40)) break;
    n *= 2;
  }
  double best = 0;
  long long sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += run(n);
    const double rate = 2.0 * 8 * macs * (double)n * threads / (now() - t0) / 1e9;
    if (rate > best) best = rate;
  }
  printf("%s %.1f %lld\n", isa, best, sink & 1);
  return 0;
}
