"""A step's drafts: which speculating sequences draft and how far, what their proposers propose,
which tree nodes are worth verifying, and the KV room for them.

The controllers choose each sequence's k for this step from the measured step costs (choose_k);
each proposer drafts for all of its sequences in one call; a goodput-controlled tree keeps the
branch nodes that pay in this step (grow_trees); KV slots are reserved for what is kept, a tree
falling back to its first path, then to nothing, when the cache is short. A proposer that raises
or returns something malformed costs its requests their drafts (or, if drafting them alone fails
too, those requests alone), never the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, field

import torch

from specgate.engine import draft_tree
from specgate.engine.block_manager import BlockManager
from specgate.engine.scheduler import ScheduledSequence
from specgate.engine.sequence import Sequence
from specgate.engine.spec_decode import tree_proposal
from specgate.engine.spec_decode.controller import Candidate, TreeCandidate, choose_k, grow_trees
from specgate.engine.spec_decode.cost_model import CostModel
from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest, Proposer
from specgate.engine.stop_rules import sampling_row

logger = logging.getLogger("specgate.engine")
# Tokens a grammar may force into one step's draft: they cost no proposer time, but each one is
# verified (one more token in the forward pass).
MAX_FORCED_DRAFT = 16


@dataclass(slots=True)
class Drafter:
    block_manager: BlockManager
    proposer: Callable[[str], Proposer]  # the engine's proposer table
    fail: Callable[[Sequence, str], None]  # ends one request with an error
    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    deterministic: bool
    eos_token_ids: Set[int]
    forced_drafts: bool = True  # constrained requests draft what their grammar forces
    cost_model: CostModel = field(default_factory=CostModel)  # measured step costs

    def propose(self, batch: list[ScheduledSequence]) -> list[Proposal]:
        """Drafts per scheduled sequence (empty for most); KV room is reserved for them."""
        drafts = [Proposal([]) for _ in batch]
        decoding = [i for i, s in enumerate(batch) if s.samples and s.num_tokens == 1]
        speculating = [i for i in decoding if batch[i].seq.spec is not None]
        constrained = [i for i in decoding if batch[i].seq.constraint is not None]
        if not speculating and not constrained:
            return drafts
        bs = self.block_manager.block_size
        free_slots = self.block_manager.num_free_blocks * bs
        rooms: dict[int, int] = {}  # KV slots each drafting sequence could still take
        caps: dict[int, int] = {}  # the most tokens it may draft
        for i in {*speculating, *constrained}:
            seq = batch[i].seq
            room = rooms[i] = len(seq.block_table) * bs - seq.num_tokens + free_slots
            caps[i] = max(
                0,
                min(
                    seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1,
                    room,
                ),
            )
        scheduled_tokens = sum(s.num_tokens for s in batch)
        emitting = sum(s.samples for s in batch)
        context = mean_context((s.seq.num_computed_tokens, s.num_tokens) for s in batch)
        drafted = self._proposals(batch, speculating, caps, scheduled_tokens, emitting, context)
        budget = (
            self.max_num_batched_tokens - scheduled_tokens - sum(len(p.token_ids) for p in drafted.values())
        )
        for i in constrained:
            seq = batch[i].seq
            try:
                prop = self._grammar_draft(seq, drafted.pop(i, None), caps[i], budget)
            except Exception as exc:
                logger.exception("request %s failed while its grammar drafted", seq.request_id)
                self.fail(seq, f"the grammar failed while drafting ({type(exc).__name__}: {exc})")
                continue
            if prop is not None:
                drafted[i] = prop
                budget -= prop.num_forced
        chosen = self._grow_trees(batch, drafted, rooms, scheduled_tokens, emitting, context)
        for i, prop in chosen.items():
            seq = batch[i].seq
            for attempt in (prop, tree_proposal.first_path(prop)):
                n = seq.num_tokens + len(attempt.token_ids)
                if attempt.token_ids and self.block_manager.can_allocate(seq, n):
                    self.block_manager.allocate(seq, n)
                    drafts[i] = attempt
                    break
        return drafts

    def _proposals(
        self,
        batch: list[ScheduledSequence],
        speculating: list[int],
        caps: dict[int, int],
        scheduled_tokens: int,
        emitting: int,
        context: float,
    ) -> dict[int, Proposal]:
        """The proposers' checked drafts for the speculating sequences, k chosen by their controllers."""
        if not speculating:
            return {}
        candidates = []
        for i in speculating:
            seq = batch[i].seq
            assert seq.spec is not None and seq.stats.spec is not None
            method = seq.stats.spec.method
            candidates.append(Candidate(seq.spec, method, self.proposer(method).autoregressive, caps[i]))
        ks = choose_k(
            candidates,
            num_emitting=emitting,
            num_tokens=scheduled_tokens,
            budget=max(0, self.max_num_batched_tokens - scheduled_tokens),
            cost=self.cost_model,
            context=context,
        )
        by_method: dict[str, list[tuple[int, ProposalRequest]]] = {}
        for i, c, k in zip(speculating, candidates, ks, strict=True):
            if k == 0:
                c.state.relax()
            else:
                seq = batch[i].seq
                # Deterministic mode keeps fixed attention tiles per sequence: chains only.
                nodes = 0 if self.deterministic else c.state.params.max_tree_nodes
                row = sampling_row(seq, [], self.eos_token_ids)
                req = ProposalRequest(
                    seq.request_id, seq.token_ids, seq.num_prompt_tokens, k, row, nodes, seq.constraint
                )
                by_method.setdefault(c.method, []).append((i, req))
        drafted: dict[int, Proposal] = {}
        for method, reqs in by_method.items():
            proposer = self.proposer(method)
            t0 = time.perf_counter()
            proposals = self._drafts(proposer, method, batch, reqs)
            for (i, req), prop in zip(reqs, proposals, strict=True):
                try:
                    checked, problem = tree_proposal.checked(prop, req, self.vocab_size)
                except Exception:  # a proposal too broken to inspect: drafted nothing, the request goes on
                    checked, problem = None, "an unreadable proposal"
                if problem is not None:
                    logger.warning("proposer %s returned %s; dropped", method, problem)
                if checked is not None and not batch[i].seq.is_finished:
                    drafted[i] = checked
            steps = max(r.k for _, r in reqs) if proposer.autoregressive else 1
            self.cost_model.observe_draft(method, steps, time.perf_counter() - t0)
        return drafted

    def _grammar_draft(self, seq: Sequence, prop: Proposal | None, cap: int, budget: int) -> Proposal | None:
        """A constrained sequence's draft: the proposer's cut to what the grammar accepts, led by the
        tokens the grammar forces. Forced tokens are point masses; a proposer's tokens past them
        are kept only where its first path drafted exactly those tokens, so each kept token was drawn
        from the law its row reports given the tokens before it."""
        constraint = seq.constraint
        assert constraint is not None
        if prop is not None:
            if prop.parents is None:
                keep = list(range(constraint.valid_prefix(prop.token_ids)))
            else:
                keep = constraint.valid_nodes(prop.token_ids, prop.parents)
            if len(keep) < len(prop.token_ids):
                prop = tree_proposal.cut(prop, keep) if keep else None
        limit = min(cap, MAX_FORCED_DRAFT, max(0, budget)) if self.forced_drafts else 0
        forced = constraint.forced(limit)
        if not forced:
            return prop
        m = len(forced)
        if prop is not None:
            chain = tree_proposal.first_path(prop)
            rest = chain.token_ids[m:cap] if chain.token_ids[:m] == forced else []
            if rest:
                probs = None
                if chain.probs is not None:
                    point = torch.zeros(m, chain.probs.shape[1], dtype=chain.probs.dtype)  # [m, vocab]
                    point[torch.arange(m), torch.tensor(forced)] = 1.0
                    probs = torch.cat([point, chain.probs[m : m + len(rest)]])
                return Proposal([*forced, *rest], probs, num_forced=m)
        return Proposal(forced, num_forced=m)

    def _grow_trees(
        self,
        batch: list[ScheduledSequence],
        drafted: dict[int, Proposal],
        rooms: dict[int, int],
        scheduled: int,
        emitting: int,
        context: float,
    ) -> dict[int, Proposal]:
        """Drafts cut to the nodes worth verifying: a goodput-controlled tree keeps its first path (at
        most the k it was given deep, as checked) and the branch nodes that pay in this step; other
        trees keep what they have up to the KV room."""
        out: dict[int, Proposal] = {}
        trees: list[tuple[int, TreeCandidate]] = []
        tokens = scheduled
        for i, prop in drafted.items():
            spec = batch[i].seq.spec
            if prop.parents is None or spec is None:  # a chain (forced tokens need no controller)
                out[i] = prop if prop.parents is None else tree_proposal.first_path(prop)
                tokens += len(out[i].token_ids)
            elif spec.params.controller == "goodput":
                trees.append((i, TreeCandidate(spec, prop.parents, rooms[i], prop.scores)))
                tokens += min(len(draft_tree.first_path(prop.parents)), rooms[i])
            else:
                out[i] = tree_proposal.cut(prop, list(range(min(len(prop.token_ids), rooms[i]))))
        if trees:
            budget = max(0, self.max_num_batched_tokens - tokens)
            kept = grow_trees([t for _, t in trees], emitting, tokens, budget, self.cost_model, context)
            for (i, _), keep in zip(trees, kept, strict=True):
                out[i] = tree_proposal.cut(drafted[i], keep)
        return {i: p for i, p in sorted(out.items()) if p.token_ids}

    def _drafts(
        self,
        proposer: Proposer,
        method: str,
        batch: list[ScheduledSequence],
        reqs: list[tuple[int, ProposalRequest]],
    ) -> list[Proposal]:
        """One batched draft call; if it fails, each request is drafted alone and only the requests
        whose drafting fails are failed."""
        try:
            proposals = proposer.propose([r for _, r in reqs])
            if len(proposals) == len(reqs):
                return proposals
            raise RuntimeError(f"{len(proposals)} proposals for {len(reqs)} requests")
        except Exception:
            logger.exception("batched drafting with %s failed; drafting each request alone", method)
        out: list[Proposal] = []
        for i, req in reqs:
            try:
                out.append(proposer.propose([req])[0])
            except Exception as exc:
                self.fail(batch[i].seq, f"drafting with {method} failed ({type(exc).__name__})")
                out.append(Proposal([]))
        return out


def mean_context(chunks: Iterable[tuple[int, int]]) -> float:
    """Keys each new token attends to, on average, for (start, num_new_tokens) per sequence."""
    tokens = work = 0
    for start, n in chunks:
        tokens += n
        work += n * (start + n)
    return work / tokens if tokens else 0.0
