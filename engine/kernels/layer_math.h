// What a decoder layer does to a product's input before the product (RMSNorm, SwiGLU / GeGLU), on the
// vector unit the kernels use; exp512 serves attention's softmax too.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_features.h"

namespace sg {

// ---- what the layers do to an input before its product: RMSNorm, SwiGLU / GeGLU ---------------

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// The gate's activations: silu(g) = g * sigmoid(g); GELU's tanh form, 0.5 g (1 + tanh(y)) with
// y = sqrt(2 / pi) (g + 0.044715 g^3), is g * sigmoid(2 y), so both are g / (1 + exp(-a)).
enum Activation : int64_t { ACT_NONE = 0, ACT_SILU = 1, ACT_GELU_TANH = 2 };

static inline float gelu_tanh(float v) {
  float cube = v * v * v;
  float y2 = (2.f * 0.7978845608028654f) * (v + 0.044715f * cube);  // the vector path's order
  return v / (1.f + std::exp(-y2));
}


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

SG_AVX512 static void gated_avx512(const float* gate, const float* up, float* out, int64_t n, int64_t act) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    __m512 g = _mm512_loadu_ps(gate + i);
    __m512 a = g;
    if (act == ACT_GELU_TANH) {
      __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
      __m512 inner = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), cube));
      a = _mm512_mul_ps(_mm512_set1_ps(2.f * 0.7978845608028654f), inner);
    }
    __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), a));
    __m512 sg = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(sg, _mm512_loadu_ps(up + i)));
  }
  for (; i < n; i++) out[i] = (act == ACT_GELU_TANH ? gelu_tanh(gate[i]) : silu(gate[i])) * up[i];
}
#endif

// act(gate) * up of each row of x [rows, 2 * in] (gate first) into out [rows, in].
static void gated_rows(const float* x, int64_t rows, int64_t in, float* out, int64_t act) {
  TORCH_CHECK(act == ACT_SILU || act == ACT_GELU_TANH, "unknown gate activation ", act);
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      const float* g = x + r * 2 * in;
#if SG_X86
      if (isa() >= 2) {
        gated_avx512(g, g + in, out + r * in, in, act);
        continue;
      }
#endif
      if (act == ACT_GELU_TANH) {
        for (int64_t i = 0; i < in; i++) out[r * in + i] = gelu_tanh(g[i]) * g[in + i];
      } else {
        for (int64_t i = 0; i < in; i++) out[r * in + i] = silu(g[i]) * g[in + i];
      }
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
// (gated: its activation) act(gate) * up of a [rows, 2 * in] input.
static at::Tensor prepared_input(const at::Tensor& x, int64_t in_features, const c10::optional<at::Tensor>& norm,
                                 double eps, int64_t gated) {
  at::Tensor xf = x.to(at::kFloat).contiguous();
  int64_t rows = x.size(0);
  if (gated) {
    TORCH_CHECK(x.size(1) == 2 * in_features, "a gated input must be [rows, 2 * in_features]");
    at::Tensor out = at::empty({rows, in_features}, at::kFloat);
    gated_rows(xf.data_ptr<float>(), rows, in_features, out.data_ptr<float>(), gated);
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

}  // namespace sg
