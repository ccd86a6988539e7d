"""Draft trees inside the continuous batch: greedy output token-identical to plain decoding in fp32,
for every tree-drafting proposer, with trees, chains and plain requests sharing the batch, under
preemption and KV exhaustion; accepted branches off the first path move their keys and values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.spec_decode.draft_tree import TreeBuilder
from specgate.engine.spec_decode.proposer import Proposal, ProposalRequest
from specgate.engine.vocab import SpecParams
from tests.engine.spec_decode.test_speculative_engine import FixedCosts, proposer_options, repetitive_prompts
from tests.engine.test_engine import GREEDY, hf_greedy, prompts, run_to_completion, tokens

TREE_METHODS = ["ngram", "suffix", "eagle", "draft_model"]


def tree_options(method: str, tiny_draft_dir: Path, tiny_eagle_dir: Path) -> dict:
    # Matching single tokens too gives the n-gram proposer several continuations to branch into.
    if method == "ngram":
        return {"ngram": {"min_n": 1}}
    return proposer_options(method, tiny_draft_dir, tiny_eagle_dir)


def _count_moves(engine: Engine) -> list[int]:
    moved = [0]
    keep_path = engine.runner.keep_path

    def counted(*args: object) -> None:
        moved[0] += 1
        keep_path(*args)  # type: ignore[arg-type]

    engine.runner.keep_path = counted  # type: ignore[method-assign]
    return moved


@pytest.mark.parametrize("controller", ["goodput", "static"])
@pytest.mark.parametrize("method", TREE_METHODS)
def test_trees_chains_and_plain_requests_in_one_batch_agree(
    method: str,
    controller: str,
    make_engine: Callable[..., Engine],
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    options = tree_options(method, tiny_draft_dir, tiny_eagle_dir)
    engine = make_engine(num_blocks=1024, max_num_batched_tokens=256, proposer_options=options)
    engine.cost_model = FixedCosts()
    tree = SpecParams(method=method, controller=controller, num_speculative_tokens=4, max_tree_nodes=12)
    chain = SpecParams(method=method, controller=controller, num_speculative_tokens=4, max_tree_nodes=0)
    ps = repetitive_prompts()
    for i, p in enumerate(ps):
        engine.add_request(f"plain{i}", p, SamplingParams(max_tokens=40, **GREEDY))
        engine.add_request(f"tree{i}", p, SamplingParams(max_tokens=40, **GREEDY), tree)
        engine.add_request(f"chain{i}", p, SamplingParams(max_tokens=40, **GREEDY), chain)
    outs = run_to_completion(engine)
    for i in range(len(ps)):
        assert tokens(outs[f"tree{i}"]) == tokens(outs[f"plain{i}"]), f"tree{i} diverged"
        assert tokens(outs[f"chain{i}"]) == tokens(outs[f"plain{i}"]), f"chain{i} diverged"
        assert outs[f"chain{i}"][-1].stats.spec.num_tree_drafts == 0
    if controller == "static":  # goodput may rightly find no branch worth a token in a batch of 9
        tree_stats = [outs[f"tree{i}"][-1].stats.spec for i in range(len(ps))]
        assert sum(s.num_tree_drafts for s in tree_stats) > 0
        assert any(step.drafted > step.depth for s in tree_stats for step in s.steps)


def plain_outputs(engine: Engine, ps: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    """Plain greedy output of each prompt, by request id r0, r1, ..."""
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY))
    return {k: tokens(v) for k, v in run_to_completion(engine).items()}


class OracleTrees:
    """Drafts trees whose first path is always wrong and whose second branches hold what plain greedy
    decoding emits: every accepted token comes off the first path, so its keys and values move."""

    autoregressive = False
    needs_hidden = False
    drafts_past_extra = False

    def __init__(self, expected: dict[str, list[int]], vocab: int) -> None:
        self.expected, self.vocab = expected, vocab

    def start(self, request_id: str, token_ids: object, scope: str | None = "") -> None:
        pass

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            done = len(r.token_ids) - r.num_prompt_tokens
            right = self.expected[r.request_id][done : done + r.k]
            if not right:
                out.append(Proposal([]))
                continue
            b = TreeBuilder(r.max_nodes)
            b.add_path([(t + 1) % self.vocab for t in right])  # the first path: wrong from its root
            parent = -1
            for t in right:  # the right path, each node a second child under a wrong first one
                b.add(parent, (t + 2) % self.vocab)
                parent = b.add(parent, t) or 0
            draft, parents, _ = b.build()
            out.append(Proposal(draft, None, parents))
        return out

    def observe_hidden(self, request_id: str, start: int, hidden: object) -> None:
        pass

    def commit(self, request_id: str, token_ids: object, num_new: int) -> None:
        pass

    def finish(self, request_id: str, token_ids: object) -> None:
        pass


def test_accepted_branches_off_the_first_path_move_into_place(make_engine: Callable[..., Engine]) -> None:
    ps = prompts([7, 12, 20], seed=8)
    expected = plain_outputs(make_engine(), ps, 30)
    engine = make_engine(max_num_batched_tokens=256)
    engine.cost_model = FixedCosts()
    engine.speculation.proposers["ngram"] = OracleTrees(expected, engine.runner.vocab_size)
    moved = _count_moves(engine)
    spec = SpecParams(method="ngram", controller="static", num_speculative_tokens=3, max_tree_nodes=24)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, **GREEDY), spec)
        engine.add_request(f"plain{i}", p, SamplingParams(max_tokens=30, **GREEDY))
    outs = run_to_completion(engine)
    for i in range(len(ps)):
        assert tokens(outs[f"r{i}"]) == expected[f"r{i}"] == tokens(outs[f"plain{i}"])
        stats = outs[f"r{i}"][-1].stats.spec
        assert stats.num_tree_drafts > 0 and stats.mean_acceptance_length > 3.0  # every draft right
    assert moved[0] > 0


@pytest.mark.parametrize("method", TREE_METHODS)
def test_trees_survive_kv_exhaustion_and_preemption(
    method: str,
    make_engine: Callable[..., Engine],
    tiny_llama_dir: Path,
    tiny_draft_dir: Path,
    tiny_eagle_dir: Path,
) -> None:
    # 14 blocks of 4 tokens: three requests of up to ~45 tokens plus their trees cannot all stay.
    options = tree_options(method, tiny_draft_dir, tiny_eagle_dir)
    engine = make_engine(num_blocks=14, max_num_batched_tokens=64, proposer_options=options)
    engine.cost_model = FixedCosts()
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=3, max_tree_nodes=10)
    ps = [p + p for p in prompts([6, 8, 5], seed=2)]
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=25, **GREEDY), spec)
    outs = run_to_completion(engine)
    assert sum(o[-1].stats.num_preemptions for o in outs.values()) > 0
    assert sum(o[-1].stats.spec.num_tree_drafts for o in outs.values()) > 0
    for i, p in enumerate(ps):
        assert tokens(outs[f"r{i}"]) == hf_greedy(tiny_llama_dir, p, 25), f"r{i} diverged"
    assert engine.block_manager.num_used_blocks == 0


def test_deterministic_mode_verifies_chains(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(deterministic=True)
    engine.cost_model = FixedCosts()
    spec = SpecParams(method="ngram", controller="static", max_tree_nodes=16)
    p = repetitive_prompts()[1]
    engine.add_request("plain", p, SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("spec", p, SamplingParams(max_tokens=30, **GREEDY), spec)
    outs = run_to_completion(engine)
    assert tokens(outs["spec"]) == tokens(outs["plain"])
    stats = outs["spec"][-1].stats.spec
    assert stats.num_draft_tokens > 0 and stats.num_tree_drafts == 0


class Dear(FixedCosts):
    """Each extra token costs as much as a whole step."""

    def forward_time(self, num_tokens: int, context: float = 0.0) -> float:
        return float(num_tokens)


class Cheap(FixedCosts):
    """An extra token costs 0.1% of a step."""

    def forward_time(self, num_tokens: int, context: float = 0.0) -> float:
        return 1.0 + 0.001 * num_tokens


@pytest.mark.parametrize(("costs", "branches"), [(Dear, False), (Cheap, True)])
def test_the_goodput_controller_keeps_branches_only_where_they_pay(
    costs: type[FixedCosts], branches: bool, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine()
    engine.cost_model = costs()
    spec = SpecParams(method="suffix", max_tree_nodes=16)
    p = repetitive_prompts()[2]
    engine.add_request("plain", p, SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("spec", p, SamplingParams(max_tokens=30, **GREEDY), spec)
    outs = run_to_completion(engine)
    assert tokens(outs["spec"]) == tokens(outs["plain"])
    assert (outs["spec"][-1].stats.spec.num_tree_drafts > 0) is branches


class Malformed(OracleTrees):
    """Right tokens in broken trees: a parent after its child, a wrong-length parent list, a parent
    out of range, NaN and negative scores. The engine must drop each (or its scores) and go on."""

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        out = super().propose(requests)
        broken = []
        for n, prop in enumerate(out):
            if not prop.token_ids or prop.parents is None:
                broken.append(prop)
                continue
            kind = (len(requests[n].token_ids) + n) % 5
            parents = list(prop.parents)
            if kind == 0:
                parents[0] = 1  # after its child
            elif kind == 1:
                parents = parents[:-1]
            elif kind == 2:
                parents[-1] = -7
            scores = [float("nan")] * len(prop.token_ids) if kind == 3 else [-1.0] * len(prop.token_ids)
            broken.append(Proposal(prop.token_ids, None, parents, scores))
        return broken


def test_malformed_trees_are_dropped_and_requests_go_on(make_engine: Callable[..., Engine]) -> None:
    ps = prompts([7, 12], seed=9)
    expected = plain_outputs(make_engine(), ps, 30)
    engine = make_engine(max_num_batched_tokens=256)
    engine.cost_model = FixedCosts()
    engine.speculation.proposers["ngram"] = Malformed(expected, engine.runner.vocab_size)
    spec = SpecParams(method="ngram", num_speculative_tokens=3, max_tree_nodes=24)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, **GREEDY), spec)
    outs = run_to_completion(engine)
    for i in range(len(ps)):
        assert outs[f"r{i}"][-1].finish_reason == "length"
        assert tokens(outs[f"r{i}"]) == expected[f"r{i}"]
    # The well-formed trees with bad scores were verified (their scores ignored).
    assert sum(outs[f"r{i}"][-1].stats.spec.num_tree_drafts for i in range(len(ps))) > 0


def test_trees_on_the_hugging_face_modules(make_engine: Callable[..., Engine]) -> None:
    """The Hugging Face path reads the tree's positions and masks through the attention interface."""
    engine = make_engine(model_impl="hf", proposer_options={"ngram": {"min_n": 1}})
    assert not engine.runner.compact
    engine.cost_model = FixedCosts()
    spec = SpecParams(method="ngram", controller="static", num_speculative_tokens=4, max_tree_nodes=12)
    ps = repetitive_prompts()
    for i, p in enumerate(ps):
        engine.add_request(f"plain{i}", p, SamplingParams(max_tokens=30, **GREEDY))
        engine.add_request(f"tree{i}", p, SamplingParams(max_tokens=30, **GREEDY), spec)
    outs = run_to_completion(engine)
    for i in range(len(ps)):
        assert tokens(outs[f"tree{i}"]) == tokens(outs[f"plain{i}"])
    assert sum(outs[f"tree{i}"][-1].stats.spec.num_tree_drafts for i in range(len(ps))) > 0
