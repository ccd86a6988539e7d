"""`specgate bench policy`: its trace schedule and its analysis, on fabricated traces, prompts and results."""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import Any

import pytest

from specgate.bench import policy as bp
from specgate.bench.client import RequestResult
from specgate.bench.workload import BenchRequest, TraceRequest

RATES = (0.5, 2.0, 8.0)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bp.add_arguments(p)
    return bp.settle(p.parse_args(argv))


def _trace(gaps: list[float], generated: list[int] | None = None) -> list[TraceRequest]:
    """A trace with these inter-arrival gaps (the first request at 0)."""
    offsets = list(itertools.accumulate([0.0, *gaps]))
    gen = generated or [40] * len(offsets)
    return [TraceRequest(t, 100 + i, gen[i % len(gen)]) for i, t in enumerate(offsets)]


# Bursty: clumps of near-simultaneous requests with long silences between them, as the code trace.
CODE = _trace([0.05, 0.05, 28.0, 0.1, 0.2, 0.1, 9.0, 0.3, 0.3, 0.1, 5.0])  # 12 requests
CONV = _trace([4.3, 0.2, 0.2, 1.2, 0.4, 1.4, 0.5, 0.1, 0.1, 0.3, 0.7] * 2 + [0.5])  # 24 requests


def _pools(n: int = 20) -> dict[str, list[BenchRequest]]:
    return {
        c: [BenchRequest(c, [{"role": "user", "content": f"{c} prompt {i}"}], 96) for i in range(n)]
        for c in {*bp.CODE_CLASSES, *bp.CONV_CLASSES}
    }


def test_periods_come_in_order_with_equal_counts_and_their_rates() -> None:
    slots = bp.timeline(CODE, CONV, RATES)
    assert [s.period for s in slots] == ["light"] * 12 + ["medium"] * 12 + ["overload"] * 12
    offsets = [s.offset for s in slots]
    assert offsets[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(offsets))
    for period, rate in zip(bp.PERIODS, RATES, strict=True):
        part = [s.offset for s in slots if s.period == period]
        assert (len(part) - 1) / (part[-1] - part[0]) == pytest.approx(rate, rel=1e-9)
    # A period starts one of its own mean gaps after the one before ends.
    for i in (12, 24):
        rate = RATES[i // 12]
        assert offsets[i] - offsets[i - 1] == pytest.approx(1 / rate)
    # Each period holds a third of each trace.
    for period in bp.PERIODS:
        assert sum(s.trace == "code" for s in slots if s.period == period) == 4


def test_bursts_are_kept_within_a_period() -> None:
    """One trace alone: inside each period its gaps keep their proportions to each other."""
    slots = bp.timeline(CODE, [], RATES)
    for k, period in enumerate(bp.PERIODS):
        got = [b.offset - a.offset for a, b in itertools.pairwise(s for s in slots if s.period == period)]
        native = [b.offset - a.offset for a, b in itertools.pairwise(CODE[4 * k : 4 * k + 4])]
        factor = got[0] / native[0]
        assert got == pytest.approx([g * factor for g in native])
        assert max(got) / min(got) > 10  # the bursts did not become even spacing


def test_code_trace_requests_get_code_like_classes_and_every_class_every_period() -> None:
    slots = bp.timeline(CODE, CONV, RATES)
    assert all(s.category in bp.CODE_CLASSES for s in slots if s.trace == "code")
    assert all(s.category in bp.CONV_CLASSES for s in slots if s.trace == "conv")
    every = {*bp.CODE_CLASSES, *bp.CONV_CLASSES}
    for period in bp.PERIODS:
        assert {s.category for s in slots if s.period == period} == every
    counts = bp.demand(12, 24)
    assert counts == {c: sum(s.category == c for s in slots) for c in every}
    assert counts["rag"] == 3 + 4 and counts["code"] == 3 and counts["qa"] == 4


def test_schedule_clips_max_tokens_and_is_deterministic_under_its_seed() -> None:
    code = _trace([1.0] * 11, generated=[3, 500, 40])
    slots = bp.timeline(code, CONV, RATES)
    items = bp.schedule(slots, _pools(), max_tokens=64, seed=0, multi_turn_share=0.25, sampled_share=0.3)
    want = {3: 16, 500: 64, 40: 40}
    assert [s.request.max_tokens for s in items] == [want[s.generated_tokens] for s in items]
    assert {s.request.max_tokens for s in items if s.trace == "code"} == {16, 40, 64}
    assert [s.request.category for s in items] == [s.category for s in slots]
    # Each class's prompts are taken in order, none twice.
    texts = [s.request.messages[0]["content"] for s in items]
    assert len(set(texts)) == len(texts)
    assert [t for t in texts if t.startswith("qa ")] == [f"qa prompt {i}" for i in range(4)]

    def key(xs: list[bp.Scheduled]) -> list[Any]:
        return [(s.offset, s.request.category, s.request.messages, s.temperature) for s in xs]

    again = bp.schedule(slots, _pools(), max_tokens=64, seed=0, multi_turn_share=0.25, sampled_share=0.3)
    other = bp.schedule(slots, _pools(), max_tokens=64, seed=1, multi_turn_share=0.25, sampled_share=0.3)
    assert key(items) == key(again) and key(items) != key(other)
    sampled = [s.temperature for s in items if s.temperature > 0]
    assert 0 < len(sampled) < len(items) and all(0.7 <= t <= 1.0 for t in sampled)
    second = [s for s in items if len(s.request.messages) == 3]
    assert second and all(s.request.messages[-1]["content"] == bp.FOLLOW_UP for s in second)
    assert all(not s.request.tools for s in second)


def test_schedule_refuses_to_run_out_of_prompts() -> None:
    slots = bp.timeline(CODE, CONV, RATES)
    with pytest.raises(ValueError, match="not enough"):
        bp.schedule(slots, _pools(2), 64, 0, 0.0, 0.0)


def test_workload_keeps_training_prompts_out_of_evaluation() -> None:
    args = parse(["--quick"])
    items = bp.workload_of(args)
    assert len(items["evaluation"]) == 18 and len(items["train"]) == 36

    def prompts(xs: list[bp.Scheduled]) -> set[str]:
        return {str(m["content"]) for s in xs for m in s.request.messages if m["role"] == "user"} - {
            bp.FOLLOW_UP
        }

    assert prompts(items["train"]).isdisjoint(prompts(items["evaluation"]))
    assert [s.period for s in items["evaluation"]] == ["light"] * 6 + ["medium"] * 6 + ["overload"] * 6


def test_arguments() -> None:
    args = parse(["--rates", "0.1,1,5", "--arms", "plain,ngram,suffix"])
    assert args.rates == (0.1, 1.0, 5.0) and args.max_in_flight == 16 and args.reps == 3
    for bad in (["--rates", "1,2"], ["--rates", "1,0,2"], ["--arms", "ngram,suffix"], ["--max-tokens", "8"]):
        with pytest.raises(SystemExit):
            parse(bad)


# --- the analysis on fabricated results -------------------------------------------------------------

PERIODS = [p for p in bp.PERIODS for _ in range(8)]
CLASSES = ["code", "summarization", "rag", "qa"] * 6
COPY = {"light": {"plain": 10.0, "ngram": 20.0, "suffix": 18.0}}
COPY |= {"medium": {"plain": 10.0, "ngram": 15.0, "suffix": 12.0}}
COPY |= {"overload": {"plain": 10.0, "ngram": 5.0, "suffix": 6.0}}
QA = {p: {"plain": 10.5, "ngram": 8.0, "suffix": 9.0} for p in bp.PERIODS}
QA["overload"] = {"plain": 10.5, "ngram": 4.0, "suffix": 5.0}


def _static(arm: str, i: int, rep: int) -> float:
    table = QA if CLASSES[i] == "qa" else COPY
    return table[PERIODS[i]][arm] * (1 + 0.02 * rep) * (1 + 0.01 * (i % 2))  # a little spread


def _result(arm: str, i: int, value: float, spec: dict[str, Any] | None = None) -> RequestResult:
    r = RequestResult(f"r{i}", CLASSES[i], arm, sent_at=0.0, ok=True, output_tokens=100)
    r.done_at = 100 / value
    r.spec = spec or {}
    return r


def _results(
    learned: Any, accepted: tuple[int, int] | None = (25, 10)
) -> dict[str, list[list[RequestResult]]]:
    """Two repetitions; `learned(i, rep)` is the learned arm's goodput; its copy-heavy requests
    speculate with (accepted tokens, steps)."""
    res: dict[str, list[list[RequestResult]]] = {}
    for arm in ("plain", "ngram", "suffix"):
        res[arm] = [[_result(arm, i, _static(arm, i, k)) for i in range(24)] for k in range(2)]
    res["rules"] = res["plain"]
    res["learned_greedy"] = res["ngram"]
    spec = {} if accepted is None else {"num_accepted_tokens": accepted[0], "num_drafts": accepted[1]}
    res["learned"] = [
        [_result("learned", i, learned(i, k), spec if CLASSES[i] != "qa" else None) for i in range(24)]
        for k in range(2)
    ]
    return res


def _oracle(i: int, rep: int) -> float:
    return max(_static(a, i, rep) for a in ("plain", "ngram", "suffix"))


def test_the_oracle_picks_per_class_and_period_and_the_paired_differences() -> None:
    rep = bp.analyse(_results(lambda i, k: 1.25 * _oracle(i, k)), PERIODS, ["plain", "ngram", "suffix"])
    pick = rep["oracle_pick"]
    assert pick["code@light"] == "ngram" and pick["rag@medium"] == "ngram"
    assert pick["code@overload"] == "plain" and pick["summarization@overload"] == "plain"
    assert all(pick[f"qa@{p}"] == "plain" for p in bp.PERIODS)
    assert rep["best_static"] == "ngram" and rep["best_speculative_light"] == "ngram"
    table = rep["table"]
    assert set(table["learned"]) == {"all", "light", "medium", "overload"}
    light_ngram = statistics.fmean(_static("ngram", i, 0) for i in range(8))
    assert table["ngram"]["light"]["low"] < light_ngram < table["ngram"]["light"]["high"]

    d = rep["learned_minus_oracle"]
    assert d["mean"] == pytest.approx(0.25) and d["n"] == 48
    pairs = [(1.25 * _oracle(i, k), _static("ngram", i, k)) for k in range(2) for i in range(24)]
    want = statistics.fmean(a - b for a, b in pairs) / statistics.fmean(b for _, b in pairs)
    assert rep["learned_minus_best_static"]["mean"] == pytest.approx(want)
    over = rep["overload_learned_minus_plain"]
    assert over["mean"] == pytest.approx(0.25) and over["n"] == 16
    assert rep["light_learned_minus_best_speculative"]["n"] == 16
    acc = rep["accepted_length"]
    assert acc["learned"]["code"] == {"median": 3.5, "speculated": 12, "requests": 12}
    assert acc["learned"]["qa"]["median"] is None and acc["plain"]["code"]["speculated"] == 0
    assert rep["routes"]["learned"]  # per class@period


def _lines(rep: dict[str, Any]) -> list[bool]:
    return [ok for _, ok in bp.goals(rep)]


def test_every_goal_passes_on_a_policy_that_beats_the_oracle() -> None:
    rep = bp.analyse(_results(lambda i, k: 1.25 * _oracle(i, k)), PERIODS, ["plain", "ngram", "suffix"])
    assert _lines(rep) == [True] * 5
    text = bp.markdown(rep, ["plain", "ngram", "suffix", "rules", "learned", "learned_greedy"])
    assert text.count("PASS: ") == 5 and "MISS" not in text
    assert "| code | - (0/12) |" in text and "3.50 (12/12)" in text


def test_each_goal_misses_on_its_own() -> None:
    def goals_with(learned: Any, accepted: tuple[int, int] | None = (25, 10)) -> list[bool]:
        return _lines(bp.analyse(_results(learned, accepted), PERIODS, ["plain", "ngram", "suffix"]))

    def by_period(light: float, medium: float, overload: float) -> Any:
        share = {"light": light, "medium": medium, "overload": overload}
        return lambda i, k: share[PERIODS[i]] * _oracle(i, k)

    # The oracle is plain in the overload period: 0.8x plain there misses that goal alone.
    assert goals_with(by_period(1.25, 1.25, 0.8)) == [True, True, False, True, True]
    # 5% below the oracle in light and medium: still >10% above n-gram overall, but >3% below the oracle.
    assert goals_with(by_period(0.95, 0.95, 1.0)) == [True, False, True, True, True]
    # 15% below the oracle (n-gram, for copy-heavy prompts) in the light period only.
    assert goals_with(by_period(0.85, 1.1, 1.1)) == [True, True, True, False, True]
    # Plain everywhere: below the best static arm (n-gram) and the oracle, speculation missed in the
    # light period; the overload period is a tie, which its goal accepts.
    assert goals_with(lambda i, k: _static("plain", i, k)) == [False, False, True, False, True]
    # Oracle-beating goodput but short accepted runs, or none: only the accepted-length goal misses.
    assert goals_with(by_period(1.25, 1.25, 1.25), (15, 10)) == [True, True, True, True, False]
    assert goals_with(by_period(1.25, 1.25, 1.25), None) == [True, True, True, True, False]


def test_goal_thresholds_on_constructed_numbers() -> None:
    def ci(mean: float, low: float, high: float) -> dict[str, float]:
        return {"mean": mean, "low": low, "high": high, "n": 10}

    passing = {
        "best_static": "ngram",
        "best_speculative_light": "ngram",
        "learned_minus_best_static": ci(0.10, 0.01, 0.2),
        "learned_minus_oracle": ci(-0.03, -0.1, 0.04),
        "overload_learned_minus_plain": ci(-0.05, -0.1, 0.0),
        "light_learned_minus_best_speculative": ci(-0.05, -0.1, 0.0),
        "accepted_length": {"learned": {c: {"median": 3.0} for c in bp.COPY_HEAVY}},
    }
    assert _lines(passing) == [True] * 5
    misses: list[tuple[str, Any]] = [
        ("learned_minus_best_static", ci(0.099, 0.01, 0.2)),
        ("learned_minus_best_static", ci(0.2, 0.0, 0.4)),
        ("learned_minus_oracle", ci(-0.031, -0.1, 0.04)),
        ("overload_learned_minus_plain", ci(-0.05, -0.1, -0.001)),
        ("overload_learned_minus_plain", None),
        ("light_learned_minus_best_speculative", ci(-0.05, -0.1, -0.001)),
        ("accepted_length", {"learned": {"code": {"median": 3.0}, "rag": {"median": 3.0}}}),
        ("accepted_length", {"learned": {c: {"median": 2.99 if c == "rag" else 4} for c in bp.COPY_HEAVY}}),
    ]
    goal = {
        "learned_minus_best_static": 0,
        "learned_minus_oracle": 1,
        "overload_learned_minus_plain": 2,
        "light_learned_minus_best_speculative": 3,
        "accepted_length": 4,
    }
    for key, value in misses:
        got = _lines({**passing, key: value})
        assert got == [j != goal[key] for j in range(5)], (key, value)
