"""Choose how the model runs: the compact decoder on the native GGUF kernels (a Llama-family GGUF
file on CPU), the compact decoder on dense / int8 / int4 weights, or the Hugging Face modules."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specgate.engine.batch_invariant import make_batch_invariant
from specgate.engine.config import EngineConfig
from specgate.engine.cpu_linear import PackedLinear, pack_linears, packing_supported
from specgate.engine.kernels import extension
from specgate.engine.loader import ModelSource, load_config_and_tokenizer
from specgate.engine.models.family import unsupported
from specgate.engine.models.gguf_weights import GGUFWeights, apply_file_metadata
from specgate.engine.models.linear import WeightOnlyLinear
from specgate.engine.models.llama import CompactCausalLM
from specgate.engine.models.plan import gguf_tensor_types, mode_plan
from specgate.engine.models.quantized import GGUFLinear

logger = logging.getLogger(__name__)


def build_model(hf_model: Any, config: EngineConfig, source: ModelSource, max_len: int) -> tuple[Any, bool]:
    """(the model to run, whether it is the compact decoder). The compact decoder copies what it
    needs, so the caller may drop `hf_model` afterwards."""
    reason = unsupported(hf_model.config)
    compact = config.model_impl == "compact" or (config.model_impl == "auto" and reason is None)
    if compact and reason is not None:
        raise ValueError(
            f"model_impl compact runs the Llama, Mistral, Qwen2, Qwen3, Gemma 3 and Phi-3 families; "
            f"{source.name}: {reason}"
        )
    pack = bool(config.pack_linears) and packing_supported(config.torch_dtype)
    if config.pack_linears and not pack:
        logger.warning("oneDNN cannot pack %s linears on this CPU; using torch's kernels", config.dtype)
    if not compact:
        if config.quantization in ("int8", "int4"):
            raise ValueError(f"quantization {config.quantization} needs the compact decoder ({reason})")
        logger.info("%s: served by the Hugging Face modules (%s)", source.name, reason or "model_impl hf")
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


@dataclass(frozen=True, slots=True)
class NativeFile:
    """A GGUF file the native kernels will serve: its model configuration (corrected by the
    file's own metadata), its tokenizer, and the file opened once (its header takes seconds to
    read for a large vocabulary)."""

    config: Any
    tokenizer: Any
    weights: GGUFWeights


def native_gguf(config: EngineConfig, source: ModelSource) -> NativeFile | None:
    """The file, when the native GGUF kernels will serve this model, else None:
    a GGUF file of a family the compact decoder covers (models/family.py), on CPU, with
    `quantization` auto and the kernels built. Anything else (or kernels that cannot be built here)
    takes the Hugging Face loading path, and the start-up log says why."""
    if source.gguf_file is None:
        return None
    why = None
    if config.device != "cpu":
        why = f"the native kernels run on CPU, not {config.device}"
    elif config.quantization != "auto":
        why = f"quantization {config.quantization} asks for another weight format"
    elif config.model_impl == "hf":
        why = "model_impl hf"
    if why is not None:
        logger.info("%s: not on the native GGUF kernels (%s)", source.name, why)
        return None
    model_config, tokenizer = load_config_and_tokenizer(source, config.convert_cache_dir)
    weights = GGUFWeights.open(source.directory / source.gguf_file)
    reason = apply_file_metadata(model_config, weights)
    reason = reason or unsupported(model_config)
    if reason is not None:
        logger.warning("%s: served by the Hugging Face modules, dequantized: %s", source.name, reason)
        return None
    if not extension.load():
        logger.warning(
            "%s: served by the Hugging Face modules, dequantized: the native kernels cannot be built (%s)",
            source.name,
            extension.unavailable_reason(),
        )
        return None
    return NativeFile(model_config, tokenizer, weights)


def build_native(
    native: NativeFile, config: EngineConfig, source: ModelSource, max_len: int
) -> tuple[Any, int]:
    """(the compact decoder on the GGUF kernels, bytes of weights one decode step reads)."""
    from transformers import GenerationConfig

    from specgate.engine.models.gguf_model import build_gguf_model

    pack = bool(config.pack_linears) and packing_supported(config.torch_dtype)
    generation = GenerationConfig.from_model_config(native.config)
    model = build_gguf_model(native.weights, native.config, config.torch_dtype, pack, max_len, generation)
    _make_invariant(model, config)
    model.bind_layers()
    per_step = sum(p.nbytes for m in model.modules() if isinstance(m, GGUFLinear) for p in m.parts)
    f = model.family
    logger.info(
        "%s: served on the native GGUF kernels (%s), the %s family%s: %.0f MB of weights per decode step",
        source.name,
        ("portable C++", "AVX2", "AVX-512 VNNI")[extension.isa_level()],
        f.model_type,
        f" (sliding window {max(f.windows)} on {sum(1 for x in f.windows if x)} of {f.num_layers} layers)"
        if f.sliding
        else "",
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
