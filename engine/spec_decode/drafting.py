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
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, field

import torch

from specgate.engine.block_manager import BlockManager
from specgate.engine.scheduler import ScheduledSequence
from specgate.engine.sequence import Sequence
from specgate.engine.spec_decode import draft_tree, tree_proposal
from specgate.engine.spec_decode.controller import Candidate, SpecState, TreeCandidate, choose_k, grow_trees
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
    # Each speculating sequence's controller state, by seq_id (the engine's Speculation keeps them).
    states: Mapping[str, SpecState] = field(default_factory=dict)

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
        forced = self._forced(batch, constrained, caps, self.max_num_batched_tokens - scheduled_tokens)
        drafted, past = self._proposals(batch, speculating, caps, forced, scheduled_tokens, emitting, context)
        for i in constrained:
            seq = batch[i].seq
            if seq.is_finished:
                continue
            try:
                prop = self._grammar_draft(seq, drafted.pop(i, None), forced.get(i, []), i in past)
            except Exception as exc:
                self._grammar_failed(seq, exc)
                continue
            if prop is not None:
                drafted[i] = prop
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

    def _forced(
        self, batch: list[ScheduledSequence], constrained: list[int], caps: dict[int, int], budget: int
    ) -> dict[int, list[int]]:
        """Per constrained sequence, the tokens its grammar forces next (up to MAX_FORCED_DRAFT and
        what the step's token budget leaves)."""
        out: dict[int, list[int]] = {}
        if not self.forced_drafts:
            return out
        for i in constrained:
            seq = batch[i].seq
            assert seq.constraint is not None
            try:
                out[i] = seq.constraint.forced(min(caps[i], MAX_FORCED_DRAFT, max(0, budget)))
            except Exception as exc:
                self._grammar_failed(seq, exc)
                continue
            budget -= len(out[i])
        return out

    def _grammar_failed(self, seq: Sequence, exc: Exception) -> None:
        """A grammar that fails while drafting ends its own request; the step goes on."""
        logger.exception("request %s failed while its grammar drafted", seq.seq_id)
        self.fail(seq, f"the grammar failed while drafting ({type(exc).__name__}: {exc})")

    def _proposals(
        self,
        batch: list[ScheduledSequence],
        speculating: list[int],
        caps: dict[int, int],
        forced: dict[int, list[int]],
        scheduled_tokens: int,
        emitting: int,
        context: float,
    ) -> tuple[dict[int, Proposal], set[int]]:
        """The proposers' checked drafts for the speculating sequences, k chosen by their controllers,
        and which of them were drafted past their grammar's forced tokens (a lookup proposer reads
        them as context: `drafts_past_extra`)."""
        past: set[int] = set()
        speculating = [i for i in speculating if not batch[i].seq.is_finished]
        if not speculating:
            return {}, past
        candidates = []
        for i in speculating:
            seq = batch[i].seq
            assert seq.spec is not None
            method = seq.spec.method
            state = self.states[seq.seq_id]
            candidates.append(Candidate(state, method, self.proposer(method).autoregressive, caps[i]))
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
                extra = forced.get(i, []) if self.proposer(c.method).drafts_past_extra else []
                k = min(k, caps[i] - len(extra))
                if k <= 0:
                    continue
                if extra:
                    past.add(i)
                # Deterministic mode keeps fixed attention tiles per sequence: chains only.
                nodes = 0 if self.deterministic else c.state.params.max_tree_nodes
                row = sampling_row(seq, [], self.eos_token_ids)
                req = ProposalRequest(
                    seq.seq_id, seq.token_ids, seq.num_prompt_tokens, k, row, nodes, seq.constraint, extra
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
        return drafted, past

    def _grammar_draft(
        self, seq: Sequence, prop: Proposal | None, forced: list[int], past: bool
    ) -> Proposal | None:
        """A constrained sequence's draft: led by the tokens its grammar forces (point masses), then
        the proposer's, cut to what the grammar accepts. A proposer that drafted past the forced
        tokens (`past`) continues them; otherwise its tokens past them are kept only where its first
        path drafted exactly those tokens. Either way each kept token was drawn from the law its row
        reports given the tokens before it."""
        constraint = seq.constraint
        assert constraint is not None
        m = len(forced)
        if prop is not None and m and past:
            prop = _after(forced, prop)
        elif prop is not None and m:
            # Checked proposals are at most k <= the sequence's cap deep: no cut is needed here.
            chain = tree_proposal.first_path(prop)
            prop = (
                _with_forced(chain, m) if chain.token_ids[:m] == forced and len(chain.token_ids) > m else None
            )
        if prop is None:
            return Proposal(forced, num_forced=m) if m else None
        if prop.parents is None:
            keep = list(range(constraint.valid_prefix(prop.token_ids)))
        else:
            keep = constraint.valid_nodes(prop.token_ids, prop.parents)
        if len(keep) < len(prop.token_ids):
            prop = tree_proposal.cut(prop, keep) if keep else None
        return prop

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
            state = self.states.get(batch[i].seq.seq_id)
            if prop.parents is None or state is None:  # a chain (forced tokens need no controller)
                out[i] = prop if prop.parents is None else tree_proposal.first_path(prop)
                tokens += len(out[i].token_ids)
            elif state.params.controller == "goodput":
                trees.append((i, TreeCandidate(state, prop.parents, rooms[i], prop.scores)))
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


def _point_masses(tokens: list[int], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    point = torch.zeros(len(tokens), vocab, dtype=dtype)  # [len(tokens), vocab]
    point[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return point


def _with_forced(prop: Proposal, m: int) -> Proposal:
    """A chain whose first m tokens are the forced ones: their rows become point masses."""
    probs = prop.probs
    if probs is not None:
        probs = torch.cat([_point_masses(prop.token_ids[:m], probs.shape[1], probs.dtype), probs[m:]])
    return Proposal(prop.token_ids, probs, num_forced=m)


def _after(forced: list[int], prop: Proposal) -> Proposal:
    """One draft of the forced tokens (a chain of point masses) with `prop`, drafted after them,
    hanging from the last one."""
    m = len(forced)
    probs = prop.probs
    if probs is not None:
        probs = torch.cat([_point_masses(forced, probs.shape[1], probs.dtype), probs])
    tokens = [*forced, *prop.token_ids]
    if prop.parents is None:
        return Proposal(tokens, probs, num_forced=m)
    parents = [*draft_tree.chain_parents(m), *(p + m if p >= 0 else m - 1 for p in prop.parents)]
    scores = [1.0] * m + list(prop.scores) if prop.scores is not None else None
    return Proposal(tokens, probs, parents, scores, m)


def mean_context(chunks: Iterable[tuple[int, int]]) -> float:
    """Keys each new token attends to, on average, for (start, num_new_tokens) per sequence."""
    tokens = work = 0
    for start, n in chunks:
        tokens += n
        work += n * (start + n)
    return work / tokens if tokens else 0.0
