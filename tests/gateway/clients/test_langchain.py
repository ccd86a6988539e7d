"""LangChain's `ChatOpenAI` (langchain-openai) against the gateway on the default model: invoke,
stream, structured output (json_schema and function_calling) and bound tools, on chat completions
and on the Responses API (`use_responses_api=True`). LangSmith stays off: the package's conftest
removes its environment."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.clients.shared import API_KEY, EXTRACT, MAX_TOKENS, MODEL, QUESTION, WEATHER, Person

langchain_openai: Any = pytest.importorskip("langchain_openai", reason="langchain-openai is a dev dependency")
from langchain_core.messages import AIMessage, AIMessageChunk  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
APIS = [pytest.param(False, id="chat"), pytest.param(True, id="responses")]


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


def chat(base_url: str, responses: bool, max_tokens: int = MAX_TOKENS) -> Any:
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=base_url,
        api_key=API_KEY,
        temperature=0,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=60,
        use_responses_api=responses,
    )


@pytest.mark.parametrize("responses", APIS)
def test_invoke_and_stream(base_url: str, responses: bool) -> None:
    llm = chat(base_url, responses)
    message = llm.invoke(QUESTION)
    assert isinstance(message, AIMessage) and message.text
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] > 0
    chunks = list(llm.stream(QUESTION))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == message.text  # greedy: the same answer


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
@pytest.mark.parametrize("responses", APIS)
def test_with_structured_output(base_url: str, responses: bool, method: str) -> None:
    structured = chat(base_url, responses, max_tokens=64).with_structured_output(Person, method=method)
    assert isinstance(structured.invoke(EXTRACT), Person)


@pytest.mark.parametrize("responses", APIS)
def test_bind_tools(base_url: str, responses: bool) -> None:
    """tool_choice "any" (sent as "required"): the answer is a well-formed call of the bound tool."""
    message = (
        chat(base_url, responses, max_tokens=64).bind_tools([get_weather], tool_choice="any").invoke(WEATHER)
    )
    assert isinstance(message, AIMessage) and message.tool_calls
    for call in message.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    assert get_weather.invoke(message.tool_calls[0]["args"]).startswith("It is sunny")
