// The ops of the native kernels (torch.ops.specgate_gguf): matrix products on GGUF blocks
// (quantized_matmul.h), rotary embedding with paged attention (attention.h) and a whole decoder
// stack per call (decoder.h). One translation unit: the headers are this file's parts.

#include "quantized_matmul.h"
#include "attention.h"
#include "decoder.h"

namespace sg {

// Bytes of one packed panel (16 output rows) of a matrix with `in_features` inputs.
int64_t packed_panel_bytes(int64_t type, int64_t in_features) { return panel_bytes(type, in_features); }

// Panels [ceil(rows / 16), panel bytes] from a GGUF tensor's raw blocks [rows, row bytes].
at::Tensor repack(const at::Tensor& src, int64_t type, int64_t in_features) {
  TORCH_CHECK(src.dtype() == at::kByte && src.dim() == 2 && src.is_contiguous(), "src must be uint8 [rows, bytes]");
  check_type(type);
  return repack_rows(src.data_ptr<uint8_t>(), src.size(0), src.size(1), type, in_features);
}

// Dense fp32 rows of a packed matrix (the embedding table's lookups; references in tests).
// `rows`: the matrix's rows (its panels hold up to 15 more, padding).
at::Tensor dequantize_rows(const at::Tensor& w, int64_t type, int64_t in_features, int64_t rows, const at::Tensor& ids) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous(), "w must be packed uint8 panels");
  int64_t pb = panel_bytes(type, in_features);
  TORCH_CHECK(w.size(1) == pb, "packed panel bytes do not match the type");
  Layout L = layout_of(type);
  at::Tensor idx = ids.to(at::kLong).contiguous();
  int64_t n = idx.numel();
  TORCH_CHECK(w.size(0) == panels_of(rows), "the panels do not hold ", rows, " rows");
  at::Tensor out = at::empty({n, in_features}, at::kFloat);
  const int64_t* ip = idx.data_ptr<int64_t>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < n; i++) TORCH_CHECK(ip[i] >= 0 && ip[i] < rows, "row id out of range");
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    uint8_t u[256];
    float scale[16], bias[16];
    for (int64_t i = a; i < b; i++) {
      const uint8_t* panel = wp + (ip[i] / PANEL) * pb;
      float* dst = op + i * in_features;
      for (int64_t s = 0; s < units_of(type, in_features); s++) {
        unpack_row(type, panel + s * L.unit_bytes, (int)(ip[i] % PANEL), u, scale, bias);
        for (int j = 0; j < L.unit && L.unit * s + j < in_features; j++)
          dst[L.unit * s + j] = scale[j / L.group] * u[j] + bias[j / L.group];
      }
    }
  });
  return out;
}

// y [rows, sum of out] = x [rows, in] times each packed matrix's transpose, outputs side by side
// (the fused q/k/v or gate/up of a layer, whatever their types); x is float32 or bfloat16, y has
// x's dtype. `biases`: per matrix, an fp32 [out] tensor or an empty one. `gated`: 0, or the gate's
// activation (layer_math.h `Activation`) of a [rows, 2 * in] input.
at::Tensor qmatmul(const at::Tensor& x, at::TensorList weights, at::IntArrayRef types, at::IntArrayRef outs,
                   int64_t in_features, at::TensorList biases, const c10::optional<at::Tensor>& norm, double eps,
                   int64_t gated, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  Projection p = make_projection(weights, types, outs, in_features, biases);
  int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, p.total}, at::kFloat);
  if (rows == 0 || p.total == 0) return y.to(x.scalar_type());
  at::Tensor xin = prepared_input(x, in_features, norm, eps, gated);
  Scratch scratch;
  project(p, xin.data_ptr<float>(), rows, y.data_ptr<float>(), scratch);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->dim() == 2 && residual->size(0) == rows && residual->size(1) == p.total,
                "the residual must be [rows, sum of out]");
    y.add_(residual->to(at::kFloat));
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// RMSNorm(x) * w of each row of x [rows, in], float32: the norm the decoder applies to a projection's
// output (Gemma's sandwich norms), for the per-layer path.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  at::Tensor xf = x.to(at::kFloat).contiguous(), wf = w.to(at::kFloat).contiguous();
  TORCH_CHECK(wf.numel() == xf.size(1), "the norm weight must have in elements");
  at::Tensor out = at::empty_like(xf);
  rms_norm_rows(xf.data_ptr<float>(), xf.size(0), xf.size(1), wf.data_ptr<float>(), eps, out.data_ptr<float>());
  return out;
}

}  // namespace sg

// The ops' namespace; a benchmark may build a variant under another name to compare the two in one
// process.
#ifndef SG_LIBRARY
#define SG_LIBRARY specgate_gguf
#endif

TORCH_LIBRARY(SG_LIBRARY, m) {
  m.class_<sg::Decoder>("Decoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t>())
      .def("add_layer", &sg::Decoder::add_layer)
      .def("num_layers", &sg::Decoder::num_layers)
      .def("forward", &sg::Decoder::forward);
  m.def(
      "qmatmul(Tensor x, Tensor[] weights, int[] types, int[] outs, int in_features, Tensor[] biases, "
      "Tensor? norm=None, float eps=0.0, int gated=0, Tensor? residual=None) -> Tensor");
  m.def("repack(Tensor src, int type, int in_features) -> Tensor");
  m.def(
      "rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, int layer, "
      "Tensor slots, int heads, int kv_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.0) -> Tensor");
  m.def(
      "paged_attend(Tensor q, Tensor k_pool, Tensor v_pool, int layer, Tensor kv_slots, int start, "
      "Tensor q_index, Tensor? mask, int t, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("dequantize_rows(Tensor w, int type, int in_features, int rows, Tensor ids) -> Tensor");
  m.def("packed_panel_bytes(int type, int in_features) -> int", &sg::packed_panel_bytes);
  m.def("isa_level() -> int", &sg::isa_level);
  m.def("set_isa_level(int level) -> int", &sg::set_isa_level);
}

TORCH_LIBRARY_IMPL(SG_LIBRARY, CPU, m) {
  m.impl("qmatmul", &sg::qmatmul);
  m.impl("repack", &sg::repack);
  m.impl("rope_store", &sg::rope_store);
  m.impl("paged_attend", &sg::paged_attend);
  m.impl("dequantize_rows", &sg::dequantize_rows);
  m.impl("rms_norm", &sg::rms_norm);
}
