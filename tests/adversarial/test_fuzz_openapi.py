"""Property-based fuzzing of /v1 and /admin from the gateway's own OpenAPI schema.

Bodies are drawn by schemathesis from the published request schemas (so most of them reach the
engine, not only the validator), then some are mutated with hostile values. Whatever comes in:
never a 500 (5xx only 502 / 503 / 504), OpenAI-shaped errors, the engine alive, /metrics
answering, and exactly one telemetry row per /v1 request. `max_tokens` is capped so the examples stay quick.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.adversarial.conftest import ADMIN, assert_openai_error, assert_whole, rows_for, send
from tests.gateway.live import LiveGateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HOSTILE_VALUES = [
    float("nan"),
    float("inf"),
    -1e308,
    1e-320,
    2**64,
    -(2**63) - 1,
    10**30,
    "",
    "\ud800",
    "x" * 5000,
    [],
    {},
    None,
    True,
    [[[[[[[[[[["deep"]]]]]]]]]]],
]
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same examples every run: a CI failure reproduces here
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def _drawn(live: LiveGateway, method: str, path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies schemathesis draws for one operation of the live gateway's /openapi.json."""
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    cases = schema[path][method].as_strategy()
    return cases.map(lambda case: case.body if isinstance(case.body, dict) else {})


def _bodies(drawn: st.SearchStrategy[dict[str, Any]], model: str) -> st.SearchStrategy[dict[str, Any]]:
    def shape(body: dict[str, Any], use_model: bool, mutation: tuple[str, Any] | None) -> dict[str, Any]:
        body = dict(body)
        if use_model:
            body["model"] = model
        for key in ("max_tokens", "max_completion_tokens"):  # cap the work, keep the field's presence
            if isinstance(body.get(key), int):
                body[key] = min(body[key], 4)
        body.setdefault("max_tokens", 4)
        if mutation is not None:
            key, value = mutation
            body[key] = value
        return body

    keys = st.sampled_from(
        [
            "temperature",
            "top_p",
            "seed",
            "max_tokens",
            "stop",
            "logprobs",
            "top_logprobs",
            "spec",
            "messages",
            "prompt",
            "stop_token_ids",
            "n",
            "model",
            "tools",
            "top_k",
            "min_p",
            "stream",
            "logit_bias",
        ]
    )
    mutation = st.none() | st.tuples(keys, st.sampled_from(HOSTILE_VALUES))
    served = st.sampled_from([True, True, True, False])  # most name the served model
    return st.builds(shape, drawn, served, mutation)


def _check(r: httpx.Response) -> None:
    if r.status_code == 200:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            for line in r.text.splitlines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        assert chunk["error"]["code"] != "internal_error", chunk
        return
    assert_openai_error(r)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzz_inference_routes(target: LiveGateway, model: str, path: str) -> None:
    sent: list[str] = []
    statuses: list[int] = []

    @FUZZ
    @given(_bodies(_drawn(target, "POST", path), model))
    def one(body: dict[str, Any]) -> None:
        rid = f"fuzz-{uuid.uuid4().hex}"
        sent.append(rid)
        r = send(target, path, body, {"x-request-id": rid})
        statuses.append(r.status_code)
        _check(r)

    one()
    assert_whole(target)
    assert set(rows_for(target, sent).values()) == {1}  # exactly one row per request, whatever it was
    assert statuses.count(200) >= 5, statuses  # the schema is precise enough to reach the engine


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/tokenize", "/detokenize"])
def test_fuzz_passthrough_routes(target: LiveGateway, model: str, path: str) -> None:
    """The embedded model serves /tokenize and /detokenize and refuses embeddings and rerank (no
    external backend here): never a 500, and one row per embeddings / rerank request."""
    sent: list[str] = []
    keys = ["model", "input", "prompt", "messages", "content", "tokens", "query", "documents", "dimensions"]
    mutation = st.none() | st.tuples(st.sampled_from(keys), st.sampled_from(HOSTILE_VALUES))

    def shape(body: dict[str, Any], use_model: bool, change: tuple[str, Any] | None) -> dict[str, Any]:
        body = dict(body)
        if use_model:
            body["model"] = model
        if change is not None:
            body[change[0]] = change[1]
        return body

    @settings(FUZZ, max_examples=30)
    @given(st.builds(shape, _drawn(target, "POST", path), st.booleans(), mutation))
    def one(body: dict[str, Any]) -> None:
        rid = f"fuzz-{uuid.uuid4().hex}"
        sent.append(rid)
        r = send(target, path, body, {"x-request-id": rid})
        statuses.append(r.status_code)
        if r.status_code != 200:
            assert_openai_error(r)

    statuses: list[int] = []
    one()
    assert_whole(target)
    tracked = path in ("/v1/embeddings", "/v1/rerank")
    assert set(rows_for(target, sent).values()) == ({1} if tracked else {0})
    if not tracked:  # the schema is precise enough to reach the tokenizer
        assert statuses.count(200) >= 2, statuses


def test_fuzz_responses_route(target: LiveGateway, model: str) -> None:
    """POST /v1/responses: translated to chat, so the same guarantees, and a stream that fails after
    it started ends with `response.failed`, never an internal error."""
    sent: list[str] = []
    statuses: list[int] = []
    keys = ["input", "instructions", "tools", "tool_choice", "text", "reasoning", "metadata", "stream"]
    keys += ["temperature", "previous_response_id", "store", "max_output_tokens", "model"]
    mutation = st.none() | st.tuples(st.sampled_from(keys), st.sampled_from(HOSTILE_VALUES))

    def shape(body: dict[str, Any], use_model: bool, change: tuple[str, Any] | None) -> dict[str, Any]:
        body = dict(body)
        if use_model:
            body["model"] = model
        body.setdefault("input", "Hi")  # optional in the schema, but without it there is nothing to answer
        body.pop("previous_response_id", None)  # a drawn id names no stored response: always a 400
        cap = body.get("max_output_tokens")
        body["max_output_tokens"] = min(cap, 4) if isinstance(cap, int) and cap >= 1 else 4
        if change is not None:
            body[change[0]] = change[1]
        return body

    @settings(FUZZ, max_examples=40)
    @given(st.builds(shape, _drawn(target, "POST", "/v1/responses"), served_model(), mutation))
    def one(body: dict[str, Any]) -> None:
        rid = f"fuzz-{uuid.uuid4().hex}"
        sent.append(rid)
        r = send(target, "/v1/responses", body, {"x-request-id": rid})
        statuses.append(r.status_code)
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            for line in r.text.splitlines():
                if line.startswith("data: {") and '"response.failed"' in line:
                    event = json.loads(line[6:])
                    assert event["response"]["error"]["code"] != "internal_error", event
        elif r.status_code != 200:
            assert_openai_error(r)

    one()
    assert_whole(target)
    assert set(rows_for(target, sent).values()) == {1}
    assert statuses.count(200) >= 3, statuses


def served_model() -> st.SearchStrategy[bool]:
    return st.sampled_from([True, True, True, False])


@pytest.mark.parametrize(
    ("method", "path"),
    [("PUT", "/admin/policy"), ("POST", "/admin/route/explain"), ("POST", "/admin/policy/retrain")],
)
def test_fuzz_admin_routes(target: LiveGateway, model: str, method: str, path: str) -> None:
    auth = {"authorization": f"Bearer {ADMIN}"}

    @settings(FUZZ, max_examples=25)
    @given(_bodies(_drawn(target, method, path), model))
    def one(body: dict[str, Any]) -> None:
        if path != "/admin/route/explain":
            body.pop("model", None)
            body.pop("max_tokens", None)
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        r = httpx.request(
            method,
            f"{target.url}{path}",
            content=raw,
            headers={**auth, "content-type": "application/json"},
            timeout=60,
        )
        if r.status_code >= 400:
            assert_openai_error(r)

    one()
    assert_whole(target)
    # Whatever the edits did, /v1 still routes.
    ok = send(
        target,
        "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert ok.status_code == 200, ok.text
