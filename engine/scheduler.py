"""Continuous-batching scheduler: who runs in the next forward pass, and how many tokens each.

Every step, running sequences that are decoding are served first (one token each; speculation
will ask for more), then running sequences still prefilling, then waiting requests, all under one
token budget so a long prompt is prefilled in chunks instead of stalling the decodes. When the KV
pool cannot hold a running sequence's next tokens, the most recently admitted sequence is
preempted: its blocks are freed and it is recomputed later from its tokens.

Batch slots are shared fairly between tenants (`Sequence.tenant`): a waiting request is admitted
from the tenant holding the fewest running slots (arrival order within a tenant), and when every
slot is taken while a tenant with fewer slots waits, the newest sequences of the tenant holding
the most are preempted until the two differ by at most one (at most `MAX_FAIR_PREEMPTIONS` a
step). One tenant alone still gets every slot; a second one's request does not wait for the
first one's long requests to end.

Parallel sampling (n > 1, `SequenceGroup`): a request's first sequence queues like any other; its
siblings wait beside the queues until a running sequence of theirs has computed the prompt's full
blocks (that sequence's prefill stops at the fork point while siblings wait, so it cannot sample
and end before they fork), then join the running set on those blocks, shared, as slots and KV room
allow. If every sequence of the group ends before some siblings could fork, those queue as plain
requests (the prefix cache may still spare their prefill).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from specgate.engine.block_manager import BlockManager, blocks_for
from specgate.engine.sequence import Sequence, SequenceGroup, SequenceStatus

# Preemptions for fairness per step: each costs the victim's recomputation (its committed blocks
# stay in the prefix cache), so a burst of new tenants is balanced over a few steps, not in one.
MAX_FAIR_PREEMPTIONS = 4


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
        # Groups of n > 1 requests with siblings waiting to fork, in arrival order.
        self.forking: list[SequenceGroup] = []

    def add(self, seq: Sequence) -> None:
        group = seq.group
        if group is not None and seq.index > 0 and group.fork_point > 0:
            group.unforked.append(seq)  # forks once a sibling has computed the shared prompt
            if group not in self.forking:
                self.forking.append(group)
            return
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: queued, and siblings waiting to fork."""
        return len(self.waiting) + sum(len(g.unforked) for g in self.forking)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        group = seq.group
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif group is not None and seq in group.unforked:
            group.unforked.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        if group is not None and group in self.forking:
            self._settle(group)

    def _settle(self, group: SequenceGroup) -> None:
        """A group whose siblings can no longer fork (none left, or no sequence of it queued or
        running to fork from) leaves `forking`; siblings left over queue as plain requests."""
        if group.unforked and not group.active:
            self.waiting.extend(group.unforked)
            group.unforked.clear()
        if not group.unforked:
            self.forking.remove(group)

    def _fork(self) -> None:
        """Siblings of n > 1 requests start on a running sibling's shared prompt blocks, while batch
        slots and KV room (their prompt tails, above the watermark) allow."""
        bm = self.block_manager
        for group in list(self.forking):
            donor = group.donor()
            if donor is None:
                continue
            shared = group.fork_point // bm.block_size
            while group.unforked and len(self.running) < self.max_num_seqs:
                seq = group.unforked[0]
                tail = blocks_for(seq.num_tokens, bm.block_size) - shared
                if tail + self.watermark_blocks > bm.num_free_blocks:
                    break
                group.unforked.pop(0)
                bm.share(seq, donor, shared)
                # Prompt tokens this sequence did not compute, as a prefix-cache hit reports them.
                seq.stats.num_cached_tokens = seq.num_computed_tokens
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                self.hits.append(seq)  # a feature-level proposer reads the shared blocks' features
            if not group.unforked:
                self.forking.remove(group)

    @staticmethod
    def _fork_cap(seq: Sequence, n: int) -> int:
        """`n` tokens to compute, cut at the fork point while siblings wait to fork from `seq`: its
        prefill stops where theirs will start (so it cannot sample, and end, before they fork), and
        goes on with them in the next step."""
        group = seq.group
        if group is None or not group.unforked or seq.num_computed_tokens >= group.fork_point:
            return n
        return min(n, group.fork_point - seq.num_computed_tokens)

    def running_by_tenant(self) -> Counter[str]:
        return Counter(s.tenant for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)  # its committed blocks stay cached: readmission may hit them
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _fairest_waiting(self, held: Counter[str]) -> Sequence:
        """The first waiting sequence of the tenant holding the fewest running slots (`held`; ties:
        the tenant whose request has waited longest)."""
        best = self.waiting[0]
        best_load, seen = held[best.tenant], {best.tenant}
        for seq in self.waiting:
            if best_load == 0:
                break
            if seq.tenant in seen:
                continue
            seen.add(seq.tenant)
            if held[seq.tenant] < best_load:
                best, best_load = seq, held[seq.tenant]
        return best

    def _rebalance(self) -> None:
        """With every slot taken, preempt the newest sequences of the tenant holding the most slots
        while a tenant holding at least two fewer has a request waiting."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        held = self.running_by_tenant()
        waiting = Counter(s.tenant for s in self.waiting)
        planned: Counter[str] = Counter()  # slots freed here, promised to the tenants waiting
        free, preemptions = 0, 0
        while True:
            wanting = [t for t in waiting if waiting[t] > planned[t]]
            if not wanting:
                return
            poor = min(wanting, key=lambda t: held[t] + planned[t])
            if free:
                planned[poor] += 1
                free -= 1
                continue
            rich = max(held, key=lambda t: held[t] + planned[t], default=None)
            if rich is None or held[rich] + planned[rich] <= held[poor] + planned[poor] + 1:
                return
            if preemptions == MAX_FAIR_PREEMPTIONS:
                return
            self._preempt(next(s for s in reversed(self.running) if s.tenant == rich))
            held[rich] -= 1
            preemptions += 1
            waiting[rich] += 1
            free += 1

    def schedule(self) -> list[ScheduledSequence]:
        self._rebalance()
        self.hits = []
        if self.forking:
            self._fork()
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        # Decoding sequences first, then those part-way through their prompt.
        order = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._fork_cap(seq, min(seq.num_uncomputed_tokens, budget))
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
        bm = self.block_manager
        held = self.running_by_tenant() if self.waiting else Counter()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._fairest_waiting(held)
            hits = bm.match(seq)
            computed = len(hits) * bm.block_size if hits else seq.num_computed_tokens
            n = min(seq.num_tokens - computed, budget)
            if seq.group is not None and seq.group.unforked and computed < seq.group.fork_point:
                n = min(n, seq.group.fork_point - computed)
            reserve = self.watermark_blocks if self.running else 0
            # Hit blocks that no sequence holds leave the free pool too.
            need = blocks_for(computed + n, bm.block_size) - len(seq.block_table) - len(hits)
            if need + bm.num_reclaimed(hits) + reserve > bm.num_free_blocks:
                break  # the fairest request is blocked: nobody overtakes it
            self.waiting.remove(seq)
            bm.acquire(seq, hits)
            if hits:
                self.hits.append(seq)
                if not seq.stats.num_preemptions:
                    seq.stats.num_cached_tokens = seq.num_computed_tokens
            bm.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            held[seq.tenant] += 1
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n
        if self.forking:  # a prompt admitted on prefix-cache hits may have reached the fork point
            self._fork()
        return scheduled
