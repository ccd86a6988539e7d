"""Runs one forward pass of the target model over a ragged batch of sequences."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specgate.engine.attention import AttentionMetadata, BatchedGroup, LongChunk, tile_groups
from specgate.engine.batch_invariant import ATTENTION_TILE, key_bucket, tile_attention_invariant
from specgate.engine.config import EngineConfig
from specgate.engine.kv_cache import KVCache
from specgate.engine.loader import load_model, resolve_model
from specgate.engine.models.build import build_model

logger = logging.getLogger(__name__)

# Sequences with at most this many new tokens (decode, verification) may share a padded attention call.
SHORT_MAX_TOKENS = 16
# On CPU, only sequences with contexts up to this many keys share a padded attention call; longer
# ones attend alone. Padding every row to the longest context costs a gather and attention over keys
# nobody needs: at batch 16 with contexts of 100-1500 tokens one layer's padded call took 33 ms against
# 2.0 ms for one call per sequence over views of the pool. A call costs ~25 us, so one call per
# sequence pays from about 150 keys up (16 x 100 keys: 0.34 ms padded, 0.47 ms alone).
SHARED_MAX_CONTEXT = 128


@dataclass(slots=True)
class ForwardItem:
    token_ids: Sequence[int]  # new tokens of one sequence, at positions start, start + 1, ...
    start: int
    block_table: Sequence[int]  # must already cover start + len(token_ids) positions
    num_logits: int  # logits wanted for this many trailing positions


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.source = resolve_model(config.model, config.gguf_file)
        hf_model, self.tokenizer = load_model(
            self.source, config.torch_dtype, config.device, config.convert_cache_dir
        )
        text_config = hf_model.config.get_text_config()
        num_layers = text_config.num_hidden_layers
        heads = text_config.num_attention_heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        self.vocab_size = int(text_config.vocab_size)
        # CPU attention runs in fp32 (bf16 SDPA is several times slower there); keep the pool in fp32
        # so no per-layer cast of the whole context is needed.
        self.compute_dtype = torch.float32 if self.device.type == "cpu" else config.torch_dtype
        block_size = config.block_size
        per_token = KVCache.bytes_per_token(num_layers, kv_heads, head_dim, self.compute_dtype)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // (per_token * block_size))
        self.kv_cache = KVCache(
            num_layers, kv_heads, head_dim, num_blocks, block_size, self.compute_dtype, config.device
        )
        limits = [num_blocks * block_size, int(getattr(text_config, "max_position_embeddings", 0) or 1 << 30)]
        if config.max_model_len is not None:
            limits.append(config.max_model_len)
        window = getattr(text_config, "sliding_window", None)
        uses_window = getattr(text_config, "use_sliding_window", True) and "sliding_attention" in (
            getattr(text_config, "layer_types", None) or ["sliding_attention"]
        )
        if window and uses_window:
            # Within the window, sliding attention equals full attention; beyond it we would be wrong.
            limits.append(int(window))
        self.max_model_len = min(limits)
        self.model, self.compact = build_model(hf_model, config, self.source, self.max_model_len)
        del hf_model  # for the compact decoder, the last reference to the Hugging Face weights
        if self.compact and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.hidden_size = int(text_config.hidden_size)
        self.serial_tiles = False
        if config.deterministic:
            args = (heads, kv_heads, head_dim, self.compute_dtype, self.device)
            if not tile_attention_invariant(*args, serial=False):
                self.serial_tiles = True
                if not tile_attention_invariant(*args, serial=True):
                    raise RuntimeError(
                        "deterministic mode: this machine's attention matmuls are not batch-invariant"
                    )
                logger.warning("deterministic mode: attention matmuls run on one thread on this machine")
        # The final norm's output is the feature a feature-level drafter (EAGLE) reads; a hook keeps a
        # reference to it on the forward passes that ask (no copy, no cost otherwise).
        self._capture = False
        self._captured: torch.Tensor | None = None
        final_norm = None if self.compact else getattr(self.model.get_decoder(), "norm", None)
        self.has_features = self.compact or isinstance(final_norm, torch.nn.Module)
        if final_norm is not None:
            final_norm.register_forward_hook(self._keep_hidden)
        # With prefix caching, each slot's final-norm feature is kept beside its keys and values, so a
        # feature-level drafter (EAGLE) can start after a cache hit (~2.5% of the pool's bytes).
        self.features: torch.Tensor | None = None  # [num_slots, hidden]
        if config.prefix_caching and self.has_features:
            shape = (self.kv_cache.num_slots, int(text_config.hidden_size))
            self.features = torch.zeros(shape, dtype=config.torch_dtype, device=self.device)
        logger.info(
            "loaded %s (%s, %s, %s): KV pool %d blocks x %d tokens, %.1f MiB, max_model_len %d",
            self.source.name,
            config.dtype,
            config.device,
            "compact decoder" if self.compact else "Hugging Face modules",
            num_blocks,
            block_size,
            self.kv_cache.nbytes / 2**20,
            self.max_model_len,
        )

    def _keep_hidden(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        if self._capture:
            self._captured = output

    def embed_tokens(self) -> torch.nn.Module:
        module: torch.nn.Module = self.model.get_input_embeddings()
        return module

    def lm_head(self) -> torch.nn.Module:
        module: torch.nn.Module = self.model.get_output_embeddings()
        return module

    def weight_of(self, module: torch.nn.Module) -> torch.Tensor:
        """A plain layer's weight (not a prepacked one: build the runner with pack_linears=False)."""
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{type(module).__name__} has no plain weight; load with pack_linears=False")
        return weight

    def _slots(self, block_table: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        bs = self.kv_cache.block_size
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // bs] * bs + positions % bs

    def _run_start(self, block_table: Sequence[int], num_tokens: int) -> int | None:
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
            group.kv_start = self._run_start(items[0].block_table, s)
        if b > 1 or t > 1:
            q_pos = torch.stack(q_pos_rows)  # [b, t]
            mask = torch.arange(s).view(1, 1, s) <= q_pos.unsqueeze(-1)  # [b, t, s]
            group.mask = mask.unsqueeze(1).to(self.device)  # [b, 1, t, s]
        if num_tokens != b * t:
            lengths = torch.tensor([len(it.token_ids) for it in items]).view(b, 1)
            real = torch.arange(t).view(1, t) < lengths  # [b, t]
            group.q_index = torch.stack(q_index_rows).flatten().to(self.device)
            group.out_index = torch.nonzero(real.flatten()).flatten().to(self.device)
        return group

    def _attention_groups(self, items: Sequence[ForwardItem]) -> list[list[int]]:
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

    def _prepare(
        self, items: Sequence[ForwardItem]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[range]]:
        if self.config.deterministic:
            return self._prepare_tiled(items)
        long = [i for i, it in enumerate(items) if len(it.token_ids) > SHORT_MAX_TOKENS]
        ids: list[int] = []
        pos_parts: list[torch.Tensor] = []
        slot_parts: list[torch.Tensor] = []
        logit_rows: list[range] = [range(0)] * len(items)  # packed rows whose logits each item wants
        token_rows: list[range] = [range(0)] * len(items)  # packed rows of each item's new tokens
        meta = AttentionMetadata(self.kv_cache, torch.empty(0), compute_dtype=self.compute_dtype)
        for group in self._attention_groups(items):
            first_row = len(ids)
            ctx_slots: list[torch.Tensor] = []
            for i in group:
                it = items[i]
                n = len(it.token_ids)
                logit_rows[i] = range(len(ids) + n - it.num_logits, len(ids) + n)
                token_rows[i] = range(len(ids), len(ids) + n)
                ids.extend(it.token_ids)
                pos_parts.append(torch.arange(it.start, it.start + n))
                ctx_slots.append(self._slots(it.block_table, torch.arange(it.start + n)))
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
            q_pos = torch.arange(it.start, it.start + n)
            pos_parts.append(q_pos)
            ctx = it.start + n
            slots = self._slots(it.block_table, torch.arange(ctx))  # [ctx]
            slot_parts.append(slots[it.start :])  # the new tokens' own slots
            mask = torch.arange(ctx).view(1, ctx) <= q_pos.view(n, 1)  # [n, ctx]
            meta.long_chunks.append(
                LongChunk(
                    start_tok,
                    start_tok + n,
                    slots.to(self.device),
                    mask.to(self.device),
                    self._run_start(it.block_table, ctx),
                )
            )
            logit_rows[i] = range(start_tok + n - it.num_logits, start_tok + n)
        meta.slot_mapping = torch.cat(slot_parts).to(self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [num_tokens]
        positions = torch.cat(pos_parts).to(self.device)  # [num_tokens]
        logit_index = torch.tensor(
            [r for rows in logit_rows for r in rows], dtype=torch.long, device=self.device
        )
        return input_ids, positions, logit_index, meta, token_rows

    def _prepare_tiled(
        self, items: Sequence[ForwardItem]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[range]]:
        """Deterministic mode: items packed in order, every row attended in fixed tiles."""
        ids: list[int] = []
        token_rows: list[range] = []
        logit_index: list[int] = []
        tiled: list[tuple[int, int, torch.Tensor]] = []
        for it in items:
            n, row0 = len(it.token_ids), len(ids)
            ids.extend(it.token_ids)
            token_rows.append(range(row0, row0 + n))
            logit_index.extend(range(row0 + n - it.num_logits, row0 + n))
            tiled.append((row0, it.start, self._slots(it.block_table, torch.arange(it.start + n))))
        trash = self.kv_cache.trash_slot
        meta = AttentionMetadata(
            self.kv_cache,
            torch.cat([slots[start:] for _, start, slots in tiled]).to(self.device),
            compute_dtype=self.compute_dtype,
            serial_tiles=self.serial_tiles,
            tiles=[g.to(self.device) for g in tile_groups(tiled, ATTENTION_TILE, key_bucket, trash)],
        )
        positions = torch.cat([torch.arange(it.start, it.start + len(it.token_ids)) for it in items])
        return (
            torch.tensor(ids, dtype=torch.long, device=self.device),  # [num_tokens]
            positions.to(self.device),  # [num_tokens]
            torch.tensor(logit_index, dtype=torch.long, device=self.device),
            meta,
            token_rows,
        )

    @torch.inference_mode()
    def execute(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """Run the batch; return logits [sum of num_logits, vocab] in item order."""
        return self.execute_with_hidden(items, False)[0]

    @torch.inference_mode()
    def execute_with_hidden(
        self, items: Sequence[ForwardItem], hidden: bool
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Logits [sum of num_logits, vocab] in item order and, if `hidden`, each item's final-norm
        hidden states [len(token_ids), hidden_size] (the features EAGLE drafts from)."""
        if hidden and not self.has_features:
            raise ValueError(f"{self.source.name}: no final norm found to read hidden states from")
        input_ids, positions, logit_index, meta, token_rows = self._prepare(items)
        keep = self.features is not None
        if self.compact:
            logits, packed = self.model(input_ids, positions, meta, logit_index, hidden or keep)
        else:
            logits, packed = self._forward_hf(input_ids, positions, meta, logit_index, hidden or keep)
        if self.features is not None and packed is not None:
            self.features.index_copy_(0, meta.slot_mapping, packed.to(self.features.dtype))
        features = None
        if hidden:
            assert packed is not None
            features = [packed[r.start : r.stop] for r in token_rows]
        return logits, features  # [num_logits, vocab]

    def cached_features(self, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """The kept final-norm features [num_tokens, hidden] of a sequence's first positions."""
        assert self.features is not None, "features are kept only with prefix caching"
        slots = self._slots(block_table, torch.arange(num_tokens)).to(self.device)
        return self.features.index_select(0, slots)

    def _forward_hf(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        logit_index: torch.Tensor,
        hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._capture, self._captured = hidden, None
        try:
            out = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                logits_to_keep=logit_index,
                specgate_meta=meta,
            )
        finally:
            self._capture = False
        packed = None
        if hidden:
            assert self._captured is not None, "the final norm did not run"
            packed = self._captured[0]  # [num_tokens, hidden]
            self._captured = None
        return out.logits[0], packed
