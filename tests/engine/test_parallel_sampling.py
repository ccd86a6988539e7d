"""Parallel sampling (SamplingParams.n > 1): one prompt prefilled once, n sequences sampled from it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specgate.engine.engine import Engine
from specgate.engine.errors import DuplicateRequestError, RequestError
from specgate.engine.outputs import RequestOutput, RequestStats, SpecStats
from specgate.engine.sampling_params import MAX_N, SamplingParams
from specgate.engine.vocab import SpecParams, SpecStep
from tests.engine.spec_decode.test_speculative_engine import FixedCosts, repetitive_prompts, spec_engine
from tests.engine.test_engine import GREEDY, prompts, run_to_completion, tokens


def by_index(outs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    seqs: dict[int, list[RequestOutput]] = {}
    for o in outs:
        seqs.setdefault(o.index, []).append(o)
    return seqs


def sample_n(engine: Engine, rid: str, prompt: list[int], **params: Any) -> dict[int, list[RequestOutput]]:
    engine.add_request(rid, prompt, SamplingParams(**params))
    return by_index(run_to_completion(engine)[rid])


def count_prompt_positions(engine: Engine, prompt_len: int) -> list[int]:
    """Counts (in the returned list's one cell) the prompt positions every forward pass computes."""
    counted = [0]
    execute = engine.runner.execute_with_hidden

    def counting(items: Any, hidden: bool) -> Any:
        for it in items:
            counted[0] += max(0, min(prompt_len, it.start + len(it.token_ids)) - it.start)
        return execute(items, hidden)

    engine.runner.execute_with_hidden = counting  # type: ignore[method-assign]
    return counted


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_prompt_is_computed_once_and_its_blocks_are_shared(
    make_engine: Callable[..., Engine], prefix_caching: bool
) -> None:
    engine = make_engine(prefix_caching=prefix_caching)  # blocks of 4 tokens
    prompt = prompts([30])[0]
    counted = count_prompt_positions(engine, len(prompt))
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, n=3, **GREEDY))  # type: ignore[arg-type]
    outs: list[RequestOutput] = list(engine.step())  # the first sequence prefills up to the fork point
    first, *siblings = engine.scheduler.running
    assert not siblings and first.num_computed_tokens == 28 and not outs
    outs += engine.step()  # the siblings fork: every sequence computes the prompt's tail and samples
    seqs = sorted(engine.scheduler.running, key=lambda s: s.index)
    assert [s.index for s in seqs] == [0, 1, 2]
    shared = seqs[0].block_table[:7]  # the prompt's 7 full blocks
    bm = engine.block_manager
    for s in seqs[1:]:
        assert s.block_table[:7] == shared and s.block_table[7] != seqs[0].block_table[7]
    assert all(bm.ref_count(b) == 3 for b in shared)
    assert {o.index for o in outs} == {0, 1, 2}  # each sampled its first token in the same step
    outs += run_to_completion(engine)["r"]
    # 30 prompt positions once, then the 2 tail positions (the last block's) per sibling.
    assert counted[0] == 30 + 2 * 2
    final = {o.index: o for o in outs if o.finished}
    assert final[0].stats.num_cached_tokens == 0
    assert final[1].stats.num_cached_tokens == final[2].stats.num_cached_tokens == 28
    assert bm.num_used_blocks == 0
    if not prefix_caching:
        assert bm.num_cached_blocks == 0  # the sharing needed no cache entry


def test_a_short_prompt_has_nothing_to_share_and_each_sequence_computes_it(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(prefix_caching=False)
    prompt = prompts([4])[0]  # one block, whose last token every sequence computes anyway
    counted = count_prompt_positions(engine, len(prompt))
    seqs = sample_n(engine, "r", prompt, max_tokens=3, n=2, **GREEDY)
    assert tokens(seqs[0]) == tokens(seqs[1]) and counted[0] == 8


def test_greedy_n_sequences_equal_the_n_1_answer(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    reference = make_engine(prefix_caching=False)
    for length in (3, 17, 30):
        prompt = prompts([length], seed=length)[0]
        alone = tokens(run_to_completion_of(reference, prompt, max_tokens=12, **GREEDY))
        seqs = sample_n(engine, f"g{length}", prompt, max_tokens=12, n=3, **GREEDY)
        assert [tokens(seqs[i]) for i in range(3)] == [alone] * 3
        assert all(seqs[i][-1].finish_reason == "length" for i in range(3))


def run_to_completion_of(engine: Engine, prompt: list[int], **params: Any) -> list[RequestOutput]:
    engine.add_request("one", prompt, SamplingParams(**params))
    return run_to_completion(engine)["one"]


def test_seeded_sequences_are_reproducible_distinct_and_seeded_seed_plus_index(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    prompt = prompts([21], seed=9)[0]
    params = dict(max_tokens=16, temperature=1.0, ignore_eos=True, seed=1234)
    first = sample_n(engine, "a", prompt, n=4, **params)
    again = sample_n(engine, "b", prompt, n=4, **params)
    answers = [tokens(first[i]) for i in range(4)]
    assert answers == [tokens(again[i]) for i in range(4)]
    assert len({tuple(a) for a in answers}) == 4  # each sequence draws from its own stream
    # Sequence i samples as a lone request seeded seed + i would (vLLM's per-sequence seeds).
    for i in (0, 2):
        alone = run_to_completion_of(engine, prompt, **{**params, "seed": 1234 + i})
        assert tokens(alone) == answers[i]


def test_unseeded_sequences_differ(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    seqs = sample_n(engine, "u", prompts([10])[0], n=3, max_tokens=16, temperature=1.0, ignore_eos=True)
    assert len({tuple(tokens(seqs[i])) for i in range(3)}) > 1


def test_each_sequence_finishes_on_its_own(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    stops = list(range(0, 95, 5))  # a fifth of the tokens the tiny model favours end a sequence
    seqs = sample_n(
        engine, "s", prompts([9])[0], n=6, max_tokens=12, temperature=1.0, seed=7, stop_token_ids=stops
    )
    lengths = set()
    for i in range(6):
        outs, last = seqs[i], seqs[i][-1]
        assert last.finished and sum(o.finished for o in outs) == 1
        ids = tokens(outs)
        lengths.add(len(ids))
        if last.finish_reason == "stop":
            assert ids[-1] in engine.eos_token_ids or (ids[-1] in stops and last.stop_reason == ids[-1])
        else:
            assert last.finish_reason == "length" and len(ids) == 12
    assert len(lengths) > 1  # they ended at different steps, each on its own
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("when", [0, 1, 3])
def test_abort_aborts_every_sequence_and_frees_every_block(
    make_engine: Callable[..., Engine], when: int
) -> None:
    engine = make_engine()
    engine.add_request("r", prompts([30])[0], SamplingParams(max_tokens=50, n=3, **GREEDY))  # type: ignore[arg-type]
    engine.add_request("other", prompts([8])[0], SamplingParams(max_tokens=50, **GREEDY))  # type: ignore[arg-type]
    for _ in range(when):  # 0: before the prefill, 1: before the fork, 3: while decoding
        engine.step()
    assert engine.abort("r")
    outs = [o for o in engine.step() if o.request_id == "r"]
    finals = {o.index: o.finish_reason for o in outs if o.finished}
    assert finals == {0: "abort", 1: "abort", 2: "abort"}
    assert engine.request_ids() == ["other"]
    assert not engine.abort("r")
    engine.abort("other")
    engine.step()
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_one_slot_runs_the_sequences_one_after_another(make_engine: Callable[..., Engine]) -> None:
    """With no slot to fork into, siblings queue as plain requests once the others are done."""
    engine = make_engine(max_num_seqs=1)
    reference = make_engine()
    prompt = prompts([14])[0]
    alone = tokens(run_to_completion_of(reference, prompt, max_tokens=8, **GREEDY))
    seqs = sample_n(engine, "r", prompt, max_tokens=8, n=3, **GREEDY)
    assert [tokens(seqs[i]) for i in range(3)] == [alone] * 3
    assert engine.block_manager.num_used_blocks == 0


def test_kv_pressure_preempts_sequences_without_changing_them(make_engine: Callable[..., Engine]) -> None:
    # The n = 3 request needs 4 shared + 3 x 4 blocks at most, the other one 12: not both at once.
    engine = make_engine(num_blocks=24, prefix_caching=False)
    reference = make_engine()
    prompt, other = prompts([18, 30], seed=4)
    alone = tokens(run_to_completion_of(reference, prompt, max_tokens=14, **GREEDY))
    other_alone = tokens(run_to_completion_of(reference, other, max_tokens=18, **GREEDY))
    engine.add_request("other", other, SamplingParams(max_tokens=18, **GREEDY))  # type: ignore[arg-type]
    engine.add_request("r", prompt, SamplingParams(max_tokens=14, n=3, **GREEDY))  # type: ignore[arg-type]
    outs = run_to_completion(engine)
    seqs = by_index(outs["r"])
    assert [tokens(seqs[i]) for i in range(3)] == [alone] * 3
    assert tokens(outs["other"]) == other_alone
    preempted = outs["other"][-1].stats.num_preemptions
    assert preempted + sum(seqs[i][-1].stats.num_preemptions for i in range(3)) > 0
    assert engine.block_manager.num_used_blocks == 0


def test_refusals(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(num_blocks=16)
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(ValueError, match="n must be in"):
        SamplingParams(n=0)
    # 4 sequences of up to 20 tokens: 4 shared blocks + 4 x 1 of their own fit 16 blocks; 8 x 1 fit
    # too, but 8 sequences of up to 28 tokens (4 + 8 x 3 blocks) never can.
    prompt = prompts([18])[0]
    engine.add_request("fits", prompt, SamplingParams(max_tokens=2, n=8, **GREEDY))  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="n=8 sequences of up to 28 tokens need 28 KV blocks"):
        engine.add_request("big", prompt, SamplingParams(max_tokens=10, n=8, **GREEDY))  # type: ignore[arg-type]
    with pytest.raises(DuplicateRequestError):
        engine.add_request("fits/1", prompt, SamplingParams(max_tokens=2, **GREEDY))  # type: ignore[arg-type]
    run_to_completion(engine)
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_speculation_per_sequence_stays_lossless(
    method: str, make_engine: Callable[..., Engine], tiny_draft_dir: Path, tiny_eagle_dir: Path
) -> None:
    engine = spec_engine(make_engine, method, tiny_draft_dir, tiny_eagle_dir)
    engine.cost_model = FixedCosts()
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=3)
    for i, prompt in enumerate(repetitive_prompts()):
        engine.add_request(f"plain{i}", prompt, SamplingParams(max_tokens=30, **GREEDY))  # type: ignore[arg-type]
        engine.add_request(f"spec{i}", prompt, SamplingParams(max_tokens=30, n=3, **GREEDY), spec)  # type: ignore[arg-type]
    outs = run_to_completion(engine)
    drafted = 0
    for i in range(len(repetitive_prompts())):
        plain = tokens(outs[f"plain{i}"])
        seqs = by_index(outs[f"spec{i}"])
        for j in range(3):
            assert tokens(seqs[j]) == plain, f"spec{i} sequence {j} diverged"
            stats = seqs[j][-1].stats.spec
            assert stats is not None and stats.method == method
            drafted += stats.num_draft_tokens
    assert drafted > 0
    assert engine.block_manager.num_used_blocks == 0


def test_merged_stats_sum_the_sequences_counters() -> None:
    a = RequestStats(arrival_ts=1.0, num_prompt_tokens=9, num_output_tokens=3, num_cached_tokens=4)
    a.first_token_ts, a.last_token_ts, a.finished_ts = 2.0, 3.0, 3.5
    b = RequestStats(arrival_ts=1.0, num_prompt_tokens=9, num_output_tokens=5, num_cached_tokens=8)
    b.first_token_ts, b.last_token_ts, b.finished_ts = 2.5, 4.0, 4.0
    a.spec, b.spec = SpecStats("ngram"), SpecStats("ngram")
    a.spec.record(SpecStep(3, 2, batch_tokens=4, step_ms=1.0, depth=3))
    b.spec.record(SpecStep(2, 1, batch_tokens=3, step_ms=1.0, depth=2))
    b.spec.record(SpecStep(4, 3, batch_tokens=5, step_ms=1.0, depth=4))
    m = RequestStats.merged([a, b])
    assert (m.num_output_tokens, m.num_cached_tokens, m.first_token_ts, m.finished_ts) == (8, 4, 2.0, 4.0)
    assert m.spec is not None and m.spec.num_drafts == 3 and m.spec.num_draft_tokens == 9
    assert m.spec.num_accepted_tokens == 6 and m.spec.num_accepted_tokens_per_pos == [3, 2, 1, 0]
    assert [step.drafted for step in m.spec.steps] == [3, 2, 4]
    b.finished_ts = None
    assert RequestStats.merged([a, b]).finished_ts is None
