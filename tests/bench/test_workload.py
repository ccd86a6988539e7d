"""The shipped workload data, JSONL prompts and the Azure trace."""

from __future__ import annotations

import pytest

from specgate.bench import workload


def test_the_azure_trace_from_its_first_request() -> None:
    trace = workload.load_trace("conv", limit=500)
    assert len(trace) == 500 and trace[0].offset == 0.0 and all(t.context_tokens > 0 for t in trace)
    offsets = [t.offset for t in trace]
    assert offsets == sorted(offsets) and offsets[-1] > 0


def test_shipped_categories_and_tools() -> None:
    reqs = workload.shipped(per_category=2, max_tokens=64)
    cats = [r.category for r in reqs]
    assert cats[: len(workload.CATEGORIES)] == workload.CATEGORIES  # interleaved
    assert all(cats.count(c) == 2 for c in workload.CATEGORIES)
    tool = next(r for r in reqs if r.category == "tool_call")
    assert tool.tools and tool.tools[0]["type"] == "function"
    assert '"dict"' not in str(tool.tools).replace("'", '"')  # BFCL's "dict" became "object"
    with pytest.raises(ValueError):
        workload.shipped(1, 8, ["poetry"])


def test_custom_jsonl(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "hi", "category": "x", "max_tokens": 5}\n'
        '\n{"messages": [{"role": "user", "content": "yo"}]}\n'
    )
    reqs = workload.from_jsonl(path, max_tokens=9)
    assert [(r.category, r.max_tokens) for r in reqs] == [("x", 5), ("custom", 9)]
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompt"):
        workload.from_jsonl(path, 9)


def test_a_prompt_length_cap_takes_the_first_prompts_within_it() -> None:
    capped = workload.shipped(3, 8, ["qa", "summarization"], max_prompt_tokens=300)
    assert capped and all(r.approx_tokens <= 300 for r in capped)
    assert sum(r.category == "qa" for r in capped) == 3
    assert max(r.approx_tokens for r in workload.shipped(3, 8, ["summarization"])) > 300
