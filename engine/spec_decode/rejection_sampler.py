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

from specgate.engine.sampler import draw
from specgate.engine.spec_decode.draft_tree import children


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
    extra = draw(dist, generator)
    return Verification([*draft[:n], extra], n)


@dataclass(slots=True)
class TreeVerification:
    token_ids: list[int]  # the accepted path's tokens, then one recovered or bonus token
    path: list[int]  # the accepted nodes, root's child first (len: the number accepted)


def verify_tree_greedy(
    processed: torch.Tensor,  # [n + 1, vocab]: row 0 the root's, row i + 1 node i's
    draft: Sequence[int],
    parents: Sequence[int],
) -> TreeVerification:
    """Walk down from the root while some child holds the target's argmax."""
    target = processed.argmax(dim=-1).tolist()  # [n + 1]
    kids = _children(draft, parents)
    path: list[int] = []
    node = -1
    while True:
        token = target[node + 1]
        nxt = kids.get(node, {}).get(token)
        if nxt is None:
            return TreeVerification([*(draft[i] for i in path), token], path)
        path.append(nxt)
        node = nxt


def verify_tree_sampled(
    processed: torch.Tensor,  # [n + 1, vocab] target logits after processing
    draft: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None,  # [n, vocab]: the law node i's token was drawn from, or None
    generator: torch.Generator | None,
) -> TreeVerification:
    """Multi-candidate rejection sampling (SpecInfer, arXiv 2305.09781; EAGLE's tree sampling).

    At each node on the walk the children are tried in order, child c with the law q_c its token was
    drawn from given the siblings before it (a point mass for a deterministic draft). With r the
    target's law at the node, c is accepted with probability min(1, r(x_c) / q_c(x_c)); a rejection
    replaces r by the normalized residual max(r - q_c, 0). When every child is rejected the emitted
    token is drawn from the last r. Each step is one speculative-sampling step against the residual
    left by the one before, so the emitted token follows the target's law exactly; for point masses
    this is drawing from r with the rejected children's tokens removed."""
    p = processed.softmax(dim=-1)  # [n + 1, vocab]
    kids = children(parents)
    path: list[int] = []
    node = -1
    while True:
        r = p[node + 1]
        for c in kids.get(node, []):
            x = draft[c]
            q_x = float(draft_probs[c, x]) if draft_probs is not None else 1.0
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * q_x < float(r[x]):  # accept with probability min(1, r(x) / q(x))
                path.append(c)
                node = c
                break
            if draft_probs is not None:
                residual = (r - draft_probs[c]).clamp_(min=0.0)
            else:
                residual = r.clone()
                residual[x] = 0.0
            total = float(residual.sum())
            # r == q_c up to rounding leaves no mass; r itself is then the right law.
            r = residual / total if total > 0 else r
        else:
            extra = draw(r, generator)
            return TreeVerification([*(draft[i] for i in path), extra], path)


def _children(draft: Sequence[int], parents: Sequence[int]) -> dict[int, dict[int, int]]:
    """Node -> {token: child}; the first child wins where two siblings hold one token."""
    out: dict[int, dict[int, int]] = {}
    for i, par in enumerate(parents):
        out.setdefault(par, {}).setdefault(int(draft[i]), i)
    return out


def verify_draft(
    processed: torch.Tensor,  # [n + 1, vocab] target logits after processing
    draft: Sequence[int],
    parents: Sequence[int] | None,  # None: a chain
    draft_probs: torch.Tensor | None,  # [n, vocab] or None (point masses)
    greedy: bool,
    generator: torch.Generator | None,
) -> TreeVerification:
    """Any non-empty draft, chain or tree, greedy or sampled: the emitted tokens and accepted nodes
    (for a chain, the first `num_accepted` positions)."""
    if parents is not None:
        if greedy:
            return verify_tree_greedy(processed, draft, parents)
        return verify_tree_sampled(processed, draft, parents, draft_probs, generator)
    chain = (
        verify_greedy(processed, draft)
        if greedy
        else verify_sampled(processed, draft, draft_probs, generator)
    )
    return TreeVerification(chain.token_ids, list(range(chain.num_accepted)))
