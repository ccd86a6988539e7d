"""Tenants do not share drafting state or cached prompts, clients cannot pick methods the operator did
not allow, and long prompts are tokenized off the event loop."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgate.gateway.backends.embedded import backend as embedded_module
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
    key_id = keyed.services.key_ids.of
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


@pytest.mark.slow
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


def test_what_the_template_renders_counts_wherever_it_sits_in_the_body(
    keyed: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tool calls' arguments, names: everything the template renders goes by the body's size, not
    by the message text alone (a big body in a tool call used to be tokenized on the loop)."""
    threads: list[str] = []
    real = embedded_module.prepare

    def spy(call, engine):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(call, engine)

    monkeypatch.setattr(embedded_module, "prepare", spy)
    args = "y" * (embedded_module.TOKENIZE_OFF_LOOP_CHARS * 4)
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    _chat(keyed, "k-alice", messages=messages, max_tokens=2)
    _chat(keyed, "k-alice", max_tokens=2)  # a small one stays on the loop
    big, small = threads
    assert small == keyed.thread.name != big  # the small one on the event loop's thread, the big one not


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing(
    keyed: LiveGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = keyed.services.registry.embedded.model  # type: ignore[union-attr]
    assert model is not None and model.max_token_chars >= 1
    calls: list[int] = []
    tok = model.tokenizer
    real = type(tok).__call__

    def counting(self, text, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(text))
        return real(self, text, *a, **kw)

    monkeypatch.setattr(type(tok), "__call__", counting)
    huge = "z" * (model.max_model_len * model.max_token_chars + 1)
    r = _chat(keyed, "k-alice", messages=[{"role": "user", "content": huge}], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []  # the tokenizer never saw it
    ids = list(range(model.max_model_len + 1))
    name = keyed.services.registry.embedded.served_name  # type: ignore[union-attr]
    body = {"model": name, "prompt": ids, "echo": True, "max_tokens": 1}
    r = httpx.post(f"{keyed.url}/v1/completions", json=body, headers={"authorization": "Bearer k-alice"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_prompt_of_millions_of_token_ids_is_refused_by_its_size(keyed: LiveGateway) -> None:
    body = b'{"model": "x", "echo": true, "prompt": [' + b",".join([b"1"] * 1_500_000) + b"]}"
    headers = {"authorization": "Bearer k-alice", "content-type": "application/json"}
    start = time.monotonic()
    r = httpx.post(f"{keyed.url}/v1/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and "at most 262144 token ids" in r.text
    assert time.monotonic() - start < 5


def test_healthz_is_not_held_up_by_a_big_request(keyed: LiveGateway) -> None:
    """The event loop stays free while a 3.7 MB request is parsed, rendered and refused."""
    args = "w" * 3_700_000
    body = {
        "model": keyed.services.registry.embedded.served_name,  # type: ignore[union-attr]
        "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }
    waits: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(timeout=10) as h:
            while not done.is_set():
                start = time.monotonic()
                h.get(f"{keyed.url}/healthz")
                waits.append(time.monotonic() - start)
                time.sleep(0.01)

    t = threading.Thread(target=probe)
    t.start()
    try:
        # At least two refusals, and enough of them that the probe has sampled the loop throughout
        # (a fast machine refuses in less time than a handful of probes take).
        sent = 0
        while sent < 2 or (len(waits) < 10 and sent < 30):
            sent += 1
            r = httpx.post(
                f"{keyed.url}/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer k-alice"},
                timeout=60,
            )
            assert r.status_code == 400
    finally:
        done.set()
        t.join(10)
    assert len(waits) >= 10
    assert max(waits) < 0.5, sorted(waits)[-5:]


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
    key_id = keyed.services.key_ids.of
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
        ("tenant", ["k"], "key:k"),  # the key's id
        ("tenant", [], "addr:10.0.0.1"),  # open mode: per client address
        ("address", ["k"], "addr:10.0.0.1"),
        ("global", ["k"], ""),
        ("off", ["k"], None),
    ],
)
def test_prefix_salt_follows_the_scope_setting(
    keyed: LiveGateway, mode: str, keys: list[str], expected: str | None
) -> None:
    key_id = keyed.services.key_ids.of
    expected = key_id(expected[4:]) if expected and expected.startswith("key:") else expected
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
