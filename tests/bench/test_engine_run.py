"""The loop around `Engine.step` the engine benchmarks share, on the tiny model: every request's
tokens and their times, at most N in flight, and the windows the benchmarks time."""

from __future__ import annotations

from collections.abc import Callable

from specgate.bench import engine_run
from specgate.engine.engine import Engine
from specgate.engine.vocab import SpecParams

PROMPTS = [[5, 17, 3, 44, 9], [7, 7, 7, 7], [1, 2, 3, 1, 2, 3, 1, 2], [11, 12]]


def test_answers_in_prompt_order_exactly_max_tokens_long(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    batch = engine_run.run(engine, PROMPTS, 6, concurrency=2)
    assert [len(a.tokens) for a in batch.answers] == [6] * 4 and batch.tokens == 24
    assert all(
        len(a.times) == 6 and a.times == sorted(a.times) and a.stats.num_output_tokens == 6
        for a in batch.answers
    )
    # At most two in flight: the third prompt's first token comes after one of the first two finished.
    assert batch.answers[2].times[0] >= min(batch.answers[0].times[-1], batch.answers[1].times[-1])
    assert batch.seconds > 0 and batch.steps == sorted(batch.steps)
    alone = engine_run.run(engine, [PROMPTS[0]], 6)
    assert alone.answers[0].tokens == batch.answers[0].tokens  # greedy, fp32: the batch changes nothing
    assert alone.answers[0].tpot_ms and alone.answers[0].decode_rate


def test_the_timed_windows(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    batch = engine_run.run(engine, PROMPTS, 8)
    after, seconds = batch.after_first_tokens()
    assert 0 < after < batch.tokens and 0 < seconds <= batch.seconds
    during, window = batch.all_decoding()
    assert 0 < during <= after and 0 < window <= seconds


def test_a_speculating_run_keeps_its_counters_and_its_answer(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    spec = SpecParams("ngram", controller="static", num_speculative_tokens=3, max_tree_nodes=0)
    prompt = [[1, 2, 3, 4] * 6]
    batch = engine_run.run(engine, prompt, 24, spec, cache_scope=None, prefix_salt=None)
    assert [s.method for s in batch.spec] == ["ngram"]
    plain = engine_run.run(engine, prompt, 24)
    assert plain.spec == [] and batch.answers[0].tokens == plain.answers[0].tokens  # lossless
