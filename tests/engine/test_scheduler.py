"""Continuous-batching scheduler over a real BlockManager, driven by a simulated engine loop."""

from __future__ import annotations

import random

import pytest

from specgate.engine.block_manager import BlockManager, blocks_for
from specgate.engine.outputs import RequestStats
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.scheduler import ScheduledSequence, Scheduler
from specgate.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, prompt_len: int) -> Sequence:
    return Sequence(
        request_id=request_id,
        token_ids=[1000 + i for i in range(prompt_len)],
        num_prompt_tokens=prompt_len,
        params=SamplingParams(),
        generator=None,
        stats=RequestStats(arrival_ts=0.0, num_prompt_tokens=prompt_len),
    )


def next_token(seq: Sequence) -> int:
    """A deterministic 'model': the token depends on the request and position only."""
    return hash((seq.request_id, seq.num_tokens)) % 50_000


class Sim:
    """Runs the scheduler like the engine does, with a fake KV cache to catch block table mistakes."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens)
        self.block_size = block_size
        self.budget = max_num_batched_tokens
        # block id -> slot -> (request id, position, token id)
        self.cache: dict[int, dict[int, tuple[str, int, int]]] = {}
        self.seqs: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.max_output: dict[str, int] = {}
        self.steps = 0

    def add(self, seq: Sequence, max_output: int = 4) -> Sequence:
        self.seqs.append(seq)
        self.max_output[seq.request_id] = max_output
        self.sched.add(seq)
        return seq

    def check_invariants(self) -> None:
        live = [s for s in self.seqs if not s.is_finished]
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned)), "two sequences share a block"
        assert self.bm.num_used_blocks == len(owned), "blocks leaked or double-freed"
        assert len(self.sched.running) <= self.sched.max_num_seqs
        for s in self.sched.running:
            assert s.status is SequenceStatus.RUNNING
            assert len(s.block_table) >= blocks_for(s.num_computed_tokens, self.block_size)
        for s in self.sched.waiting:
            assert s.status is SequenceStatus.WAITING

    def step(self) -> list[tuple[Sequence, int, bool]]:
        """One engine step; returns (sequence, num_tokens, samples) per scheduled sequence."""
        batch: list[ScheduledSequence] = self.sched.schedule()
        result = [(s.seq, s.num_tokens, s.samples) for s in batch]
        self.steps += 1
        assert sum(s.num_tokens for s in batch) <= self.budget
        assert len({id(s.seq) for s in batch}) == len(batch), "a sequence is scheduled twice"
        sampling = []
        for s in batch:
            seq = s.seq
            assert s.num_tokens >= 1
            assert seq.status is SequenceStatus.RUNNING
            start = seq.num_computed_tokens
            end = start + s.num_tokens
            assert end <= seq.num_tokens
            assert len(seq.block_table) >= blocks_for(end, self.block_size), "scheduled without KV blocks"
            for pos in range(start, end):  # "write" the keys/values of these positions
                block = seq.block_table[pos // self.block_size]
                self.cache.setdefault(block, {})[pos % self.block_size] = (
                    seq.request_id,
                    pos,
                    seq.token_ids[pos],
                )
            if s.samples:
                sampling.append(seq)
        for s in batch:
            s.seq.num_computed_tokens += s.num_tokens
        for seq in sampling:
            assert seq.num_computed_tokens == seq.num_tokens
            for pos in range(seq.num_tokens):  # attention reads the whole context from the cache
                block = seq.block_table[pos // self.block_size]
                got = self.cache.get(block, {}).get(pos % self.block_size)
                assert got == (seq.request_id, pos, seq.token_ids[pos]), f"{seq.request_id}: KV of {pos} lost"
            seq.token_ids.append(next_token(seq))
            if seq.num_output_tokens >= self.max_output[seq.request_id]:
                self.sched.remove(seq)
                self.finished.append(seq)
        self.check_invariants()
        return result

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_unfinished():
            assert self.steps < max_steps, "no progress"
            self.step()


def expected_tokens(request_id: str, prompt_len: int, n_out: int) -> list[int]:
    seq = make_seq(request_id, prompt_len)
    for _ in range(n_out):
        seq.token_ids.append(next_token(seq))
    return seq.token_ids


# ---- budget and chunked prefill -------------------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    seq = sim.add(make_seq("long", 50), max_output=3)
    chunks = []
    samples = []
    while seq.num_output_tokens == 0:
        batch = sim.step()
        assert [s for s, _, _ in batch] == [seq]
        chunks.append(batch[0][1])
        samples.append(batch[0][2])
    assert chunks == [16, 16, 16, 2]
    assert samples == [False, False, False, True]
    assert len(seq.block_table) == blocks_for(50, 4)
    sim.run()
    assert seq.token_ids == expected_tokens("long", 50, 3)


def test_token_budget_is_never_exceeded_with_many_requests() -> None:
    rng = random.Random(0)
    sim = Sim(num_blocks=400, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    lengths = [rng.randint(1, 70) for _ in range(20)]
    outs = [rng.randint(1, 10) for _ in range(20)]
    for i in range(10):
        sim.add(make_seq(f"r{i}", lengths[i]), outs[i])
    full_steps = 0
    while sim.sched.has_unfinished():
        if sim.steps == 5:
            for i in range(10, 20):
                sim.add(make_seq(f"r{i}", lengths[i]), outs[i])
        batch = sim.step()
        full_steps += sum(n for _, n, _ in batch) == 24
        assert sim.steps < 1000
    assert full_steps > 5  # the budget was actually binding
    for i, s in enumerate(sim.seqs):
        assert s.token_ids == expected_tokens(f"r{i}", lengths[i], outs[i])
    assert sim.bm.num_used_blocks == 0


def test_decoding_sequences_are_scheduled_before_a_prefilling_one() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=10)
    a = sim.add(make_seq("a", 3), max_output=20)
    b = sim.add(make_seq("b", 4), max_output=20)
    sim.step()  # both prefilled, both sampled
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    long = sim.add(make_seq("long", 40), max_output=2)
    for i in range(5):
        batch = sim.step()
        # a and b decode first; the long prompt gets what the decodes left, and samples on its last chunk.
        assert batch == [(a, 1, True), (b, 1, True), (long, 8, i == 4)]
    assert long.num_output_tokens == 1
    batch = sim.step()
    assert batch == [(a, 1, True), (b, 1, True), (long, 1, True)]


def test_decode_first_even_when_the_prefilling_sequence_was_admitted_earlier() -> None:
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    prefilling = make_seq("p", 20)
    prefilling.num_computed_tokens = 8
    decoding = make_seq("d", 6)
    decoding.num_computed_tokens = 5
    for s in (prefilling, decoding):
        bm.allocate(s, s.num_computed_tokens)
        s.status = SequenceStatus.RUNNING
        sched.running.append(s)
    batch = sched.schedule()
    assert [(s.seq, s.num_tokens) for s in batch] == [(decoding, 1), (prefilling, 7)]
    assert batch[0].samples and not batch[1].samples


# ---- admission ------------------------------------------------------------------------------


def test_max_num_seqs_caps_running_and_admission_is_fifo() -> None:
    sim = Sim(num_blocks=128, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [sim.add(make_seq(f"r{i}", 3), max_output=2 + i) for i in range(5)]
    admitted: list[str] = []
    while sim.sched.has_unfinished():
        sim.step()
        assert len(sim.sched.running) <= 2
        for s in sim.sched.running:
            if s.request_id not in admitted:
                admitted.append(s.request_id)
    assert admitted == [f"r{i}" for i in range(5)]
    assert [s.request_id for s in sim.finished] == [f"r{i}" for i in range(5)]
    assert all(s.stats.num_preemptions == 0 for s in seqs)


def test_first_step_admits_as_many_as_fit() -> None:
    sim = Sim(num_blocks=128, block_size=4, max_num_seqs=3, max_num_batched_tokens=100)
    for i in range(5):
        sim.add(make_seq(f"r{i}", 5))
    batch = sim.step()
    assert [s.request_id for s, _, _ in batch] == ["r0", "r1", "r2"]
    assert [s.request_id for s in sim.sched.waiting] == ["r3", "r4"]


def test_blocked_head_of_queue_is_not_overtaken() -> None:
    sim = Sim(num_blocks=10, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    first = sim.add(make_seq("first", 24), max_output=2)  # 6 blocks
    big = sim.add(make_seq("big", 16))  # 4 blocks + watermark: does not fit next to `first`
    small = sim.add(make_seq("small", 1))  # would fit, but must wait its turn
    batch = sim.step()
    assert [s for s, _, _ in batch] == [first]
    assert list(sim.sched.waiting) == [big, small]
    sim.run()
    assert [s.request_id for s in sim.finished][:1] == ["first"]
    assert big.num_output_tokens == 4 and small.num_output_tokens == 4


def test_watermark_is_kept_free_when_admitting_next_to_running_sequences() -> None:
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    assert sim.sched.watermark_blocks == 1
    a = sim.add(make_seq("a", 8))  # 2 blocks
    b = sim.add(make_seq("b", 8))  # 2 more would leave no block free: refused
    sim.step()
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    # Alone, a request may use the whole pool.
    sim2 = Sim(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    c = sim2.add(make_seq("c", 16))
    sim2.step()
    assert c.status is SequenceStatus.RUNNING and sim2.bm.num_free_blocks == 0


# ---- preemption -----------------------------------------------------------------------------


def test_most_recently_admitted_sequence_is_preempted_when_blocks_run_out() -> None:
    sim = Sim(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
    # The pool holds 8 tokens: each request alone fits, all together do not.
    a = sim.add(make_seq("a", 3), max_output=5)  # 2 blocks
    b = sim.add(make_seq("b", 2), max_output=6)  # 1 block (+1 watermark)
    c = sim.add(make_seq("c", 1), max_output=7)  # over max_num_seqs: waits
    sim.step()
    assert sim.sched.running == [a, b] and list(sim.sched.waiting) == [c]
    sim.step()  # a computes token 4 (2 blocks), b token 3 (2 blocks): pool full
    assert sim.bm.num_free_blocks == 0
    a_table = list(a.block_table)
    b_output = b.output_token_ids
    batch = sim.step()  # a computes token 5 and needs a third block: b must go
    assert batch == [(a, 1, True)]
    assert sim.sched.running == [a]
    assert list(sim.sched.waiting) == [b, c]  # at the front, ahead of c
    assert b.status is SequenceStatus.WAITING
    assert b.block_table == []
    assert b.num_computed_tokens == 0
    assert b.stats.num_preemptions == 1 and a.stats.num_preemptions == 0
    assert b.output_token_ids == b_output  # its tokens are kept, to be recomputed
    assert a.block_table[:2] == a_table and len(a.block_table) == 3
    sim.run()
    assert a.token_ids == expected_tokens("a", 3, 5)
    assert b.token_ids == expected_tokens("b", 2, 6)
    assert c.token_ids == expected_tokens("c", 1, 7)
    assert sim.bm.num_used_blocks == 0


def test_sequence_preempts_itself_when_it_is_the_most_recent() -> None:
    sim = Sim(num_blocks=5, block_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    a = sim.add(make_seq("a", 3), max_output=7)
    b = sim.add(make_seq("b", 3), max_output=7)
    sim.step()
    sim.step()
    assert sim.bm.num_free_blocks == 1
    batch = sim.step()  # both need a third block; a takes the last one, b is preempted
    assert batch == [(a, 1, True)]
    assert list(sim.sched.waiting) == [b] and b.num_computed_tokens == 0 and b.block_table == []
    assert b.stats.num_preemptions == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nothing_is_lost_under_memory_pressure(seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim(num_blocks=12, block_size=2, max_num_seqs=5, max_num_batched_tokens=7)
    spec = [(f"r{i}", rng.randint(1, 8), rng.randint(3, 9)) for i in range(12)]
    for rid, prompt_len, n_out in spec[:6]:
        sim.add(make_seq(rid, prompt_len), n_out)
    while sim.sched.has_unfinished():
        if sim.steps == 4:
            for rid, prompt_len, n_out in spec[6:]:
                sim.add(make_seq(rid, prompt_len), n_out)
        sim.step()
        assert sim.steps < 2000, "no progress"
    assert sum(s.stats.num_preemptions for s in sim.seqs) > 0  # the pool really was too small
    assert len(sim.finished) == len(spec)
    for (rid, prompt_len, n_out), seq in zip(spec, sim.seqs, strict=True):
        assert seq.token_ids == expected_tokens(rid, prompt_len, n_out)
        assert seq.status is SequenceStatus.FINISHED
    assert sim.bm.num_used_blocks == 0
    assert not sim.sched.running and not sim.sched.waiting


# ---- remove ---------------------------------------------------------------------------------


def test_remove_running_sequence_frees_its_blocks() -> None:
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = sim.add(make_seq("a", 10))
    b = sim.add(make_seq("b", 6))
    sim.step()
    b_table = list(b.block_table)
    assert sim.bm.num_used_blocks == len(a.block_table) + len(b.block_table)
    sim.sched.remove(a)
    assert a.status is SequenceStatus.FINISHED and a.block_table == []
    assert sim.sched.running == [b] and b.block_table == b_table
    assert sim.bm.num_used_blocks == len(b_table)
    assert [s for s, _, _ in sim.step()] == [b]


def test_remove_waiting_sequence_frees_its_blocks_and_leaves_the_queue() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = make_seq("a", 4), make_seq("b", 4), make_seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    bm.allocate(b, 8)  # e.g. left over; remove must release it anyway
    sched.remove(b)
    assert b.status is SequenceStatus.FINISHED and b.block_table == []
    assert list(sched.waiting) == [a, c]
    assert bm.num_used_blocks == 0
    assert [s.seq for s in sched.schedule()] == [a, c]


def test_remove_preempted_sequence() -> None:
    sim = Sim(num_blocks=4, block_size=2, max_num_seqs=2, max_num_batched_tokens=16)
    a = sim.add(make_seq("a", 3), max_output=5)
    b = sim.add(make_seq("b", 2), max_output=6)
    for _ in range(3):
        sim.step()
    assert b.status is SequenceStatus.WAITING and b.stats.num_preemptions == 1
    sim.sched.remove(b)
    assert not sim.sched.waiting and sim.sched.running == [a]
    assert sim.bm.num_used_blocks == len(a.block_table)


def test_has_unfinished() -> None:
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    assert not sched.has_unfinished()
    seq = make_seq("a", 3)
    sched.add(seq)
    assert sched.has_unfinished()
    sched.schedule()
    assert sched.has_unfinished()
    sched.remove(seq)
    assert not sched.has_unfinished()
    assert sched.schedule() == []


# ---- fairness between tenants ----------------------------------------------------------------


def tenant_seq(request_id: str, tenant: str, prompt_len: int = 3) -> Sequence:
    seq = make_seq(request_id, prompt_len)
    seq.tenant = tenant
    return seq


def test_a_tenant_alone_gets_every_slot_in_arrival_order() -> None:
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [sim.add(tenant_seq(f"r{i}", "a"), max_output=3) for i in range(6)]
    sim.step()
    assert [s.request_id for s in sim.sched.running] == ["r0", "r1", "r2", "r3"]
    sim.run()
    assert all(s.stats.num_preemptions == 0 for s in seqs)  # nobody to make room for


def test_a_second_tenant_is_admitted_before_the_first_ones_backlog() -> None:
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(10):
        sim.add(tenant_seq(f"hog{i}", "hog"), max_output=50)
    sim.step()
    victim = sim.add(tenant_seq("victim", "victim"), max_output=2)
    sim.step()
    # Every slot was the hog's: its newest sequence made room, the victim runs at once.
    assert victim in sim.sched.running
    held = sim.sched.running_by_tenant()
    assert held == {"hog": 3, "victim": 1}
    preempted = [s for s in sim.seqs if s.stats.num_preemptions]
    assert [s.request_id for s in preempted] == ["hog3"]
    sim.run()
    # Preempted work is recomputed, never lost or changed.
    for s in sim.seqs:
        n = sim.max_output[s.request_id]
        assert s.token_ids == expected_tokens(s.request_id, 3, n)[: 3 + n]


def test_slots_even_out_between_tenants_a_few_preemptions_a_step() -> None:
    sim = Sim(num_blocks=512, block_size=4, max_num_seqs=12, max_num_batched_tokens=128)
    for i in range(12):
        sim.add(tenant_seq(f"a{i}", "a"), max_output=200)
    sim.step()
    for i in range(12):
        sim.add(tenant_seq(f"b{i}", "b"), max_output=200)
    counts = []
    for _ in range(3):
        before = sum(s.stats.num_preemptions for s in sim.seqs)
        sim.step()
        assert sum(s.stats.num_preemptions for s in sim.seqs) - before <= 4  # MAX_FAIR_PREEMPTIONS
        counts.append(dict(sim.sched.running_by_tenant()))
    assert counts[-1] == {"a": 6, "b": 6}
    sim.step()
    assert dict(sim.sched.running_by_tenant()) == {"a": 6, "b": 6}  # balanced: no more preemption


def test_no_preemption_while_the_imbalance_is_one_slot() -> None:
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(2):
        sim.add(tenant_seq(f"a{i}", "a"), max_output=50)
    sim.add(tenant_seq("b0", "b"), max_output=50)
    sim.step()
    sim.add(tenant_seq("b1", "b"), max_output=50)  # b holds 1, a holds 2: fair enough
    sim.step()
    assert all(s.stats.num_preemptions == 0 for s in sim.seqs)
    assert dict(sim.sched.running_by_tenant()) == {"a": 2, "b": 1}


def test_the_waiting_tenant_with_the_fewest_slots_goes_first() -> None:
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(4):
        sim.add(tenant_seq(f"a{i}", "a"), max_output=50)
    sim.add(tenant_seq("b0", "b"), max_output=50)
    sim.step()
    # a0 (nobody holds anything: the longest waiting first), then b0 (b holds fewer), then a1 (a
    # tie: the longest waiting), though b0 arrived after all of a's.
    assert [s.request_id for s in sim.sched.running] == ["a0", "b0", "a1"]
