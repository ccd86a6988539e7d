"""The preallocated KV pool shared by every sequence, addressed by slot = block * block_size + offset."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One extra slot at the end backs the padded key reads of shorter sequences in a batch.
        self.num_slots = num_blocks * block_size + 1
        self.trash_slot = self.num_slots - 1
        # Layout [layer, kv_head, slot, head_dim]: gathering a sequence's slots yields the
        # [kv_head, tokens, head_dim] layout attention wants without a transpose copy.
        shape = (num_layers, num_kv_heads, self.num_slots, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new keys/values. slots: [T]; key, value: [kv_heads, T, head_dim]."""
        self.k[layer].index_copy_(1, slots, key.to(self.k.dtype))
        self.v[layer].index_copy_(1, slots, value.to(self.v.dtype))

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's keys / values at slots src [n] to slots dst [n]: an accepted tree path
        whose nodes were verified at scattered slots moves to the consecutive ones after its root."""
        self.k.index_copy_(2, dst, self.k.index_select(2, src))
        self.v.index_copy_(2, dst, self.v.index_select(2, src))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at `slots` ([S]) as [kv_heads, S, head_dim]."""
        return self.k[layer].index_select(1, slots), self.v[layer].index_select(1, slots)

    def read(
        self, layer: int, slots: torch.Tensor, start: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values at `slots` ([S]) as [kv_heads, S, head_dim]: views of the pool when the caller
        knows the slots are the range start .. start + S - 1, gathered copies otherwise."""
        if start is None:
            return self.gather(layer, slots)
        end = start + slots.shape[0]
        return self.k[layer, :, start:end], self.v[layer, :, start:end]
