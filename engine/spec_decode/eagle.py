"""EAGLE proposer: drafts in feature space from the target's own final hidden states.

Per request it keeps the target's verified features and the head's keys / values over the real
(token, feature) pairs. To draft after committed tokens x_0 .. x_n it first runs the head over
the pairs it has not seen, (x_{i+1}, f_i) up to i = n - 1, then feeds its own predicted feature
back k - 1 times. Draft positions are never kept: the next call rewinds the head's cache to the
real pairs (a slice, no copy), so a rejection costs nothing to undo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specgate.engine.model_runner import ModelRunner
from specgate.engine.sampler import process_logits
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
        """Draft logits [1, vocab] for one predicted feature; -inf outside the draft vocabulary."""
        if self.draft_rows is None or self.draft_ids is None:
            logits: torch.Tensor = self.lm_head(feature.unsqueeze(0)).float()[:, : self.vocab_size]
            return logits
        sub = (self.draft_rows @ feature).float()  # [n_draft]
        full = sub.new_full((1, self.vocab_size), float("-inf"))
        full[0, self.draft_ids] = sub
        return full

    def _propose_one(self, r: ProposalRequest) -> Proposal:
        st = self._states.get(r.request_id)
        n = len(r.token_ids) - 1  # x_n: the newest committed token, not yet seen by the target
        if st is None or r.k <= 0 or len(st.features) < n or n < 1:
            return Proposal([])
        # Catch the head up on real pairs (x_{i+1}, f_i), i = num_real .. n - 1.
        lo = st.num_real
        feats = torch.stack(st.features[lo:n])  # [n - lo, hidden]
        predicted = self._step(st, r.token_ids[lo + 1 : n + 1], feats, lo)
        st.num_real = n
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


def _plain_lm_weight(runner: ModelRunner) -> torch.Tensor | None:
    """The LM head's weight as a plain [vocab, hidden] tensor: its own, or the tied embeddings'."""
    own = getattr(runner.lm_head(), "weight", None)
    if isinstance(own, torch.Tensor):
        return own
    tied = getattr(runner.model.config, "tie_word_embeddings", False)
    embeddings = getattr(runner.embed_tokens(), "weight", None)
    return embeddings if tied and isinstance(embeddings, torch.Tensor) else None
