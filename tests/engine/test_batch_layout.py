"""The batch layout has attention read a sequence's keys and values as a view of the pool when its
blocks are consecutive, and gather them otherwise; long contexts attend alone. Every way gives the
same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specgate.engine.batch_layout import ForwardItem
from specgate.engine.config import EngineConfig
from specgate.engine.model_runner import ModelRunner
from tests.engine.test_engine import prompts


@pytest.fixture(scope="module")
def runner(tiny_llama_dir: Path) -> ModelRunner:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", block_size=4, num_blocks=64
    )
    return ModelRunner(config)


def test_run_start_finds_consecutive_blocks_only(runner: ModelRunner) -> None:
    assert runner.layout.run_start([5, 6, 7], 12) == 20
    assert runner.layout.run_start([5, 6, 9], 8) == 20  # the third block holds no position yet
    assert runner.layout.run_start([5, 6, 9], 9) is None
    assert runner.layout.run_start([6, 5], 8) is None
    assert runner.layout.run_start([3], 1) == 12


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
        meta_v = runner.layout.pack(items_v)[3]
        meta_g = runner.layout.pack(items_g)[3]
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
    meta = runner.layout.pack(items)[3]
    assert [g.kv_start for g in meta.groups] == [None]
    together = runner.execute(items)
    alone = torch.cat([runner.execute([it]) for it in items])
    assert torch.allclose(together, alone, atol=1e-5, rtol=1e-5)


def test_long_contexts_attend_alone_and_agree_with_a_shared_call(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specgate.engine import batch_layout

    monkeypatch.setattr(batch_layout, "SHARED_MAX_CONTEXT", 16)  # the tiny pool holds no long contexts
    a, b, c = prompts([24, 8, 25], seed=6)
    tables = [list(range(0, 7)), list(range(7, 10)), [20 + 2 * j for j in range(8)]]  # c scattered
    runner.execute([ForwardItem(p, 0, t, 1) for p, t in zip((a, b, c), tables, strict=True)])
    items = [
        ForwardItem([1], 24, tables[0], 1),  # decode, long context: alone, a view of the pool
        ForwardItem([2], 8, tables[1], 1),  # decode, short context: shares a call
        ForwardItem([3, 4, 5], 25, tables[2], 3),  # verification, long context: alone, gathered
    ]
    meta = runner.layout.pack(items)[3]
    assert [(g.b, g.kv_start) for g in meta.groups] == [(1, 28), (1, 0), (1, None)]
    assert [g.start for g in meta.groups] == [0, 1, 2]  # short decodes first, then one per sequence
    alone = runner.execute(items)  # [5, vocab]
    monkeypatch.setattr(batch_layout, "SHARED_MAX_CONTEXT", 1 << 30)
    meta = runner.layout.pack(items)[3]
    assert [g.b for g in meta.groups] == [2, 1]  # the two decodes share a call, padded
    shared = runner.execute(items)
    assert torch.allclose(alone, shared, atol=1e-5, rtol=1e-5)
