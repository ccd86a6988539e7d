"""Paged KV block accounting: a free list of fixed-size blocks and per-sequence block tables.

Blocks are only ever appended to or popped from the end of a table, so rollback (speculation)
and preemption free memory without copying any cache contents.
"""

from __future__ import annotations

from typing import Protocol


class HasBlockTable(Protocol):
    block_table: list[int]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # LIFO free list: recently freed blocks are reused first, which keeps the hot set small.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold its first `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: HasBlockTable, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= len(self._free)

    def allocate(self, seq: HasBlockTable, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            seq.block_table.append(self._free.pop())

    def truncate(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` tokens (rollback)."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            self._free.append(seq.block_table.pop())

    def free(self, seq: HasBlockTable) -> None:
        self.truncate(seq, 0)
