"""The draft-model proposer on its own: drafts against a full-recompute reference, rollback, blocks."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from specgate.engine.block_manager import blocks_for
from specgate.engine.sampler import SamplingRow, process_logits
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode import draft_tree
from specgate.engine.spec_decode.draft_model import DraftModelProposer
from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest, ProposerContext
from tests.conftest import VOCAB_SIZE, build_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def make_context(options: dict) -> ProposerContext:
    return ProposerContext(
        vocab_size=VOCAB_SIZE,
        device=torch.device("cpu"),
        dtype="float32",
        tokenizer=build_tokenizer(),
        options=options,
    )


@pytest.fixture
def make_proposer(tiny_draft_dir: Path) -> Callable[[], DraftModelProposer]:
    return lambda: DraftModelProposer(make_context({"model": str(tiny_draft_dir)}))


@pytest.fixture(scope="module")
def reference(tiny_draft_dir: Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_draft_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def last_logits(model: PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """Logits [1, vocab] after `tokens`, recomputed from scratch."""
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0, -1:].float()


def greedy_continuation(model: PreTrainedModel, tokens: Sequence[int], k: int) -> list[int]:
    seq = list(tokens)
    for _ in range(k):
        seq.append(int(last_logits(model, seq).argmax()))
    return seq[len(tokens) :]


def request(
    request_id: str, tokens: Sequence[int], k: int, params: SamplingParams = GREEDY, seed: int | None = None
) -> ProposalRequest:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    row = SamplingRow(params, list(tokens), len(tokens), generator)
    return ProposalRequest(request_id, list(tokens), len(tokens), k, row)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE - 1) for _ in range(length)]


def test_greedy_drafts_equal_the_draft_models_own_continuation(
    make_proposer: Callable[[], DraftModelProposer], reference: PreTrainedModel
) -> None:
    proposer = make_proposer()
    a, b = prompt(9, seed=1), prompt(23, seed=2)
    proposer.start("a", a)
    proposer.start("b", b)
    proposals = proposer.propose([request("a", a, k=5), request("b", b, k=3)])
    assert proposals[0].token_ids == greedy_continuation(reference, a, 5)
    assert proposals[1].token_ids == greedy_continuation(reference, b, 3)
    assert proposals[0].probs is None and proposals[1].probs is None


def test_drafts_stay_correct_after_rejections_and_blocks_are_rolled_back(
    make_proposer: Callable[[], DraftModelProposer], reference: PreTrainedModel
) -> None:
    proposer = make_proposer()
    block_size = proposer.blocks.block_size
    rng = random.Random(0)
    tokens = prompt(12, seed=3)
    proposer.start("r", tokens)
    for step in range(14):
        k = 8 if step % 2 == 0 else 1 + step % 3
        (proposal,) = proposer.propose([request("r", tokens, k)])
        assert proposal.token_ids == greedy_continuation(reference, tokens, k), f"step {step}"
        # The draft cache holds the committed tokens and all drafts but the last, nothing more.
        assert proposer.blocks.num_used_blocks == blocks_for(len(tokens) + k - 1, block_size)
        # Verification keeps some drafts and then emits a token of its own, mostly a different one.
        d = proposal.token_ids
        kept = rng.randrange(len(d) + 1)
        if kept < len(d):
            token = (d[kept] + 1 + rng.randrange(VOCAB_SIZE - 2)) % (VOCAB_SIZE - 1)
            assert token != d[kept]
        else:
            token = rng.randrange(VOCAB_SIZE - 1)
        tokens = [*tokens, *d[:kept], token]
    # A history that differs from the cached one everywhere after the prompt rewinds to the prompt,
    # not just to the newest token, and releases the blocks past it.
    before = proposer.blocks.num_used_blocks
    other = [*tokens[:12], *((t + 1) % (VOCAB_SIZE - 1) for t in tokens[12:18])]
    (proposal,) = proposer.propose([request("r", other, 4)])
    assert proposal.token_ids == greedy_continuation(reference, other, 4)
    assert proposer.blocks.num_used_blocks == blocks_for(len(other) + 3, block_size) < before


def test_finish_frees_every_draft_block(make_proposer: Callable[[], DraftModelProposer]) -> None:
    proposer = make_proposer()
    a, b = prompt(40, seed=4), prompt(5, seed=5)
    proposer.start("a", a)
    proposer.start("b", b)
    proposer.propose([request("a", a, k=6), request("b", b, k=6)])
    assert proposer.blocks.num_used_blocks > 0
    proposer.finish("a", a)
    assert proposer.blocks.num_used_blocks == blocks_for(len(b) + 5, proposer.blocks.block_size)
    proposer.finish("b", b)
    assert proposer.blocks.num_used_blocks == 0
    proposer.finish("b", b)  # finishing twice, or an unknown request, is a no-op
    proposer.finish("never-started", [1, 2])
    assert proposer.blocks.num_used_blocks == 0


def test_sampled_drafts_come_with_their_distributions(
    make_proposer: Callable[[], DraftModelProposer], reference: PreTrainedModel
) -> None:
    proposer = make_proposer()
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64)
    a, b = prompt(11, seed=6), prompt(7, seed=7)
    proposer.start("a", a)
    proposer.start("g", b)
    sampled, greedy = proposer.propose([request("a", a, k=4, params=params, seed=0), request("g", b, k=2)])
    assert len(sampled.token_ids) == 4
    assert sampled.probs is not None and sampled.probs.shape == (4, VOCAB_SIZE)
    assert torch.allclose(sampled.probs.sum(dim=-1), torch.ones(4), atol=1e-5)
    assert greedy.probs is None and greedy.token_ids == greedy_continuation(reference, b, 2)
    # Row j is the processed draft distribution after the prompt and drafts 0 .. j-1.
    for j, token in enumerate(sampled.token_ids):
        prefix = [*a, *sampled.token_ids[:j]]
        row = SamplingRow(params, prefix, len(a), None)
        expected = process_logits(last_logits(reference, prefix), [row]).softmax(dim=-1)[0]
        assert torch.allclose(sampled.probs[j], expected, atol=1e-4), f"position {j}"
        assert sampled.probs[j, token] > 0


def test_greedy_trees_hang_the_drafts_runner_ups_beside_the_chain(
    make_proposer: Callable[[], DraftModelProposer], reference: PreTrainedModel
) -> None:
    proposer = make_proposer()
    a = prompt(13, seed=8)
    proposer.start("t", a)
    req = request("t", a, k=4)
    req.max_nodes = 10
    tree = proposer.propose([req])[0]
    chain = greedy_continuation(reference, a, 4)
    assert tree.parents is not None and tree.scores is not None and tree.probs is None
    assert draft_tree.is_valid(tree.parents) and len(tree.token_ids) == 10
    assert [tree.token_ids[i] for i in draft_tree.first_path(tree.parents)] == chain
    assert max(draft_tree.depths(tree.parents)) == 4
    ranks = draft_tree.ranks(tree.parents)
    for node in range(4, 10):  # every other node is a leaf beside the chain: a runner-up of its depth
        parent = tree.parents[node]
        assert -1 <= parent <= 2, "a leaf hangs off the root or a chain node"
        assert node == 4 or parent <= tree.parents[node - 1], "depth first: the deepest leaves first"
        assert ranks[node] >= 1 and node not in tree.parents
        prefix = [*a, *chain[: parent + 1]]
        p = last_logits(reference, prefix).softmax(dim=-1)[0]
        assert tree.token_ids[node] != chain[parent + 1]
        assert tree.scores[node] == pytest.approx(float(p[tree.token_ids[node]]), rel=1e-4)
        # no token left out at this depth is likelier than one kept
        assert float(p[tree.token_ids[node]]) >= float(p.topk(1 + ranks[node]).values[-1]) - 1e-6
    for j in range(4):
        p = last_logits(reference, [*a, *chain[:j]]).softmax(dim=-1)[0]
        assert tree.scores[j] == pytest.approx(float(p[chain[j]]), rel=1e-4)


def test_sampled_and_small_tree_requests_get_chains(make_proposer: Callable[[], DraftModelProposer]) -> None:
    proposer = make_proposer()
    a = prompt(10, seed=9)
    proposer.start("s", a)
    proposer.start("c", a)
    sampled = request("s", a, k=3, params=SamplingParams(temperature=0.9, max_tokens=64), seed=1)
    sampled.max_nodes = 12
    small = request("c", a, k=3)
    small.max_nodes = 3
    for prop in proposer.propose([sampled, small]):
        assert prop.parents is None and len(prop.token_ids) == 3


@pytest.mark.parametrize("target_vocab", [90, 100])
def test_draft_logits_are_fitted_to_the_target_vocabulary(
    tiny_draft_dir: Path, reference: PreTrainedModel, target_vocab: int
) -> None:
    # The target's vocabulary (its padded embedding rows) may be smaller or larger than the draft's.
    ctx = make_context({"model": str(tiny_draft_dir)})
    ctx.vocab_size = target_vocab
    proposer = DraftModelProposer(ctx)
    tokens = prompt(10, seed=10)
    proposer.start("g", tokens)
    proposer.start("s", tokens)
    params = SamplingParams(temperature=1.0, max_tokens=64)
    greedy, sampled = proposer.propose(
        [request("g", tokens, k=3), request("s", tokens, k=3, params=params, seed=1)]
    )
    seq = list(tokens)
    for _ in range(3):
        seq.append(int(last_logits(reference, seq)[0, :target_vocab].argmax()))
    assert greedy.token_ids == seq[len(tokens) :]
    assert sampled.probs is not None and sampled.probs.shape == (3, target_vocab)
    assert torch.allclose(sampled.probs.sum(dim=-1), torch.ones(3), atol=1e-5)
    assert all(t < min(target_vocab, VOCAB_SIZE) for t in sampled.token_ids)
    if target_vocab > VOCAB_SIZE:
        assert torch.all(sampled.probs[:, VOCAB_SIZE:] == 0)
    expected = last_logits(reference, tokens)[0, :target_vocab].softmax(dim=-1)
    assert torch.allclose(sampled.probs[0, : min(target_vocab, VOCAB_SIZE)], expected[:VOCAB_SIZE], atol=1e-4)


def test_requests_without_room_or_without_k_get_no_draft(
    make_proposer: Callable[[], DraftModelProposer],
) -> None:
    proposer = make_proposer()
    long = prompt(proposer.runner.max_model_len - 2, seed=8)
    short = prompt(6, seed=9)
    proposer.start("long", long)
    proposer.start("short", short)
    proposals: list[Proposal] = proposer.propose(
        [
            request("long", long, k=4),  # would run past max_model_len
            request("short", short, k=0),
            request("unknown", short, k=3),  # never started
        ]
    )
    assert [p.token_ids for p in proposals] == [[], [], []]
    assert all(p.probs is None for p in proposals)
    assert proposer.blocks.num_used_blocks == 0


@pytest.mark.parametrize("options", [{}, {"model": ""}, {"model": None}])
def test_a_missing_model_option_is_refused(options: dict) -> None:
    with pytest.raises(ValueError, match="needs a draft model"):
        DraftModelProposer(make_context(options))
