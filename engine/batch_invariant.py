"""Batch invariance: a row's result that does not depend on which other rows share its kernel call.

Greedy output should not depend on the route a request took (speculation, K, batch mates, a
prefix-cache hit), but a GEMM's reduction order usually depends on the shape of the whole call: on
these CPUs MKL's fp32 GEMM rounds a row differently at 1, 2, 4, ... rows, and torch's fused CPU
attention rounds a query differently next to other queries. In deterministic mode the engine keeps
every row's arithmetic a function of that row alone (the approach of vLLM's batch-invariant mode and
of "Defeating Nondeterminism in LLM Inference"):

- linears: each linear kernel is probed at start-up, on this machine. A kernel whose rows already come
  out the same at every row count runs as it is (torch's int4 / int8 weight-only kernels, and bf16
  without native bf16 support, do); otherwise rows go through calls of one fixed row count (a tile),
  whose rows a probe found independent of their position and neighbours; failing that, one row per call.
  Weight-only layers always use their kernel (their dense copy rounds differently).
- attention (engine/attention.py, `TileGroup`): queries in fixed tiles of `ATTENTION_TILE` rows of one
  sequence, over keys padded to a multiple of `KEY_BUCKET` that depends only on the query's position,
  as plain fp32 batched matmuls of one shape per bucket.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

LINEAR_TILE = 8  # rows per call for kernels that are invariant only at a fixed row count
ATTENTION_TILE = 4  # query rows per attention tile (of one sequence)
KEY_BUCKET = 64  # keys are padded to a multiple of this, chosen by the query's position alone

_PROBE_ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64)


def key_bucket(position: int) -> int:
    """Keys a query at `position` attends over, padding included."""
    return -(-(position + 1) // KEY_BUCKET) * KEY_BUCKET


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Whether rows of fn come out the same at every probed row count and offset."""
    full = fn(x)  # [n, out]
    n = x.shape[0]
    for m in (*_PROBE_ROWS, n - 1):
        for start in {0, 1, (n - m) // 2}:
            end = start + m
            if m > 0 and end <= n and not torch.equal(fn(x[start:end]), full[start:end]):
                return False
    return True


def _tile_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> bool:
    """Whether, at exactly `tile` rows per call, a row's result ignores its position and neighbours."""
    ref = fn(x[:tile])
    for shift in range(1, tile):
        if not torch.equal(fn(torch.roll(x[:tile], shift, 0)), torch.roll(ref, shift, 0)):
            return False
    other = torch.cat([x[:1], x[tile : 2 * tile - 1]])  # row 0 among other neighbours
    return bool(torch.equal(fn(other)[0], ref[0]))


def probe_tile(
    module: nn.Module, in_features: int, dtype: torch.dtype, device: torch.device, rows: int
) -> int:
    """0 if `module` is row-invariant at any row count up to `rows`, else the tile to call it with."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(max(rows, 2 * LINEAR_TILE), in_features, generator=g).to(device=device, dtype=dtype)
    with torch.inference_mode():
        if _rows_invariant(module, x):
            return 0
        if _tile_invariant(module, x, LINEAR_TILE):
            return LINEAR_TILE
    return 1


class InvariantLinear(nn.Module):
    """A linear layer called at a fixed row count (`tile` rows per call, the last call padded)."""

    def __init__(self, inner: nn.Module, tile: int) -> None:
        super().__init__()
        self.inner = inner
        self.tile = tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [n, in]
        n, t = rows.shape[0], self.tile
        if n % t:
            rows = torch.cat([rows, rows.new_zeros(t - n % t, rows.shape[1])])
        out = torch.cat([self.inner(rows[i : i + t]) for i in range(0, rows.shape[0], t)])[:n]  # [n, out]
        return out.view(*x.shape[:-1], out.shape[-1])


def make_batch_invariant(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    rows: int,
    linear_types: tuple[type[nn.Module], ...],
    weight_only: type[nn.Module],
) -> int:
    """Make every linear layer of `model` (instances of `linear_types`) row-invariant (see the module
    docstring), probing each kind of layer once; `weight_only` layers are switched to their kernel
    for every row count. Returns how many layers had to be tiled."""
    tiles: dict[tuple[str, int, int], int] = {}
    wrapped = 0
    quantized = [name for name, m in model.named_modules() if isinstance(m, weight_only)]
    for name, module in list(model.named_modules()):
        if not isinstance(module, linear_types):
            continue
        if any(name.startswith(f"{w}.") for w in quantized):
            continue  # the dense copy inside a weight-only layer, which no longer runs
        if isinstance(module, weight_only):
            setattr(module, "max_rows", sys.maxsize)  # noqa: B010 (one kernel for every row count)
        in_f, out_f = int(getattr(module, "in_features")), int(getattr(module, "out_features"))  # noqa: B009
        key = (type(module).__name__, in_f, out_f)
        if key not in tiles:
            tiles[key] = probe_tile(module, in_f, dtype, device, rows)
            logger.info("batch invariance: %s %dx%d %s", key[0], out_f, in_f, _describe(tiles[key]))
        if tiles[key]:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, InvariantLinear(module, tiles[key]))
            wrapped += 1
    return wrapped


def _describe(tile: int) -> str:
    return "invariant as it is" if tile == 0 else f"called {tile} row(s) at a time"


def tile_attention_invariant(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, serial: bool
) -> bool:
    """Whether tile attention gives each query row the same bits alone, among many tiles and key
    buckets, and next to another sequence's rows, with this machine's matmuls (`serial`: on one
    thread)."""
    from specgate.engine.attention import AttentionMetadata, paged_attention, tile_groups
    from specgate.engine.kv_cache import KVCache

    g = torch.Generator(device="cpu").manual_seed(0)
    ctx = 3 * KEY_BUCKET + 7  # rows in four key buckets
    cache = KVCache(1, kv_heads, head_dim, ctx // 16 + 2, 16, dtype, str(device))
    keys = torch.randn(2, kv_heads, ctx, head_dim, generator=g).to(device=device, dtype=dtype)
    cache.write(0, torch.arange(ctx, device=device), keys[0], keys[1])
    q = torch.randn(heads, 40, head_dim, generator=g).to(device=device, dtype=dtype)
    slots = torch.arange(ctx)
    start = ctx - 37  # 37 rows of one sequence after 3 rows of another (over the first 43 slots)

    no_kv = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)  # nothing new to store

    def attend(rows: list[tuple[int, int, torch.Tensor]], queries: torch.Tensor) -> torch.Tensor:
        groups = [t.to(device) for t in tile_groups(rows, ATTENTION_TILE, key_bucket, cache.trash_slot)]
        no_slots = torch.empty(0, dtype=torch.long, device=device)
        meta = AttentionMetadata(cache, no_slots, tiles=groups, serial_tiles=serial)
        return paged_attention(meta, 0, queries, no_kv, no_kv, head_dim**-0.5)

    with torch.inference_mode():
        together = attend([(0, 40, slots[:43]), (3, start, slots)], q)[3:]
        for i in (0, 1, 5, 17, 36):
            alone = attend([(0, start + i, slots[: start + i + 1])], q[:, 3 + i : 4 + i])
            if not torch.equal(alone[0], together[i]):
                return False
    return True
