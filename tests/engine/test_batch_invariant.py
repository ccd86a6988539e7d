"""Deterministic mode: a row's result, and so greedy output, independent of the batch it ran in."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specgate.engine.attention import AttentionMetadata, _tile_attention, tile_groups
from specgate.engine.batch_invariant import (
    ATTENTION_TILE,
    KEY_BUCKET,
    InvariantLinear,
    key_bucket,
    probe_tile,
    tile_attention_invariant,
)
from specgate.engine.engine import Engine
from specgate.engine.kv_cache import KVCache
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from tests.engine.spec_decode.test_speculative_engine import FixedCosts, proposer_options
from tests.engine.test_engine import GREEDY, prompts, run_to_completion, tokens


class RowCountNoise(nn.Module):
    """A linear whose rounding depends on how many rows share the call, as a GEMM's can."""

    def __init__(self, in_features: int = 16, out_features: int = 8, tile_safe: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.randn(out_features, in_features)
        self.tile_safe = tile_safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        n = x.shape[0]
        noise = 1e-3 * n if self.tile_safe else 1e-3 * x.sum()  # the latter depends on neighbours too
        return out + noise


def test_the_probe_keeps_invariant_kernels_and_tiles_the_others() -> None:
    cpu = torch.device("cpu")
    exact = nn.Linear(16, 8, bias=False)
    exact.forward = lambda x: (x.unsqueeze(1) * exact.weight).sum(-1)  # type: ignore[method-assign]
    assert probe_tile(exact, 16, torch.float32, cpu, 64) == 0
    assert probe_tile(RowCountNoise(), 16, torch.float32, cpu, 64) == 8
    assert probe_tile(RowCountNoise(tile_safe=False), 16, torch.float32, cpu, 64) == 1


@pytest.mark.parametrize("tile", [1, 3, 8])
@pytest.mark.parametrize("rows", [1, 5, 8, 19])
def test_invariant_linear_computes_the_same_linear(tile: int, rows: int) -> None:
    lin = nn.Linear(16, 12)
    x = torch.randn(2, rows, 16)
    wrapped = InvariantLinear(lin, tile)
    torch.testing.assert_close(wrapped(x), lin(x))
    assert wrapped(x).shape == (2, rows, 12)
    # Row-count noise disappears: every call has `tile` rows.
    noisy = InvariantLinear(RowCountNoise(), tile)
    y = torch.randn(rows, 16)
    assert torch.equal(noisy(y)[:1], noisy(y[:1]))


def _pool(ctx: int, kv_heads: int = 2, head_dim: int = 8) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    blocks = ctx // 4 + 2
    cache = KVCache(1, kv_heads, head_dim, blocks, block_size=4, dtype=torch.float32, device="cpu")
    k, v = torch.randn(kv_heads, ctx, head_dim), torch.randn(kv_heads, ctx, head_dim)
    cache.write(0, torch.arange(ctx), k, v)
    return cache, k, v


def _tiled(cache: KVCache, q: torch.Tensor, rows: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """[num_tokens, heads, d] for packed queries q [heads, num_tokens, d]."""
    groups = tile_groups(rows, ATTENTION_TILE, key_bucket, cache.trash_slot)
    meta = AttentionMetadata(cache, torch.empty(0), tiles=groups)
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2])
    for g in groups:
        out[g.out_rows] = _tile_attention(meta, 0, g, q, cache.k.shape[1], 0.35)
    return out


def test_tile_attention_is_causal_attention_and_ignores_batch_mates() -> None:
    ctx = 150  # keys in three buckets
    cache, k, v = _pool(ctx)
    heads, n = 4, 11
    q = torch.randn(heads, n, 8)
    start = ctx - n
    slots = torch.arange(ctx)
    out = _tiled(cache, q, [(0, start, slots)])
    mask = torch.arange(ctx).view(1, ctx) <= torch.arange(start, ctx).view(n, 1)  # [n, ctx]
    ref = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=0.35, enable_gqa=True
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref)
    # Each row alone, or with another sequence's rows before it, comes out bit-identical.
    for i in range(n):
        alone = _tiled(cache, q[:, i : i + 1], [(0, start + i, slots[: start + i + 1])])
        assert torch.equal(alone[0], out[i]), f"row {i}"
    other = torch.randn(heads, 3, 8)
    mixed = _tiled(cache, torch.cat([other, q], 1), [(0, 40, slots[:43]), (3, start, slots)])
    assert torch.equal(mixed[3:], out)


@pytest.mark.parametrize("serial", [False, True])
def test_the_start_up_probe_passes_tile_attention_on_this_machine(serial: bool) -> None:
    # The engine probes this at start-up and falls back to one thread (then refuses to start) if it
    # fails; the model dimensions of the default model and of the tiny test models.
    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 2, 16)):
        assert tile_attention_invariant(heads, kv_heads, head_dim, torch.float32, torch.device("cpu"), serial)


def test_key_buckets_depend_on_the_position_only() -> None:
    assert key_bucket(0) == KEY_BUCKET and key_bucket(KEY_BUCKET - 1) == KEY_BUCKET
    assert key_bucket(KEY_BUCKET) == 2 * KEY_BUCKET


# ---- the engine in deterministic mode: bf16, the default dtype --------------------------------


def _outputs(
    engine: Engine, requests: list[tuple[str, list[int], SpecParams | None]]
) -> dict[str, list[int]]:
    engine.cost_model = FixedCosts()
    for rid, prompt, spec in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=32, **GREEDY), spec)
    return {rid: tokens(outs) for rid, outs in run_to_completion(engine).items()}


def _prompts() -> list[list[int]]:
    # Repetitive prompts, so n-gram and suffix drafts are often accepted (multi-token verification).
    return [p + p[: len(p) // 2] + p for p in prompts([5, 11, 23, 40], seed=9)]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.slow
def test_bf16_greedy_output_ignores_batch_speculation_and_cache_hits(
    quantization: str, make_engine: Callable[..., Engine], tiny_draft_dir: Path, tiny_eagle_dir: Path
) -> None:
    options = {
        **proposer_options("draft_model", tiny_draft_dir, tiny_eagle_dir),
        **proposer_options("eagle", tiny_draft_dir, tiny_eagle_dir),
    }

    def engine(**kw: object) -> Engine:
        return make_engine(
            dtype="bfloat16",
            deterministic=True,
            quantization=quantization,
            max_num_batched_tokens=48,
            num_blocks=1024,
            proposer_options=options,
            **kw,
        )

    ps = _prompts()
    alone = {}
    for i, p in enumerate(ps):
        alone.update(_outputs(engine(prefix_caching=False), [(f"r{i}", p, None)]))
    batched = _outputs(engine(prefix_caching=False), [(f"r{i}", p, None) for i, p in enumerate(ps)])
    assert batched == alone
    for method in ("ngram", "suffix", "draft_model", "eagle"):
        spec = SpecParams(method=method, controller="static", num_speculative_tokens=3)
        got = _outputs(engine(prefix_caching=False), [(f"r{i}", p, spec) for i, p in enumerate(ps)])
        assert got == alone, method
    # After a prefix-cache hit (the prompt's first blocks are not recomputed) and next to other work.
    cached = engine()
    _outputs(cached, [(f"warm{i}", p, None) for i, p in enumerate(ps)])
    hits = _outputs(cached, [(f"r{i}", p, None) for i, p in enumerate(ps)])
    assert cached.block_manager.hit_tokens > 0
    assert hits == alone
