"""Logits processing and sampling, in one place.

Speculative verification (lossless rejection sampling) must compare the target and draft
distributions after exactly the processing plain sampling applies, so both go through
`process_logits`. Rows are independent: each row carries its own parameters and token history,
and random rows draw from their own generator, so a seeded request samples the same tokens
whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgate.engine.outputs import TokenLogprob
from specgate.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One position to sample: the request's parameters and the tokens before that position."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt followed by the output so far
    num_prompt_tokens: int
    generator: torch.Generator | None
    # Tokens that must not be drawn here, e.g. EOS and stop tokens before min_tokens is reached.
    suppress_token_ids: Sequence[int] = ()
    # [vocab] bool: the tokens a grammar allows here (engine/structured_output/constraint.py); None:
    # all of them.
    allowed: torch.Tensor | None = None


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        device = logits.device
        if p.repetition_penalty != 1.0 and row.token_ids:
            seen = torch.tensor(sorted(set(row.token_ids)), device=device)  # [num_distinct]
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        output = row.token_ids[row.num_prompt_tokens :]
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output, device=device), minlength=vocab)[:vocab]  # [vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if not bias:
            continue
        # Ids past this vocabulary are refused at the edge; a bias for one is a no-op here.
        items = [(t, v) for t, v in bias.items() if t < vocab]
        if items:
            ids = torch.tensor([t for t, _ in items], device=logits.device)  # [num_biased]
            logits[i, ids] += torch.tensor([v for _, v in items], device=logits.device)


def _mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
    ranks = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the tokens ranked above it already cover top_p; the best is always kept.
    # Rows at top_p = 1 skip this: in float32 the cumulative sum reaches 1.0 before the tail.
    covered = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop |= covered & (top_p < 1.0).unsqueeze(1)
    # The best token always stays: a top_p below float32's smallest value (5e-324 rounds to 0)
    # would otherwise mask every token of the row.
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Penalties, logit bias, temperature, top-k, top-p and min-p; float32 logits with -inf masks.

    logits: [n, vocab] raw model output for the n rows.
    """
    logits = logits.float().clone()  # [n, vocab]
    _apply_penalties(logits, rows)
    _apply_logit_bias(logits, rows)
    for i, row in enumerate(rows):
        if row.suppress_token_ids:
            logits[i, list(row.suppress_token_ids)] = float("-inf")
        if row.allowed is not None:
            # The masked law: grammar-invalid tokens go before temperature, top-k, top-p and min-p,
            # which then act on the tokens the grammar allows.
            logits[i].masked_fill_(~row.allowed[: logits.shape[-1]], float("-inf"))
    vocab = logits.shape[-1]
    device = logits.device
    temps = [1.0 if r.params.greedy else r.params.temperature for r in rows]
    if any(t != 1.0 for t in temps):
        logits /= torch.tensor(temps, device=device).unsqueeze(1)
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _mask_top_k_top_p(
            logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device)
        )
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


_DRAW_BLOCK = 1024  # entries per block of the two-level cumulative sum in `draw`


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn from the law `probs` [vocab] (non-negative, any positive finite total) by
    inverting its cumulative sum, in float64, at one uniform draw of `generator`: the sum of each
    block of entries, then the sum within the one block the draw falls in. torch.multinomial over a
    152k vocabulary took ~2.4 ms a draw on two CPU cores (a tenth of a 1.5B model's decode step), a
    float64 cumulative sum over all of it ~0.8 ms; this takes under 0.1 ms. An index of probability
    0 is never drawn: it adds nothing to the sum."""
    p = probs.reshape(-1)  # [vocab]
    n = p.numel()
    full = n - n % _DRAW_BLOCK
    # Block sums straight into float64: a float64 copy of the whole law (and its padding) cost more
    # than the rest together, most of it in page faults.
    sums = p[:full].view(-1, _DRAW_BLOCK).sum(dim=1, dtype=torch.float64)  # [num_full_blocks]
    if full < n:
        sums = torch.cat([sums, p[full:].sum(dtype=torch.float64).reshape(1)])
    ends = sums.cumsum(0)  # [num_blocks]: the cumulative sum at each block's end
    total = float(ends[-1])
    if not (total > 0 and math.isfinite(total)):
        raise RuntimeError(f"cannot draw from a distribution whose total is {total}")
    x = torch.rand((), generator=generator, dtype=torch.float64, device=probs.device) * total
    b = int(torch.searchsorted(ends, x.reshape(1), right=True))
    if b < len(ends):
        block = p[b * _DRAW_BLOCK : (b + 1) * _DRAW_BLOCK]
        inside = block.double().cumsum(0) + (ends[b - 1] if b else 0.0)  # [block]
        j = int(torch.searchsorted(inside, x.reshape(1), right=True))
        if j < len(block):
            return b * _DRAW_BLOCK + j
    # x rounded up to a block's end (u * total can reach the total): the last index up to that block
    # holding mass.
    return int(torch.nonzero(p[: (min(b, len(ends) - 1) + 1) * _DRAW_BLOCK] > 0)[-1])


def sample(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Draw one token per row from processed logits [n, vocab]; greedy rows take the argmax."""
    greedy = processed.argmax(dim=-1).tolist()
    out: list[int] = []
    probs: torch.Tensor | None = None
    for i, row in enumerate(rows):
        if row.params.greedy:
            out.append(int(greedy[i]))
            continue
        if probs is None:
            probs = processed.softmax(dim=-1)  # [n, vocab]
        out.append(draw(probs[i], row.generator))
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], rows: Sequence[SamplingRow]
) -> list[TokenLogprob | None]:
    """Logprobs of the chosen tokens under the raw model distribution (vLLM's default mode)."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return result
    logp = torch.log_softmax(logits[wanted].float(), dim=-1)  # [len(wanted), vocab]
    max_top = max(rows[i].params.logprobs or 0 for i in wanted)
    top_vals, top_ids = logp.topk(max_top, dim=-1) if max_top else (None, None)
    for j, i in enumerate(wanted):
        tok = int(token_ids[i])
        n_top = rows[i].params.logprobs or 0
        top: list[tuple[int, float]] = []
        if n_top and top_vals is not None and top_ids is not None:
            top = list(zip(top_ids[j, :n_top].tolist(), top_vals[j, :n_top].tolist(), strict=True))
        result[i] = TokenLogprob(token_id=tok, logprob=float(logp[j, tok]), top=top)
    return result
