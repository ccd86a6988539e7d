// Rotary embedding, KV-pool stores and paged attention for the rows of a decode or verification
// step, in one call each per layer.
//
// The torch path spends most of a small model's attention time in dispatch: a rotation is four
// tensor ops, the pool stores two more, and SDPA on a [1, heads, 1..17, context] problem costs tens
// of microseconds before it reads a key. Here each (query, kv head) pair is one task that reads its
// keys and values straight from the pool by slot, with no gathered copy, for all the query heads
// of its group; on AVX-512 sixteen keys' dot products run side by side (keys in lanes).
//
// A query's result depends only on its own visible keys, read in slot-list order: never on the
// other rows of the step, so batching and speculation change no token.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_features.h"
#include "layer_math.h"

#include <vector>

namespace sg {

static inline float bf16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does.
static inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

struct Pool {
  void* k;
  void* v;
  bool bf16;
  int64_t kv_heads, slots, d;

  // Element offset of (kv head, slot) in one layer.
  inline int64_t at(int64_t head, int64_t slot) const { return (head * slots + slot) * d; }
};

static Pool pool_of(const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t layer) {
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes(), "pools must be [layers, kv_heads, slots, d]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "key and value pools must share a dtype");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16,
              "pools must be float32 or bfloat16");
  TORCH_CHECK(layer >= 0 && layer < k_pool.size(0), "layer out of range");
  bool bf16 = k_pool.scalar_type() == at::kBFloat16;
  int64_t per_layer = k_pool.size(1) * k_pool.size(2) * k_pool.size(3);
  int64_t es = bf16 ? 2 : 4;
  return {(char*)k_pool.data_ptr() + layer * per_layer * es, (char*)v_pool.data_ptr() + layer * per_layer * es, bf16,
          k_pool.size(1), k_pool.size(2), k_pool.size(3)};
}

static inline void store(const Pool& p, void* base, int64_t off, const float* src) {
  if (p.bf16) {
    uint16_t* dst = (uint16_t*)base + off;
    for (int64_t i = 0; i < p.d; i++) dst[i] = bf16_bits(src[i]);
  } else {
    std::memcpy((float*)base + off, src, p.d * sizeof(float));
  }
}

// The step's queries rotated into q [n, heads, d]; the rotated keys and the values stored in the
// pool at `slots`. x [n, (heads + 2 kv) d] float32, cos and sin [n, rot] float32 (the first `rot`
// dims of each head are rotated, the rest pass through) with sin signed so that rotate_half(x) *
// sin == x[(i + rot/2) % rot] * sin_signed[i]. Each product is rounded before the sum, as the tensor
// expression x * cos + roll(x, rot/2) * sin is. Where `qn` / `kn` are given, each query / key head
// is first RMS-normed with that weight [d] (QK-norm), as rms_norm_rows normalizes a row.
static void rope_core(const float* xp, int64_t n, int64_t heads, int64_t kv_heads, const float* cp, const float* sp,
                      int64_t rot, const Pool& p, const int64_t* slp, float* qp, const float* qn = nullptr,
                      const float* kn = nullptr, double eps = 0.0) {
  int64_t d = p.d, units = heads + 2 * kv_heads, width = units * d, half = rot / 2;
  at::parallel_for(0, n * units, 16, [&](int64_t u0, int64_t u1) {
    std::vector<float> rotated(d), normed(d);
    for (int64_t u = u0; u < u1; u++) {
      int64_t r = u / units, j = u % units;
      const float* src = xp + r * width + j * d;
      if (j >= heads + kv_heads) {  // a value head: stored as it is
        store(p, p.v, p.at(j - heads - kv_heads, slp[r]), src);
        continue;
      }
      const float* w = j < heads ? qn : kn;
      if (w != nullptr) {
        double ss = 0.0;
        for (int64_t i = 0; i < d; i++) ss += (double)src[i] * src[i];
        float inv = (float)(1.0 / std::sqrt(ss / (double)d + eps));
        for (int64_t i = 0; i < d; i++) normed[i] = src[i] * inv * w[i];
        src = normed.data();
      }
      const float *cr = cp + r * rot, *sr = sp + r * rot;
      float* dst = j < heads ? qp + (r * heads + j) * d : rotated.data();
      for (int64_t i = 0; i < rot; i++) {
        float a = src[i] * cr[i];
        float b = src[(i + half) % rot] * sr[i];
        dst[i] = a + b;
      }
      for (int64_t i = rot; i < d; i++) dst[i] = src[i];
      if (j >= heads) store(p, p.k, p.at(j - heads, slp[r]), rotated.data());
    }
  });
}

// A QK-norm weight as float [d], or an undefined tensor where the layer has none.
static at::Tensor head_norm_weight(const c10::optional<at::Tensor>& w, int64_t d) {
  if (!w.has_value() || !w->defined() || w->numel() == 0) return at::Tensor();
  at::Tensor f = w->to(at::kFloat).contiguous();
  TORCH_CHECK(f.numel() == d, "a QK-norm weight must have head_dim elements");
  return f;
}

static const float* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// cos, sin as float [n, rot] for heads of d dims.
static int64_t rotary_width(const at::Tensor& c, const at::Tensor& s, int64_t n, int64_t d) {
  TORCH_CHECK(c.dim() == 2 && c.size(0) == n && s.sizes() == c.sizes(), "cos, sin must be [N, rot]");
  int64_t rot = c.size(1);
  TORCH_CHECK(rot > 0 && rot <= d && rot % 2 == 0, "the rotated dims must be even and at most head_dim");
  return rot;
}

static void check_slots(const int64_t* slots, int64_t n, const Pool& p) {
  for (int64_t i = 0; i < n; i++) TORCH_CHECK(slots[i] >= 0 && slots[i] < p.slots, "slot out of range");
}

// q [N, heads, d] float32 (rope_core) from qkv [N, (heads + 2 kv_heads) d] (float32 or bfloat16).
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool,
                      at::Tensor v_pool, int64_t layer, const at::Tensor& slots, int64_t heads, int64_t kv_heads,
                      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) % (heads + 2 * kv_heads) == 0, "qkv must be [N, (h + 2 kv) d]");
  int64_t n = qkv.size(0), d = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  Pool p = pool_of(k_pool, v_pool, layer);
  TORCH_CHECK(p.kv_heads == kv_heads && p.d == d, "the pools' heads or head_dim do not match qkv");
  at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  int64_t rot = rotary_width(c, s, n, d);
  at::Tensor sl = slots.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == n, "one slot per row");
  check_slots(sl.data_ptr<int64_t>(), n, p);
  at::Tensor qn = head_norm_weight(q_norm, d), kn = head_norm_weight(k_norm, d);
  at::Tensor x = qkv.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({n, heads, d}, at::kFloat);
  rope_core(x.data_ptr<float>(), n, heads, kv_heads, c.data_ptr<float>(), s.data_ptr<float>(), rot, p,
            sl.data_ptr<int64_t>(), q.data_ptr<float>(), data_or_null(qn), data_or_null(kn), eps);
  return q;
}

// ---- attention ----------------------------------------------------------------------------------

// sum_i q[i] * key[i]; key from the pool (float32 or bfloat16).
static float dot_scalar(const float* q, const Pool& p, int64_t off, int64_t d) {
  float acc = 0.f;
  if (p.bf16) {
    const uint16_t* k = (const uint16_t*)p.k + off;
    for (int64_t i = 0; i < d; i++) acc += q[i] * bf16_value(k[i]);
  } else {
    const float* k = (const float*)p.k + off;
    for (int64_t i = 0; i < d; i++) acc += q[i] * k[i];
  }
  return acc;
}

// acc[i] += w * value[i].
static void axpy_scalar(float* acc, float w, const Pool& p, int64_t off, int64_t d) {
  if (p.bf16) {
    const uint16_t* v = (const uint16_t*)p.v + off;
    for (int64_t i = 0; i < d; i++) acc[i] += w * bf16_value(v[i]);
  } else {
    const float* v = (const float*)p.v + off;
    for (int64_t i = 0; i < d; i++) acc[i] += w * v[i];
  }
}

// e[i] = exp(x[i] - m) by std::exp, and their sum in index order: the softmax of the paths without
// a vector exp (their tokens stay what they were).
static float exp_sum_scalar(float* x, int64_t n, float m) {
  float total = 0.f;
  for (int64_t j = 0; j < n; j++) total += (x[j] = std::exp(x[j] - m));
  return total;
}

#if SG_X86
SG_AVX512 static inline __m512 load16(const void* base, int64_t off, bool bf16) {
  if (bf16) {
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float*)base + off);
}

SG_AVX512 static float dot_avx512(const float* q, const Pool& p, int64_t off, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(p.k, off + i, p.bf16), acc);
  return _mm512_reduce_add_ps(acc);
}

SG_AVX512 static void axpy_avx512(float* acc, float w, const Pool& p, int64_t off, int64_t d) {
  __m512 wv = _mm512_set1_ps(w);
  for (int64_t i = 0; i < d; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, load16(p.v, off + i, p.bf16), _mm512_loadu_ps(acc + i)));
}

// e[i] = exp(x[i] - m), and their sum in index order.
SG_AVX512 static float exp_sum_avx512(float* x, int64_t n, float m) {
  int64_t i = 0;
  __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp512(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv)));
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
  }
  float s = 0.f;
  for (int64_t j = 0; j < n; j++) s += x[j];
  return s;
}

// Scores of up to 16 keys against one query, the keys in lanes: out[j] = (q . key j) * sc for the
// keys at offs[0..n). Each key's dot product is the one dot_avx512 computes, bit for bit (its chain
// of fused multiply-adds over the 16-wide chunks of d, then _mm512_reduce_add_ps's tree: halves,
// quarters, pairs), but sixteen keys' chains run side by side and one transposition reduces them
// all, instead of one latency-bound chain and a horizontal sum per key.
template <int C, bool BF>
SG_AVX512 static inline void scores16_avx512(const float* q, const void* kbase, const int64_t* offs, int64_t n,
                                             float sc, float* out) {
  __m512 acc[16];
  for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
  int64_t off[16];
  for (int k = 0; k < 16; k++) off[k] = offs[k < n ? k : 0];  // a short block repeats its first key
  for (int c = 0; c < C; c++) {
    __m512 qc = _mm512_loadu_ps(q + 16 * c);
    for (int k = 0; k < 16; k++) acc[k] = _mm512_fmadd_ps(qc, load16(kbase, off[k] + 16 * c, BF), acc[k]);
  }
  __m512 h[8], r4[4], r2[2];
  for (int m = 0; m < 8; m++)  // lanes 0-7: key 2m's lane l + lane l+8; lanes 8-15: key 2m+1's
    h[m] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(acc[2 * m], acc[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int m = 0; m < 4; m++)  // 128-bit lane j: key 4m+j's quarter 1 + quarter 0
    r4[m] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_shuffle_f32x4(h[2 * m], h[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int m = 0; m < 2; m++)  // lane j: {key 8m+j: e0+e2, e1+e3; key 8m+4+j: e0+e2, e1+e3}
    r2[m] = _mm512_add_ps(_mm512_shuffle_ps(r4[2 * m], r4[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(r4[2 * m], r4[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // 128-bit lane j: keys j, 4+j, 8+j, 12+j; put key k in lane k.
  __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(r2[0], r2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(r2[0], r2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  sum = _mm512_mul_ps(_mm512_permutexvar_ps(order, sum), _mm512_set1_ps(sc));
  _mm512_mask_storeu_ps(out, (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1), sum);
}

// tile [n, 16 C] float32 = the bfloat16 pool rows at offs[0..n).
template <int C>
SG_AVX512 static inline void widen_avx512(const void* base, const int64_t* offs, int64_t n, float* tile) {
  for (int64_t r = 0; r < n; r++)
    for (int c = 0; c < C; c++) _mm512_storeu_ps(tile + r * 16 * C + 16 * c, load16(base, offs[r] + 16 * c, true));
}

// Keys (and values) a grouped task widens to float32 at a time: its scratch tile is [TILE, d].
constexpr int64_t TILE = 32;

// All the query heads that share one kv head for one query row: q and o [G, d] (contiguous),
// score [G, m], total [G] scratch, tile [TILE, d] scratch. Keys and values are read from the pool a
// tile at a time, widened to float32 once for the G heads rather than once per head; every head's
// arithmetic is attend_head's order.
template <int C, bool BF>
SG_AVX512 static void group_avx512(const float* q, int64_t G, const Pool& p, const int64_t* offs, int64_t m, float sc,
                                   float* score, float* total, float* tile, float* o) {
  constexpr int64_t D = 16 * C;
  int64_t local[TILE];
  for (int64_t r = 0; r < TILE; r++) local[r] = r * D;
  for (int64_t j0 = 0; j0 < m; j0 += TILE) {
    int64_t n = std::min(TILE, m - j0);
    if (BF) widen_avx512<C>(p.k, offs + j0, n, tile);
    const void* kb = BF ? (const void*)tile : p.k;
    const int64_t* ko = BF ? local : offs + j0;
    for (int64_t g = 0; g < G; g++)
      for (int64_t b = 0; b < n; b += 16)
        scores16_avx512<C, false>(q + g * D, kb, ko + b, std::min<int64_t>(16, n - b), sc, score + g * m + j0 + b);
  }
  for (int64_t g = 0; g < G; g++) {
    float* sg = score + g * m;
    __m512 tops = _mm512_set1_ps(-INFINITY);  // a maximum is the same in any order
    int64_t j = 0;
    for (; j + 16 <= m; j += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(sg + j));
    float top = _mm512_reduce_max_ps(tops);
    for (; j < m; j++) top = std::max(top, sg[j]);
    total[g] = exp_sum_avx512(sg, m, top);
  }
  for (int64_t j0 = 0; j0 < m; j0 += TILE) {
    int64_t n = std::min(TILE, m - j0);
    if (BF) widen_avx512<C>(p.v, offs + j0, n, tile);
    for (int64_t g = 0; g < G; g++) {
      float* og = o + g * D;
      const float* w = score + g * m + j0;
      __m512 acc[C];
      for (int c = 0; c < C; c++) acc[c] = _mm512_loadu_ps(og + 16 * c);
      for (int64_t r = 0; r < n; r++) {
        __m512 wv = _mm512_set1_ps(w[r]);
        const float* row = BF ? tile + r * D : (const float*)p.v + offs[j0 + r];
        for (int c = 0; c < C; c++) acc[c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(row + 16 * c), acc[c]);
      }
      for (int c = 0; c < C; c++) _mm512_storeu_ps(og + 16 * c, acc[c]);
    }
  }
  for (int64_t g = 0; g < G; g++) {
    float inv = 1.f / total[g];
    for (int64_t k = 0; k < D; k++) o[g * D + k] *= inv;
  }
}

// group_avx512 for this head_dim; false where d has no specialization (the caller's per-head loop
// takes it).
template <bool BF>
SG_AVX512 static bool group_avx512_any(const float* q, int64_t G, const Pool& p, const int64_t* offs, int64_t m,
                                       float sc, float* score, float* total, float* tile, float* o) {
  switch (p.d) {
    case 32: group_avx512<2, BF>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    case 64: group_avx512<4, BF>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    case 128: group_avx512<8, BF>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    case 256: group_avx512<16, BF>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    default: return false;
  }
}

SG_AVX2 static inline __m256 load8(const void* base, int64_t off, bool bf16) {
  if (bf16) {
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + off));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return _mm256_loadu_ps((const float*)base + off);
}

SG_AVX2 static float dot_avx2(const float* q, const Pool& p, int64_t off, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(p.k, off + i, p.bf16), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

SG_AVX2 static void axpy_avx2(float* acc, float w, const Pool& p, int64_t off, int64_t d) {
  __m256 wv = _mm256_set1_ps(w);
  for (int64_t i = 0; i < d; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, load8(p.v, off + i, p.bf16), _mm256_loadu_ps(acc + i)));
}

// Scores of up to 8 keys against one query (float32 keys at offs[0..n) of kbase), the keys in lanes:
// each key's dot product is dot_avx2's, bit for bit, but eight keys' chains of fused multiply-adds
// run side by side and are reduced together, where dot_avx2 runs one latency-bound chain per key.
template <int C>
SG_AVX2 static inline void scores8_avx2(const float* q, const float* kbase, const int64_t* offs, int64_t n, float sc,
                                        float* out) {
  __m256 acc[8];
  for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
  const float* key[8];
  for (int k = 0; k < 8; k++) key[k] = kbase + offs[k < n ? k : 0];  // a short block repeats its first key
  for (int c = 0; c < C; c++) {
    __m256 qc = _mm256_loadu_ps(q + 8 * c);
    for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(key[k] + 8 * c), acc[k]);
  }
  // dot_avx2's reduction of each key, bit for bit: s = low half + high half (4 lanes), then
  // (s0 + s2) + (s1 + s3). Keys k and k + 4 share a vector, one per 128-bit half.
  __m256 t[4];
  for (int k = 0; k < 4; k++)
    t[k] = _mm256_add_ps(_mm256_permute2f128_ps(acc[k], acc[k + 4], 0x20),
                         _mm256_permute2f128_ps(acc[k], acc[k + 4], 0x31));
  // Per half: [keys 0, 1: s0 + s2, then s1 + s3] and the same for keys 2, 3.
  __m256 u01 = _mm256_add_ps(_mm256_unpacklo_ps(t[0], t[1]), _mm256_unpackhi_ps(t[0], t[1]));
  __m256 u23 = _mm256_add_ps(_mm256_unpacklo_ps(t[2], t[3]), _mm256_unpackhi_ps(t[2], t[3]));
  __m256 sum = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_mul_ps(sum, _mm256_set1_ps(sc)));
  for (int64_t k = 0; k < std::min<int64_t>(8, n); k++) out[k] = r[k];
}

// tile [n, 8 C] float32 = the bfloat16 pool rows at offs[0..n).
template <int C>
SG_AVX2 static inline void widen_avx2(const void* base, const int64_t* offs, int64_t n, float* tile) {
  for (int64_t r = 0; r < n; r++)
    for (int c = 0; c < C; c++) _mm256_storeu_ps(tile + r * 8 * C + 8 * c, load8(base, offs[r] + 8 * c, true));
}

// group_avx512's method with 256-bit vectors: the G query heads of one kv head read each tile of keys
// and values once (a bfloat16 pool's widened to float32 once); every head's arithmetic is attend_head's on AVX2 (its
// dot products, std::exp, the values' FMAs in key order), so a token is the same as there.
template <int C>
SG_AVX2 static void group_avx2(const float* q, int64_t G, const Pool& p, const int64_t* offs, int64_t m, float sc,
                               float* score, float* total, float* tile, float* o) {
  constexpr int64_t D = 8 * C;
  int64_t local[TILE];
  for (int64_t r = 0; r < TILE; r++) local[r] = r * D;
  for (int64_t j0 = 0; j0 < m; j0 += TILE) {
    int64_t n = std::min(TILE, m - j0);
    if (p.bf16) widen_avx2<C>(p.k, offs + j0, n, tile);
    const float* kb = p.bf16 ? tile : (const float*)p.k;
    const int64_t* ko = p.bf16 ? local : offs + j0;
    for (int64_t g = 0; g < G; g++)
      for (int64_t b = 0; b < n; b += 8)
        scores8_avx2<C>(q + g * D, kb, ko + b, std::min<int64_t>(8, n - b), sc, score + g * m + j0 + b);
  }
  for (int64_t g = 0; g < G; g++) {
    float* sg = score + g * m;
    float top = -INFINITY;
    for (int64_t j = 0; j < m; j++) top = std::max(top, sg[j]);
    total[g] = exp_sum_scalar(sg, m, top);
  }
  // Values: 8 chunks of d (64 floats) at a time stay in registers.
  constexpr int CH = C < 8 ? C : 8;
  for (int64_t j0 = 0; j0 < m; j0 += TILE) {
    int64_t n = std::min(TILE, m - j0);
    if (p.bf16) widen_avx2<C>(p.v, offs + j0, n, tile);
    for (int64_t g = 0; g < G; g++) {
      const float* w = score + g * m + j0;
      for (int c0 = 0; c0 < C; c0 += CH) {
        float* og = o + g * D + 8 * c0;
        __m256 acc[CH];
        for (int c = 0; c < CH; c++) acc[c] = _mm256_loadu_ps(og + 8 * c);
        for (int64_t r = 0; r < n; r++) {
          __m256 wv = _mm256_set1_ps(w[r]);
          const float* row = (p.bf16 ? tile + r * D : (const float*)p.v + offs[j0 + r]) + 8 * c0;
          for (int c = 0; c < CH; c++) acc[c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + 8 * c), acc[c]);
        }
        for (int c = 0; c < CH; c++) _mm256_storeu_ps(og + 8 * c, acc[c]);
      }
    }
  }
  for (int64_t g = 0; g < G; g++) {
    float inv = 1.f / total[g];
    for (int64_t k = 0; k < D; k++) o[g * D + k] *= inv;
  }
}

// group_avx2 for this head_dim; false where d has no specialization.
SG_AVX2 static bool group_avx2_any(const float* q, int64_t G, const Pool& p, const int64_t* offs, int64_t m, float sc,
                                   float* score, float* total, float* tile, float* o) {
  switch (p.d) {
    case 32: group_avx2<4>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    case 64: group_avx2<8>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    case 128: group_avx2<16>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    case 256: group_avx2<32>(q, G, p, offs, m, sc, score, total, tile, o); return true;
    default: return false;
  }
}
#endif

// One attention call: a group of b sequences with t query rows each (BatchedGroup in
// engine/attention.py). Query i is packed row qi[i] (start + i where qi is null); it sees key s of
// its sequence bi = i / t, at pool slot kv[bi * S + s], where mask[i * S + s] (every s if null)
// and, on a sliding-window layer (window > 0), where pos[row] - s < window (s is the key's position;
// draft-tree nodes sit at or after theirs, within any window), as engine/attention.py `windowed`.
struct AttendCall {
  const int64_t* kv;
  int64_t b, S, t, start;
  const int64_t* qi;
  const bool* mask;
  const int64_t* pos = nullptr;
  int64_t window = 0;
};

// One (query, head) over its m visible keys, any head_dim: score [m] scratch, o [d] zeros on entry.
static void attend_head(const float* qv, const Pool& p, const int64_t* offs, int64_t m, float sc, float* score,
                        float* o) {
  int64_t d = p.d, level = isa();
  bool v512 = SG_X86 && level >= 2 && d % 16 == 0, v256 = SG_X86 && level >= 1 && d % 8 == 0;
  (void)v512;
  (void)v256;
  float top = -INFINITY, total;
#if SG_X86
  if (v512) {
    for (int64_t j = 0; j < m; j++) score[j] = dot_avx512(qv, p, offs[j], d) * sc;
  } else if (v256) {
    for (int64_t j = 0; j < m; j++) score[j] = dot_avx2(qv, p, offs[j], d) * sc;
  } else
#endif
  {
    for (int64_t j = 0; j < m; j++) score[j] = dot_scalar(qv, p, offs[j], d) * sc;
  }
  for (int64_t j = 0; j < m; j++) top = std::max(top, score[j]);
#if SG_X86
  if (v512) {
    total = exp_sum_avx512(score, m, top);
  } else
#endif
  {
    total = exp_sum_scalar(score, m, top);
  }
#if SG_X86
  if (v512) {
    for (int64_t j = 0; j < m; j++) axpy_avx512(o, score[j], p, offs[j], d);
  } else if (v256) {
    for (int64_t j = 0; j < m; j++) axpy_avx2(o, score[j], p, offs[j], d);
  } else
#endif
  {
    for (int64_t j = 0; j < m; j++) axpy_scalar(o, score[j], p, offs[j], d);
  }
  float inv = 1.f / total;
  for (int64_t k = 0; k < d; k++) o[k] *= inv;
}

// out [b * t, heads, d] for q [N, heads, d] (float32). One task per (query row, kv head): the
// query heads of a GQA group read their keys and values together.
static void attend_core(const float* qp, int64_t heads, const Pool& p, const AttendCall& c, float sc, float* op) {
  int64_t d = p.d, rows = c.b * c.t, group = heads / p.kv_heads, S = c.S;
  bool v512 = SG_X86 && isa() >= 2, v256 = SG_X86 && isa() == 1;
  (void)v512;
  (void)v256;
  at::parallel_for(0, rows * p.kv_heads, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> score(group * S), total(group), tile(TILE * d);
    std::vector<int64_t> offs(S);
    for (int64_t u = u0; u < u1; u++) {
      int64_t i = u / p.kv_heads, head = u % p.kv_heads, bi = i / c.t, h0 = head * group;
      int64_t row = c.qi ? c.qi[i] : c.start + i;
      const float* qv = qp + (row * heads + h0) * d;
      const bool* visible = c.mask ? c.mask + i * S : nullptr;
      int64_t first = c.window > 0 ? std::max<int64_t>(0, c.pos[row] - c.window + 1) : 0;
      int64_t m = 0;
      for (int64_t s = first; s < S; s++)
        if (!visible || visible[s]) offs[m++] = p.at(head, c.kv[bi * S + s]);
      float* o = op + (i * heads + h0) * d;
      std::fill(o, o + group * d, 0.f);
      if (m == 0) continue;  // a padded query with no keys: zeros, as it is discarded
#if SG_X86
      float *sp = score.data(), *tp = total.data(), *wp = tile.data();
      if (v512 && (p.bf16 ? group_avx512_any<true>(qv, group, p, offs.data(), m, sc, sp, tp, wp, o)
                          : group_avx512_any<false>(qv, group, p, offs.data(), m, sc, sp, tp, wp, o)))
        continue;
      if (v256 && group_avx2_any(qv, group, p, offs.data(), m, sc, sp, tp, wp, o)) continue;
#endif
      for (int64_t g = 0; g < group; g++) attend_head(qv + g * d, p, offs.data(), m, sc, score.data(), o + g * d);
    }
  });
}

// An AttendCall from tensors, checked against q's n rows and the pool; `keep` holds the converted
// tensors its pointers refer to.
static AttendCall attend_call(const at::Tensor& kv_slots, int64_t start, const at::Tensor& q_index,
                              const at::Tensor& mask, int64_t t, int64_t n, const Pool& p,
                              std::vector<at::Tensor>& keep) {
  at::Tensor kv = kv_slots.to(at::kLong).contiguous();
  TORCH_CHECK(kv.dim() == 2 && t > 0, "kv_slots must be [b, S] and t positive");
  int64_t b = kv.size(0), S = kv.size(1), rows = b * t;
  check_slots(kv.data_ptr<int64_t>(), b * S, p);
  at::Tensor qi = q_index.to(at::kLong).contiguous();
  TORCH_CHECK(qi.numel() == 0 || qi.numel() == rows, "q_index must have b * t entries, or none");
  const int64_t* qip = qi.numel() ? qi.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < rows; i++) {
    int64_t r = qip ? qip[i] : start + i;
    TORCH_CHECK(r >= 0 && r < n, "query row out of range");
  }
  const bool* mp = nullptr;
  if (mask.defined() && mask.numel() > 0) {
    at::Tensor mk = mask.to(at::kBool).contiguous();
    TORCH_CHECK(mk.numel() == rows * S, "mask must be [b, (1,) t, S]");
    mp = mk.data_ptr<bool>();
    keep.push_back(mk);
  }
  keep.push_back(kv);
  keep.push_back(qi);
  return {kv.data_ptr<int64_t>(), b, S, t, start, qip, mp, nullptr, 0};
}

// out [b * t, heads, d] float32 of one AttendCall over q [N, heads, d] (float32).
at::Tensor paged_attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t layer,
                        const at::Tensor& kv_slots, int64_t start, const at::Tensor& q_index,
                        const c10::optional<at::Tensor>& mask, int64_t t, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q must be float [N, heads, d]");
  Pool p = pool_of(k_pool, v_pool, layer);
  TORCH_CHECK(p.d == q.size(2) && q.size(1) % p.kv_heads == 0, "the pools do not match q's heads or head_dim");
  std::vector<at::Tensor> keep;
  AttendCall c = attend_call(kv_slots, start, q_index, mask.has_value() ? *mask : at::Tensor(), t, q.size(0), p, keep);
  at::Tensor out = at::empty({c.b * c.t, q.size(1), q.size(2)}, at::kFloat);
  attend_core(q.data_ptr<float>(), q.size(1), p, c, (float)scale, out.data_ptr<float>());
  return out;
}

}  // namespace sg
