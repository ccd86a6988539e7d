"""Batch-1 Hugging Face `generate` rows on the same model and prompts: plain, prompt lookup, assisted.

Run in this process after the arms, while the gateway is idle, with the same chat template and
greedy decoding; one request per category (the first), `max_tokens` new tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from specgate.bench.serve.datasets import BenchRequest


def _model_dir(model: str | None) -> tuple[Path, Any]:
    """The directory of the model the gateway serves (the cached safetensors of a GGUF default)."""
    from specgate.engine.loader import converted_dir, resolve_model
    from specgate.gateway.settings import default_cache_dir

    src = resolve_model(model)
    if src.gguf_file is None:
        return src.directory, None
    path = converted_dir(src, default_cache_dir())
    if not path.exists():
        raise RuntimeError(f"no converted checkpoint at {path}; start the gateway once to create it")
    return path, src


def hf_rows(args: argparse.Namespace, reqs: list[BenchRequest]) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgate.engine.config import EngineConfig

    path, _ = _model_dir(args.model)
    dtype = EngineConfig(dtype=args.dtype or "auto", device="cpu").torch_dtype
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    draft = None
    if args.hf_draft_model:
        draft = AutoModelForCausalLM.from_pretrained(args.hf_draft_model, dtype=dtype).eval()
    baselines: dict[str, dict[str, Any]] = {
        "hf_plain": {},
        "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10},
    }
    if draft is not None:
        baselines["hf_assisted"] = {"assistant_model": draft}
    firsts: dict[str, BenchRequest] = {}
    for r in reqs:
        firsts.setdefault(r.category, r)
    rows = []
    with torch.inference_mode():
        for cat, req in firsts.items():
            ids: Any = tok.apply_chat_template(
                req.messages,
                tools=list(req.tools or []) or None,
                add_generation_prompt=True,
                return_tensors="pt",
            )
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False
            )  # warm-up
            for name, extra in baselines.items():
                t0 = time.perf_counter()
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=req.max_tokens,
                    do_sample=False,
                    **extra,
                )
                dt = time.perf_counter() - t0
                rows.append(
                    {"baseline": name, "category": cat, "tokens_per_s": (out.shape[1] - ids.shape[1]) / dt}
                )
    return rows
