"""Tenants do not share drafting state, clients cannot pick methods the operator did not allow, and
long prompts are tokenized off the event loop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.gateway.backends.embedded import backend as embedded_module
from specgate.gateway.http.auth import key_id
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings

PROMPT = [{"role": "user", "content": "abcabcabcabc"}]


@pytest.fixture(scope="module")
def keyed(tiny_fixed_point_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(str(tiny_fixed_point_dir), api_keys=["k-alice", "k-bob"], log_requests=False)
    )
    yield live
    live.stop()


def _chat(live: LiveGateway, key: str | None, **extra: Any) -> httpx.Response:
    body = {"model": live.services.registry.embedded.served_name, "messages": PROMPT, "max_tokens": 24}  # type: ignore[union-attr]
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{live.url}/v1/chat/completions", json={**body, **extra}, headers=headers, timeout=60)


def test_each_key_drafts_only_from_its_own_outputs(keyed: LiveGateway) -> None:
    engine = keyed.services.registry.embedded.engine  # type: ignore[union-attr]
    suffix = engine.proposer("suffix")
    assert _chat(keyed, "k-alice", spec={"method": "suffix"}).status_code == 200
    assert suffix.scopes == [key_id("k-alice")]
    # Bob's identical request finds no cache of his own: nothing of Alice's output reaches his drafts.
    tree_before = suffix.shared_tree(key_id("k-alice"))
    r = _chat(keyed, "k-bob", spec={"method": "suffix"})
    assert r.status_code == 200
    assert sorted(suffix.scopes) == sorted([key_id("k-alice"), key_id("k-bob")])
    assert suffix.shared_tree(key_id("k-alice")) is tree_before  # untouched by Bob


def test_a_method_the_operator_does_not_allow_is_refused(keyed: LiveGateway) -> None:
    r = _chat(keyed, "k-alice", spec={"method": "draft_model"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spec.method"


def test_open_mode_scopes_by_address_or_not_at_all(tiny_fixed_point_dir: Path) -> None:
    for mode, expected in (("tenant", ["addr:127.0.0.1"]), ("off", []), ("global", [""])):
        live = start_gateway(
            tiny_settings(str(tiny_fixed_point_dir), embedded={"draft_cache_scope": mode}, log_requests=False)
        )
        try:
            assert _chat(live, "any-string", spec={"method": "suffix"}).status_code == 200
            suffix = live.services.registry.embedded.engine.proposer("suffix")  # type: ignore[union-attr]
            assert suffix.scopes == expected, mode
        finally:
            live.stop()


def test_long_prompts_are_tokenized_off_the_event_loop(
    keyed: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real = embedded_module.prepare

    def spy(call, engine):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(call, engine)

    monkeypatch.setattr(embedded_module, "prepare", spy)
    _chat(keyed, "k-alice", max_tokens=2)
    long = [{"role": "user", "content": "x" * (embedded_module.TOKENIZE_OFF_LOOP_CHARS + 1)}]
    r = _chat(keyed, "k-alice", messages=long, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    loop_thread, worker_thread = threads
    assert worker_thread != loop_thread  # the short one on the loop, the long one in a worker thread
