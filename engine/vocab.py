"""The words the engine, the policies and the gateway share, defined once.

This module imports nothing of the project, so that `policies` may import it (with
`engine/step_cost.py`, the only exceptions to its import contract; a contract of its own checks that
it stays a leaf). The gateway's schemas embed these types or derive their bounds from them; no
layer keeps a copy.

- `SpecParams`: one request's speculation settings, from the configuration, a class rule or the
  client's `speculation` field, through the route, to the engine.
- `SpecStep`: one verification step of one request, as the engine measured it and the `spec_steps`
  rows store it.
- `LoadSnapshot`: an engine's load after its last step, under vLLM's names (`num_running`,
  `num_waiting`, `kv_cache_usage`, `step_time` in seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Drafted tokens per step, a chain's length or a tree's nodes: the most any setting may ask for.
K_MAX = 64
CONTROLLERS = ("goodput", "static", "heuristic")
SPEC_OFF = "off"


def check_k_range(k_min: int, k_max: int) -> None:
    """Raise ValueError unless 0 <= k_min <= k_max <= K_MAX."""
    if not 0 <= k_min <= k_max <= K_MAX:
        raise ValueError(f"need 0 <= k_min <= k_max <= {K_MAX}, got k_min={k_min}, k_max={k_max}")


def check_controller(controller: str) -> None:
    if controller not in CONTROLLERS:
        raise ValueError(f"controller must be one of {', '.join(CONTROLLERS)}; got {controller!r}")


@dataclass(frozen=True, slots=True)
class SpecParams:
    # A registered proposer name ("ngram", "suffix", "draft_model", ...) or "off".
    method: str = SPEC_OFF
    # A registered controller name: "goodput" (dynamic K), "static" or "heuristic".
    controller: str = "goodput"
    k_min: int = 0
    k_max: int = 8
    # Draft length for "static", starting length for "heuristic".
    num_speculative_tokens: int = 4
    # Prior per-position acceptance probability, e.g. measured for the request's workload class.
    acceptance_prior: float = 0.6
    # Draft trees: at most this many drafted nodes per step for a proposer that drafts trees (at most
    # k_max deep); the goodput controller keeps only the branches that pay. At most k: chains only.
    max_tree_nodes: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError("method must be a proposer name or 'off'")
        check_controller(self.controller)
        check_k_range(self.k_min, self.k_max)
        if not 0 <= self.num_speculative_tokens <= K_MAX:
            raise ValueError(f"num_speculative_tokens must be in [0, {K_MAX}]")
        if not 0 <= self.max_tree_nodes <= K_MAX:
            raise ValueError(f"max_tree_nodes must be in [0, {K_MAX}]")
        if not 0.0 <= self.acceptance_prior <= 1.0:
            raise ValueError("acceptance_prior must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method != SPEC_OFF and self.k_max > 0


@dataclass(frozen=True, slots=True)
class SpecStep:
    """One verification step of one request: a `spec_steps` row's numbers."""

    drafted: int  # drafted tokens (a tree's nodes)
    accepted: int  # drafts accepted (a tree's accepted depth)
    batch_tokens: int  # tokens in the whole forward pass, every request's
    step_ms: float  # that pass's time, sampling and verification included
    depth: int  # the draft's depth: `drafted` for a chain

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= self.depth <= self.drafted:
            raise ValueError(f"need 0 <= accepted <= depth <= drafted, got {self}")
        if self.batch_tokens < 0 or not 0.0 <= self.step_ms < math.inf:
            raise ValueError("batch_tokens and step_ms must be non-negative and finite")

    @property
    def tree(self) -> bool:
        return self.depth < self.drafted


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """An engine's load after its last step (what the router reads of the embedded engine)."""

    num_running: int = 0  # sequences in the running batch
    num_waiting: int = 0  # requests waiting for a batch slot
    kv_cache_usage: float = 0.0  # share of KV blocks in use, [0, 1]
    num_batched_tokens: int = 0  # tokens the last step emitted, every request's
    step_time: float = 0.0  # the last step's wall time, seconds
    num_steps: int = 0  # steps since the engine started
    kv_blocks_used: int = 0

    def __post_init__(self) -> None:
        counts = (
            self.num_running,
            self.num_waiting,
            self.num_batched_tokens,
            self.num_steps,
            self.kv_blocks_used,
        )
        if min(counts) < 0:
            raise ValueError("load counts must be non-negative")
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError("kv_cache_usage must be in [0, 1]")
        if not 0.0 <= self.step_time < math.inf:
            raise ValueError("step_time must be non-negative and finite")

    @property
    def batch(self) -> int:
        """Sequences competing for the next steps: running plus waiting."""
        return self.num_running + self.num_waiting
