"""Paged attention as one opaque torch op, so a compiled decoder graph can call it.

A compiled step (engine/models/compiled.py) is one graph per padded token count; the step's
attention metadata (slots, groups, masks: Python objects that change every step) cannot be graph
inputs. The graph calls `torch.ops.specgate.paged_attention(q, k, v, layer, scale)` instead, and
the op reads the metadata bound for the current forward pass (as vLLM's attention op reads its
forward context). Rows past the metadata's token count are the bucket's padding: their keys and
values are never written, and their output is zeros.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specgate.engine.attention import AttentionMetadata, paged_attention

_bound = threading.local()


@contextmanager
def bind_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """The metadata the op reads during one forward pass on this thread."""
    previous = getattr(_bound, "meta", None)
    _bound.meta = meta
    try:
        yield
    finally:
        _bound.meta = previous


@torch.library.custom_op("specgate::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,  # [heads, padded_tokens, head_dim]
    key: torch.Tensor,  # [kv_heads, padded_tokens, head_dim]
    value: torch.Tensor,  # [kv_heads, padded_tokens, head_dim]
    layer: int,
    scale: float,
) -> torch.Tensor:  # [padded_tokens, heads, head_dim]
    meta: AttentionMetadata | None = getattr(_bound, "meta", None)
    if meta is None:
        raise RuntimeError("specgate.paged_attention called outside bind_metadata()")
    heads, padded, head_dim = query.shape
    n = meta.slot_mapping.shape[0]
    if n == padded:
        # A fresh tensor (a custom op's output may not alias its inputs): paged_attention returns
        # attention's own output, or a buffer it allocated.
        return paged_attention(meta, layer, query, key, value, scale)
    real = paged_attention(meta, layer, query[:, :n], key[:, :n], value[:, :n], scale)  # [n, heads, head_dim]
    out = query.new_zeros(padded, heads, head_dim)
    out[:n] = real
    return out


@paged_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    heads, padded, head_dim = query.shape
    return query.new_empty(padded, heads, head_dim)
