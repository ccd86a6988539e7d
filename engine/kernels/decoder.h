// A whole decoder stack in one call per step (torch.classes.specgate_gguf.Decoder): the Llama block
// and what the families of engine/models/family.py add to it (QK-norm, sandwich norms, GeGLU,
// partial rotary, sliding windows, a second rotary table).
//
// On a small model a step is a few hundred short kernel calls, and from Python each costs 10-20 us
// of dispatch (argument lists turned into IValues) before it computes anything: more than the
// products themselves. The decoder holds every layer's packed matrices and norms and runs the
// layers back to back here, with the same functions, in the same order, as the per-layer path in
// engine/models/llama.py (RMSNorm, product, QK-norm with rotation and pool stores, attention,
// product, output norm and residual add, RMSNorm, product, gated activation, product, output norm
// and residual add): the two give bit-identical results.

#pragma once

#include <torch/custom_class.h>

#include "attention.h"
#include "quantized_matmul.h"

namespace sg {

struct DecoderLayer {
  Projection qkv, o, gate_up, down;
  at::Tensor input_norm, post_norm;  // float32 [hidden]: before attention, before the MLP
  // Optional (undefined where the family has none): QK-norm weights [head_dim]; the norms of the
  // attention's and the MLP's outputs before their residual adds [hidden] (Gemma's sandwich).
  at::Tensor q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t window = 0;      // sliding window in tokens; 0: global attention
  int64_t rope_table = 0;  // 0: the model's rotary table, 1: its sliding layers' own (Gemma 3)
};

struct Decoder : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim, hidden = -1, intermediate = -1, rotary_dim, activation;
  double eps, scale;
  std::vector<DecoderLayer> layers;

  Decoder(int64_t heads_, int64_t kv_heads_, int64_t head_dim_, double eps_, double scale_, int64_t rotary_dim_,
          int64_t activation_)
      : heads(heads_),
        kv_heads(kv_heads_),
        head_dim(head_dim_),
        rotary_dim(rotary_dim_),
        activation(activation_),
        eps(eps_),
        scale(scale_) {
    TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
                "bad attention shape");
    TORCH_CHECK(rotary_dim > 0 && rotary_dim <= head_dim && rotary_dim % 2 == 0, "bad rotary_dim");
    TORCH_CHECK(activation == ACT_SILU || activation == ACT_GELU_TANH, "unknown activation");
  }

  // One layer's matrices: `counts` says how many of `weights` (and types, outs, biases) belong to
  // qkv, o, gate_up and down, in that order. `norms`: input, post (before the MLP), then q, k,
  // attention output and MLP output norms, each an empty tensor where the family has none.
  void add_layer(std::vector<at::Tensor> weights, std::vector<int64_t> types, std::vector<int64_t> outs,
                 std::vector<int64_t> counts, std::vector<at::Tensor> biases, std::vector<at::Tensor> norms,
                 int64_t hidden_, int64_t intermediate_, int64_t window, int64_t rope_table) {
    TORCH_CHECK(counts.size() == 4, "counts: qkv, o, gate_up, down");
    TORCH_CHECK(norms.size() == 6, "norms: input, post, q, k, attention output, MLP output");
    TORCH_CHECK(hidden < 0 || (hidden == hidden_ && intermediate == intermediate_), "layers differ in size");
    TORCH_CHECK(window >= 0 && (rope_table == 0 || rope_table == 1), "bad window or rotary table");
    hidden = hidden_;
    intermediate = intermediate_;
    int64_t ins[4] = {hidden, heads * head_dim, hidden, intermediate};
    int64_t want[4] = {(heads + 2 * kv_heads) * head_dim, hidden, 2 * intermediate, hidden};
    Projection ps[4];
    size_t at = 0;
    for (int k = 0; k < 4; k++) {
      TORCH_CHECK(counts[k] > 0 && at + counts[k] <= weights.size(), "counts do not match the weights");
      std::vector<at::Tensor> w(weights.begin() + at, weights.begin() + at + counts[k]);
      std::vector<at::Tensor> b(biases.begin() + at, biases.begin() + at + counts[k]);
      std::vector<int64_t> t(types.begin() + at, types.begin() + at + counts[k]);
      std::vector<int64_t> o(outs.begin() + at, outs.begin() + at + counts[k]);
      ps[k] = make_projection(w, t, o, ins[k], b);
      TORCH_CHECK(ps[k].total == want[k], "projection ", k, " has ", ps[k].total, " outputs, not ", want[k]);
      at += counts[k];
    }
    TORCH_CHECK(at == weights.size(), "counts do not match the weights");
    auto norm = [&](const at::Tensor& w, int64_t size, bool required) {
      if (!required && (!w.defined() || w.numel() == 0)) return at::Tensor();
      at::Tensor f = w.to(at::kFloat).contiguous();
      TORCH_CHECK(f.numel() == size, "a norm weight has ", f.numel(), " elements, not ", size);
      return f;
    };
    DecoderLayer L{std::move(ps[0]), std::move(ps[1]), std::move(ps[2]), std::move(ps[3]),
                   norm(norms[0], hidden, true), norm(norms[1], hidden, true)};
    L.q_norm = norm(norms[2], head_dim, false);
    L.k_norm = norm(norms[3], head_dim, false);
    L.attn_out_norm = norm(norms[4], hidden, false);
    L.mlp_out_norm = norm(norms[5], hidden, false);
    L.window = window;
    L.rope_table = rope_table;
    layers.push_back(std::move(L));
  }

  int64_t num_layers() const { return (int64_t)layers.size(); }

  // The residual stream after every layer, [N, hidden] float32, for x [N, hidden] (float32; the
  // final norm is the caller's). cos / sin [N, rotary_dim]: the model's rotary table at each row's
  // position; cos_local / sin_local the same of its sliding layers' table (empty where it has one
  // table); positions [N] each row's position (sliding windows). The attention calls are given as
  // parallel lists (one entry per call, as `AttendCall`): call c writes its rows, picked by
  // out_index[c] (all where empty), to rows out_start[c] .. out_start[c] + out_count[c] of the step.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor cos_local, at::Tensor sin_local,
                     at::Tensor positions, at::Tensor k_pool, at::Tensor v_pool, at::Tensor slots,
                     std::vector<at::Tensor> kv_slots, std::vector<int64_t> starts, std::vector<at::Tensor> q_index,
                     std::vector<at::Tensor> masks, std::vector<int64_t> ts, std::vector<at::Tensor> out_index,
                     std::vector<int64_t> out_start, std::vector<int64_t> out_count) {
    TORCH_CHECK(!layers.empty(), "no layers");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden && x.scalar_type() == at::kFloat, "x must be float [N, hidden]");
    TORCH_CHECK(k_pool.size(0) >= num_layers(), "the pools have fewer layers than the decoder");
    int64_t n = x.size(0), d = head_dim, calls = (int64_t)kv_slots.size();
    TORCH_CHECK(starts.size() == (size_t)calls && q_index.size() == (size_t)calls && masks.size() == (size_t)calls &&
                    ts.size() == (size_t)calls && out_index.size() == (size_t)calls &&
                    out_start.size() == (size_t)calls && out_count.size() == (size_t)calls,
                "one entry per attention call in every list");
    at::Tensor c[2], s[2];
    c[0] = cos.to(at::kFloat).contiguous();
    s[0] = sin.to(at::kFloat).contiguous();
    TORCH_CHECK(rotary_width(c[0], s[0], n, d) == rotary_dim, "cos, sin must be [N, rotary_dim]");
    bool has_local = cos_local.defined() && cos_local.numel() > 0;
    c[1] = has_local ? cos_local.to(at::kFloat).contiguous() : c[0];
    s[1] = has_local ? sin_local.to(at::kFloat).contiguous() : s[0];
    TORCH_CHECK(rotary_width(c[1], s[1], n, d) == rotary_dim, "cos_local, sin_local must be [N, rotary_dim]");
    at::Tensor pos = positions.to(at::kLong).contiguous();
    TORCH_CHECK(pos.numel() == n, "one position per row");
    at::Tensor sl = slots.to(at::kLong).contiguous();
    TORCH_CHECK(sl.numel() == n, "one slot per row");
    Pool p0 = pool_of(k_pool, v_pool, 0);
    TORCH_CHECK(p0.kv_heads == kv_heads && p0.d == d, "the pools' heads or head_dim do not match");
    check_slots(sl.data_ptr<int64_t>(), n, p0);
    std::vector<at::Tensor> keep;
    std::vector<AttendCall> plan;
    std::vector<std::vector<int64_t>> picks(calls);
    int64_t covered = 0;
    for (int64_t k = 0; k < calls; k++) {
      plan.push_back(attend_call(kv_slots[k], starts[k], q_index[k], masks[k], ts[k], n, p0, keep));
      plan.back().pos = pos.data_ptr<int64_t>();
      int64_t rows = plan.back().b * plan.back().t;
      at::Tensor oi = out_index[k].to(at::kLong).contiguous();
      TORCH_CHECK(oi.numel() == 0 ? out_count[k] == rows : oi.numel() == out_count[k], "bad out_index ", k);
      TORCH_CHECK(out_start[k] >= 0 && out_start[k] + out_count[k] <= n, "call ", k, " writes outside the step");
      for (int64_t j = 0; j < out_count[k]; j++) {
        int64_t src = oi.numel() ? oi.data_ptr<int64_t>()[j] : j;
        TORCH_CHECK(src >= 0 && src < rows, "out_index out of range");
        picks[k].push_back(src);
      }
      covered += out_count[k];
    }
    TORCH_CHECK(covered == n, "the attention calls must cover every row of the step once");

    int64_t width = (heads + 2 * kv_heads) * d, hd = heads * d;
    at::Tensor res = x.clone();  // [N, hidden]
    at::Tensor h = at::empty({n, hidden}, at::kFloat), qkv = at::empty({n, width}, at::kFloat);
    at::Tensor q = at::empty({n, heads, d}, at::kFloat), attn = at::empty({n, hd}, at::kFloat);
    at::Tensor proj = at::empty({n, std::max(hidden, 2 * intermediate)}, at::kFloat);
    at::Tensor act = at::empty({n, intermediate}, at::kFloat);
    std::vector<at::Tensor> parts;
    for (auto& pc : plan) parts.push_back(at::empty({pc.b * pc.t, heads, d}, at::kFloat));
    float *rp = res.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
    float *qp = q.data_ptr<float>(), *ap = attn.data_ptr<float>(), *pp = proj.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    Scratch scratch;
    int64_t nres = n * hidden;
    for (int64_t l = 0; l < num_layers(); l++) {
      DecoderLayer& L = layers[l];
      Pool p = pool_of(k_pool, v_pool, l);
      rms_norm_rows(rp, n, hidden, L.input_norm.data_ptr<float>(), eps, hp);
      project(L.qkv, hp, n, qkvp, scratch);
      int64_t t = L.rope_table;
      rope_core(qkvp, n, heads, kv_heads, c[t].data_ptr<float>(), s[t].data_ptr<float>(), rotary_dim, p,
                sl.data_ptr<int64_t>(), qp, data_or_null(L.q_norm), data_or_null(L.k_norm), eps);
      for (int64_t k = 0; k < calls; k++) {
        float* part = parts[k].data_ptr<float>();
        AttendCall call = plan[k];
        call.window = L.window;
        attend_core(qp, heads, p, call, (float)scale, part);
        for (int64_t j = 0; j < out_count[k]; j++)
          std::memcpy(ap + (out_start[k] + j) * hd, part + picks[k][j] * hd, hd * sizeof(float));
      }
      project(L.o, ap, n, pp, scratch);
      if (L.attn_out_norm.defined()) rms_norm_rows(pp, n, hidden, L.attn_out_norm.data_ptr<float>(), eps, pp);
      for (int64_t i = 0; i < nres; i++) rp[i] = pp[i] + rp[i];
      rms_norm_rows(rp, n, hidden, L.post_norm.data_ptr<float>(), eps, hp);
      project(L.gate_up, hp, n, pp, scratch);
      gated_rows(pp, n, intermediate, actp, activation);
      project(L.down, actp, n, pp, scratch);
      if (L.mlp_out_norm.defined()) rms_norm_rows(pp, n, hidden, L.mlp_out_norm.data_ptr<float>(), eps, pp);
      for (int64_t i = 0; i < nres; i++) rp[i] = pp[i] + rp[i];
    }
    return res;
  }
};

}  // namespace sg
