"""How one forward pass lays out a ragged batch: the packed token rows, their positions, the rows whose
logits are wanted, and the attention metadata (which sequences share an attention call, and where
each one reads its keys and values: a view of the pool, its own gathered slots, or a padded batch)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgate.engine.attention import AttentionMetadata, BatchedGroup, LongChunk, tile_groups
from specgate.engine.batch_invariant import ATTENTION_TILE, key_bucket
from specgate.engine.kv_cache import KVCache

# Sequences with at most this many new tokens (decode, verification) may share a padded attention call.
SHORT_MAX_TOKENS = 16
# On CPU, only sequences with contexts up to this many keys share a padded attention call; longer
# ones attend alone. Padding every row to the longest context costs a gather and attention over keys
# nobody needs: at batch 16 with contexts of 100-1500 tokens one layer's padded call took 33 ms against
# 2.0 ms for one call per sequence over views of the pool. A call costs ~25 us, so one call per
# sequence pays from about 150 keys up (16 x 100 keys: 0.34 ms padded, 0.47 ms alone).
SHARED_MAX_CONTEXT = 128


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool over a draft tree's root (row and column 0) and its n nodes: True where the
    row's token may attend the column's, i.e. the column is the row itself or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        row = i + 1
        mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask


@dataclass(slots=True)
class ForwardItem:
    token_ids: Sequence[int]  # new tokens of one sequence, at positions start, start + 1, ...
    start: int
    block_table: Sequence[int]  # must already cover start + len(token_ids) positions
    num_logits: int  # logits wanted for this many trailing positions
    # A draft tree to verify: the first token is its root (the sequence's last committed token) and
    # the rest its nodes, with their parents as in engine/spec_decode/draft_tree.py (-1: the root).
    # Token j then sits at position start + its depth, attends to the context and its ancestors
    # only, and its key / value goes to slot start + j all the same.
    tree: Sequence[int] | None = None

    def positions(self) -> torch.Tensor:
        """[len(token_ids)] position of each new token."""
        if self.tree is None:
            return torch.arange(self.start, self.start + len(self.token_ids))
        # A token's depth is the number of its ancestors, the root included: its mask row less itself.
        return self.start + ancestor_mask(self.tree).sum(dim=-1) - 1

    def mask(self, t: int, s: int) -> torch.Tensor:
        """[t, s] bool: which of the first s context slots each new token attends to; rows past the
        item's own tokens repeat its last one (padding that sees a whole real context)."""
        n = len(self.token_ids)
        q_pos = torch.arange(self.start, self.start + n).view(n, 1)
        rows = torch.arange(s).view(1, s) <= q_pos  # [n, s] causal over the slots
        if self.tree is not None:
            rows[:, self.start : self.start + n] = ancestor_mask(self.tree)
        if t > n:
            rows = torch.cat([rows, rows[n - 1 :].expand(t - n, s)])
        return rows


Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[range]]


class BatchLayout:
    """Lays out forward items for one KV pool: pack(items) gives input ids [num_tokens], positions
    [num_tokens], the logit rows [num_logits], the attention metadata and each item's packed rows."""

    def __init__(
        self,
        kv_cache: KVCache,
        device: torch.device,
        compute_dtype: torch.dtype,
        deterministic: bool = False,
        serial_tiles: bool = False,
    ) -> None:
        self.kv_cache = kv_cache
        self.device = device
        self.compute_dtype = compute_dtype
        self.deterministic = deterministic
        self.serial_tiles = serial_tiles

    def slots(self, block_table: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        bs = self.kv_cache.block_size
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // bs] * bs + positions % bs

    def run_start(self, block_table: Sequence[int], num_tokens: int) -> int | None:
        """The first slot of a context of `num_tokens` positions whose blocks are consecutive in the
        pool (then its slots are one range and attention can read a view); None otherwise."""
        bs = self.kv_cache.block_size
        first = block_table[0]
        for j in range(1, (num_tokens + bs - 1) // bs):
            if block_table[j] != first + j:
                return None
        return int(first) * bs

    def _batched_group(
        self, items: Sequence[ForwardItem], ctx_slots: Sequence[torch.Tensor], first_row: int, num_tokens: int
    ) -> BatchedGroup:
        """ctx_slots[i]: [start + n] slots of item i's whole context, its new tokens included."""
        b = len(items)
        t = max(len(it.token_ids) for it in items)
        s = max(it.start + len(it.token_ids) for it in items)
        trash = self.kv_cache.trash_slot
        kv_rows, q_pos_rows, q_index_rows = [], [], []
        row = first_row
        for it, slots in zip(items, ctx_slots, strict=True):
            n = len(it.token_ids)
            ctx = it.start + n
            kv_rows.append(torch.cat([slots, torch.full((s - ctx,), trash)]))
            # A row shorter than t is padded by repeating its last query, which sees its whole context.
            q_pos_rows.append(torch.arange(it.start, it.start + t).clamp_(max=ctx - 1))
            q_index_rows.append(torch.arange(row, row + t).clamp_(max=row + n - 1))
            row += n
        group = BatchedGroup(first_row, num_tokens, b, t, torch.stack(kv_rows).to(self.device), None)
        if b == 1:
            group.kv_start = self.run_start(items[0].block_table, s)
        if any(it.tree is not None for it in items):
            group.mask = torch.stack([it.mask(t, s) for it in items]).unsqueeze(1).to(self.device)
        elif b > 1 or t > 1:
            q_pos = torch.stack(q_pos_rows)  # [b, t]
            mask = torch.arange(s).view(1, 1, s) <= q_pos.unsqueeze(-1)  # [b, t, s]
            group.mask = mask.unsqueeze(1).to(self.device)  # [b, 1, t, s]
        if num_tokens != b * t:
            lengths = torch.tensor([len(it.token_ids) for it in items]).view(b, 1)
            real = torch.arange(t).view(1, t) < lengths  # [b, t]
            group.q_index = torch.stack(q_index_rows).flatten().to(self.device)
            group.out_index = torch.nonzero(real.flatten()).flatten().to(self.device)
        return group

    def attention_groups(self, items: Sequence[ForwardItem]) -> list[list[int]]:
        """The items with few new tokens, in groups that share one attention call: decodes together,
        verifications together; on CPU, a sequence with a long context attends alone."""
        decode = [i for i, it in enumerate(items) if len(it.token_ids) == 1]
        verify = [i for i, it in enumerate(items) if 1 < len(it.token_ids) <= SHORT_MAX_TOKENS]
        if self.device.type != "cpu":  # a GPU pays per call, not per padded key
            return [g for g in (decode, verify) if g]
        groups: list[list[int]] = []
        for kind in (decode, verify):
            short = [i for i in kind if items[i].start + len(items[i].token_ids) <= SHARED_MAX_CONTEXT]
            if short:
                groups.append(short)
            shared = set(short)
            groups.extend([i] for i in kind if i not in shared)
        return groups

    def pack(self, items: Sequence[ForwardItem]) -> Packed:
        if self.deterministic:
            return self._pack_tiled(items)
        long = [i for i, it in enumerate(items) if len(it.token_ids) > SHORT_MAX_TOKENS]
        ids: list[int] = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        logit_rows: list[range] = [range(0)] * len(items)  # packed rows whose logits each item wants
        token_rows: list[range] = [range(0)] * len(items)  # packed rows of each item's new tokens
        meta = AttentionMetadata(self.kv_cache, torch.empty(0), compute_dtype=self.compute_dtype)
        for group in self.attention_groups(items):
            first_row = len(ids)
            ctx_slots: list[torch.Tensor] = []
            for i in group:
                it = items[i]
                n = len(it.token_ids)
                logit_rows[i] = range(len(ids) + n - it.num_logits, len(ids) + n)
                token_rows[i] = range(len(ids), len(ids) + n)
                ids.extend(it.token_ids)
                pos_parts.append(it.positions())
                ctx_slots.append(self.slots(it.block_table, torch.arange(it.start + n)))
                slot_parts.append(ctx_slots[-1][it.start :])  # the new tokens' own slots
            meta.groups.append(
                self._batched_group([items[i] for i in group], ctx_slots, first_row, len(ids) - first_row)
            )
        for i in long:
            it = items[i]
            n = len(it.token_ids)
            start_tok = len(ids)
            token_rows[i] = range(start_tok, start_tok + n)
            ids.extend(it.token_ids)
            pos_parts.append(it.positions())
            ctx = it.start + n
            slots = self.slots(it.block_table, torch.arange(ctx))  # [ctx]
            slot_parts.append(slots[it.start :])  # the new tokens' own slots
            mask = it.mask(n, ctx)  # [n, ctx]
            meta.long_chunks.append(
                LongChunk(
                    start_tok,
                    start_tok + n,
                    slots.to(self.device),
                    mask.to(self.device),
                    self.run_start(it.block_table, ctx),
                )
            )
            logit_rows[i] = range(start_tok + n - it.num_logits, start_tok + n)
        meta.slot_mapping = torch.cat(slot_parts).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]
        positions = torch.cat(pos_parts).to(self.device)  # [num_tokens]
        meta.positions = positions
        logit_index = torch.tensor(
            [r for rows in logit_rows for r in rows], dtype=torch.long, device=self.device
        )
        return input_ids, positions, logit_index, meta, token_rows

    def _pack_tiled(self, items: Sequence[ForwardItem]) -> Packed:
        """Deterministic mode: items packed in order, every row attended in fixed tiles (chains only:
        the engine verifies no trees in this mode)."""
        if any(it.tree is not None for it in items):
            raise ValueError("deterministic mode verifies chains, not draft trees")
        ids: list[int] = []
        token_rows: list[range] = []
        logit_index: list[int] = []
        tiled: list[tuple[int, int, torch.Tensor]] = []
        for it in items:
            n, row0 = len(it.token_ids), len(ids)
            ids.extend(it.token_ids)
            token_rows.append(range(row0, row0 + n))
            logit_index.extend(range(row0 + n - it.num_logits, row0 + n))
            tiled.append((row0, it.start, self.slots(it.block_table, torch.arange(it.start + n))))
        trash = self.kv_cache.trash_slot
        meta = AttentionMetadata(
            self.kv_cache,
            torch.cat([slots[start:] for _, start, slots in tiled]).to(self.device),
            compute_dtype=self.compute_dtype,
            serial_tiles=self.serial_tiles,
            tiles=[g.to(self.device) for g in tile_groups(tiled, ATTENTION_TILE, key_bucket, trash)],
        )
        positions = torch.cat([torch.arange(it.start, it.start + len(it.token_ids)) for it in items])
        meta.positions = positions.to(self.device)
        return (
            torch.tensor(ids, dtype=torch.long, device=self.device),  # [num_tokens]
            positions.to(self.device),  # [num_tokens]
            torch.tensor(logit_index, dtype=torch.long, device=self.device),
            meta,
            token_rows,
        )
