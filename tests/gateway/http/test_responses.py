"""The Responses API (/v1/responses) on the embedded engine, through the official openai client.

The tiny model's weights are random: the tests assert what the gateway guarantees (shapes, event
order, grammars, storage and ownership), never what the model says.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema_rs
import openai
import pytest
import sqlalchemy as sa
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specgate.gateway.telemetry.tables import responses as responses_table
from tests.conftest import build_tokenizer, tiny_config_kwargs
from tests.gateway.live import TEST_ADMIN_KEY, LiveGateway, record_of, start_gateway, tiny_settings

pytestmark = pytest.mark.timeout(300)
KEY_A, KEY_B = "key-a-responses-0001", "key-b-responses-0002"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "pick",
        "description": "Pick a digit.",
        "parameters": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared tiny Llama with a 1024-token context: tools go into a system message of ~700 tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**tiny_config_kwargs(), "max_position_embeddings": 1024})
    path = tmp_path_factory.mktemp("tiny-llama-1k")
    LlamaForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir: Path) -> Iterator[LiveGateway]:
    live = start_gateway(
        tiny_settings(str(tiny_llama_dir), admin_key=TEST_ADMIN_KEY, api_keys=[KEY_A, KEY_B])
    )
    yield live
    live.stop()


def _client(live: LiveGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return _client(gateway, KEY_A)


@pytest.fixture(scope="module")
def other(gateway: LiveGateway) -> openai.OpenAI:
    return _client(gateway, KEY_B)


@pytest.fixture(scope="module")
def model_name(tiny_llama_dir: Path) -> str:
    return tiny_llama_dir.name


def post(live: LiveGateway, body: dict[str, Any], key: str = KEY_A) -> httpx.Response:
    return httpx.post(
        f"{live.url}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60
    )


def error_of(r: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = r.json()["error"]
    return body


# ---- create ---------------------------------------------------------------------------------------


def test_string_input(client: openai.OpenAI, model_name: str, gateway: LiveGateway) -> None:
    r = client.responses.create(
        model=model_name,
        input="Say hi",
        max_output_tokens=8,
        temperature=0,
        extra_headers={"x-request-id": "resp-string-1"},
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model_name
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"]
    first: Any = r.output[0]
    assert r.output_text == first.content[0].text
    assert r.usage is not None and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    extra = r.model_extra or {}
    assert extra["metrics"]["route"]["backend"] == "embedded"
    rec = record_of(gateway, "resp-string-1")  # one telemetry row, as a Responses request
    assert rec is not None and rec.endpoint == "responses" and rec.completion_tokens == 8


def test_items_and_instructions_reach_the_prompt(
    client: openai.OpenAI, model_name: str, gateway: LiveGateway
) -> None:
    """The same conversation as chat and as Responses items gives the same greedy answer."""
    chat = client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Count"},
        ],
        max_tokens=6,
        temperature=0,
    )
    r = client.responses.create(
        model=model_name,
        instructions="Be brief.",
        input=cast(
            Any,
            [
                {"role": "user", "content": "Hi"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Hello"}],
                },
                {"role": "user", "content": [{"type": "input_text", "text": "Count"}]},
            ],
        ),
        max_output_tokens=6,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Be brief."


def test_forced_tool_choice_gives_a_function_call(client: openai.OpenAI, model_name: str) -> None:
    r = client.responses.create(
        model=model_name,
        input="Pick one",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "pick"},
        max_output_tokens=120,
        temperature=0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and r.status == "completed"
    call = calls[0]
    assert call.name == "pick" and call.call_id
    jsonschema_rs.validate(TOOLS[0]["parameters"], json.loads(call.arguments))


def test_function_call_output_round_trip(client: openai.OpenAI, model_name: str) -> None:
    first = client.responses.create(
        model=model_name,
        input="Pick one",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        temperature=0,
    )
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model=model_name,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"ok": true}'}],
        tools=TOOLS,
        max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    items = client.responses.input_items.list(second.id, order="asc").data
    # The stored conversation first (the first response's input and its call), then the output.
    types = [item.type for item in items]
    assert types[0] == "message" and "function_call" in types and types[-1] == "function_call_output"
    # The same conversation sent whole, as chat, is what the model saw.
    chat = client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "user", "content": "Pick one"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": "pick", "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"ok": true}'},
        ],
        tools=cast(
            Any, [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
        ),
        max_tokens=4,
        temperature=0,
    )
    message = chat.choices[0].message
    if message.content and not message.tool_calls:
        assert second.output_text == message.content


def test_text_format_json_schema(client: openai.OpenAI, model_name: str) -> None:
    r = client.responses.create(
        model=model_name,
        input="Describe a pet as JSON.",
        text={"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}},
        max_output_tokens=80,
        temperature=0,
    )
    assert r.status == "completed"
    jsonschema_rs.validate(PET, json.loads(r.output_text))
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_text_format_json_object(client: openai.OpenAI, model_name: str) -> None:
    r = client.responses.create(
        model=model_name,
        input="JSON please",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


# ---- streaming ------------------------------------------------------------------------------------


def test_stream_event_order(client: openai.OpenAI, model_name: str) -> None:
    ref = client.responses.create(model=model_name, input="Say hi", max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(
            model=model_name, input="Say hi", max_output_tokens=10, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ref.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage is not None and final.usage.output_tokens == 10
    assert (final.model_extra or {})["metrics"]["route"]["backend"] == "embedded"


def test_stream_helper_with_a_forced_tool_call(client: openai.OpenAI, model_name: str) -> None:
    with client.responses.stream(
        model=model_name,
        input="Pick one",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "pick"},
        max_output_tokens=120,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    assert kinds[-1] == "response.completed"
    call = next(item for item in final.output if item.type == "function_call")
    jsonschema_rs.validate(TOOLS[0]["parameters"], json.loads(call.arguments))
    stored = client.responses.retrieve(final.id)  # stored before the stream's end went out
    assert stored.output[0].type == "function_call"


def test_stream_helper_parses_text_format(client: openai.OpenAI, model_name: str) -> None:
    fmt: Any = {"format": {"type": "json_schema", "name": "pet", "schema": PET, "strict": True}}
    with client.responses.stream(
        model=model_name, input="A pet", text=fmt, max_output_tokens=80, temperature=0
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    jsonschema_rs.validate(PET, json.loads(final.output_text))


# ---- stored responses -----------------------------------------------------------------------------


def test_store_get_delete_and_ownership(
    client: openai.OpenAI, other: openai.OpenAI, model_name: str, gateway: LiveGateway
) -> None:
    r = client.responses.create(
        model=model_name, input="Hi", max_output_tokens=3, temperature=0, metadata={"topic": "tests"}
    )
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"topic": "tests"}
    # Another key: not found, everywhere, as an unknown id.
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(r.id)
    with pytest.raises(openai.BadRequestError) as info:
        other.responses.create(model=model_name, input="more", previous_response_id=r.id, max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert client.responses.retrieve(r.id).id == r.id  # still there for its owner
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].id
    # Delete: gone for its owner too.
    raw = httpx.delete(f"{gateway.url}/v1/responses/{r.id}", headers={"authorization": f"Bearer {KEY_A}"})
    assert raw.status_code == 200 and raw.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    for bad in ("resp_unknown", "not-an-id", "resp_" + "x" * 300):
        r2 = httpx.get(f"{gateway.url}/v1/responses/{bad}", headers={"authorization": f"Bearer {KEY_A}"})
        assert r2.status_code == 404, bad


def test_store_false_is_not_stored(client: openai.OpenAI, model_name: str, gateway: LiveGateway) -> None:
    r = client.responses.create(model=model_name, input="Hi", max_output_tokens=2, store=False)
    assert r.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    store = gateway.services.store
    assert store is not None
    with store.engine.connect() as conn:
        found = conn.execute(
            sa.select(responses_table.c.owner).where(responses_table.c.response_id == r.id)
        ).first()
    assert found is None


def test_previous_response_continues_the_conversation(client: openai.OpenAI, model_name: str) -> None:
    first = client.responses.create(model=model_name, input="Hi", max_output_tokens=3, temperature=0)
    second = client.responses.create(
        model=model_name, input="And then?", previous_response_id=first.id, max_output_tokens=5, temperature=0
    )
    chat = client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=5,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens


# ---- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "status"),
    [
        ({"frobnicate": 1}, "frobnicate", 400),
        ({"text": {"verbosity": "low"}}, "text.verbosity", 400),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "bogus": 1}}},
            "text.format.bogus",
            400,
        ),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", 400),
        ({"reasoning": {"summary": "auto"}}, "reasoning.summary", 400),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", 400),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type", 400),
        ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, "input.0.bogus", 400),
        ({"input": [{"role": "user", "content": 5}]}, "input.0.content", 400),
        ({"input": 5}, "input", 400),
        ({"input": [{"role": "user", "content": "x"}] * 4097}, "input", 400),
        ({"previous_response_id": "nope"}, "previous_response_id", 400),
        ({"previous_response_id": "resp_doesnotexist"}, "previous_response_id", 400),
        ({"max_output_tokens": 0}, "max_output_tokens", 400),
        ({"temperature": 3}, "temperature", 400),
        ({"truncation": "auto"}, "truncation", 400),
        ({"background": True}, "background", 400),
        ({"include": ["reasoning.encrypted_content"]}, "include", 400),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", 400),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice", 400),
    ],
)
def test_refusals_name_the_parameter(
    gateway: LiveGateway, model_name: str, extra: dict[str, Any], param: str, status: int
) -> None:
    body = {"model": model_name, "input": "Hi", "max_output_tokens": 2, **extra}
    r = post(gateway, body)
    assert r.status_code == status, r.text
    assert error_of(r)["param"] == param, r.text


def test_huge_input_is_a_400_and_a_running_stream_goes_on(gateway: LiveGateway, model_name: str) -> None:
    out: dict[str, Any] = {}

    def stream() -> None:
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/responses",
            json={
                "model": model_name,
                "input": "Go",
                "max_output_tokens": 40,
                "temperature": 0,
                "stream": True,
            },
            headers={"authorization": f"Bearer {KEY_A}"},
            timeout=60,
        ) as r:
            out["text"] = "".join(r.iter_text())

    t = threading.Thread(target=stream)
    t.start()
    for body in (
        {"model": model_name, "input": [{"role": "user", "content": "x" * 1000}] * 4096},
        {
            "model": model_name,
            "input": [{"type": "function_call_output", "call_id": "c", "output": []}] * 5000,
        },
        {"model": model_name, "input": [[[[]]]]},
        {"model": model_name, "input": "x", "tools": [{"type": "function", "name": "bad name!"}]},
    ):
        r = post(gateway, body)
        assert r.status_code in (400, 413), r.text
        assert r.status_code == 413 or error_of(r)["param"] is not None
    t.join(60)
    assert "event: response.incomplete" in out["text"] or "event: response.completed" in out["text"]


def test_method_and_openapi(gateway: LiveGateway) -> None:
    r = httpx.get(f"{gateway.url}/v1/responses", headers={"authorization": f"Bearer {KEY_A}"})
    assert r.status_code == 405
    spec = httpx.get(f"{gateway.url}/openapi.json").json()
    assert "/v1/responses" in spec["paths"] and "ResponsesRequest" in spec["components"]["schemas"]
    assert "/v1/responses/{response_id}" in spec["paths"]
