"""Runs one forward pass of the target model over a ragged batch of sequences."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specgate.engine.attention import AttentionMetadata
from specgate.engine.batch_invariant import tile_attention_invariant
from specgate.engine.batch_layout import BatchLayout, ForwardItem
from specgate.engine.config import EngineConfig
from specgate.engine.kv_cache import KVCache
from specgate.engine.loader import load_model, resolve_model
from specgate.engine.models.build import build_model, build_native, native_gguf
from specgate.engine.models.compiled import CompiledSteps
from specgate.engine.models.family import unsupported

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.source = resolve_model(config.model, config.gguf_file)
        # A Llama-family GGUF file on CPU is served from its own blocks by the native kernels: only
        # its configuration and tokenizer are loaded through transformers, never its weights.
        self.native = native_gguf(config, self.source)
        hf_model = None
        if self.native is not None:
            model_config, self.tokenizer = self.native.config, self.native.tokenizer
            if config.dtype_auto:
                config.dtype = "float32"
        else:
            hf_model, self.tokenizer = load_model(
                self.source, config.torch_dtype, config.device, config.convert_cache_dir
            )
            model_config = hf_model.config
        text_config = model_config.get_text_config()
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
        # The compact decoder masks each sliding layer's window itself (attention.windowed), and so
        # does the paged attention function for the Hugging Face modules of those families, which
        # hand it their window. Another family's modules might not: within the window, sliding
        # attention equals full attention.
        if window and uses_window and unsupported(model_config) is not None:
            limits.append(int(window))
        self.max_model_len = min(limits)
        self.weight_bytes: int | None = None  # bytes of weights a decode step reads (native GGUF)
        if self.native is not None:
            self.model, self.weight_bytes = build_native(self.native, config, self.source, self.max_model_len)
            self.compact = True
        else:
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
        self.layout = BatchLayout(
            self.kv_cache, self.device, self.compute_dtype, config.deterministic, self.serial_tiles
        )
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
        self.compiled = self._compile(config)
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

    def _compile(self, config: EngineConfig) -> CompiledSteps | None:
        if not config.compile_sizes:
            return None
        why = None
        if not self.compact:
            why = "it runs the compact decoder only"
        elif config.deterministic:
            why = "deterministic mode fixes its own kernels"
        elif self.device.type != "cpu":
            why = "compiled steps run on CPU only"
        elif self.model.family.sliding:
            why = "compiled steps attend without sliding windows"
        if why is not None:
            logger.warning("compile_sizes ignored: %s", why)
            return None
        try:
            return CompiledSteps(
                self.model, self.kv_cache, config.compile_sizes, self.compute_dtype, self.device
            )
        except Exception as e:  # no C++ compiler, an inductor bug: serve eagerly, as without the setting
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            logger.warning("compiling the decode step failed, running it eagerly: %s", first_line)
            return None

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
        input_ids, positions, logit_index, meta, token_rows = self.layout.pack(items)
        keep = self.features is not None
        packed: torch.Tensor | None
        compiled = (
            None if self.compiled is None else self.compiled.run(input_ids, positions, meta, logit_index)
        )
        if compiled is not None:
            logits, packed = compiled
        elif self.compact:
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

    def keep_path(self, block_table: Sequence[int], src: Sequence[int], dst: Sequence[int]) -> None:
        """Keys / values (and kept features) of positions `src` of a sequence copied to positions `dst`:
        a verified tree's accepted nodes into the positions their tokens now hold."""
        src_slots = self.layout.slots(block_table, torch.tensor(list(src))).to(self.device)
        dst_slots = self.layout.slots(block_table, torch.tensor(list(dst))).to(self.device)
        self.kv_cache.move(src_slots, dst_slots)
        if self.features is not None:
            self.features.index_copy_(0, dst_slots, self.features.index_select(0, src_slots))

    def cached_features(self, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """The kept final-norm features [num_tokens, hidden] of a sequence's first positions."""
        assert self.features is not None, "features are kept only with prefix caching"
        slots = self.layout.slots(block_table, torch.arange(num_tokens)).to(self.device)
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
