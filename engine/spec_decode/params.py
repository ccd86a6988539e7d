"""Per-request speculation settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

CONTROLLERS = ("goodput", "static", "heuristic")


@dataclass(slots=True)
class SpecParams:
    # A registered proposer name ("ngram", "suffix", "draft_model", ...) or "off".
    method: str = "off"
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
        if self.controller not in CONTROLLERS:
            raise ValueError(f"controller must be one of {', '.join(CONTROLLERS)}; got {self.controller!r}")
        if not 0 <= self.k_min <= self.k_max <= 64:
            raise ValueError(f"need 0 <= k_min <= k_max <= 64, got k_min={self.k_min}, k_max={self.k_max}")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [0, 64]")
        if not 0 <= self.max_tree_nodes <= 64:
            raise ValueError("max_tree_nodes must be in [0, 64]")
        if not 0.0 <= self.acceptance_prior <= 1.0:
            raise ValueError("acceptance_prior must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.k_max > 0
