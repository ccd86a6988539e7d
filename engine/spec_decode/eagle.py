"""EAGLE proposer: drafts in feature space from the target's own final hidden states.

Per request it keeps the target's verified features and the head's keys / values over the real
(token, feature) pairs. To draft after committed tokens x_0 .. x_n it first runs the head over
the pairs it has not seen, (x_{i+1}, f_i) up to i = n - 1, then feeds its own predicted feature
back k - 1 times. Draft positions are never kept: the next call rewinds the head's cache to the
real pairs (a slice, no copy), so a rejection costs nothing to undo.

With a node budget it drafts an EAGLE-2 dynamic tree (arXiv 2406.16858): at each depth the nodes
with the highest cumulative draft probability are expanded together in one head call (each sees
the real pairs and its own ancestors), each into its most likely children; at the end all nodes are
reranked by cumulative probability and the best `max_nodes` kept. The tree is a deterministic
function of the context, so verification treats its tokens as point masses, sampled or greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specgate.engine.model_runner import ModelRunner
from specgate.engine.sampler import process_logits
from specgate.engine.spec_decode.draft_tree import depth_first, path_to, reorder, subtree
from specgate.engine.spec_decode.eagle_head import EagleHead
from specgate.engine.spec_decode.eagle_io import default_head_dir, load_head
from specgate.engine.spec_decode.proposer import (
    Proposal,
    ProposalRequest,
    ProposerContext,
    draft_row,
    draw_draft,
)


@dataclass(slots=True)
class _State:
    features: list[torch.Tensor] = field(default_factory=list)  # [hidden] per verified position
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # head keys / values [1, KV, s, d]
    num_real: int = 0  # head positions in `kv` that came from real pairs (drafts come after)


class EagleProposer:
    autoregressive = True
    needs_hidden = True
    drafts_past_extra = False

    def __init__(self, ctx: ProposerContext) -> None:
        runner = ctx.runner
        if runner is None or not runner.has_features:
            raise ValueError(
                "the eagle proposer needs the target's final hidden states, which this model lacks"
            )
        path = ctx.options.get("head") or default_head_dir(ctx.model_name)
        if path is None:
            raise ValueError(
                f"no EAGLE head for {ctx.model_name!r}: set proposer_options['eagle']['head'] to a head "
                "directory, or train one with `specgate eagle train`"
            )
        head, _ = load_head(Path(path), runner.hidden_size, runner.vocab_size)
        dtype = next(runner.model.parameters()).dtype
        self.head: EagleHead = head.to(device=ctx.device, dtype=dtype)
        self.embed = runner.embed_tokens()
        self.lm_head = runner.lm_head()
        self.vocab_size = ctx.vocab_size
        # With a draft vocabulary, drafts score only those rows of the LM head (a gathered copy of
        # them; the full head stays the target's). Without a plain weight to gather from (a
        # prepacked, untied LM head) the full head is used.
        self.draft_ids: torch.Tensor | None = None
        self.draft_rows: torch.Tensor | None = None
        if head.draft_vocab is not None:
            weight = _plain_lm_weight(runner)
            if weight is not None:
                self.draft_ids = head.draft_vocab.to(ctx.device)
                self.draft_rows = weight[self.draft_ids].clone()  # [n_draft, hidden]
        self.device = ctx.device
        # Trees: children drawn per expanded node, nodes expanded per depth.
        self.tree_branch = int(ctx.options.get("tree_branch", 4))
        self.tree_expand = int(ctx.options.get("tree_expand", 4))
        if self.tree_branch < 1 or self.tree_expand < 1:
            raise ValueError("eagle proposer needs tree_branch >= 1 and tree_expand >= 1")
        self._states: dict[str, _State] = {}

    def start(self, request_id: str, token_ids: Sequence[int], scope: str | None = "") -> None:
        self._states[request_id] = _State()

    def observe_hidden(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        st = self._states.get(request_id)
        if st is None:
            return
        if start < len(st.features):  # recomputed after preemption: features from `start` on are new
            del st.features[start:]
            st.num_real = min(st.num_real, start)
        if start != len(st.features):
            return  # a gap should not happen; drafting simply stops until features line up again
        st.features.extend(hidden.detach().clone().unbind(0))

    def commit(self, request_id: str, token_ids: Sequence[int], num_new: int) -> None:
        pass  # features arrive through observe_hidden; the next propose() catches the head up

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[Proposal]:
        return [self._propose_one(r) for r in requests]

    def _step(self, st: _State, tokens: Sequence[int], features: torch.Tensor, start: int) -> torch.Tensor:
        """Run the head over pairs at head positions start .. start + t - 1; its last predicted feature."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, t]
        embeds = self.embed(ids)  # [1, t, hidden]
        positions = torch.arange(start, start + len(tokens), device=self.device)
        past = None if st.kv is None else (st.kv[0][:, :, :start], st.kv[1][:, :, :start])
        out, st.kv = self.head(embeds, features.unsqueeze(0), positions, past)
        last: torch.Tensor = out[0, -1]  # [hidden]
        return last

    def _logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Draft logits [t, vocab] for predicted features [t, hidden] (or [hidden]: [1, vocab]); -inf
        outside the draft vocabulary."""
        features = feature.view(-1, feature.shape[-1])  # [t, hidden]
        if self.draft_rows is None or self.draft_ids is None:
            logits: torch.Tensor = self.lm_head(features).float()[:, : self.vocab_size]
            return logits
        sub = (features @ self.draft_rows.T).float()  # [t, n_draft]
        full = sub.new_full((features.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_ids] = sub
        return full

    def _propose_one(self, r: ProposalRequest) -> Proposal:
        st = self._states.get(r.request_id)
        n = len(r.token_ids) - 1  # x_n: the newest committed token, not yet seen by the target
        if st is None or r.k <= 0 or len(st.features) < n or n < 1:
            return Proposal([])
        # Catch the head up on real pairs (x_{i+1}, f_i), i = num_real .. n - 1; at least the last one,
        # whose prediction starts the draft (a second call without new tokens recomputes it).
        lo = min(st.num_real, n - 1)
        feats = torch.stack(st.features[lo:n])  # [n - lo, hidden]
        predicted = self._step(st, r.token_ids[lo + 1 : n + 1], feats, lo)
        st.num_real = n
        if r.max_nodes > r.k:
            return self._tree(r, st, predicted, n)
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            row = draft_row(r, drafts)
            processed = process_logits(self._logits(predicted), [row])[0]  # [vocab]
            token, q = draw_draft(processed, row)
            if q is not None:
                probs.append(q)
            drafts.append(token)
            if len(drafts) >= r.k:
                break
            # The next draft position: (the draft just made, the feature the head predicted for it).
            predicted = self._step(st, [token], predicted.unsqueeze(0), n + len(drafts) - 1)
        return Proposal(drafts, torch.stack(probs) if probs else None)

    def _tree(self, r: ProposalRequest, st: _State, predicted: torch.Tensor, n: int) -> Proposal:
        """An EAGLE-2 tree at most r.k deep and r.max_nodes large after the head's catch-up to x_n
        (`predicted`: its feature for position n)."""
        tokens: list[int] = []
        parents: list[int] = []
        cum: list[float] = []  # cumulative draft probability of each node's path
        depth: list[int] = []
        kv_of: dict[int, int] = {}  # expanded node -> its entry in the head's cache
        frontier, feats = [-1], predicted.unsqueeze(0)  # nodes to draw children for; [f, hidden]
        for d in range(1, r.k + 1):
            rows = [draft_row(r, [tokens[i] for i in path_to(parents, node)]) for node in frontier]
            probs = process_logits(self._logits(feats), rows).softmax(dim=-1)  # [f, vocab]
            top_p, top_i = probs.topk(min(self.tree_branch, probs.shape[-1]), dim=-1)  # [f, branch]
            born: list[int] = []
            for f, node in enumerate(frontier):
                base = 1.0 if node < 0 else cum[node]
                for p, t in zip(top_p[f].tolist(), top_i[f].tolist(), strict=True):
                    if p <= 0.0:
                        break
                    born.append(len(tokens))
                    tokens.append(int(t))
                    parents.append(node)
                    cum.append(base * p)
                    depth.append(d)
            if d == r.k or not born:
                break
            expand = sorted(born, key=lambda i: -cum[i])[: self.tree_expand]
            assert st.kv is not None
            kv_len = st.kv[0].shape[2]
            ids = torch.tensor([[tokens[i] for i in expand]], dtype=torch.long, device=self.device)  # [1, t]
            parent_feats = feats[[frontier.index(parents[i]) for i in expand]]  # [t, hidden]
            positions = torch.tensor([n + depth[i] - 1 for i in expand], device=self.device)
            mask = _tree_step_mask(n, kv_len, expand, parents, kv_of).to(self.device)
            out, st.kv = self.head(self.embed(ids), parent_feats.unsqueeze(0), positions, st.kv, mask)
            kv_of.update({node: kv_len + j for j, node in enumerate(expand)})
            frontier, feats = expand, out[0]  # [t, hidden]
        # Rerank: the best max_nodes by path probability (a parent never ranks below its child).
        best = sorted(range(len(tokens)), key=lambda i: (-cum[i], depth[i], i))[: r.max_nodes]
        keep = sorted(best)
        kept_parents = subtree(parents, keep)
        order = depth_first(kept_parents)
        ordered, ordered_parents = reorder([tokens[i] for i in keep], kept_parents, order)
        # A node's draft probability given its parent: its path's over its parent's.
        conditional = [cum[i] / (1.0 if parents[i] < 0 else cum[parents[i]]) for i in keep]
        return Proposal(ordered, None, ordered_parents, [conditional[j] for j in order])


def _tree_step_mask(
    num_real: int, kv_len: int, rows: list[int], parents: list[int], kv_of: dict[int, int]
) -> torch.Tensor:
    """[t, kv_len + t] bool for a head call over tree nodes `rows`: each sees the real pairs, the head
    entries of its ancestors (all expanded before it) and itself."""
    t = len(rows)
    mask = torch.zeros(t, kv_len + t, dtype=torch.bool)
    mask[:, :num_real] = True
    for j, node in enumerate(rows):
        mask[j, kv_len + j] = True
        a = parents[node]
        while a >= 0:
            mask[j, kv_of[a]] = True
            a = parents[a]
    return mask


def _plain_lm_weight(runner: ModelRunner) -> torch.Tensor | None:
    """The LM head's weight as a plain [vocab, hidden] tensor: its own, or the tied embeddings'."""
    own = getattr(runner.lm_head(), "weight", None)
    if isinstance(own, torch.Tensor):
        return own
    tied = getattr(runner.model.config, "tie_word_embeddings", False)
    embeddings = getattr(runner.embed_tokens(), "weight", None)
    return embeddings if tied and isinstance(embeddings, torch.Tensor) else None
