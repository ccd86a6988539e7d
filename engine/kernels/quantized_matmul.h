// Matrix products with GGUF-quantized weights on the CPU, at the weights' own bytes.
//
// Decoding reads every weight once per step, so a one-row product costs (weight bytes) / (memory
// bandwidth); a product of a few rows (a verification step, a batch, a prefill chunk) should cost
// little more, so the arithmetic per weight read must be small. The weights are read from panels of
// 16 output rows (gguf_blocks.h): one 64-byte vector is 4 codes of each of 16 rows, the unsigned
// operand of one VNNI dot product (vpdpbusd) whose signed operand is 4 activation values broadcast.
// So the codes of a block of 32 are unpacked once into 8 such vectors and multiplied with up to
// ROWS activation rows; the results of a row stay in the 16 lanes of its output rows, with no
// horizontal sums.
//
// Activations are quantized to signed 8 bits with a scale per 32 values (llama.cpp keeps one per 256
// for K-quants; one per 256 lost about half the greedy agreement with the fp32 reference on the
// default model). Every weight is w = scale[g] * u + bias[g] for its group g (32 weights, or 16 for
// Q6_K) and its code u, so per group and row:
//   y += (scale[g] * xscale) * sum(u * x) + bias[g] * (xscale * sum(x)).
// Where bias[g] = -offset * scale[g] (the symmetric types) the second term is folded into the
// integer sum, which starts at -offset * sum(x): exact, and one float op fewer.
//
// A (row, output) result is the same floats whatever the number of rows in the call and however the
// panels are split between threads: each row's lanes go through the same operations in the same
// order, so a step's batch never changes a token.
//
// Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (superblocks of 256). The
// Python side turns other types (Q2_K, Q3_K, ...) into Q8_0 first.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "gguf_blocks.h"
#include "layer_math.h"

namespace sg {

// ---- activations ----------------------------------------------------------------------------------

// Rows of activations quantized once per product, for every weight type: int8 codes in natural order,
// one scale per 32 values, and the code sums the bias terms need. Buffers are reused from call to
// call (a decoder stack quantizes hundreds of inputs a step).
struct Activations {
  int64_t rows = 0, K = 0;
  std::vector<int8_t> q;       // [rows, K]
  std::vector<float> xs;       // [rows, K / 32] scale of each 32 values
  std::vector<float> gs;       // [rows, K / 32] xs * (sum of the 32 codes)
  std::vector<int32_t> s32;    // [rows, K / 32] sum of the 32 codes
  std::vector<int32_t> s16;    // [rows, K / 16] sum of each 16 codes
  std::vector<int32_t> o16;    // [rows, K / 16] -32 * s16: Q6_K's offset, ready to broadcast
};

// Raw views of an activation batch (no tensor calls in the inner loops).
struct Act {
  const int8_t* q;
  const float* xs;
  const float* gs;
  const int32_t* s32;
  const int32_t* s16;
  const int32_t* o16;
  int64_t K, nb;  // nb: blocks of 32 per row
};

static Act view(const Activations& a) {
  return {a.q.data(), a.xs.data(), a.gs.data(), a.s32.data(), a.s16.data(), a.o16.data(), a.K, a.K / 32};
}

#if SG_X86
// One block of 32 as the scalar loop below quantizes it (the same float product, rounded half to
// even by the default MXCSR mode as lrint does). Every activation of every layer goes through here:
// one value at a time it took 3-8% of a forward pass of the 1.5B model (1 to 16 tokens).
SG_AVX512 static inline void quantize_block512(const float* v, int8_t* out, float& scale, int32_t& lo,
                                                int32_t& hi) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtsepi32_epi8(qb));
  lo = _mm512_reduce_add_epi32(qa);
  hi = _mm512_reduce_add_epi32(qb);
  scale = amax / 127.f;
}

SG_AVX2 static inline int32_t hsum256(__m256i s) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// The same block with 256-bit vectors (cvtps rounds half to even, as lrint does under the default
// MXCSR mode): on AVX2 machines the scalar loop took ~5% of a forward pass of the 1.5B model.
SG_AVX2 static inline void quantize_block256(const float* v, int8_t* out, float& scale, int32_t& lo, int32_t& hi) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 x[4];
  for (int i = 0; i < 4; i++) x[i] = _mm256_loadu_ps(v + 8 * i);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i q[4];
  for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));
  // packs interleave the 128-bit lanes: dwords come out as quads 0, 2, 4, 6, 1, 3, 5, 7.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256((__m256i*)out, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  lo = hsum256(_mm256_add_epi32(q[0], q[1]));
  hi = hsum256(_mm256_add_epi32(q[2], q[3]));
  scale = amax / 127.f;
}
#endif

// Rows of float activations [rows, in] (contiguous), in a multiple of 32; each row is padded with
// zeros to the panels' row length.
static void quantize_activations(const float* xp, int64_t rows, int64_t in, Activations& a) {
  TORCH_CHECK(in % 32 == 0, "in_features must be a multiple of 32");
  int64_t K = padded_features(in), nb = K / 32;
  a.rows = rows;
  a.K = K;
  a.q.resize(rows * K);
  a.xs.resize(rows * nb);
  a.gs.resize(rows * nb);
  a.s32.resize(rows * nb);
  a.s16.resize(rows * nb * 2);
  a.o16.resize(rows * nb * 2);
  const int64_t level = SG_X86 ? isa() : 0;  // read once, not per block
  (void)level;
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++)
      for (int64_t b = 0; b < nb; b++) {
        const float* v = xp + r * in + 32 * b;
        int8_t* out = a.q.data() + r * K + 32 * b;
        if (32 * b >= in) {  // the padding
          std::memset(out, 0, 32);
          int64_t k = r * nb + b;
          a.xs[k] = a.gs[k] = 0.f;
          a.s32[k] = a.s16[2 * k] = a.s16[2 * k + 1] = a.o16[2 * k] = a.o16[2 * k + 1] = 0;
          continue;
        }
        int32_t lo = 0, hi = 0;
        float scale;
#if SG_X86
        if (level >= 2) {
          quantize_block512(v, out, scale, lo, hi);
        } else if (level == 1) {
          quantize_block256(v, out, scale, lo, hi);
        } else
#endif
        {
          float amax = 0.f;
          for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
          float inv = amax > 0.f ? 127.f / amax : 0.f;
          for (int i = 0; i < 32; i++) {
            out[i] = (int8_t)std::lrint(v[i] * inv);
            (i < 16 ? lo : hi) += out[i];
          }
          scale = amax / 127.f;
        }
        int64_t k = r * nb + b;
        a.xs[k] = scale;
        a.s32[k] = lo + hi;
        a.gs[k] = scale * (float)(lo + hi);
        a.s16[2 * k] = lo;
        a.s16[2 * k + 1] = hi;
        a.o16[2 * k] = -32 * lo;
        a.o16[2 * k + 1] = -32 * hi;
      }
  });
}

// ---- the products -----------------------------------------------------------------------------------

struct Matrix {
  const uint8_t* w;  // packed panels
  int64_t type, rows, panel_bytes, out_offset;
  const float* bias;  // per output row, or null
};

// Activation rows per pass over a panel's codes: their accumulators and the 8 code vectors stay in
// registers (32 on AVX-512, 16 on AVX2).
constexpr int ROWS = 8, ROWS256 = 4;
constexpr int64_t ROW_BLOCK = 64;  // rows per sweep over the matrix (their activations stay in cache)

// Panel p of `m` for activation rows [r0, r1): y[r * ld + out_offset + 16 p + lane].
using PanelKernel = void (*)(const Matrix& m, int64_t p, const Act& a, int64_t r0, int64_t r1, float* y,
                             int64_t ld);

static inline int32_t quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return v;
}

// The portable path: the same sums, one output row at a time.
static void panel_scalar(const Matrix& m, int64_t p, const Act& a, int64_t r0, int64_t r1, float* y, int64_t ld) {
  Layout L = layout_of(m.type);
  int64_t units = a.K / L.unit, valid = std::min<int64_t>(PANEL, m.rows - p * PANEL);
  const uint8_t* panel = m.w + p * m.panel_bytes;
  uint8_t u[256];
  float scale[16], bias[16];
  for (int64_t o = 0; o < valid; o++) {
    for (int64_t r = r0; r < r1; r++) {
      float acc = 0.f, bacc = 0.f;
      for (int64_t n = 0; n < units; n++) {
        unpack_row(m.type, panel + n * L.unit_bytes, (int)o, u, scale, bias);
        for (int g = 0; g < L.unit / L.group; g++) {
          int64_t at = n * L.unit + g * L.group, b = at / 32;
          const int8_t* x = a.q + r * a.K + at;
          int32_t dot = 0;
          for (int i = 0; i < L.group; i++) dot += (int32_t)u[g * L.group + i] * x[i];
          if (L.has_min) {
            bacc += bias[g] * a.gs[r * a.nb + b];
          } else {
            dot -= L.offset * (L.group == 16 ? a.s16[r * 2 * a.nb + at / 16] : a.s32[r * a.nb + b]);
          }
          acc += (float)dot * (scale[g] * a.xs[r * a.nb + b]);
        }
      }
      y[r * ld + m.out_offset + p * PANEL + o] = acc + bacc + (m.bias ? m.bias[p * PANEL + o] : 0.f);
    }
  }
}

#if SG_X86

// Called once per block of 32: fetches the bytes a block reads on average, `distance` ahead of block
// j of unit `un` (a panel streams from memory, and a thread's panels lie one after another). A unit's
// high bits lie at its end, after all its codes: the distance spans two units, or the next unit's
// high bits arrive late (Q6_K's 8-row products were ~20% slower at a fixed 2 kB).
template <int64_t TYPE>
static inline void prefetch_ahead(const uint8_t* un, int j) {
  constexpr Layout L = layout_of(TYPE);
  constexpr int64_t stride = L.unit_bytes / (L.unit / 32), distance = std::max<int64_t>(2048, 2 * L.unit_bytes);
  for (int64_t f = 0; f < stride; f += 64) _mm_prefetch((const char*)(un + j * stride + f + distance), _MM_HINT_T0);
}

// ---- AVX-512 VNNI ---------------------------------------------------------------------------------

// The 8 code vectors (quads 0..7, 16 rows x 4 codes each, unsigned) of a block of 32, from its codes
// q and high bits h.
template <int64_t TYPE>
SG_AVX512 static inline void codes512(const uint8_t* q, const uint8_t* h, __m512i* C) {
  constexpr Layout L = layout_of(TYPE);
  if constexpr (L.bits == 8) {
    for (int c = 0; c < 8; c++) C[c] = _mm512_loadu_si512(q + 64 * c);
    return;
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 4; v++) {
    __m512i V = _mm512_loadu_si512(q + 64 * v);
    C[v] = _mm512_and_si512(V, nib);
    C[v + 4] = _mm512_and_si512(_mm512_srli_epi16(V, 4), nib);
  }
  if constexpr (L.bits == 5) {  // bit c of each byte to bit 4 of quad c's codes: C | (shifted & 0x10)
    const __m512i m = _mm512_set1_epi8(0x10);
    __m512i H = _mm512_loadu_si512(h);
    C[0] = _mm512_ternarylogic_epi32(C[0], _mm512_slli_epi16(H, 4), m, 0xF8);
    C[1] = _mm512_ternarylogic_epi32(C[1], _mm512_slli_epi16(H, 3), m, 0xF8);
    C[2] = _mm512_ternarylogic_epi32(C[2], _mm512_slli_epi16(H, 2), m, 0xF8);
    C[3] = _mm512_ternarylogic_epi32(C[3], _mm512_slli_epi16(H, 1), m, 0xF8);
    C[4] = _mm512_ternarylogic_epi32(C[4], H, m, 0xF8);
    C[5] = _mm512_ternarylogic_epi32(C[5], _mm512_srli_epi16(H, 1), m, 0xF8);
    C[6] = _mm512_ternarylogic_epi32(C[6], _mm512_srli_epi16(H, 2), m, 0xF8);
    C[7] = _mm512_ternarylogic_epi32(C[7], _mm512_srli_epi16(H, 3), m, 0xF8);
  } else if constexpr (L.bits == 6) {  // bits 2(c % 4).. of each byte to bits 4..5
    const __m512i m = _mm512_set1_epi8(0x30);
    for (int half = 0; half < 2; half++) {
      __m512i H = _mm512_loadu_si512(h + 64 * half);
      __m512i* D = C + 4 * half;
      D[0] = _mm512_ternarylogic_epi32(D[0], _mm512_slli_epi16(H, 4), m, 0xF8);
      D[1] = _mm512_ternarylogic_epi32(D[1], _mm512_slli_epi16(H, 2), m, 0xF8);
      D[2] = _mm512_ternarylogic_epi32(D[2], H, m, 0xF8);
      D[3] = _mm512_ternarylogic_epi32(D[3], _mm512_srli_epi16(H, 2), m, 0xF8);
    }
  }
}

// acc += codes (unsigned) times 4 activation values broadcast. GCC does not fold a broadcast load
// into vpdpbusd's memory operand: it issues a vpbroadcastd beside each dot product, one vector
// operation more for every 4 activations. The embedded broadcast ({1to16}) does the same in one:
// products 2-6% faster on Zen 5 (8-64 rows), the same sums.
SG_AVX512 static inline __m512i dp(__m512i acc, __m512i codes, const int8_t* x) {
#if defined(__GNUC__) && !defined(__clang__)
  typedef int32_t __attribute__((may_alias)) packed4;  // 4 int8 codes as one operand
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const packed4*)x));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, codes, _mm512_set1_epi32(quad(x)));
#endif
}

// Panel p for activation rows r0 .. r0 + R - 1.
template <int64_t TYPE, int R>
SG_AVX512 static void panel512(const Matrix& m, int64_t p, const Act& a, int64_t r0, float* y, int64_t ld) {
  constexpr Layout L = layout_of(TYPE);
  constexpr int blocks = (int)(L.unit / 32);
  constexpr bool kmin = TYPE == Q4_K || TYPE == Q5_K;
  const uint8_t* panel = m.w + p * m.panel_bytes;
  const int64_t units = a.K / L.unit;
  __m512 acc[R];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t n = 0; n < units; n++) {
    const uint8_t* un = panel + n * L.unit_bytes;
    const uint8_t* sc = un + scales_at(L);
    __m512 dv = _mm512_setzero_ps(), mv = _mm512_setzero_ps();
    if constexpr (kmin || TYPE == Q6_K) dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sc));
    if constexpr (kmin) mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32)));
    for (int j = 0; j < blocks; j++) {
      prefetch_ahead<TYPE>(un, j);
      const int64_t b = n * blocks + j;  // block of 32 in the row
      __m512i C[8];
      codes512<TYPE>(un + codes_at(L, j), un + high_at(L, j), C);
      if constexpr (TYPE == Q6_K) {
        const __m512 Sa = _mm512_mul_ps(
            dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + 32 + 32 * j)))));
        const __m512 Sb = _mm512_mul_ps(
            dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sc + 48 + 32 * j)))));
        static_assert(L.offset == 32, "o16 holds -32 * s16");
        // Left to itself GCC keeps this loop rolled at 8 rows, its accumulators in memory: unrolled,
        // the 8-row pass is ~7% faster (and the offsets broadcast from memory ~2% more).
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          const int8_t* x = a.q + (r0 + r) * a.K + 32 * b;
          const int32_t* s = a.o16 + (r0 + r) * 2 * a.nb + 2 * b;
          __m512i ia = _mm512_set1_epi32(s[0]), ib = _mm512_set1_epi32(s[1]);
          ia = dp(dp(dp(dp(ia, C[0], x), C[1], x + 4), C[2], x + 8), C[3], x + 12);
          ib = dp(dp(dp(dp(ib, C[4], x + 16), C[5], x + 20), C[6], x + 24), C[7], x + 28);
          const __m512 xs = _mm512_set1_ps(a.xs[(r0 + r) * a.nb + b]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(Sa, xs), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(Sb, xs), acc[r]);
        }
      } else {
        __m512 S, B = _mm512_setzero_ps();
        if constexpr (kmin) {
          S = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                    _mm_loadu_si128((const __m128i*)(sc + 64 + 16 * j)))));
          B = _mm512_mul_ps(mv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                    _mm_loadu_si128((const __m128i*)(sc + 192 + 16 * j)))));
        } else {
          const uint8_t* block = sc + j * L.scale_bytes / 2;
          S = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)block));
          if constexpr (L.has_min) B = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + 32)));
        }
        // The rows inside: each code vector meets all R rows before the next, so R independent sums
        // are in flight at every step. A row's own two chains of 4 left the dot-product units
        // waiting on their latency: Q4_K's 8-64-row products took 6-11% longer that way on Zen 5
        // (1-5 rows: the same; they wait on memory). Q6_K keeps its chains above: with the rows
        // inside it was no faster. Integer sums: the same result in any order.
        __m512i I[R];
        const int8_t* x[R];
        for (int r = 0; r < R; r++) {
          x[r] = a.q + (r0 + r) * a.K + 32 * b;
          I[r] = L.has_min ? _mm512_setzero_si512() : _mm512_set1_epi32(-a.s32[(r0 + r) * a.nb + b] * L.offset);
        }
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
#pragma GCC unroll 8
          for (int r = 0; r < R; r++) I[r] = dp(I[r], C[c], x[r] + 4 * c);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
          const int64_t k = (r0 + r) * a.nb + b;
          const __m512 xs = _mm512_set1_ps(a.xs[k]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(S, xs), acc[r]);
          if constexpr (kmin) acc[r] = _mm512_fnmadd_ps(B, _mm512_set1_ps(a.gs[k]), acc[r]);
          else if constexpr (L.has_min) acc[r] = _mm512_fmadd_ps(B, _mm512_set1_ps(a.gs[k]), acc[r]);
        }
      }
    }
  }
  const int64_t valid = std::min<int64_t>(PANEL, m.rows - p * PANEL);
  const __mmask16 keep = (__mmask16)((1u << valid) - 1);
  const __m512 bias = m.bias ? _mm512_maskz_loadu_ps(keep, m.bias + p * PANEL) : _mm512_setzero_ps();
  for (int r = 0; r < R; r++)
    _mm512_mask_storeu_ps(y + (r0 + r) * ld + m.out_offset + p * PANEL, keep,
                          _mm512_add_ps(acc[r], bias));
}

template <int64_t TYPE>
SG_AVX512 static void panel_avx512(const Matrix& m, int64_t p, const Act& a, int64_t r0, int64_t r1, float* y,
                                   int64_t ld) {
  int64_t r = r0;
  for (; r + ROWS <= r1; r += ROWS) panel512<TYPE, ROWS>(m, p, a, r, y, ld);
  // The rest in one pass: each pass unpacks the panel's codes again, so 5-7 rows as 4 + 1..3 cost
  // about what 8 rows do (a draft of 4-6 tokens paid for 8).
  switch (r1 - r) {
    case 7: panel512<TYPE, 7>(m, p, a, r, y, ld); break;
    case 6: panel512<TYPE, 6>(m, p, a, r, y, ld); break;
    case 5: panel512<TYPE, 5>(m, p, a, r, y, ld); break;
    case 4: panel512<TYPE, 4>(m, p, a, r, y, ld); break;
    case 3: panel512<TYPE, 3>(m, p, a, r, y, ld); break;
    case 2: panel512<TYPE, 2>(m, p, a, r, y, ld); break;
    case 1: panel512<TYPE, 1>(m, p, a, r, y, ld); break;
    default: break;
  }
}

// ---- AVX2 -----------------------------------------------------------------------------------------

// Half h (rows 8h .. 8h + 7) of the 8 code vectors of block j: 32 bytes each. Q8_0's stay unsigned.
template <int64_t TYPE>
SG_AVX2 static inline void codes256(const uint8_t* codes, const uint8_t* high, int h, __m256i* C) {
  constexpr Layout L = layout_of(TYPE);
  const uint8_t* q = codes + 32 * h;
  if constexpr (L.bits == 8) {
    for (int c = 0; c < 8; c++) C[c] = _mm256_loadu_si256((const __m256i*)(q + 64 * c));
    return;
  }
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int v = 0; v < 4; v++) {
    __m256i V = _mm256_loadu_si256((const __m256i*)(q + 64 * v));
    C[v] = _mm256_and_si256(V, nib);
    C[v + 4] = _mm256_and_si256(_mm256_srli_epi16(V, 4), nib);
  }
  const uint8_t* hp = high + 32 * h;
  if constexpr (L.bits == 5) {
    const __m256i m = _mm256_set1_epi8(0x10);
    __m256i H = _mm256_loadu_si256((const __m256i*)hp);
    C[0] = _mm256_or_si256(C[0], _mm256_and_si256(_mm256_slli_epi16(H, 4), m));
    C[1] = _mm256_or_si256(C[1], _mm256_and_si256(_mm256_slli_epi16(H, 3), m));
    C[2] = _mm256_or_si256(C[2], _mm256_and_si256(_mm256_slli_epi16(H, 2), m));
    C[3] = _mm256_or_si256(C[3], _mm256_and_si256(_mm256_slli_epi16(H, 1), m));
    C[4] = _mm256_or_si256(C[4], _mm256_and_si256(H, m));
    C[5] = _mm256_or_si256(C[5], _mm256_and_si256(_mm256_srli_epi16(H, 1), m));
    C[6] = _mm256_or_si256(C[6], _mm256_and_si256(_mm256_srli_epi16(H, 2), m));
    C[7] = _mm256_or_si256(C[7], _mm256_and_si256(_mm256_srli_epi16(H, 3), m));
  } else if constexpr (L.bits == 6) {
    const __m256i m = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; half++) {
      __m256i H = _mm256_loadu_si256((const __m256i*)(hp + 64 * half));
      __m256i* D = C + 4 * half;
      D[0] = _mm256_or_si256(D[0], _mm256_and_si256(_mm256_slli_epi16(H, 4), m));
      D[1] = _mm256_or_si256(D[1], _mm256_and_si256(_mm256_slli_epi16(H, 2), m));
      D[2] = _mm256_or_si256(D[2], _mm256_and_si256(H, m));
      D[3] = _mm256_or_si256(D[3], _mm256_and_si256(_mm256_srli_epi16(H, 2), m));
    }
  }
}

// Pairwise products of codes and 4 activation values broadcast, in int16 (u * x pairs).
SG_AVX2 static inline __m256i mul16(__m256i codes, const int8_t* x) {
  return _mm256_maddubs_epi16(codes, _mm256_set1_epi32(quad(x)));
}

SG_AVX2 static inline __m256i widen(__m256i v16) { return _mm256_madd_epi16(v16, _mm256_set1_epi16(1)); }

// sum(u * x) over quads [c0, c0 + n) in int32 lanes, int16 partial sums as long as they cannot
// overflow (|u * x| pairs: 4-bit 3810, 5-bit 7874, 6-bit 16002; Q8_0 by the sign trick, one at a time).
template <int BITS>
SG_AVX2 static inline __m256i dot256(const __m256i* C, const int8_t* x, int c0, int n) {
  if constexpr (BITS == 8) {
    __m256i acc = _mm256_setzero_si256();
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int c = c0; c < c0 + n; c++) {
      __m256i xv = _mm256_set1_epi32(quad(x + 4 * c));
      __m256i s = _mm256_xor_si256(C[c], flip);  // signed codes: u - 128
      acc = _mm256_add_epi32(acc, widen(_mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(s, xv))));
    }
    return acc;
  } else {
    constexpr int run = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;
    __m256i acc = _mm256_setzero_si256();
    for (int c = c0; c < c0 + n; c += run) {
      __m256i s = mul16(C[c], x + 4 * c);
      for (int i = 1; i < run && c + i < c0 + n; i++) s = _mm256_add_epi16(s, mul16(C[c + i], x + 4 * (c + i)));
      acc = _mm256_add_epi32(acc, widen(s));
    }
    return acc;
  }
}

// Half h of 16 sub-scales (one byte per row) as floats.
SG_AVX2 static inline __m256 sub_scales256(const uint8_t* at, int h, bool is_signed) {
  __m128i v = _mm_loadl_epi64((const __m128i*)(at + 8 * h));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

// Half h of a block's scales S and biases B (the types with one float step per block of 32): from
// the superblock's dv / mv and the sub-block bytes (Q4_K, Q5_K), or the block's own halves.
template <int64_t TYPE>
SG_AVX2 static inline void block_scales256(const uint8_t* sc, int j, int h, __m256 dv, __m256 mv, __m256& S,
                                           __m256& B) {
  constexpr Layout L = layout_of(TYPE);
  B = _mm256_setzero_ps();
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    S = _mm256_mul_ps(dv, sub_scales256(sc + 64 + 16 * j, h, false));
    B = _mm256_mul_ps(mv, sub_scales256(sc + 192 + 16 * j, h, false));
  } else {
    const uint8_t* block = sc + j * L.scale_bytes / 2;
    S = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block + 16 * h)));
    if constexpr (L.has_min) B = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(block + 32 + 16 * h)));
  }
}

// acc += one block's integer sum `dot` of a row (k: its block index in a.xs), scaled, with the
// type's offset or bias term (Q8_0's products are signed here, u - 128: no offset to take off).
template <int64_t TYPE>
SG_AVX2 static inline __m256 accumulate256(__m256 acc, __m256i dot, __m256 S, __m256 B, const Act& a, int64_t k) {
  constexpr Layout L = layout_of(TYPE);
  if constexpr (!L.has_min && L.bits != 8) dot = _mm256_add_epi32(_mm256_set1_epi32(-a.s32[k] * L.offset), dot);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(S, _mm256_set1_ps(a.xs[k])), acc);
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) return _mm256_fnmadd_ps(B, _mm256_set1_ps(a.gs[k]), acc);
  else if constexpr (L.has_min) return _mm256_fmadd_ps(B, _mm256_set1_ps(a.gs[k]), acc);
  return acc;
}

// Rows r0 .. r0 + R - 1 of half h of panel p into y, with the matrix's bias.
template <int R>
SG_AVX2 static inline void store_half256(const Matrix& m, int64_t p, int h, int64_t valid, const __m256* acc, int64_t r0,
                                         float* y, int64_t ld) {
  const int64_t lanes = std::min<int64_t>(8, valid - 8 * h);
  const int64_t first = p * PANEL + 8 * h;
  for (int r = 0; r < R; r++) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[r]);
    float* dst = y + (r0 + r) * ld + m.out_offset + first;
    for (int64_t i = 0; i < lanes; i++) dst[i] = out[i] + (m.bias ? m.bias[first + i] : 0.f);
  }
}

template <int64_t TYPE, int R>
SG_AVX2 static void panel256(const Matrix& m, int64_t p, const Act& a, int64_t r0, float* y, int64_t ld) {
  constexpr Layout L = layout_of(TYPE);
  constexpr int blocks = (int)(L.unit / 32);
  constexpr bool kmin = TYPE == Q4_K || TYPE == Q5_K;
  const uint8_t* panel = m.w + p * m.panel_bytes;
  const int64_t units = a.K / L.unit;
  const int64_t valid = std::min<int64_t>(PANEL, m.rows - p * PANEL);
  for (int h = 0; h < 2 && 8 * h < valid; h++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t n = 0; n < units; n++) {
      const uint8_t* un = panel + n * L.unit_bytes;
      const uint8_t* sc = un + scales_at(L);
      __m256 dv = _mm256_setzero_ps(), mv = _mm256_setzero_ps();
      if constexpr (kmin || TYPE == Q6_K) dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 16 * h)));
      if constexpr (kmin) mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32 + 16 * h)));
      for (int j = 0; j < blocks; j++) {
        if (h == 0) prefetch_ahead<TYPE>(un, j);  // the second half reads the panel from cache
        const int64_t b = n * blocks + j;
        __m256i C[8];
        codes256<TYPE>(un + codes_at(L, j), un + high_at(L, j), h, C);
        if constexpr (TYPE == Q6_K) {
          const __m256 Sa = _mm256_mul_ps(dv, sub_scales256(sc + 32 + 32 * j, h, true));
          const __m256 Sb = _mm256_mul_ps(dv, sub_scales256(sc + 48 + 32 * j, h, true));
          for (int r = 0; r < R; r++) {
            const int8_t* x = a.q + (r0 + r) * a.K + 32 * b;
            const int32_t* s = a.s16 + (r0 + r) * 2 * a.nb + 2 * b;
            __m256i ia = _mm256_add_epi32(_mm256_set1_epi32(-s[0] * L.offset), dot256<6>(C, x, 0, 4));
            __m256i ib = _mm256_add_epi32(_mm256_set1_epi32(-s[1] * L.offset), dot256<6>(C, x, 4, 4));
            const __m256 xs = _mm256_set1_ps(a.xs[(r0 + r) * a.nb + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(Sa, xs), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ib), _mm256_mul_ps(Sb, xs), acc[r]);
          }
        } else {
          __m256 S, B;
          block_scales256<TYPE>(sc, j, h, dv, mv, S, B);
          for (int r = 0; r < R; r++) {
            const __m256i dot = dot256<L.bits>(C, a.q + (r0 + r) * a.K + 32 * b, 0, 8);
            acc[r] = accumulate256<TYPE>(acc[r], dot, S, B, a, (r0 + r) * a.nb + b);
          }
        }
      }
    }
    store_half256<R>(m, p, h, valid, acc, r0, y, ld);
  }
}

// The 4-bit types with the rows inside: each code vector is unpacked once and multiplied with the R
// activation rows at once, a row's int16 partial sum (8 quads of 4-bit codes cannot overflow) held
// in a register, so 8 rows fit in AVX2's 16 registers where holding a block's 8 code vectors left
// room for 4 (the float accumulators, touched once per block, live in memory). The integer sums and
// the float steps are panel256's, in its order: the same results, bit for bit.
template <int64_t TYPE, int R>
SG_AVX2 static void panel256q4(const Matrix& m, int64_t p, const Act& a, int64_t r0, float* y, int64_t ld) {
  constexpr Layout L = layout_of(TYPE);
  static_assert(L.bits == 4, "4-bit codes only");
  constexpr int blocks = (int)(L.unit / 32);
  constexpr bool kmin = TYPE == Q4_K;
  const uint8_t* panel = m.w + p * m.panel_bytes;
  const int64_t units = a.K / L.unit;
  const int64_t valid = std::min<int64_t>(PANEL, m.rows - p * PANEL);
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2 && 8 * h < valid; h++) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t n = 0; n < units; n++) {
      const uint8_t* un = panel + n * L.unit_bytes;
      const uint8_t* sc = un + scales_at(L);
      __m256 dv = _mm256_setzero_ps(), mv = _mm256_setzero_ps();
      if constexpr (kmin) {
        dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 16 * h)));
        mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32 + 16 * h)));
      }
      for (int j = 0; j < blocks; j++) {
        if (h == 0) prefetch_ahead<TYPE>(un, j);  // the second half reads the panel from cache
        const int64_t b = n * blocks + j;
        const uint8_t* q = un + codes_at(L, j) + 32 * h;
        const int8_t* x = a.q + r0 * a.K + 32 * b;
        __m256i s[R];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {  // quads v and v + 4 share their bytes (low and high nibbles)
          const __m256i V = _mm256_loadu_si256((const __m256i*)(q + 64 * v));
          const __m256i lo = _mm256_and_si256(V, nib), hi = _mm256_and_si256(_mm256_srli_epi16(V, 4), nib);
#pragma GCC unroll 8
          for (int r = 0; r < R; r++) {
            const int8_t* xr = x + r * a.K;
            __m256i t = _mm256_add_epi16(mul16(lo, xr + 4 * v), mul16(hi, xr + 4 * (v + 4)));
            s[r] = v == 0 ? t : _mm256_add_epi16(s[r], t);
            // Left alone, GCC issues a block's 64 products first and spills them to the stack:
            // each row's sum is materialized in program order instead.
            __asm__("" : "+x"(s[r]));
          }
        }
        __m256 S, B;
        block_scales256<TYPE>(sc, j, h, dv, mv, S, B);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
          acc[r] = accumulate256<TYPE>(acc[r], _mm256_madd_epi16(s[r], ones), S, B, a, (r0 + r) * a.nb + b);
      }
    }
    store_half256<R>(m, p, h, valid, acc, r0, y, ld);
  }
}

template <int64_t TYPE>
SG_AVX2 static void panel_avx2(const Matrix& m, int64_t p, const Act& a, int64_t r0, int64_t r1, float* y,
                               int64_t ld) {
  int64_t r = r0;
  if constexpr (layout_of(TYPE).bits == 4) {
    for (; r + ROWS <= r1; r += ROWS) panel256q4<TYPE, ROWS>(m, p, a, r, y, ld);
    switch (r1 - r) {  // the rest in one pass, as panel_avx512 does
      case 7: panel256q4<TYPE, 7>(m, p, a, r, y, ld); break;
      case 6: panel256q4<TYPE, 6>(m, p, a, r, y, ld); break;
      case 5: panel256q4<TYPE, 5>(m, p, a, r, y, ld); break;
      case 4: panel256q4<TYPE, 4>(m, p, a, r, y, ld); break;
      case 3: panel256q4<TYPE, 3>(m, p, a, r, y, ld); break;
      case 2: panel256q4<TYPE, 2>(m, p, a, r, y, ld); break;
      case 1: panel256q4<TYPE, 1>(m, p, a, r, y, ld); break;
      default: break;
    }
    return;
  }
  for (; r + ROWS256 <= r1; r += ROWS256) panel256<TYPE, ROWS256>(m, p, a, r, y, ld);
  switch (r1 - r) {
    case 3: panel256<TYPE, 3>(m, p, a, r, y, ld); break;
    case 2: panel256<TYPE, 2>(m, p, a, r, y, ld); break;
    case 1: panel256<TYPE, 1>(m, p, a, r, y, ld); break;
    default: break;
  }
}

#endif  // SG_X86

// ---- dispatch ---------------------------------------------------------------------------------------

template <int64_t TYPE>
static PanelKernel kernel_of(int64_t level) {
#if SG_X86
  if (level >= 2) return panel_avx512<TYPE>;
  if (level >= 1) return panel_avx2<TYPE>;
#endif
  return panel_scalar;
}

static PanelKernel kernel_for(int64_t level, int64_t type) {
  switch (type) {
    case Q4_0: return kernel_of<Q4_0>(level);
    case Q4_1: return kernel_of<Q4_1>(level);
    case Q5_0: return kernel_of<Q5_0>(level);
    case Q5_1: return kernel_of<Q5_1>(level);
    case Q8_0: return kernel_of<Q8_0>(level);
    case Q4_K: return kernel_of<Q4_K>(level);
    case Q5_K: return kernel_of<Q5_K>(level);
    case Q6_K: return kernel_of<Q6_K>(level);
    default: TORCH_CHECK(false, "unsupported GGUF type ", type);
  }
}

// ---- a projection: matrices with one input, outputs side by side ---------------------------------

// The fused q/k/v or gate/up of a layer (whatever their types), or one matrix. `keep` holds the
// tensors the raw pointers point into.
struct Projection {
  std::vector<Matrix> mats;
  int64_t in_features = 0, total = 0;
  std::vector<at::Tensor> keep;
};

static Projection make_projection(at::TensorList weights, at::IntArrayRef types, at::IntArrayRef outs,
                                  int64_t in_features, at::TensorList biases) {
  TORCH_CHECK(weights.size() == types.size() && types.size() == outs.size() && biases.size() == outs.size(),
              "one type, output size and bias per matrix");
  TORCH_CHECK(!weights.empty() && weights.size() <= 8, "one to 8 matrices per projection");
  Projection p;
  p.in_features = in_features;
  for (size_t i = 0; i < weights.size(); i++) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == panels_of(outs[i]),
                "bad packed matrix ", i, ": uint8 [ceil(out / 16), panel bytes] expected");
    TORCH_CHECK(w.size(1) == panel_bytes(types[i], in_features), "packed panel bytes do not match ", i);
    const float* b = nullptr;
    if (biases[i].numel() > 0) {
      TORCH_CHECK(biases[i].dtype() == at::kFloat && biases[i].numel() == outs[i] && biases[i].is_contiguous(),
                  "bias ", i, " must be fp32 [out]");
      b = biases[i].data_ptr<float>();
      p.keep.push_back(biases[i]);
    }
    p.keep.push_back(w);
    p.mats.push_back({w.data_ptr<uint8_t>(), types[i], outs[i], w.size(1), p.total, b});
    p.total += outs[i];
  }
  return p;
}

// Activation buffers of one caller, reused from product to product.
struct Scratch {
  Activations act;
};

// y [rows, p.total] = x [rows, p.in_features] (float, prepared) times the projection's transpose.
static void project(const Projection& p, const float* x, int64_t rows, float* y, Scratch& scratch) {
  if (rows == 0 || p.total == 0) return;
  quantize_activations(x, rows, p.in_features, scratch.act);
  const Act a = view(scratch.act);
  int64_t n = (int64_t)p.mats.size();
  PanelKernel kernels[8];
  int64_t first[9];  // first panel of each matrix in the projection's panel order
  first[0] = 0;
  for (int64_t i = 0; i < n; i++) {
    kernels[i] = kernel_for(isa(), p.mats[i].type);
    first[i + 1] = first[i] + panels_of(p.mats[i].rows);
  }
  int64_t panels = first[n], total = p.total;
  int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, panels / (4 * at::get_num_threads() + 1)));
  for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK) {
    int64_t r1 = std::min(rows, r0 + ROW_BLOCK);
    at::parallel_for(0, panels, grain, [&](int64_t q0, int64_t q1) {
      int64_t i = 0;
      for (int64_t q = q0; q < q1; q++) {
        while (q >= first[i + 1]) i++;
        kernels[i](p.mats[i], q - first[i], a, r0, r1, y, total);
      }
    });
  }
}

}  // namespace sg
