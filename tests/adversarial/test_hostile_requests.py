"""The attacks once seen against the gateway, and every bounded field, one by one: each hostile
request gets a 400 that names its parameter (or is made harmless), and nobody else notices."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import pytest

from tests.adversarial.conftest import assert_openai_error, assert_whole, rows_for, send
from tests.gateway.live import LiveGateway

pytestmark = pytest.mark.timeout(180)
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]
DEEP = {"a": 1}
for _ in range(100):
    DEEP = {"a": DEEP}

# field -> (value, the param a 400 names); every row is a request that must be refused cleanly.
REFUSED: list[tuple[str, Any, str | None]] = [
    ("seed", 2**64, "seed"),
    ("seed", -(2**63) - 1, "seed"),
    ("seed", 10**40, "seed"),
    ("temperature", float("nan"), None),
    ("temperature", float("inf"), None),
    ("temperature", 1e400, None),  # parses as inf
    ("temperature", -1e-300, "temperature"),
    ("top_p", 0.0, "top_p"),
    ("top_p", float("nan"), None),
    ("min_p", 1.5, "min_p"),
    ("presence_penalty", -1e308, "presence_penalty"),
    ("frequency_penalty", float("-inf"), None),
    ("repetition_penalty", 1e-300, "repetition_penalty"),
    ("repetition_penalty", 1e300, "repetition_penalty"),
    ("top_k", 2**40, "top_k"),
    ("top_k", -2, "top_k"),
    ("max_tokens", 2**40, "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("min_tokens", 2**40, "min_tokens"),
    ("n", 10**9, "n"),
    ("top_logprobs", 10**6, "top_logprobs"),
    ("stop", ["x"] * 5, "stop"),
    ("stop", "y" * 10_000, "stop"),
    ("stop_token_ids", [-1], "stop_token_ids.0"),
    ("stop_token_ids", [2**31], "stop_token_ids.0"),
    ("stop_token_ids", [95] * 1000, "stop_token_ids"),
    ("stop_token_ids", [10_000], "stop_token_ids"),  # beyond this model's vocabulary
    ("logit_bias", {"abc": 1}, "logit_bias"),
    ("logit_bias", {"-1": 1}, "logit_bias"),
    ("logit_bias", {"007": 1}, "logit_bias"),
    ("logit_bias", {"99999999999": 1}, "logit_bias"),
    ("logit_bias", {"5": 100.5}, "logit_bias.5"),
    ("logit_bias", {"5": float("nan")}, None),
    ("logit_bias", {"5": "much"}, "logit_bias.5"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias"),
    ("logit_bias", [1, 2], "logit_bias"),
    ("logit_bias", {"10000": -100}, "logit_bias"),  # beyond this model's vocabulary
    ("spec", {"k_max": 10**6}, "spec.k_max"),
    ("spec", {"k_min": 5, "k_max": 2}, "spec"),
    ("spec", {"method": "draft_model"}, "spec.method"),  # a method the operator does not allow
    ("spec", {"method": "x" * 100}, "spec.method"),
    ("user", "u" * 10_000, "user"),
    ("tools", [{"type": "function", "function": {"name": "bad name!"}}], "tools"),
    ("tools", [{"type": "function", "function": {"name": "f"}}] * 200, "tools"),
    ("tool_choice", "whatever", None),
    ("messages", [{"role": "user", "content": "x"}] * 5000, "messages"),
    ("messages", [{"role": "tool", "content": "x"}], None),
    ("extra", DEEP, None),  # nesting beyond the limit, in a field nobody reads
    ("model", "m" * 1000, "model"),
]


@pytest.mark.parametrize(
    ("field", "value", "param"), REFUSED, ids=[f"{f}={str(v)[:20]}" for f, v, _ in REFUSED]
)
def test_refused_with_a_clear_400(
    target: LiveGateway, model: str, field: str, value: Any, param: str | None
) -> None:
    body = {"model": model, "messages": MSG, "max_tokens": 4, field: value}
    r = send(target, CHAT, body)
    assert r.status_code == 400, r.text
    err = assert_openai_error(r)
    if param is not None:
        assert err["param"] == param, err


def test_the_reported_attacks_leave_the_gateway_whole(target: LiveGateway, model: str) -> None:
    ids = [f"attack-{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
    # A seed beyond the generator's range once killed the engine thread: 503 for everyone after.
    r = send(
        target,
        CHAT,
        {"model": model, "messages": MSG, "seed": 18446744073709551616},
        {"x-request-id": ids[0]},
    )
    assert r.status_code == 400 and assert_openai_error(r)["param"] == "seed"
    # A lone surrogate as the model name once made /metrics 500 forever and jammed telemetry.
    r = send(target, CHAT, {"model": "\ud800", "messages": MSG}, {"x-request-id": ids[1]})
    assert r.status_code == 400
    r = send(
        target, CHAT, {"model": "\ud83d\ude00 ok", "messages": MSG}, {"x-request-id": ids[2]}
    )  # a valid pair
    assert r.status_code == 404
    # The same client id three times: three rows, each under the gateway's own id.
    for _ in range(3):
        ok = send(target, CHAT, {"model": model, "messages": MSG, "max_tokens": 2}, {"x-request-id": ids[3]})
        assert ok.status_code == 200 and ok.headers["x-request-id"] == ids[3]
    assert_whole(target)
    assert rows_for(target, ids[:4]) == {ids[0]: 1, ids[1]: 1, ids[2]: 1, ids[3]: 3}
    # Extreme seeds inside the range are served.
    for seed in (-(2**63), 2**63 - 1):
        r = send(target, CHAT, {"model": model, "messages": MSG, "seed": seed, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_bodies_refused_before_any_parameter_is_read(target: LiveGateway, model: str) -> None:
    cases = {
        "not json": b"{nope",
        "nan literal": b'{"model": "m", "messages": [], "temperature": NaN}',
        "an array": b"[1, 2]",
        "deep arrays": b"[" * 100_000 + b"]" * 100_000,
        "huge integer": b'{"seed": ' + b"9" * 10_000 + b"}",
        "not utf-8": b'{"model": "\xff\xfe"}',
        "utf-16": '{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}'.encode("utf-16"),
        "a float out of range": b'{"model": "m", "messages": [], "extra": 1e999}',
    }
    for name, raw in cases.items():
        r = send(target, CHAT, raw)
        assert r.status_code == 400, name
        assert assert_openai_error(r)["code"] == "invalid_json", name
    assert_whole(target)


@pytest.mark.slow
def test_a_victim_stream_is_untouched_by_hostile_neighbours(target: LiveGateway, model: str) -> None:
    """A greedy stream decodes the same text alone and while hostile requests hit the same engine."""
    victim = {
        "model": model,
        "messages": [{"role": "user", "content": "the victim's own prompt"}],
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    def stream_text() -> str:
        out = []
        with httpx.stream("POST", f"{target.url}{CHAT}", json=victim, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    import json

                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for c in chunk.get("choices") or []:
                        out.append(c["delta"].get("content") or "")
        return "".join(out)

    alone = stream_text()
    hostile: list[dict[str, Any]] = [
        {"temperature": 1e-50, "stream": True, "max_tokens": 60},
        {"seed": 2**64},
        {"temperature": 1e-45, "top_p": 5e-324, "max_tokens": 40},
        {"stop_token_ids": [10**5]},
        {"repetition_penalty": 0.01, "temperature": 1.9, "max_tokens": 40, "seed": 3},
        {"presence_penalty": 2, "frequency_penalty": -2, "top_k": 1, "max_tokens": 40},
        {"logprobs": True, "top_logprobs": 20, "max_tokens": 30},
        {"min_tokens": 30, "max_tokens": 30, "stop": ["a", "b", "c", "d"]},
        {"spec": {"method": "suffix", "k_max": 64}, "max_tokens": 50},
        {"spec": {"method": "eagle"}, "max_tokens": 10},  # no head for this model: refused
    ]
    results: list[int] = []

    def attack() -> None:
        for extra in hostile:
            body = {"model": model, "messages": [{"role": "user", "content": "abab abab"}], **extra}
            results.append(send(target, CHAT, body).status_code)
        # and clients that leave mid-stream
        for _ in range(3):
            try:
                with httpx.stream(
                    "POST", f"{target.url}{CHAT}", json={**victim, "max_tokens": 100}, timeout=0.3
                ) as r:
                    next(r.iter_lines())
            except httpx.HTTPError:
                pass

    threads = [threading.Thread(target=attack) for _ in range(3)]
    for t in threads:
        t.start()
    together = stream_text()
    for t in threads:
        t.join(120)
    assert together == alone
    assert 500 not in results and set(results) <= {200, 400}
    assert_whole(target)
