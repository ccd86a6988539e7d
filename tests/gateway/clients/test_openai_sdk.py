"""The official openai SDK against the gateway on the default model, called as its users call it:
plain and streamed chat, the streaming helpers, `parse` with a pydantic model, and the Responses
API (`create`, `stream`, `parse`)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.gateway.clients.shared import (
    API_KEY,
    EXTRACT,
    MAX_TOKENS,
    MODEL,
    QUESTION,
    RECORD,
    STRUCTURED_MAX_TOKENS,
    Person,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)


def test_chat_create_and_stream(client: openai.OpenAI) -> None:
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert r.model == MODEL and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_stream_helper(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=MAX_TOKENS, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert deltas and "".join(deltas) == final.choices[0].message.content
    assert final.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("where", ["chat", "beta"])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, where: str) -> None:
    completions = client.chat.completions if where == "chat" else client.beta.chat.completions
    r = completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": EXTRACT}],
        response_format=Person,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
    )
    assert isinstance(r.choices[0].message.parsed, Person)


def test_stream_helper_with_a_pydantic_model(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": EXTRACT}],
        response_format=Person,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "content.delta" in events and "content.done" in events
    assert isinstance(final.choices[0].message.parsed, Person)


def test_parse_a_forced_tool_call(client: openai.OpenAI) -> None:
    """`pydantic_function_tool` + `parse`: the call's arguments come back parsed into the model."""
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": RECORD}],
        tools=[openai.pydantic_function_tool(Person)],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        parallel_tool_calls=False,
        max_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "Person"
    assert isinstance(call.function.parsed_arguments, Person)
    assert Person.model_validate(json.loads(call.function.arguments)) == call.function.parsed_arguments


def test_responses_create(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    assert r.status == "completed" and r.model == MODEL and r.output_text
    assert r.usage is not None and r.usage.output_tokens > 0
    again = client.responses.retrieve(r.id)  # stored, as OpenAI's (store defaults to true)
    assert again.output_text == r.output_text


def test_responses_stream(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == final.output_text


def test_responses_parse(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        model=MODEL,
        input=EXTRACT,
        text_format=Person,
        max_output_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
    )
    assert r.status == "completed" and isinstance(r.output_parsed, Person)


def test_responses_stream_with_a_pydantic_model(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=MODEL,
        input=EXTRACT,
        text_format=Person,
        max_output_tokens=STRUCTURED_MAX_TOKENS,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person)
