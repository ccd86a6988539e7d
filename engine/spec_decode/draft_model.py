"""Draft-model proposer: a smaller model with the target's tokenizer drafts autoregressively.

It runs in the same process with its own paged KV cache. Before drafting it rewinds its cache to
the longest prefix it shares with the request's committed tokens (rollback = truncation), so
rejected drafts cost nothing to undo.

A greedy request asked for a tree gets the chain plus, at each depth, the draft's runner-up tokens
as leaves beside the chain's node there: they cost no draft pass (they come from the logits that
chose the chain's token), and when the target turns the chain down at that depth it often picks the
draft's second choice. The draft's probabilities are the nodes' scores, so the goodput controller
keeps only the leaves that pay. A sampled request gets a chain (its drafts are draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specgate.engine.batch_layout import ForwardItem
from specgate.engine.block_manager import BlockManager
from specgate.engine.config import EngineConfig
from specgate.engine.model_runner import ModelRunner
from specgate.engine.sampler import process_logits
from specgate.engine.spec_decode.proposer import (
    Proposal,
    ProposalRequest,
    ProposerContext,
    draft_row,
    draw_draft,
)


@dataclass(slots=True)
class _DraftSeq:
    block_table: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # tokens whose keys/values the draft cache holds


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    autoregressive = True
    needs_hidden = False
    drafts_past_extra = False

    def __init__(self, ctx: ProposerContext) -> None:
        opts = ctx.options
        if not opts.get("model"):
            raise ValueError(
                "the draft_model proposer needs a draft model: set proposer_options['draft_model']['model']"
            )
        config = EngineConfig(
            model=str(opts["model"]),
            dtype=str(opts.get("dtype", ctx.dtype)),
            device=str(ctx.device),
            kv_cache_bytes=int(opts.get("kv_cache_bytes", 128 * 2**20)),
            convert_cache_dir=opts.get("convert_cache_dir"),
            prefix_caching=False,  # the draft keeps its own per-request KV: no feature pool for it
        )
        self.runner = ModelRunner(config)
        if self.runner.tokenizer.get_vocab() != ctx.tokenizer.get_vocab():
            raise ValueError(f"draft model {opts['model']!r} uses a different tokenizer than the target")
        self.vocab_size = ctx.vocab_size
        self.blocks = BlockManager(self.runner.kv_cache.num_blocks, config.block_size)
        self._seqs: dict[str, _DraftSeq] = {}

    def start(self, request_id: str, token_ids: Sequence[int], scope: str | None = "") -> None:
        self._seqs[request_id] = _DraftSeq()

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        pass

    def commit(self, request_id: str, token_ids: Sequence[int], num_new: int) -> None:
        pass  # the next propose() rewinds to whatever was committed

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        st = self._seqs.pop(request_id, None)
        if st is not None:
            self.blocks.free(st)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, draft_vocab] on the target's vocabulary (padding rows differ in size)."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Greedy tree requests: per depth, the chain token's draft probability and the runner-ups'.
        tops: list[list[tuple[float, list[tuple[int, float]]]]] = [[] for _ in requests]
        live: list[int] = []
        feed: list[list[int]] = []
        for i, r in enumerate(requests):
            st = self._seqs.get(r.request_id)
            if st is None or r.k <= 0 or len(r.token_ids) + r.k > self.runner.max_model_len:
                continue
            keep = _common_prefix(st.cached, r.token_ids)
            keep = min(keep, len(r.token_ids) - 1)  # always feed at least the newest token
            del st.cached[keep:]
            self.blocks.truncate(st, keep)
            if not self.blocks.can_allocate(st, len(r.token_ids) + r.k - 1):
                continue  # no room in the draft cache: this request does not speculate this step
            self.blocks.allocate(st, len(r.token_ids) + r.k - 1)
            live.append(i)
            feed.append(list(r.token_ids[keep:]))
        for _ in range(max((requests[i].k for i in live), default=0)):
            if not live:
                break
            items = []
            for i, tokens in zip(live, feed, strict=True):
                st = self._seqs[requests[i].request_id]
                items.append(ForwardItem(tokens, len(st.cached), st.block_table, 1))
                st.cached.extend(tokens)
            logits = self._fit_vocab(self.runner.execute(items).float())  # [len(live), vocab]
            rows = [draft_row(requests[i], drafts[i]) for i in live]
            processed = process_logits(logits, rows)  # [len(live), vocab]
            next_live, next_feed = [], []
            for j, i in enumerate(live):
                r = requests[i]
                token, q = draw_draft(processed[j], rows[j])
                if q is not None:
                    probs[i].append(q)
                elif r.max_nodes > r.k:
                    tops[i].append(_runner_ups(processed[j], token, r.max_nodes - r.k))
                drafts[i].append(token)
                if len(drafts[i]) < r.k:
                    next_live.append(i)
                    next_feed.append([token])
            live, feed = next_live, next_feed
        out = []
        for i, r in enumerate(requests):
            if tops[i]:  # only where max_nodes > k >= the chain's length
                out.append(_tree(drafts[i], tops[i], r.max_nodes))
            else:
                out.append(Proposal(drafts[i], torch.stack(probs[i]) if probs[i] else None))
        return out


def _runner_ups(processed: torch.Tensor, chosen: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's draft probability and the next `n` best (token, probability), from the
    processed logits [vocab] of one draft position."""
    p = processed.float().softmax(dim=-1)  # [vocab]
    top = torch.topk(p, min(n + 1, p.shape[-1]))
    alts = [(int(t), float(v)) for v, t in zip(top.values, top.indices, strict=True) if int(t) != chosen]
    return float(p[chosen]), [(t, v) for t, v in alts[:n] if v > 0.0]


def _tree(chain: list[int], tops: list[tuple[float, list[tuple[int, float]]]], max_nodes: int) -> Proposal:
    """The chain and the best runner-up leaves by path probability, in depth-first order (the chain
    first, then the leaves deepest first, each depth's best first), at most `max_nodes` nodes.
    tops[j]: the chain token's probability at depth j + 1 and that depth's runner-ups."""
    reach = [1.0]  # draft probability of reaching depth j along the chain
    for p_chain, _ in tops:
        reach.append(reach[-1] * p_chain)
    leaves = [(reach[j] * p, j, token) for j, (_, alts) in enumerate(tops) for token, p in alts]
    leaves.sort(key=lambda x: -x[0])
    kept = sorted(leaves[: max_nodes - len(chain)], key=lambda x: (-x[1], -x[0]))
    tokens = [*chain, *(t for _, _, t in kept)]
    parents = [*range(-1, len(chain) - 1), *(j - 1 for _, j, _ in kept)]
    scores = [*(p for p, _ in tops), *(s / reach[j] for s, j, _ in kept)]
    return Proposal(tokens, parents=parents, scores=scores)
