"""Speculative decoding of a grammar-constrained request follows the masked law, and planted bugs
in the masking do not.

A fake token automaton (six tokens, a DFA with free, two-way and forced states) plugs into the real
`Constraint` through a fake matcher; a fake target and a fake draft model give fixed logits per
token history. Each speculative step runs the engine's own pieces: a proposer drafts (a point-mass
argmax chain, a chain sampled under the mask, a tree whose siblings are sampled under the mask
without replacement, or a point-mass tree), `Drafter._grammar_draft` cuts the draft and puts the
forced tokens first, `sampling_row` masks each verification row for its own prefix
(`tree_proposal.histories`), then `process_logits` and `verify_draft`. The first tokens emitted over
many steps from a fixed prefix are compared by chi-square with the exact law: the product of masked
conditionals of the fake target. Greedy requests must emit the masked argmax chain.

The mutation checks plant three bugs on the same path and require the same check to fail: a
verification row masked for its parent's prefix instead of its own, a draft reported with its
unmasked law q while drawn from the masked one, and target rows left unmasked.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import cache
from typing import cast

import pytest
import torch
from llguidance import LLMatcher
from scipy.stats import chisquare

from specgate.engine.block_manager import BlockManager
from specgate.engine.outputs import RequestStats
from specgate.engine.sampler import SamplingRow, process_logits, sample
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.sequence import Sequence
from specgate.engine.spec_decode.drafting import Drafter
from specgate.engine.spec_decode.proposer import (
    Proposal,
    ProposalRequest,
    Proposer,
    draft_row,
    draw_draft,
)
from specgate.engine.spec_decode.rejection_sampler import verify_draft
from specgate.engine.spec_decode.tree_proposal import histories
from specgate.engine.stop_rules import sampling_row
from specgate.engine.structured_output.constraint import Constraint, ConstraintError

VOCAB = 6
# The automaton over the output: state -> {allowed token: next state}. State 1 forces 4, state 4
# forces 1; the others allow two to four tokens, with different sets in neighbouring states.
TRANSITIONS: dict[int, dict[int, int]] = {
    0: {0: 1, 2: 2, 3: 3, 5: 3},
    1: {4: 2},
    2: {0: 0, 1: 3, 4: 0},
    3: {2: 0, 5: 4},
    4: {1: 2},
}
PROMPT = (3, 1, 4)  # context for the fake models; the grammar covers the output only
FREE_START: tuple[int, ...] = ()  # state 0: four tokens allowed
FORCED_START: tuple[int, ...] = (0,)  # state 1: the grammar forces 4, then state 2
K = 3  # chain drafts' length and trees' depth bound
LENGTH = 3  # emitted tokens compared with the exact law
TEMPERATURE = 0.9
NO_EOS: frozenset[int] = frozenset()
ARGMAX_NUDGE = 2.0  # about 80% of the argmax proposer's tokens are grammar-valid
SAMPLES = 1500  # runs per correct case: 9 to 27 outcomes, p-values spread evenly over seeds
MUTATED_SAMPLES = 400  # per planted bug: p-values below 1e-50 over seeds
INVALID = -1  # marks an outcome in which a grammar-invalid token was emitted


# ---- the fake automaton and models ----------------------------------------------------------------


def state_after(output: Seq[int]) -> int | None:
    """The automaton's state after `output`; None once a token was invalid."""
    state = 0
    for t in output:
        nxt = TRANSITIONS[state].get(t)
        if nxt is None:
            return None
        state = nxt
    return state


class FakeMatcher:
    """The LLMatcher methods `Constraint` uses, over TRANSITIONS (a stack of states rolls back)."""

    def __init__(self) -> None:
        self._states = [0]
        self._error = ""

    def is_error(self) -> bool:
        return bool(self._error)

    def get_error(self) -> str:
        return self._error

    def validate_tokens(self, tokens: Seq[int]) -> int:
        state, n = self._states[-1], 0
        for t in tokens:
            if t not in TRANSITIONS[state]:
                break
            state, n = TRANSITIONS[state][t], n + 1
        return n

    def consume_tokens(self, tokens: Seq[int]) -> bool:
        if self._error or self.validate_tokens(tokens) != len(tokens):
            self._error = f"tokens {list(tokens)} refused"
            return False
        for t in tokens:
            self._states.append(TRANSITIONS[self._states[-1]][t])
        return True

    def rollback(self, n: int) -> bool:
        if n >= len(self._states):
            return False
        del self._states[len(self._states) - n :]
        return True

    def compute_bitmask(self) -> bytes:
        return sum(1 << t for t in TRANSITIONS[self._states[-1]]).to_bytes(4, "little")

    def compute_logit_bias(self) -> bytes:
        return bytes(200 if t in TRANSITIONS[self._states[-1]] else 0 for t in range(VOCAB))

    def compute_ff_tokens(self) -> list[int]:
        out: list[int] = []
        state = self._states[-1]
        while len(TRANSITIONS[state]) == 1 and len(out) < 32:
            ((token, state),) = TRANSITIONS[state].items()
            out.append(token)
        return out

    def is_stopped(self) -> bool:
        return False


def _seeded_logits(tokens: tuple[int, ...], salt: int, scale: float) -> torch.Tensor:
    code = salt
    for t in tokens:
        code = (code * 31 + t + 1) % (2**61 - 1)
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(code), dtype=torch.float64) * scale


@cache
def target_logits(tokens: tuple[int, ...]) -> torch.Tensor:
    """[vocab] float64: the fake target's raw logits after `tokens` (prompt and output)."""
    return _seeded_logits(tokens, 1, 1.6)


@cache
def draft_logits(tokens: tuple[int, ...]) -> torch.Tensor:
    """[vocab] float64: the fake draft model's raw logits, loosely tied to the target's."""
    return 0.4 * target_logits(tokens) + _seeded_logits(tokens, 2, 1.6)


def masked_law(logits: torch.Tensor, allowed: Seq[int], temperature: float, top_k: int = 0) -> torch.Tensor:
    """[vocab] float64, by hand: tokens outside `allowed` removed, then temperature, then the top_k
    best of the allowed tokens (0: all)."""
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[list(allowed)] = True
    logits = logits.masked_fill(~keep, -math.inf) / temperature
    if 0 < top_k < len(allowed):
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
    return logits.softmax(-1)


def masked_conditional(output: tuple[int, ...], temperature: float, top_k: int = 0) -> torch.Tensor:
    """[vocab] float64: the target's masked law after PROMPT + output."""
    state = state_after(output)
    assert state is not None
    return masked_law(target_logits((*PROMPT, *output)), list(TRANSITIONS[state]), temperature, top_k)


def exact_law(start: tuple[int, ...], length: int, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The law of the next `length` output tokens after `start`: products of masked conditionals."""
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        nxt: dict[tuple[int, ...], float] = {}
        for seq, prob in law.items():
            cond = masked_conditional((*start, *seq), params.temperature, params.top_k)
            for t in cond.nonzero().flatten().tolist():
                nxt[(*seq, t)] = prob * float(cond[t])
        law = nxt
    return law


def masked_argmax_chain(start: tuple[int, ...], length: int) -> list[int]:
    out: list[int] = []
    for _ in range(length):
        out.append(int(masked_conditional((*start, *out), 1.0).argmax()))
    return out


# ---- one speculative step, as the engine takes it -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Bugs:
    """Planted mutations of the masking (all False: the engine's path)."""

    wrong_prefix_mask: bool = False  # a verification row masked for its parent's prefix
    unmasked_q: bool = False  # a sampled draft's reported q: the draft law before masking
    unmasked_target: bool = False  # verification rows not masked at all


PROPOSERS = ("argmax_chain", "sampled_chain", "sampled_tree", "top_tree")
# Per node of the sampled and top trees: how many children to give it, in depth-first order (the
# root's two children, then the first child's two and the second child's one).
TREE_SHAPE = {(): 2, (0,): 2, (1,): 1}


def _no_proposer(method: str) -> Proposer:
    raise AssertionError(f"no proposer table in this test ({method})")


def _no_failure(seq: Sequence, message: str) -> None:
    raise AssertionError(message)


DRAFTER = Drafter(
    block_manager=BlockManager(1, 16),
    proposer=_no_proposer,
    fail=_no_failure,
    vocab_size=VOCAB,
    max_model_len=1024,
    max_num_batched_tokens=1024,
    deterministic=False,
    eos_token_ids=NO_EOS,
)


def new_sequence(start: tuple[int, ...], params: SamplingParams, generator: torch.Generator) -> Sequence:
    constraint = Constraint(cast(LLMatcher, FakeMatcher()), VOCAB)
    constraint.advance(start)
    return Sequence(
        "r",
        [*PROMPT, *start],
        len(PROMPT),
        params,
        generator,
        RequestStats(0.0, len(PROMPT)),
        constraint=constraint,
    )


# (token history, temperature, top_k, masked) -> the processed draft logits: a pure function of them,
# since the mask is the automaton's after the history's output.
_DRAFT_LAWS: dict[tuple[tuple[int, ...], float, int, bool], torch.Tensor] = {}


def _draft_law(req: ProposalRequest, drafts: list[int], masked: bool) -> tuple[torch.Tensor, SamplingRow]:
    """Processed draft logits [vocab] for the position after `drafts` (under the mask, or not), and
    the masked draft row (draft_row, as the draft-model proposer builds it)."""
    row = draft_row(req, drafts)
    key = (tuple(row.token_ids), row.params.temperature, row.params.top_k, masked)
    if key not in _DRAFT_LAWS:
        use = row if masked else SamplingRow(row.params, row.token_ids, row.num_prompt_tokens, row.generator)
        _DRAFT_LAWS[key] = process_logits(draft_logits(key[0]).unsqueeze(0), [use])[0]
    return _DRAFT_LAWS[key], row


def _chain(req: ProposalRequest, bugs: Bugs) -> Proposal:
    """K tokens sampled from the masked draft law (the argmax for a greedy request)."""
    tokens: list[int] = []
    probs: list[torch.Tensor] = []
    for _ in range(req.k):
        processed, row = _draft_law(req, tokens, masked=True)
        token, q = draw_draft(processed, row)
        if q is not None:
            probs.append(_draft_law(req, tokens, masked=False)[0].softmax(-1) if bugs.unmasked_q else q)
        tokens.append(token)
    return Proposal(tokens, torch.stack(probs) if probs else None)


def _siblings(
    req: ProposalRequest, path: list[int], count: int, point_mass: bool, bugs: Bugs
) -> list[tuple[int, torch.Tensor | None]]:
    """Up to `count` children after `path`: the best tokens of the masked draft law (point masses),
    or draws without replacement from it, each with the law it was drawn from given the siblings
    before it (the unmasked law, equally conditioned, under `bugs.unmasked_q`)."""
    processed, row = _draft_law(req, path, masked=True)
    q = processed.softmax(-1)
    if point_mass or row.params.greedy:
        top = q.topk(count)
        return [(int(t), None) for p, t in zip(top.values, top.indices, strict=True) if p > 0]
    reported = _draft_law(req, path, masked=False)[0].softmax(-1) if bugs.unmasked_q else q
    out: list[tuple[int, torch.Tensor | None]] = []
    for _ in range(count):
        if float(q.sum()) <= 0:  # a forced position has one child
            break
        q, reported = q / q.sum(), reported / reported.sum()
        token = int(torch.multinomial(q, 1, generator=row.generator))
        out.append((token, reported))
        q, reported = q.clone(), reported.clone()
        q[token] = reported[token] = 0.0
    return out


def _tree(req: ProposalRequest, point_mass: bool, bugs: Bugs) -> Proposal:
    """A tree of TREE_SHAPE in depth-first order, each node's children drawn when it is added."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[torch.Tensor | None] = []

    def grow(node: int, path: list[int], ranks: tuple[int, ...]) -> None:
        kids = _siblings(req, path, TREE_SHAPE.get(ranks, 0), point_mass, bugs)
        for rank, (token, q) in enumerate(kids):
            tokens.append(token)
            parents.append(node)
            probs.append(q)
            grow(len(tokens) - 1, [*path, token], (*ranks, rank))

    grow(-1, [], ())
    laws = [q for q in probs if q is not None]
    return Proposal(tokens, torch.stack(laws) if len(laws) == len(tokens) else None, parents)


def propose(req: ProposalRequest, proposer: str, bugs: Bugs) -> Proposal:
    if proposer == "argmax_chain":
        # Deterministic and mostly, not always, grammar-valid (like an n-gram table built from similar
        # outputs): the draft model's argmax nudged toward allowed tokens. The drafter cuts the chain
        # at its first invalid token.
        tokens: list[int] = []
        for _ in range(req.k):
            logits = draft_logits((*req.token_ids, *tokens)).clone()
            state = state_after([*req.token_ids[req.num_prompt_tokens :], *tokens])
            if state is not None:
                logits[list(TRANSITIONS[state])] += ARGMAX_NUDGE
            tokens.append(int(logits.argmax()))
        return Proposal(tokens)
    if proposer == "sampled_chain":
        return _chain(req, bugs)
    return _tree(req, proposer == "top_tree", bugs)


def speculative_step(seq: Sequence, proposer: str, bugs: Bugs) -> list[int]:
    """Draft, cut and verify one step for `seq`; the emitted tokens (not committed)."""
    constraint = seq.constraint
    assert constraint is not None
    base = sampling_row(seq, [], NO_EOS)
    nodes = sum(TREE_SHAPE.values()) if proposer.endswith("tree") else 0
    req = ProposalRequest("r", list(seq.token_ids), seq.num_prompt_tokens, K, base, nodes, constraint)
    forced = constraint.forced(16)
    draft = DRAFTER._grammar_draft(seq, propose(req, proposer, bugs), forced, past=False)
    if draft is None:  # nothing to verify: a plain decode
        draft = Proposal([])
    rows_of = histories(draft)
    rows = [sampling_row(seq, extra, NO_EOS) for extra in rows_of]
    if bugs.wrong_prefix_mask:
        parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.token_ids) - 1))
        for j in range(1, len(rows)):
            rows[j].allowed = constraint.allowed_after(rows_of[parents[j - 1] + 1])
    if bugs.unmasked_target:
        for row in rows:
            row.allowed = None
    logits = torch.stack([target_logits(tuple(row.token_ids)) for row in rows])  # [n + 1, vocab]
    processed = process_logits(logits, rows)
    if not draft.token_ids:
        return sample(processed, rows)
    greedy = seq.params.greedy
    return verify_draft(
        processed, draft.token_ids, draft.parents, draft.probs, greedy, seq.generator
    ).token_ids


def generate(
    proposer: str,
    start: tuple[int, ...],
    params: SamplingParams,
    generator: torch.Generator,
    length: int,
    bugs: Bugs,
) -> tuple[int, ...]:
    """The first `length` tokens emitted by speculative steps from `start` (ending in INVALID where a
    grammar-invalid token was emitted)."""
    seq = new_sequence(start, params, generator)
    constraint = seq.constraint
    assert constraint is not None
    out: list[int] = []
    while len(out) < length:
        for token in speculative_step(seq, proposer, bugs)[: length - len(out)]:
            out.append(token)
            try:
                constraint.advance([token])
            except ConstraintError:
                return (*out, INVALID)
            seq.token_ids.append(token)
    return tuple(out)


def simulate(
    proposer: str, start: tuple[int, ...], params: SamplingParams, n: int, seed: int, bugs: Bugs = Bugs()
) -> Counter[tuple[int, ...]]:
    """Counts of the first LENGTH emitted tokens over n independent runs."""
    generator = torch.Generator().manual_seed(seed)
    return Counter(generate(proposer, start, params, generator, LENGTH, bugs) for _ in range(n))


def law_pvalue(counts: Counter[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of `counts` against `law`; 0 when an outcome of probability 0 occurred.
    Cells expected fewer than 5 times are pooled."""
    n = sum(counts.values())
    if any(law.get(seq, 0.0) <= 0.0 for seq in counts):
        return 0.0
    big = [seq for seq, p in law.items() if p * n >= 5]
    small = [seq for seq in law if seq not in big]
    observed = [float(counts[seq]) for seq in big]
    expected = [law[seq] * n for seq in big]
    pooled = sum(law[seq] for seq in small) * n
    if pooled > 0:
        observed.append(float(sum(counts[seq] for seq in small)))
        expected.append(pooled)
    expected = [e * n / sum(expected) for e in expected]  # float rounding of the law's total
    return float(chisquare(observed, expected).pvalue)


# ---- the tests ------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Rows of six logits: a second intra-op thread only adds wake-ups (milliseconds per softmax on a
    busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_fake_automaton_has_free_and_forced_positions() -> None:
    constraint = Constraint(cast(LLMatcher, FakeMatcher()), VOCAB)
    allowed = constraint.allowed_after([])
    assert allowed is not None and allowed.nonzero().flatten().tolist() == [0, 2, 3, 5]
    assert constraint.forced(16) == []
    constraint.advance(FORCED_START)
    assert constraint.forced(16) == [4]
    assert constraint.allowed_after([4, 1, 5]) is not None and constraint.allowed_after([4, 2]) is None
    assert constraint.valid_prefix([4, 1, 5, 1, 3]) == 4  # state 2 refuses 3


def _first_token_law(p: torch.Tensor, q: torch.Tensor, reported: torch.Tensor) -> torch.Tensor:
    """The law of the first token a one-token sampled chain emits: drafted from q, verified against
    p with `reported` as its law (min(1, p / reported) to accept, else the residual)."""
    ratio = torch.where(reported > 0, p / reported, 1.0)  # [vocab]; q is 0 where `reported` is
    accepted = q * ratio.clamp(max=1.0)
    residual = (p - reported).clamp(min=0.0)
    return accepted + (1.0 - accepted.sum()) * residual / residual.sum()


def test_each_planted_bug_changes_the_law_it_acts_on() -> None:
    """The design behind the mutation checks, computed exactly in the first positions after
    FREE_START: a row masked for its parent's prefix, an unmasked reported q and an unmasked target
    row each move the law far (total variation above 0.2), while the correct q leaves it as it is."""
    allowed = list(TRANSITIONS[0])
    target = target_logits(PROMPT)
    p = masked_law(target, allowed, TEMPERATURE)
    # A row masked for its parent's prefix: the second token's law after each allowed first token.
    for token in allowed:
        state = TRANSITIONS[0][token]
        logits = target_logits((*PROMPT, token))
        right = masked_law(logits, list(TRANSITIONS[state]), TEMPERATURE)
        wrong = masked_law(logits, allowed, TEMPERATURE)
        assert 0.5 * float((right - wrong).abs().sum()) > 0.2, token
    # An unmasked q reported for a draft drawn from the masked q.
    draft = draft_logits(PROMPT)
    q = masked_law(draft, allowed, TEMPERATURE)
    q_unmasked = masked_law(draft, range(VOCAB), TEMPERATURE)
    assert torch.allclose(_first_token_law(p, q, q), p)
    assert 0.5 * float((_first_token_law(p, q, q_unmasked) - p).abs().sum()) > 0.2
    # An unmasked target row: its law's mass on grammar-invalid tokens.
    plain = masked_law(target, range(VOCAB), TEMPERATURE)
    assert float(plain[[t for t in range(VOCAB) if t not in allowed]].sum()) > 0.2


@pytest.mark.parametrize("start", [FREE_START, FORCED_START], ids=["free", "forced"])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_emits_the_masked_argmax_chain(proposer: str, start: tuple[int, ...]) -> None:
    params = SamplingParams(temperature=0.0)
    expected = tuple(masked_argmax_chain(start, 6))
    assert generate(proposer, start, params, torch.Generator(), 6, Bugs()) == expected
    unmasked = generate(proposer, start, params, torch.Generator(), 6, Bugs(unmasked_target=True))
    assert unmasked != expected


SAMPLED = SamplingParams(temperature=TEMPERATURE)
CORRECT_CASES = [
    ("argmax_chain", FREE_START, SAMPLED),
    ("sampled_chain", FREE_START, SAMPLED),
    ("sampled_tree", FREE_START, SAMPLED),
    ("top_tree", FREE_START, SAMPLED),
    ("argmax_chain", FORCED_START, SAMPLED),
    ("sampled_chain", FORCED_START, SAMPLED),
    ("sampled_tree", FORCED_START, SAMPLED),
    # top-k acts on the allowed tokens: the two best of them, where the grammar allows more.
    ("sampled_tree", FREE_START, SamplingParams(temperature=TEMPERATURE, top_k=2)),
]


def _case_id(proposer: str, start: tuple[int, ...], params: SamplingParams) -> str:
    return f"{proposer}-{'forced' if start else 'free'}" + (f"-top{params.top_k}" if params.top_k else "")


@pytest.mark.parametrize(
    ("proposer", "start", "params"), CORRECT_CASES, ids=[_case_id(*c) for c in CORRECT_CASES]
)
@pytest.mark.slow
def test_sampled_speculation_follows_the_masked_law(
    proposer: str, start: tuple[int, ...], params: SamplingParams
) -> None:
    counts = simulate(proposer, start, params, SAMPLES, seed=11)
    assert INVALID not in {t for seq in counts for t in seq}
    assert law_pvalue(counts, exact_law(start, LENGTH, params)) > 1e-3


MUTATION_CASES = [
    (Bugs(wrong_prefix_mask=True), "sampled_chain", FREE_START),
    (Bugs(wrong_prefix_mask=True), "sampled_tree", FREE_START),
    (Bugs(wrong_prefix_mask=True), "argmax_chain", FORCED_START),
    (Bugs(unmasked_q=True), "sampled_chain", FREE_START),
    (Bugs(unmasked_q=True), "sampled_tree", FREE_START),
    (Bugs(unmasked_q=True), "sampled_chain", FORCED_START),
    (Bugs(unmasked_target=True), "argmax_chain", FREE_START),
    (Bugs(unmasked_target=True), "sampled_chain", FREE_START),
    (Bugs(unmasked_target=True), "sampled_tree", FORCED_START),
]


def _mutation_id(case: tuple[Bugs, str, tuple[int, ...]]) -> str:
    bugs, proposer, start = case
    name = next(f for f in ("wrong_prefix_mask", "unmasked_q", "unmasked_target") if getattr(bugs, f))
    return f"{name}-{_case_id(proposer, start, SAMPLED)}"


@pytest.mark.parametrize(("bugs", "proposer", "start"), MUTATION_CASES, ids=map(_mutation_id, MUTATION_CASES))
def test_a_planted_masking_bug_fails_the_same_check(
    bugs: Bugs, proposer: str, start: tuple[int, ...]
) -> None:
    counts = simulate(proposer, start, SAMPLED, MUTATED_SAMPLES, seed=11, bugs=bugs)
    assert law_pvalue(counts, exact_law(start, LENGTH, SAMPLED)) < 1e-6
