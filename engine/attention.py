"""Paged attention over a ragged batch, for the compact models and transformers' attention interface.

`paged_attention` writes a layer's new keys/values into the paged pool and attends over each
sequence's cached context. The compact models (engine/models/) call it directly; for any other
architecture the Hugging Face model classes run unchanged, with it registered as their attention
function. Per-step metadata (slots, masks) is built once by the model runner and reaches every layer
(through the model's forward kwargs on the Hugging Face path).

Sequences with few new tokens share batched SDPA calls: one for plain decodes (one query each),
one for speculative verifications (k+1 queries, padded to the longest inside attention only, so
neither the linear layers nor the decodes pay for padding). Long prefill chunks get one call each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specgate.engine.kv_cache import KVCache

ATTENTION_NAME = "specgate_paged"


@dataclass(slots=True)
class LongChunk:
    start: int  # first packed token of the chunk
    end: int
    kv_slots: torch.Tensor  # [S] slots of the context, chunk included
    mask: torch.Tensor  # [T, S] bool, True where query t may attend key s
    kv_start: int | None = None  # the slots are kv_start .. kv_start + S - 1: read a view, no gather


@dataclass(slots=True)
class BatchedGroup:
    """Sequences with few new tokens each (decode, verification) served by one SDPA call.

    Their packed rows are contiguous; only attention sees them padded to [b, t]."""

    start: int  # first packed row of the group
    num_tokens: int  # real rows
    b: int
    t: int
    kv_slots: torch.Tensor  # [b, S] context slots, padded with the trash slot
    mask: torch.Tensor | None  # [b, 1, t, S]; None: every query attends to its whole row
    q_index: torch.Tensor | None = None  # [b * t] packed row of each padded query (ragged groups)
    out_index: torch.Tensor | None = None  # [num_tokens] padded position of each real row
    # One sequence whose context slots are kv_start .. kv_start + S - 1 (consecutive blocks, the usual
    # case at batch 1): attention reads a view of the pool instead of gathering a copy every layer.
    kv_start: int | None = None


@dataclass(slots=True)
class TileGroup:
    """Deterministic mode: queries in tiles of `tile` rows of one sequence each, over `keys` keys (a
    bucket fixed by the queries' positions). Every call has one shape per bucket and each query row
    meets only its own keys, so its result does not depend on the batch (engine/batch_invariant.py)."""

    tile: int
    rows: torch.Tensor  # [num_tiles * tile] packed row of each tile entry (padding repeats a real row)
    kv_slots: torch.Tensor  # [num_tiles, keys] slots of each tile's sequence, padded with the trash slot
    bias: torch.Tensor  # [num_tiles, tile, keys]: 0 for keys at or before the entry's position, else -inf
    real: torch.Tensor  # [num_real] tile entries that are real rows
    out_rows: torch.Tensor  # [num_real] the packed row each of them is

    def to(self, device: torch.device) -> TileGroup:
        return TileGroup(
            self.tile,
            self.rows.to(device),
            self.kv_slots.to(device),
            self.bias.to(device),
            self.real.to(device),
            self.out_rows.to(device),
        )


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [num_tokens] where each packed token's key/value is stored
    groups: list[BatchedGroup] = field(default_factory=list)
    long_chunks: list[LongChunk] = field(default_factory=list)
    compute_dtype: torch.dtype = torch.float32
    tiles: list[TileGroup] = field(default_factory=list)  # deterministic mode: all rows are here
    # Run the tiles' matmuls on one thread: where a probe found this machine's threaded matmuls
    # rounding a row differently with the number of tiles (engine/batch_invariant.py).
    serial_tiles: bool = False
    # [num_tokens] position of each packed row: sliding-window layers mask keys by it (`windowed`).
    positions: torch.Tensor | None = None
    _windowed: dict[int, AttentionMetadata] = field(default_factory=dict)


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step's metadata for a sliding-window layer: key s (a context slot index, which is the
    key's position; draft-tree nodes sit at or after theirs, always within any window) is visible to
    a query at position p only where p - s < window, as well as where `meta` allows. Built once
    per step and window; the step's own metadata where no query reaches past the window."""
    if window <= 0:
        return meta
    cached = meta._windowed.get(window)
    if cached is not None:
        return cached
    pos = meta.positions
    if pos is None:
        raise ValueError("a sliding-window layer needs the step's positions in its metadata")
    out = meta
    if pos.numel() and int(pos.max()) >= window:
        out = replace(
            meta,
            groups=[_windowed_group(g, pos, window) for g in meta.groups],
            long_chunks=[_windowed_chunk(c, pos, window) for c in meta.long_chunks],
            tiles=[_windowed_tiles(t, pos, window) for t in meta.tiles],
            _windowed={},
        )
    meta._windowed[window] = out
    return out


def _in_window(q_pos: torch.Tensor, keys: int, window: int) -> torch.Tensor:
    """[..., keys] bool: key s is within `window` of each query position in q_pos [...]."""
    s = torch.arange(keys, device=q_pos.device)
    return s > (q_pos.unsqueeze(-1) - window)


def _windowed_group(g: BatchedGroup, pos: torch.Tensor, window: int) -> BatchedGroup:
    rows = (
        g.q_index if g.q_index is not None else torch.arange(g.start, g.start + g.b * g.t, device=pos.device)
    )
    q_pos = pos.index_select(0, rows).view(g.b, 1, g.t)  # [b, 1, t]
    s = g.kv_slots.shape[1]
    near = _in_window(q_pos, s, window)  # [b, 1, t, S]
    # Without a mask, each sequence is one query over its whole row: causal already.
    return replace(g, mask=near if g.mask is None else g.mask & near)


def _windowed_chunk(c: LongChunk, pos: torch.Tensor, window: int) -> LongChunk:
    q_pos = pos[c.start : c.end]  # [T]
    return replace(c, mask=c.mask & _in_window(q_pos, c.mask.shape[1], window))


def _windowed_tiles(g: TileGroup, pos: torch.Tensor, window: int) -> TileGroup:
    nt, keys = g.kv_slots.shape
    q_pos = pos.index_select(0, g.rows).view(nt, g.tile)  # [nt, tile]
    bias = g.bias.masked_fill(~_in_window(q_pos, keys, window), float("-inf"))
    return replace(g, bias=bias)


def tile_groups(
    rows: list[tuple[int, int, torch.Tensor]], tile: int, bucket_of: Callable[[int], int], trash: int
) -> list[TileGroup]:
    """Tile groups for sequences given as (first packed row, first position, [ctx] context slots),
    each with new tokens at positions first position .. ctx - 1."""
    by_keys: dict[int, list[tuple[int, list[int], torch.Tensor]]] = {}  # keys -> (row0, positions, slots)
    for row0, start, slots in rows:
        ctx = slots.shape[0]
        positions = list(range(start, ctx))
        i = 0
        while i < len(positions):
            keys = bucket_of(positions[i])
            j = i
            while j < len(positions) and j - i < tile and bucket_of(positions[j]) == keys:
                j += 1
            by_keys.setdefault(keys, []).append((row0 + i, positions[i:j], slots))
            i = j
    groups = []
    for keys, tiles in by_keys.items():
        entry_rows: list[int] = []
        real: list[int] = []
        out_rows: list[int] = []
        kv: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for t, (row, positions, slots) in enumerate(tiles):
            n = len(positions)
            padded = positions + [positions[-1]] * (tile - n)
            entry_rows.extend(row + min(e, n - 1) for e in range(tile))
            kv_slots = slots[:keys]
            kv.append(torch.cat([kv_slots, torch.full((keys - kv_slots.shape[0],), trash)]))
            seen = torch.arange(keys).view(1, keys) <= torch.tensor(padded).view(tile, 1)  # [tile, keys]
            masks.append(torch.zeros(tile, keys).masked_fill_(~seen, float("-inf")))
            real.extend(range(t * tile, t * tile + n))
            out_rows.extend(range(row, row + n))
        groups.append(
            TileGroup(
                tile,
                torch.tensor(entry_rows),
                torch.stack(kv),
                torch.stack(masks),
                torch.tensor(real),
                torch.tensor(out_rows),
            )
        )
    return groups


def _tile_attention(
    meta: AttentionMetadata, layer: int, g: TileGroup, q: torch.Tensor, kv_heads: int, scale: float
) -> torch.Tensor:
    """Attention of one tile group in fixed-shape fp32 batched matmuls; [num_real, heads, head_dim]."""
    heads, _, d = q.shape
    nt, keys = g.kv_slots.shape
    rep, t = heads // kv_heads, g.tile
    k, v = meta.kv_cache.gather(layer, g.kv_slots.reshape(-1))  # [kv_heads, nt * keys, d]
    k = k.to(q.dtype).view(kv_heads, nt, keys, d)  # batched by (kv head, tile) without a copy
    v = v.to(q.dtype).view(kv_heads, nt, keys, d)
    qt = q.index_select(1, g.rows).view(kv_heads, rep, nt, t, d)  # heads grouped by their kv head
    qt = qt.transpose(1, 2).reshape(kv_heads, nt, rep * t, d)
    scores = torch.matmul(qt, k.transpose(-1, -2)).view(kv_heads, nt, rep, t, keys)
    scores = scores * scale + g.bias.unsqueeze(1)  # bias [nt, t, keys]: 0 or -inf
    probs = torch.softmax(scores, dim=-1).view(kv_heads, nt, rep * t, keys)
    o = torch.matmul(probs, v).view(kv_heads, nt, rep, t, d)  # [kv_heads, nt, rep, t, d]
    o = o.permute(1, 3, 0, 2, 4).reshape(nt * t, heads, d)
    return o.index_select(0, g.real)  # [num_real, heads, d]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def paged_attention(
    meta: AttentionMetadata,
    layer: int,
    query: torch.Tensor,  # [heads, num_tokens, head_dim]
    key: torch.Tensor,  # [kv_heads, num_tokens, head_dim]
    value: torch.Tensor,  # [kv_heads, num_tokens, head_dim]
    scale: float,
) -> torch.Tensor:
    """Store the step's keys/values in the pool and attend; returns [num_tokens, heads, head_dim]."""
    cache = meta.kv_cache
    cache.write(layer, meta.slot_mapping, key, value)
    heads, num_tokens, head_dim = query.shape
    # On CPU, fp32 SDPA is several times faster than bf16; on GPU this is the model dtype.
    q = query.to(meta.compute_dtype)  # [heads, num_tokens, head_dim]
    if meta.tiles:
        out = torch.empty(num_tokens, heads, head_dim, dtype=query.dtype, device=query.device)
        threads = torch.get_num_threads()
        if meta.serial_tiles:
            torch.set_num_threads(1)
        try:
            for tg in meta.tiles:
                out[tg.out_rows] = _tile_attention(meta, layer, tg, q, key.shape[0], scale).to(query.dtype)
        finally:
            if meta.serial_tiles:
                torch.set_num_threads(threads)
        return out
    # A step that is one batched group (plain decoding) returns that group's output as it is.
    whole = len(meta.groups) == 1 and meta.groups[0].num_tokens == num_tokens
    out = query if whole else torch.empty(num_tokens, heads, head_dim, dtype=query.dtype, device=query.device)
    for g in meta.groups:
        s = g.kv_slots.shape[1]
        k, v = cache.read(layer, g.kv_slots.reshape(-1), g.kv_start)  # [kv_heads, b * S, head_dim]
        k = k.view(-1, g.b, s, head_dim).transpose(0, 1)  # [b, kv_heads, S, head_dim]
        v = v.view(-1, g.b, s, head_dim).transpose(0, 1)
        rows = q[:, g.start : g.start + g.num_tokens]  # [heads, num_tokens, head_dim]
        if g.q_index is not None:
            rows = q.index_select(1, g.q_index)  # [heads, b * t, head_dim]
        qs = rows.reshape(heads, g.b, g.t, head_dim).transpose(0, 1)  # [b, heads, t, head_dim]
        o = _sdpa(qs, k.to(q.dtype), v.to(q.dtype), g.mask, scale)  # [b, heads, t, head_dim]
        o = o.permute(0, 2, 1, 3).reshape(g.b * g.t, heads, head_dim)
        if g.out_index is not None:
            o = o.index_select(0, g.out_index)  # [num_tokens, heads, head_dim]
        if whole:
            return o.to(query.dtype)
        out[g.start : g.start + g.num_tokens] = o
    for chunk in meta.long_chunks:
        k, v = cache.read(layer, chunk.kv_slots, chunk.kv_start)  # [kv_heads, S, head_dim]
        qc = q[:, chunk.start : chunk.end].unsqueeze(0)  # [1, heads, T, head_dim]
        o = _sdpa(qc, k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype), chunk.mask, scale)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


_NO_INDEX = torch.empty(0, dtype=torch.long)


def native_paged_attention(
    meta: AttentionMetadata, layer: int, q: torch.Tensor, scale: float, ops: Any
) -> torch.Tensor:
    """Attention of a step whose keys and values `ops.rope_store` has already put in the pool, on the
    native kernels (engine/kernels/attention.h): q [num_tokens, heads, head_dim] float32, returns the
    same shape. The calls are `native_calls(meta)`, as the one-call decoder makes them."""
    cache = meta.kv_cache
    calls = zip(*native_calls(meta), strict=True)
    out = torch.empty_like(q)
    for kv_slots, start, q_index, mask, t, out_index, out_start, out_count in calls:
        o = ops.paged_attend(q, cache.k, cache.v, layer, kv_slots, start, q_index, mask, t, scale)
        if out_index.numel():
            o = o.index_select(0, out_index)  # [out_count, heads, head_dim]
        out[out_start : out_start + out_count] = o
    return out


def native_calls(meta: AttentionMetadata) -> tuple[list[Any], ...]:
    """The step's attention calls as the native decoder takes them (engine/kernels/decoder.h): lists
    of kv_slots, starts, q_index, masks, t, out_index, out_start, out_count, one entry per call.
    Prefill chunks too: each query reads its own visible keys in position order, so its result does
    not depend on where a chunk starts or ends, or on whether its prefix came from the cache."""
    lists: tuple[list[Any], ...] = ([], [], [], [], [], [], [], [])
    for g in meta.groups:
        entry = (
            g.kv_slots,
            g.start,
            _NO_INDEX if g.q_index is None else g.q_index,
            _NO_INDEX if g.mask is None else g.mask,
            g.t,
            _NO_INDEX if g.out_index is None else g.out_index,
            g.start,
            g.num_tokens,
        )
        for target, value in zip(lists, entry, strict=True):
            target.append(value)
    for c in meta.long_chunks:
        t = c.end - c.start
        entry = (c.kv_slots.view(1, -1), c.start, _NO_INDEX, c.mask, t, _NO_INDEX, c.start, t)
        for target, value in zip(lists, entry, strict=True):
            target.append(value)
    return lists


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over `paged_attention` (the Hugging Face module path)."""
    meta = kwargs.get("specgate_meta")
    if not isinstance(meta, AttentionMetadata):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs specgate_meta from the engine's model runner")
    layer = int(getattr(module, "layer_idx", 0))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    if isinstance(window, int) and window > 0:
        meta = windowed(meta, window)
    out = paged_attention(meta, layer, query[0], key[0], value[0], scale)
    return out.unsqueeze(0), None  # [1, num_tokens, heads, head_dim]


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
