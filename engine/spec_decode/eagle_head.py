"""The EAGLE draft head (arXiv 2401.15077): one Llama decoder layer over fused token + feature inputs.

At head position i it reads the embedding of token x_{i+1} and the target's feature f_i (its
final hidden state at position i), fuses them with `fc`, and predicts the next feature f_{i+1};
the target's own LM head turns that into draft logits. Module names follow the published EAGLE-1 /
EAGLE-2 checkpoints (`fc`, `layers.0.self_attn.q_proj`, ...; layer 0 has no input norm), so
their weights load as they are. The embeddings and LM head are the target's, never copied.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    bias: bool = True  # fc bias (EAGLE-1 and -2 heads have one)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for name in ("hidden_size", "intermediate_size", "vocab_size", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EagleConfig:
        scaling = d.get("rope_scaling")
        if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
            raise ValueError(f"EAGLE head uses rope_scaling {scaling}; only default RoPE is supported")
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            vocab_size=int(d["vocab_size"]),
            head_dim=int(d.get("head_dim") or 0),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            bias=bool(d.get("bias", True)),
            attention_bias=bool(d.get("attention_bias", False)),
        )

    @classmethod
    def for_target(cls, text_config: Any) -> EagleConfig:
        """A head shaped like one layer of the target (what `specgate eagle train` builds)."""
        d = text_config.to_dict()
        d["rope_theta"] = getattr(text_config, "rope_theta", None) or d.get("rope_parameters", {}).get(
            "rope_theta", 10000.0
        )
        d.pop("rope_scaling", None)
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        # The published format: a Llama config with one layer.
        return {"architectures": ["EagleHead"], "model_type": "llama", "num_hidden_layers": 1, **asdict(self)}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, Hugging Face's rotate-half layout. x: [..., t, d]; positions: [t]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))  # [d/2]
    angles = positions.float().unsqueeze(-1) * inv  # [t, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)  # [t, d]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,  # [t, s] bool over all keys; None: causal
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        c = self.c
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)  # [b, H, t, d]
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)  # [b, KV, t, d]
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # [b, KV, s, d]
        s = k.shape[2]
        groups = c.num_attention_heads // c.num_key_value_heads
        kr, vr = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [b, H, s, d]
        if mask is None:  # query j sits at key index s - t + j and sees every key up to it
            mask = torch.arange(s, device=x.device).view(1, s) <= torch.arange(
                s - t, s, device=x.device
            ).view(t, 1)
        out = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)  # [b, H, t, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """A Llama decoder layer without the input norm (EAGLE's layer 0: `fc`'s output goes in as is)."""

    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn, kv = self.self_attn(x, positions, past, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class EagleHead(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=c.bias)
        self.layers = nn.ModuleList([DecoderLayer(c)])
        # Optional: the token ids drafts are chosen from (the most frequent in the training answers).
        # Scoring only those rows of the LM head makes a draft token several times cheaper on a
        # large vocabulary; tokens outside it are never drafted, which verification tolerates.
        self.draft_vocab: torch.Tensor | None = None

    def forward(
        self,
        embeds: torch.Tensor,  # [b, t, hidden] embeddings of tokens x_{i+1}
        features: torch.Tensor,  # [b, t, hidden] target (or predicted) features f_i
        positions: torch.Tensor,  # [t] head positions i
        past: tuple[torch.Tensor, torch.Tensor] | None = None,  # keys / values [b, KV, s, d] before them
        mask: torch.Tensor | None = None,  # [t, s + t] bool: the keys each input sees (a draft tree's)
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Predicted features f_{i+1} [b, t, hidden], and the keys / values with these positions added."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        out: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = self.layers[0](x, positions, past, mask)
        return out
