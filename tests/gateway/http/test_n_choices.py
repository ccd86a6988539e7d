"""`n > 1` on the embedded engine, through the official openai client: n choices of one prompt."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from specgate.engine.sampling_params import MAX_N
from tests.gateway.live import LiveGateway, record_of, wait_for

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
# Pinned off: a sampled answer is reproducible from its seed under one speculation setting (the
# router may pick another per request; verification then draws from the stream differently).
SAMPLED: dict[str, Any] = {
    "temperature": 1.0,
    "seed": 77,
    "extra_body": {"ignore_eos": True, "spec": {"method": "off"}},
}


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=9)


def _chat(client: openai.OpenAI, model: str, **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=MESSAGES, **kw)  # type: ignore[arg-type]


def test_greedy_chat_gives_n_identical_choices_and_sums_usage(
    client: openai.OpenAI, model_name: str, gateway: LiveGateway
) -> None:
    one = _chat(client, model_name, max_tokens=10, temperature=0, extra_body={"spec": {"method": "off"}})
    r: Any = client.chat.completions.with_raw_response.create(
        model=model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        n=3,
        max_tokens=10,
        temperature=0,
        extra_headers={"x-request-id": "n3-greedy"},
    ).parse()
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [one.choices[0].message.content] * 3
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert r.usage.completion_tokens == 30 and r.usage.total_tokens == r.usage.prompt_tokens + 30
    metrics = r.model_extra["metrics"]
    assert metrics["n"] == 3
    rec = record_of(gateway, "n3-greedy")
    assert rec.completion_tokens == 30 and rec.n == 3 and rec.prompt_tokens == one.usage.prompt_tokens


def test_sampled_chat_choices_are_reproducible_and_differ(client: openai.OpenAI, model_name: str) -> None:
    first = _chat(client, model_name, n=4, max_tokens=12, **SAMPLED)
    again = _chat(client, model_name, n=4, max_tokens=12, **SAMPLED)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1
    # Choice i is the n = 1 answer for seed + i.
    alone = _chat(client, model_name, max_tokens=12, **{**SAMPLED, "seed": 78})
    assert alone.choices[0].message.content == texts[1]


def test_streamed_chat_interleaves_choices_and_ends_with_summed_usage(
    client: openai.OpenAI, model_name: str, gateway: LiveGateway
) -> None:
    whole = _chat(client, model_name, n=3, max_tokens=12, **SAMPLED)
    chunks: list[Any] = list(
        _chat(
            client,
            model_name,
            n=3,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-request-id": "n3-stream"},
            **SAMPLED,
        )
    )
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    order = []
    for c in chunks[:-1]:
        assert len(c.choices) == 1
        choice = c.choices[0]
        order.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
            assert c.model_extra["metrics"]["tpot"] is not None  # its own
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert dict(finishes) == {0: ["length"], 1: ["length"], 2: ["length"]}
    switches = sum(a != b for a, b in itertools.pairwise(order))
    assert switches > 2  # interleaved as the sequences decode side by side, not one after another
    tail = chunks[-1]
    assert tail.choices == [] and tail.usage is not None
    assert tail.usage.completion_tokens == 36 and tail.usage.prompt_tokens == whole.usage.prompt_tokens
    assert tail.model_extra["metrics"]["n"] == 3
    rec = record_of(gateway, "n3-stream")
    assert rec.completion_tokens == 36 and rec.n == 3 and rec.outcome == "ok"


def test_speculation_counters_are_summed_over_the_choices(
    client: openai.OpenAI, model_name: str, gateway: LiveGateway
) -> None:
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt="abcabcabcabcabcabc",
            n=3,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"x-request-id": "n3-spec"},
            extra_body={"spec": {"method": "ngram"}},
        )
    )
    finals: list[Any] = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    per_choice = [c.model_extra["metrics"]["spec_decoding"] for c in finals]
    assert len(per_choice) == 3 and all(s["method"] == "ngram" for s in per_choice)
    total = chunks[-1].model_extra["metrics"]["spec_decoding"]  # type: ignore[index]
    rec = record_of(gateway, "n3-spec")
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert total[key] == rec.spec_decoding[key] == sum(s[key] for s in per_choice)
    assert rec.completion_tokens == 72


def test_completions_n_streamed_and_not(client: openai.OpenAI, model_name: str) -> None:
    kw: dict[str, Any] = {"model": model_name, "prompt": "once upon", "n": 2, "max_tokens": 8, "logprobs": 2}
    whole = client.completions.create(**kw, **SAMPLED)
    assert [c.index for c in whole.choices] == [0, 1]
    for c in whole.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens or []) == 8
    assert whole.choices[0].text != whole.choices[1].text
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    chunks = list(client.completions.create(**kw, stream=True, **SAMPLED))
    texts: dict[int, str] = defaultdict(str)
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]


def test_structured_output_applies_to_every_choice(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "pet", "strict": True, "schema": Pet.model_json_schema()},
        },
        n=3,
        max_tokens=150,
        temperature=0.8,
        seed=5,
    )
    assert len(r.choices) == 3
    pets = [Pet.model_validate_json(c.message.content or "") for c in r.choices]
    assert all(c.finish_reason == "stop" for c in r.choices) and len(pets) == 3


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"n": MAX_N + 1, "max_tokens": 4}, f"at most {MAX_N}"),
        ({"n": MAX_N, "max_tokens": 200}, "cannot fit"),  # 16 x 200 tokens: more than the 1,024 slots
    ],
)
def test_n_over_the_engines_bounds_is_a_400_naming_n(
    client: openai.OpenAI, model_name: str, kw: dict[str, Any], why: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, model_name, **kw)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "n"  # type: ignore[index]
    assert why in exc.value.message


def test_best_of_is_refused_clearly(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model_name, prompt="a", n=2, best_of=3, max_tokens=2)
    assert exc.value.body["param"] == "best_of"  # type: ignore[index]


def test_a_client_that_leaves_aborts_every_choice(
    gateway: LiveGateway, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine: Any = gateway.services.registry.embedded.engine  # type: ignore[union-attr]
    real_step = engine.step

    def slow_step() -> Any:
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    body = {
        "model": model_name,
        "messages": MESSAGES,
        "n": 3,
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30) as h,
        h.stream(
            "POST", f"{gateway.url}/v1/chat/completions", json=body, headers={"x-request-id": "n3-gone"}
        ) as r,
    ):
        lines = r.iter_lines()
        for _ in range(12):
            next(lines)
        assert engine.scheduler.num_waiting + len(engine.scheduler.running) == 3
    assert wait_for(lambda: not engine.request_ids() and engine.block_manager.num_used_blocks == 0, 2.0)
    rec = record_of(gateway, "n3-gone")
    assert rec.outcome == "cancelled"


def test_without_max_tokens_each_choice_grows_as_far_as_all_fit(
    client: openai.OpenAI, model_name: str
) -> None:
    # Chat: no max_tokens means the context's room (a completion's default is 16 tokens).
    r = _chat(client, model_name, n=MAX_N, temperature=0, extra_body={"ignore_eos": True})
    p = r.usage.prompt_tokens
    shared = (p - 1) // 4  # the tiny gateway's pool: 256 blocks of 4 tokens
    fits = (shared + (256 - shared) // MAX_N) * 4 - p
    assert all(c.finish_reason == "length" for c in r.choices) and len(r.choices) == MAX_N
    assert r.usage.completion_tokens == MAX_N * fits
