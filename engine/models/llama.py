"""A compact decoder for the Llama block and the families that extend it (models/family.py: Llama,
Mistral, Qwen2, Qwen3, Gemma 3, Phi-3), built from the loaded HF weights or a GGUF file's blocks.

The Hugging Face module tree spends most of a CPU decode step on Python dispatch: hooks, generic
attention plumbing, per-layer rotary recomputation, cache bookkeeping. This model does the same math
in few ops: one fused qkv and one fused gate/up projection per layer (dense, int8 or int4), rotary
tables computed once, one rotary application to queries and keys together, and attention straight
into the paged pool. Positions are per token and attention masks come from the metadata, so decode,
verification, chunked prefill and token trees run on it alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from specgate.engine.attention import (
    AttentionMetadata,
    native_calls,
    native_paged_attention,
    paged_attention,
    windowed,
)
from specgate.engine.cpu_linear import concat_linears
from specgate.engine.models.family import LOCAL, Family, family_of, unsupported
from specgate.engine.models.linear import make_linear

_PRECISION = {"none": 2, "int8": 1, "int4": 0}  # fused siblings take the most precise member's mode
_ACTIVATION_CODES = {"silu": 1, "gelu_tanh": 2}  # layer_math.h `Activation`

ModePlan = Callable[[str], str]  # HF parameter name -> linear mode (none, int8, int4)
# attend(layer, query [heads, n, d], key [kv_heads, n, d], value [kv_heads, n, d]) -> [n, heads, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def compact_supported(config: Any) -> bool:
    return unsupported(config) is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (torch's one op; transformers' five differ from it by bf16 rounding at most)."""
    return torch.rms_norm(x, weight.shape, weight, eps)


def _fuse(
    parent: Any, prefix: str, names: tuple[str, ...], plan: ModePlan, dtype: torch.dtype, pack: bool
) -> nn.Module:
    weight, bias = concat_linears([getattr(parent, n) for n in names])  # [sum of out, in]
    mode = max((plan(f"{prefix}.{n}.weight") for n in names), key=_PRECISION.__getitem__)
    return make_linear(weight, bias, mode, dtype, pack)


def _optional(weight: torch.Tensor | None) -> nn.Parameter | None:
    return None if weight is None else nn.Parameter(weight, requires_grad=False)


class CompactLayer(nn.Module):
    """One decoder block's operands: fused projections and its norms' weights (RMSNorm multipliers:
    a Gemma module's 1 + w). `input_norm` comes before attention, `post_norm` before the MLP; the
    optional ones are the family's QK-norms [head_dim] and its norms of the attention's and the MLP's
    outputs [hidden] (Gemma's sandwich)."""

    def __init__(
        self,
        qkv: nn.Module,
        o: nn.Module,
        gate_up: nn.Module,
        down: nn.Module,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        intermediate: int,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        attn_out_norm: torch.Tensor | None = None,
        mlp_out_norm: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.input_norm = nn.Parameter(input_norm, requires_grad=False)
        self.post_norm = nn.Parameter(post_norm, requires_grad=False)
        self.q_norm, self.k_norm = _optional(q_norm), _optional(k_norm)
        self.attn_out_norm, self.mlp_out_norm = _optional(attn_out_norm), _optional(mlp_out_norm)
        self.intermediate = intermediate

    @classmethod
    def from_hf(
        cls, hf_layer: Any, prefix: str, plan: ModePlan, dtype: torch.dtype, pack: bool, family: Family
    ) -> CompactLayer:
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        qkv_names = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
        gate_up_names = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
        offset = family.norm_offset

        def norm(module: Any) -> torch.Tensor:
            weight: torch.Tensor = module.weight.detach().float()
            return (weight + offset).to(dtype)

        def head_norm(name: str) -> torch.Tensor | None:
            module = getattr(attn, name, None) if family.qk_norm else None
            return None if module is None else (module.weight.detach().float() + offset)

        sandwich = family.sandwich_norms
        return cls(
            _fuse(attn, f"{prefix}.self_attn", qkv_names, plan, dtype, pack),
            _fuse(attn, f"{prefix}.self_attn", ("o_proj",), plan, dtype, pack),
            _fuse(mlp, f"{prefix}.mlp", gate_up_names, plan, dtype, pack),
            _fuse(mlp, f"{prefix}.mlp", ("down_proj",), plan, dtype, pack),
            norm(hf_layer.input_layernorm),
            norm(hf_layer.pre_feedforward_layernorm if sandwich else hf_layer.post_attention_layernorm),
            int(getattr(mlp, "intermediate_size", 0) or mlp.down_proj.in_features),
            head_norm("q_norm"),
            head_norm("k_norm"),
            norm(hf_layer.post_attention_layernorm) if sandwich else None,
            norm(hf_layer.post_feedforward_layernorm) if sandwich else None,
        )


class CompactCausalLM(nn.Module):
    cos: torch.Tensor
    sin: torch.Tensor
    cos_local: torch.Tensor
    sin_local: torch.Tensor

    def __init__(
        self,
        config: Any,
        embed: nn.Module,
        layers: list[CompactLayer],
        norm: torch.Tensor,
        lm_head: nn.Module,
        rotary: RotaryTables,
        max_len: int,
        generation_config: Any = None,
    ) -> None:
        """From its parts (`from_hf` and models/gguf_model.py make them); `rotary`: cos and sin
        [max_len, rotary_dim] fp32 of the model's rotary table and of its sliding layers' own
        (models/rotary.py)."""
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.family = family = family_of(config)
        c = config.get_text_config()
        self.heads, self.kv_heads, self.head_dim = family.heads, family.kv_heads, family.head_dim
        self.rotary_dim = family.rotary_dim
        self.scale = family.scale
        self.eps = float(c.rms_norm_eps)
        self.embed_scale = family.embed_scale
        self.embed_tokens = embed
        if len(layers) != family.num_layers:
            raise ValueError(f"{len(layers)} layers for a config of {family.num_layers}")
        self.layers = nn.ModuleList(layers)
        self._layers = layers  # typed: ModuleList items are plain nn.Modules to mypy
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        # rotate_half(x) * sin == roll(x, rot/2) * sin_signed: one roll instead of slices, neg and cat.
        for suffix, (cos, sin) in zip(("", "_local"), rotary, strict=True):
            if cos.shape != (max_len, self.rotary_dim) or sin.shape != cos.shape:
                raise ValueError(f"rotary tables must be [{max_len}, {self.rotary_dim}]")
            half = self.rotary_dim // 2
            sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            self.register_buffer("cos" + suffix, cos.float(), persistent=False)  # [max_len, rot] fp32
            self.register_buffer("sin" + suffix, sin_signed.float(), persistent=False)
        self.two_tables = LOCAL in family.rope_tables
        self.bind_layers()

    @classmethod
    def from_hf(
        cls, hf_model: Any, plan: ModePlan, dtype: torch.dtype, pack: bool, max_len: int
    ) -> CompactCausalLM:
        """From a loaded Hugging Face model, whose weights it copies (dense, int8 or int4 by `plan`)."""
        from specgate.engine.models.rotary import rotary_tables

        family = family_of(hf_model.config)
        decoder = hf_model.get_decoder()
        embed = hf_model.get_input_embeddings()
        weight = embed.weight.detach().to(dtype)  # [vocab, hidden]
        embed_tokens = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
        layers = [
            CompactLayer.from_hf(layer, f"model.layers.{i}", plan, dtype, pack, family)
            for i, layer in enumerate(decoder.layers)
        ]
        head = hf_model.get_output_embeddings()
        lm_head = make_linear(head.weight.detach(), head.bias, plan("lm_head.weight"), dtype, pack)
        norm = (decoder.norm.weight.detach().float() + family.norm_offset).to(dtype)
        generation = getattr(hf_model, "generation_config", None)
        tables = rotary_tables(hf_model.config, max_len, norm.device)
        return cls(hf_model.config, embed_tokens, layers, norm, lm_head, tables, max_len, generation)

    def bind_layers(self) -> None:
        """The per-layer operands as plain tuples: the forward loop then pays no nn.Module attribute
        lookups or __call__ hooks (thousands per step on a 30-layer model). Call again after
        replacing a layer's module. Where every projection runs on the GGUF kernels, the norms,
        the gated activation and the residual adds are done inside their calls (`fused`)."""
        from specgate.engine.models.quantized import GGUFLinear

        self.fused = all(
            isinstance(m, GGUFLinear)
            for layer in self._layers
            for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        f = self.family
        self._plan = [
            _LayerPlan(
                layer.qkv.forward,
                layer.o.forward,
                layer.gate_up.forward,
                layer.down.forward,
                layer.input_norm,
                layer.post_norm,
                layer.intermediate,
                layer.q_norm,
                layer.k_norm,
                layer.attn_out_norm,
                layer.mlp_out_norm,
                window,
                table,
            )
            for layer, window, table in zip(self._layers, f.windows, f.rope_tables, strict=True)
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
        windows = self.family.windows
        if meta.positions is None:
            meta.positions = positions

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return paged_attention(windowed(meta, windows[layer]), layer, q, k, v, self.scale)

        if self.fused and not meta.tiles and input_ids.device.type == "cpu":
            hidden = self._native_hidden_states(input_ids, positions, meta)
        else:
            hidden = self.hidden_states(
                input_ids, positions, attend, meta.compute_dtype
            )  # [num_tokens, hidden]
        logits = self.lm_head(hidden.index_select(0, logit_index))  # [num_logits, vocab]
        return logits, (hidden if want_hidden else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden]: the tokens' embeddings, scaled as the family does (Gemma)."""
        x: torch.Tensor = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # in the embedding's dtype, as HF
        return x

    def _tables(
        self, positions: torch.Tensor, compute: torch.dtype
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(cos, sin)] [1, num_tokens, rot] in `compute`, per rotary table (GLOBAL, LOCAL)."""
        glob = (self.cos[positions].to(compute).unsqueeze(0), self.sin[positions].to(compute).unsqueeze(0))
        if not self.two_tables:
            return [glob, glob]
        local = (
            self.cos_local[positions].to(compute).unsqueeze(0),
            self.sin_local[positions].to(compute).unsqueeze(0),
        )
        return [glob, local]

    def _rotate(
        self, qkv: torch.Tensor, lp: _LayerPlan, tables: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Queries and keys [h + kv, num_tokens, d] of qkv [h + 2kv, num_tokens, d], QK-normed where
        the family does, rotated on their first rotary_dim dims."""
        h, kv, d, rot = self.heads, self.kv_heads, self.head_dim, self.rotary_dim
        if lp.q_norm is not None and lp.k_norm is not None:
            dtype = qkv.dtype
            qk = torch.cat(
                [
                    rms_norm(qkv[:h], lp.q_norm.to(dtype), self.eps),
                    rms_norm(qkv[h : h + kv], lp.k_norm.to(dtype), self.eps),
                ]
            )
        else:
            qk = qkv[: h + kv]
        cos, sin = tables[lp.table]
        if rot == d:
            return qk * cos + torch.roll(qk, d // 2, dims=-1) * sin  # rotary on queries and keys at once
        part = qk[..., :rot]
        rotated = part * cos + torch.roll(part, rot // 2, dims=-1) * sin
        return torch.cat([rotated, qk[..., rot:]], dim=-1)

    def _gate(self, gate_up: torch.Tensor, m: int) -> torch.Tensor:
        gate = gate_up[:, :m]
        act = F.silu(gate) if self.family.activation == "silu" else F.gelu(gate, approximate="tanh")
        return act * gate_up[:, m:]

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
        x = self.embed(input_ids)  # [num_tokens, hidden]
        if self.fused:
            return self._fused_hidden_states(x, positions, attend, compute)
        dtype = x.dtype
        # Queries and keys are rotated in attention's compute dtype (fp32 on CPU): one cast of the
        # fused qkv per layer, and the keys and values go into the pool without another.
        tables = self._tables(positions, compute)
        n, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        residual = x
        eps = self.eps
        for i, lp in enumerate(self._plan):
            hs = rms_norm(residual, lp.input_norm, eps)
            qkv = lp.qkv(hs).to(compute).view(n, h + 2 * kv, d).transpose(0, 1)  # [h + 2kv, num_tokens, d]
            qk = self._rotate(qkv, lp, tables)
            attn = attend(i, qk[:h], qk[h:], qkv[h + kv :])  # [num_tokens, h, d]
            out = lp.o(attn.reshape(n, h * d).to(dtype))
            if lp.attn_out_norm is not None:
                out = rms_norm(out, lp.attn_out_norm, eps)
            residual = residual + out
            hs = rms_norm(residual, lp.post_norm, eps)
            out = lp.down(self._gate(lp.gate_up(hs), lp.intermediate))  # gate_up: [num_tokens, 2 * m]
            if lp.mlp_out_norm is not None:
                out = rms_norm(out, lp.mlp_out_norm, eps)
            residual = residual + out
        return rms_norm(residual, self.norm, eps)

    def _fused_hidden_states(
        self, x: torch.Tensor, positions: torch.Tensor, attend: Attend, compute: torch.dtype
    ) -> torch.Tensor:
        """`hidden_states` with each projection's norm, gated activation and residual add in its
        kernel call."""
        dtype = x.dtype
        tables = self._tables(positions, compute)
        n, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        residual, eps = x, self.eps
        act = _ACTIVATION_CODES[self.family.activation]
        for i, lp in enumerate(self._plan):
            qkv = lp.qkv(residual, lp.input_norm, eps).to(compute).view(n, h + 2 * kv, d).transpose(0, 1)
            qk = self._rotate(qkv, lp, tables)
            attn = attend(i, qk[:h], qk[h:], qkv[h + kv :])  # [num_tokens, h, d]
            residual = _add_out(lp.o, attn.reshape(n, h * d).to(dtype), residual, lp.attn_out_norm, eps)
            gate_up = lp.gate_up(residual, lp.post_norm, eps)  # [num_tokens, 2 * intermediate]
            residual = _add_out(lp.down, gate_up, residual, lp.mlp_out_norm, eps, gated=act)
        return rms_norm(residual, self.norm, eps)

    def _native_decoder(self) -> Any:
        """The whole layer stack as one native object (engine/kernels/decoder.h), over the same packed
        matrices and norms: a step's layers then cost one call from Python instead of hundreds."""
        from specgate.engine.kernels.extension import NAMESPACE
        from specgate.engine.models.quantized import GGUFLinear

        f = self.family
        decoder = getattr(torch.classes, NAMESPACE).Decoder(
            self.heads, self.kv_heads, self.head_dim, self.eps, self.scale, self.rotary_dim,
            _ACTIVATION_CODES[f.activation],
        )  # fmt: skip
        empty = torch.empty(0)
        for layer, window, table in zip(self._layers, f.windows, f.rope_tables, strict=True):
            mods = [cast(GGUFLinear, m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            norms = [layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm]
            norms += [layer.attn_out_norm, layer.mlp_out_norm]
            decoder.add_layer(
                [w for m in mods for w in m._weights],
                [t for m in mods for t in m._types],
                [o for m in mods for o in m._outs],
                [len(m._weights) for m in mods],
                [b for m in mods for b in m._biases],
                [empty if w is None else w.detach() for w in norms],
                mods[0].in_features,
                layer.intermediate,
                window,
                table,
            )
        return decoder

    def _native_hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """`hidden_states` on the native kernels end to end: each projection with its norm, gated
        activation or residual add, the QK-norm and rotation with the pool stores, and attention
        (engine/kernels/)."""
        from specgate.engine.kernels.extension import ops

        native = ops()
        x = self.embed(input_ids)  # [num_tokens, hidden]
        dtype = x.dtype
        tables = [(self.cos[positions], self.sin[positions])]  # [num_tokens, rot] fp32
        if self.two_tables:
            tables.append((self.cos_local[positions], self.sin_local[positions]))
        n, h, kv, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        cache, slots = meta.kv_cache, meta.slot_mapping
        residual, eps = x, self.eps
        decoder = self._decoder
        if decoder is not None and dtype == torch.float32:  # bit-identical to the loop below, in one call
            local = tables[-1] if self.two_tables else (_EMPTY, _EMPTY)
            residual = decoder.forward(
                x, *tables[0], *local, positions, cache.k, cache.v, slots, *native_calls(meta)
            )
            return rms_norm(residual, self.norm, eps)
        act = _ACTIVATION_CODES[self.family.activation]
        for i, lp in enumerate(self._plan):
            qkv = lp.qkv(residual, lp.input_norm, eps)  # [num_tokens, (h + 2 kv) d]
            cos, sin = tables[min(lp.table, len(tables) - 1)]
            q = native.rope_store(
                qkv, cos, sin, cache.k, cache.v, i, slots, h, kv, lp.q_norm, lp.k_norm, eps
            )  # [num_tokens, h, d]
            attn = native_paged_attention(windowed(meta, lp.window), i, q, self.scale, native)  # fp32
            residual = _add_out(lp.o, attn.view(n, h * d).to(dtype), residual, lp.attn_out_norm, eps, native)
            gate_up = lp.gate_up(residual, lp.post_norm, eps)  # [num_tokens, 2 * intermediate]
            residual = _add_out(lp.down, gate_up, residual, lp.mlp_out_norm, eps, native, gated=act)
        return rms_norm(residual, self.norm, eps)


_EMPTY = torch.empty(0)
RotaryTables = list[tuple[torch.Tensor, torch.Tensor]]


class _LayerPlan(NamedTuple):
    qkv: Callable[..., torch.Tensor]
    o: Callable[..., torch.Tensor]
    gate_up: Callable[..., torch.Tensor]
    down: Callable[..., torch.Tensor]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    intermediate: int
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    attn_out_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    window: int
    table: int


def _add_out(
    proj: Callable[..., torch.Tensor],
    x: torch.Tensor,
    residual: torch.Tensor,
    out_norm: torch.Tensor | None,
    eps: float,
    native: Any = None,
    gated: int = 0,
) -> torch.Tensor:
    """residual + proj(x) on the GGUF kernels, the add inside the call; with an output norm (Gemma's
    sandwich), residual + RMSNorm(proj(x)) * out_norm, the norm the native decoder's own where
    `native` ops are given."""
    if out_norm is None:
        return proj(x, gated=gated, residual=residual)
    out = proj(x, gated=gated)
    if native is not None:
        normed: torch.Tensor = native.rms_norm(out, out_norm, eps).to(out.dtype)
    else:
        normed = rms_norm(out, out_norm.to(out.dtype), eps)
    return residual + normed
