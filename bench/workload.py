"""What benchmarks send: prompts by workload category from the public data in bench/data (licenses
beside it) or any JSONL file, and the arrivals of the Azure LLM inference trace of 2023.
"""

from __future__ import annotations

import csv
import gzip
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from specgate.policies.training import dataset

DATA = Path(__file__).resolve().parent / "data"
TRACE_DIR = DATA / "azure_llm_trace_2023"
CATEGORIES = ["code", "summarization", "rag", "qa", "translation", "math_reasoning", "open_chat", "tool_call"]
# The workload classifier's mapping of Spec-Bench categories (MT-bench's open-ended ones pooled as
# open chat), less MT-bench's few math / reasoning / coding prompts: GSM8K and HumanEval stand for those.
SPEC_BENCH = {k: v for k, v in dataset.SPEC_BENCH.items() if k not in ("math", "reasoning", "coding")}


@dataclass(slots=True)
class BenchRequest:
    category: str
    messages: list[dict[str, Any]]
    max_tokens: int
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # body fields this request adds

    @property
    def approx_tokens(self) -> int:
        """A tokenizer-free length estimate (about four characters per token)."""
        text = "".join(str(m.get("content") or "") for m in self.messages)
        text += json.dumps(self.tools) if self.tools else ""
        return max(1, len(text) // 4)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def jsonl(name: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file of bench/data (gzipped when its name says so)."""
    path = DATA / name
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as f:
        text = f.read()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def category_texts() -> dict[str, list[str]]:
    """First-turn user messages per category but tool_call, in file order."""
    out: dict[str, list[str]] = {c: [] for c in CATEGORIES if c != "tool_call"}
    task = "Complete this Python function. Reply with the full function only.\n\n"
    out["code"] = [task + row["prompt"] for row in jsonl("HumanEval.jsonl.gz")]
    for row in jsonl("spec_bench_dev.jsonl"):
        if (cat := SPEC_BENCH.get(row["category"])) is not None:
            out[cat].append(row["turns"][0])
    return out


def _bfcl(max_tokens: int) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    for name in ("simple_python", "multiple", "parallel"):
        for row in jsonl(f"bfcl/BFCL_v4_{name}.json"):
            tools = [{"type": "function", "function": _openai_schema(fn)} for fn in row["function"]]
            out.append(BenchRequest("tool_call", list(row["question"][0]), max_tokens, tools))
    random.Random(0).shuffle(out)
    return out


def _openai_schema(node: Any) -> Any:
    """BFCL writes "type": "dict" where JSON Schema says "object"."""
    if isinstance(node, dict):
        return {k: ("object" if k == "type" and v == "dict" else _openai_schema(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_openai_schema(v) for v in node]
    return node


def shipped(
    per_category: int, max_tokens: int, categories: Sequence[str] = (), max_prompt_tokens: int | None = None
) -> list[BenchRequest]:
    """`per_category` requests of each category (of those within `max_prompt_tokens`, estimated),
    interleaved so that categories alternate (the first of each, then the second of each, ...)."""
    wanted = list(categories or CATEGORIES)
    if unknown := set(wanted) - set(CATEGORIES):
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
    texts = category_texts()
    steps = "Think step by step, then give the answer after '####'."
    texts["math_reasoning"] += [f"{r['question']}\n{steps}" for r in jsonl("gsm8k_test_dev.jsonl")]
    pools = []
    for cat in wanted:
        asked = [BenchRequest(cat, user(t), max_tokens) for t in texts.get(cat, [])]  # tool_call: BFCL's
        pool = _bfcl(max_tokens) if cat == "tool_call" else asked
        fit = [r for r in pool if max_prompt_tokens is None or r.approx_tokens <= max_prompt_tokens]
        pools.append(fit[:per_category])
    return [p[i] for i in range(max(map(len, pools), default=0)) for p in pools if i < len(p)]


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
            messages = user(row["prompt"])
        else:
            raise ValueError(f"{path}:{n + 1}: each line needs 'prompt' or 'messages'")
        tokens = int(row.get("max_tokens", max_tokens))
        out.append(BenchRequest(row.get("category", "custom"), messages, tokens, row.get("tools")))
    return out


# ---- the Azure LLM inference trace ------------------------------------------------------------------


@dataclass(slots=True)
class TraceRequest:
    offset: float  # seconds from the first request of the trace
    context_tokens: int
    generated_tokens: int


def load_trace(name: str, limit: int | None = None) -> list[TraceRequest]:
    """The Azure LLM inference trace ('code' or 'conv'), offsets from its first request."""
    rows: list[TraceRequest] = []
    with (TRACE_DIR / f"AzureLLMInferenceTrace_{name}.csv").open() as f:
        first = None
        for row in itertools.islice(csv.DictReader(f), limit):
            # "2023-11-16 18:15:46.6805900": sub-microsecond digits are beyond datetime's reach.
            date, _, frac = row["TIMESTAMP"].partition(".")
            ts = datetime.strptime(date, "%Y-%m-%d %H:%M:%S").timestamp() + float("0." + (frac or "0"))
            first = ts if first is None else first
            rows.append(TraceRequest(ts - first, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    return rows
