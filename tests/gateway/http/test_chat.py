"""/v1/chat/completions on the embedded engine, through the official openai client on loopback."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from specgate.engine.engine import Engine
from specgate.engine.sampling_params import SamplingParams
from specgate.gateway.backends.embedded.chat_template import render_chat
from specgate.gateway.protocol.schemas import ChatCompletionRequest
from tests.gateway.live import LiveGateway, record_of

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def _engine_greedy(engine: Engine, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    ids = render_chat(engine.tokenizer, messages)
    engine.add_request("ref", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.new_text for o in engine.step())
    return text, len(ids)


def test_chat_matches_the_engine_and_counts_usage_exactly(
    client: openai.OpenAI, model_name: str, make_engine: Callable[..., Engine]
) -> None:
    expected, prompt_len = _engine_greedy(make_engine(), MESSAGES, 12)
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        extra_body={"spec": {"method": "off"}},
    )
    assert r.choices[0].message.content == expected
    assert r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.model == model_name
    assert r.usage is not None
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == prompt_len + 12


def test_max_completion_tokens_and_stop(client: openai.OpenAI, model_name: str) -> None:
    full = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=20, temperature=0
    )
    text = full.choices[0].message.content or ""
    assert full.usage is not None and full.usage.completion_tokens == 20
    stop = text[5:7]
    cut = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=20, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_stream_with_usage_matches_non_stream(client: openai.OpenAI, model_name: str) -> None:
    ref = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=15, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=15,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 15 and last.usage.prompt_tokens == ref.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])
    metrics = last.model_extra["metrics"]  # type: ignore[index]
    assert metrics["route"]["backend"] == "embedded" and metrics["ttft"] > 0


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI, model_name: str) -> None:
    chunks = list(
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, stream=True)
    )
    assert chunks[-1].choices and chunks[-1].choices[0].finish_reason == "length"
    assert "metrics" in (chunks[-1].model_extra or {})


def test_speculation_is_lossless_and_reported(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "abcabcabcabcabcabcabcabc"}]
    plain = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"spec": {"method": "off"}},
    )
    spec = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=40,
        temperature=0,
        extra_body={"spec": {"method": "ngram", "controller": "static", "num_speculative_tokens": 3}},
    )
    assert spec.choices[0].message.content == plain.choices[0].message.content
    m = spec.model_extra["metrics"]  # type: ignore[index]
    assert m["route"]["spec"]["method"] == "ngram" and m["route"]["spec"]["controller"] == "static"
    assert m["spec_decoding"]["method"] == "ngram"
    assert m["spec_decoding"]["num_draft_tokens"] >= m["spec_decoding"]["num_accepted_tokens"] >= 0
    assert plain.model_extra["metrics"]["spec_decoding"]["method"] is None  # type: ignore[index]


def test_draft_trees_are_lossless_reported_and_bounded(client: openai.OpenAI, model_name: str) -> None:
    messages = [{"role": "user", "content": "ab1 ab2 ab3 abc ab1 ab2 ab3 abc ab1 ab2 ab3 ab"}]
    kw = dict(model=model_name, messages=messages, max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**kw, extra_body={"spec": {"method": "off"}})  # type: ignore[call-overload]
    tree = client.chat.completions.create(  # type: ignore[call-overload]
        **kw,
        extra_body={"spec": {"method": "suffix", "controller": "static", "k_max": 4, "max_tree_nodes": 12}},
    )
    assert tree.choices[0].message.content == plain.choices[0].message.content
    m = tree.model_extra["metrics"]
    assert m["route"]["spec"]["max_tree_nodes"] == 12
    sd = m["spec_decoding"]
    assert {"num_tree_drafts", "mean_draft_nodes", "mean_accepted_depth"} <= set(sd)
    assert 0 <= sd["num_tree_drafts"] <= sd["num_drafts"] and 0 <= sd["mean_draft_nodes"] <= 12
    for bad in (-1, 65, "many", 2.5):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(**kw, extra_body={"spec": {"max_tree_nodes": bad}})  # type: ignore[call-overload]
        assert err.value.status_code == 400 and "max_tree_nodes" in str(err.value)


def test_seeded_sampling_is_reproducible(client: openai.OpenAI, model_name: str) -> None:
    kw = dict(model=model_name, messages=MESSAGES, max_tokens=12, temperature=1.0, top_p=0.9, seed=123)
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].message.content == b.choices[0].message.content


def test_seeded_requests_are_never_explored(
    gateway: LiveGateway, model_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Exploration takes a random arm, and a speculative arm samples through rejection sampling:
    # the same seed would then give another answer.
    router = gateway.services.router
    assert router.policy is not None
    manager = router.policy.manager
    asked: list[bool] = []
    decide = manager.decide

    def spy(ctx: object, explore: bool) -> object:
        asked.append(explore)
        return decide(ctx, explore)

    monkeypatch.setattr(manager, "decide", spy)
    for extra in ({}, {"seed": 7}, {"seed": 0}):
        body = {"model": model_name, "messages": MESSAGES, "temperature": 1.0, **extra}
        router.route(ChatCompletionRequest.model_validate(body), gateway.services.load_signals())
    assert asked == [True, False, False]


def test_logprobs(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)  # greedy: the argmax
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_penalties_and_vllm_extensions_are_accepted(client: openai.OpenAI, model_name: str) -> None:
    r = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=8,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 8,
            "ignore_eos": True,
        },
    )
    assert r.usage is not None and r.usage.completion_tokens == 8


def test_logit_bias_bans_and_forces_tokens(
    client: openai.OpenAI, model_name: str, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine()
    engine.add_request(
        "ref", render_chat(engine.tokenizer, MESSAGES), SamplingParams(max_tokens=6, temperature=0.0)
    )
    step = iter(engine.step, None)
    first = next(t for outs in step for o in outs for t in o.new_token_ids)  # the greedy first token

    def greedy(**kw: object) -> list[str]:
        r = client.chat.completions.create(  # type: ignore[call-overload]
            model=model_name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, **kw
        )
        return [e.token for e in r.choices[0].logprobs.content]

    plain = greedy()
    assert plain[0] == engine.tokenizer.decode([first])
    banned = greedy(logit_bias={str(first): -100})
    assert banned[0] != plain[0]
    forced = greedy(logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced == [engine.tokenizer.decode([42])] * 6


def test_tools_are_rendered_into_the_prompt(client: openai.OpenAI, model_name: str) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    with_tools = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=2, tools=tools
    )  # type: ignore[arg-type]
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # type: ignore[union-attr]
    none = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=2,
        tools=tools,
        tool_choice="none",  # type: ignore[arg-type]
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]


def test_tool_round_trip_messages_are_accepted(client: openai.OpenAI, model_name: str) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
    ]
    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=3)  # type: ignore[arg-type]
    assert r.choices[0].finish_reason == "length"


def test_request_id_header(gateway: LiveGateway, model_name: str) -> None:
    import httpx

    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 2}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"x-request-id": "my-req-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-req-42"  # echoed
    ours = r.json()["id"].removeprefix("chatcmpl-")  # the gateway's own id names the response and row
    assert ours != "my-req-42" and len(ours) == 32
    r2 = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
    assert len(r2.headers["x-request-id"]) >= 16 and r2.headers["x-request-id"] != "my-req-42"
    rec = record_of(gateway, "my-req-42")
    assert (
        rec is not None and rec.outcome == "ok" and rec.completion_tokens == 2 and rec.backend == "embedded"
    )
    assert rec.request_id == ours and rec.client_request_id == "my-req-42"
