"""Benchmark prompts by workload category, from the public data copied into bench/data/."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from specgate.policies.training import dataset

DATA = Path(__file__).resolve().parent / "data"

# The workload classifier's mapping of Spec-Bench categories (MT-bench's open-ended ones pooled as
# open chat), less MT-bench's few math / reasoning / coding prompts: GSM8K and HumanEval stand for those.
SPEC_BENCH = {k: v for k, v in dataset.SPEC_BENCH.items() if k not in ("math", "reasoning", "coding")}
CATEGORIES = ["code", "summarization", "rag", "qa", "translation", "math_reasoning", "open_chat"]


def category_texts() -> dict[str, list[str]]:
    """First-turn user messages per category, in file order."""
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        for line in f:
            prompt = json.loads(line)["prompt"]
            out["code"].append(
                f"Complete this Python function. Reply with the full function only.\n\n{prompt}"
            )
    for line in (DATA / "spec_bench_dev.jsonl").read_text().splitlines():
        row = json.loads(line)
        cat = SPEC_BENCH.get(row["category"])
        if cat is not None:
            out[cat].append(row["turns"][0])
    return out


def chat_prompts(
    tokenizer: Any, per_category: int, max_prompt_tokens: int, categories: list[str] | None = None
) -> list[tuple[str, list[int]]]:
    """(category, chat-templated prompt ids), `per_category` prompts of each category that fit."""
    from specgate.gateway.backends.embedded.chat_template import render_chat

    texts = category_texts()
    prompts: list[tuple[str, list[int]]] = []
    for cat in categories or CATEGORIES:
        taken = 0
        for text in texts[cat]:
            if taken == per_category:
                break
            ids = render_chat(tokenizer, [{"role": "user", "content": text}])
            if len(ids) <= max_prompt_tokens:
                prompts.append((cat, ids))
                taken += 1
    return prompts


def round_robin(prompts: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """Reorder so that categories alternate: first prompt of each, then the second of each, ..."""
    rank: dict[str, int] = {}
    keyed = []
    for i, (cat, ids) in enumerate(prompts):
        keyed.append((rank.get(cat, 0), i, (cat, ids)))
        rank[cat] = rank.get(cat, 0) + 1
    return [p for _, _, p in sorted(keyed)]
