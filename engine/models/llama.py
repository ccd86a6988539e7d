"""A compact decoder for the Llama family (Llama, Qwen2, Mistral), built from the loaded HF weights.

The Hugging Face module tree spends most of a CPU decode step on Python dispatch: hooks, generic
attention plumbing, per-layer rotary recomputation, cache bookkeeping. This model does the same math
in few ops: one fused qkv and one fused gate/up projection per layer (dense, int8 or int4), rotary
tables computed once, one rotary application to queries and keys together, and attention straight
into the paged pool. Positions are per token and attention masks come from the metadata, so decode,
verification, chunked prefill and token trees run on it alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from specgate.engine.attention import AttentionMetadata, native_calls, native_paged_attention, paged_attention
from specgate.engine.cpu_linear import concat_linears
from specgate.engine.models.linear import make_linear

# model_type values whose HF layers are the plain Llama block (Qwen2 adds a qkv bias, read as it is).
COMPACT_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
# Precision order of the linear modes: fused siblings take the most precise of their members'.
_PRECISION = {"none": 2, "int8": 1, "int4": 0}

ModePlan = Callable[[str], str]  # HF parameter name -> linear mode (none, int8, int4)
# attend(layer, query [heads, n, d], key [kv_heads, n, d], value [kv_heads, n, d]) -> [n, heads, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def compact_supported(config: Any) -> bool:
    c = config.get_text_config()
    return (
        getattr(c, "model_type", None) in COMPACT_MODEL_TYPES
        and getattr(c, "hidden_act", "silu") == "silu"
        and (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default") != "dynamic"
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (torch's one op; transformers' five differ from it by bf16 rounding at most)."""
    return torch.rms_norm(x, weight.shape, weight, eps)


def _fuse(
    parent: Any, prefix: str, names: tuple[str, ...], plan: ModePlan, dtype: torch.dtype, pack: bool
) -> nn.Module:
    weight, bias = concat_linears([getattr(parent, n) for n in names])  # [sum of out, in]
    mode = max((plan(f"{prefix}.{n}.weight") for n in names), key=_PRECISION.__getitem__)
    return make_linear(weight, bias, mode, dtype, pack)


class CompactLayer(nn.Module):
    """One decoder block's operands: fused projections and the two norms' weights."""

    def __init__(
        self,
        qkv: nn.Module,
        o: nn.Module,
        gate_up: nn.Module,
        down: nn.Module,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        intermediate: int,
    ) -> None:
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.input_norm = nn.Parameter(input_norm, requires_grad=False)
        self.post_norm = nn.Parameter(post_norm, requires_grad=False)
        self.intermediate = intermediate

    @classmethod
    def from_hf(
        cls, hf_layer: Any, prefix: str, plan: ModePlan, dtype: torch.dtype, pack: bool
    ) -> CompactLayer:
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        return cls(
            _fuse(attn, f"{prefix}.self_attn", ("q_proj", "k_proj", "v_proj"), plan, dtype, pack),
            _fuse(attn, f"{prefix}.self_attn", ("o_proj",), plan, dtype, pack),
            _fuse(mlp, f"{prefix}.mlp", ("gate_proj", "up_proj"), plan, dtype, pack),
            _fuse(mlp, f"{prefix}.mlp", ("down_proj",), plan, dtype, pack),
            hf_layer.input_layernorm.weight.detach().to(dtype),
            hf_layer.post_attention_layernorm.weight.detach().to(dtype),
            mlp.gate_proj.out_features,
        )


class CompactCausalLM(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        config: Any,
        embed: nn.Module,
        layers: list[CompactLayer],
        norm: torch.Tensor,
        lm_head: nn.Module,
        rotary: nn.Module,
        max_len: int,
        generation_config: Any = None,
    ) -> None:
        """From its parts (`from_hf` and models/gguf_model.py make them); `rotary`: the model's own
        rotary embedding module, whose tables (scaling included) are computed once here."""
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        c = config.get_text_config()
        self.heads = c.num_attention_heads
        self.kv_heads = getattr(c, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self.eps = float(c.rms_norm_eps)
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self._layers = layers  # typed: ModuleList items are plain nn.Modules to mypy
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.bind_layers()
        cos, sin = _rotary_tables(rotary, max_len, norm.device)
        # rotate_half(x) * sin == roll(x, half) * sin_signed: one roll instead of slices, neg and cat.
        half = self.head_dim // 2
        sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
        self.register_buffer("cos", cos, persistent=False)  # [max_len, head_dim] fp32
        self.register_buffer("sin", sin_signed, persistent=False)

    @classmethod
    def from_hf(
        cls, hf_model: Any, plan: ModePlan, dtype: torch.dtype, pack: bool, max_len: int
    ) -> CompactCausalLM:
        """From a loaded Hugging Face model, whose weights it copies (dense, int8 or int4 by `plan`)."""
        decoder = hf_model.get_decoder()
        embed = hf_model.get_input_embeddings()
        weight = embed.weight.detach().to(dtype)  # [vocab, hidden]
        embed_tokens = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        layers = [
            CompactLayer.from_hf(layer, f"model.layers.{i}", plan, dtype, pack)
            for i, layer in enumerate(decoder.layers)
        ]
        head = hf_model.get_output_embeddings()
        lm_head = make_linear(head.weight.detach(), head.bias, plan("lm_head.weight"), dtype, pack)
        norm = decoder.norm.weight.detach().to(dtype)
        generation = getattr(hf_model, "generation_config", None)
        return cls(
            hf_model.config, embed_tokens, layers, norm, lm_head, decoder.rotary_emb, max_len, generation
        )

    def bind_layers(self) -> None:
        """The per-layer operands as plain tuples: the forward loop then pays no nn.Module attribute
        lookups or __call__ hooks (thousands per step on a 30-layer model). Call again after
        replacing a layer's module. Where every projection runs on the GGUF kernels, the norms,
        the SwiGLU and the residual adds are done inside their calls (`fused`)."""
        from specgate.engine.models.quantized import GGUFLinear

        self.fused = all(
            isinstance(m, GGUFLinear)
            for layer in self._layers
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        self._plan = [
            (
                layer.qkv.forward,
                layer.o.forward,
                layer.gate_up.forward,
                layer.down.forward,
                layer.input_norm,
                layer.post_norm,
                layer.intermediate,
            )
            for layer in self._layers
        ]
        self._decoder = self._native_decoder() if self.fused else None

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        logit_index: torch.Tensor,  # [num_logits] packed rows whose logits are wanted
        want_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [num_logits, vocab] and, if asked, the final-norm hidden states [num_tokens, hidden]."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return paged_attention(meta, layer, q, k, v, self.scale)

        if self.fused and not meta.tiles and input_ids.device.type == "cpu":
            hidden = self._native_hidden_states(input_ids, positions, meta)
        else:
            hidden = self.hidden_states(
                input_ids, positions, attend, meta.compute_dtype
            )  # [num_tokens, hidden]
        logits = self.lm_head(hidden.index_select(0, logit_index))  # [num_logits, vocab]
        return logits, (hidden if want_hidden else None)

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        attend: Attend,
        compute: torch.dtype,
    ) -> torch.Tensor:
        """The final-norm hidden states [num_tokens, hidden]; `attend(layer, q, k, v)` stores a layer's
        keys and values and returns its attention output [num_tokens, heads, head_dim]. Plain code
        with no data-dependent control flow, so torch.compile traces it into one graph."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.fused:
            return self._fused_hidden_states(x, positions, attend, compute)
        dtype = x.dtype
        # Queries and keys are rotated in attention's compute dtype (fp32 on CPU): one cast of the
        # fused qkv per layer, and the keys and values go into the pool without another.
        cos = self.cos[positions].to(compute).unsqueeze(0)  # [1, num_tokens, head_dim]
        sin = self.sin[positions].to(compute).unsqueeze(0)
        n, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        residual = x
        eps = self.eps
        for i, (qkv_proj, o_proj, gate_up_proj, down_proj, input_norm, post_norm, m) in enumerate(self._plan):
            hs = rms_norm(residual, input_norm, eps)
            qkv = qkv_proj(hs).to(compute).view(n, h + 2 * kv, d).transpose(0, 1)  # [h + 2kv, num_tokens, d]
            qk = qkv[: h + kv]
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin  # rotary on queries and keys at once
            attn = attend(i, qk[:h], qk[h:], qkv[h + kv :])  # [num_tokens, h, d]
            residual = residual + o_proj(attn.reshape(n, h * d).to(dtype))
            hs = rms_norm(residual, post_norm, eps)
            gate_up = gate_up_proj(hs)  # [num_tokens, 2 * intermediate]
            residual = residual + down_proj(F.silu(gate_up[:, :m]) * gate_up[:, m:])
        return rms_norm(residual, self.norm, eps)

    def _fused_hidden_states(
        self, x: torch.Tensor, positions: torch.Tensor, attend: Attend, compute: torch.dtype
    ) -> torch.Tensor:
        """`hidden_states` with each projection's norm, SwiGLU and residual add in its kernel call."""
        dtype = x.dtype
        cos = self.cos[positions].to(compute).unsqueeze(0)  # [1, num_tokens, head_dim]
        sin = self.sin[positions].to(compute).unsqueeze(0)
        n, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        residual, eps = x, self.eps
        for i, (qkv_proj, o_proj, gate_up_proj, down_proj, input_norm, post_norm, _m) in enumerate(
            self._plan
        ):
            qkv = qkv_proj(residual, input_norm, eps).to(compute).view(n, h + 2 * kv, d).transpose(0, 1)
            qk = qkv[: h + kv]
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
            attn = attend(i, qk[:h], qk[h:], qkv[h + kv :])  # [num_tokens, h, d]
            residual = o_proj(attn.reshape(n, h * d).to(dtype), residual=residual)
            gate_up = gate_up_proj(residual, post_norm, eps)  # [num_tokens, 2 * intermediate]
            residual = down_proj(gate_up, gated=True, residual=residual)
        return rms_norm(residual, self.norm, eps)

    def _native_decoder(self) -> Any:
        """The whole layer stack as one native object (engine/kernels/decoder.h), over the same packed
        matrices and norms: a step's layers then cost one call from Python instead of hundreds."""
        from specgate.engine.kernels.extension import NAMESPACE
        from specgate.engine.models.quantized import GGUFLinear

        decoder = getattr(torch.classes, NAMESPACE).Decoder(
            self.heads, self.kv_heads, self.head_dim, self.eps, self.scale
        )
        for layer in self._layers:
            mods = [cast(GGUFLinear, m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            decoder.add_layer(
                [w for m in mods for w in m._weights],
                [t for m in mods for t in m._types],
                [o for m in mods for o in m._outs],
                [len(m._weights) for m in mods],
                [b for m in mods for b in m._biases],
                layer.input_norm.detach(),
                layer.post_norm.detach(),
                mods[0].in_features,
                layer.intermediate,
            )
        return decoder

    def _native_hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """`hidden_states` on the native kernels end to end: each projection with its norm, SwiGLU or
        residual add, the rotation with the pool stores, and attention (engine/kernels/)."""
        from specgate.engine.kernels.extension import ops

        native = ops()
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        dtype = x.dtype
        cos, sin = self.cos[positions], self.sin[positions]  # [num_tokens, head_dim] fp32
        n, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        cache, slots = meta.kv_cache, meta.slot_mapping
        residual, eps = x, self.eps
        decoder = self._decoder
        if decoder is not None and dtype == torch.float32:  # bit-identical to the loop below, in one call
            residual = decoder.forward(x, cos, sin, cache.k, cache.v, slots, *native_calls(meta))
            return rms_norm(residual, self.norm, eps)
        for i, (qkv_proj, o_proj, gate_up_proj, down_proj, input_norm, post_norm, _m) in enumerate(
            self._plan
        ):
            qkv = qkv_proj(residual, input_norm, eps)  # [num_tokens, (h + 2 kv) d]
            q = native.rope_store(qkv, cos, sin, cache.k, cache.v, i, slots, h, kv)  # [num_tokens, h, d]
            attn = native_paged_attention(meta, i, q, self.scale, native)  # [num_tokens, h, d] fp32
            residual = o_proj(attn.view(n, h * d).to(dtype), residual=residual)
            gate_up = gate_up_proj(residual, post_norm, eps)  # [num_tokens, 2 * intermediate]
            residual = down_proj(gate_up, gated=True, residual=residual)
        return rms_norm(residual, self.norm, eps)


def _rotary_tables(
    rotary: nn.Module, max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] in fp32, from the model's own rotary module (its scaling included)."""
    positions = torch.arange(max_len, device=device).unsqueeze(0)  # [1, max_len]
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rotary(probe, positions)  # [1, max_len, head_dim]
    return cos[0].float(), sin[0].float()
