"""The compact decoder built straight from a GGUF file of a family it covers (models/family.py), its
weights left quantized.

Every projection and the LM head run on the native kernels at the file's own bytes per weight
(engine/models/quantized.py); the embedding table stays quantized too and only the rows of the
step's tokens are dequantized. Float matrices (some files keep the output head in F16) become
dense layers. Nothing of the Hugging Face model is loaded but its configuration and its rotary
embedding, built from that configuration. Tensor names are llama.cpp's: Phi-3 files hold fused
qkv and gate/up matrices (the decoder's own fused forms); Gemma files store their norms as the
multipliers (1 + w of the Hugging Face module), which is what the decoder applies.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from specgate.engine.cpu_linear import PackedLinear
from specgate.engine.models.family import GLOBAL, family_of
from specgate.engine.models.gguf_weights import GGUFWeights
from specgate.engine.models.llama import CompactCausalLM, CompactLayer
from specgate.engine.models.quantized import GGUFEmbedding, GGUFLinear, QuantizedMatrix, SideBySide
from specgate.engine.models.rotary import rotary_tables, scaled_frequencies, tables_from_frequencies

logger = logging.getLogger(__name__)


def _layer(
    parts: list[QuantizedMatrix | torch.Tensor],
    biases: list[torch.Tensor | None],
    dtype: torch.dtype,
    pack: bool,
) -> nn.Module:
    if all(isinstance(p, QuantizedMatrix) for p in parts):
        return GGUFLinear([p for p in parts if isinstance(p, QuantizedMatrix)], biases)
    modules: list[nn.Module] = []
    for p, b in zip(parts, biases, strict=True):
        if isinstance(p, QuantizedMatrix):
            modules.append(GGUFLinear([p], [b]))
            continue
        dense = nn.Linear(p.shape[1], p.shape[0], bias=b is not None, dtype=dtype)
        with torch.no_grad():
            dense.weight.copy_(p)
            if b is not None and dense.bias is not None:
                dense.bias.copy_(b)
        dense.requires_grad_(False)
        modules.append(PackedLinear([dense]) if pack else dense)
    return modules[0] if len(modules) == 1 else SideBySide(modules)


def build_gguf_model(
    w: GGUFWeights,
    config: Any,
    dtype: torch.dtype,
    pack: bool,
    max_len: int,
    generation_config: Any = None,
) -> CompactCausalLM:
    family = family_of(config)
    heads, kv_heads = family.heads, family.kv_heads

    def bias(name: str, heads_permuted: int | None = None) -> torch.Tensor | None:
        if not w.has(name):
            return None
        b = w.vector(name)
        if heads_permuted is not None and w.architecture in ("llama", "mistral"):
            from specgate.engine.models.gguf_weights import unpermute_rows

            b = b[torch.from_numpy(unpermute_rows(b.numel(), heads_permuted))]
        return b

    def norm(name: str) -> torch.Tensor | None:
        return w.vector(name) if w.has(name) else None

    layers = []
    for i in range(family.num_layers):
        p = f"blk.{i}."
        if w.has(p + "attn_qkv.weight"):  # Phi-3: q, k and v rows in one matrix, in that order
            qkv = _layer([w.matrix(p + "attn_qkv.weight")], [bias(p + "attn_qkv.bias")], dtype, pack)
        else:
            q = w.matrix(p + "attn_q.weight", heads)
            k = w.matrix(p + "attn_k.weight", kv_heads)
            v = w.matrix(p + "attn_v.weight")
            qkv_bias = [
                bias(p + "attn_q.bias", heads),
                bias(p + "attn_k.bias", kv_heads),
                bias(p + "attn_v.bias"),
            ]
            qkv = _layer([q, k, v], qkv_bias, dtype, pack)
        if w.has(p + "ffn_gate.weight"):
            parts = [w.matrix(p + "ffn_gate.weight"), w.matrix(p + "ffn_up.weight")]
        else:  # Phi-3: ffn_up holds the gate's rows, then the up projection's
            parts = [w.matrix(p + "ffn_up.weight")]
        rows = sum(m.rows if isinstance(m, QuantizedMatrix) else int(m.shape[0]) for m in parts)
        sandwich = family.sandwich_norms
        layers.append(
            CompactLayer(
                qkv,
                _layer([w.matrix(p + "attn_output.weight")], [bias(p + "attn_output.bias")], dtype, pack),
                _layer(parts, [None] * len(parts), dtype, pack),
                _layer([w.matrix(p + "ffn_down.weight")], [None], dtype, pack),
                w.vector(p + "attn_norm.weight").to(dtype),
                w.vector(p + "ffn_norm.weight").to(dtype),
                rows // 2,
                norm(p + "attn_q_norm.weight") if family.qk_norm else None,
                norm(p + "attn_k_norm.weight") if family.qk_norm else None,
                w.vector(p + "post_attention_norm.weight").to(dtype) if sandwich else None,
                w.vector(p + "post_ffw_norm.weight").to(dtype) if sandwich else None,
            )
        )
    table = w.matrix("token_embd.weight")
    embed: nn.Module
    if isinstance(table, QuantizedMatrix):
        embed = GGUFEmbedding(table, dtype)
    else:
        embed = nn.Embedding(table.shape[0], table.shape[1], _weight=table.to(dtype), _freeze=True)
    head = w.matrix("output.weight") if w.has("output.weight") else table  # tied: the same blocks
    lm_head = _layer([head], [None], dtype, pack)
    out_norm = w.vector("output_norm.weight").to(dtype)
    tables = rotary_tables(config, max_len, out_norm.device)
    if w.has("rope_freqs.weight"):  # Llama 3: the file's scaled frequencies decide the global table
        c = config.get_text_config()
        params = getattr(c, "rope_parameters", None) or {}
        theta = float(params.get("rope_theta", None) or getattr(c, "rope_theta", None) or 10000.0)
        freqs = scaled_frequencies(theta, family.rotary_dim, w.vector("rope_freqs.weight"))
        glob = tables_from_frequencies(freqs, max_len, out_norm.device)
        tables = [glob, tables[1] if any(t != GLOBAL for t in family.rope_tables) else glob]
    model = CompactCausalLM(config, embed, layers, out_norm, lm_head, tables, max_len, generation_config)
    total = sum(w.loaded_bytes.values())
    logger.info(
        "GGUF weights served at their own bytes: %.0f MB (%s)",
        total / 1e6,
        ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in w.loaded_bytes.most_common()),
    )
    return model
