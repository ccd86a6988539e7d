"""The EAGLE proposer on its own: drafts against a full recompute, the published format, refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from specgate.engine.config import EngineConfig
from specgate.engine.model_runner import ModelRunner
from specgate.engine.sampler import SamplingRow
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.eagle import EagleProposer
from specgate.engine.spec_decode.eagle_head import EagleConfig, EagleHead
from specgate.engine.spec_decode.eagle_io import load_head, save_head
from specgate.engine.spec_decode.proposer import ProposalRequest, ProposerContext
from tests.conftest import VOCAB_SIZE, tiny_config_kwargs

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_blocks=64))


def proposer(runner: ModelRunner, head_dir: Path) -> EagleProposer:
    ctx = ProposerContext(
        VOCAB_SIZE, torch.device("cpu"), "float32", None, {"head": str(head_dir)}, runner, "tiny"
    )
    return EagleProposer(ctx)


def features(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden states [len, hidden] for `tokens`, recomputed from scratch."""
    model = AutoModelForCausalLM.from_pretrained(runner.source.directory, dtype=torch.float32)
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def reference_drafts(runner: ModelRunner, head: EagleHead, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts with no cache at all: the head re-run over every pair for each draft."""
    feats = features(runner, tokens[:-1])  # f_0 .. f_{n-1}
    toks = list(tokens)
    pairs_f = [feats[i] for i in range(len(feats))]
    drafts = []
    with torch.no_grad():
        for _ in range(k):
            n = len(pairs_f)
            embeds = runner.embed_tokens()(torch.tensor([toks[1 : n + 1]]))
            out, _ = head(embeds, torch.stack(pairs_f).unsqueeze(0), torch.arange(n))
            predicted = out[0, -1]
            token = int(runner.lm_head()(predicted).argmax())
            drafts.append(token)
            toks.append(token)
            pairs_f.append(predicted)
    return drafts


def request(request_id: str, tokens: list[int], k: int) -> ProposalRequest:
    return ProposalRequest(request_id, tokens, len(tokens), k, SamplingRow(GREEDY, tokens, len(tokens), None))


def test_drafts_equal_a_cache_free_recompute_across_rollbacks(
    runner: ModelRunner, tiny_eagle_dir: Path
) -> None:
    eagle = proposer(runner, tiny_eagle_dir)
    head, _ = load_head(tiny_eagle_dir, runner.hidden_size, runner.vocab_size)
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(12)]
    eagle.start("a", tokens[:-1])
    eagle.observe_hidden("a", 0, features(runner, tokens[:-1]))  # the prefill's features
    first = eagle.propose([request("a", tokens, 4)])[0].token_ids
    assert first == reference_drafts(runner, head, tokens, 4)
    # Two of the drafts "accepted" plus a bonus token; the head must rewind its draft positions.
    tokens2 = [*tokens, *first[:2], (first[2] + 1) % (VOCAB_SIZE - 1)]
    eagle.observe_hidden("a", len(tokens) - 1, features(runner, tokens2[:-1])[len(tokens) - 1 :])
    second = eagle.propose([request("a", tokens2, 3)])[0].token_ids
    assert second == reference_drafts(runner, head, tokens2, 3)
    eagle.finish("a", tokens2)
    assert eagle.propose([request("a", tokens2, 3)])[0].token_ids == []


def test_published_layout_loads_and_drafts_the_same(
    runner: ModelRunner, tiny_eagle_dir: Path, tmp_path: Path
) -> None:
    # The EAGLE repositories ship torch .bin files, often with a copy of the embeddings inside.
    state = load_file(str(tiny_eagle_dir / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(VOCAB_SIZE, runner.hidden_size)
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((tiny_eagle_dir / "config.json").read_text())
    keys = set(state) - {"embed_tokens.weight"}
    assert "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert not any("input_layernorm" in k for k in keys)  # EAGLE's layer 0 has none
    rng = random.Random(1)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(9)]
    got = []
    for directory in (tiny_eagle_dir, tmp_path):
        eagle = proposer(runner, directory)
        eagle.start("a", tokens)
        eagle.observe_hidden("a", 0, features(runner, tokens[:-1]))
        got.append(eagle.propose([request("a", tokens, 5)])[0].token_ids)
    assert got[0] == got[1] and len(got[0]) == 5


def test_heads_for_another_target_are_refused(runner: ModelRunner, tmp_path: Path) -> None:
    wide = LlamaConfig(**{**tiny_config_kwargs(), "hidden_size": 128})
    save_head(EagleHead(EagleConfig.for_target(wide)), tmp_path / "wide")
    with pytest.raises(ValueError, match="hidden size 128; the target's is 64"):
        proposer(runner, tmp_path / "wide")
    other = LlamaConfig(**{**tiny_config_kwargs(), "vocab_size": 1000})
    save_head(EagleHead(EagleConfig.for_target(other)), tmp_path / "vocab")
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        proposer(runner, tmp_path / "vocab")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        proposer(runner, tmp_path / "empty")
    cfg = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama"


def test_a_draft_vocabulary_restricts_drafts_and_survives_a_round_trip(
    runner: ModelRunner, tiny_eagle_dir: Path, tmp_path: Path
) -> None:
    head, _ = load_head(tiny_eagle_dir, runner.hidden_size, runner.vocab_size)
    subset = torch.arange(0, VOCAB_SIZE, 3)  # every third token
    head.draft_vocab = subset
    save_head(head, tmp_path / "sub")
    loaded, _ = load_head(tmp_path / "sub", runner.hidden_size, runner.vocab_size)
    assert loaded.draft_vocab is not None and loaded.draft_vocab.tolist() == subset.tolist()
    rng = random.Random(4)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(10)]
    eagle = proposer(runner, tmp_path / "sub")
    eagle.start("a", tokens)
    eagle.observe_hidden("a", 0, features(runner, tokens[:-1]))
    drafts = eagle.propose([request("a", tokens, 6)])[0].token_ids
    assert len(drafts) == 6 and all(t % 3 == 0 for t in drafts)
    # The first draft is the best-scoring token of the subset under the full LM head.
    with torch.no_grad():
        embeds = runner.embed_tokens()(torch.tensor([tokens[1:]]))
        out, _ = loaded(embeds, features(runner, tokens[:-1]).unsqueeze(0), torch.arange(len(tokens) - 1))
        scores = runner.lm_head()(out[0, -1])
    assert drafts[0] == int(subset[scores[subset].argmax()])
    bad = EagleHead(head.config)
    bad.draft_vocab = torch.tensor([0, VOCAB_SIZE + 5])
    save_head(bad, tmp_path / "bad")
    with pytest.raises(ValueError, match="draft_vocab"):
        load_head(tmp_path / "bad", runner.hidden_size, runner.vocab_size)


def reference_probs(runner: ModelRunner, head: EagleHead, tokens: list[int], path: list[int]) -> torch.Tensor:
    """The head's draft distribution [vocab] after `tokens` and the drafted `path`, with no cache."""
    feats = [*features(runner, tokens[:-1]).unbind(0)]
    toks = [*tokens, *path]
    with torch.no_grad():
        predicted = None
        for _ in range(len(path) + 1):
            n = len(feats)
            embeds = runner.embed_tokens()(torch.tensor([toks[1 : n + 1]]))
            out, _ = head(embeds, torch.stack(feats).unsqueeze(0), torch.arange(n))
            predicted = out[0, -1]
            feats.append(predicted)
        assert predicted is not None
        return runner.lm_head()(predicted).float().softmax(-1)


def test_a_tree_is_eagle_2s_best_nodes_by_path_probability(runner: ModelRunner, tiny_eagle_dir: Path) -> None:
    """Every node holds one of its parent's top `tree_branch` draft tokens and scores its draft
    probability there (each checked against a cache-free recompute along the node's path); the first
    path is the greedy chain; no node left out has a higher path probability than one kept."""
    from specgate.engine.spec_decode import draft_tree as dt

    ctx = ProposerContext(
        VOCAB_SIZE,
        torch.device("cpu"),
        "float32",
        None,
        {"head": str(tiny_eagle_dir), "tree_branch": 3, "tree_expand": 2},
        runner,
        "tiny",
    )
    eagle = EagleProposer(ctx)
    head, _ = load_head(tiny_eagle_dir, runner.hidden_size, runner.vocab_size)
    rng = random.Random(1)
    tokens = [rng.randrange(VOCAB_SIZE - 1) for _ in range(10)]
    eagle.start("t", tokens[:-1])
    eagle.observe_hidden("t", 0, features(runner, tokens[:-1]))
    req = ProposalRequest("t", tokens, len(tokens), 3, SamplingRow(GREEDY, tokens, len(tokens), None), 8)
    prop = eagle.propose([req])[0]
    assert prop.parents is not None and prop.scores is not None
    assert dt.is_valid(prop.parents) and 1 < len(prop.token_ids) <= 8
    assert max(dt.depths(prop.parents)) <= 3
    assert any(rank > 0 for rank in dt.ranks(prop.parents))  # it branches
    path_prob = []
    for i, parent in enumerate(prop.parents):
        path = [prop.token_ids[j] for j in dt.path_to(prop.parents, parent)]
        probs = reference_probs(runner, head, tokens, path)
        top = probs.topk(3).indices.tolist()
        assert prop.token_ids[i] in top, f"node {i}"
        assert abs(prop.scores[i] - float(probs[prop.token_ids[i]])) < 1e-4
        path_prob.append(prop.scores[i] * (1.0 if parent < 0 else path_prob[parent]))
    first = [prop.token_ids[i] for i in dt.first_path(prop.parents)]
    assert first == reference_drafts(runner, head, tokens, 3)[: len(first)]
    # The same drafts again after a tree: the head's cache was rewound to the real pairs.
    again = eagle.propose([req])[0]
    assert again.token_ids == prop.token_ids and again.parents == prop.parents
    chain = eagle.propose([ProposalRequest("t", tokens, len(tokens), 3, req.row, 0)])[0]
    assert chain.parents is None and chain.token_ids == reference_drafts(runner, head, tokens, 3)
