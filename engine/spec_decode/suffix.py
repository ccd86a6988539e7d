"""SuffixDecoding-style proposer (arXiv 2411.04975).

Two suffix tries answer each draft request: one per request over its prompt and output, and one
bounded cache of recent requests' outputs shared within the request's scope (agentic and templated
workloads repeat themselves across requests). The candidate with the higher expected acceptance
wins; draft length grows with the match length.

Scopes keep tenants apart: a draft drawn from another tenant's output would reveal that output
through acceptance counts and timing. The gateway scopes by API key; a request with scope None
neither reads nor feeds any shared cache. All scopes share one token budget, oldest first out.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest, ProposerContext
from specgate.engine.spec_decode.suffix_tree import Node, SuffixTree, draft_from, draft_tree_from


@dataclass(slots=True)
class _Local:
    tree: SuffixTree
    active: list[Node]
    num_indexed: int
    scope: str | None


@dataclass(slots=True)
class _Candidate:
    tokens: list[int]  # the chain
    score: float  # its expected accepted tokens
    node: Node | None = None  # the matched trie node it continues
    limit: int = 0  # the draft's length limit there


@dataclass(slots=True)
class _Shared:
    tree: SuffixTree
    num_sequences: int = 0


class SuffixProposer:
    autoregressive = False
    needs_hidden = False
    drafts_past_extra = True

    def __init__(self, ctx: ProposerContext) -> None:
        opts = ctx.options
        self.max_depth = int(opts.get("max_depth", 24))
        # Matching at most half the depth leaves the other half of each path for the draft.
        self.max_match = int(opts.get("max_match", self.max_depth // 2))
        self.max_spec_factor = float(opts.get("max_spec_factor", 2.0))
        self.min_token_prob = float(opts.get("min_token_prob", 0.1))
        self.max_cached_tokens = int(opts.get("max_cached_tokens", 20_000))
        # The per-request index covers at most this many trailing prompt tokens (memory and start-up
        # time grow with tokens x depth).
        self.max_prompt_tokens = int(opts.get("max_prompt_tokens", 4096))
        self._local: dict[str, _Local] = {}
        self._shared: dict[str, _Shared] = {}  # scope -> its cache of finished outputs
        self._cached: deque[tuple[str, tuple[int, ...]]] = deque()  # every scope's, oldest first
        self._cached_tokens = 0
        # The global cache may be fed or read from outside the engine loop (e.g. warm-up).
        self._lock = threading.Lock()

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def scopes(self) -> list[str]:
        return list(self._shared)

    def shared_tree(self, scope: str = "") -> SuffixTree | None:
        shared = self._shared.get(scope)
        return shared.tree if shared is not None else None

    def start(self, request_id: str, token_ids: Sequence[int], scope: str | None = "") -> None:
        tree = SuffixTree(self.max_depth)
        active = tree.add(token_ids[-self.max_prompt_tokens :])
        self._local[request_id] = _Local(tree, active, len(token_ids), scope)

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        pass

    def commit(self, request_id: str, token_ids: Sequence[int], num_new: int) -> None:
        local = self._local.get(request_id)
        if local is None:
            return
        for t in token_ids[local.num_indexed :]:
            local.active = local.tree.append(local.active, t)
        local.num_indexed = len(token_ids)

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        local = self._local.pop(request_id, None)
        if local is None or local.scope is None:
            return
        self.cache(token_ids[-self.max_cached_tokens :], local.scope)

    def cache(self, tokens: Sequence[int], scope: str = "") -> None:
        """Add a sequence to `scope`'s cache, evicting the oldest of any scope beyond the token bound."""
        seq = tuple(tokens)
        if not seq:
            return
        with self._lock:
            shared = self._shared.get(scope)
            if shared is None:
                shared = self._shared[scope] = _Shared(SuffixTree(self.max_depth))
            shared.tree.add(seq)
            shared.num_sequences += 1
            self._cached.append((scope, seq))
            self._cached_tokens += len(seq)
            while self._cached_tokens > self.max_cached_tokens:
                old_scope, old = self._cached.popleft()
                old_shared = self._shared[old_scope]
                old_shared.tree.remove(old)
                old_shared.num_sequences -= 1
                if old_shared.num_sequences == 0:
                    del self._shared[old_scope]
                self._cached_tokens -= len(old)

    def _candidate(self, tree: SuffixTree, context: Sequence[int], k: int) -> _Candidate:
        found = tree.match(context, self.max_match)
        if found is None:
            return _Candidate([], 0.0)
        node, length = found
        limit = min(k, max(1, math.ceil(self.max_spec_factor * length)))
        tokens, score = draft_from(node, limit, self.min_token_prob)
        return _Candidate(tokens, score, node, limit)

    def _proposal(self, c: _Candidate, r: ProposalRequest) -> Proposal:
        """The winning candidate's chain, or with a node budget its speculation tree (built only for
        the candidate that won, and under the lock when its trie is the shared one)."""
        if r.max_nodes <= r.k or not c.tokens or c.node is None:
            return Proposal(c.tokens)
        tokens, parents, shares = draft_tree_from(c.node, c.tokens, c.limit, r.max_nodes, self.min_token_prob)
        return Proposal(tokens, None, parents, shares)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        out: list[Proposal] = []
        for r in requests:
            # The forced tokens ahead of this draft are context to look up, never committed here.
            context = [*r.token_ids[-self.max_depth :], *r.extra][-self.max_depth :]
            local = self._local.get(r.request_id)
            best = _Candidate([], 0.0)
            scope: str | None = ""  # a request never started here (direct use) reads the default scope
            if local is not None:
                self.commit(r.request_id, r.token_ids, 0)
                best = self._candidate(local.tree, context, r.k)
                scope = local.scope
            proposal = None
            if scope is not None:
                with self._lock:
                    cache = self._shared.get(scope)
                    shared = self._candidate(cache.tree, context, r.k) if cache is not None else best
                    if shared.score > best.score:
                        proposal = self._proposal(shared, r)
            out.append(proposal if proposal is not None else self._proposal(best, r))
        return out
