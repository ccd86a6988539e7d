"""A client that leaves (streaming or not) aborts its engine request at once; its KV blocks are freed."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from tests.gateway.live import LiveGateway, wait_for

BODY = {
    "messages": [{"role": "user", "content": "tell me everything"}],
    "max_tokens": 400,
    "ignore_eos": True,
}


@pytest.fixture
def slow_engine(gateway: LiveGateway, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Steps take >= 10 ms, so a 400-token request is still running when the client leaves."""
    engine = gateway.services.registry.embedded.engine  # type: ignore[union-attr]
    real_step = engine.step

    def slow_step():  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    return engine


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    return wait_for(cond, timeout, interval=0.01)


def test_stream_disconnect_frees_blocks(gateway: LiveGateway, model_name: str, slow_engine) -> None:  # type: ignore[no-untyped-def]
    body = {**BODY, "model": model_name, "stream": True}
    headers = {"x-request-id": "leaves-mid-stream"}
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert slow_engine.block_manager.num_used_blocks > 0 and slow_engine.request_ids()
    left = time.monotonic()
    assert _wait(lambda: not slow_engine.request_ids() and slow_engine.block_manager.num_used_blocks == 0)
    assert time.monotonic() - left < 1.0  # at once, not when the request would have finished (~4 s)
    rec = gateway.services.recent.find("leaves-mid-stream")  # type: ignore[attr-defined]
    assert _wait(lambda: gateway.services.recent.find("leaves-mid-stream") is not None)  # type: ignore[attr-defined]
    rec = gateway.services.recent.find("leaves-mid-stream")  # type: ignore[attr-defined]
    assert rec.outcome == "cancelled" and rec.status == 200 and rec.completion_tokens is None


def test_non_stream_disconnect_frees_blocks(gateway: LiveGateway, model_name: str, slow_engine) -> None:  # type: ignore[no-untyped-def]
    body = {**BODY, "model": model_name}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gateway.url}/v1/chat/completions", json=body, headers={"x-request-id": "gives-up"}, timeout=0.5
        )
    assert _wait(
        lambda: not slow_engine.request_ids() and slow_engine.block_manager.num_used_blocks == 0, 1.5
    )
    assert _wait(lambda: gateway.services.recent.find("gives-up") is not None)  # type: ignore[attr-defined]
    rec = gateway.services.recent.find("gives-up")  # type: ignore[attr-defined]
    assert rec.outcome == "cancelled" and rec.status == 499


def test_gateway_serves_normally_after_disconnects(gateway: LiveGateway, model_name: str) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": model_name, "prompt": "ab", "max_tokens": 3}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_events_are_valid_json_even_with_an_upstreams_nan() -> None:
    import json as _json

    from specgate.gateway.http.sse import sse

    event = sse({"x": float("nan"), "y": [float("inf"), 1.5], "z": "\ud800"})

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    body = _json.loads(event.removeprefix(b"data: ").strip(), parse_constant=refuse)
    assert body["x"] is None and body["y"] == [None, 1.5]
