"""/v1/responses in front of external backends, through the official openai client: translated to
chat for an upstream that speaks only chat (the scripted fake), proxied as-is to one that declares
`responses_api` (a small stub serving /v1/responses), stored by the gateway either way."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.fake_upstream import FakeUpstream, backend, openai_client, running_gateway
from tests.gateway.live import LiveGateway, free_port

pytestmark = pytest.mark.timeout(60)
PUBLIC, UPSTREAM = "public-model", "upstream-model"


# ---- an upstream serving the Responses API --------------------------------------------------------


class ResponsesStub:
    """GET /v1/models and POST /v1/responses (JSON, or the Responses event stream), recording bodies."""

    def __init__(self, text: str = "Hello there") -> None:
        self.text = text
        self.received: list[dict[str, Any]] = []
        self.port = free_port()
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/responses", self.responses, methods=["POST"]),
            ]
        )
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ResponsesStub:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": UPSTREAM, "object": "model"}]})

    def _response(self, body: dict[str, Any], status: str) -> dict[str, Any]:
        done = status == "completed"
        item = {
            "id": "msg_up",
            "type": "message",
            "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [{"type": "output_text", "text": self.text if done else "", "annotations": []}]
            if done
            else [],
        }
        return {
            "id": "resp_upstream_own_id",
            "object": "response",
            "created_at": 1700000000,
            "status": status,
            "model": body.get("model"),
            "output": [item] if done else [],
            "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7} if done else None,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": {},
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "reasoning": {"effort": body.get("reasoning", {}).get("effort")},
        }

    async def responses(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append(body)
        if not body.get("stream"):
            return JSONResponse(self._response(body, "completed"))
        item_at = {"item_id": "msg_up", "output_index": 0, "content_index": 0}
        words = self.text.split(" ")
        deltas = [w if i == 0 else " " + w for i, w in enumerate(words)]
        part = {"type": "output_text", "text": "", "annotations": []}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": self._response(body, "in_progress")},
            {"type": "response.in_progress", "response": self._response(body, "in_progress")},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {
                    "id": "msg_up",
                    "type": "message",
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [],
                },
            },
            {"type": "response.content_part.added", **item_at, "part": part},
            *({"type": "response.output_text.delta", **item_at, "delta": d, "logprobs": []} for d in deltas),
            {"type": "response.output_text.done", **item_at, "text": self.text, "logprobs": []},
            {"type": "response.content_part.done", **item_at, "part": {**part, "text": self.text}},
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": self._response(body, "completed")["output"][0],
            },
            {"type": "response.completed", "response": self._response(body, "completed")},
        ]

        async def stream() -> Any:
            for seq, event in enumerate(events):
                event["sequence_number"] = seq
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

        return StreamingResponse(stream(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def proxied() -> Iterator[tuple[LiveGateway, ResponsesStub]]:
    with ResponsesStub() as stub:
        settings = backend("up", stub.base_url, models={PUBLIC: UPSTREAM}, responses_api=True)
        with running_gateway(settings) as live:
            yield live, stub


@pytest.fixture(scope="module")
def translated() -> Iterator[tuple[LiveGateway, FakeUpstream]]:
    with (
        FakeUpstream(models=(UPSTREAM,)) as fake,
        running_gateway(backend("up", fake, models={PUBLIC: UPSTREAM})) as live,
    ):
        yield live, fake


# ---- translated to chat ---------------------------------------------------------------------------


def test_translated_to_chat_for_a_chat_upstream(translated: tuple[LiveGateway, FakeUpstream]) -> None:
    live, fake = translated
    fake.reset()
    client = openai_client(live)
    first = client.responses.create(
        model=PUBLIC, instructions="Be brief.", input="Hi", max_output_tokens=20, temperature=0.5, user="u1"
    )
    assert first.output_text == fake.text and first.status == "completed" and first.model == PUBLIC
    assert first.usage is not None and first.usage.input_tokens == 7
    sent = fake.posts("/chat/completions")[-1].body
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert sent["model"] == UPSTREAM and sent["max_completion_tokens"] == 20 and sent["user"] == "u1"
    assert (first.model_extra or {})["metrics"]["route"]["backend"] == "up"
    # A continuation sends the stored conversation as chat messages; the stream parses in the SDK.
    with client.responses.stream(model=PUBLIC, input="More", previous_response_id=first.id) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == fake.text and final.usage is not None and final.usage.input_tokens == 7
    sent = fake.posts("/chat/completions")[-1].body
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert sent["messages"][1]["content"] == fake.text
    assert sent["stream_options"] == {"include_usage": True}
    assert client.responses.retrieve(final.id).output_text == fake.text


def test_translated_tool_call_and_json_schema(translated: tuple[LiveGateway, FakeUpstream]) -> None:
    from tests.gateway.fake_upstream import Reply

    live, fake = translated
    fake.reset()
    call = {"id": "call_9", "type": "function", "function": {"name": "pick", "arguments": '{"n": 3}'}}
    fake.script(Reply.ok(tool_calls=[call]))
    client = openai_client(live)
    tool = {"type": "function", "name": "pick", "parameters": {"type": "object"}, "strict": True}
    r = client.responses.create(
        model=PUBLIC,
        input="Pick",
        tools=cast(Any, [tool]),
        tool_choice={"type": "function", "name": "pick"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    )
    item = r.output[0]
    assert item.type == "function_call" and item.call_id == "call_9" and item.arguments == '{"n": 3}'
    sent = fake.posts("/chat/completions")[-1].body
    assert sent["tools"] == [
        {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "pick"}}
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }


# ---- proxied to a Responses upstream --------------------------------------------------------------


def test_proxied_as_sent_and_stored(proxied: tuple[LiveGateway, ResponsesStub]) -> None:
    live, stub = proxied
    client = openai_client(live)
    first = client.responses.create(
        model=PUBLIC, input="Hi", reasoning={"effort": "low"}, metadata={"a": "b"}
    )
    assert first.id.startswith("resp_") and first.id != "resp_upstream_own_id" and first.model == PUBLIC
    assert first.output_text == stub.text and first.to_dict()["store"] is True
    sent = stub.received[-1]
    assert sent["model"] == UPSTREAM and sent["store"] is False and sent["reasoning"] == {"effort": "low"}
    assert sent["input"] == "Hi" and sent["metadata"] == {"a": "b"}
    assert client.responses.retrieve(first.id).output_text == stub.text
    # The continuation: the gateway's stored conversation goes upstream as input items.
    second = client.responses.create(model=PUBLIC, input="More", previous_response_id=first.id)
    sent = stub.received[-1]
    assert "previous_response_id" not in sent and second.previous_response_id == first.id
    assert [i.get("role") for i in sent["input"]] == ["user", "assistant", "user"]
    assert sent["input"][1]["content"][0]["text"] == stub.text


def test_proxied_stream_parses_in_the_sdk(proxied: tuple[LiveGateway, ResponsesStub]) -> None:
    live, stub = proxied
    client = openai_client(live)
    with client.responses.stream(model=PUBLIC, input="Hi") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == stub.text and final.id != "resp_upstream_own_id"
    assert (final.model_extra or {})["metrics"]["route"]["backend"] == "up"
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == stub.text and stored.usage is not None and stored.usage.output_tokens == 2
