"""The labeled prompts the workload classifier trains on, built from the public workload data.

`build(source)` reads the verbatim copies in `source` (Spec-Bench, HumanEval, GSM8K, BFCL; see
their licenses beside `policies/data/`) and adds phrasing variants made by this project
(`synthetic.py`): the public sets phrase each class one way ("Translate German to English:",
"Summarize:"), and a classifier trained on them alone learns the prefix, not the workload.
Every row carries a `group`: variants of one source item share it, so a held-out split by group
never tests on a rephrasing of a training prompt.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

from specgate.policies.classes import check_class
from specgate.policies.training import synthetic

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_DATASET = DATA_DIR / "workload_prompts.jsonl.gz"

# Spec-Bench category -> workload class. MT-bench "extraction" asks for structured pulls from a
# given text; it sits between rag and tool_call, and is left out rather than taught as either.
SPEC_BENCH = {
    "summarization": "summarization",
    "rag": "rag",
    "qa": "qa",
    "translation": "translation",
    "math_reasoning": "math_reasoning",
    "math": "math_reasoning",
    "reasoning": "math_reasoning",
    "coding": "code",
    "writing": "open_chat",
    "roleplay": "open_chat",
    "humanities": "open_chat",
    "stem": "open_chat",
}
MAX_PER_SOURCE = 300  # GSM8K and BFCL would otherwise swamp the small classes


def _row(
    text: str, label: str, source: str, group: str, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    row: dict[str, Any] = {"text": text, "label": check_class(label), "source": source, "group": group}
    if tools:
        row["tools"] = tools
    return row


def _spec_bench(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        item = json.loads(line)
        label = SPEC_BENCH.get(item["category"])
        if label is not None:
            rows.append(
                _row(item["turns"][0], label, f"spec_bench/{item['category']}", f"sb{item['question_id']}")
            )
    return rows


def _humaneval(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        items = [json.loads(line) for line in f]
    return [_row(it["prompt"], "code", "humaneval", it["task_id"]) for it in items]


def _gsm8k(path: Path, rng: random.Random) -> list[dict[str, Any]]:
    items = [json.loads(line) for line in path.read_text().splitlines()]
    rng.shuffle(items)
    return [
        _row(it["question"], "math_reasoning", "gsm8k", f"gsm{i}")
        for i, it in enumerate(items[:MAX_PER_SOURCE])
    ]


def _bfcl(directory: Path, rng: random.Random) -> list[dict[str, Any]]:
    rows = []
    for name in ("simple_python", "multiple", "parallel"):
        for line in (directory / f"BFCL_v4_{name}.json").read_text().splitlines():
            item = json.loads(line)
            turn = item["question"][0][-1]["content"]
            tools = [{"name": f["name"], "description": f.get("description", "")} for f in item["function"]]
            rows.append(_row(turn, "tool_call", f"bfcl/{name}", item["id"], tools))
    rng.shuffle(rows)
    return rows[:MAX_PER_SOURCE]


def build(source: Path, seed: int = 0) -> list[dict[str, Any]]:
    """Labeled rows: the public prompts, then project-made variants of them and of each class."""
    rng = random.Random(seed)
    public = (
        _spec_bench(source / "spec_bench_dev.jsonl")
        + _humaneval(source / "HumanEval.jsonl.gz")
        + _gsm8k(source / "gsm8k_test_dev.jsonl", rng)
        + _bfcl(source / "bfcl", rng)
    )
    made = [
        _row(text, label, f"synthetic/{label}", group)
        for text, label, group in synthetic.variants(public, rng)
    ]
    return public + made


def save(rows: list[dict[str, Any]], path: Path = DEFAULT_DATASET) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def load(path: Path = DEFAULT_DATASET) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]
