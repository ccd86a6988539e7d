/* The machine's int8 roof for `specgate bench steps --roof`: chains of independent VNNI dot products
   (vpdpbusd on 512-bit registers; vpmaddubsw + vpmaddwd on AVX2) on every thread at once, in GMAC/s. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#define N 20000000L
#ifdef __AVX512VNNI__
#define V __m512i
#define SET(x) _mm512_set1_epi8(x)
#define DP(a, b, c) _mm512_dpbusd_epi32(a, b, c)
#define MACS 64
#else
#define V __m256i
#define SET(x) _mm256_set1_epi8(x)
#define DP(a, b, c) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(b, c), _mm256_set1_epi16(1)))
#define MACS 32
#endif
int main(void) {
  double best = 0;
  for (int round = 0; round < 3; round++) {
    double t0 = omp_get_wtime();
    long sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      V a0 = SET(0), a1 = SET(1), a2 = SET(2), a3 = SET(3);
      V a4 = SET(4), a5 = SET(5), a6 = SET(6), a7 = SET(7);
      V b = SET(3), c = SET(5);
      for (long n = 0; n < N; n++) {
        __asm__ volatile("" : "+x"(b));
        a0 = DP(a0, b, c); a1 = DP(a1, b, c); a2 = DP(a2, b, c); a3 = DP(a3, b, c);
        a4 = DP(a4, b, c); a5 = DP(a5, b, c); a6 = DP(a6, b, c); a7 = DP(a7, b, c);
      }
      int out[16];
      V s = a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7;
      __builtin_memcpy(out, &s, sizeof(int) * 4);
      sink += out[0];
    }
    double dt = omp_get_wtime() - t0, gmacs = (double)omp_get_max_threads() * N * 8 * MACS / dt / 1e9;
    if (gmacs > best) best = gmacs;
    if (sink == 42) printf("!");
  }
  printf("%.1f\n", best);
  return 0;
}
