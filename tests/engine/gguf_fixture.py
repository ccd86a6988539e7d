"""Tiny GGUF files for the tests: a random-weight model of a family the compact decoder covers
(Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) written as llama.cpp writes it (its tensor names;
query and key rows permuted for Llama; Gemma's norms stored as their multipliers 1 + w; Llama 3's
rotary scaling as a `rope_freqs` tensor), each matrix quantized to a chosen ggml type.

gguf-py quantizes the blocks-of-32 types; the K-quants (Q4_K, Q5_K, Q6_K) are quantized here with
simple, valid encoders (not llama.cpp's search for the best scales: any valid blocks will do, the
tests compare the kernels against gguf-py's own dequantization of the same blocks). The model's
configuration and tokenizer are saved where the engine looks for a GGUF file's metadata (the
conversion cache's `-meta` directory), so the file itself needs only its tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from specgate.engine.loader import ModelSource, converted_dir
from specgate.engine.models.plan import HF_TO_GGUF

# Hugging Face state-dict names -> GGUF tensor names: the model-wide tensors, and the parts of a
# layer (model.layers.<i>.<part>.<kind> -> blk.<i>.<gguf part>.<kind>).
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}
LAYER_PARTS = {**HF_TO_GGUF, "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# What other families add or name otherwise (llama.cpp's names).
FAMILY_PARTS = {
    "qwen3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
    "gemma3_text": {
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
# Families llama.cpp converts as its "llama" architecture, query and key rows permuted.
PERMUTED = frozenset({"llama", "mistral"})
# Families whose Hugging Face norms hold w where the module multiplies by 1 + w.
NORM_OFFSET = {"gemma3_text": 1.0}


def gguf_name(name: str, model_type: str) -> str:
    """The GGUF tensor a Hugging Face state-dict entry is written as."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = {**LAYER_PARTS, **FAMILY_PARTS.get(model_type, {})}
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def stored(name: str, data: np.ndarray, model_type: str, heads: int, kv: int) -> np.ndarray:
    """A Hugging Face weight as llama.cpp's converter stores it."""
    if model_type in PERMUTED and (".attn_q." in name or ".attn_k." in name):
        return llama_permute(data, heads if ".attn_q." in name else kv)
    if name.endswith("norm.weight"):
        return data + NORM_OFFSET.get(model_type, 0.0)
    return data


def _f16(values: np.ndarray) -> np.ndarray:
    return np.frombuffer(values.astype(np.float16).tobytes(), dtype=np.uint8).reshape(*values.shape, 2)


def quantize_k(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows of x (multiples of 256 long) as Q4_K, Q5_K or Q6_K blocks: uint8 [rows, bytes]."""
    rows, cols = x.shape
    sb = x.reshape(rows, cols // 256, 256).astype(np.float64)
    if qtype == GGMLQuantizationType.Q6_K:
        g = sb.reshape(rows, -1, 16, 16)
        scale = np.abs(g).max(-1) / 31.5 + 1e-12  # [rows, n, 16]
        d = scale.max(-1) / 127.0  # [rows, n]
        sc = np.clip(np.round(scale / d[..., None]), 1, 127)
        q = np.clip(np.round(g / (d[..., None, None] * sc[..., None])), -32, 31).astype(np.int64) + 32
        u = q.reshape(rows, -1, 256)
        out = np.zeros((rows, u.shape[1], 210), dtype=np.uint8)
        for n in range(2):
            b = u[..., 128 * n : 128 * n + 128]
            out[..., 64 * n : 64 * n + 32] = (b[..., 0:32] & 0xF) | ((b[..., 64:96] & 0xF) << 4)
            out[..., 64 * n + 32 : 64 * n + 64] = (b[..., 32:64] & 0xF) | ((b[..., 96:128] & 0xF) << 4)
            out[..., 128 + 32 * n : 128 + 32 * n + 32] = (
                (b[..., 0:32] >> 4)
                | ((b[..., 32:64] >> 4) << 2)
                | ((b[..., 64:96] >> 4) << 4)
                | ((b[..., 96:128] >> 4) << 6)
            )
        out[..., 192:208] = sc.astype(np.int8).view(np.uint8)
        out[..., 208:210] = _f16(d)
        return out.reshape(rows, -1)
    levels = 15 if qtype == GGMLQuantizationType.Q4_K else 31
    g = sb.reshape(rows, -1, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)
    scale = (g.max(-1) - lo) / levels + 1e-12
    mins = -lo
    d = scale.max(-1) / 63.0
    dmin = mins.max(-1) / 63.0 + 1e-12
    sc = np.clip(np.round(scale / d[..., None]), 1, 63).astype(np.int64)
    mq = np.clip(np.round(mins / dmin[..., None]), 0, 63).astype(np.int64)
    # Round d and dmin to fp16 first: the codes are chosen for the factors the file will hold.
    d16, dmin16 = d.astype(np.float16).astype(np.float64), dmin.astype(np.float16).astype(np.float64)
    step = (d16[..., None] * sc)[..., None]
    q = np.clip(np.round((g + (dmin16[..., None] * mq)[..., None]) / step), 0, levels).astype(np.int64)
    q = q.reshape(rows, -1, 256)
    width = 144 if levels == 15 else 176
    out = np.zeros((rows, q.shape[1], width), dtype=np.uint8)
    out[..., 0:2], out[..., 2:4] = _f16(d), _f16(dmin)
    scales = np.zeros((rows, q.shape[1], 12), dtype=np.int64)
    for j in range(4):
        scales[..., j] = (sc[..., j] & 63) | ((sc[..., j + 4] >> 4) << 6)
        scales[..., j + 4] = (mq[..., j] & 63) | ((mq[..., j + 4] >> 4) << 6)
        scales[..., j + 8] = (sc[..., j + 4] & 0xF) | ((mq[..., j + 4] & 0xF) << 4)
    out[..., 4:16] = scales
    ql = out[..., 16:144] if levels == 15 else out[..., 48:176]
    for j in range(4):
        lo_q, hi_q = q[..., 64 * j : 64 * j + 32], q[..., 64 * j + 32 : 64 * j + 64]
        ql[..., 32 * j : 32 * j + 32] = (lo_q & 0xF) | ((hi_q & 0xF) << 4)
        if levels == 31:
            out[..., 16:48] |= (((lo_q >> 4) & 1) << (2 * j)).astype(np.uint8)
            out[..., 16:48] |= (((hi_q >> 4) & 1) << (2 * j + 1)).astype(np.uint8)
    return out.reshape(rows, -1)


def quantize(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
        return quantize_k(x, qtype)
    return quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a Llama query / key projection (what the engine undoes)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model_dir: Path,
    out: Path,
    cache_dir: Path,
    types: dict[str, GGMLQuantizationType],
    default: GGMLQuantizationType = GGMLQuantizationType.Q8_0,
    rope_freqs: np.ndarray | None = None,
    meta_config: object | None = None,
) -> Path:
    """Write the Hugging Face checkpoint in `model_dir` as the GGUF file `out`, its matrices in
    `types` (by GGUF tensor name suffix, e.g. "ffn_down.weight"; else `default`), and save its
    configuration (`meta_config`, where given: what transformers' GGUF loader would read of a
    real file) and tokenizer where the engine looks for them (under `cache_dir`). `rope_freqs`:
    written as llama.cpp writes Llama 3's rotary scaling."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = model.config
    model_type = config.model_type
    arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(model_type, model_type)
    writer = GGUFWriter(out, arch)
    writer.add_block_count(config.num_hidden_layers)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        target = gguf_name(name, model_type)
        data = stored(target, tensor.detach().float().numpy(), model_type, heads, kv)
        if data.ndim == 1:
            writer.add_tensor(target, data.astype(np.float32))
            continue
        qtype = next((t for suffix, t in types.items() if target.endswith(suffix)), default)
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(target, data.astype(np.float32))
            continue
        blocks = quantize(data, qtype)
        writer.add_tensor(target, blocks, raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = converted_dir(ModelSource(out.parent, out.name, out.stem), cache_dir)
    meta = meta.with_name(meta.name + "-meta")
    meta.mkdir(parents=True, exist_ok=True)
    (meta_config or config).save_pretrained(meta)  # type: ignore[attr-defined]
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(meta)
    return out


# Every kind of block the kernels read, and a K-quant on the tied or untied head.
MIXED = {
    "attn_q.weight": GGMLQuantizationType.Q4_K,
    "attn_k.weight": GGMLQuantizationType.Q5_0,
    "attn_v.weight": GGMLQuantizationType.Q6_K,
    "attn_output.weight": GGMLQuantizationType.Q4_1,
    "ffn_gate.weight": GGMLQuantizationType.Q5_K,
    "ffn_up.weight": GGMLQuantizationType.Q4_0,
    "ffn_down.weight": GGMLQuantizationType.Q6_K,
    "output.weight": GGMLQuantizationType.Q8_0,
    "token_embd.weight": GGMLQuantizationType.Q5_1,
}


# ---- running the engine on these files (tests/engine/models) ----------------------------------

GREEDY = dict(temperature=0.0, ignore_eos=True)


def gguf_engine(files: dict[str, tuple[Path, Path]], name: str, **kw: object) -> Any:
    """An fp32 engine on the file `files[name][0]` (the metadata under `files["cache"]`)."""
    from specgate.engine.config import EngineConfig
    from specgate.engine.engine import Engine

    args: dict[str, Any] = dict(
        model=str(files[name][0]),
        convert_cache_dir=str(files["cache"][0]),
        dtype="float32",
        block_size=4,
        num_blocks=256,
    )
    args.update(kw)
    return Engine(EngineConfig(**args))


def dequantized_reference(gguf: Path, hf: Path) -> torch.nn.Module:
    """The Hugging Face model with the file's weights, dequantized by gguf-py (float32), as stored
    weights map back (Llama rows unpermuted, Gemma norms less their offset)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from specgate.engine.models.gguf_weights import unpermute_rows

    tensors = {t.name: t for t in GGUFReader(gguf).tensors}
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    model_type = model.config.model_type
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            target = gguf_name(name, model_type)
            t = tensors[target]
            values = np.array(quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tensor.shape))
            if model_type in PERMUTED and (".attn_q." in target or ".attn_k." in target):
                values = values[unpermute_rows(values.shape[0], heads if ".attn_q." in target else kv)]
            if target.endswith("norm.weight"):
                values = values - NORM_OFFSET.get(model_type, 0.0)
            tensor.copy_(torch.from_numpy(values))
    return model


def quantize_inputs(model: torch.nn.Module) -> None:
    """Make every linear layer of `model` see its input as the kernels do: each row quantized to
    8 bits in blocks of 256 (then 64), one scale per block, rounded half to even."""
    from tests.engine.kernels.test_gguf_kernels import quantized_activations

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        rows = x.reshape(-1, x.shape[-1])
        return (quantized_activations(rows).to(x.dtype).view(x.shape),)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(hook)


def step_logits(engine: Any) -> list[torch.Tensor]:
    """Every step's logits from now on (a list the engine's runner appends to)."""
    captured: list[torch.Tensor] = []
    run = engine.runner.execute_with_hidden

    def capture(items, hidden):  # type: ignore[no-untyped-def]
        out = run(items, hidden)
        captured.append(out[0].clone())
        return out

    engine.runner.execute_with_hidden = capture
    return captured


def run_greedy(
    engine: Any, prompts: list[list[int]], n: int, spec: Any = None, finals: dict[str, Any] | None = None
) -> dict[str, list[int]]:
    """Greedy tokens of each prompt by request id; `finals` gets each request's last output."""
    from specgate.engine.sampling_params import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, **GREEDY), spec)  # type: ignore[arg-type]
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if finals is not None:
                finals[o.request_id] = o
    return out
