"""Paged KV block accounting: allocation, rollback, freeing and capacity checks."""

from __future__ import annotations

import pytest

from specgate.engine.block_manager import BlockManager, block_hash, blocks_for
from specgate.engine.outputs import RequestStats
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.sequence import Sequence


def make_seq(num_tokens: int = 1, request_id: str = "r") -> Sequence:
    return Sequence(
        request_id=request_id,
        token_ids=list(range(num_tokens)),
        num_prompt_tokens=num_tokens,
        params=SamplingParams(),
        generator=None,
        stats=RequestStats(arrival_ts=0.0, num_prompt_tokens=num_tokens),
    )


def assert_consistent(bm: BlockManager, *seqs: Sequence) -> None:
    tables = [b for s in seqs for b in s.block_table]
    assert len(tables) == len(set(tables)), "a block is owned twice"
    assert all(0 <= b < bm.num_blocks for b in tables)
    assert bm.num_used_blocks == len(tables)
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    assert bm.usage == pytest.approx(bm.num_used_blocks / bm.num_blocks)


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7), (100, 16, 7)],
)
def test_blocks_for(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_for(num_tokens, block_size) == expected


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 4)])
def test_invalid_sizes_rejected(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


def test_new_pool_is_empty() -> None:
    bm = BlockManager(10, 4)
    assert bm.num_free_blocks == 10 and bm.num_used_blocks == 0 and bm.usage == 0.0


def test_allocation_grows_block_table_only_when_needed() -> None:
    bm = BlockManager(10, 4)
    seq = make_seq()
    expected_lengths = {1: 1, 2: 1, 4: 1, 5: 2, 8: 2, 9: 3, 12: 3, 13: 4}
    previous: list[int] = []
    for n in range(1, 14):
        assert bm.blocks_needed(seq, n) == max(0, blocks_for(n, 4) - len(seq.block_table))
        bm.allocate(seq, n)
        if n in expected_lengths:
            assert len(seq.block_table) == expected_lengths[n]
        assert seq.block_table[: len(previous)] == previous  # existing blocks never move
        previous = list(seq.block_table)
        assert_consistent(bm, seq)
    assert bm.num_used_blocks == 4


def test_allocating_fewer_tokens_than_held_is_a_no_op() -> None:
    bm = BlockManager(10, 4)
    seq = make_seq()
    bm.allocate(seq, 12)
    table = list(seq.block_table)
    bm.allocate(seq, 3)
    bm.allocate(seq, 0)
    assert seq.block_table == table and bm.num_used_blocks == 3


def test_two_sequences_get_disjoint_blocks() -> None:
    bm = BlockManager(8, 2)
    a, b = make_seq(request_id="a"), make_seq(request_id="b")
    for n in range(1, 9):
        bm.allocate(a, n)
        bm.allocate(b, n)
        assert_consistent(bm, a, b)
    assert bm.num_free_blocks == 0


@pytest.mark.parametrize(("keep", "expected_len"), [(13, 4), (12, 3), (9, 3), (8, 2), (5, 2), (1, 1), (0, 0)])
def test_truncate_frees_exactly_the_blocks_beyond_kept_tokens(keep: int, expected_len: int) -> None:
    bm = BlockManager(10, 4)
    other = make_seq(request_id="other")
    bm.allocate(other, 6)
    other_table = list(other.block_table)
    seq = make_seq()
    bm.allocate(seq, 14)  # 4 blocks
    table = list(seq.block_table)
    free_before = bm.num_free_blocks
    bm.truncate(seq, keep)
    assert seq.block_table == table[:expected_len]  # same ids, same order
    assert bm.num_free_blocks == free_before + (4 - expected_len)
    assert other.block_table == other_table
    assert_consistent(bm, seq, other)


def test_truncate_beyond_current_length_is_a_no_op() -> None:
    bm = BlockManager(10, 4)
    seq = make_seq()
    bm.allocate(seq, 5)
    table = list(seq.block_table)
    bm.truncate(seq, 100)
    assert seq.block_table == table and bm.num_used_blocks == 2


def test_rollback_then_regrow_reuses_the_freed_blocks() -> None:
    bm = BlockManager(6, 2)
    seq = make_seq()
    bm.allocate(seq, 10)
    table = list(seq.block_table)
    bm.truncate(seq, 4)
    bm.allocate(seq, 10)
    assert seq.block_table[:2] == table[:2]
    assert sorted(seq.block_table[2:]) == sorted(table[2:])
    assert_consistent(bm, seq)


def test_free_returns_the_pool_to_empty() -> None:
    bm = BlockManager(16, 4)
    seqs = [make_seq(request_id=str(i)) for i in range(4)]
    for i, s in enumerate(seqs):
        bm.allocate(s, 5 + 3 * i)
    assert_consistent(bm, *seqs)
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
        assert_consistent(bm, *seqs)
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0 and bm.usage == 0.0
    # Everything can be allocated again, to one sequence.
    big = make_seq(request_id="big")
    bm.allocate(big, 64)
    assert sorted(big.block_table) == list(range(16))


def test_free_of_an_empty_sequence_is_harmless() -> None:
    bm = BlockManager(4, 4)
    seq = make_seq()
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4


def test_allocate_beyond_capacity_raises_and_leaves_state_unchanged() -> None:
    bm = BlockManager(5, 4)
    a, b = make_seq(request_id="a"), make_seq(request_id="b")
    bm.allocate(a, 12)  # 3 blocks
    bm.allocate(b, 4)  # 1 block
    a_table, b_table = list(a.block_table), list(b.block_table)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 12)  # needs 2 more, 1 free
    assert a.block_table == a_table and b.block_table == b_table
    assert bm.num_free_blocks == 1
    bm.allocate(b, 8)  # the free block is still there
    assert bm.num_free_blocks == 0
    assert_consistent(bm, a, b)


def test_can_allocate_matches_allocate_and_respects_reserve() -> None:
    bm = BlockManager(6, 4)
    filler = make_seq(request_id="filler")
    bm.allocate(filler, 8)  # 4 free left
    seq = make_seq()
    bm.allocate(seq, 2)  # 1 block, 3 free left
    assert bm.blocks_needed(seq, 14) == 3
    assert bm.can_allocate(seq, 14)
    assert bm.can_allocate(seq, 14, reserve=0)
    assert not bm.can_allocate(seq, 14, reserve=1)
    assert bm.can_allocate(seq, 10, reserve=1)
    assert not bm.can_allocate(seq, 10, reserve=2)
    assert bm.can_allocate(seq, 4, reserve=3)  # nothing needed
    assert not bm.can_allocate(seq, 4, reserve=4)
    assert not bm.can_allocate(seq, 17)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 17)
    bm.allocate(seq, 14)
    assert bm.num_free_blocks == 0


def test_usage_tracks_used_blocks() -> None:
    bm = BlockManager(8, 2)
    seq = make_seq()
    for n, used in [(1, 1), (4, 2), (9, 5), (16, 8)]:
        bm.allocate(seq, n)
        assert bm.num_used_blocks == used
        assert bm.num_free_blocks == 8 - used
        assert bm.usage == pytest.approx(used / 8)
    bm.truncate(seq, 6)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (3, 5, pytest.approx(3 / 8))


# ---- prefix caching ----------------------------------------------------------------------------


def committed(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """`seq` holds blocks for its first `num_tokens` tokens, computed: what a prefill step leaves."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.publish(seq)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    hits = bm.match(seq)
    bm.acquire(seq, hits)
    return hits


def test_block_hash_chains_over_the_prefix_and_the_salt() -> None:
    a = block_hash(None, [1, 2, 3, 4], "")
    assert a == block_hash(None, [1, 2, 3, 4], "")
    assert a != block_hash(None, [1, 2, 3, 5], "")
    assert a != block_hash(None, [1, 2, 3, 4], "tenant-b")
    # The same block after different prefixes is a different block.
    assert block_hash(a, [5, 6, 7, 8], "") != block_hash(block_hash(None, [0, 2, 3, 4], ""), [5, 6, 7, 8], "")
    # Token boundaries count: (1, 23) is not (12, 3).
    assert block_hash(None, [1, 23], "") != block_hash(None, [12, 3], "")


def test_a_second_sequence_takes_the_cached_full_blocks_of_the_first() -> None:
    bm = BlockManager(16, 4, caching=True)
    a = make_seq(14, "a")
    committed(bm, a, 14)  # 3 full blocks published, the 4th partial
    assert bm.num_cached_blocks == 3
    b = make_seq(14, "b")  # the same tokens
    hits = admit(bm, b)
    assert hits == a.block_table[:3]
    assert b.block_table == a.block_table[:3] and b.num_computed_tokens == 12
    assert bm.num_used_blocks == 4  # shared blocks are counted once
    assert (bm.queried_tokens, bm.hit_tokens) == (14, 12)


def test_the_last_token_is_always_left_to_compute() -> None:
    bm = BlockManager(16, 4, caching=True)
    a = make_seq(12, "a")
    committed(bm, a, 12)  # 3 full blocks
    b = make_seq(12, "b")
    assert len(admit(bm, b)) == 2  # the third would leave nothing to sample from
    assert b.num_computed_tokens == 8


def test_hits_stop_at_the_first_difference_and_respect_the_salt() -> None:
    bm = BlockManager(32, 4, caching=True)
    a = make_seq(20, "a")
    committed(bm, a, 20)
    b = make_seq(20, "b")
    b.token_ids[9] = 90  # the third block differs
    assert admit(bm, b) == a.block_table[:2]
    other = make_seq(20, "other")
    other.prefix_salt = "tenant-b"
    assert admit(bm, other) == []
    private = make_seq(20, "private")
    private.prefix_salt = None
    assert admit(bm, private) == []
    bm.allocate(private, 20)
    private.num_computed_tokens = 20
    bm.publish(private)  # a request that shares nothing publishes nothing
    assert bm.num_cached_blocks == 5


def test_freed_cached_blocks_stay_until_an_allocation_needs_them_lru_first() -> None:
    bm = BlockManager(4, 2, caching=True)
    old, new = make_seq(3, "old"), make_seq(3, "new")
    old.token_ids, new.token_ids = [1, 2, 3], [4, 5, 6]
    committed(bm, old, 3)
    committed(bm, new, 3)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 2  # [1, 2] and [4, 5]
    filler = make_seq(6, "filler")
    filler.token_ids = [9] * 6
    bm.allocate(filler, 6)  # 3 blocks: the 2 empty ones, then the least recently freed cached one
    assert bm.num_cached_blocks == 1
    again_old, again_new = make_seq(3, "o2"), make_seq(3, "n2")
    again_old.token_ids, again_new.token_ids = [1, 2, 3], [4, 5, 6]
    assert admit(bm, again_old) == []  # evicted
    assert len(admit(bm, again_new)) == 1


def test_a_cached_block_held_by_a_sequence_is_never_evicted() -> None:
    bm = BlockManager(3, 2, caching=True)
    a = make_seq(3, "a")
    committed(bm, a, 3)
    b = make_seq(3, "b")
    admit(bm, b)
    bm.free(a)
    big = make_seq(4, "big")
    bm.allocate(big, 4)  # both blocks not held by b
    assert bm.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        bm.allocate(make_seq(1, "x"), 1)
    assert bm.num_cached_blocks == 1 and b.block_table[0] not in big.block_table


def test_rolled_back_and_uncommitted_blocks_are_never_published() -> None:
    bm = BlockManager(16, 4, caching=True)
    a = make_seq(6, "a")
    bm.allocate(a, 6)
    a.num_computed_tokens = 6
    a.token_ids += [60, 61, 62, 63, 64]  # drafts being verified: blocks allocated, not committed
    bm.allocate(a, 11)
    bm.publish(a)
    assert bm.num_cached_blocks == 1  # only the first block is full and committed
    bm.truncate(a, 7)  # one draft accepted, the rest rolled back
    del a.token_ids[8:]
    a.num_computed_tokens = 7
    bm.publish(a)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    assert bm.num_free_blocks == 16


def test_max_cached_blocks_bounds_what_unused_blocks_keep() -> None:
    bm = BlockManager(16, 2, caching=True, max_cached_blocks=2)
    a = make_seq(9, "a")
    committed(bm, a, 9)
    assert bm.num_cached_blocks == 4  # held blocks stay cached whatever the bound
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    b = make_seq(9, "b")
    # A table is released from its tail, so the tail is evicted first and the shared start stays.
    assert admit(bm, b) == table[:2]


def test_without_caching_nothing_is_matched_or_published() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(14, "a")
    committed(bm, a, 14)
    assert bm.num_cached_blocks == 0 and admit(bm, make_seq(14, "b")) == []
    bm.free(a)
    assert bm.num_free_blocks == 16


def test_share_gives_a_fork_the_donors_full_blocks_by_reference() -> None:
    bm = BlockManager(8, 4)
    donor, fork = make_seq(10, "d"), make_seq(10, "d/1")
    bm.allocate(donor, 10)  # 3 blocks
    with pytest.raises(ValueError, match="computed"):
        bm.share(fork, donor, 2)  # nothing computed yet
    donor.num_computed_tokens = 8
    bm.share(fork, donor, 2)
    assert fork.block_table == donor.block_table[:2] and fork.num_computed_tokens == 8
    assert [bm.ref_count(b) for b in donor.block_table] == [2, 2, 1]
    assert bm.num_used_blocks == 3 and (bm.queried_tokens, bm.hit_tokens) == (0, 0)
    bm.allocate(fork, 10)  # its own tail block
    assert bm.num_used_blocks == 4
    bm.free(donor)
    assert [bm.ref_count(b) for b in fork.block_table] == [1, 1, 1] and bm.num_used_blocks == 3
    bm.free(fork)
    assert bm.num_used_blocks == 0
