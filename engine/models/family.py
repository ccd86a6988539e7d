"""What a decoder family's layers do beyond the Llama block, read from its configuration.

The compact decoder (models/llama.py) and the native one-call decoder (kernels/decoder.h) run one
block shape, generalized over what the common small-model families differ in:

- Llama, Mistral, Qwen2: the plain block (Qwen2 adds a qkv bias, read as it is);
- Qwen3: RMSNorm over each head of the queries and keys before rotation (QK-norm);
- Gemma 3: QK-norm, a norm after attention and after the MLP too ("sandwich" norms), GeGLU with
  tanh GELU, embeddings scaled by sqrt(hidden), attention scaled by query_pre_attn_scalar,
  interleaved sliding-window and global layers with their own rotary bases;
- Phi-3: fused qkv and gate/up tensors (the fused forms are what the decoder runs anyway) and,
  where the config says so, partial rotary;
- Mistral, Phi-3, Qwen2 / Qwen3 with use_sliding_window: a sliding window on every (or the
  config's) layer.

What the decoder does not cover (softcapped logits, dynamic or LongRoPE rotary, biased norms,
parallel blocks, ...) keeps the Hugging Face modules; `unsupported` says why, for the start-up line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# model_type -> the family's name in this module (gemma3 GGUF files load as gemma3_text).
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# Rotary types whose tables depend only on the position (computed once for every position).
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})
GLOBAL, LOCAL = 0, 1  # rotary table of a layer: the model's own, or its sliding layers' own


@dataclass(slots=True, frozen=True)
class Family:
    model_type: str
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that are rotated (head_dim unless partial rotary)
    qk_norm: bool
    sandwich_norms: bool  # norms after attention and after the MLP, before the residual adds
    norm_offset: float  # Hugging Face keeps Gemma norm weights as w - 1 (its modules use 1 + w)
    embed_scale: float | None
    activation: str  # "silu" or "gelu_tanh" (the gate's activation in act(gate) * up)
    scale: float  # attention's score scale
    windows: tuple[int, ...]  # per layer: sliding window in tokens (key visible if q - k < w), 0 = none
    rope_tables: tuple[int, ...]  # per layer: GLOBAL or LOCAL

    def __post_init__(self) -> None:
        if self.heads <= 0 or self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError("heads must be a positive multiple of kv_heads")
        if self.head_dim <= 0 or self.head_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError("head_dim must be even and rotary_dim in 1..head_dim")
        if self.rotary_dim % 2:
            raise ValueError("rotary_dim must be even")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation {self.activation!r}")
        if len(self.windows) != len(self.rope_tables) or any(w < 0 for w in self.windows):
            raise ValueError("one non-negative window and one rotary table per layer")
        if any(t not in (GLOBAL, LOCAL) for t in self.rope_tables):
            raise ValueError("rope_tables are GLOBAL or LOCAL")

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def sliding(self) -> bool:
        return any(self.windows)


def unsupported(config: Any) -> str | None:
    """Why the compact decoder cannot run this configuration, or None where it can."""
    c = config.get_text_config()
    model_type = getattr(c, "model_type", None)
    if model_type not in FAMILIES:
        return f"the {model_type!r} architecture is not one the compact decoder covers"
    act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        return f"the {act!r} activation is not one the compact decoder covers"
    for params in _rope_parameters(c).values():
        kind = (params or {}).get("rope_type", "default")
        if kind not in _STATIC_ROPE:
            return f"{kind!r} rotary scaling changes with the sequence length"
    if getattr(c, "final_logit_softcapping", None) or getattr(c, "attn_logit_softcapping", None):
        return "softcapped logits are not covered"
    if getattr(c, "use_bidirectional_attention", False):
        return "bidirectional attention is not covered"
    if getattr(c, "mlp_bias", False):
        return "MLP biases are not covered"
    if model_type == "llama" and getattr(c, "attention_bias", False):
        return "Llama attention biases are not covered"
    return None


def _rope_parameters(c: Any) -> dict[str, Any]:
    """The config's rotary parameters by layer type ({"": params} where one set serves all)."""
    params = getattr(c, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        return dict(params)
    return {"": params}


def layer_windows(c: Any) -> tuple[int, ...]:
    n = int(c.num_hidden_layers)
    window = int(getattr(c, "sliding_window", None) or 0)
    types = getattr(c, "layer_types", None)
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if getattr(c, "use_sliding_window", True) is False:
        return (0,) * n
    return (window,) * n


def family_of(config: Any) -> Family:
    """The family description of a configuration `unsupported` accepts."""
    reason = unsupported(config)
    if reason is not None:
        raise ValueError(reason)
    c = config.get_text_config()
    model_type = FAMILIES[c.model_type]
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
    partial = float(_rope_parameters(c).get("", {}).get("partial_rotary_factor", None) or 1.0)
    partial = float(getattr(c, "partial_rotary_factor", None) or partial)
    rotary_dim = int(head_dim * partial)
    windows = layer_windows(c)
    gemma = model_type == "gemma3"
    act = str(getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", "silu"))
    scalar = getattr(c, "query_pre_attn_scalar", None) if gemma else None
    types = getattr(c, "layer_types", None) or ["full_attention"] * len(windows)
    local = gemma and "sliding_attention" in _rope_parameters(c)
    return Family(
        model_type=model_type,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        qk_norm=model_type in ("qwen3", "gemma3"),
        sandwich_norms=gemma,
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=math.sqrt(c.hidden_size) if gemma else None,
        activation=ACTIVATIONS[act],
        scale=float(scalar if scalar else head_dim) ** -0.5,
        windows=windows,
        rope_tables=tuple(LOCAL if local and t == "sliding_attention" else GLOBAL for t in types),
    )
