"""Verifying a draft tree in one forward pass: each node's logits equal those of a chain forward over
its own path, whatever shares the batch, with trees short (a shared attention call) or long (a
chunk of their own); an accepted path off the first branch moves its keys / values into place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specgate.engine.batch_layout import ForwardItem
from specgate.engine.config import EngineConfig
from specgate.engine.model_runner import ModelRunner
from specgate.engine.spec_decode import draft_tree as dt
from tests.engine.test_engine import prompts

ATOL = 1e-5

# Root, then: a -> b -> c (the first path), a -> d, e -> f, e -> g -> h.
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]
PARENTS = [-1, 0, 1, 0, -1, 4, 4, 6]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4, num_blocks=96
    )
    return ModelRunner(config)


def _tree_item(root: int, start: int, table: list[int], tokens: list[int], parents: list[int]) -> ForwardItem:
    return ForwardItem([root, *tokens], start, table, 1 + len(tokens), parents)


def _chain_logits(runner: ModelRunner, prompt: list[int], table: list[int], path: list[int]) -> torch.Tensor:
    """Logits [1 + len(path), vocab] of a fresh prefill of prompt + path tokens (in its own blocks)."""
    tokens = prompt + path
    return runner.execute([ForwardItem(tokens, 0, table, 1 + len(path))])


def _check_tree(runner: ModelRunner, tokens: list[int], parents: list[int], with_decode: bool) -> None:
    (prompt,) = prompts([13], seed=5)
    table = list(range(0, 10))
    runner.execute([ForwardItem(prompt[:-1], 0, table, 1)])  # the context before the root
    items = [_tree_item(prompt[-1], len(prompt) - 1, table, tokens, parents)]
    if with_decode:  # a plain decode and a chain verification in the same pass
        a, b = prompts([9, 10], seed=6)
        runner.execute([ForwardItem(a, 0, [40, 41, 42], 1), ForwardItem(b, 0, [50, 51, 52, 53], 1)])
        items += [ForwardItem([3], 9, [40, 41, 42], 1), ForwardItem([4, 5, 6], 10, [50, 51, 52, 53], 3)]
    logits = runner.execute(items)  # [num_logits, vocab]
    tree_logits = logits[: 1 + len(tokens)]
    scratch = list(range(60, 70))
    for node in [-1, *range(len(tokens))]:
        path = [tokens[i] for i in dt.path_to(parents, node)]
        chain = _chain_logits(runner, prompt, scratch, path)[-1]
        assert torch.allclose(tree_logits[node + 1], chain, atol=ATOL, rtol=ATOL), f"node {node}"


@pytest.mark.parametrize("with_decode", [False, True])
def test_each_node_sees_only_its_path(runner: ModelRunner, with_decode: bool) -> None:
    _check_tree(runner, TOKENS, PARENTS, with_decode)


def test_a_tree_too_large_to_share_attention_is_a_chunk_of_its_own(runner: ModelRunner) -> None:
    b = dt.TreeBuilder(24)
    for i in range(6):
        b.add_path([20 + i, 30 + i, 40 + i, 50])
    tokens, parents, _ = b.build()
    assert len(tokens) == 24  # 25 rows with the root: more than a shared call takes
    meta = runner.layout.pack([_tree_item(1, 12, list(range(10)), tokens, parents)])[3]
    assert len(meta.long_chunks) == 1 and not meta.groups
    _check_tree(runner, tokens, parents, False)


def test_positions_follow_depth_and_slots_follow_order(runner: ModelRunner) -> None:
    item = _tree_item(7, 12, list(range(10)), TOKENS, PARENTS)
    assert item.positions().tolist() == [12, 13, 14, 15, 14, 13, 14, 14, 15]
    _, positions, _, meta, _ = runner.layout.pack([item])
    assert positions.tolist() == item.positions().tolist()
    assert meta.slot_mapping.tolist() == list(range(12, 21))  # block i holds slots 4i .. 4i + 3


def test_keep_path_moves_an_accepted_branch_into_place(runner: ModelRunner) -> None:
    """After accepting e -> g -> h (nodes 4, 6, 7), their keys / values sit where a chain over those
    tokens puts them: decoding the next token gives the chain's logits."""
    (prompt,) = prompts([13], seed=5)
    table = list(range(0, 10))
    runner.execute([ForwardItem(prompt[:-1], 0, table, 1)])
    start = len(prompt) - 1
    runner.execute([_tree_item(prompt[-1], start, table, TOKENS, PARENTS)])
    path = [4, 6, 7]
    base = start + 1
    runner.keep_path(table, [base + n for n in path], [base + j for j in range(len(path))])
    after = runner.execute([ForwardItem([9], base + len(path), table, 1)])[0]
    chain = _chain_logits(runner, prompt, list(range(60, 70)), [TOKENS[n] for n in path] + [9])[-1]
    assert torch.allclose(after, chain, atol=ATOL, rtol=ATOL)
