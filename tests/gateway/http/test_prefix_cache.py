"""Prefix caching through the gateway on the embedded engine, seen through the official openai client:
`usage.prompt_tokens_details.cached_tokens` on both endpoints, streamed or not; a repeated prompt is
served from the cache (same text, fewer tokens prefilled); `cache_salt` partitions the cache and is
validated; the request's record and /metrics count the hits.

Each test starts its prompts with a tag of its own, so that no test hits another's cached blocks
(the module's gateway, and so its cache, is shared)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.fake_upstream import metric_value
from tests.gateway.live import LiveGateway, record_of, start_gateway, tiny_settings

pytestmark = pytest.mark.timeout(120)

# About 150 prompt tokens (one per character): dozens of full blocks of 4.
BODY = "The quick brown fox jumps over the lazy dog, then naps under the old oak tree. " * 2


def _messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{tag} {BODY}"}]


def _chat(client: openai.OpenAI, model: str, tag: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=_messages(tag),  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        **kw,
    )


def _cached(usage: Any) -> int | None:
    details = usage.prompt_tokens_details
    return None if details is None else details.cached_tokens


def _stream_usage(client: openai.OpenAI, model: str, tag: str, chat: bool = True, **kw: Any) -> Any:
    if chat:
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=_messages(tag),  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        )
    else:
        chunks = list(
            client.completions.create(
                model=model,
                prompt=f"{tag} {BODY}",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            )
        )
    tail = chunks[-1]
    assert tail.choices == [] and tail.usage is not None
    assert sum(1 for c in chunks if c.usage is not None) == 1
    return tail.usage


def _post(live: LiveGateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=60)


# ---- the usage field: always there on the embedded engine -------------------------------------------


def test_every_answer_reports_cached_tokens(gateway: LiveGateway, model_name: str) -> None:
    """Non-streamed and streamed, chat and completions: the field is there (0 or more), as OpenAI
    and vLLM put it, and total_tokens still adds up."""
    chat = _post(
        gateway,
        "/v1/chat/completions",
        {"model": model_name, "messages": _messages("A1"), "max_tokens": 4, "temperature": 0},
    ).json()
    text = _post(
        gateway, "/v1/completions", {"model": model_name, "prompt": "A2 hello", "max_tokens": 4}
    ).json()
    for use in (chat["usage"], text["usage"]):
        assert set(use) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
        assert set(use["prompt_tokens_details"]) == {"cached_tokens"}
        cached = use["prompt_tokens_details"]["cached_tokens"]
        assert isinstance(cached, int) and 0 <= cached <= use["prompt_tokens"]
        assert use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_the_stream_usage_chunk_reports_cached_tokens(
    client: openai.OpenAI, model_name: str, chat: bool
) -> None:
    use = _stream_usage(client, model_name, "B1" if chat else "B2", chat=chat)
    cached = _cached(use)
    assert cached is not None and 0 <= cached <= use.prompt_tokens


# ---- real hits (these need the engine's prefix cache) -----------------------------------------------


def test_a_repeated_chat_prompt_is_served_from_the_cache(
    gateway: LiveGateway, client: openai.OpenAI, model_name: str
) -> None:
    first = _chat(client, model_name, "C1", extra_headers={"x-request-id": "prefix-c1-first"})
    second = _chat(client, model_name, "C1", extra_headers={"x-request-id": "prefix-c1-second"})
    assert _cached(first.usage) == 0
    hit = _cached(second.usage)
    assert hit is not None and 0 < hit <= second.usage.prompt_tokens  # type: ignore[union-attr]
    assert second.usage.prompt_tokens == first.usage.prompt_tokens  # type: ignore[union-attr]
    # Reused keys and values give the same greedy text as a full prefill.
    assert second.choices[0].message.content == first.choices[0].message.content
    # The record (and so the telemetry row) keeps what the client was told.
    assert record_of(gateway, "prefix-c1-first").cached_tokens == 0
    assert record_of(gateway, "prefix-c1-second").cached_tokens == hit
    # Streamed, the same prompt hits too, and the usage chunk says so.
    streamed = _cached(_stream_usage(client, model_name, "C1"))
    assert streamed is not None and streamed > 0


def test_a_repeated_completion_prompt_is_served_from_the_cache(
    client: openai.OpenAI, model_name: str
) -> None:
    prompt = f"D1 {BODY}"
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0)
    assert _cached(first.usage) == 0
    hit = _cached(second.usage)
    assert hit is not None and 0 < hit <= second.usage.prompt_tokens  # type: ignore[union-attr]
    assert second.choices[0].text == first.choices[0].text
    streamed = _cached(_stream_usage(client, model_name, "D1", chat=False))
    assert streamed is not None and streamed > 0


def test_cache_salt_partitions_the_cache(client: openai.OpenAI, model_name: str) -> None:
    def cached(salt: str | None) -> int | None:
        extra = {"cache_salt": salt} if salt is not None else {}
        return _cached(_chat(client, model_name, "E1", extra_body=extra).usage)

    assert cached("team-a") == 0
    assert cached("team-b") == 0  # another salt: none of team-a's blocks
    assert cached(None) == 0  # no salt is a partition of its own, too
    hit = cached("team-a")
    assert hit is not None and hit > 0
    hit = cached(None)
    assert hit is not None and hit > 0


def test_prefix_cache_counters_count_queried_and_hit_tokens(
    gateway: LiveGateway, client: openai.OpenAI, model_name: str
) -> None:
    labels = {"model": model_name, "backend": "embedded"}

    def counters() -> tuple[float, float]:
        text = httpx.get(f"{gateway.url}/metrics").text
        queried = metric_value(text, "specgate_prefix_cache_queried_tokens_total", **labels) or 0.0
        hits = metric_value(text, "specgate_prefix_cache_hit_tokens_total", **labels) or 0.0
        return queried, hits

    before = counters()
    first = _chat(client, model_name, "F1", extra_headers={"x-request-id": "prefix-f1-first"})
    second = _chat(client, model_name, "F1", extra_headers={"x-request-id": "prefix-f1-second"})
    for rid in ("prefix-f1-first", "prefix-f1-second"):
        assert record_of(gateway, rid) is not None  # counted before its record is handed on
    after = counters()
    prompt = first.usage.prompt_tokens + second.usage.prompt_tokens  # type: ignore[union-attr]
    assert after[0] - before[0] == prompt
    assert after[1] - before[1] == _cached(first.usage) + _cached(second.usage)  # type: ignore[operator]
    assert after[1] - before[1] > 0


# ---- cache_salt at the edge -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "salt",
    [
        "x" * 257,  # longer than any salt needs to be
        "x" * 100_000,
        "",
        123,
        1.5,
        True,
        ["team-a"],
        {"salt": "team-a"},
        "team\na",
        "team\x00a",
        "team\x1b[31ma",
        "team\x7f",
        "team\x85a",  # C1 (next line)
    ],
    ids=repr,
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_hostile_cache_salt_is_a_400_naming_it(
    gateway: LiveGateway, model_name: str, path: str, salt: Any
) -> None:
    body: dict[str, Any] = {"model": model_name, "max_tokens": 2, "cache_salt": salt}
    body.update({"messages": _messages("G1")} if "chat" in path else {"prompt": "G1 hi"})
    r = _post(gateway, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and error["code"] == "invalid_value"
    assert error["type"] == "invalid_request_error"


def test_a_lone_surrogate_salt_is_a_400(gateway: LiveGateway, model_name: str) -> None:
    body = json.dumps({"model": model_name, "prompt": "hi", "max_tokens": 2, "cache_salt": "a\ud800"})
    r = httpx.post(
        f"{gateway.url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_sane_salt_is_accepted(gateway: LiveGateway, model_name: str) -> None:
    for salt in ("a", "x" * 256, "tenant 42 / ünïcode ☃", None):
        body = {"model": model_name, "prompt": "H1 hi", "max_tokens": 2, "cache_salt": salt}
        assert _post(gateway, "/v1/completions", body).status_code == 200, salt


def test_the_published_schema_describes_cache_salt(gateway: LiveGateway) -> None:
    schemas = httpx.get(f"{gateway.url}/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        (salt,) = [s for s in schemas[name]["properties"]["cache_salt"]["anyOf"] if s.get("type") == "string"]
        assert salt["minLength"] == 1 and salt["maxLength"] == 256 and salt["pattern"]


# ---- prefix caching turned off ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def uncached(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(str(tiny_llama_dir), embedded={"prefix_caching": False}, log_requests=False)
    )
    yield live
    live.stop()


def test_with_prefix_caching_off_nothing_is_cached_and_usage_says_0(
    uncached: LiveGateway, model_name: str
) -> None:
    assert uncached.services.settings.embedded.engine_config().prefix_caching is False
    client = openai.OpenAI(base_url=f"{uncached.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for _ in range(2):
        assert _cached(_chat(client, model_name, "I1").usage) == 0
