"""Lossless verification of drafted tokens (Leviathan et al., arXiv 2211.17192).

Vocabulary as in vLLM: drafted tokens the target agrees with are *accepted*; at the first
rejection one *recovered* token is drawn from the residual distribution; when every draft is
accepted, a *bonus* token is drawn from the target's next distribution. Either way each
verification emits accepted + 1 tokens, distributed exactly as the target would have sampled them.

`processed` must come from `engine.sampler.process_logits`, the same processing plain sampling
applies, and draft probabilities from the same processing of the draft's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verification:
    token_ids: list[int]  # accepted drafts, then one recovered or bonus token
    num_accepted: int


def verify_greedy(processed: torch.Tensor, draft: Sequence[int]) -> Verification:
    """processed: [k + 1, vocab]. Accept while each draft equals the target's argmax."""
    target = processed.argmax(dim=-1).tolist()  # [k + 1]
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return Verification([*draft[:n], target[n]], n)


def verify_sampled(
    processed: torch.Tensor,  # [k + 1, vocab] target logits after processing
    draft: Sequence[int],
    draft_probs: torch.Tensor | None,  # [k, vocab], or None for a point-mass proposer
    generator: torch.Generator | None,
) -> Verification:
    k = len(draft)
    p = processed.softmax(dim=-1)  # [k + 1, vocab]
    n = k
    if k:
        rows = torch.arange(k, device=p.device)
        tokens = torch.tensor(list(draft), device=p.device)
        p_draft = p[rows, tokens]  # [k]
        q_draft = draft_probs[rows, tokens] if draft_probs is not None else torch.ones_like(p_draft)
        u = torch.rand(k, generator=generator, device=p.device)
        # Accept token i with probability min(1, p / q), written without dividing by q.
        rejected = torch.nonzero(u * q_draft >= p_draft)
        if len(rejected):
            n = int(rejected[0, 0])
    if n < k:
        if draft_probs is not None:
            q = draft_probs[n]
        else:
            q = torch.zeros_like(p[n])
            q[draft[n]] = 1.0
        residual = (p[n] - q).clamp_(min=0.0)  # [vocab]
        # p == q up to rounding leaves no residual mass; then p itself is the right law.
        dist = residual if float(residual.sum()) > 0 else p[n]
    else:
        dist = p[k]
    extra = int(torch.multinomial(dist, 1, generator=generator).item())
    return Verification([*draft[:n], extra], n)
