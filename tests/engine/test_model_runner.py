"""The runner reads a sequence's keys and values as a view of the pool when its blocks are consecutive,
and gathers them otherwise; both give the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specgate.engine.config import EngineConfig
from specgate.engine.model_runner import ForwardItem, ModelRunner
from tests.engine.test_engine import prompts


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4, num_blocks=64
    )
    return ModelRunner(config)


def test_run_start_finds_consecutive_blocks_only(runner: ModelRunner) -> None:
    assert runner._run_start([5, 6, 7], 12) == 20
    assert runner._run_start([5, 6, 9], 8) == 20  # the third block holds no position yet
    assert runner._run_start([5, 6, 9], 9) is None
    assert runner._run_start([6, 5], 8) is None
    assert runner._run_start([3], 1) == 12


def _steps(table: list[int]) -> list[list[ForwardItem]]:
    (ids,) = prompts([19], seed=3)
    return [
        [ForwardItem(ids, 0, table, 1)],  # prefill: one long chunk
        [ForwardItem([7], 19, table, 1)],  # decode
        [ForwardItem([8, 9, 10, 11], 20, table, 4)],  # verification of 3 drafts
    ]


def test_view_and_gather_give_the_same_logits(runner: ModelRunner) -> None:
    consecutive = list(range(10, 16))
    scattered = [30, 22, 41, 2, 57, 8]  # no block of `consecutive`: both stay valid
    for items_v, items_g in zip(_steps(consecutive), _steps(scattered), strict=True):
        meta_v = runner._prepare(items_v)[3]
        meta_g = runner._prepare(items_g)[3]
        starts_v = [g.kv_start for g in meta_v.groups] + [c.kv_start for c in meta_v.long_chunks]
        starts_g = [g.kv_start for g in meta_g.groups] + [c.kv_start for c in meta_g.long_chunks]
        assert starts_v == [40] and starts_g == [None]
        logits_v = runner.execute(items_v)  # [num_logits, vocab]
        logits_g = runner.execute(items_g)
        assert torch.allclose(logits_v, logits_g, atol=1e-5, rtol=1e-5)


def test_a_batch_of_several_sequences_gathers(runner: ModelRunner) -> None:
    a, b = prompts([5, 6], seed=4)
    runner.execute([ForwardItem(a, 0, [0, 1], 1), ForwardItem(b, 0, [2, 3], 1)])
    items = [ForwardItem([1], 5, [0, 1], 1), ForwardItem([2], 6, [2, 3], 1)]
    meta = runner._prepare(items)[3]
    assert [g.kv_start for g in meta.groups] == [None]
    together = runner.execute(items)
    alone = torch.cat([runner.execute([it]) for it in items])
    assert torch.allclose(together, alone, atol=1e-5, rtol=1e-5)
