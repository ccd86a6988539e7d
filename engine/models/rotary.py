"""Rotary tables of a compact decoder: cos and sin [max_len, rotary_dim] for every position, computed
once, from the model family's own rotary module (its scaling included) or from the frequencies a
GGUF file states (`rope_freqs.weight`, Llama 3's scaled frequencies).

A family with two rotary bases (Gemma 3: its sliding layers' local base beside the global one) has
two tables; every other family's second table is its first.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

Tables = list[tuple[torch.Tensor, torch.Tensor]]


def _rotary_module(config: Any) -> nn.Module:
    """The model family's own rotary embedding module, from the config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text = config.get_text_config()
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(text)]
    module = sys.modules[model_class.__module__]
    names = [n for n in dir(module) if n.endswith("RotaryEmbedding")]
    if not names:
        raise ValueError(f"no rotary embedding class in {module.__name__}")
    rotary: nn.Module = getattr(module, names[0])(config=text)
    return rotary


def _table(
    rotary: nn.Module, max_len: int, device: torch.device, layer_type: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(max_len, device=device).unsqueeze(0)  # [1, max_len]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    if layer_type is None:
        cos, sin = rotary(probe, positions)  # [1, max_len, rot]
    else:
        cos, sin = rotary(probe, positions, layer_type)
    return cos[0].float(), sin[0].float()


def rotary_tables(config: Any, max_len: int, device: torch.device) -> Tables:
    """[(cos, sin) of the global table, (cos, sin) of the sliding layers' table]."""
    text = config.get_text_config()
    rotary = _rotary_module(config)
    types = sorted(set(getattr(text, "layer_types", None) or []))
    params = getattr(text, "rope_parameters", None) or {}
    per_type = bool(types) and all(t in params for t in types)  # Gemma 3: parameters per layer type
    if not per_type:
        table = _table(rotary, max_len, device, None)
        return [table, table]
    glob = _table(rotary, max_len, device, "full_attention" if "full_attention" in types else types[0])
    local = _table(rotary, max_len, device, "sliding_attention") if "sliding_attention" in types else glob
    return [glob, local]


def tables_from_frequencies(
    inv_freq: torch.Tensor, max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, 2 * len(inv_freq)] of the inverse frequencies `inv_freq` [rot / 2], as the
    Hugging Face rotary modules compute them (fp32 products, the frequencies repeated)."""
    positions = torch.arange(max_len, device=device, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]  # [max_len, rot/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def scaled_frequencies(theta: float, rotary_dim: int, factors: torch.Tensor) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies of base `theta` divided by a GGUF file's per-frequency
    factors (`rope_freqs.weight`: llama.cpp divides each frequency by its factor)."""
    if factors.numel() != rotary_dim // 2:
        raise ValueError(f"rope_freqs has {factors.numel()} factors for {rotary_dim // 2} frequencies")
    base = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    return base / factors.float()
