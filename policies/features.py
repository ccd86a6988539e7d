"""Request features known before dispatch: structure, size, sampling, and how copyable the prompt is.

Everything here is a few passes over a bounded slice of the prompt, so it stays well under a
millisecond even for a long RAG context.
"""

from __future__ import annotations

import functools
import math
import re

from specgate.policies.classes import WORKLOAD_CLASSES
from specgate.policies.request import RequestInfo

COPY_CHARS = 4000  # prompt slice the copyability estimate reads
_WORD = re.compile(r"\w+|[^\w\s]")
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|return\b|for .*:|if .*:|#include|public |"
    r"function |const |let |var |SELECT |[{}]\s*$|.*;\s*$)"
)

# Structural features, in the order the classifier's linear model reads them.
STRUCTURAL = (
    "has_tools",
    "json_mode",
    "code_fence",
    "code_line_share",
    "log_prompt_chars",
    "paragraphs",
    "ends_with_question",
    "non_ascii_share",
)


def structural(info: RequestInfo) -> dict[str, float]:
    text = info.text
    head = text[:COPY_CHARS]
    lines = [ln for ln in head.splitlines() if ln.strip()]
    code_lines = sum(1 for ln in lines if _CODE_LINE.match(ln))
    non_ascii = sum(1 for ch in head if ord(ch) > 127)
    tail = (info.last_user or text).rstrip()
    return {
        "has_tools": float(info.has_tools),
        "json_mode": float(info.json_mode),
        "code_fence": float("```" in text),
        "code_line_share": code_lines / len(lines) if lines else 0.0,
        "log_prompt_chars": math.log1p(len(text)) / 10.0,
        "paragraphs": min(text.count("\n\n"), 20) / 20.0,
        "ends_with_question": float(tail.endswith("?")),
        "non_ascii_share": non_ascii / len(head) if head else 0.0,
    }


def copyability(text: str, n: int = 3) -> float:
    """Share of word n-grams in the prompt that already occurred earlier in it.

    Repetitive prompts (code, templated data, documents quoted twice) are the ones whose outputs
    n-gram and suffix proposers can copy from.
    """
    return _copyability(text[:COPY_CHARS], n)


@functools.lru_cache(maxsize=1024)  # keys are at most COPY_CHARS long: a few MiB in all
def _copyability(text: str, n: int) -> float:
    words = _WORD.findall(text)
    total = len(words) - n + 1
    if total <= 0:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for i in range(total):
        gram = tuple(words[i : i + n])
        if gram in seen:
            repeats += 1
        else:
            seen.add(gram)
    return repeats / total


def request_features(info: RequestInfo, class_probs: dict[str, float]) -> dict[str, float]:
    """The features a goodput model reads, with the classifier's probabilities folded in."""
    out = {f"p_{c}": float(class_probs.get(c, 0.0)) for c in WORKLOAD_CLASSES}
    out.update(
        log_prompt_tokens=math.log1p(info.approx_prompt_tokens),
        log_max_tokens=math.log1p(info.max_tokens) if info.max_tokens else math.log1p(256),
        temperature=float(info.temperature),
        top_p=float(info.top_p),
        copyability=copyability(info.text),
        tools_or_json=float(info.has_tools or info.json_mode),
    )
    return out
