"""POST /tokenize and /detokenize: the embedded tiny model's own (its tokenizer and chat template,
in vLLM's and llama.cpp's shapes), an external model's relayed to its backend; the key checked,
no telemetry row (as /v1/models)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import VOCAB_SIZE
from tests.gateway.fake_upstream import HTTP, FakeUpstream, backend
from tests.gateway.live import LiveGateway, start_gateway, tiny_settings, wait_for

pytestmark = pytest.mark.timeout(120)

KEY = "sk-tokenize-tests"
AUTH = {"authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeUpstream]:
    with FakeUpstream(models=("their-model",)) as fake:
        yield fake


@pytest.fixture(scope="module")
def live(tiny_llama_dir: Path, upstream: FakeUpstream) -> Iterator[LiveGateway]:
    settings = tiny_settings(
        str(tiny_llama_dir),
        api_keys=[KEY],
        log_requests=False,
        backends=[backend("ext", upstream, models={"external": "their-model"})],
    )
    gateway = start_gateway(settings)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


def post(live: LiveGateway, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    rid = f"tok-{uuid.uuid4().hex}"
    return HTTP.post(f"{live.url}{path}", json=body, headers={**AUTH, "x-request-id": rid, **(headers or {})})


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_a_prompt_round_trips(live: LiveGateway, model: str) -> None:
    text = "Hello, world!"
    got = ok(post(live, "/tokenize", {"model": model, "prompt": text}))
    # The tiny tokenizer spends one token per character.
    assert got["count"] == len(text) == len(got["tokens"])
    assert got["max_model_len"] > 0 and got["token_strs"] is None
    assert ok(post(live, "/detokenize", {"model": model, "tokens": got["tokens"]})) == {"prompt": text}
    strs = ok(post(live, "/tokenize", {"model": model, "prompt": "ab", "return_token_strs": True}))
    assert strs["token_strs"] == ["a", "b"]


def test_the_prompt_count_is_what_completions_charge(live: LiveGateway, model: str) -> None:
    text = "Count me in."
    count = ok(post(live, "/tokenize", {"model": model, "prompt": text}))["count"]
    done = ok(post(live, "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}))
    assert done["usage"]["prompt_tokens"] == count


def test_the_messages_count_is_what_chat_charges(live: LiveGateway, model: str) -> None:
    got = ok(post(live, "/tokenize", {"model": model, "messages": MESSAGES}))
    done = ok(post(live, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 1}))
    assert done["usage"]["prompt_tokens"] == got["count"]
    # The tiny template, "s:Be brief.\nu:Hello there\na:" (the tiny vocabulary has no newline),
    # ending in the generation prompt "a:".
    text = ok(post(live, "/detokenize", {"model": model, "tokens": got["tokens"]}))["prompt"]
    assert text == "s:Be brief.u:Hello therea:"
    bare = ok(post(live, "/tokenize", {"model": model, "messages": MESSAGES, "add_generation_prompt": False}))
    assert bare["count"] == got["count"] - 2


def test_llama_cpp_shapes(live: LiveGateway) -> None:
    # llama.cpp sends no model: the embedded engine's.
    got = ok(post(live, "/tokenize", {"content": "Hi!"}))
    assert list(got) == ["tokens"] and len(got["tokens"]) == 3
    pieces = ok(post(live, "/tokenize", {"content": "Hi!", "with_pieces": True}))["tokens"]
    assert [p["id"] for p in pieces] == got["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hi!"
    # Without a model the request may be either server's: the text under both names.
    assert ok(post(live, "/detokenize", {"tokens": got["tokens"]})) == {"prompt": "Hi!", "content": "Hi!"}


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/detokenize", {"tokens": [1, VOCAB_SIZE]}, "tokens", "invalid_value"),
        ("/detokenize", {"tokens": [1, 2**31 - 1]}, "tokens", "invalid_value"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens.1", "invalid_value"),
        ("/detokenize", {"tokens": [1, 2**40]}, "tokens.1", "invalid_value"),
        ("/detokenize", {"tokens": "abc"}, "tokens", "invalid_value"),
        ("/detokenize", {}, "tokens", "missing_required_parameter"),
        ("/tokenize", {"prompt": "a", "content": "b"}, None, "invalid_value"),
        ("/tokenize", {}, None, "invalid_value"),
        ("/tokenize", {"prompt": "a", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs", None),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages.0.content", "missing_required_parameter"),
        ("/tokenize", {"prompt": "x" * 1_048_577}, "prompt", "invalid_value"),
        ("/tokenize", {"model": "nobody", "prompt": "a"}, "model", "model_not_found"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(
    live: LiveGateway, path: str, body: dict[str, Any], param: str | None, code: str | None
) -> None:
    r = post(live, path, body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    if path == "/detokenize" and param == "tokens" and "tokens" in body and isinstance(body["tokens"], list):
        assert f"[0, {VOCAB_SIZE})" in error["message"]


def test_a_prompt_too_long_for_the_model_is_refused_before_tokenizing(live: LiveGateway, model: str) -> None:
    info = live.services.registry.embedded
    assert info is not None and info.model is not None
    too_long = "x" * (info.model.max_model_len * info.model.max_token_chars + 1)
    r = post(live, "/tokenize", {"model": model, "prompt": too_long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_an_external_model_is_relayed_to_its_backend(live: LiveGateway, upstream: FakeUpstream) -> None:
    upstream.reset()
    got = ok(post(live, "/tokenize", {"model": "external", "prompt": "hey", "add_special_tokens": False}))
    assert got == {"count": 3, "max_model_len": 4096, "tokens": [104, 101, 121]}  # the fake's own
    assert ok(post(live, "/detokenize", {"model": "external", "tokens": [104, 105]})) == {"prompt": "hi"}
    assert [(p.path, p.body) for p in upstream.posts()] == [
        # Below the server's root, as vLLM and llama.cpp serve them; the backend's name for the model.
        ("/tokenize", {"model": "their-model", "prompt": "hey", "add_special_tokens": False}),
        ("/detokenize", {"model": "their-model", "tokens": [104, 105]}),
    ]
    # Relayed, the embedded model's limits do not apply: the backend judges the ids.
    assert ok(post(live, "/detokenize", {"model": "external", "tokens": [VOCAB_SIZE + 10]}))["prompt"]


def test_the_key_is_checked_and_no_row_is_left(live: LiveGateway, model: str) -> None:
    before = len(live.services.recent.records)
    r = post(live, "/tokenize", {"model": model, "prompt": "a"}, {"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(live, "/detokenize", {"model": model, "tokens": [1]}, {"authorization": ""})
    assert r.status_code == 401
    ok(post(live, "/tokenize", {"model": model, "prompt": "a"}))
    ok(post(live, "/tokenize", {"model": "external", "prompt": "a"}))
    # One chat request afterwards does leave its row: the records are not merely late.
    chat = post(live, "/v1/chat/completions", {"model": model, "messages": MESSAGES, "max_tokens": 1})
    assert chat.status_code == 200
    assert wait_for(lambda: len(live.services.recent.records) > before, 10)
    new = list(live.services.recent.records)[before:]
    assert [r.endpoint for r in new] == ["chat"]
