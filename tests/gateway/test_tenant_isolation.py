"""Tenants do not share drafting state or cached prompts, clients cannot pick methods the operator did
not allow, and long prompts are tokenized off the event loop."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.gateway.backends.embedded import backend as embedded_module
from specgate.gateway.http.auth import key_id
from specgate.gateway.services import Services, salted
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


# ---- the prefix cache -------------------------------------------------------------------------------

# Long enough for many full KV blocks (one token per character, blocks of 4).
LONG_PROMPT = [{"role": "user", "content": "Summarise: the tide comes in and the tide goes out. " * 3}]


def _cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    cached: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def _salts(live: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The prefix salt of every request the engine admits from now on (thread mode)."""
    engine = live.services.registry.embedded.engine  # type: ignore[union-attr]
    real = engine.add_request
    seen: list[str | None] = []

    def spy(*args: Any, **kw: Any) -> None:
        seen.append(kw.get("prefix_salt"))
        real(*args, **kw)

    monkeypatch.setattr(engine, "add_request", spy)
    return seen


def test_each_key_gets_its_own_prefix_salt(keyed: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _salts(keyed, monkeypatch)
    for key, extra in (("k-alice", {}), ("k-bob", {}), ("k-alice", {"cache_salt": "project-1"})):
        assert _chat(keyed, key, max_tokens=2, **extra).status_code == 200
    assert seen == [key_id("k-alice"), key_id("k-bob"), salted(key_id("k-alice"), "project-1")]


def test_one_key_hits_its_own_cached_prompt_and_never_another_keys(keyed: LiveGateway) -> None:
    def send(key: str, **extra: Any) -> int:
        return _cached(_chat(keyed, key, messages=LONG_PROMPT, max_tokens=4, temperature=0, **extra))

    assert send("k-alice") == 0
    assert send("k-bob") == 0  # the same prompt under another key: none of Alice's blocks
    assert send("k-alice") > 0  # Alice's own
    assert send("k-bob") > 0  # and Bob's own, now that he sent it
    # A salt partitions a key's cache further; the same salt under another key reaches nothing.
    assert send("k-alice", cache_salt="s") == 0
    assert send("k-bob", cache_salt="s") == 0
    assert send("k-alice", cache_salt="s") > 0


def _with_scope(svc: Services, mode: str, keys: list[str]) -> Services:
    embedded = svc.settings.embedded.model_copy(update={"prefix_cache_scope": mode})
    return dataclasses.replace(
        svc, settings=svc.settings.model_copy(update={"embedded": embedded}), api_keys=keys
    )


@pytest.mark.parametrize(
    ("mode", "keys", "expected"),
    [
        ("tenant", ["k"], key_id("k")),
        ("tenant", [], "addr:10.0.0.1"),  # open mode: per client address
        ("address", ["k"], "addr:10.0.0.1"),
        ("global", ["k"], ""),
        ("off", ["k"], None),
    ],
)
def test_prefix_salt_follows_the_scope_setting(
    keyed: LiveGateway, mode: str, keys: list[str], expected: str | None
) -> None:
    svc = _with_scope(keyed.services, mode, keys)
    assert svc.prefix_salt(key_id("k"), "10.0.0.1") == expected
    salt = svc.prefix_salt(key_id("k"), "10.0.0.1", "team")
    if expected is None:
        assert salt is None  # nobody shares, whatever the client asks
    else:
        assert salt == salted(expected, "team") and salt != expected
        assert salt != svc.prefix_salt(key_id("k"), "10.0.0.1", "team2")
    # The drafting cache keeps its own setting (tenant).
    assert svc.cache_scope(key_id("k"), "10.0.0.1") == (key_id("k") if keys else "addr:10.0.0.1")


def test_a_salt_cannot_spell_another_scope() -> None:
    # The salt is hashed with its scope: no client salt turns one tenant's salt into another's.
    assert salted("key-a", "x") != salted("key-b", "x")
    assert salted("key-a", "bx") != salted("key-ab", "x")
    assert salted("", "addr:1.2.3.4") != "addr:1.2.3.4"
    assert len(salted("key-a", "s" * 256)) == len(salted("key-a", "s"))
