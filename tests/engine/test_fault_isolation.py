"""One request's failure is its own: the rest of the batch decodes exactly as it would have alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specgate.engine import engine as engine_module
from specgate.engine.engine import Engine
from specgate.engine.errors import RequestError
from specgate.engine.sampling_params import SAMPLING_EPS, SamplingParams
from specgate.engine.vocab import SpecParams
from tests.engine.test_engine import prompts, run_to_completion, tokens

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=12)


def reference(make_engine: Callable[..., Engine], ps: list[list[int]]) -> list[list[int]]:
    """Each prompt decoded alone."""
    out = []
    for p in ps:
        e = make_engine()
        e.add_request("solo", p, SamplingParams(**GREEDY))
        out.append(tokens(run_to_completion(e)["solo"]))
    return out


def test_a_failing_draft_fails_only_its_request(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = prompts([9, 14, 6], seed=3)
    expected = reference(make_engine, ps)
    e = make_engine()
    ngram = e.proposer("ngram")
    real = ngram.propose

    def propose(requests):  # type: ignore[no-untyped-def]
        if any(r.request_id == "bad" for r in requests):
            raise RuntimeError("proposer bug")
        return real(requests)

    monkeypatch.setattr(ngram, "propose", propose)
    for i, p in enumerate(ps):
        e.add_request(f"ok{i}", p, SamplingParams(**GREEDY), SpecParams("ngram", "static", 0, 4, 4))
    e.add_request("bad", ps[0], SamplingParams(**GREEDY), SpecParams("ngram", "static", 0, 4, 4))
    outs = run_to_completion(e)
    assert outs["bad"][-1].finish_reason == "error" and "drafting with ngram" in (outs["bad"][-1].error or "")
    for i in range(len(ps)):
        assert tokens(outs[f"ok{i}"]) == expected[i] and outs[f"ok{i}"][-1].error is None
    assert e.block_manager.num_used_blocks == 0  # the failed request's blocks came back too


def test_failing_logits_processing_fails_only_its_request(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = prompts([7, 11], seed=5)
    expected = reference(make_engine, ps)
    real = engine_module.process_logits

    def process(logits, rows):  # type: ignore[no-untyped-def]
        if any(r.params.presence_penalty == 1.5 for r in rows):
            raise IndexError("a row the batched kernel cannot take")
        return real(logits, rows)

    monkeypatch.setattr(engine_module, "process_logits", process)
    e = make_engine()
    for i, p in enumerate(ps):
        e.add_request(f"ok{i}", p, SamplingParams(**GREEDY))
    e.add_request("bad", ps[1], SamplingParams(**{**GREEDY, "presence_penalty": 1.5}))
    outs = run_to_completion(e)
    assert outs["bad"][-1].finish_reason == "error"
    assert [tokens(outs[f"ok{i}"]) for i in range(len(ps))] == expected


def test_non_finite_logits_fail_only_their_request(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = prompts([8, 5], seed=7)
    expected = reference(make_engine, ps)
    e = make_engine()
    real = e.runner.execute_with_hidden

    def execute(items, want_hidden):  # type: ignore[no-untyped-def]
        logits, hidden = real(items, want_hidden)
        logits = logits.clone()
        row = 0
        for it in items:
            if it.num_logits and it.block_table is poisoned_table[0]:
                logits[row : row + it.num_logits] = float("nan")
            row += it.num_logits
        return logits, hidden

    monkeypatch.setattr(e.runner, "execute_with_hidden", execute)
    for i, p in enumerate(ps):
        e.add_request(f"ok{i}", p, SamplingParams(**GREEDY))
    e.add_request("nan", ps[0], SamplingParams(**{**GREEDY, "temperature": 0.8}))
    poisoned_table = [e._seqs["nan"].block_table]
    outs = run_to_completion(e)
    assert outs["nan"][-1].finish_reason == "error" and "finite" in (outs["nan"][-1].error or "")
    assert [tokens(outs[f"ok{i}"]) for i in range(len(ps))] == expected


def test_a_failing_stop_check_fails_only_its_request(make_engine: Callable[..., Engine]) -> None:
    ps = prompts([6, 9], seed=11)
    expected = reference(make_engine, ps)
    e = make_engine()
    for i, p in enumerate(ps):
        e.add_request(f"ok{i}", p, SamplingParams(**GREEDY))
    e.add_request("bad", ps[0], SamplingParams(**{**GREEDY, "stop": ["zz"]}))
    detok = e._seqs["bad"].detokenizer
    assert detok is not None

    def broken(*_: object) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer bug")

    detok.append = broken  # type: ignore[method-assign]
    outs = run_to_completion(e)
    assert outs["bad"][-1].finish_reason == "error"
    assert [tokens(outs[f"ok{i}"]) for i in range(len(ps))] == expected


def test_a_failed_forward_pass_fails_its_batch_and_the_queue_goes_on(
    make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = prompts([5, 7], seed=13)
    expected = reference(make_engine, ps[1:])
    e = make_engine(max_num_seqs=1)  # one at a time: the second waits while the first's pass fails
    real = e.runner.execute_with_hidden
    calls = {"n": 0}

    def execute(items, want_hidden):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory")
        return real(items, want_hidden)

    monkeypatch.setattr(e.runner, "execute_with_hidden", execute)
    e.add_request("first", ps[0], SamplingParams(**GREEDY))
    e.add_request("second", ps[1], SamplingParams(**GREEDY))
    outs = run_to_completion(e)
    assert outs["first"][-1].finish_reason == "error" and "forward pass" in (outs["first"][-1].error or "")
    assert tokens(outs["second"]) == expected[0]
    assert e.consecutive_forward_failures == 0 and e.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("temperature", [1e-50, 1e-30, SAMPLING_EPS / 2])
def test_a_temperature_that_underflows_is_greedy(
    make_engine: Callable[..., Engine], temperature: float
) -> None:
    [p] = prompts([9], seed=17)
    [expected] = reference(make_engine, [p])
    e = make_engine()
    e.add_request("cold", p, SamplingParams(**{**GREEDY, "temperature": temperature}))
    e.add_request(
        "cold-spec", p, SamplingParams(**{**GREEDY, "temperature": temperature}), SpecParams("ngram")
    )
    outs = run_to_completion(e)
    assert tokens(outs["cold"]) == tokens(outs["cold-spec"]) == expected


@pytest.mark.parametrize("seed", [0, -1, -(2**63), 2**63 - 1, 2**64 - 1])
def test_every_seed_in_the_generators_range_is_taken(make_engine: Callable[..., Engine], seed: int) -> None:
    [p] = prompts([4], seed=19)
    e = make_engine()
    e.add_request("s", p, SamplingParams(max_tokens=3, temperature=1.0, seed=seed))
    assert len(tokens(run_to_completion(e)["s"])) == 3


def test_values_outside_the_engines_range_are_refused_at_admission(
    make_engine: Callable[..., Engine],
) -> None:
    e = make_engine()
    for bad in (
        dict(seed=2**64),
        dict(seed=-(2**63) - 1),
        dict(temperature=float("nan")),
        dict(top_p=float("inf")),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="stop_token_ids"):
        e.add_request("x", [1, 2], SamplingParams(stop_token_ids=[e.runner.vocab_size]))
    assert not e.has_unfinished()


def test_top_p_always_keeps_a_token(make_engine: Callable[..., Engine]) -> None:
    [p] = prompts([6], seed=23)
    e = make_engine()
    e.add_request("tiny-p", p, SamplingParams(max_tokens=8, temperature=1.0, top_p=5e-324, seed=1))
    outs = run_to_completion(e)["tiny-p"]
    assert outs[-1].error is None and len(tokens(outs)) == 8
    assert torch.isfinite(torch.tensor(tokens(outs), dtype=torch.float32)).all()
