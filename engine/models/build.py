"""Choose how the model runs: the compact decoder on the native GGUF kernels (a Llama-family GGUF
file on CPU), the compact decoder on dense / int8 / int4 weights, or the Hugging Face modules."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from specgate.engine.batch_invariant import make_batch_invariant
from specgate.engine.config import EngineConfig
from specgate.engine.cpu_linear import PackedLinear, pack_linears, packing_supported
from specgate.engine.kernels import extension
from specgate.engine.loader import ModelSource, load_config_and_tokenizer
from specgate.engine.models.linear import WeightOnlyLinear
from specgate.engine.models.llama import CompactCausalLM, compact_supported
from specgate.engine.models.plan import gguf_tensor_types, mode_plan
from specgate.engine.models.quantized import GGUFLinear

logger = logging.getLogger(__name__)


def build_model(hf_model: Any, config: EngineConfig, source: ModelSource, max_len: int) -> tuple[Any, bool]:
    """(the model to run, whether it is the compact decoder). The compact decoder copies what it
    needs, so the caller may drop `hf_model` afterwards."""
    supported = compact_supported(hf_model.config)
    compact = config.model_impl == "compact" or (config.model_impl == "auto" and supported)
    if compact and not supported:
        raise ValueError(
            f"model_impl compact runs the Llama family (llama, qwen2, mistral); "
            f"{source.name} is {hf_model.config.get_text_config().model_type!r}"
        )
    pack = bool(config.pack_linears) and packing_supported(config.torch_dtype)
    if config.pack_linears and not pack:
        logger.warning("oneDNN cannot pack %s linears on this CPU; using torch's kernels", config.dtype)
    if not compact:
        if config.quantization in ("int8", "int4"):
            raise ValueError(f"quantization {config.quantization} needs the compact decoder (Llama family)")
        if pack and not config.deterministic:  # fused packed siblings share one call: not wrappable
            pack_linears(hf_model)
        _make_invariant(hf_model, config)
        return hf_model, False
    types = None
    if config.quantization == "auto" and source.gguf_file is not None and config.device == "cpu":
        types = gguf_tensor_types(source.directory / source.gguf_file)
    plan = mode_plan(config.quantization if config.device == "cpu" else "none", types)
    model = CompactCausalLM.from_hf(hf_model, plan, config.torch_dtype, pack, max_len)
    if _make_invariant(model, config):
        model.bind_layers()  # the layer loop holds bound forwards of the layers it replaced
    kinds = Counter(type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Linear"))
    logger.info("compact decoder, linear layers: %s", ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return model, True


def native_gguf(config: EngineConfig, source: ModelSource) -> tuple[Any, Any] | None:
    """(model config, tokenizer) when the native GGUF kernels will serve this model, else None:
    a GGUF file of the Llama family, on CPU, with `quantization` auto and the kernels built.
    Anything else (or kernels that cannot be built here) takes the Hugging Face loading path."""
    if source.gguf_file is None or config.device != "cpu" or config.quantization != "auto":
        return None
    if config.model_impl == "hf":
        return None
    model_config, tokenizer = load_config_and_tokenizer(source, config.convert_cache_dir)
    if not compact_supported(model_config):
        kind = model_config.get_text_config().model_type
        logger.warning("%s is a %r model: served by the Hugging Face modules, dequantized", source.name, kind)
        return None
    if not extension.load():
        return None
    return model_config, tokenizer


def build_native(
    model_config: Any, config: EngineConfig, source: ModelSource, max_len: int
) -> tuple[Any, int]:
    """(the compact decoder on the GGUF kernels, bytes of weights one decode step reads)."""
    from transformers import GenerationConfig

    from specgate.engine.models.gguf_model import build_gguf_model

    pack = bool(config.pack_linears) and packing_supported(config.torch_dtype)
    generation = GenerationConfig.from_model_config(model_config)
    model, _ = build_gguf_model(source, model_config, config.torch_dtype, pack, max_len, generation)
    _make_invariant(model, config)
    model.bind_layers()
    per_step = sum(p.nbytes for m in model.modules() if isinstance(m, GGUFLinear) for p in m.parts)
    logger.info(
        "native GGUF kernels (%s): %.0f MB of weights per decode step",
        ("portable C++", "AVX2", "AVX-512 VNNI")[extension.isa_level()],
        per_step / 1e6,
    )
    return model, per_step


def _make_invariant(model: Any, config: EngineConfig) -> bool:
    if not config.deterministic:
        return False
    device = torch.device(config.device)
    linears = (nn.Linear, PackedLinear, WeightOnlyLinear)
    rows = config.max_num_batched_tokens
    tiled = make_batch_invariant(model, config.torch_dtype, device, rows, linears, WeightOnlyLinear)
    logger.info("deterministic mode: %d linear layers called at a fixed row count", tiled)
    return True
