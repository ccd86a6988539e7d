"""The compact decoder built straight from a Llama-family GGUF file, its weights left quantized.

Every projection and the LM head run on the native kernels at the file's own bytes per weight
(engine/models/quantized.py); the embedding table stays quantized too and only the rows of the
step's tokens are dequantized. Float matrices (some files keep the output head in F16) become
dense layers. Nothing of the Hugging Face model is loaded but its configuration and its rotary
embedding, built from that configuration.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from specgate.engine.cpu_linear import PackedLinear
from specgate.engine.loader import ModelSource
from specgate.engine.models.gguf_weights import GGUFWeights
from specgate.engine.models.llama import CompactCausalLM, CompactLayer
from specgate.engine.models.quantized import GGUFEmbedding, GGUFLinear, QuantizedMatrix, SideBySide

logger = logging.getLogger(__name__)


def rotary_embedding(config: Any) -> nn.Module:
    """The model family's own rotary embedding module (its scaling included), from the config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    module = sys.modules[model_class.__module__]
    names = [n for n in dir(module) if n.endswith("RotaryEmbedding")]
    if not names:
        raise ValueError(f"no rotary embedding class in {module.__name__}")
    rotary: nn.Module = getattr(module, names[0])(config=config.get_text_config())
    return rotary


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
    source: ModelSource,
    config: Any,
    dtype: torch.dtype,
    pack: bool,
    max_len: int,
    generation_config: Any = None,
) -> tuple[CompactCausalLM, GGUFWeights]:
    assert source.gguf_file is not None
    w = GGUFWeights.open(source.directory / source.gguf_file)
    c = config.get_text_config()
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads

    def bias(name: str, heads_permuted: int | None = None) -> torch.Tensor | None:
        if not w.has(name):
            return None
        b = w.vector(name)
        if heads_permuted is not None and w.architecture in ("llama", "mistral"):
            from specgate.engine.models.gguf_weights import unpermute_rows

            b = b[torch.from_numpy(unpermute_rows(b.numel(), heads_permuted))]
        return b

    layers = []
    for i in range(c.num_hidden_layers):
        p = f"blk.{i}."
        q = w.matrix(p + "attn_q.weight", heads)
        k = w.matrix(p + "attn_k.weight", kv_heads)
        v = w.matrix(p + "attn_v.weight")
        qkv_bias = [
            bias(p + "attn_q.bias", heads),
            bias(p + "attn_k.bias", kv_heads),
            bias(p + "attn_v.bias"),
        ]
        gate, up = w.matrix(p + "ffn_gate.weight"), w.matrix(p + "ffn_up.weight")
        intermediate = gate.rows if isinstance(gate, QuantizedMatrix) else int(gate.shape[0])
        layers.append(
            CompactLayer(
                _layer([q, k, v], qkv_bias, dtype, pack),
                _layer([w.matrix(p + "attn_output.weight")], [bias(p + "attn_output.bias")], dtype, pack),
                _layer([gate, up], [None, None], dtype, pack),
                _layer([w.matrix(p + "ffn_down.weight")], [None], dtype, pack),
                w.vector(p + "attn_norm.weight").to(dtype),
                w.vector(p + "ffn_norm.weight").to(dtype),
                intermediate,
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
    norm = w.vector("output_norm.weight").to(dtype)
    model = CompactCausalLM(
        config, embed, layers, norm, lm_head, rotary_embedding(config), max_len, generation_config
    )
    total = sum(w.loaded_bytes.values())
    logger.info(
        "GGUF weights served at their own bytes: %.0f MB (%s)",
        total / 1e6,
        ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in w.loaded_bytes.most_common()),
    )
    return model, w
