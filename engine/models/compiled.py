"""Compiled decode and verify steps for the compact decoder: one graph per token-count bucket.

A batch-1 decode step of the default model runs ~3,000 small torch ops in eager mode, and their
dispatch cost as much as the weight-only matmuls themselves. torch.compile (inductor, weights frozen
as constants, C++ wrapper, autotuned GEMM templates) turns the whole step into one graph of fused
C++ kernels with one opaque call per layer for paged attention (engine/attention_op.py).

Shapes are static: a step of n tokens runs the graph of the smallest bucket >= n, padded with
token 0 at position 0 (pad rows write no keys or values and their logits are dropped). Steps with
more tokens than the largest bucket (prefill chunks, big batches) run eagerly, where the matmuls
dominate anyway. Each bucket has its own code object, so each has exactly one cache entry and its
guards can be skipped after the warm-up: the caller alone picks which graph runs, by shape.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specgate.engine.attention import AttentionMetadata, BatchedGroup
from specgate.engine.attention_op import bind_metadata
from specgate.engine.kv_cache import KVCache
from specgate.engine.models.llama import CompactCausalLM

logger = logging.getLogger(__name__)

# Weights frozen as constants let inductor pick its prepacked GEMM templates (int4 and bf16); the C++
# wrapper removes the Python glue between kernels. Autotuning reports go nowhere (they would be
# written to stderr, past logging).
INDUCTOR_OPTIONS = {
    "freezing": True,
    "cpp_wrapper": True,
    "max_autotune": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}
# Warm-up timings per bucket, compiled and eager; a bucket whose graph is not faster runs eagerly.
_TIMED_CALLS = 5


def _graph(
    model: CompactCausalLM, input_ids: torch.Tensor, positions: torch.Tensor, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [bucket, vocab] and final-norm hidden states [bucket, hidden] of every row."""
    op = torch.ops.specgate.paged_attention
    scale = model.scale

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return op(q, k, v, layer, scale)  # type: ignore[no-any-return]

    hidden = model.hidden_states(input_ids, positions, attend, compute)  # [bucket, hidden]
    return model.lm_head(hidden), hidden


def _entry_point(bucket: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`_graph` under a code object of its own (dynamo keeps its compiled graphs per code object)."""
    code = _graph.__code__.replace(co_name=f"_graph_{bucket}", co_qualname=f"_graph_{bucket}")
    return types.FunctionType(code, _graph.__globals__, f"_graph_{bucket}")


def warmup_metadata(
    kv_cache: KVCache, rows: int, compute: torch.dtype, device: torch.device
) -> AttentionMetadata:
    """Metadata for `rows` one-token sequences that read and write only the pool's trash slot."""
    trash = kv_cache.trash_slot
    slots = torch.full((rows,), trash, dtype=torch.long, device=device)
    group = BatchedGroup(0, rows, rows, 1, slots.view(rows, 1), None)
    return AttentionMetadata(kv_cache, slots, groups=[group], compute_dtype=compute)


class CompiledSteps:
    """The compiled graphs of one compact model; `run` returns None for a step no bucket holds."""

    def __init__(
        self,
        model: CompactCausalLM,
        kv_cache: KVCache,
        buckets: Sequence[int],
        compute: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.compute = compute
        self.device = device
        self.graphs: dict[int, Callable[..., Any]] = {}
        start = time.perf_counter()
        for bucket in sorted(set(buckets)):
            fn = torch.compile(_entry_point(bucket), fullgraph=True, dynamic=False)
            compiled_ms, eager_ms = self._warm_up(fn, kv_cache, bucket)
            if compiled_ms < eager_ms:
                self.graphs[bucket] = fn
            logger.info(
                "compiled step, %d tokens: %.2f ms against %.2f ms eager%s",
                bucket,
                compiled_ms,
                eager_ms,
                "" if compiled_ms < eager_ms else " (not faster: runs eagerly)",
            )
        kv_cache.k[:, :, kv_cache.trash_slot].zero_()  # the warm-up wrote model outputs there
        kv_cache.v[:, :, kv_cache.trash_slot].zero_()
        logger.info("compiled %d step graphs in %.1f s", len(self.graphs), time.perf_counter() - start)

    @torch.inference_mode()
    def _warm_up(self, fn: Callable[..., Any], kv_cache: KVCache, bucket: int) -> tuple[float, float]:
        """Compile `fn` for `bucket` rows; the median ms per call of it and of the eager model."""
        meta = warmup_metadata(kv_cache, bucket, self.compute, self.device)
        # Distinct tensors like a real step's: dynamo guards on whether inputs alias each other.
        ids = torch.zeros(bucket, dtype=torch.long, device=self.device)
        positions = torch.zeros(bucket, dtype=torch.long, device=self.device)
        index = torch.arange(bucket, device=self.device)

        def compiled() -> None:
            with bind_metadata(meta):
                fn(self.model, ids, positions, self.compute)

        def eager() -> None:
            self.model(ids, positions, meta, index)

        # The options as a config patch around the compiling call: passed to torch.compile, freezing
        # is not applied (torch 2.13), and the mkldnn linears need frozen weights.
        with torch._inductor.config.patch(INDUCTOR_OPTIONS):
            compiled()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            compiled_ms = _median_ms(compiled)
        return compiled_ms, _median_ms(eager)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest compiled size that holds `num_tokens`; None if none does."""
        return min((b for b in self.graphs if b >= num_tokens), default=None)

    def run(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        meta: AttentionMetadata,
        logit_index: torch.Tensor,  # [num_logits]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits [num_logits, vocab] and hidden states [num_tokens, hidden], or None (run eagerly)."""
        n = input_ids.shape[0]
        bucket = self.bucket(n)
        if bucket is None:
            return None
        if bucket != n:
            pad = bucket - n  # token 0 at position 0: valid rows whose outputs nobody reads
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        try:
            with bind_metadata(meta), torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                logits, hidden = self.graphs[bucket](self.model, input_ids, positions, self.compute)
        except RuntimeError as e:
            # Raised before the graph runs (nothing written): inputs unlike the warm-up's. Never seen;
            # if it happens, that bucket runs eagerly from now on rather than failing requests.
            if "Recompilation" not in str(e):
                raise
            logger.error("compiled step of %d tokens rejected its inputs; running it eagerly", bucket)
            del self.graphs[bucket]
            return None
        return logits.index_select(0, logit_index), hidden[:n]


def _median_ms(fn: Callable[[], None]) -> float:
    times = []
    for _ in range(_TIMED_CALLS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]
