// Matrix products with GGUF-quantized weights on the CPU, at the weights' own bytes.
//
// Decoding reads every weight once per step, so a step costs (weight bytes) / (memory bandwidth).
// These kernels read the GGUF file's blocks (repacked once at load, same bytes up to 3%) and never
// widen them in memory: each superblock of 256 weights is unpacked into unsigned 8-bit codes in
// registers and multiplied with the activations, quantized to signed 8 bits with a scale per 32
// values, with integer dot products (AVX-512 VNNI vpdpbusd, or AVX2 vpmaddubsw) and one vector
// float multiply-add per superblock and row.
//
// Every weight is w = scale[g] * u + bias[g] for its group g (32 weights, or 16 for Q6_K) and its
// code u, so y = sum_g scale[g] * (sum_i u_i x_i) + bias[g] * (sum_i x_i). The packed layout puts
// the codes of group g in fixed dot-product lanes (lanes g and g + 8 for groups of 32, lane g for
// groups of 16) across the superblock's four 64-byte chunks, so the integer sums of a whole
// superblock accumulate in one register with no per-group work. Activations are laid out the same
// way when they are quantized.
//
// Results for a given (activation row, output) pair do not depend on how many rows are computed at
// once or how the output rows are split between threads: a step's batch never changes a token.
//
// Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (superblocks of 256). The
// Python side turns other types (Q2_K, Q3_K, ...) into Q8_0 first.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SG_X86 1
#define SG_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))
#define SG_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define SG_X86 0
#endif

namespace sg {

// ggml's type ids.
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Layout {
  int64_t sb_bytes;     // bytes of one packed superblock (256 weights)
  int64_t tail_bytes;   // bytes of one packed tail chunk (64 weights; blocks-of-32 types only)
  int64_t src_block;    // weights per source block
  int64_t src_bytes;    // bytes per source block
  int group;            // weights per scale: 32, or 16 (Q6_K)
  int bits;             // code width: 4, 5, 6 or 8
  bool has_min;         // w = d * u + m (Q4_1, Q5_1, K4, K5), else w = d * (u - offset)
};

static Layout layout_of(int64_t type) {
  switch (type) {
    case Q4_0: return {144, 36, 32, 18, 32, 4, false};
    case Q4_1: return {160, 40, 32, 20, 32, 4, true};
    case Q5_0: return {176, 44, 32, 22, 32, 5, false};
    case Q5_1: return {192, 48, 32, 24, 32, 5, true};
    case Q8_0: return {272, 68, 32, 34, 32, 8, false};
    case Q4_K: return {148, 0, 256, 144, 32, 4, true};
    case Q5_K: return {180, 0, 256, 176, 32, 5, true};
    case Q6_K: return {210, 0, 256, 210, 16, 6, false};
    default: TORCH_CHECK(false, "unsupported GGUF type ", type);
  }
}

static inline bool k_type(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

struct RowShape {
  int64_t n_sb;    // superblocks per row
  int64_t n_tail;  // tail chunks (64 weights) per row
  int64_t bytes;   // packed bytes per row
};

static RowShape row_shape(int64_t type, int64_t in_features) {
  Layout L = layout_of(type);
  TORCH_CHECK(in_features % L.src_block == 0, "in_features ", in_features, " is not a multiple of ",
              L.src_block);
  int64_t n_sb = in_features / 256;
  int64_t rest = in_features - 256 * n_sb;
  TORCH_CHECK(!k_type(type) || rest == 0, "a K-quant row must be a multiple of 256 weights");
  int64_t n_tail = (rest + 63) / 64;
  return {n_sb, n_tail, n_sb * L.sb_bytes + n_tail * L.tail_bytes};
}

// ---- fp16 ---------------------------------------------------------------------------------------

static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        e++;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t rd16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline void wr16(uint8_t* p, uint16_t v) {
  p[0] = (uint8_t)(v & 0xFF);
  p[1] = (uint8_t)(v >> 8);
}

// ---- source blocks -> codes, scales and biases (scalar; load time and the reference path) ------

// One source block's codes (unsigned) and the scale and bias of each of its groups.
struct Decoded {
  uint8_t u[256];
  float scale[16];  // per group (of 32 or 16 weights)
  float bias[16];
  int16_t scale_q[16];  // K-quants: integer sub-scales (6 bits; Q6_K: signed 8 bits), for repacking
  int16_t min_q[16];
  uint16_t d, dmin;  // K-quants: the superblock's fp16 factors
};

static inline void k4_scale_min(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

static void decode_source(int64_t type, const uint8_t* b, Decoded& o) {
  switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      bool mn = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
      float d = half_to_float(rd16(b));
      float m = mn ? half_to_float(rd16(b + 2)) : 0.f;
      const uint8_t* p = b + (mn ? 4 : 2);
      uint32_t qh = 0;
      if (five) {
        std::memcpy(&qh, p, 4);
        p += 4;
      }
      for (int j = 0; j < 16; j++) {
        int lo = p[j] & 0xF, hi = p[j] >> 4;
        if (five) {
          lo |= ((qh >> j) & 1) << 4;
          hi |= ((qh >> (j + 16)) & 1) << 4;
        }
        o.u[j] = (uint8_t)lo;
        o.u[j + 16] = (uint8_t)hi;
      }
      o.scale[0] = d;
      o.bias[0] = mn ? m : -(five ? 16.f : 8.f) * d;
      return;
    }
    case Q8_0: {
      float d = half_to_float(rd16(b));
      for (int j = 0; j < 32; j++) o.u[j] = (uint8_t)((int8_t)b[2 + j] + 128);
      o.scale[0] = d;
      o.bias[0] = -128.f * d;
      return;
    }
    case Q4_K:
    case Q5_K: {
      o.d = rd16(b);
      o.dmin = rd16(b + 2);
      float d = half_to_float(o.d), dmin = half_to_float(o.dmin);
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* ql = type == Q5_K ? b + 48 : b + 16;
      for (int j = 0; j < 4; j++) {
        int s1, m1, s2, m2;
        k4_scale_min(2 * j, sc, s1, m1);
        k4_scale_min(2 * j + 1, sc, s2, m2);
        o.scale_q[2 * j] = (int16_t)s1;
        o.min_q[2 * j] = (int16_t)m1;
        o.scale_q[2 * j + 1] = (int16_t)s2;
        o.min_q[2 * j + 1] = (int16_t)m2;
        o.scale[2 * j] = d * s1;
        o.bias[2 * j] = -dmin * m1;
        o.scale[2 * j + 1] = d * s2;
        o.bias[2 * j + 1] = -dmin * m2;
        for (int l = 0; l < 32; l++) {
          int lo = ql[32 * j + l] & 0xF, hi = ql[32 * j + l] >> 4;
          if (type == Q5_K) {
            lo |= ((qh[l] >> (2 * j)) & 1) << 4;
            hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          o.u[64 * j + l] = (uint8_t)lo;
          o.u[64 * j + 32 + l] = (uint8_t)hi;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      o.d = rd16(b + 208);
      float d = half_to_float(o.d);
      for (int n = 0; n < 2; n++) {
        const uint8_t* l8 = ql + 64 * n;
        const uint8_t* h8 = qh + 32 * n;
        for (int l = 0; l < 32; l++) {
          o.u[128 * n + l] = (uint8_t)((l8[l] & 0xF) | (((h8[l] >> 0) & 3) << 4));
          o.u[128 * n + l + 32] = (uint8_t)((l8[l + 32] & 0xF) | (((h8[l] >> 2) & 3) << 4));
          o.u[128 * n + l + 64] = (uint8_t)((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4));
          o.u[128 * n + l + 96] = (uint8_t)((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4));
        }
      }
      for (int g = 0; g < 16; g++) {
        o.scale_q[g] = sc[g];
        o.scale[g] = d * sc[g];
        o.bias[g] = -32.f * d * sc[g];
      }
      return;
    }
    default:
      TORCH_CHECK(false, "unsupported GGUF type ", type);
  }
}

// The weight of superblock position (chunk c, lane l, byte b) for groups of `group` weights: for
// groups of 32, lane l holds group l % 8 (so the two halves of a chunk hold the same groups, and
// their sums add lane by lane); for groups of 16, lane l holds group l.
static inline int sb_position(int group, int c, int l, int b) {
  return group == 32 ? 32 * (l & 7) + (((l >> 3) + 2 * c) << 2) + b : 16 * l + (c << 2) + b;
}

// ---- repacking: source rows -> packed rows ------------------------------------------------------

// Writes one superblock's codes u[256] (natural order) into the packed code area.
static void pack_codes(int bits, int group, const uint8_t* u, uint8_t* q, uint8_t* h) {
  uint8_t perm[4][64];
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 16; l++)
      for (int b = 0; b < 4; b++) perm[c][4 * l + b] = u[sb_position(group, c, l, b)];
  if (bits == 8) {
    for (int c = 0; c < 4; c++)
      for (int j = 0; j < 64; j++) q[64 * c + j] = (uint8_t)(perm[c][j] - 128);  // stored signed
    return;
  }
  for (int j = 0; j < 64; j++) {
    q[j] = (uint8_t)((perm[0][j] & 0xF) | ((perm[1][j] & 0xF) << 4));
    q[64 + j] = (uint8_t)((perm[2][j] & 0xF) | ((perm[3][j] & 0xF) << 4));
  }
  if (bits == 5) {
    std::memset(h, 0, 32);
    for (int c = 0; c < 4; c++)
      for (int j = 0; j < 64; j++)
        if (perm[c][j] & 0x10) h[(64 * c + j) >> 3] |= (uint8_t)(1 << ((64 * c + j) & 7));
  } else if (bits == 6) {
    for (int j = 0; j < 64; j++)
      h[j] = (uint8_t)(((perm[0][j] >> 4) & 3) | (((perm[1][j] >> 4) & 3) << 2) |
                       (((perm[2][j] >> 4) & 3) << 4) | (((perm[3][j] >> 4) & 3) << 6));
  }
}

static void repack_row(int64_t type, const uint8_t* src, int64_t in_features, uint8_t* dst) {
  Layout L = layout_of(type);
  RowShape rs = row_shape(type, in_features);
  Decoded dec;
  if (k_type(type)) {
    for (int64_t s = 0; s < rs.n_sb; s++) {
      decode_source(type, src + s * L.src_bytes, dec);
      uint8_t* o = dst + s * L.sb_bytes;
      if (type == Q6_K) {
        wr16(o, dec.d);
        for (int g = 0; g < 16; g++) o[2 + g] = (uint8_t)(int8_t)dec.scale_q[g];
        pack_codes(6, 16, dec.u, o + 18, o + 146);
      } else {
        wr16(o, dec.d);
        wr16(o + 2, dec.dmin);
        for (int g = 0; g < 8; g++) {
          o[4 + g] = (uint8_t)dec.scale_q[g];
          o[12 + g] = (uint8_t)dec.min_q[g];
        }
        pack_codes(L.bits, 32, dec.u, o + 20, o + 148);
      }
    }
    return;
  }
  // Blocks of 32: groups of eight blocks as superblocks, then pairs of blocks as tail chunks.
  int64_t n_blocks = in_features / 32;
  bool mn = L.has_min;
  for (int64_t s = 0; s < rs.n_sb; s++) {
    uint8_t u[256];
    uint8_t* o = dst + s * L.sb_bytes;
    for (int k = 0; k < 8; k++) {
      const uint8_t* b = src + (s * 8 + k) * L.src_bytes;
      decode_source(type, b, dec);
      std::memcpy(u + 32 * k, dec.u, 32);
      std::memcpy(o + 2 * k, b, 2);  // d, as in the source
      if (mn) std::memcpy(o + 16 + 2 * k, b + 2, 2);  // m
    }
    int64_t head = mn ? 32 : 16;
    pack_codes(L.bits, 32, u, o + head, o + head + (L.bits == 8 ? 256 : 128));
  }
  for (int64_t t = 0; t < rs.n_tail; t++) {
    uint8_t* o = dst + rs.n_sb * L.sb_bytes + t * L.tail_bytes;
    std::memset(o, 0, L.tail_bytes);
    uint8_t u[64] = {0};
    for (int k = 0; k < 2; k++) {
      int64_t blk = rs.n_sb * 8 + 2 * t + k;
      if (blk >= n_blocks) break;  // an odd last block: its pair is all zeros
      const uint8_t* b = src + blk * L.src_bytes;
      decode_source(type, b, dec);
      std::memcpy(u + 32 * k, dec.u, 32);
      std::memcpy(o + 2 * k, b, 2);
      if (mn) std::memcpy(o + 4 + 2 * k, b + 2, 2);
    }
    uint8_t* q = o + (mn ? 8 : 4);
    if (L.bits == 8) {
      for (int j = 0; j < 64; j++) q[j] = (uint8_t)(u[j] - 128);
    } else {
      for (int j = 0; j < 32; j++) q[j] = (uint8_t)((u[j] & 0xF) | ((u[j + 32] & 0xF) << 4));
      if (L.bits == 5) {
        uint8_t* h = q + 32;
        std::memset(h, 0, 8);
        for (int j = 0; j < 64; j++)
          if (u[j] & 0x10) h[j >> 3] |= (uint8_t)(1 << (j & 7));
      }
    }
  }
}

// ---- packed rows -> codes, scales and biases (scalar) -------------------------------------------

// Superblock s of a packed row: codes (unsigned) in natural order and per-group scales and biases.
static void unpack_sb(int64_t type, const uint8_t* o, uint8_t* u, float* scale, float* bias) {
  Layout L = layout_of(type);
  uint8_t perm[4][64];
  const uint8_t *q, *h = nullptr;
  float d[8], m[8];
  if (type == Q6_K) {
    float dd = half_to_float(rd16(o));
    for (int g = 0; g < 16; g++) {
      scale[g] = dd * (int8_t)o[2 + g];
      bias[g] = -32.f * scale[g];
    }
    q = o + 18;
    h = o + 146;
  } else if (k_type(type)) {
    float dd = half_to_float(rd16(o)), dmin = half_to_float(rd16(o + 2));
    for (int g = 0; g < 8; g++) {
      scale[g] = dd * o[4 + g];
      bias[g] = -dmin * o[12 + g];
    }
    q = o + 20;
    h = o + 148;
  } else {
    bool mn = L.has_min;
    for (int g = 0; g < 8; g++) {
      d[g] = half_to_float(rd16(o + 2 * g));
      m[g] = mn ? half_to_float(rd16(o + 16 + 2 * g)) : 0.f;
    }
    q = o + (mn ? 32 : 16);
    h = q + (L.bits == 8 ? 256 : 128);
    float off = L.bits == 8 ? 128.f : (L.bits == 5 ? 16.f : 8.f);
    for (int g = 0; g < 8; g++) {
      scale[g] = d[g];
      bias[g] = mn ? m[g] : -off * d[g];
    }
  }
  if (L.bits == 8) {
    for (int c = 0; c < 4; c++)
      for (int j = 0; j < 64; j++) perm[c][j] = (uint8_t)((int8_t)q[64 * c + j] + 128);
  } else {
    for (int j = 0; j < 64; j++) {
      perm[0][j] = q[j] & 0xF;
      perm[1][j] = q[j] >> 4;
      perm[2][j] = q[64 + j] & 0xF;
      perm[3][j] = q[64 + j] >> 4;
    }
    if (L.bits == 5)
      for (int c = 0; c < 4; c++)
        for (int j = 0; j < 64; j++) perm[c][j] |= (uint8_t)(((h[(64 * c + j) >> 3] >> ((64 * c + j) & 7)) & 1) << 4);
    if (L.bits == 6)
      for (int c = 0; c < 4; c++)
        for (int j = 0; j < 64; j++) perm[c][j] |= (uint8_t)(((h[j] >> (2 * c)) & 3) << 4);
  }
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 16; l++)
      for (int b = 0; b < 4; b++) u[sb_position(L.group, c, l, b)] = perm[c][4 * l + b];
}

// Tail chunk t: 64 codes in natural order, two groups of 32.
static void unpack_tail(int64_t type, const uint8_t* o, uint8_t* u, float* scale, float* bias) {
  Layout L = layout_of(type);
  bool mn = L.has_min;
  const uint8_t* q = o + (mn ? 8 : 4);
  float off = L.bits == 8 ? 128.f : (L.bits == 5 ? 16.f : 8.f);
  for (int k = 0; k < 2; k++) {
    scale[k] = half_to_float(rd16(o + 2 * k));
    bias[k] = mn ? half_to_float(rd16(o + 4 + 2 * k)) : -off * scale[k];
  }
  if (L.bits == 8) {
    for (int j = 0; j < 64; j++) u[j] = (uint8_t)((int8_t)q[j] + 128);
    return;
  }
  for (int j = 0; j < 32; j++) {
    u[j] = q[j] & 0xF;
    u[j + 32] = q[j] >> 4;
  }
  if (L.bits == 5)
    for (int j = 0; j < 64; j++) u[j] |= (uint8_t)(((q[32 + (j >> 3)] >> (j & 7)) & 1) << 4);
}

// ---- activations ----------------------------------------------------------------------------------

// One activation row quantized for a weight type, one int8 scale per 32 values, for every weight
// type (llama.cpp does so for its 32-blocks and keeps one per 256 for K-quants; one per 256 here
// lost about half the greedy agreement with the fp32 reference on the default model).
// Per superblock: 256 int8 values in the packed lane order, then 16 scales and 16 sums indexed by
// the weight's group (groups of 32: the first 8, the rest zero; Q6_K's groups of 16: group g has
// the scale of values 32 (g / 2)..); a sum is the group's scale times the sum of its values. Then
// the tail chunks in natural order, each with two scales and two sums.
// Buffers are reused from call to call (a decoder stack quantizes hundreds of inputs a step).
struct Activations {
  int64_t n_sb = 0, n_tail = 0, width = 0, nsums = 0;
  std::vector<int8_t> q;     // [rows, width = (n_sb * 4 + n_tail) * 64]
  std::vector<float> scale;  // [rows, nsums = n_sb * 16 + n_tail * 2]
  std::vector<float> sums;   // [rows, nsums]
};

// Raw views of an activation batch (no tensor calls in the inner loops).
struct Act {
  const int8_t* q;
  const float* scale;
  const float* sums;
  int64_t width, nscale, nsums, n_sb, n_tail;
};

static Act view(const Activations& a) {
  return {a.q.data(), a.scale.data(), a.sums.data(), a.width, a.nsums, a.nsums, a.n_sb, a.n_tail};
}

// For each superblock position k (chunk c = k / 64, lane and byte), the natural position it holds.
struct Permutation {
  uint8_t of[2][256];  // [0]: groups of 32, [1]: groups of 16
  Permutation() {
    for (int g = 0; g < 2; g++)
      for (int c = 0; c < 4; c++)
        for (int l = 0; l < 16; l++)
          for (int b = 0; b < 4; b++) of[g][64 * c + 4 * l + b] = (uint8_t)sb_position(g ? 16 : 32, c, l, b);
  }
};
static const Permutation kPermutation;

// Rows of float activations [rows, in_features] (contiguous), quantized for a weight type.
static void quantize_activations(const float* xp, int64_t rows, int64_t type, int64_t in_features, Activations& a) {
  RowShape rs = row_shape(type, in_features);
  int group = layout_of(type).group;
  int groups = group == 16 ? 16 : 8;
  const uint8_t* perm = kPermutation.of[group == 16 ? 1 : 0];
  int64_t width = (rs.n_sb * 4 + rs.n_tail) * 64;
  int64_t nsums = rs.n_sb * 16 + rs.n_tail * 2;
  a.n_sb = rs.n_sb;
  a.n_tail = rs.n_tail;
  a.width = width;
  a.nsums = nsums;
  a.q.resize(rows * width);
  a.scale.assign(rows * nsums, 0.f);
  a.sums.assign(rows * nsums, 0.f);
  int8_t* qp = a.q.data();
  float* sp = a.scale.data();
  float* sump = a.sums.data();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* xr = xp + r * in_features;
      int8_t* qr = qp + r * width;
      float* sr = sp + r * nsums;
      float* gr = sump + r * nsums;
      // n values from v quantized with one scale; returns it.
      auto quantize32 = [](const float* v, int n, int8_t* out) {
        float amax = 0.f;
        for (int i = 0; i < n; i++) amax = std::max(amax, std::fabs(v[i]));
        float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int i = 0; i < 32; i++) out[i] = i < n ? (int8_t)std::lrint(v[i] * inv) : (int8_t)0;
        return amax / 127.f;
      };
      for (int64_t s = 0; s < rs.n_sb; s++) {
        int8_t natural[256];
        float scale32[8];
        for (int k = 0; k < 8; k++) scale32[k] = quantize32(xr + 256 * s + 32 * k, 32, natural + 32 * k);
        int8_t* out = qr + 256 * s;
        for (int k = 0; k < 256; k++) out[k] = natural[perm[k]];
        const int per = 256 / groups;
        for (int g = 0; g < groups; g++) {
          int sum = 0;
          for (int i = 0; i < per; i++) sum += natural[g * per + i];
          float scale = scale32[g * per / 32];
          sr[s * 16 + g] = scale;
          gr[s * 16 + g] = scale * (float)sum;
        }
      }
      for (int64_t t = 0; t < rs.n_tail; t++) {
        int64_t start = 256 * rs.n_sb + 64 * t;
        int8_t* out = qr + 256 * rs.n_sb + 64 * t;
        for (int k = 0; k < 2; k++) {
          int n = (int)std::max<int64_t>(0, std::min<int64_t>(32, in_features - start - 32 * k));
          float scale = quantize32(xr + start + 32 * k, n, out + 32 * k);
          int sum = 0;
          for (int i = 0; i < 32; i++) sum += out[32 * k + i];
          sr[rs.n_sb * 16 + 2 * t + k] = scale;
          gr[rs.n_sb * 16 + 2 * t + k] = scale * (float)sum;
        }
      }
    }
  });
}

// ---- what the layers do to an input before its product: RMSNorm, SwiGLU -----------------------

static int64_t isa_level_for_activations();

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

#if SG_X86
// exp(x) for the SwiGLU gate: 2^(x log2 e) as 2^n times a degree-6 polynomial of the remainder
// (relative error below 2e-7 where the gate's values lie; inputs are clamped to +-87).
SG_AVX512 static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(87.f)), _mm512_set1_ps(-87.f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));  // in [-ln2/2, ln2/2]
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

SG_AVX512 static void swiglu_avx512(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 g = _mm512_loadu_ps(gate + i);
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(sg, _mm512_loadu_ps(up + i)));
  }
  for (; i < n; i++) out[i] = silu(gate[i]) * up[i];
}
#endif

// silu(gate) * up of each row of x [rows, 2 * in] into out [rows, in].
static void swiglu_rows(const float* x, int64_t rows, int64_t in, float* out) {
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* g = x + r * 2 * in;
#if SG_X86
      if (isa_level_for_activations() >= 2) {
        swiglu_avx512(g, g + in, out + r * in, in);
        continue;
      }
#endif
      for (int64_t i = 0; i < in; i++) out[r * in + i] = silu(g[i]) * g[in + i];
    }
  });
}

// RMSNorm(x) * w of each row of x [rows, in] into out (which may be x).
static void rms_norm_rows(const float* x, int64_t rows, int64_t in, const float* w, double eps, float* out) {
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* v = x + r * in;
      double ss = 0.0;
      for (int64_t i = 0; i < in; i++) ss += (double)v[i] * v[i];
      float inv = (float)(1.0 / std::sqrt(ss / (double)in + eps));
      for (int64_t i = 0; i < in; i++) out[r * in + i] = v[i] * inv * w[i];
    }
  });
}

// The input rows as the layer feeds them to its product, in float: `x` itself, RMSNorm(x) * w, or
// (gated) silu(gate) * up of a [rows, 2 * in] input.
static at::Tensor prepared_input(const at::Tensor& x, int64_t in_features, const c10::optional<at::Tensor>& norm,
                                 double eps, bool gated) {
  at::Tensor xf = x.to(at::kFloat).contiguous();
  int64_t rows = x.size(0);
  if (gated) {
    TORCH_CHECK(x.size(1) == 2 * in_features, "a gated input must be [rows, 2 * in_features]");
    at::Tensor out = at::empty({rows, in_features}, at::kFloat);
    swiglu_rows(xf.data_ptr<float>(), rows, in_features, out.data_ptr<float>());
    xf = out;
  } else {
    TORCH_CHECK(x.size(1) == in_features, "x must be [rows, in_features]");
  }
  if (norm.has_value() && norm->defined()) {
    at::Tensor w = norm->to(at::kFloat).contiguous();
    TORCH_CHECK(w.numel() == in_features, "the norm weight must have in_features elements");
    at::Tensor out = at::empty({rows, in_features}, at::kFloat);
    rms_norm_rows(xf.data_ptr<float>(), rows, in_features, w.data_ptr<float>(), eps, out.data_ptr<float>());
    xf = out;
  }
  return xf;
}

// ---- the products -----------------------------------------------------------------------------------

struct Matrix {
  const uint8_t* w;  // packed rows
  int64_t type, rows, row_bytes, out_offset;
  const float* bias;  // per output row, or null
};

// One output row o of `m` for activation rows [r0, r1): y[r * ld + out_offset + o].
using RowKernel = void (*)(const Matrix& m, int64_t o, const Act& a, int64_t r0, int64_t r1, float* y,
                           int64_t ld);

static void row_scalar(const Matrix& m, int64_t o, const Act& a, int64_t r0, int64_t r1, float* y, int64_t ld) {
  Layout L = layout_of(m.type);
  const uint8_t* row = m.w + o * m.row_bytes;
  uint8_t u[256];
  float scale[16], bias[16];
  int gsize = L.group, groups = gsize == 16 ? 16 : 8;
  for (int64_t r = r0; r < r1; r++) {
    double total = 0.0;
    for (int64_t s = 0; s < a.n_sb; s++) {
      unpack_sb(m.type, row + s * L.sb_bytes, u, scale, bias);
      const int8_t* x = a.q + r * a.width + 256 * s;
      int32_t dot[16] = {0};
      for (int c = 0; c < 4; c++)
        for (int l = 0; l < 16; l++)
          for (int b = 0; b < 4; b++) {
            int pos = sb_position(gsize, c, l, b);
            dot[pos / gsize] += (int32_t)u[pos] * x[64 * c + 4 * l + b];
          }
      float acc = 0.f;
      for (int g = 0; g < groups; g++)
        acc += scale[g] * (float)dot[g] * a.scale[r * a.nscale + s * 16 + g] + bias[g] * a.sums[r * a.nsums + s * 16 + g];
      total += acc;
    }
    for (int64_t t = 0; t < a.n_tail; t++) {
      unpack_tail(m.type, row + a.n_sb * L.sb_bytes + t * L.tail_bytes, u, scale, bias);
      const int8_t* x = a.q + r * a.width + 256 * a.n_sb + 64 * t;
      float acc = 0.f;
      for (int k = 0; k < 2; k++) {
        int32_t dot = 0;
        for (int i = 0; i < 32; i++) dot += (int32_t)u[32 * k + i] * x[32 * k + i];
        acc += scale[k] * (float)dot * a.scale[r * a.nscale + a.n_sb * 16 + 2 * t + k] +
               bias[k] * a.sums[r * a.nsums + a.n_sb * 16 + 2 * t + k];
      }
      total += acc;
    }
    y[r * ld + m.out_offset + o] = (float)total + (m.bias ? m.bias[o] : 0.f);
  }
}

#if SG_X86

// ---- AVX-512 VNNI ---------------------------------------------------------------------------------

constexpr int64_t PREFETCH = 2048;  // bytes of weights fetched ahead of the superblock being read

// The four 64-byte code chunks of a packed superblock, unsigned.
SG_AVX512 static inline void codes512(int bits, const uint8_t* q, const uint8_t* h, __m512i* U) {
  if (bits == 8) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int c = 0; c < 4; c++) U[c] = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * c), flip);
    return;
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i a = _mm512_loadu_si512(q), b = _mm512_loadu_si512(q + 64);
  U[0] = _mm512_and_si512(a, nib);
  U[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), nib);
  U[2] = _mm512_and_si512(b, nib);
  U[3] = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
  if (bits == 5) {
    const __m512i bit = _mm512_set1_epi8(0x10);
    for (int c = 0; c < 4; c++) {
      uint64_t mask;
      std::memcpy(&mask, h + 8 * c, 8);
      U[c] = _mm512_or_si512(U[c], _mm512_maskz_mov_epi8((__mmask64)mask, bit));
    }
  } else if (bits == 6) {
    const __m512i two = _mm512_set1_epi8(0x30);
    __m512i hh = _mm512_loadu_si512(h);
    U[0] = _mm512_or_si512(U[0], _mm512_and_si512(_mm512_slli_epi16(hh, 4), two));
    U[1] = _mm512_or_si512(U[1], _mm512_and_si512(_mm512_slli_epi16(hh, 2), two));
    U[2] = _mm512_or_si512(U[2], _mm512_and_si512(hh, two));
    U[3] = _mm512_or_si512(U[3], _mm512_and_si512(_mm512_srli_epi16(hh, 2), two));
  }
}

// A superblock's code chunks and scales: for groups of 32, the 8 group scales and biases (ymm; lane g
// of both halves of a chunk holds group g); for Q6_K's 16 groups, 16 (zmm).
template <int64_t TYPE>
SG_AVX512 static inline void superblock512(const uint8_t* o8, __m512& S, __m512& B, __m256& S8, __m256& B8,
                                           __m512i* U) {
  constexpr int bits = TYPE == Q8_0 ? 8 : (TYPE == Q5_0 || TYPE == Q5_1 || TYPE == Q5_K) ? 5 : TYPE == Q6_K ? 6 : 4;
  const uint8_t *q, *h;
  if constexpr (TYPE == Q6_K) {
    __m512 d = _mm512_set1_ps(_cvtsh_ss(rd16(o8)));
    S = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(o8 + 2)))));
    B = _mm512_mul_ps(_mm512_set1_ps(-32.f), S);
    q = o8 + 18;
    h = o8 + 146;
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    // d and dmin, then the 8 sub-scales and 8 mins side by side: one conversion, one multiply.
    __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t*)o8));  // d, dmin
    __m512 f = _mm512_insertf32x8(_mm512_broadcastss_ps(dd), _mm256_broadcastss_ps(_mm_sub_ps(_mm_setzero_ps(), _mm_movehdup_ps(dd))), 1);
    __m512 sm = _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(o8 + 4)))));
    S8 = _mm512_castps512_ps256(sm);
    B8 = _mm512_extractf32x8_ps(sm, 1);
    q = o8 + 20;
    h = o8 + 148;
  } else {
    constexpr bool mn = TYPE == Q4_1 || TYPE == Q5_1;
    constexpr float off = bits == 8 ? -128.f : bits == 5 ? -16.f : -8.f;
    S8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o8));
    if constexpr (mn) {
      B8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o8 + 16)));
      q = o8 + 32;
    } else {
      B8 = _mm256_mul_ps(_mm256_set1_ps(off), S8);
      q = o8 + 16;
    }
    h = q + (bits == 8 ? 256 : 128);
  }
  codes512(bits, q, h, U);
}

// The superblock's integer dot products with one activation row: 16 int32 lanes.
SG_AVX512 static inline __m512i dot512(const __m512i* U, const int8_t* x) {
  __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), U[0], _mm512_loadu_si512(x));
  p = _mm512_dpbusd_epi32(p, U[1], _mm512_loadu_si512(x + 64));
  p = _mm512_dpbusd_epi32(p, U[2], _mm512_loadu_si512(x + 128));
  return _mm512_dpbusd_epi32(p, U[3], _mm512_loadu_si512(x + 192));
}

// Output row o for activation rows [r0, r0 + RT): the superblocks, then the tail chunks.
template <int64_t TYPE, int RT>
SG_AVX512 static void rows512(const Matrix& m, int64_t o, const Act& a, int64_t r0, float* y, int64_t ld) {
  constexpr int64_t sb_bytes = TYPE == Q4_0 ? 144 : TYPE == Q4_1 ? 160 : TYPE == Q5_0 ? 176 : TYPE == Q5_1 ? 192
                             : TYPE == Q8_0 ? 272 : TYPE == Q4_K ? 148 : TYPE == Q5_K ? 180 : 210;
  constexpr int bits = TYPE == Q8_0 ? 8 : (TYPE == Q5_0 || TYPE == Q5_1 || TYPE == Q5_K) ? 5 : TYPE == Q6_K ? 6 : 4;
  constexpr bool mn = TYPE == Q4_1 || TYPE == Q5_1;
  constexpr bool g16 = TYPE == Q6_K;
  const uint8_t* row = m.w + o * m.row_bytes;
  const int8_t* qp = a.q + r0 * a.width;
  const float* sp = a.scale + r0 * a.nscale;
  const float* gp = a.sums + r0 * a.nsums;
  __m512 acc[RT];    // Q6_K: 16 groups
  __m256 acc8[RT];   // groups of 32: 8 groups
  for (int r = 0; r < RT; r++) {
    acc[r] = _mm512_setzero_ps();
    acc8[r] = _mm256_setzero_ps();
  }
  for (int64_t s = 0; s < a.n_sb; s++) {
    __m512 S, B;
    __m256 S8, B8;
    __m512i U[4];
    // Rows of a thread's range lie one after another: fetch ahead across row ends too, so that
    // memory keeps streaming while the dot products of batched rows compute.
    _mm_prefetch((const char*)(row + s * sb_bytes + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char*)(row + s * sb_bytes + PREFETCH + 96), _MM_HINT_T0);
    if constexpr (sb_bytes > 192) _mm_prefetch((const char*)(row + s * sb_bytes + PREFETCH + 192), _MM_HINT_T0);
    superblock512<TYPE>(row + s * sb_bytes, S, B, S8, B8, U);
    for (int r = 0; r < RT; r++) {
      __m512i p = dot512(U, qp + r * a.width + 256 * s);
      const float* xs = sp + r * a.nscale + 16 * s;
      const float* g = gp + r * a.nsums + 16 * s;
      if constexpr (g16) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(S, _mm512_loadu_ps(xs)), acc[r]);
        acc[r] = _mm512_fmadd_ps(B, _mm512_loadu_ps(g), acc[r]);
      } else {
        // Lanes g and g + 8 hold group g: add the halves, then one 8-wide multiply-add.
        __m256i p8 = _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
        acc8[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p8), _mm256_mul_ps(S8, _mm256_loadu_ps(xs)), acc8[r]);
        acc8[r] = _mm256_fmadd_ps(B8, _mm256_loadu_ps(g), acc8[r]);
      }
    }
  }
  float tail[RT] = {0.f};
  if constexpr (!(TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K)) {
    constexpr int64_t tail_bytes = sb_bytes / 4;
    constexpr float off = bits == 8 ? -128.f : bits == 5 ? -16.f : -8.f;
    for (int64_t t = 0; t < a.n_tail; t++) {
      const uint8_t* o8 = row + a.n_sb * sb_bytes + t * tail_bytes;
      float dA = _cvtsh_ss(rd16(o8)), dB = _cvtsh_ss(rd16(o8 + 2));
      float bA = mn ? _cvtsh_ss(rd16(o8 + 4)) : off * dA;
      float bB = mn ? _cvtsh_ss(rd16(o8 + 6)) : off * dB;
      const uint8_t* q = o8 + (mn ? 8 : 4);
      __m512i U;
      if constexpr (bits == 8) {
        U = _mm512_xor_si512(_mm512_loadu_si512(q), _mm512_set1_epi8((char)0x80));
      } else {
        __m256i v = _mm256_loadu_si256((const __m256i*)q);
        __m256i nib = _mm256_set1_epi8(0x0F);
        U = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, nib)),
                               _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), 1);
        if constexpr (bits == 5) {
          uint64_t mask;
          std::memcpy(&mask, q + 32, 8);
          U = _mm512_or_si512(U, _mm512_maskz_mov_epi8((__mmask64)mask, _mm512_set1_epi8(0x10)));
        }
      }
      for (int r = 0; r < RT; r++) {
        const int8_t* x = qp + r * a.width + 256 * a.n_sb + 64 * t;
        __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), U, _mm512_loadu_si512(x));
        const float* xs = sp + r * a.nscale + 16 * a.n_sb + 2 * t;
        __m512 St = _mm512_insertf32x8(_mm512_set1_ps(dA * xs[0]), _mm256_set1_ps(dB * xs[1]), 1);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), St, acc[r]);
        const float* g = gp + r * a.nsums + 16 * a.n_sb + 2 * t;
        tail[r] += bA * g[0] + bB * g[1];
      }
    }
  }
  float b = m.bias ? m.bias[o] : 0.f;
  for (int r = 0; r < RT; r++) {
    float v = _mm512_reduce_add_ps(acc[r]) + tail[r] + b;
    if constexpr (!g16) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc8[r]), _mm256_extractf128_ps(acc8[r], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      v += _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
    y[(r0 + r) * ld + m.out_offset + o] = v;
  }
}

template <int64_t TYPE>
SG_AVX512 static void row_avx512_t(const Matrix& m, int64_t o, const Act& a, int64_t r0, int64_t r1, float* y,
                                   int64_t ld) {
  int64_t r = r0;
  for (; r + 8 <= r1; r += 8) rows512<TYPE, 8>(m, o, a, r, y, ld);
  for (; r + 4 <= r1; r += 4) rows512<TYPE, 4>(m, o, a, r, y, ld);
  for (; r + 2 <= r1; r += 2) rows512<TYPE, 2>(m, o, a, r, y, ld);
  for (; r < r1; r++) rows512<TYPE, 1>(m, o, a, r, y, ld);
}

// ---- AVX2 -----------------------------------------------------------------------------------------

SG_AVX2 static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Half h (lanes 8h..8h+7) of the four code chunks: 32 bytes each. Q8_0 codes stay signed.
SG_AVX2 static inline void codes256(int bits, const uint8_t* q, const uint8_t* h, int half, __m256i* U) {
  if (bits == 8) {
    for (int c = 0; c < 4; c++) U[c] = _mm256_loadu_si256((const __m256i*)(q + 64 * c + 32 * half));
    return;
  }
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i a = _mm256_loadu_si256((const __m256i*)(q + 32 * half));
  __m256i b = _mm256_loadu_si256((const __m256i*)(q + 64 + 32 * half));
  U[0] = _mm256_and_si256(a, nib);
  U[1] = _mm256_and_si256(_mm256_srli_epi16(a, 4), nib);
  U[2] = _mm256_and_si256(b, nib);
  U[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
  if (bits == 5) {
    // Bits of the 5th bit plane, one per byte: spread 32 bits over 32 bytes.
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    for (int c = 0; c < 4; c++) {
      uint32_t bitsw;
      std::memcpy(&bitsw, h + 8 * c + 4 * half, 4);
      __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bitsw), shuffle);
      __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
      U[c] = _mm256_or_si256(U[c], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
  } else if (bits == 6) {
    const __m256i two = _mm256_set1_epi8(0x30);
    __m256i hh = _mm256_loadu_si256((const __m256i*)(h + 32 * half));
    U[0] = _mm256_or_si256(U[0], _mm256_and_si256(_mm256_slli_epi16(hh, 4), two));
    U[1] = _mm256_or_si256(U[1], _mm256_and_si256(_mm256_slli_epi16(hh, 2), two));
    U[2] = _mm256_or_si256(U[2], _mm256_and_si256(hh, two));
    U[3] = _mm256_or_si256(U[3], _mm256_and_si256(_mm256_srli_epi16(hh, 2), two));
  }
}

// Sum over the four chunks of u * x in int32 lanes; Q8_0 (signed codes) by the sign trick.
SG_AVX2 static inline __m256i dot4_256(int bits, const __m256i* U, const int8_t* x, int half) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (bits == 8) {
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      __m256i xv = _mm256_loadu_si256((const __m256i*)(x + 64 * c + 32 * half));
      __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(U[c], xv));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    return acc;
  }
  __m256i p[4];
  for (int c = 0; c < 4; c++)
    p[c] = _mm256_maddubs_epi16(U[c], _mm256_loadu_si256((const __m256i*)(x + 64 * c + 32 * half)));
  if (bits <= 5) {  // |u * x| <= 31 * 127 * 2 per int16: four of them still fit
    __m256i s = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    return _mm256_madd_epi16(s, ones);
  }
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                          _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
}

template <int64_t TYPE>
SG_AVX2 static inline void superblock256(const uint8_t* o8, __m256& S0, __m256& S1, __m256& B0, __m256& B1,
                                         const uint8_t*& q, const uint8_t*& h) {
  constexpr int bits = TYPE == Q8_0 ? 8 : (TYPE == Q5_0 || TYPE == Q5_1 || TYPE == Q5_K) ? 5 : TYPE == Q6_K ? 6 : 4;
  if constexpr (TYPE == Q6_K) {
    __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(o8)));
    __m128i sc = _mm_loadu_si128((const __m128i*)(o8 + 2));
    S0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    S1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    B0 = _mm256_mul_ps(_mm256_set1_ps(-32.f), S0);
    B1 = _mm256_mul_ps(_mm256_set1_ps(-32.f), S1);
    q = o8 + 18;
    h = o8 + 146;
    return;
  } else {
    __m256 scales, bias;
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
      __m256 d = _mm256_set1_ps(_cvtsh_ss(rd16(o8)));
      __m256 dmin = _mm256_set1_ps(-_cvtsh_ss(rd16(o8 + 2)));
      scales = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o8 + 4)))));
      bias = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(o8 + 12)))));
      q = o8 + 20;
      h = o8 + 148;
    } else {
      constexpr bool mn = TYPE == Q4_1 || TYPE == Q5_1;
      constexpr float off = bits == 8 ? 0.f : bits == 5 ? -16.f : -8.f;  // Q8_0: signed codes here
      scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)o8));
      if constexpr (mn) {
        bias = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o8 + 16)));
        q = o8 + 32;
      } else {
        bias = _mm256_mul_ps(_mm256_set1_ps(off), scales);
        q = o8 + 16;
      }
      h = q + (bits == 8 ? 256 : 128);
    }
    S0 = S1 = scales;  // lane g of either half holds group g
    B0 = bias;
    B1 = _mm256_setzero_ps();
  }
}

template <int64_t TYPE, int RT>
SG_AVX2 static void rows256(const Matrix& m, int64_t o, const Act& a, int64_t r0, float* y, int64_t ld) {
  constexpr int64_t sb_bytes = TYPE == Q4_0 ? 144 : TYPE == Q4_1 ? 160 : TYPE == Q5_0 ? 176 : TYPE == Q5_1 ? 192
                             : TYPE == Q8_0 ? 272 : TYPE == Q4_K ? 148 : TYPE == Q5_K ? 180 : 210;
  constexpr int bits = TYPE == Q8_0 ? 8 : (TYPE == Q5_0 || TYPE == Q5_1 || TYPE == Q5_K) ? 5 : TYPE == Q6_K ? 6 : 4;
  constexpr bool mn = TYPE == Q4_1 || TYPE == Q5_1;
  const uint8_t* row = m.w + o * m.row_bytes;
  const int8_t* qp = a.q + r0 * a.width;
  const float* sp = a.scale + r0 * a.nscale;
  const float* gp = a.sums + r0 * a.nsums;
  __m256 acc[RT];
  for (int r = 0; r < RT; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < a.n_sb; s++) {
    __m256 S0, S1, B0, B1;
    const uint8_t *q, *h;
    // As in rows512 (worth 12-18% here at one row, with the weights streaming from memory).
    _mm_prefetch((const char*)(row + s * sb_bytes + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char*)(row + s * sb_bytes + PREFETCH + 96), _MM_HINT_T0);
    if constexpr (sb_bytes > 192) _mm_prefetch((const char*)(row + s * sb_bytes + PREFETCH + 192), _MM_HINT_T0);
    superblock256<TYPE>(row + s * sb_bytes, S0, S1, B0, B1, q, h);
    if constexpr (TYPE == Q6_K) {
      for (int half = 0; half < 2; half++) {
        __m256i U[4];
        codes256(bits, q, h, half, U);
        __m256 S = half ? S1 : S0;
        for (int r = 0; r < RT; r++) {
          __m256i p = dot4_256(bits, U, qp + r * a.width + 256 * s, half);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(S, _mm256_loadu_ps(sp + r * a.nscale + 16 * s + 8 * half)), acc[r]);
        }
      }
    } else {  // both halves hold the same groups: add their sums, then one multiply-add
      __m256i U[4], V[4];
      codes256(bits, q, h, 0, U);
      codes256(bits, q, h, 1, V);
      for (int r = 0; r < RT; r++) {
        const int8_t* x = qp + r * a.width + 256 * s;
        __m256i p = _mm256_add_epi32(dot4_256(bits, U, x, 0), dot4_256(bits, V, x, 1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(S0, _mm256_loadu_ps(sp + r * a.nscale + 16 * s)), acc[r]);
      }
    }
    for (int r = 0; r < RT; r++) {
      const float* g = gp + r * a.nsums + 16 * s;
      acc[r] = _mm256_fmadd_ps(B0, _mm256_loadu_ps(g), acc[r]);
      if constexpr (TYPE == Q6_K) acc[r] = _mm256_fmadd_ps(B1, _mm256_loadu_ps(g + 8), acc[r]);
    }
  }
  float tail[RT] = {0.f};
  if constexpr (!(TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K)) {
    constexpr int64_t tail_bytes = sb_bytes / 4;
    constexpr float off = bits == 8 ? 0.f : bits == 5 ? -16.f : -8.f;
    for (int64_t t = 0; t < a.n_tail; t++) {
      const uint8_t* o8 = row + a.n_sb * sb_bytes + t * tail_bytes;
      float dA = _cvtsh_ss(rd16(o8)), dB = _cvtsh_ss(rd16(o8 + 2));
      float bA = mn ? _cvtsh_ss(rd16(o8 + 4)) : off * dA;
      float bB = mn ? _cvtsh_ss(rd16(o8 + 6)) : off * dB;
      const uint8_t* q = o8 + (mn ? 8 : 4);
      __m256i U0, U1;
      if constexpr (bits == 8) {
        U0 = _mm256_loadu_si256((const __m256i*)q);
        U1 = _mm256_loadu_si256((const __m256i*)(q + 32));
      } else {
        __m256i v = _mm256_loadu_si256((const __m256i*)q), nib = _mm256_set1_epi8(0x0F);
        U0 = _mm256_and_si256(v, nib);
        U1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        if constexpr (bits == 5) {
          const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
          const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
          for (int k = 0; k < 2; k++) {
            uint32_t bitsw;
            std::memcpy(&bitsw, q + 32 + 4 * k, 4);
            __m256i v2 = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bitsw), shuffle);
            __m256i set = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v2, select), select),
                                           _mm256_set1_epi8(0x10));
            if (k == 0) U0 = _mm256_or_si256(U0, set);
            else U1 = _mm256_or_si256(U1, set);
          }
        }
      }
      const __m256i ones = _mm256_set1_epi16(1);
      for (int r = 0; r < RT; r++) {
        const int8_t* x = qp + r * a.width + 256 * a.n_sb + 64 * t;
        __m256i x0 = _mm256_loadu_si256((const __m256i*)x), x1 = _mm256_loadu_si256((const __m256i*)(x + 32));
        __m256i p0, p1;
        if constexpr (bits == 8) {
          p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x0, x0), _mm256_sign_epi8(U0, x0)), ones);
          p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x1, x1), _mm256_sign_epi8(U1, x1)), ones);
        } else {
          p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(U0, x0), ones);
          p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(U1, x1), ones);
        }
        const float* xs = sp + r * a.nscale + 16 * a.n_sb + 2 * t;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(dA * xs[0]), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(dB * xs[1]), acc[r]);
        const float* g = gp + r * a.nsums + 16 * a.n_sb + 2 * t;
        tail[r] += bA * g[0] + bB * g[1];
      }
    }
  }
  float b = m.bias ? m.bias[o] : 0.f;
  for (int r = 0; r < RT; r++) y[(r0 + r) * ld + m.out_offset + o] = hsum256(acc[r]) + tail[r] + b;
}

template <int64_t TYPE>
SG_AVX2 static void row_avx2_t(const Matrix& m, int64_t o, const Act& a, int64_t r0, int64_t r1, float* y,
                               int64_t ld) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) rows256<TYPE, 4>(m, o, a, r, y, ld);
  for (; r + 2 <= r1; r += 2) rows256<TYPE, 2>(m, o, a, r, y, ld);
  for (; r < r1; r++) rows256<TYPE, 1>(m, o, a, r, y, ld);
}

#endif  // SG_X86

// ---- dispatch and the ops ---------------------------------------------------------------------------

// 0: scalar, 1: AVX2, 2: AVX-512 VNNI. SPECGATE_KERNEL_ISA (scalar, avx2, avx512) may lower it.
static int64_t detect_isa() {
  int64_t best = 0;
#if SG_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = 1;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni"))
    best = 2;
#endif
  const char* want = std::getenv("SPECGATE_KERNEL_ISA");
  if (want != nullptr) {
    int64_t asked = std::strcmp(want, "scalar") == 0 ? 0 : std::strcmp(want, "avx2") == 0 ? 1 : 2;
    best = std::min(best, asked);
  }
  return best;
}

static int64_t g_isa = -1;

static int64_t isa() {
  if (g_isa < 0) g_isa = detect_isa();
  return g_isa;
}

template <int64_t TYPE>
static RowKernel kernel_of(int64_t level) {
#if SG_X86
  if (level >= 2) return row_avx512_t<TYPE>;
  if (level >= 1) return row_avx2_t<TYPE>;
#endif
  return row_scalar;
}



static RowKernel kernel_for(int64_t level, int64_t type) {
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

static int64_t isa_level() { return isa(); }

static int64_t isa_level_for_activations() { return isa(); }

static int64_t set_isa_level(int64_t level) {
  int64_t best = detect_isa();
  g_isa = std::max<int64_t>(0, std::min(level, best));
  return g_isa;
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
  Projection p;
  p.in_features = in_features;
  for (size_t i = 0; i < weights.size(); i++) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == outs[i],
                "bad packed matrix ", i);
    TORCH_CHECK(w.size(1) == row_shape(types[i], in_features).bytes, "packed row bytes do not match ", i);
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
  Activations a32, a16;
};

// y [rows, p.total] = x [rows, p.in_features] (float, prepared) times the projection's transpose.
static void project(const Projection& p, const float* x, int64_t rows, float* y, Scratch& scratch) {
  if (rows == 0 || p.total == 0) return;
  // One activation layout per group size the matrices use.
  bool need32 = false, need16 = false;
  int64_t t32 = -1;
  for (auto& m : p.mats) {
    bool g16 = layout_of(m.type).group == 16;
    (g16 ? need16 : need32) = true;
    if (!g16 && t32 < 0) t32 = m.type;
  }
  if (need32) quantize_activations(x, rows, t32, p.in_features, scratch.a32);
  if (need16) quantize_activations(x, rows, Q6_K, p.in_features, scratch.a16);
  RowKernel kernels[8];
  Act acts[8];
  int64_t n = (int64_t)p.mats.size();
  TORCH_CHECK(n <= 8, "at most 8 matrices per projection");
  for (int64_t i = 0; i < n; i++) {
    kernels[i] = kernel_for(isa(), p.mats[i].type);
    acts[i] = view(layout_of(p.mats[i].type).group == 16 ? scratch.a16 : scratch.a32);
  }
  int64_t total = p.total;
  // Work in units of output rows across all matrices; each unit computes every activation row.
  int64_t grain = std::max<int64_t>(1, std::min<int64_t>(64, total / (4 * at::get_num_threads() + 1)));
  at::parallel_for(0, total, grain, [&](int64_t o0, int64_t o1) {
    for (int64_t i = 0; i < n; i++) {
      const Matrix& m = p.mats[i];
      int64_t start = std::max(o0, m.out_offset), end = std::min(o1, m.out_offset + m.rows);
      for (int64_t o = start; o < end; o++) kernels[i](m, o - m.out_offset, acts[i], 0, rows, y, total);
    }
  });
}

}  // namespace sg
