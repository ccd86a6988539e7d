// GGUF weight blocks and the panel layout the products read them in.
//
// A GGUF file stores each weight row as blocks (32 weights, or superblocks of 256 for the K-quants),
// each with its scales and its codes. The kernels read them from panels instead: 16 output rows side
// by side, so that one 64-byte vector holds 4 consecutive codes of each of the 16 rows (the operand
// of one VNNI dot product against 4 activation values broadcast), and one product call reads every
// weight once whatever the number of activation rows. The bytes per weight are the file's own (the
// same fields, moved), but for padding: rows to a multiple of 16, a row of blocks of 32 to a
// multiple of 64 weights (zeros), and Q6_K's scales by 32 bytes a unit (1%).
//
// A panel is its units one after another (so that a thread's reads are one stream), each a whole
// number of 64-byte lines: 64 weights of each of the 16 rows for the blocks-of-32 types (two blocks),
// 256 for the K-quants. A unit holds its scales first (read before its codes), then the codes of its
// blocks of 32, then their high bits (5- and 6-bit types), each part 64-byte aligned so that no
// vector load splits a line. Scales (o: the row in the panel, 0..15; fp16 as in the file):
//   blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): per block, d[16] fp16, then m[16] fp16 (Q4_1, Q5_1).
//   Q4_K, Q5_K: d[16], dmin[16] fp16, sc[8][16] and mn[8][16] (6-bit scales and mins).
//   Q6_K: d[16] fp16, sc[16][16] int8.
// Codes of one block of 32 (quad c: inputs 4c..4c+3; byte 4o + b of a 64-byte vector: row o, input 4c + b):
//   4-bit and the low 4 bits of 5/6-bit codes: 4 vectors; vector v holds quad v in its low nibbles and
//     quad v + 4 in its high nibbles.
//   5th bit: one vector; bit c of byte 4o + b is the 5th bit of quad c's code.
//   6-bit high bits: two vectors (quads 0-3, 4-7); bits 2(c % 4)..2(c % 4)+1 of byte 4o + b.
//   8-bit: 8 vectors, one per quad, each code stored unsigned (q + 128).

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace sg {

// ggml's type ids.
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int64_t PANEL = 16;  // output rows per panel

struct Layout {
  int64_t unit;         // weights of a row per unit: 64 (two blocks of 32), or 256 (K-quants)
  int64_t src_block;    // weights per source block: 32, or 256
  int64_t src_bytes;    // bytes of one source block
  int group;            // weights per scale: 32, or 16 (Q6_K)
  int bits;             // code width: 4, 5, 6 or 8
  bool has_min;         // w = d * u + m (Q4_1, Q5_1, Q4_K, Q5_K); else w = d * (u - offset)
  int offset;           // the symmetric types' code offset: 8, 16, 32 or 128
  int64_t scale_bytes;  // bytes of one unit's scales (16 rows), a multiple of 64
  int64_t unit_bytes;   // bytes of one unit (16 rows), a multiple of 64
};

static constexpr Layout layout_of(int64_t type) {
  return type == Q4_0   ? Layout{64, 32, 18, 32, 4, false, 8, 64, 576}
         : type == Q4_1 ? Layout{64, 32, 20, 32, 4, true, 0, 128, 640}
         : type == Q5_0 ? Layout{64, 32, 22, 32, 5, false, 16, 64, 704}
         : type == Q5_1 ? Layout{64, 32, 24, 32, 5, true, 0, 128, 768}
         : type == Q8_0 ? Layout{64, 32, 34, 32, 8, false, 128, 64, 1088}
         : type == Q4_K ? Layout{256, 256, 144, 32, 4, true, 0, 320, 2368}
         : type == Q5_K ? Layout{256, 256, 176, 32, 5, true, 0, 320, 2880}
         : type == Q6_K ? Layout{256, 256, 210, 16, 6, false, 32, 320, 3392}
                        : Layout{0, 0, 0, 0, 0, false, 0, 0, 0};
}

static inline bool known_type(int64_t type) { return layout_of(type).unit != 0; }

static inline void check_type(int64_t type) { TORCH_CHECK(known_type(type), "unsupported GGUF type ", type); }

static inline bool k_type(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

// Bytes of the codes of one block of 32 in a panel, and of their high bits.
static constexpr int64_t block_code_bytes(int bits) { return bits == 8 ? 512 : 256; }
static constexpr int64_t block_high_bytes(int bits) { return bits == 5 ? 64 : bits == 6 ? 128 : 0; }

// Where the parts of a unit start, from the unit's first byte: its scales, the codes of its blocks of
// 32, their high bits.
static constexpr int64_t scales_at(const Layout&) { return 0; }
static constexpr int64_t codes_at(const Layout& L, int j) { return L.scale_bytes + j * block_code_bytes(L.bits); }
static constexpr int64_t high_at(const Layout& L, int j) {
  return L.scale_bytes + L.unit / 32 * block_code_bytes(L.bits) + j * block_high_bytes(L.bits);
}

// A row of `in_features` weights as the panels hold it: padded to whole units.
static constexpr int64_t padded_features(int64_t in_features) { return (in_features + 63) / 64 * 64; }

static int64_t units_of(int64_t type, int64_t in_features) {
  check_type(type);
  Layout L = layout_of(type);
  TORCH_CHECK(in_features > 0 && in_features % L.src_block == 0, "in_features ", in_features,
              " is not a multiple of ", L.src_block,
              k_type(type) ? " (a K-quant row must be a multiple of 256 weights)" : "");
  return padded_features(in_features) / L.unit;
}

static int64_t panel_bytes(int64_t type, int64_t in_features) {
  return units_of(type, in_features) * layout_of(type).unit_bytes;
}

static inline int64_t panels_of(int64_t rows) { return (rows + PANEL - 1) / PANEL; }

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

// ---- source blocks -> codes and scales (scalar; load time) --------------------------------------

// One source block's codes (unsigned) and its scale fields.
struct Decoded {
  uint8_t u[256];
  int16_t scale_q[16];  // K-quants: integer sub-scales (6 bits; Q6_K: signed 8 bits)
  int16_t min_q[16];
  uint16_t d, dmin;  // fp16 factors (blocks of 32: d and, Q4_1 / Q5_1, m as dmin)
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
      o.d = rd16(b);
      o.dmin = mn ? rd16(b + 2) : 0;
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
      return;
    }
    case Q8_0: {
      o.d = rd16(b);
      for (int j = 0; j < 32; j++) o.u[j] = (uint8_t)((int8_t)b[2 + j] + 128);
      return;
    }
    case Q4_K:
    case Q5_K: {
      o.d = rd16(b);
      o.dmin = rd16(b + 2);
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
      for (int g = 0; g < 16; g++) o.scale_q[g] = sc[g];
      return;
    }
    default:
      TORCH_CHECK(false, "unsupported GGUF type ", type);
  }
}

// ---- one code in a panel-unit -------------------------------------------------------------------

// Writes code u of input i (0 .. unit - 1) of panel row o into a zeroed panel-unit.
static void put_code(const Layout& L, uint8_t* unit, int o, int i, uint8_t u) {
  int j = i / 32, c = (i % 32) / 4, pos = 4 * o + i % 4;
  uint8_t* codes = unit + codes_at(L, j);
  if (L.bits == 8) {
    codes[64 * c + pos] = u;
    return;
  }
  codes[64 * (c % 4) + pos] |= (uint8_t)((u & 0xF) << (c < 4 ? 0 : 4));
  uint8_t* high = unit + high_at(L, j);
  if (L.bits == 5 && (u & 0x10)) high[pos] |= (uint8_t)(1 << c);
  if (L.bits == 6) high[64 * (c / 4) + pos] |= (uint8_t)(((u >> 4) & 3) << (2 * (c % 4)));
}

static uint8_t get_code(const Layout& L, const uint8_t* unit, int o, int i) {
  int j = i / 32, c = (i % 32) / 4, pos = 4 * o + i % 4;
  const uint8_t* codes = unit + codes_at(L, j);
  if (L.bits == 8) return codes[64 * c + pos];
  uint8_t u = (uint8_t)((codes[64 * (c % 4) + pos] >> (c < 4 ? 0 : 4)) & 0xF);
  const uint8_t* high = unit + high_at(L, j);
  if (L.bits == 5) u |= (uint8_t)(((high[pos] >> c) & 1) << 4);
  if (L.bits == 6) u |= (uint8_t)(((high[64 * (c / 4) + pos] >> (2 * (c % 4))) & 3) << 4);
  return u;
}

// ---- repacking: source rows -> panels -------------------------------------------------------------

// Row o of a panel-unit from the source block holding its inputs [32 k, ...) (k: which block of 32
// of the unit; 0 for K-quants).
static void put_block(int64_t type, const uint8_t* src, uint8_t* unit, int o, int k) {
  Layout L = layout_of(type);
  Decoded dec;
  decode_source(type, src, dec);
  uint8_t* sc = unit + scales_at(L);
  if (type == Q4_K || type == Q5_K) {
    wr16(sc + 2 * o, dec.d);
    wr16(sc + 32 + 2 * o, dec.dmin);
    for (int g = 0; g < 8; g++) {
      sc[64 + 16 * g + o] = (uint8_t)dec.scale_q[g];
      sc[192 + 16 * g + o] = (uint8_t)dec.min_q[g];
    }
  } else if (type == Q6_K) {
    wr16(sc + 2 * o, dec.d);
    for (int g = 0; g < 16; g++) sc[32 + 16 * g + o] = (uint8_t)(int8_t)dec.scale_q[g];
  } else {
    uint8_t* block = sc + k * L.scale_bytes / 2;
    wr16(block + 2 * o, dec.d);
    if (L.has_min) wr16(block + 32 + 2 * o, dec.dmin);
  }
  for (int i = 0; i < L.src_block; i++) put_code(L, unit, o, 32 * k + i, dec.u[i]);
}

// Packed panels [ceil(rows / 16), panel bytes] of a matrix's source blocks [rows, row bytes]; rows
// past the last, and weights past a row's end, are zeros (their outputs are never written; their
// products are zero).
static at::Tensor repack_rows(const uint8_t* src, int64_t rows, int64_t src_row_bytes, int64_t type,
                              int64_t in_features) {
  Layout L = layout_of(type);
  int64_t units = units_of(type, in_features), pb = units * L.unit_bytes;
  int64_t src_blocks = in_features / L.src_block, per_unit = L.unit / L.src_block;
  TORCH_CHECK(src_row_bytes == src_blocks * L.src_bytes, "row bytes do not match the type");
  at::Tensor dst = at::zeros({panels_of(rows), pb}, at::kByte);
  uint8_t* d = dst.data_ptr<uint8_t>();
  at::parallel_for(0, panels_of(rows), 4, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
      for (int o = 0; o < PANEL && p * PANEL + o < rows; o++)
        for (int64_t s = 0; s < src_blocks; s++)
          put_block(type, src + (p * PANEL + o) * src_row_bytes + s * L.src_bytes,
                    d + p * pb + s / per_unit * L.unit_bytes, o, (int)(s % per_unit));
  });
  return dst;
}

// ---- panels -> weights (scalar: the embedding's lookups, the portable product) --------------------

// Row o of a panel-unit: its codes (unsigned, natural order) and per-group scale and bias, so that
// weight i is scale[i / group] * u[i] + bias[i / group].
static void unpack_row(int64_t type, const uint8_t* unit, int o, uint8_t* u, float* scale, float* bias) {
  Layout L = layout_of(type);
  const uint8_t* sc = unit + scales_at(L);
  if (type == Q4_K || type == Q5_K) {
    float d = half_to_float(rd16(sc + 2 * o)), dmin = half_to_float(rd16(sc + 32 + 2 * o));
    for (int g = 0; g < 8; g++) {
      scale[g] = d * sc[64 + 16 * g + o];
      bias[g] = -dmin * sc[192 + 16 * g + o];
    }
  } else if (type == Q6_K) {
    float d = half_to_float(rd16(sc + 2 * o));
    for (int g = 0; g < 16; g++) {
      scale[g] = d * (int8_t)sc[32 + 16 * g + o];
      bias[g] = -32.f * scale[g];
    }
  } else {
    for (int k = 0; k < 2; k++) {
      const uint8_t* block = sc + k * L.scale_bytes / 2;
      float d = half_to_float(rd16(block + 2 * o));
      scale[k] = d;
      bias[k] = L.has_min ? half_to_float(rd16(block + 32 + 2 * o)) : -(float)L.offset * d;
    }
  }
  for (int i = 0; i < L.unit; i++) u[i] = get_code(L, unit, o, i);
}

}  // namespace sg
