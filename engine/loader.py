"""Resolve and load a causal LM and its tokenizer from local files only (never a hub).

GGUF checkpoints go through transformers' GGUF loader, which dequantizes to dense weights and
rebuilds the tokenizer (about 15 s for SmolLM2). When a conversion cache directory is given,
the result is saved once as safetensors and later loads take under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specgate.engine.attention import ATTENTION_NAME, register
from specgate.engine.model_source import ModelNotFoundError as ModelNotFoundError
from specgate.engine.model_source import ModelSource as ModelSource
from specgate.engine.model_source import default_model_source as default_model_source
from specgate.engine.model_source import resolve_model as resolve_model

logger = logging.getLogger(__name__)


def _cache_key(gguf_path: Path) -> str:
    st = gguf_path.stat()
    ident = f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return f"{gguf_path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def converted_dir(source: ModelSource, cache_dir: str | Path) -> Path:
    """Where a GGUF source's one-off safetensors conversion lives (or will) under `cache_dir`."""
    assert source.gguf_file is not None
    return Path(cache_dir) / _cache_key(source.directory / source.gguf_file)


def _converted_checkpoint(source: ModelSource, cache_dir: Path) -> Path:
    """Convert a GGUF checkpoint to safetensors once; return the converted directory."""
    target = converted_dir(source, cache_dir)
    if (target / "config.json").is_file():
        return target
    logger.info("converting %s to safetensors in %s (once)", source.gguf_file, target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"gguf_file": source.gguf_file, "local_files_only": True}
    # float32 keeps the dequantized weights exact whatever dtype is served later.
    model: Any = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
    # The GGUF loader already dequantized every weight to a dense tensor; what stays marked as
    # "quantized" is bookkeeping that would stop save_pretrained, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache_dir))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion never leaves half a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
    return target


def load_config_and_tokenizer(source: ModelSource, cache_dir: str | None) -> tuple[Any, Any]:
    """The configuration and tokenizer of a GGUF source, without its weights. Reading them from the
    file takes seconds (the tokenizer is rebuilt from its vocabulary), so they are saved once next to
    the conversion cache (`<key>-meta`, a few MB) and read from there afterwards."""
    from transformers import AutoConfig

    assert source.gguf_file is not None
    kwargs: dict[str, Any] = {"local_files_only": True}
    if cache_dir is not None:
        converted = converted_dir(source, cache_dir)
        for directory in (converted, converted.with_name(converted.name + "-meta")):
            if (directory / "config.json").is_file() and (directory / "tokenizer_config.json").is_file():
                config = AutoConfig.from_pretrained(directory, **kwargs)
                return config, AutoTokenizer.from_pretrained(directory, **kwargs)
    kwargs["gguf_file"] = source.gguf_file
    config = AutoConfig.from_pretrained(source.directory, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(source.directory, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF loader's bookkeeping, meaningless here
    if cache_dir is not None:
        target = converted_dir(source, cache_dir)
        target = target.with_name(target.name + "-meta")
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".meta-", dir=cache_dir))
        try:
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return config, tokenizer


def load_model(
    source: ModelSource, dtype: torch.dtype, device: str, cache_dir: str | None
) -> tuple[Any, Any]:
    """The model (a transformers PreTrainedModel on `device`, in eval mode) and its tokenizer."""
    register()
    directory = source.directory
    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.gguf_file is not None:
        if cache_dir is not None:
            directory = _converted_checkpoint(source, Path(cache_dir))
        else:
            kwargs["gguf_file"] = source.gguf_file
    model: Any = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation=ATTENTION_NAME, **kwargs
    )
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    return model, tokenizer
