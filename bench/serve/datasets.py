"""Benchmark requests by workload category, from the data shipped in bench/data or any JSONL file.

Categories: code (HumanEval), summarization, rag, qa, translation, math_reasoning (Spec-Bench and
GSM8K), open_chat (MT-bench writing / roleplay / humanities / stem), tool_call (BFCL, with tools).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specgate.bench.workloads import DATA, category_texts

CATEGORIES = ["code", "summarization", "rag", "qa", "translation", "math_reasoning", "open_chat", "tool_call"]


@dataclass(slots=True)
class BenchRequest:
    category: str
    messages: list[dict[str, Any]]
    max_tokens: int
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def approx_tokens(self) -> int:
        """A tokenizer-free length estimate (about four characters per token)."""
        text = "".join(str(m.get("content") or "") for m in self.messages)
        text += json.dumps(self.tools) if self.tools else ""
        return max(1, len(text) // 4)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _bfcl(limit: int) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    for name in ("simple_python", "multiple", "parallel"):
        for line in (DATA / "bfcl" / f"BFCL_v4_{name}.json").read_text().splitlines():
            row = json.loads(line)
            tools = [{"type": "function", "function": _openai_schema(fn)} for fn in row["function"]]
            out.append(BenchRequest("tool_call", list(row["question"][0]), 0, tools))
    random.Random(0).shuffle(out)
    return out[:limit]


def _openai_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """BFCL writes "type": "dict" where JSON Schema says "object"."""

    def fix(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ("object" if k == "type" and v == "dict" else fix(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    return fix(fn)


def _gsm8k(limit: int) -> list[str]:
    rows = [json.loads(line) for line in (DATA / "gsm8k_test_dev.jsonl").read_text().splitlines()[:limit]]
    return [f"{r['question']}\nThink step by step, then give the answer after '####'." for r in rows]


def shipped(
    per_category: int, max_tokens: int, categories: Sequence[str] | None = None
) -> list[BenchRequest]:
    """`per_category` requests of each category, interleaved so categories alternate."""
    wanted = list(categories or CATEGORIES)
    unknown = set(wanted) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    texts = category_texts()
    texts["math_reasoning"] = texts["math_reasoning"] + _gsm8k(per_category)
    pools: dict[str, list[BenchRequest]] = {}
    for cat in wanted:
        if cat == "tool_call":
            reqs = _bfcl(per_category)
            for r in reqs:
                r.max_tokens = max_tokens
            pools[cat] = reqs
        else:
            pools[cat] = [BenchRequest(cat, _user(t), max_tokens) for t in texts[cat][:per_category]]
    return interleave(pools)


def from_jsonl(path: str | Path, max_tokens: int) -> list[BenchRequest]:
    """Lines of {"prompt": str} or {"messages": [...]}, optional "category", "max_tokens", "tools"."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            messages = row["messages"]
        elif "prompt" in row:
            messages = _user(row["prompt"])
        else:
            raise ValueError(f"{path}:{n + 1}: each line needs 'prompt' or 'messages'")
        out.append(
            BenchRequest(
                row.get("category", "custom"),
                messages,
                int(row.get("max_tokens", max_tokens)),
                row.get("tools"),
            )
        )
    return out


def interleave(pools: dict[str, list[BenchRequest]]) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    i = 0
    while any(i < len(p) for p in pools.values()):
        out.extend(p[i] for p in pools.values() if i < len(p))
        i += 1
    return out


def match_lengths(
    pool: Sequence[BenchRequest], wanted: Sequence[tuple[int, int]], max_context: int, max_tokens: int
) -> list[BenchRequest]:
    """For each (context tokens, generated tokens) of a trace, the pool's request closest in length
    (capped at `max_context`), asking for the trace's output length (capped at `max_tokens`)."""
    by_len = sorted(pool, key=lambda r: r.approx_tokens)
    lengths = [r.approx_tokens for r in by_len]
    import bisect

    out = []
    for ctx, gen in wanted:
        target = min(ctx, max_context)
        i = bisect.bisect_left(lengths, target)
        cands = [j for j in (i - 1, i) if 0 <= j < len(by_len)]
        best = min(cands, key=lambda j: abs(lengths[j] - target))
        src = by_len[best]
        out.append(BenchRequest(src.category, src.messages, max(1, min(gen, max_tokens)), src.tools))
    return out
