"""Automatic prefix caching in the engine: hits skip prefill and change no token (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.engine.vocab import SpecParams
from tests.engine.spec_decode.test_speculative_engine import FixedCosts, proposer_options
from tests.engine.test_engine import GREEDY, prompts, run_to_completion, tokens


def generate(
    engine: Engine, request_id: str, prompt: list[int], n: int, **kwargs: object
) -> tuple[list[int], int]:
    """Run one request alone; (its tokens, its cached prompt tokens)."""
    spec = kwargs.pop("spec", None)
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=n, **GREEDY), spec, **kwargs)  # type: ignore[arg-type]
    outs = run_to_completion(engine)[request_id]
    return tokens(outs), outs[-1].stats.num_cached_tokens


def test_a_repeated_prompt_hits_and_decodes_the_same_tokens(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    reference = make_engine(prefix_caching=False)
    prompt = prompts([30])[0]
    first, cached_first = generate(engine, "a", prompt, 12)
    second, cached_second = generate(engine, "b", prompt, 12)
    plain, cached_plain = generate(reference, "a", prompt, 12)
    assert first == second == plain
    assert cached_first == 0 and cached_plain == 0
    assert cached_second == 28  # 7 full blocks of 4; the 30th token is computed to sample from it
    bm = engine.block_manager
    assert (bm.queried_tokens, bm.hit_tokens) == (60, 28)
    assert bm.num_used_blocks == 0  # nothing held once both finished; the blocks stay cached
    assert reference.block_manager.num_cached_blocks == 0


def test_a_second_turn_reuses_the_generated_tokens_of_the_first(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    reference = make_engine(prefix_caching=False)
    system, question, follow_up = prompts([21, 6, 5], seed=2)
    answer, _ = generate(engine, "t1", system + question, 15)
    turn2 = system + question + answer + follow_up
    got, cached = generate(engine, "t2", turn2, 10)
    assert got == generate(reference, "t2", turn2, 10)[0]
    # Everything the first turn committed, its output included, in full blocks.
    assert cached == (len(system + question + answer) - 1) // 4 * 4


def test_a_shared_system_prompt_hits_across_different_questions(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_num_batched_tokens=24)  # chunked prefill of the first prompt
    reference = make_engine(prefix_caching=False, max_num_batched_tokens=24)
    system = prompts([40], seed=4)[0]
    questions = prompts([3, 9, 14], seed=5)
    generate(engine, "warm", system + questions[0], 4)
    for i, q in enumerate(questions):
        engine.add_request(f"q{i}", system + q, SamplingParams(max_tokens=8, **GREEDY))
        reference.add_request(f"q{i}", system + q, SamplingParams(max_tokens=8, **GREEDY))
    outs, ref = run_to_completion(engine), run_to_completion(reference)
    for i in range(3):
        assert tokens(outs[f"q{i}"]) == tokens(ref[f"q{i}"])
        assert outs[f"q{i}"][-1].stats.num_cached_tokens >= 40


def test_hits_stay_within_a_salt(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    prompt = prompts([25])[0]
    generate(engine, "a", prompt, 3, prefix_salt="tenant-a")
    assert generate(engine, "b", prompt, 3, prefix_salt="tenant-b")[1] == 0
    assert generate(engine, "c", prompt, 3, prefix_salt=None)[1] == 0
    assert generate(engine, "d", prompt, 3, prefix_salt="tenant-a")[1] == 24


def test_prefix_caching_off_never_hits(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(prefix_caching=False)
    prompt = prompts([25])[0]
    generate(engine, "a", prompt, 3)
    assert generate(engine, "b", prompt, 3)[1] == 0
    assert engine.runner.features is None


def test_eviction_under_memory_pressure_keeps_every_output_exact(make_engine: Callable[..., Engine]) -> None:
    # 24 blocks of 4 tokens: the later prompts evict the earlier ones' cached blocks, and preemption
    # (a running sequence losing its blocks) happens too.
    engine = make_engine(num_blocks=24, max_num_batched_tokens=32)
    reference = make_engine(prefix_caching=False, num_blocks=24, max_num_batched_tokens=32)
    base = prompts([18, 22, 30, 9], seed=6)
    ps = base + [p + q for p, q in zip(base, prompts([5, 7, 3, 6], seed=7), strict=True)]
    for e in (engine, reference):
        for i, p in enumerate(ps):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=20, **GREEDY))
    outs, ref = run_to_completion(engine), run_to_completion(reference)
    for i in range(len(ps)):
        assert tokens(outs[f"r{i}"]) == tokens(ref[f"r{i}"]), f"r{i} diverged"
    assert engine.block_manager.num_used_blocks == 0
    assert engine.block_manager.num_cached_blocks <= 24


def test_prefix_cache_bytes_bounds_the_unused_cached_blocks(make_engine: Callable[..., Engine]) -> None:
    probe = make_engine()
    per_block = probe.runner.kv_cache.nbytes // probe.runner.kv_cache.num_blocks
    engine = make_engine(prefix_cache_bytes=3 * per_block)
    generate(engine, "a", prompts([41])[0], 2)
    assert engine.block_manager.num_cached_blocks == 3


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
def test_speculation_after_a_hit_is_token_identical(
    method: str, make_engine: Callable[..., Engine], tiny_draft_dir: Path, tiny_eagle_dir: Path
) -> None:
    options = proposer_options(method, tiny_draft_dir, tiny_eagle_dir)
    engine = make_engine(proposer_options=options)
    engine.cost_model = FixedCosts()
    reference = make_engine(prefix_caching=False)
    p = prompts([13], seed=3)[0]
    prompt = p + p[:6] + p + p  # repetitive, so n-gram and suffix drafts get accepted
    spec = SpecParams(method=method, controller="static", num_speculative_tokens=3)
    generate(engine, "warm", prompt, 4)  # plain: publishes the prompt's blocks
    engine.add_request("spec", prompt, SamplingParams(max_tokens=30, **GREEDY), spec)
    outs = run_to_completion(engine)["spec"]
    stats = outs[-1].stats
    assert stats.num_cached_tokens > 0
    assert tokens(outs) == generate(reference, "plain", prompt, 30)[0]
    # Drafting ran after the hit; for EAGLE that needs the cached prefix's target features, which
    # come from the runner's feature pool (without them the head cannot draft at all).
    assert stats.spec is not None and stats.spec.num_draft_tokens > 0
    assert engine.block_manager.num_used_blocks == 0


def test_an_aborted_request_leaves_only_its_computed_blocks_cached(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(max_num_batched_tokens=12)  # the prompt is prefilled 12 tokens a step
    reference = make_engine(prefix_caching=False)
    prompt = prompts([40], seed=8)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    engine.step()  # 24 prompt tokens computed: 6 full blocks
    assert engine.abort("a")
    run_to_completion(engine)
    assert engine.block_manager.num_used_blocks == 0
    got, cached = generate(engine, "b", prompt, 8)
    assert cached == 24
    assert got == generate(reference, "b", prompt, 8)[0]
