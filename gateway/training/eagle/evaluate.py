"""Held-out acceptance of a drafting method, per workload class, measured in the engine."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from specgate.engine.engine import Engine
from specgate.engine.vocab import SpecParams
from specgate.gateway.training.eagle.data import submit


def acceptance_by_class(
    engine: Engine,
    items: list[tuple[str, str]],
    method: str,
    k: int,
    max_tokens: int,
    max_prompt_tokens: int,
    progress: Callable[[int], None],
) -> dict[str, dict[str, Any]]:
    """Greedy runs with a static chain of `k` drafts: per class, mean accepted length (accepted drafts
    per verification step, plus the one token every step yields) and draft acceptance rate. Chains,
    not trees: the figure is the drafter's own, comparable across heads and methods."""
    spec = SpecParams(
        method=method, controller="static", num_speculative_tokens=k, k_min=k, k_max=k, max_tree_nodes=0
    )
    added = submit(engine, items, f"eval-{method}", max_tokens, max_prompt_tokens, progress, spec)
    classes = {rid: category for rid, (category, _) in added.items()}
    steps: dict[str, int] = defaultdict(int)
    drafted: dict[str, int] = defaultdict(int)
    accepted: dict[str, int] = defaultdict(int)
    requests: dict[str, int] = defaultdict(int)
    while engine.has_unfinished():
        for out in engine.step():
            if out.stats is None:
                continue  # not finished: the counters come with the finished output
            progress(1)
            cat = classes[out.request_id]
            requests[cat] += 1
            st = out.stats.spec
            if st is not None:
                steps[cat] += st.num_drafts
                drafted[cat] += st.num_draft_tokens
                accepted[cat] += st.num_accepted_tokens
    return {
        cat: {
            "requests": requests[cat],
            "mean_acceptance_length": 1.0 + accepted[cat] / steps[cat] if steps[cat] else None,
            "acceptance_rate": accepted[cat] / drafted[cat] if drafted[cat] else None,
        }
        for cat in sorted(requests)
    }
