"""Paged KV block accounting: a free list of fixed-size blocks, per-sequence block tables, and the
automatic prefix cache.

Blocks are only ever appended to or popped from the end of a table, so rollback (speculation)
and preemption free memory without copying any cache contents.

Prefix caching (as vLLM's automatic prefix caching and nano-vllm's block hashing do it): a full
block whose tokens are committed (its keys / values computed, no draft among them) is published
under a hash chained over every token before it and the request's salt, so the hash names the
block's exact contents. Blocks are ref-counted: a sequence whose tokens start with published blocks
takes them into its table instead of prefilling them. A block no sequence holds stays cached
(evictable, least recently used first) until an allocation needs it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class HasBlockTable(Protocol):
    block_table: list[int]


class CachedSeq(Protocol):
    """What prefix caching reads of a sequence (engine/sequence.py)."""

    block_table: list[int]
    token_ids: list[int]
    num_computed_tokens: int
    prefix_salt: str | None
    block_hashes: list[bytes]  # hashes of its leading full, committed blocks


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes | None, tokens: Sequence[int], salt: str) -> bytes:
    """The chained hash of a full block: its tokens, the hash of the block before it (or, for the
    first block, the salt), so equal hashes mean equal prefixes under the same salt."""
    h = hashlib.blake2b(digest_size=16)
    if parent is None:
        h.update(b"salt:" + salt.encode("utf-8", "surrogatepass") + b"\0")
    else:
        h.update(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, caching: bool = False, max_cached_blocks: int | None = None
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if max_cached_blocks is not None and max_cached_blocks < 0:
            raise ValueError("max_cached_blocks must be >= 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.max_cached_blocks = num_blocks if max_cached_blocks is None else max_cached_blocks
        # LIFO free list of blocks holding nothing reusable: recently freed blocks are reused first,
        # which keeps the hot set small.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        # Cached blocks no sequence holds, least recently released first: evicted in that order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queried_tokens = 0  # prompt tokens looked up, and those found: the hit rate
        self.hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: empty ones and cached ones no sequence holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def blocks_needed(self, seq: HasBlockTable, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold its first `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: HasBlockTable, num_tokens: int, reserve: int = 0) -> bool:
        return self.blocks_needed(seq, num_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: HasBlockTable, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            block = self._take()
            self._refs[block] = 1
            seq.block_table.append(block)

    def truncate(self, seq: HasBlockTable, num_tokens: int) -> None:
        """Keep only the blocks covering the first `num_tokens` tokens (rollback)."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        hashes: list[bytes] | None = getattr(seq, "block_hashes", None)
        if hashes is not None:
            del hashes[keep:]

    def free(self, seq: HasBlockTable) -> None:
        """Release every block of `seq`; its committed full blocks stay cached for later requests."""
        if self.caching:
            self.publish(seq)  # type: ignore[arg-type]
        self.truncate(seq, 0)

    # ---- prefix caching ----------------------------------------------------------------------

    def match(self, seq: CachedSeq) -> list[int]:
        """The cached blocks `seq`'s tokens start with. At least its last token is left to compute:
        its logits are what the next step samples from."""
        if not self.caching or seq.prefix_salt is None or seq.block_table:
            return []
        bs = self.block_size
        tokens = seq.token_ids
        hits: list[int] = []
        parent: bytes | None = None
        for i in range((len(tokens) - 1) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs], seq.prefix_salt)
            block = self._by_hash.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_reclaimed(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` (cache hits) an `acquire` would take out of the free pool."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def acquire(self, seq: CachedSeq, blocks: Sequence[int]) -> None:
        """Admit `seq` with cache hits `blocks` (from `match`, maybe none) as its first blocks; they
        count as computed."""
        if self.caching and seq.prefix_salt is not None:
            self.queried_tokens += len(seq.token_ids)
            self.hit_tokens += len(blocks) * self.block_size
        if not blocks:
            return
        assert not seq.block_table, "prefix hits start a sequence's table"
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(self._hash_of[block])  # type: ignore[arg-type]
        seq.num_computed_tokens = len(blocks) * self.block_size

    def share(self, seq: CachedSeq, donor: CachedSeq, num_blocks: int) -> None:
        """Start `seq` on `donor`'s first `num_blocks` blocks, which hold the same tokens, full and
        computed (a fork of parallel sampling: sequence.SequenceGroup). Full blocks are never
        written again, so sharing them needs a reference each and no copy; they count as computed.
        Not a prefix-cache lookup: the hit counters are left alone."""
        assert not seq.block_table, "a fork starts a sequence's table"
        if num_blocks > len(donor.block_table) or num_blocks * self.block_size > donor.num_computed_tokens:
            raise ValueError(f"the donor does not hold {num_blocks} computed blocks")
        for block in donor.block_table[:num_blocks]:
            self._refs[block] += 1  # the donor holds it, so it is not among the evictable ones
            seq.block_table.append(block)
        seq.block_hashes.extend(donor.block_hashes[:num_blocks])
        seq.num_computed_tokens = num_blocks * self.block_size

    def publish(self, seq: CachedSeq) -> None:
        """Publish `seq`'s full blocks whose tokens are all committed (computed, no drafts)."""
        if not self.caching or seq.prefix_salt is None:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        hashes = seq.block_hashes
        for i in range(len(hashes), min(full, len(seq.block_table))):
            parent = hashes[-1] if hashes else None
            h = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.prefix_salt)
            hashes.append(h)
            block = seq.block_table[i]
            if h not in self._by_hash and self._hash_of[block] is None:
                self._by_hash[h] = block
                self._hash_of[block] = h

    # ---- internals ---------------------------------------------------------------------------

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # least recently released
        self._forget(block)
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] > 0:
            return
        if self._hash_of[block] is None:
            self._free.append(block)
            return
        self._evictable[block] = None
        while len(self._evictable) > self.max_cached_blocks:
            old, _ = self._evictable.popitem(last=False)
            self._forget(old)
            self._free.append(old)

    def _forget(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            del self._by_hash[h]
            self._hash_of[block] = None
