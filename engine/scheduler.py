"""Continuous-batching scheduler: who runs in the next forward pass, and how many tokens each.

Every step, running sequences that are decoding are served first (one token each; speculation
will ask for more), then running sequences still prefilling, then waiting requests in arrival
order, all under one token budget so a long prompt is prefilled in chunks instead of stalling
the decodes. When the KV pool cannot hold a running sequence's next tokens, the most recently
admitted sequence is preempted: its blocks are freed and it is recomputed later from its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specgate.engine.block_manager import BlockManager, blocks_for
from specgate.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so its last position is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last is preempted first
        # Blocks kept free when admitting new work, so running decodes rarely need preemption.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        # Sequences admitted in the last schedule() with a prefix-cache hit (their leading blocks
        # were not prefilled: a proposer drafting from target features needs those of the cache).
        self.hits: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)  # its committed blocks stay cached: readmission may hit them
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        # Decoding sequences first, then those part-way through their prompt.
        order = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                scheduled = [s for s in scheduled if s.seq is not victim]
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        # Budget given back by preempted sequences is not reused this step: they just lost their blocks.
        budget = self.max_num_batched_tokens - sum(s.num_tokens for s in scheduled)
        self.hits = []
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.match(seq)
            computed = len(hits) * bm.block_size if hits else seq.num_computed_tokens
            n = min(seq.num_tokens - computed, budget)
            reserve = self.watermark_blocks if self.running else 0
            # Hit blocks that no sequence holds leave the free pool too.
            need = blocks_for(computed + n, bm.block_size) - len(seq.block_table) - len(hits)
            if need + bm.num_reclaimed(hits) + reserve > bm.num_free_blocks:
                break  # first come, first served: later arrivals do not overtake a blocked one
            self.waiting.popleft()
            bm.acquire(seq, hits)
            if hits:
                self.hits.append(seq)
                if not seq.stats.num_preemptions:
                    seq.stats.num_cached_tokens = seq.num_computed_tokens
            bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        return scheduled
