"""Per-class acceptance priors for the engine's dynamic-K controller, from measured telemetry.

The controller starts each request from a prior per-position acceptance probability; a class's
measured acceptance (accepted / drafted tokens, per method) is a better start than one number for
all. Shrunk toward the engine default so that a handful of requests cannot swing it.
"""

from __future__ import annotations

from collections.abc import Iterable

from specgate.policies.arms import Arm
from specgate.policies.goodput import TrainingRow

DEFAULT_PRIOR = 0.6  # the engine's own default
PSEUDO_TOKENS = 64  # drafted tokens' worth of weight on the default


def acceptance_priors(rows: Iterable[TrainingRow]) -> dict[str, float]:
    """`{"<class>:<method>": prior}` for every class and method with drafted tokens."""
    drafted: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for r in rows:
        if not r.label or not r.draft_tokens:
            continue
        key = f"{r.label}:{Arm.parse(r.arm).method}"
        drafted[key] = drafted.get(key, 0) + r.draft_tokens
        accepted[key] = accepted.get(key, 0) + (r.accepted_tokens or 0)
    return {
        key: round((accepted[key] + PSEUDO_TOKENS * DEFAULT_PRIOR) / (drafted[key] + PSEUDO_TOKENS), 4)
        for key in sorted(drafted)
    }
