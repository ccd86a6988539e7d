"""Paged KV block accounting: allocation, rollback, freeing and capacity checks."""

from __future__ import annotations

import pytest

from specgate.engine.block_manager import BlockManager, blocks_for
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
        stats=RequestStats(arrival_time=0.0, num_prompt_tokens=num_tokens),
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
